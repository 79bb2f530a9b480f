"""The host side of the kernels' ABI (engine/kernels/launch_spec.py) against kernels/specplay_kernels.cu.

CPU only, no CuPy: the .cu source is parsed as text, and engine/kernels/cuda.py (it imports CuPy) is read
as a syntax tree, so that its launches are checked against the specs here too.
"""
from __future__ import annotations

import ast
import pathlib
import re
import struct

import pytest

from engine.kernels import launch_spec as ls

SOURCE = ls.SOURCE.read_text()
CUDA_PY = pathlib.Path(ls.__file__).with_name("cuda.py")


def test_every_kernel_of_the_source_has_a_spec_with_its_signature():
    parsed = ls.parse_kernels(SOURCE)
    assert sorted(parsed) == sorted(ls.SPECS)
    for name, spec in ls.SPECS.items():
        assert spec.args == parsed[name].args, name  # names, C types and order
        assert spec.templated == parsed[name].templated, name


def test_layouts_are_the_ones_the_kernels_were_launched_with():
    """The packed layouts before the specs existed, and later kernels' (Q = pointer / u64, i = int32,
    f = float32)."""
    assert {name: spec.layout for name, spec in ls.SPECS.items()} == {
        "sp_sample": "QiiQfiiiQiQQQQ", "sp_sample_probs": "QiiQQ",
        "sp_verify": "QiiiQQQQfiiiQiQQQQQQQ", "sp_wide": "QiiiQQQfiiQQQQQQQQ",
        "sp_readout": "QiifiQQQQQQQQQ",  # added later, with the round readout
        "sp_greedy_readout": "QiiiQQQQQQQQQQ"}  # and the greedy verification joined to it


def test_parse_params_normalises_restrict_and_pointer_spacing():
    args = ls.parse_params("const float * __restrict__ u, int R,long long* __restrict__ out, u64 tp")
    assert args == (ls.Arg("u", "const float*"), ls.Arg("R", "int"), ls.Arg("out", "long long*"),
                    ls.Arg("tp", "u64"))
    assert "".join(a.format for a in args) == "QiQQ"
    with pytest.raises(ValueError):
        _ = ls.Arg("x", "double").format


@pytest.mark.parametrize("name", sorted(ls.SPECS))
def test_packing_aligns_every_argument_to_its_size(name):
    spec = ls.SPECS[name]
    fmt, offsets, size = spec.packing()
    assert struct.calcsize(fmt) == size
    for ch, off in zip(spec.layout, offsets):
        assert off % (8 if ch == "Q" else 4) == 0
    assert list(offsets) == sorted(offsets) and offsets[0] == 0
    # a packed block unpacks to the same values, argument by argument
    values = {a.name: (i + 0.5 if a.format == "f" else i + 1) for i, a in enumerate(spec.args)}
    buf = struct.pack(fmt, *spec.values(values))
    for a, off in zip(spec.args, offsets):
        (got,) = struct.unpack_from("<" + a.format, buf, off)
        assert got == values[a.name], a.name


def test_values_take_every_argument_by_name_and_nothing_else():
    spec = ls.SPECS["sp_sample_probs"]
    args = {"tok_out": 5, "uniforms": 4, "V": 3, "R": 2, "probs": 1}
    assert spec.values(args) == (1, 2, 3, 4, 5)
    with pytest.raises(TypeError, match=r"missing arguments \['tok_out'\]"):
        spec.values({k: v for k, v in args.items() if k != "tok_out"})
    with pytest.raises(TypeError, match=r"unknown arguments \['tokens'\]"):
        spec.values({**args, "tokens": 6})
    one = ls.KernelSpec("k", "int n")
    assert one.values({"n": 7}) == (7,)


def test_warp_arguments_follow_the_cfg_struct():
    cfg = re.search(r"struct Cfg\s*\{([^}]*)\}", re.sub(r"//[^\n]*", "", SOURCE)).group(1)
    assert tuple(re.findall(r"(\w+)\s*;", cfg)) == ls.WARP_ARGS
    for name in ("sp_sample", "sp_verify"):
        names = ls.SPECS[name].names
        start = names.index(ls.WARP_ARGS[0])
        assert names[start:start + len(ls.WARP_ARGS)] == ls.WARP_ARGS


def test_struct_sizes_match_the_source():
    sizes = ls.parse_struct_sizes(SOURCE)
    assert {name: sizes[name] for name in ls.STRUCT_BYTES} == ls.STRUCT_BYTES


