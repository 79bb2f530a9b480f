"""Which forward runs each model, said where a user meets it (issue 51, item 3): `run`'s summary and the
window's status name the fast path, or the transformers path and why."""
from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_gpt2, make_tiny_llama

from engine.cli.main import main

GPT2_REASON = "transformers path: model_type 'gpt2' is not on the fast path"


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
    """(Llama target on the fast path, GPT-2 draft on the transformers path), sharing the tiny tokenizer."""
    root = tmp_path_factory.mktemp("mixed")
    return make_tiny_llama(root / "target", seed=0), make_tiny_gpt2(root / "draft", seed=1)


def run(capsys, target, draft, *extra):
    code = main(["run", "--target", str(target), "--draft", str(draft), "--prompt", "the cat",
                 "--method", "draft", "--k", "2", "--max-new-tokens", "4", "--device", "cpu", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def test_run_summary_names_each_models_path_and_why(mixed_pair, capsys):
    _, err = run(capsys, *mixed_pair)
    line = next(line for line in err.splitlines() if line.startswith("path: "))
    assert line.startswith(f"path: target: fast path; draft: {GPT2_REASON}")


def test_run_json_has_the_forward_path(mixed_pair, capsys):
    out, _ = run(capsys, *mixed_pair, "--json")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["forward_path"].startswith(f"target: fast path; draft: {GPT2_REASON}")


def test_run_summary_on_two_fast_models(mixed_pair, tmp_path, capsys):
    target, _ = mixed_pair
    draft = make_tiny_llama(tmp_path / "draft", hidden=32, layers=1, seed=2)
    _, err = run(capsys, target, draft)
    assert "path: target: fast path; draft: fast path" in err.splitlines()


def test_window_status_says_which_path_and_why(qtbot, mixed_pair):
    from app.main_window import MainWindow

    window = MainWindow(device="cpu")
    window.errors = []
    window.show_error = lambda title, message: window.errors.append((title, message))
    qtbot.addWidget(window)
    window.show()
    window.start(*(str(p) for p in mixed_pair))
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)
    assert window.errors == [] and window.decoder is not None
    label = window.status_labels["models"]
    assert label.text().endswith(" · transformers path")
    assert label.toolTip().startswith(f"target: fast path; draft: {GPT2_REASON}")
    assert window.banner.isVisible() and GPT2_REASON in window.banner.label.text()
