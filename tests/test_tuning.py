"""The engine's switches (engine/tuning.py): two for diagnosis, read once into a frozen Tuning handed to the
decoders, and two for people (progress lines, tracebacks), read by the CLI. No other SPECPLAY_* variable is
read by product code: every experiment's losing arm is deleted (tag before-house-cleanup)."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from tiny_models import make_tiny_llama

from engine.kernels import REFERENCE
from engine.tuning import Tuning

REPO = Path(__file__).resolve().parents[1]
KEPT = {"SPECPLAY_PROGRESS", "SPECPLAY_DEBUG", "SPECPLAY_TORCH_TWINS", "SPECPLAY_NO_GRAPHS"}


def _switch_names(path: Path) -> set:
    """The SPECPLAY_* names in a module's string literals (what os.environ lookups would name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value.startswith("SPECPLAY_")}


def test_product_code_reads_four_switches_at_most():
    files = [REPO / "main.py", *(REPO / "engine").rglob("*.py"), *(REPO / "app").rglob("*.py"),
             *(REPO / "scripts").rglob("*.py")]
    found = set().union(*(_switch_names(f) for f in files))
    # the shell tools and the kernels' notes name no other switch either
    texts = [*(REPO / "scripts").rglob("*.sh"), *(REPO / "kernels").rglob("*.*")]
    named = {m for f in texts for m in re.findall(r"SPECPLAY_[A-Z_]+", f.read_text(errors="replace"))}
    found |= named
    assert found <= KEPT, sorted(found - KEPT)
    assert {"SPECPLAY_TORCH_TWINS", "SPECPLAY_NO_GRAPHS"} <= found  # the two diagnosis switches are wired


@pytest.mark.parametrize("environ, expected", [
    ({}, Tuning(kernels=True, graphs=True)),
    ({"SPECPLAY_TORCH_TWINS": "1"}, Tuning(kernels=False, graphs=True)),
    ({"SPECPLAY_NO_GRAPHS": "1"}, Tuning(kernels=True, graphs=False)),
    ({"SPECPLAY_TORCH_TWINS": "0", "SPECPLAY_NO_GRAPHS": "yes"}, Tuning(kernels=True, graphs=True)),
])
def test_tuning_from_the_environment(environ, expected):
    assert Tuning.from_environment(environ) == expected


def test_tuning_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tuning().kernels = False


def test_the_decoder_applies_its_tuning_to_every_runner(tmp_path, monkeypatch):
    """Twins: the reference backend and every runner (target, draft, a head loaded later) without kernels;
    no graphs: the decoder and its runners never capture."""
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.llama import LlamaRunner
    from engine.models.loading import load_pair

    twinned = []
    original = LlamaRunner.use_torch_twins
    monkeypatch.setattr(LlamaRunner, "use_torch_twins", lambda self: twinned.append(self) or original(self))
    target = make_tiny_llama(tmp_path / "t", vocab=64, hidden=32, layers=1, seed=0)
    draft = make_tiny_llama(tmp_path / "d", vocab=64, hidden=32, layers=1, seed=1)
    pair = load_pair(str(target), str(draft), device="cpu")
    default = SpeculativeDecoder(pair)
    assert default.tuning == Tuning() and not twinned
    twins = SpeculativeDecoder(pair, tuning=Tuning(kernels=False))
    assert twins.backend is REFERENCE and {id(pair.target), id(pair.draft)} <= {id(r) for r in twinned}
    assert pair.target.fused_kernels is None and pair.target.decode_kernels is None
    no_graphs = SpeculativeDecoder(pair, tuning=Tuning(graphs=False))
    no_graphs.set_cuda_graphs(True)  # asked for, refused by the tuning
    assert not no_graphs.cuda_graphs and not pair.target.use_graphs