def test_constants_match_the_source():
    defines = dict(re.findall(r"^#define (SP_\w+) (.+?)\s*$", SOURCE, flags=re.MULTILINE))
    assert int(defines["SP_BLOCK"]) == ls.BLOCK  # the default; cuda.py passes -DSP_BLOCK=BLOCK anyway
    assert int(defines["SP_ITEMS"]) == ls.ITEMS
    assert defines["SP_TILE"] == "(SP_BLOCK * SP_ITEMS)" and ls.TILE == ls.BLOCK * ls.ITEMS
    assert int(defines["SP_MAX_V"]) == ls.MAX_V
    assert int(defines["SP_MAX_N"]) == ls.MAX_N
    assert int(defines["SP_READ_MAX_W"]) == ls.READ_MAX_W


@pytest.mark.parametrize("batch, n1, vocab", [(1, 1, 4096), (1, 9, 151936), (3, 17, 5000), (8, 65, 262144)])
def test_workspace_sizes_are_unchanged(batch, n1, vocab):
    """The byte counts cuda.py allocated before the sizes moved here."""
    chunks = (vocab + 4095) // 4096
    assert ls.wide_chunks(vocab) == chunks
    assert ls.wide_workspace_bytes(batch, n1, chunks) == (batch * n1 * chunks * 24 + batch * n1 * 32
                                                          + (batch + 1) * 16 + batch * chunks * 20 + 64)
    assert ls.wide_sync_words(batch) == batch + 2
    assert ls.row_stats_bytes(batch * n1) == batch * n1 * 8 * 4  # was 8 int32 per row


# ---------------------------------------------------------------------------------------- cuda.py's launches
def _launch_calls():
    """(kernel name, argument names) of every `_launch(state, name, grid, stream, **args)` call in cuda.py."""
    calls = []
    for node in ast.walk(ast.parse(CUDA_PY.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_launch"):
            continue
        kernel = node.args[1]
        first = kernel.values[0] if isinstance(kernel, ast.JoinedStr) else kernel  # f"sp_wide<{tname}>"
        names = []
        for kw in node.keywords:
            if kw.arg is None:  # **cfg: the warp settings
                assert isinstance(kw.value, ast.Name) and kw.value.id == "cfg", ast.unparse(node)
                names.extend(ls.WARP_ARGS)
            elif kw.arg != "chained":  # the launch's option, not a kernel argument
                names.append(kw.arg)
        calls.append((first.value.split("<")[0], names, node.lineno))
    return calls


def test_cuda_py_launches_name_exactly_the_spec_arguments():
    calls = _launch_calls()
    assert {name for name, _, _ in calls} == set(ls.SPECS)  # every kernel is launched somewhere
    for name, names, line in calls:
        assert len(names) == len(set(names)), f"cuda.py:{line}: an argument named twice"
        assert sorted(names) == sorted(ls.SPECS[name].names), f"cuda.py:{line}: {name}"


def test_cuda_py_has_no_positional_argument_tuples():
    tree = ast.parse(CUDA_PY.read_text())
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == "_launch"]
    # state, kernel, grid and stream positional; every kernel argument by name
    assert launches and all(len(n.args) == 4 for n in launches)
    assert not re.search(r"\b_ARGS\b", CUDA_PY.read_text())  # the old table of layout strings


def test_an_outgrown_workspace_stays_allocated():
    """A verification or sp_wide workspace replaced by a bigger one is kept: a CUDA graph captured with it
    launches its kernels with its address (freed, a graph's replays wrote into memory another tensor owned:
    an illegal address on an H200 in a sampled K sweep). On the CPU the bookkeeping is the same."""
    import gc
    import weakref

    import torch

    from engine.kernels.workspaces import Workspaces

    spaces = Workspaces(torch.device("cpu"))
    small = spaces.verify(7, rows=2, batch=1, vocab=16)
    kept = weakref.ref(small.scratch)
    bigger = spaces.verify(7, rows=9, batch=1, vocab=16)
    assert bigger is not small and bigger.rows == 9 and spaces.verify(7, 3, 1, 16) is bigger
    assert spaces.verify(8, 2, 1, 16) is not bigger  # another stream, its own
    wide_small = spaces.wide(7, batch=1, rows_per_seq=2, chunks=4)
    wide_kept = weakref.ref(wide_small.ws)
    assert spaces.wide(7, batch=1, rows_per_seq=9, chunks=4) is not wide_small
    del small, wide_small
    gc.collect()
    assert kept() is not None and wide_kept() is not None
