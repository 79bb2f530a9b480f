"""Retraining the Medusa heads of an exported family (`--from-family`, `--export-medusa`), `--tiny` on the
CPU: the family's tokenizer and target are taken as they are, only the heads are trained and exported."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import SpecplayError
from engine.train import heads
from engine.train.cli import main as train_main

TAKEN = ("data", "target", "selfgen", "medusa")
NOT_RUN = ("draft", "distill", "eagle", "eagle3", "export", "eval")


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    """A tiny exported family, as `main.py train --tiny` makes it."""
    out = tmp_path_factory.mktemp("family_run")
    assert train_main(["--tiny", "--out", str(out), "--device", "cpu"]) == 0
    return out / "export"


@pytest.fixture(scope="module")
def medusa_run(family, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("medusa_run")
    assert train_main(["--tiny", "--from-family", str(family), "--out", str(out), "--device", "cpu",
                       "--medusa-steps", "25", "--medusa-budget-s", "60",
                       "--export-medusa", str(out / "heads")]) == 0
    return out


def metrics(out: Path, stage: str) -> dict:
    return json.loads((out / stage / "metrics.json").read_text())


def test_only_the_medusa_stages_run(medusa_run):
    assert all((medusa_run / s / "done.json").exists() for s in TAKEN)
    assert not any((medusa_run / s).exists() for s in NOT_RUN)
    assert metrics(medusa_run, "selfgen")["train_sequences"] > 0


def test_the_tokenizer_is_the_familys(family, medusa_run):
    from transformers import AutoTokenizer

    tok_dir = medusa_run / "data" / "tokenizer"
    assert (tok_dir / "tokenizer.json").read_text() == (family / "target" / "tokenizer.json").read_text()
    text = "def f(x):\n\treturn  x + 1\n"
    assert AutoTokenizer.from_pretrained(str(tok_dir))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(family / "target"))(text)["input_ids"]
    m = metrics(medusa_run, "data")
    assert m["from_family"] == str(family) and "bpe_bytes" not in m


def test_the_target_is_the_familys(family, medusa_run):
    mine = load_file(str(medusa_run / "target" / "model" / "model.safetensors"))
    theirs = load_file(str(family / "target" / "model.safetensors"))
    assert set(mine) == set(theirs)
    assert all(mine[k].dtype == torch.float32 and torch.equal(mine[k], theirs[k].float()) for k in mine)
    m = metrics(medusa_run, "target")
    assert m["from_family"] == str(family) and m["val_loss"] > 0 and "history" not in m


def check_the_command_lines_schedule(run: Path, stage: str, export: str, steps: int) -> None:
    """The stage ran the command line's `steps` (the tiny preset's own cap is 15) in its 60 s; the export's
    <stage>_report.json carries that schedule, the stage's final metrics and the self-made text's size."""
    m = metrics(run, stage)
    assert m["steps_done"] == steps and not m["stopped_by_time"]
    report = json.loads((run / export / f"{stage}_report.json").read_text())
    assert report[f"{stage}_sched"]["steps"] == steps and report[f"{stage}_sched"]["time_budget_s"] == 60
    assert report["stages"][stage]["final"] == m["final"]
    assert report["stages"]["selfgen"]["train_sequences"] > 0


def test_the_medusa_schedule_comes_from_the_command_line(medusa_run):
    check_the_command_lines_schedule(medusa_run, "medusa", "heads", steps=25)


def test_exported_heads_drive_the_familys_target(family, medusa_run, tmp_path):
    """The heads-only export, copied over the family's target/, is what the engine's Medusa method loads:
    fp16, with the stage's measured path accuracies; greedy decoding with it equals plain decoding."""
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.methods.medusa.drafter import MedusaHeads
    from engine.models.loading import load_pair

    out = medusa_run / "heads"
    assert sorted(f.name for f in out.iterdir()) == ["medusa_config.json", "medusa_heads.safetensors",
                                                      "medusa_report.json"]
    state = load_file(str(out / "medusa_heads.safetensors"))
    # the preset ships int8 matrices with an fp16 scale a row, fp16 biases; two blocks a head
    matrices = {f"{block}.{i}.weight" for block in ("heads", "second") for i in range(4)}
    assert set(state) == matrices | {m + "_scale" for m in matrices} | {m[:-6] + "bias" for m in matrices}
    assert all(state[m].dtype == torch.int8 and state[m + "_scale"].dtype == torch.float16 for m in matrices)
    assert all(v.dtype == torch.float16 for k, v in state.items() if k.endswith("bias"))
    trained = heads.load_medusa(medusa_run / "medusa").state_dict()
    for m in matrices:  # each row within half a quantisation step, plus the fp16 scale's rounding
        exact = trained[m].abs().amax(1) / 127
        scale = state[m + "_scale"].float()
        error = (state[m].float() * scale[:, None] - trained[m]).abs().amax(1)
        assert torch.all(error <= 0.5 * exact + 127 * (scale - exact).abs() + 1e-6), m
    shipped = heads.load_medusa(out).state_dict()
    assert all(torch.equal(shipped[m], state[m].float() * state[m + "_scale"].float()[:, None])
               for m in matrices)
    cfg = json.loads((out / "medusa_config.json").read_text())
    assert cfg["path_accuracy"] == json.loads((medusa_run / "medusa" / "medusa_config.json").read_text())[
        "path_accuracy"]
    target = tmp_path / "target"
    shutil.copytree(family / "target", target)
    for name in ("medusa_heads.safetensors", "medusa_config.json"):
        shutil.copy2(out / name, target / name)
    loaded = MedusaHeads.load(target, "cpu", torch.float32)
    assert loaded.count == 4 and loaded.path_accuracy is not None
    assert loaded.layers == 2
    assert torch.equal(loaded.weights[0],
                       state["heads.0.weight"].float() * state["heads.0.weight_scale"].float()[:, None])
    assert torch.equal(loaded.second[0][3], shipped["second.3.weight"])
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    prompt = "def f(x):\n    return"
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=24))
    events = list(decoder.generate(prompt, GenerationConfig(k=3, max_new_tokens=24).with_spec("medusa")))
    assert [t for e in events for t in e.emitted_ids] == plain


