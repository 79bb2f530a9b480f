"""main.py export-heads: the heads written in a public layout load back with --heads and draft exactly as
before the export (greedy output equal to plain decoding, the same drafts and acceptance on a few prompts);
a head the layout cannot express is refused in one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_public_heads import PROMPT, decoder_with, make_eagle3, target_dir  # noqa: F401 (a fixture)

from engine.analysis.lossless import check_greedy
from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.methods import export_heads, public_heads
from engine.models.loading import load_pair, shipped_pair

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("def fib(n):\n    ", "import os\n\n\nclass Config:\n    def __init__(self", "for i in range(")


def rounds(decoder, prompt, config):
    """Every round's drafted tokens (id, parent) and accepted count: what must not change."""
    return [([(d.token_id, d.parent) for d in e.drafted], e.accepted_count, e.emitted_ids)
            for e in decoder.generate(prompt, config)]


def test_shipped_medusa_heads_round_trip_through_the_medusa1_layout(tmp_path):
    target, _ = shipped_pair()
    export_heads.export("medusa", tmp_path / "m", target)
    info = public_heads.detect(tmp_path / "m")
    assert info.layout == "Medusa-1 (FasterDecoding)"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "medusa_lm_head.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == {f"{h}.{b}.linear.{w}" for h in range(4) for b in range(2) for w in ("weight", "bias")} \
        | {f"{h}.2.weight" for h in range(4)}
    own = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False))
    exported = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False))
    exported.use_heads(str(tmp_path / "m"))
    for method in ("medusa", "medusa-fixed"):
        config = GenerationConfig(method=method, k=4, max_new_tokens=32, stop_at_eos=False)
        for prompt in PROMPTS:
            assert rounds(exported, prompt, config) == rounds(own, prompt, config), (method, prompt)
        report = check_greedy(exported, PROMPTS[0], config)
        assert report.passed, report


def test_eagle3_head_round_trips_between_speculators_and_specforge(target_dir, tmp_path):  # noqa: F811
    original = make_eagle3(tmp_path / "orig", "vllm", draft_vocab=24)
    export_heads.export("speculators", tmp_path / "spec", target_dir, heads=str(original))
    export_heads.export("specforge", tmp_path / "forge", target_dir, heads=str(tmp_path / "spec"))
    spec, forge = public_heads.detect(tmp_path / "spec"), public_heads.detect(tmp_path / "forge")
    assert spec.layout == "EAGLE-3 (speculators)" and forge.layout == "EAGLE-3 (SpecForge)"
    assert spec.taps == forge.taps == (1, 3, 4) and spec.draft_vocab == forge.draft_vocab == 24
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["transformer_layer_config"]["hidden_size"] == 32 and "eagle_config" not in cfg
    base = decoder_with(target_dir, original)
    for folder in (tmp_path / "spec", tmp_path / "forge"):
        decoder = decoder_with(target_dir, folder)
        for nodes in (0, 6):
            config = GenerationConfig(method="eagle3", k=3, tree_nodes=nodes, max_new_tokens=24,
                                      stop_at_eos=False)
            assert check_greedy(decoder, PROMPT, config).passed
            for prompt in (PROMPT, "a cat", "the mat"):
                assert rounds(decoder, prompt, config) == rounds(base, prompt, config), (folder, nodes)


def test_trained_published_head_exports_to_specforge_and_drafts_the_same(target_dir, tmp_path):  # noqa: F811
    """A head of the training variant (engine/train/eagle3.py, speculators layout) rewritten for SpecForge."""
    from transformers import AutoModelForCausalLM

    from engine.train import eagle3

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    torch.manual_seed(0)
    head = eagle3.PublishedEagle3Head.for_target(model, (1, 3, 4), inter=40)
    eagle3.save_published(head, tmp_path / "trained", dtype=torch.float32)
    export_heads.export("specforge", tmp_path / "forge", target_dir, heads=str(tmp_path / "trained"))
    config = GenerationConfig(method="eagle3", k=3, max_new_tokens=24, stop_at_eos=False)
    base, forge = decoder_with(target_dir, tmp_path / "trained"), decoder_with(target_dir, tmp_path / "forge")
    assert check_greedy(forge, PROMPT, config).passed
    assert rounds(forge, PROMPT, config) == rounds(base, PROMPT, config)


@pytest.mark.parametrize("fmt, words", [
    ("eagle", "cannot be written exactly in the SafeAILab layout"),
    ("speculators", "no EAGLE-3 head of the published architecture"),
    ("specforge", "no EAGLE-3 head of the published architecture"),
])
def test_heads_the_layout_cannot_express_are_refused_in_one_line(target_dir, tmp_path, fmt,  # noqa: F811
                                                                 words):
    """A target without a published EAGLE-3 head (the tiny one) has nothing to write as EAGLE-3."""
    with pytest.raises(SpecplayError) as caught:
        export_heads.export(fmt, tmp_path / "out", target_dir)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_shipped_eagle3_head_round_trips_through_specforge(tmp_path):
    """The shipped head (target/eagle3/, speculators) written in SpecForge's layout drafts the same rounds."""
    target, _ = shipped_pair()
    summary = export_heads.export("specforge", tmp_path / "forge", target)
    assert "forge" in summary
    assert public_heads.detect(tmp_path / "forge").method == "eagle3"
    own = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False))
    exported = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False))
    exported.use_heads(str(tmp_path / "forge"))
    config = GenerationConfig(method="eagle3", k=4, max_new_tokens=32, stop_at_eos=False)
    assert rounds(exported, PROMPTS[0], config) == rounds(own, PROMPTS[0], config)


def test_export_heads_command_refuses_in_one_line_with_status_2(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args in (["--format", "eagle", str(tmp_path / "e")], ["--format", "medusa", str(tmp_path / "full")],
                 ["--format", "bogus", str(tmp_path / "b")]):
        done = subprocess.run([sys.executable, "main.py", "export-heads", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args, done.stderr)
