"""The Backend protocol (engine/kernels/backend.py): the reference implements it, as does the CUDA backend.

CPU only, no CuPy: engine/kernels/cuda.py is read as a syntax tree.
"""
from __future__ import annotations

import ast
import inspect
import pathlib

import torch

import engine.kernels
from engine.kernels import reference
from engine.kernels.backend import FUNCTIONS, MEMBERS, Backend

CUDA_PY = pathlib.Path(engine.kernels.__file__).with_name("cuda.py")


def test_protocol_members_are_the_listed_ones():
    methods = {n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_")}
    declared = set(Backend.__annotations__) | methods
    assert declared == set(MEMBERS)


def test_reference_backend_satisfies_the_protocol():
    backend = engine.kernels.REFERENCE
    assert isinstance(backend, Backend)
    assert backend.name == "torch-reference"
    assert backend.compiles_kernels is False and backend.flags_nan_on_device is False
    for member in ("warm_up", "check_nan") + FUNCTIONS:
        assert callable(getattr(backend, member)), member
    for function in FUNCTIONS:
        assert getattr(backend, function) is getattr(reference, function)
    assert backend.warm_up() is None and backend.warm_up(torch.device("cpu")) is None
    assert backend.check_nan() is None and backend.check_nan(sync=False) is None


def test_vars_of_a_backend_is_the_whole_backend():
    """Callers copy a backend with one function replaced through vars() (tests/test_lossless.py)."""
    assert set(vars(engine.kernels.REFERENCE)) == set(MEMBERS)


def test_select_backend_on_the_cpu_is_the_reference():
    assert engine.kernels.select_backend(torch.device("cpu")) is engine.kernels.REFERENCE
    assert engine.kernels.select_backend("cpu") is engine.kernels.REFERENCE


def test_cuda_backend_defines_every_function_like_the_reference():
    """kernels/cuda.py: a module-level function per protocol function with the reference's parameters."""
    tree = ast.parse(CUDA_PY.read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for function in FUNCTIONS:
        assert function in defs, function
        params = [a.arg for a in defs[function].args.args]
        assert params == list(inspect.signature(getattr(reference, function)).parameters), function
    assert [a.arg for a in defs["warm_up"].args.args] == ["device"]
    assert [a.arg for a in defs["check_nan"].args.args] == ["sync"]
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert [ast.unparse(b) for b in classes["CudaBackend"].bases] == ["ModuleBackend"]
    assigned = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)]
    assert "BACKEND" in assigned
