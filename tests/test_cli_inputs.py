"""Hostile and broken CLI inputs: each ends in one line on stderr ("error: ..."), exit code 2, no traceback,
and (where it can be checked before) before any model is loaded."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.main import main

REPO = Path(__file__).resolve().parents[1]
HUGE = str(2**70)  # 1180591620717411303424


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs):
    """The session's tiny pair (conftest.py), as the command line names it."""
    return str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Odd files and folders the inputs name."""
    root = tmp_path_factory.mktemp("odd")
    (root / "latin1.txt").write_bytes(b"caf\xe9 \xff\xfe def f(x):")
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_text("  \n\t\n")
    (root / "plain.txt").write_text("hello")
    (root / "a_dir").mkdir()
    (root / "empty_model").mkdir()
    os.mkfifo(root / "fifo")
    (root / "bom.txt").write_bytes(b"\xef\xbb\xbf")
    with open(root / "huge.txt", "wb") as handle:
        handle.truncate(17 << 20)  # sparse: 17 MiB of NULs without writing them
    return root


def run_cases():
    """name -> (argv after `run --target T --draft D --max-new-tokens 4`, text the line must contain).
    {tmp} is the odd-files folder."""
    return {
        "no prompt": ([], "--prompt"),
        "empty prompt": (["--prompt", ""], "prompt is empty"),
        "blank prompt": (["--prompt", " \t\n "], "prompt is empty"),
        "argv not UTF-8": (["--prompt", "abc\udcff\udcfe"], "UTF-8"),
        "prompt and prompt-file": (["--prompt", "x", "--prompt-file", "{tmp}/plain.txt"], "not allowed"),
        "prompt-file missing": (["--prompt-file", "{tmp}/nope.txt"], "nope.txt"),
        "prompt-file a folder": (["--prompt-file", "{tmp}/a_dir"], "directory"),
        "prompt-file not UTF-8": (["--prompt-file", "{tmp}/latin1.txt"], "not valid UTF-8"),
        "prompt-file empty": (["--prompt-file", "{tmp}/empty.txt"], "prompt is empty"),
        "prompt-file blank": (["--prompt-file", "{tmp}/blank.txt"], "prompt is empty"),
        "prompt-file /dev/null": (["--prompt-file", "/dev/null"], "a device"),
        "prompt-file a BOM only": (["--prompt-file", "{tmp}/bom.txt"], "prompt is empty"),
        "prompt-file too large": (["--prompt-file", "{tmp}/huge.txt"], "larger than 16 MiB"),
        "prompt-file /dev/zero": (["--prompt-file", "/dev/zero"], "a device"),
        "K zero": (["--prompt", "x", "--k", "0"], "K"),
        "K negative": (["--prompt", "x", "--k", "-1"], "K"),
        "K too large": (["--prompt", "x", "--k", "33"], "K"),
        "K huge": (["--prompt", "x", "--k", HUGE], "K"),
        "K a word": (["--prompt", "x", "--k", "four"], "four"),
        "K a fraction": (["--prompt", "x", "--k", "4.5"], "4.5"),
        "K empty": (["--prompt", "x", "--k", ""], "--k"),
        "temperature inf": (["--prompt", "x", "--temperature", "inf"], "temperature"),
        "temperature nan": (["--prompt", "x", "--temperature", "nan"], "temperature"),
        "temperature -inf": (["--prompt", "x", "--temperature", "-inf"], "temperature"),
        "temperature negative": (["--prompt", "x", "--temperature", "-1"], "temperature"),
        "temperature overflows": (["--prompt", "x", "--temperature", "1e400"], "temperature"),
        "temperature subnormal": (["--prompt", "x", "--temperature", "1e-300"], "temperature"),
        "temperature absurd": (["--prompt", "x", "--temperature", "1000"], "temperature"),
        "temperature a word": (["--prompt", "x", "--temperature", "hot"], "hot"),
        "top-p zero": (["--prompt", "x", "--temperature", "1", "--top-p", "0"], "top-p"),
        "top-p above one": (["--prompt", "x", "--top-p", "1.5"], "top-p"),
        "top-p nan": (["--prompt", "x", "--top-p", "nan"], "top-p"),
        "top-p inf": (["--prompt", "x", "--top-p", "inf"], "top-p"),
        "top-p negative": (["--prompt", "x", "--top-p", "-0.1"], "top-p"),
        "top-k negative": (["--prompt", "x", "--top-k", "-1"], "top-k"),
        "top-k huge": (["--prompt", "x", "--top-k", HUGE], "top-k"),
        "top-k a fraction": (["--prompt", "x", "--top-k", "1.5"], "1.5"),
        "seed 2**70": (["--prompt", "x", "--seed", HUGE], "seed"),
        "seed negative": (["--prompt", "x", "--seed", "-1"], "seed"),
        "seed in float notation": (["--prompt", "x", "--seed", "1e3"], "1e3"),
        "max-new-tokens zero": (["--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
        "max-new-tokens negative": (["--prompt", "x", "--max-new-tokens", "-5"], "max-new-tokens"),
        "max-new-tokens huge": (["--prompt", "x", "--max-new-tokens", HUGE], "max-new-tokens"),
        "max-new-tokens past the context": (["--prompt", "x", "--max-new-tokens", "100000"], "context"),
        "unknown method": (["--prompt", "x", "--method", "magic"], "unknown method"),
        "negative tree": (["--prompt", "x", "--method", "eagle:-1"], "eagle:-1"),
        "huge tree": (["--prompt", "x", "--method", "eagle:999"], "tree nodes"),
        "method a colon": (["--prompt", "x", "--method", ":"], "method"),
        "method not UTF-8": (["--prompt", "x", "--method", "\udcff"], "method"),
        "tree-nodes negative": (["--prompt", "x", "--method", "eagle", "--tree-nodes", "-1"], "tree nodes"),
        "two tree sizes": (["--prompt", "x", "--method", "eagle:8", "--tree-nodes", "4"], "two tree sizes"),
        "csv /dev/full": (["--prompt", "x", "--csv", "/dev/full"], "No space left"),
        "trace /dev/full": (["--prompt", "x", "--trace", "/dev/full"], "No space left"),
        "csv a folder": (["--prompt", "x", "--csv", "{tmp}/a_dir"], "directory"),
        "csv in a missing folder": (["--prompt", "x", "--csv", "{tmp}/no/dir/m.csv"], "does not exist"),
        "csv under a file": (["--prompt", "x", "--csv", "{tmp}/plain.txt/m.csv"], "m.csv"),
        "csv empty path": (["--prompt", "x", "--csv", ""], "path is empty"),
        "csv a pipe nobody reads": (["--prompt", "x", "--csv", "{tmp}/fifo"], "no process reads"),
        "csv name too long": (["--prompt", "x", "--csv", "{tmp}/" + "n" * 300], "too long"),
        "csv in /proc": (["--prompt", "x", "--csv", "/proc/version"], "/proc/version"),
        "csv and trace one file": (["--prompt", "x", "--csv", "{tmp}/same", "--trace", "{tmp}/same"],
                                   "same file"),
        "threads zero": (["--prompt", "x", "--threads", "0"], "--threads"),
        "threads negative": (["--prompt", "x", "--threads", "-2"], "--threads"),
        "threads absurd": (["--prompt", "x", "--threads", "100000"], "--threads"),
        "threads a word": (["--prompt", "x", "--threads", "many"], "many"),
        "device unknown": (["--prompt", "x", "--device", "tpu"], "tpu"),
        "dtype unknown": (["--prompt", "x", "--dtype", "int3"], "int3"),
        "target empty": (["--prompt", "x", "--target", ""], "--target"),
        "target missing": (["--prompt", "x", "--target", "{tmp}/missing_model"], "missing_model"),
        "target a file": (["--prompt", "x", "--target", "{tmp}/plain.txt"], "plain.txt"),
        "target an empty folder": (["--prompt", "x", "--target", "{tmp}/empty_model"], "empty_model"),
        "draft missing": (["--prompt", "x", "--draft", "{tmp}/missing_draft"], "missing_draft"),
        "unknown option": (["--prompt", "x", "--warp", "9"], "--warp"),
        "option without its value": (["--prompt", "x", "--k"], "--k"),
    }


def other_cases():
    """name -> (full argv, text the line must contain), for the other commands; {T} {D}: the pair."""
    lossless = ["check-lossless", "--target", "{T}", "--draft", "{D}"]
    sweep = ["bench", "k-sweep", "--target", "{T}", "--draft", "{D}"]
    methods = ["bench", "methods", "--target", "{T}"]
    return {
        "no command": ([], "no command"),
        "unknown command": (["fly"], "fly"),
        "samples too few": ([*lossless, "--samples", "5"], "--samples"),
        "samples absurd": ([*lossless, "--samples", HUGE], "--samples"),
        "sample temperature nan": ([*lossless, "--sample-temperature", "nan"], "temperature"),
        "sample top-p above one": ([*lossless, "--sample-top-p", "2"], "top-p"),
        "lossless prompt not UTF-8": ([*lossless, "--prompt", "\udce9"], "UTF-8"),
        "lossless of no method": ([*lossless, "--method", "none"], "--method none"),
        "bench unknown": (["bench", "everything"], "everything"),
        "ks words": ([*sweep, "--ks", "a,b"], "--ks"),
        "ks out of range": ([*sweep, "--ks", "0,40"], "--ks"),
        "ks empty": ([*sweep, "--ks", ","], "--ks"),
        "sweep passes zero": ([*sweep, "--passes", "0"], "--passes"),
        "sweep of no method": ([*sweep, "--method", "none"], "--method none"),
        "bench unknown method": ([*methods, "--methods", "magic"], "unknown method"),
        "bench prompts zero": ([*methods, "--prompts", "0"], "--prompts"),
        "bench repeats negative": ([*methods, "--repeats", "-1"], "--repeats"),
        "bench threads zero": ([*methods, "--threads", "0"], "--threads"),
        "runtimes unknown shape": (["bench", "runtimes", "--synthetic", "llama-99b"], "llama-99b"),
        "batch unknown shape": (["bench", "batch", "--synthetic", "llama-99b"], "llama-99b"),
        "gui threads zero": (["gui", "--threads", "0"], "--threads"),
        "train unknown stage": (["train", "--tiny", "--out", "{tmp}/train", "--stages", "magic"], "magic"),
        "train unknown device": (["train", "--device", "tpu"], "tpu"),
        "train threads zero": (["train", "--tiny", "--out", "{tmp}/train", "--threads", "0"], "--threads"),
    }


def fill(argv, pair, files):
    return [a.replace("{tmp}", str(files)).replace("{T}", pair[0]).replace("{D}", pair[1]) for a in argv]


def all_cases():
    cases = {f"run: {name}": (["run", "--target", "{T}", "--draft", "{D}", "--max-new-tokens", "4", *argv],
                              needle) for name, (argv, needle) in run_cases().items()}
    cases.update(other_cases())
    return cases


def assert_clean(name, code, err, needle):
    lines = err.strip().splitlines()
    assert code == 2, f"{name}: exit {code}, stderr {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}: {err!r}"
    assert needle in lines[0], f"{name}: {lines[0]!r} does not mention {needle!r}"
    assert "Traceback" not in err


@pytest.mark.parametrize("name", list(all_cases()))
def test_a_hostile_input_ends_in_one_line_and_exit_2(name, pair, files, capsys, monkeypatch):
    from engine.models import loading as models

    argv, needle = all_cases()[name]
    argv = fill(argv, pair, files)
    loads = []
    real_load = models.load_pair
    monkeypatch.setattr(models, "load_pair", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    code = main(argv)
    out, err = capsys.readouterr()
    assert_clean(name, code, err, needle)
    # the trace's first bytes are its first round's: /dev/full refuses them once the models are loaded
    after_loading = ("past the context", "target", "draft", "trace /dev/full")
    if not any(word in name for word in after_loading):
        assert loads == [], f"{name}: a model was loaded before the input was refused"


def test_enough_hostile_inputs_are_tried():
    assert len(all_cases()) >= 40


def test_a_file_another_run_is_writing_is_refused(pair, tmp_path, capsys):
    target = tmp_path / "busy.csv"
    target.write_text("the other run's rows\n")
    with open(tmp_path / ".busy.csv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = main(["run", "--prompt", "x", "--target", pair[0], "--draft", pair[1], "--csv", str(target)])
    out, err = capsys.readouterr()
    assert_clean("locked csv", code, err, "another run is writing it")
    assert target.read_text() == "the other run's rows\n"


def subprocess_run(*argv, stdin=None):
    return subprocess.run([sys.executable, str(REPO / "main.py"), *argv], capture_output=True, timeout=120,
                          input=stdin, cwd=REPO)


def test_argv_bytes_that_are_not_utf8_end_cleanly(pair):
    """The real entry point: bytes in argv that are not UTF-8 reach Python as lone surrogates."""
    proc = subprocess_run("run", "--prompt", b"caf\xe9 \xff", "--target", pair[0], "--draft", pair[1])
    err = proc.stderr.decode("utf-8", "replace")
    assert_clean("argv bytes", proc.returncode, err, "UTF-8")


def test_a_prompt_on_stdin_that_is_not_utf8_ends_cleanly(pair):
    proc = subprocess_run("run", "--prompt-file", "-", "--target", pair[0], stdin=b"\xff\xfe\x00bad")
    assert_clean("stdin bytes", proc.returncode, proc.stderr.decode(), "not valid UTF-8")


def test_csv_to_dev_full_ends_cleanly_in_a_subprocess(pair):
    proc = subprocess_run("run", "--prompt", "x", "--target", pair[0], "--csv", "/dev/full")
    assert_clean("/dev/full", proc.returncode, proc.stderr.decode(), "No space left on device")


def test_prompt_file_is_read_as_utf8(pair, tmp_path, capsys):
    import json

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat é", encoding="utf-8")
    code = main(["run", "--prompt-file", str(prompt), "--target", pair[0], "--draft", pair[1],
                 "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["emitted"] == 3


def test_one_line_folds_breaks_and_escapes_surrogates():
    from engine.cli.main import one_line

    assert one_line("a\n  b\r\nc\n") == "a | b | c"
    assert one_line("bad \udcff") == "bad \\udcff"


def test_third_party_warnings_are_folded_into_the_error_line(pair, capsys, monkeypatch):
    import warnings

    from engine.models import loading as models

    def noisy_load(*args, **kwargs):
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers.modeling_utils").warning("a load report\nover\nthree lines")
        warnings.warn("a library grumbles", UserWarning, stacklevel=1)
        raise models.SpecplayError("the checkpoint does not match config.json")

    monkeypatch.setattr(models, "load_pair", noisy_load)
    code = main(["run", "--prompt", "x", "--target", pair[0]])
    err = capsys.readouterr().err
    assert_clean("noisy loader", code, err, "does not match config.json")
    assert "a load report | over | three lines" in err and "a library grumbles" in err


def test_third_party_warnings_of_a_successful_run_still_show(pair, capsys, monkeypatch):
    from engine.models import loading as models

    real = models.load_pair

    def noisy_load(*args, **kwargs):
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers.modeling_utils").warning("worth knowing")
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load_pair", noisy_load)
    argv = ["run", "--prompt", "x", "--target", pair[0], "--method", "none", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert capsys.readouterr().err.strip().endswith("worth knowing")


@pytest.mark.parametrize("fields, needle", [
    ({"k": True}, "K must be an integer"),
    ({"k": 4.0}, "K must be an integer"),
    ({"seed": 2**64}, "seed"),
    ({"max_new_tokens": "128"}, "max-new-tokens must be an integer"),
    ({"ngram_n": 0}, "n-gram size"),
    ({"method": None}, "method must be a name"),
    ({"sampling": (0.8, 0, 1.0)}, "SamplingParams"),
    ({"sampling_fields": {"temperature": float("nan")}}, "temperature"),
    ({"sampling_fields": {"temperature": "0.8"}}, "temperature must be a number"),
    ({"sampling_fields": {"top_p": float("inf")}}, "top-p"),
    ({"sampling_fields": {"top_k": 2.5}}, "top-k must be an integer"),
])
def test_the_engine_api_refuses_what_the_cli_refuses(fields, needle):
    """The checks live in GenerationConfig.validate, so the GUI and library callers get them too."""
    from engine.config import GenerationConfig, SamplingParams
    from engine.errors import SpecplayError

    sampling = SamplingParams(**fields.pop("sampling_fields", {}))
    config = GenerationConfig(**{"sampling": sampling, **fields})
    with pytest.raises(SpecplayError, match=needle):
        config.validate()


def test_numpy_numbers_are_numbers():
    import numpy as np

    from engine.config import GenerationConfig, SamplingParams

    GenerationConfig(k=np.int64(4), seed=np.int32(7), sampling=SamplingParams(np.float32(0.5))).validate()


def test_bad_input_is_refused_without_importing_torch():
    """Fail fast: parsing and checking the arguments imports neither torch nor transformers."""
    code = ("import sys; from engine.cli.main import main; "
            f"rc = main(['run', '--prompt', 'x', '--seed', '{HUGE}']"
            "); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert_clean("seed 2**70", proc.returncode, proc.stderr, "seed")