def test_a_family_the_preset_does_not_describe_is_refused(family, tmp_path):
    run = str(tmp_path / "run")
    with pytest.raises(SpecplayError, match=r"not match the 'full' preset: vocab_size 512 \(preset 8192\)"):
        train_main(["--from-family", str(family), "--out", run, "--device", "cpu"])
    with pytest.raises(SpecplayError, match="no target/config.json"):
        train_main(["--tiny", "--from-family", str(tmp_path), "--out", run, "--device", "cpu"])
    assert not (tmp_path / "run").exists()                                  # refused before any stage ran


def test_a_run_directory_trained_elsewhere_is_refused(family, tmp_path):
    """A finished tokenizer or target stage is reused as it is: one that did not come from the family is an
    error, not a silent mix."""
    run = family.parent                           # the family's own training run: its target was trained
    with pytest.raises(SpecplayError, match="not taken from"):
        train_main(["--tiny", "--from-family", str(family), "--out", str(run), "--device", "cpu"])


def test_the_card_reports_heads_retrained_alone(family, medusa_run, tmp_path):
    """engine.train.export's merge records the retrain in train_report.json (medusa_retrain) and the card's
    Medusa section shows the retrained heads' figures, with the family run's head 1 beside them."""
    from engine.train import export

    shipped = tmp_path / "family"
    shutil.copytree(family, shipped)
    report = json.loads((medusa_run / "heads" / "medusa_report.json").read_text())
    export.merge_medusa_retrain(shipped, medusa_run / "heads" / "medusa_report.json")
    merged = json.loads((shipped / "train_report.json").read_text())
    assert merged["medusa_retrain"] == report
    card = (shipped / "README.md").read_text()
    section = card.split("## Medusa heads (validation)", 1)[1].split("\n## ", 1)[0]
    assert "Retrained alone on this target" in section and "The family run's heads they replace" in section
    head1 = report["stages"]["medusa"]["final"]["head1_top1"]
    assert f"| 1 | t+2 | {export.fmt(head1)} |" in section


