"""Checks on the shipped model family in assets/models (skipped until it has been trained and copied)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[1] / "assets" / "models"
pytestmark = pytest.mark.skipif(
    not (MODELS / "target").is_dir(),
    reason="assets/models/target not present yet (train with `python main.py train`)")


@pytest.fixture(scope="module")
def losses() -> dict:
    from engine.train.export import heldout_sample_losses

    return heldout_sample_losses(MODELS, "cpu")


def test_target_beats_draft_beats_unigram(losses):
    assert losses["target"] < losses["draft"] < losses["unigram_self_entropy"]
    assert losses["draft"] < 0.7 * losses["unigram_self_entropy"]


def card_table() -> dict:
    rows = re.findall(r"^\| (\S+) \| (\d+) \| ([0-9a-f]{64}) \|$", (MODELS / "README.md").read_text(), re.M)
    return {path: (int(size), sha) for path, size, sha in rows}


def test_files_match_model_card():
    from engine.train.export import sha256_file

    table = card_table()
    assert "target/model.safetensors" in table and "draft/model.safetensors" in table
    for path, (size, sha) in table.items():
        f = MODELS / path
        assert f.stat().st_size == size, path
        assert sha256_file(f) == sha, path


def test_sizes_within_budget():
    from engine.train.export import DRAFT_MAX_BYTES, SHIPPED_MAX_BYTES, TARGET_MAX_BYTES

    assert (MODELS / "target" / "model.safetensors").stat().st_size <= TARGET_MAX_BYTES
    assert (MODELS / "draft" / "model.safetensors").stat().st_size <= DRAFT_MAX_BYTES
    assert sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file()) <= SHIPPED_MAX_BYTES


def test_heads_present_and_loadable():
    from transformers import AutoConfig

    from engine.train import heads

    cfg = AutoConfig.from_pretrained(str(MODELS / "target"))
    mh = heads.load_medusa(MODELS / "target")
    assert len(mh.heads) == 4 and mh.heads[0].in_features == cfg.hidden_size
    eh = heads.load_eagle(MODELS / "target", cfg)
    assert eh.fc.in_features == 2 * cfg.hidden_size


def test_heldout_prompts():
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())["prompts"]
    man = json.loads((MODELS / "manifest.json").read_text())
    val_files = {f["path"] for f in man["files"] if f["split"] == "val"}
    assert len(prompts) >= 32
    assert all(p["file"] in val_files for p in prompts)


def test_shipped_pair_through_engine_runner():
    models = pytest.importorskip("engine.models.loading")
    if not hasattr(models, "load_runner"):
        pytest.skip("engine.models.loading has no load_runner yet")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.train import heads

    tok = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    prompt = json.loads((MODELS / "heldout_prompts.json").read_text())["prompts"][0]["text"]
    ids = torch.tensor(tok(prompt)["input_ids"])
    for name in ("target", "draft"):
        runner = models.load_runner(str(MODELS / name), device="cpu")
        out = runner.forward(ids)
        hf = AutoModelForCausalLM.from_pretrained(str(MODELS / name), dtype=torch.float32)
        ref = hf(input_ids=ids[None]).logits[0]
        assert torch.allclose(out.logits.float(), ref, atol=2e-2, rtol=2e-2), name
        assert (out.logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99, name
        f, _ = heads.target_features(hf, ids[None])
        assert torch.allclose(out.hidden.float(), f[0], atol=2e-2, rtol=2e-2), name


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
def test_shipped_pair_passes_check_lossless(capsys):
    """`check-lossless` on the shipped pair: greedy token equality and the chi-squared test of sampling."""
    from engine.cli.main import main

    code = main(["check-lossless", "--method", "draft", "--k", "4", "--max-new-tokens", "48",
                 "--samples", "400", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy: PASS" in out and out.strip().splitlines()[-1].startswith("sampling") and "PASS" in out


def test_shipped_eagle3_head_is_the_published_architecture():
    """target/eagle3/ is an EAGLE-3 head in the speculators layout with a reduced draft vocabulary (EOS among
    it); the decoder drafts with it by default, and greedy output equals plain decoding."""
    from engine.analysis.lossless import check_greedy
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.methods import public_heads
    from engine.methods.eagle3.public import PublicEagle3Head
    from engine.models.loading import load_pair

    info = public_heads.detect(str(MODELS / "target" / "eagle3"))
    assert info.method == "eagle3" and "speculators" in info.layout.lower()
    vocab = json.loads((MODELS / "target" / "config.json").read_text())["vocab_size"]
    assert info.config["draft_vocab_size"] < vocab
    decoder = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False))
    head = decoder.eagle3_head()
    assert isinstance(head, PublicEagle3Head) and 1 in head.target_ids.tolist()  # EOS draftable
    prompt = json.loads((MODELS / "heldout_prompts.json").read_text())["prompts"][0]["text"]
    report = check_greedy(decoder, prompt, GenerationConfig(method="eagle3", k=4, max_new_tokens=32))
    assert report.passed, report
