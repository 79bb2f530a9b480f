"""A hostile user's inputs (issue 53): broken traces through every reader (predict, diagnose, the window's
reader, the kept session), special and oversized files for every user-named file, broken head files, signals
at start-up and during a benchmark. Each must end clean: one line naming the problem (status 2 on the CLI,
130 for a signal), a bad kept file moved aside, never a traceback, a hang or "internal error"."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli.main import main
from engine.errors import SpecplayError
from engine.files import bounded

REPO = Path(__file__).resolve().parents[1]
NAN = float("nan")
INF = float("inf")


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def real_trace(tmp_path_factory, tiny_pair_dirs):
    """(header, rounds) of a real greedy draft-model run of the tiny pair."""
    target, draft = map(str, tiny_pair_dirs)
    path = tmp_path_factory.mktemp("hostile") / "real.jsonl"
    code = main(["run", "--prompt", "def f(x):", "--target", target, "--draft", draft, "--k", "3",
                 "--max-new-tokens", "12", "--trace", str(path), "--device", "cpu"])
    assert code == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["type"] == "header" and len(records) >= 3
    return records[0], records[1:]


def _cli(capsys, argv: list) -> tuple:
    code = main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def _one_clean_line(code: int, lines: list, expected_code: int = 2) -> None:
    assert code == expected_code, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") or expected_code == 130
    assert "internal error" not in lines[0] and "Traceback" not in lines[0]


# ------------------------------------------------------------------------------------------- broken traces
def _set(path: str, value):
    """A mutation setting a dotted field (drafted.0.depth) of the first round, or of the header (h.)."""
    def mutate(header, rounds):
        record = header if path.startswith("h.") else rounds[0]
        keys = path.removeprefix("h.").split(".")
        target = record
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
        last = keys[-1]
        if isinstance(target, list):
            target[int(last)] = value
        elif value is _DELETE:
            target.pop(last, None)
        else:
            target[last] = value
        return None
    return mutate


_DELETE = object()


def _raw(text_or_bytes):
    """A mutation replacing the whole file."""
    return lambda header, rounds: text_or_bytes


def _lines(mutate_text):
    """A mutation of the file's text (the valid trace's JSON lines)."""
    def mutate(header, rounds):
        text = "\n".join(json.dumps(r) for r in [header, *rounds]) + "\n"
        return mutate_text(text)
    return mutate


BROKEN = {
    # the header
    "generation is text": _set("h.generation", "1"),
    "generation negative": _set("h.generation", -1),
    "generation absurd": _set("h.generation", 10**20),
    "generation null": _set("h.generation", None),
    "unknown format tag": _set("h.format", "specplay-trace/9"),
    "format a number": _set("h.format", 7),
    "prompt a number": _set("h.prompt", 5),
    "prompt a list": _set("h.prompt", ["a"]),
    "settings text": _set("h.settings", "x"),
    "settings k absurd": _set("h.settings.k", 10**9),
    "settings k text": _set("h.settings.k", "4"),
    "settings unknown method": _set("h.settings.method", "bogus"),
    "settings NaN temperature": _set("h.settings.sampling.temperature", NAN),
    "settings top-p 5": _set("h.settings.sampling.top_p", 5),
    "settings seed negative": _set("h.settings.seed", -1),
    "settings n-gram size negative": _set("h.settings.ngram_n", -3),
    "settings tree nodes absurd": _set("h.settings.tree_nodes", 10**6),
    "models text": _set("h.models", "x"),
    "model name a number": _set("h.models.target", 5),
    "prompt ids text": _set("h.prompt_ids", "abc"),
    "prompt id negative": _set("h.prompt_ids", [-1]),
    "prompt id fractional": _set("h.prompt_ids", [1.5]),
    "prompt id absurd": _set("h.prompt_ids", [2**40]),
    "calibration text": _set("h.calibration.target_step_ms", "x"),
    "calibration infinite": _set("h.calibration.target_step_ms", INF),
    "calibration negative": _set("h.calibration.draft_step_ms", -1),
    "suffix memory vocab absurd": _set("h.suffix_memory", {"documents": 0, "tokens": 0, "vocab": 10**12}),
    "suffix memory text": _set("h.suffix_memory", "x"),
    # a round
    "unknown method": _set("method", "bogus"),
    "method a number": _set("method", 5),
    "method missing": _set("method", _DELETE),
    "K negative": _set("k", -1),
    "K absurd": _set("k", 10**9),
    "K text": _set("k", "4"),
    "K true": _set("k", True),
    "drafted text": _set("drafted", "x"),
    "drafted of numbers": _set("drafted", [1]),
    "drafted endless": lambda h, r: _set("drafted", r[0]["drafted"] * 2000)(h, r),
    "depth absurd": _set("drafted.0.depth", 10**9),
    "depth not the parent's + 1": _set("drafted.1.depth", 5),
    "parent after the node": _set("drafted.0.parent", 5),
    "token id negative": _set("drafted.0.token_id", -5),
    "token id missing": _set("drafted.0.token_id", _DELETE),
    "p NaN": _set("drafted.0.p", NAN),
    "p above 1": _set("drafted.0.p", 2),
    "u infinite": _set("drafted.0.u", INF),
    "accepted text": _set("drafted.0.accepted", "yes"),
    "top pair short": _set("drafted.0.top", [[1]]),
    "top text": _set("drafted.0.top", "x"),
    "accepted count past the draft": _set("accepted_count", 99),
    "accepted count negative": _set("accepted_count", -1),
    "emitted ids text": _set("emitted_ids", "x"),
    "emitted id negative": _set("emitted_ids", [-1]),
    "emitted ids too many": _set("emitted_ids", list(range(100))),
    "draft time NaN": _set("draft_ms", NAN),
    "verify time infinite": _set("verify_ms", INF),
    "overhead negative": _set("overhead_ms", -1),
    "draft time text": _set("draft_ms", "1"),
    "draft time absurd": _set("draft_ms", 1e300),
    "unknown finish": _set("finish_reason", "boom"),
    "metrics null": _set("metrics", None),
    "metrics a list": _set("metrics", []),
    "metrics count text": _set("metrics.rounds", "3"),
    "metrics rate NaN": _set("metrics.tokens_per_s", NAN),
    "metrics acceptance 5": _set("metrics.per_position_acceptance", [5]),
    "verified tokens 0": _set("verified_tokens", 0),
    "position negative": _set("position", -4),
    "next p 7": _set("next_token_p", 7),
    "record type a number": _set("type", 5),
    "round generation text": _set("generation", "1"),
    # the file
    "a JSON list": _raw("[1, 2]\n"),
    "JSON null": _raw("null\n"),
    "a JSON number": _raw("42\n"),
    "a JSON string": _raw('"text"\n'),
    "not valid UTF-8": _raw(b'{"type": "header", "prompt": "caf\xe9"}\n'),
    "binary": _raw(bytes(range(256)) * 8),
    "cut mid-record": _lines(lambda text: text[: len(text) // 2]),
    "empty": _raw(""),
    "header only": _lines(lambda text: text.splitlines()[0] + "\n"),
    "nested 100000 deep": _raw("[" * 100000 + "]" * 100000 + "\n"),
    "an integer of 5000 digits": _raw('{"k": ' + "9" * 5000 + "}\n"),
    "NUL bytes": _raw(b"\x00" * 4096),
}


def _write_broken(tmp_path, real_trace, name: str) -> Path:
    header, rounds = copy.deepcopy(real_trace)
    out = BROKEN[name](header, rounds)
    if out is None:
        out = "\n".join(json.dumps(r) for r in [header, *rounds]) + "\n"
    path = tmp_path / "broken.jsonl"
    path.write_bytes(out if isinstance(out, bytes) else out.encode("utf-8"))
    return path


def test_the_real_trace_reads_through_every_reader(real_trace, tmp_path, capsys):
    """The base of the mutations is valid: a broken one fails for its mutation alone."""
    from engine.files.trace import read_trace

    path = tmp_path / "ok.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [real_trace[0], *real_trace[1]]) + "\n")
    assert len(read_trace(path)[0].events) == len(real_trace[1])
    for command in ("predict", "diagnose"):
        assert main([command, "--trace", str(path), "--no-calibrate"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["predict", "diagnose"])
@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_trace_is_one_line_and_status_2(real_trace, tmp_path, capsys, command, name):
    path = _write_broken(tmp_path, real_trace, name)
    code, lines = _cli(capsys, [command, "--trace", str(path), "--no-calibrate"])
    _one_clean_line(code, lines)
    assert str(path) in lines[0]


@pytest.mark.parametrize("name", list(BROKEN))
def test_the_window_reader_refuses_a_broken_trace_naming_line_and_field(real_trace, tmp_path, name):
    from engine.files.trace import read_trace

    path = _write_broken(tmp_path, real_trace, name)
    with pytest.raises(SpecplayError) as caught:
        read_trace(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    if isinstance(BROKEN[name], type(_set("x", 1))) and name not in ("empty", "header only"):
        assert "line" in message or "UTF-8" in message or "no rounds" in message


@pytest.mark.parametrize("name", list(BROKEN)[::3])
def test_a_broken_kept_generation_is_set_aside_and_the_rest_restored(real_trace, tmp_path, name):
    from app import autosave

    folder = tmp_path / autosave.SESSION_DIR
    folder.mkdir()
    good = "\n".join(json.dumps(r) for r in [real_trace[0], *real_trace[1]]) + "\n"
    (folder / "000001.jsonl").write_text(good)
    broken = _write_broken(tmp_path, real_trace, name)
    shutil.move(broken, folder / "000002.jsonl")
    (folder / "000003.jsonl").write_text(good)
    runs, problem = autosave.load(folder)
    assert len(runs) == 2
    assert (folder / "000002.jsonl.unreadable").exists() and not (folder / "000002.jsonl").exists()
    assert "000002.jsonl.unreadable" in problem
    assert autosave.load(folder)[1] is None  # set aside once: the next start reads only the good ones


def test_gui_open_trace_refuses_a_broken_trace_before_the_window(real_trace, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("specplay_main_hostile", REPO / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = _write_broken(tmp_path, real_trace, "generation is text")
    code = module.main(["gui", "--open-trace", str(path)])
    lines = capsys.readouterr().err.splitlines()
    _one_clean_line(code, lines)
    assert "field generation" in lines[0]


def test_a_trace_of_another_model_is_predicted_with_its_own_costs_said_plainly(real_trace, tmp_path, capsys,
                                                                               tiny_pair_dirs):
    header, rounds = copy.deepcopy(real_trace)
    header["models"]["target"] = str(tmp_path / "some-other-model")
    path = tmp_path / "other.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *rounds]) + "\n")
    code = main(["predict", "--trace", str(path), "--json", "--target", str(tiny_pair_dirs[0]),
                 "--draft", str(tiny_pair_dirs[1]), "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0
    assert "recorded with target" in captured.err and "trace's own phase times" in captured.err
    assert json.loads(captured.out)["costs"]["source"] == "trace only"


# ------------------------------------------------------------------------------------- special files
SPECIAL = ["/dev/zero", "/dev/urandom", "fifo", "directory", "missing", "oversized"]
FILE_OPTIONS = {
    "predict --trace": lambda f: ["predict", "--trace", f, "--no-calibrate"],
    "diagnose --trace": lambda f: ["diagnose", "--trace", f, "--no-calibrate"],
    "run --prompt-file": lambda f: ["run", "--prompt-file", f],
    "run --prompts-file": lambda f: ["run", "--prompts-file", f],
    "predict --costs": lambda f: ["predict", "--trace", "{trace}", "--costs", f],
    "gui --open-trace": lambda f: ["gui", "--open-trace", f],
}


@pytest.fixture
def special_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(bounded, "FIFO_WAIT_S", 0.2)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "directory").mkdir()
    with open(tmp_path / "oversized", "wb") as handle:
        handle.truncate(300 << 20)  # sparse: larger than every limit, nothing written
    return {"/dev/zero": "/dev/zero", "/dev/urandom": "/dev/urandom", "fifo": str(tmp_path / "fifo"),
            "directory": str(tmp_path / "directory"), "missing": str(tmp_path / "missing"),
            "oversized": str(tmp_path / "oversized")}


@pytest.mark.parametrize("special", SPECIAL)
@pytest.mark.parametrize("option", list(FILE_OPTIONS))
def test_special_and_oversized_files_are_refused_in_one_line(real_trace, tmp_path, capsys, special_paths,
                                                            option, special):
    trace = tmp_path / "ok.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [real_trace[0], *real_trace[1]]) + "\n")
    argv = [arg.replace("{trace}", str(trace)) for arg in FILE_OPTIONS[option](special_paths[special])]
    if option.startswith("gui"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("specplay_main_special", REPO / "main.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        started = time.monotonic()
        code = module.main(argv)
        lines = capsys.readouterr().err.splitlines()
    else:
        started = time.monotonic()
        code, lines = _cli(capsys, argv)
    _one_clean_line(code, lines)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("content, needle", [(b"caf\xe9\n" * 10, "not valid UTF-8"), (None, "larger than")])
def test_a_suffix_corpus_that_is_binary_or_too_large_is_refused(tmp_path, content, needle):
    from engine.methods.suffix.drafter import SuffixMemory

    path = tmp_path / "corpus.txt"
    if content is None:
        with open(path, "wb") as handle:
            handle.truncate(17 << 20)
    else:
        path.write_bytes(content)
    with pytest.raises(SpecplayError, match=needle):
        SuffixMemory().load_corpus(str(path), tokenizer=None)


def test_a_suffix_corpus_cut_to_the_memory_says_so(tmp_path):
    from engine.errors import SpecplayWarning
    from engine.methods.suffix.drafter import SuffixMemory

    class Tokenizer:
        def encode(self, text, verbose=True):
            assert verbose is False  # no sequence-length warning for a corpus
            return [ord(c) % 50 for c in text]

    path = tmp_path / "corpus.txt"
    path.write_text("abcdefgh" * 100)
    with pytest.warns(SpecplayWarning, match="indexed its first 49 of 800 tokens"):
        SuffixMemory(max_tokens=100).load_corpus(str(path), Tokenizer())


# ------------------------------------------------------------------------------------------- head files
@pytest.fixture(scope="module")
def head_target(tmp_path_factory):
    from test_tree_methods import add_random_eagle3_head, add_random_eagle_head, add_random_medusa_heads
    from tiny_models import make_tiny_llama

    from engine.models.llama import LlamaRunner

    target = make_tiny_llama(tmp_path_factory.mktemp("heads") / "target", hidden=32, layers=2, seed=1)
    add_random_medusa_heads(target, 32)
    add_random_eagle_head(target, 32)
    add_random_eagle3_head(target, 32)
    return target, LlamaRunner.from_pretrained(target, dtype=torch.float32)


def _tensors(name, change):
    def mutate(folder):
        path = folder / name
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
    return mutate


def _config(name, **values):
    def mutate(folder):
        path = folder / name
        path.write_text(json.dumps(dict(json.loads(path.read_text()), **values)))
    return mutate


def _truncate(name):
    def mutate(folder):
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    return mutate


def _replace_file(name, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


EAGLE, EAGLE3, MEDUSA = "eagle", "eagle3", "medusa"
HEAD_FILES = {EAGLE: ("eagle_head.safetensors", "eagle_config.json"),
              EAGLE3: ("eagle3_head.safetensors", "eagle3_config.json"),
              MEDUSA: ("medusa_heads.safetensors", "medusa_config.json")}
BROKEN_HEADS = {
    f"{kind} {what}": (kind, mutate)
    for kind in (EAGLE, EAGLE3)
    for what, mutate in {
        "truncated": _truncate(HEAD_FILES[kind][0]),
        "head_dim 1e7": _config(HEAD_FILES[kind][1], head_dim=1e7),
        "head_dim 10^7": _config(HEAD_FILES[kind][1], head_dim=10**7),
        "3-D fc": _tensors(HEAD_FILES[kind][0], lambda t: t.update({"fc.weight": t["fc.weight"][None]})),
        "fc missing": _tensors(HEAD_FILES[kind][0], lambda t: t.pop("fc.weight")),
        "q_proj of the wrong shape": _tensors(HEAD_FILES[kind][0], lambda t: t.update(
            {"layer.self_attn.q_proj.weight": torch.zeros(7, 32)})),
        "an int fc": _tensors(HEAD_FILES[kind][0], lambda t: t.update(
            {"fc.weight": t["fc.weight"].to(torch.int32)})),
        "config not JSON": _replace_file(HEAD_FILES[kind][1], b"{oops"),
        "config a list": _replace_file(HEAD_FILES[kind][1], b"[1]"),
        "tensors not safetensors": _replace_file(HEAD_FILES[kind][0], b"\x00" * 64),
        "intermediate size absurd": _config(HEAD_FILES[kind][1], intermediate_size=10**9),
    }.items()
}
BROKEN_HEADS.update({
    "eagle3 tap layer outside the target": (EAGLE3, _config("eagle3_config.json", tap_layers=[0, 99])),
    "eagle3 tap layers text": (EAGLE3, _config("eagle3_config.json", tap_layers="all")),
    "eagle3 proj of the wrong shape": (EAGLE3, _tensors("eagle3_head.safetensors", lambda t: t.update(
        {"proj.weight": torch.zeros(32, 5)}))),
    "medusa truncated": (MEDUSA, _truncate("medusa_heads.safetensors")),
    "medusa num_heads absurd": (MEDUSA, _config("medusa_config.json", num_heads=10**6)),
    "medusa num_heads text": (MEDUSA, _config("medusa_config.json", num_heads="4")),
    "medusa 3 layers": (MEDUSA, _config("medusa_config.json", layers=3)),
    "medusa head of the wrong width": (MEDUSA, _tensors("medusa_heads.safetensors", lambda t: t.update(
        {"heads.1.bias": torch.zeros(31)}))),
    "medusa scale missing": (MEDUSA, _tensors("medusa_heads.safetensors", lambda t: t.pop(
        "heads.0.weight_scale"))),
    "medusa config not JSON": (MEDUSA, _replace_file("medusa_config.json", b"\xff\xfe")),
})


@pytest.mark.parametrize("name", list(BROKEN_HEADS))
def test_a_broken_head_file_is_one_line_naming_it(head_target, tmp_path, name):
    from engine.methods.eagle.drafter import EagleHead
    from engine.methods.eagle3.drafter import Eagle3Head
    from engine.methods.medusa.drafter import MedusaHeads

    target_dir, runner = head_target
    kind, mutate = BROKEN_HEADS[name]
    folder = tmp_path / "target"
    folder.mkdir()
    for file in ("config.json", *HEAD_FILES[kind]):
        shutil.copy(target_dir / file, folder / file)
    mutate(folder)
    loaders = {EAGLE: lambda: EagleHead.load(folder, runner), EAGLE3: lambda: Eagle3Head.load(folder, runner),
               MEDUSA: lambda: MedusaHeads.load(folder, "cpu", torch.float32)}
    with pytest.raises(SpecplayError) as caught:
        loaders[kind]()
    message = str(caught.value)
    assert "\n" not in message and str(folder) in message


def test_intact_heads_still_load(head_target):
    from engine.methods.eagle.drafter import EagleHead
    from engine.methods.eagle3.drafter import Eagle3Head
    from engine.methods.medusa.drafter import MedusaHeads

    target_dir, runner = head_target
    assert EagleHead.load(target_dir, runner).fc.shape == (32, 64)
    assert Eagle3Head.load(target_dir, runner).proj.shape == (32, 64)
    assert MedusaHeads.load(target_dir, "cpu", torch.float32).count == 4


# ---------------------------------------------------------------------------------------------- signals
def _spawn(argv: list) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPECPLAY_PROGRESS="1")  # progress lines on a pipe too
    return subprocess.Popen([sys.executable, str(REPO / "main.py"), *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("delay", [0.25, 0.6])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_start_up_is_interrupted_and_130(tiny_pair_dirs, sig, delay):
    """From the moment main.py runs (the interpreter's own start-up, before it, is Python's)."""
    target, draft = map(str, tiny_pair_dirs)
    process = _spawn(["run", "--prompt", "def f(x):", "--target", target, "--draft", draft,
                      "--max-new-tokens", "200", "--device", "cpu"])
    time.sleep(delay)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_stopped_by_a_signal_prints_the_rows_it_measured(tiny_pair_dirs, sig):
    target, draft = map(str, tiny_pair_dirs)
    process = _spawn(["bench", "k-sweep", "--method", "draft", "--ks", "1,2,3,4,5,6,7,8",
                      "--prompt", "def f(x):", "--max-new-tokens", "24", "--passes", "1", "--target", target,
                      "--draft", draft, "--device", "cpu"])
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("K = 2 done" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(sig)
    out = process.stdout.read()
    process.wait(timeout=60)
    reader.join(timeout=10)
    seen, err = "", "".join(lines)
    assert process.returncode == 130, seen + err
    assert "rows measured before it are above" in err and "Traceback" not in seen + err
    table = [line for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert 2 <= len(table) < 8, out


def test_bench_methods_keeps_complete_prompts_when_stopped():
    from engine.bench import suite

    class Decoder:
        def generate(self, prompt, config):
            return iter(())

    calls = []

    def after():
        calls.append(1)
        return len(calls) < 5  # stop during the third prompt's round of two configurations

    configs = {"none": suite.GenerationConfig(method="none"), "draft": suite.GenerationConfig()}
    kept = suite.measure_interleaved(Decoder(), ["a", "b", "c"], configs, after=after, keep_partial=True)
    assert kept is not None and all(t.generations == 2 for t in kept.values())
    assert suite.measure_interleaved(Decoder(), ["a"], configs, after=lambda: False) is None


def test_a_signal_during_the_torch_import_waits_for_its_end():
    """SIGTERM while torch (and torch.distributed's C++ start-up) imports is held, then raised through the
    process's own handler: a KeyboardInterrupt after the import, not an abort inside it."""
    script = (
        "import os, signal, sys, threading\n"
        "def interrupt(signum, frame):\n"
        "    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, interrupt)\n"
        "from engine.cli.main import torch_imports_hold_signals\n"
        "assert 'torch' not in sys.modules\n"
        "threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "try:\n"
        "    with torch_imports_hold_signals():\n"
        "        import torch.distributed\n"
        "except KeyboardInterrupt:\n"
        "    print('held', 'torch.distributed' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "held True", (done.stdout, done.stderr)