@pytest.fixture(scope="module")
def eagle3_run(family, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle3_run")
    assert train_main(["--tiny", "--from-family", str(family), "--out", str(out), "--device", "cpu",
                       "--stages", "tokenizer,target,selfgen,eagle3", "--eagle3-steps", "20",
                       "--eagle3-budget-s", "60", "--export-eagle3", str(out / "head")]) == 0
    return out


def test_only_the_eagle3_stages_run_on_the_command_lines_schedule(eagle3_run):
    assert all((eagle3_run / s / "done.json").exists() for s in ("data", "target", "selfgen", "eagle3"))
    assert not any((eagle3_run / s).exists() for s in ("draft", "distill", "medusa", "eagle", "export"))
    check_the_command_lines_schedule(eagle3_run, "eagle3", "head", steps=20)


def test_exported_eagle3_head_drives_the_familys_target_and_its_card(family, eagle3_run, tmp_path):
    """The head-only export, copied over the family's target/, is what the EAGLE-3 method loads (fp16, the
    stage's weights); greedy decoding with it equals plain decoding; the card's EAGLE-3 section shows it."""
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair
    from engine.train import eagle3, export

    out = eagle3_run / "head"
    assert sorted(f.name for f in out.iterdir()) == ["eagle3_config.json", "eagle3_head.safetensors",
                                                      "eagle3_report.json"]
    state = load_file(str(out / "eagle3_head.safetensors"))
    assert all(v.dtype == torch.float16 for v in state.values())
    trained = eagle3.load_eagle3(eagle3_run / "eagle3")
    assert torch.equal(state["proj.weight"], trained.proj.weight.detach().half())
    shipped = tmp_path / "family"
    shutil.copytree(family, shipped)
    for name in ("eagle3_head.safetensors", "eagle3_config.json"):
        shutil.copy2(out / name, shipped / "target" / name)
    decoder = SpeculativeDecoder(load_pair(str(shipped / "target"), None, device="cpu", need_draft=False))
    prompt = "def f(x):\n    return"
    plain = decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=24))
    events = list(decoder.generate(prompt, GenerationConfig(k=3, max_new_tokens=24).with_spec("eagle3")))
    assert [t for e in events for t in e.emitted_ids] == plain
    export.merge_retrain(shipped, out / "eagle3_report.json", "eagle3")
    merged = json.loads((shipped / "train_report.json").read_text())
    assert merged["eagle3_retrain"]["eagle3_sched"]["steps"] == 20
    section = (shipped / "README.md").read_text().split("## EAGLE-3 head", 1)[1].split("\n## ", 1)[0]
    assert "Retrained alone on this target" in section and "The family run's head it replaces" in section


def test_published_eagle3_head_with_a_reduced_draft_vocabulary(family, tmp_path):
    """--eagle3-arch published --eagle3-draft-vocab N (the full preset's recipe, on the tiny one): the
    exported head keeps the N training tokens seen most (the specials among them) and drafts losslessly."""
    from engine.analysis.lossless import check_greedy
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    out = tmp_path / "run"
    assert train_main(["--tiny", "--from-family", str(family), "--out", str(out), "--device", "cpu",
                       "--stages", "tokenizer,target,selfgen,eagle3", "--eagle3-steps", "10",
                       "--eagle3-budget-s", "60", "--eagle3-arch", "published", "--eagle3-draft-vocab", "64",
                       "--export-eagle3", str(out / "head")]) == 0
    head = out / "head"
    config = json.loads((head / "config.json").read_text())
    state = load_file(str(head / "model.safetensors"))
    assert config["draft_vocab_size"] == 64 and state["lm_head.weight"].shape[0] == 64
    kept = (torch.arange(64) + state["d2t"]).tolist()
    counts = np.bincount(np.load(out / "data" / "train.npy").astype(np.int64), minlength=512)
    target_config = json.loads((family / "target" / "config.json").read_text())
    specials = {target_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert specials <= set(kept) and kept == sorted(kept)
    others = [i for i in range(len(counts)) if i not in kept]
    assert min(counts[i] for i in kept if i not in specials) >= max(counts[i] for i in others)
    decoder = SpeculativeDecoder(load_pair(str(family / "target"), None, device="cpu", need_draft=False))
    decoder.use_heads(str(head))
    report = check_greedy(decoder, "def f(x):\n    return", GenerationConfig(method="eagle3", k=3,
                                                                           max_new_tokens=24))
    assert report.passed, report
