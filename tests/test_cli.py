"""The headless CLI: output, exports, and one clear line + exit 2 for every bad input."""
import csv
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import make_tiny_llama, make_tiny_pair

from engine.cli.main import main
from engine.core.metrics import csv_header

REPO = Path(__file__).resolve().parents[1]
PROMPT = "the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, draft = make_tiny_pair(root)
    return str(target), str(draft)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def row_value(rows, column):
    return rows[1][rows[0].index(column)]


def test_run_json_has_the_promised_fields(pair, capsys):
    target, draft = pair
    code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--draft", draft,
                             "--k", "3", "--max-new-tokens", "20", "--json")
    assert code == 0, err
    result = json.loads(out)
    for key in ("text", "method", "k", "rounds", "drafted", "accepted", "acceptance_rate",
                "mean_acceptance_length", "tokens_per_forward", "tpot_ms", "analytic_tokens_per_forward"):
        assert key in result
    assert result["method"] == "draft" and result["k"] == 3 and result["emitted"] == 20
    assert result["drafted"] == 3 * result["rounds"]
    assert result["tokens_per_forward"] == pytest.approx(20 / result["rounds"])


def test_run_writes_csv_and_trace(pair, capsys, tmp_path):
    target, draft = pair
    csv_path, trace_path = tmp_path / "m.csv", tmp_path / "t.jsonl"
    code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--draft", draft,
                             "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
                             "--max-new-tokens", "16",
                             "--csv", str(csv_path), "--trace", str(trace_path))
    assert code == 0, err
    assert "acceptance rate" in err and out.strip()
    rows = list(csv.reader(csv_path.open()))
    assert rows[0] == csv_header()
    assert "draft_ms [ms]" in rows[0] and "running_tokens_per_s [tokens/s]" in rows[0]
    records = [json.loads(line) for line in trace_path.read_text().splitlines()]
    header, trace = records[0], records[1:]
    assert header["type"] == "header" and header["prompt"] == PROMPT and header["spec"] == "draft"
    assert header["settings"]["sampling"]["top_p"] == 0.9 and header["settings"]["seed"] == 3
    assert header["models"] == {"target": target, "draft": draft} and header["device"] == "CPU"
    from transformers import AutoTokenizer
    assert header["prompt_ids"] == AutoTokenizer.from_pretrained(target).encode(PROMPT)
    assert all(r["type"] == "round" for r in trace)
    assert len(rows) - 1 == len(trace) >= 1
    assert sum(len(e["emitted_ids"]) for e in trace) == 16
    header = rows[0]
    assert row_value(rows, "top_p") == "0.9" and row_value(rows, "k [tokens]") == "4"
    assert row_value(rows, "target") == target and rows[-1][header.index("finish_reason")] == "length"
    for row, event in zip(rows[1:], trace):
        assert int(row[header.index("accepted [tokens]")]) == event["accepted_count"]
        assert int(row[header.index("round")]) == event["round"] + 1  # rounds count from 1 in the CSV
    assert {"drafted", "draft_ms", "verify_ms", "overhead_ms", "metrics", "next_token_id"} <= set(trace[0])


def test_ngram_and_none_methods_run(pair, capsys):
    target, _ = pair
    for method in ("none", "ngram"):
        code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--method", method,
                                 "--max-new-tokens", "12", "--json")
        assert code == 0, err
        assert json.loads(out)["method"] == method


def test_check_lossless_passes(pair, capsys):
    target, draft = pair
    code, out, err = run_cli(capsys, "check-lossless", "--target", target, "--draft", draft, "--k", "3",
                             "--max-new-tokens", "24", "--samples", "300")
    assert code == 0, out + err
    assert "greedy: PASS" in out and "sampling" in out and "PASS" in out.splitlines()[-1]


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory):
    from test_tree_methods import add_random_eagle_head

    target = make_tiny_llama(tmp_path_factory.mktemp("eagle") / "target", hidden=64, layers=2, seed=0)
    add_random_eagle_head(target, 64)
    return str(target)


def test_check_lossless_of_a_tree_method_runs_its_plain_reference_without_the_tree(eagle_target, capsys):
    """eagle:8 drafts a tree; the plain run it is compared with takes no tree size (issue 52, item 2)."""
    code, out, err = run_cli(capsys, "check-lossless", "--target", eagle_target, "--method", "eagle:8",
                             "--k", "3", "--max-new-tokens", "16", "--samples", "100")
    assert code == 0, out + err
    assert "greedy: PASS (16 generated" in out and "method=eagle:8" in out


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    root = tmp_path_factory.mktemp("mismatch")
    return str(make_tiny_llama(root / "a", vocab=96)), str(make_tiny_llama(root / "b", vocab=64))


def bad_inputs(pair, mismatched, tmp_path):
    target, draft = pair
    models = ["--target", target, "--draft", draft]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    return {
        "empty prompt": (["run", "--prompt", "  ", *models], "prompt"),
        "K too small": (["run", "--prompt", "x", "--k", "0", *models], "K"),
        "K too large": (["run", "--prompt", "x", "--k", "33", *models], "K"),
        "unknown method": (["run", "--prompt", "x", "--method", "magic", *models], "method"),
        "missing dir": (["run", "--prompt", "x", "--target", str(tmp_path / "nope"), "--draft", draft],
                        "nope"),
        "not a model": (["run", "--prompt", "x", "--target", str(not_a_model), "--draft", draft], "empty"),
        "corrupt config": (["run", "--prompt", "x", "--target", str(corrupt), "--draft", draft], "corrupt"),
        "mismatched tokenizers": (["run", "--prompt", "x", "--target", mismatched[0],
                                   "--draft", mismatched[1]], "/a"),
        "negative temperature": (["run", "--prompt", "x", "--temperature", "-1", *models], "temperature"),
        "top-p zero": (["run", "--prompt", "x", "--temperature", "1", "--top-p", "0", *models], "top-p"),
        "top-p above one": (["run", "--prompt", "x", "--top-p", "1.5", *models], "top-p"),
        "max-new-tokens zero": (["run", "--prompt", "x", "--max-new-tokens", "0", *models], "max-new-tokens"),
        "unwritable csv": (["run", "--prompt", "x", "--csv", str(tmp_path / "no" / "dir" / "m.csv"), *models],
                           "m.csv"),
        "not a number": (["run", "--prompt", "x", "--k", "four", *models], "four"),
    }


def test_bad_inputs_give_one_line_and_exit_2(pair, mismatched, capsys, tmp_path):
    for name, (argv, needle) in bad_inputs(pair, mismatched, tmp_path).items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, f"{name}: exit {code}, stderr {err!r}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}: {err!r}"
        assert needle in lines[0], f"{name}: {lines[0]!r} does not mention {needle!r}"
        assert "Traceback" not in err


def test_cuda_without_gpu_is_a_clear_error(pair, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = run_cli(capsys, "run", "--prompt", "x", "--target", pair[0], "--device", "cuda")
    assert code == 2 and "cuda" in err.lower() and len(err.strip().splitlines()) == 1


def test_subprocess_bad_input_exit_code(pair):
    """The real entry point: exit status 2 and no traceback."""
    proc = subprocess.run([sys.executable, str(REPO / "main.py"), "run", "--prompt", "x", "--k", "99",
                           "--target", pair[0]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


def test_bench_methods_and_k_sweep(pair, capsys):
    target, draft = pair
    code, out, err = run_cli(capsys, "bench", "methods", "--target", target, "--draft", draft,
                             "--prompt", PROMPT,
                             "--max-new-tokens", "12", "--methods", "none,draft,ngram")
    assert code == 0, err
    lines = out.splitlines()
    assert "speedup" in lines[1]
    methods = [line.split("|")[0].strip() for line in lines[3:]]
    assert "α = accepted drafted tokens / drafted tokens" in err
    assert len(lines[1]) == len(lines[2])  # the header as wide as the rule: aligned
    assert methods == ["none", "draft", "ngram"]
    none_row = lines[3].split("|")
    assert float(none_row[-1]) == pytest.approx(1.0)
    assert none_row[1].strip() == "-" and none_row[2].strip() == "-"  # plain decoding: no K, no α
    assert "tokens_per_s [tok/s]" in lines[1] and "speedup [x]" in lines[1]
    code, out, err = run_cli(capsys, "bench", "k-sweep", "--target", target, "--draft", draft,
                             "--prompt", PROMPT,
                             "--max-new-tokens", "12", "--ks", "1,2")
    assert code == 0, err
    assert "fastest measured K" in err and "predicted_speedup" in out
    code, out, err = run_cli(capsys, "bench", "k-sweep", "--target", target, "--ks", "0,40")
    assert code == 2 and "--ks" in err


class RecordingDecoder:
    """Stands in for a decoder in bench_k_sweep: records each generation's K; `device` says where it runs."""

    def __init__(self, device: str):
        import torch

        self.device = torch.device(device)
        self.runs = []

    def calibrate(self, k, sampling=None):
        from engine.core.decoder import Calibration

        return Calibration(target_step_ms=2.0, draft_step_ms=0.5)

    def generate(self, prompt, config, should_stop=None):
        from engine.core.metrics import MetricsAccumulator

        k = config.drafts
        self.runs.append(k)
        metrics = MetricsAccumulator(k).add_round(k, k, k + 1, k, 0.25, 0.5, 0.25)
        yield SimpleNamespace(metrics=metrics, round_ms=1.0)


@pytest.mark.parametrize("device, warmed", [("cuda", True), ("cpu", False)])
def test_k_sweep_warms_up_each_k_where_graphs_are_captured(device, warmed):
    """On CUDA a K's first run captures graphs for its block sizes, which must not be timed."""
    from engine.bench.suite import bench_k_sweep
    from engine.config import GenerationConfig

    decoder = RecordingDecoder(device)
    rows = bench_k_sweep(decoder, ["p1", "p2"], GenerationConfig(method="draft", k=4), (1, 3))
    assert [row["k"] for row in rows] == [1, 3]
    def timed(k):  # each prompt decoded plainly, then at K
        return [0, k, 0, k]

    expected = [4] + [run for k in (1, 3) for run in ([k] if warmed else []) + timed(k)]
    # warm-up, then each K (its warm-up first on CUDA) paired with plain runs of the same prompts
    assert decoder.runs == expected


def test_bench_methods_times_the_methods_round_robin():
    """After one warm-up each, the timed runs go prompt by prompt, every method in turn, so that a slow
    stretch of the machine slows them alike (plain decoding timed alone in one once doubled every speedup)."""
    from engine.bench.suite import bench_methods
    from engine.config import GenerationConfig

    decoder = RecordingDecoder("cpu")
    decoder.method_availability = lambda: {"draft": None, "ngram": None}
    rows = bench_methods(decoder, ["p1", "p2"], GenerationConfig(method="draft", k=3), ["draft", "ngram"])
    assert [row["method"] for row in rows] == ["none", "draft", "ngram"]
    assert decoder.runs == [0, 3, 3] + [0, 3, 3] * 2  # warm-ups, then p1's three runs, then p2's


def test_bench_graphs_needs_a_gpu(pair, capsys):
    code, out, err = run_cli(capsys, "bench", "graphs", "--target", pair[0], "--prompt", PROMPT,
                             "--max-new-tokens", "4", "--methods", "none", "--device", "cpu")
    assert code == 2 and "CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_heldout_prompts_are_real_code_prompts():
    from engine.bench.suite import heldout_prompts

    prompts = heldout_prompts(8)
    assert len(prompts) == 8 and all(isinstance(p, str) and len(p) >= 50 for p in prompts)


def load_main_py():
    """The top-level main.py as a module (it is a script, not part of a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specplay_main", REPO / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gui_without_a_display_is_a_clear_error(capsys, monkeypatch):
    import sys as _sys

    if not _sys.platform.startswith("linux"):
        pytest.skip("display detection is for Linux")
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    entry = load_main_py()
    for argv in ([], ["gui"], ["--device", "cpu"]):
        code = entry.main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and "no display" in err and len(err.strip().splitlines()) == 1, argv


def test_main_py_chooses_the_gui_only_without_a_command(monkeypatch):
    entry = load_main_py()
    launched = []
    monkeypatch.setattr(entry, "launch_gui", lambda args: launched.append(args.target) or 0)
    assert entry.main(["--target", "somewhere"]) == 0 and launched == ["somewhere"]
    assert entry.wants_gui([]) and entry.wants_gui(["--target", "x"])
    assert not entry.wants_gui(["run", "--prompt", "x"]) and not entry.wants_gui(["--help"])


def test_the_engine_cli_alone_starts_no_gui(capsys):
    """engine.cli.main never imports the app: without main.py's launcher `gui` is a clear error."""
    code, out, err = run_cli(capsys, "gui")
    assert code == 2 and "main.py" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys)
    assert code == 2 and "no command" in err


def parse_config(*argv):
    from engine.cli.main import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(["run", "--prompt", "x", *argv]))


def test_method_takes_a_spec_with_a_tree_size():
    config = parse_config("--method", "eagle:8")
    assert (config.method, config.tree_nodes) == ("eagle", 8)
    assert parse_config("--method", "eagle:8", "--tree-nodes", "8").tree_nodes == 8
    assert parse_config("--method", "medusa", "--tree-nodes", "16").tree_nodes == 16
    assert parse_config("--method", "eagle").tree_nodes == 0


@pytest.mark.parametrize("argv, needle", [
    (["--method", "eagle:8", "--tree-nodes", "4"], "--tree-nodes 4"),
    (["--method", "draft:3"], "chain"),
    (["--method", "eagle:x"], "NAME:TREE_NODES"),
    (["--method", "draft", "--tree-nodes", "3"], "chain"),
    (["--method", "wizard"], "unknown method"),
])
def test_bad_method_specs_give_one_line(capsys, argv, needle):
    code, out, err = run_cli(capsys, "run", "--prompt", "x", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_method_help_lists_the_registry(capsys):
    from engine.methods import registry as methods

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert " | ".join(methods.NAMES) in out


class FakeBackend:
    def __init__(self, compiles):
        self.compiles_kernels = compiles
        self.warmed = 0

    def warm_up(self):
        self.warmed += 1


@pytest.mark.parametrize("names, need_draft", [(("draft",), True), (("none", "ngram", "eagle"), False),
                                               (("none", "draft"), True)])
@pytest.mark.parametrize("compiles", [True, False])
def test_load_decoder_asks_the_registry_and_warms_up(monkeypatch, capsys, names, need_draft, compiles):
    monkeypatch.setenv("SPECPLAY_PROGRESS", "1")  # the lines a terminal shows
    from engine.cli import main as cli
    from engine.core import decoder
    from engine.models import loading as models

    asked = []
    backend = FakeBackend(compiles)
    monkeypatch.setattr(models, "resolve_device", lambda device: "cpu")
    monkeypatch.setattr(models, "load_pair", lambda *a, need_draft, **kw: asked.append(need_draft))
    monkeypatch.setattr(decoder, "SpeculativeDecoder",
                        lambda pair: SimpleNamespace(backend=backend, set_cuda_graphs=lambda on: None,
                                                     warm_up=backend.warm_up))
    args = cli.build_parser().parse_args(["run", "--prompt", "x"])
    assert cli.load_decoder(args, *names).backend is backend
    assert asked == [need_draft]
    assert backend.warmed == 1  # the decoder's warm-up (kernels, prefill buckets) runs whatever the backend
    assert ("compiling CUDA kernels" in capsys.readouterr().err) == compiles


def test_bench_methods_takes_specs(pair, capsys):
    target = pair[0]
    code, out, err = run_cli(capsys, "bench", "methods", "--target", target, "--prompt", PROMPT,
                             "--max-new-tokens", "6", "--methods", "ngram,lookahead:5")
    assert code == 0, err
    assert [line.split("|")[0].strip() for line in out.splitlines()[3:]] == ["none", "ngram", "lookahead:5"]
    code, out, err = run_cli(capsys, "bench", "methods", "--target", target, "--methods", "magic")
    assert code == 2 and "unknown method" in err


def test_bench_methods_all_runs_every_menu_method_the_pair_can(pair, capsys):
    """--methods all: the Method menu's methods in its order, those the pair cannot run named on stderr with
    the reason (no heads here; no draft model without --draft), and the fastest one named."""
    from engine.methods import registry as methods

    target, draft = pair
    for extra, without in ((["--draft", draft], set()), ([], {"draft"})):
        code, out, err = run_cli(capsys, "bench", "methods", "--target", target, *extra, "--prompt", PROMPT,
                                 "--max-new-tokens", "6", "--methods", "all")
        assert code == 0, err
        measured = [line.split("|")[0].strip() for line in out.splitlines()[3:]]
        headless = {"medusa", "medusa-fixed", "eagle", "eagle:8", "eagle3", "eagle3:8"} | without
        assert measured == [s for s in methods.MENU_SPECS if s not in headless]
        for spec in headless:
            assert f"left out {spec}: " in err
        assert "no draft model loaded" in err if without else "left out draft" not in err
        assert "fastest measured method: " in err


@pytest.fixture
def shown_progress(monkeypatch):
    """Progress lines as a terminal shows them (pytest's stderr is no terminal)."""
    monkeypatch.setenv("SPECPLAY_PROGRESS", "1")


def test_run_reports_progress_and_keeps_the_summary_on_its_own_lines(pair, capsys, shown_progress):
    target, draft = pair
    code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--draft", draft,
                             "--max-new-tokens", "9")
    assert code == 0, err
    assert out.endswith("\n")  # the generated text ends its line even when the model did not
    lines = err.splitlines()
    assert lines[0].startswith("loading ") and lines[1].startswith("generating 9 tokens with Draft model")
    assert "rounds that drafted" in err and "left out of α" in err  # what α counts


def test_plain_decoding_summary_has_no_k_and_no_alpha(pair, capsys):
    target, _ = pair
    code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--method", "none",
                             "--max-new-tokens", "6")
    assert code == 0, err
    summary = err.split("-" * 60)[-1]
    assert "method=none" in summary and "K=" not in summary and "α" not in summary
    assert "tokens/s" in summary


def test_check_lossless_counts_seeds_on_stderr(pair, capsys, shown_progress):
    target, draft = pair
    code, out, err = run_cli(capsys, "check-lossless", "--target", target, "--draft", draft, "--k", "2",
                             "--max-new-tokens", "8", "--samples", "20")
    assert "greedy: comparing 8 tokens" in err
    assert "sampling (chi-squared): 20 of 20 seeds" in err and "sampling (chi-squared): 2 of 20 seeds" in err


def test_help_shows_defaults_and_a_line_per_option(capsys):
    for command in ("run", "check-lossless", "bench", "gui"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        options = [line.split()[0] for line in out.splitlines() if line.startswith("  -")]
        assert options, command
        parser_help = " ".join(out.split())
        for option in ("--max-new-tokens", "--k", "--seed", "--top-p"):
            if command != "gui":
                assert f"{option} " in parser_help, (command, option)
        assert "(default: auto)" in parser_help  # --device
        if command == "run":
            assert "(default: 128)" in parser_help and "(default: draft)" in parser_help
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in ("methods", "k-sweep", "graphs", "kernels"):
        assert f"{name} " in out
    assert "k-sweep: the K values to measure" in out and "methods, graphs: comma-separated" in out


def test_every_option_has_help():
    import argparse

    from engine.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("gui", "run", "check-lossless", "bench"):
        for action in subparsers.choices[name]._actions:
            assert action.help, (name, action.dest)


def test_gui_takes_open_trace(monkeypatch):
    entry = load_main_py()
    launched = []
    monkeypatch.setattr(entry, "launch_gui", lambda args: launched.append(args.open_trace) or 0)
    assert entry.main(["gui", "--open-trace", "run.jsonl"]) == 0 and launched == ["run.jsonl"]
    assert entry.main(["--open-trace", "other.jsonl"]) == 0 and launched[-1] == "other.jsonl"


def test_a_cli_trace_reads_back_into_the_same_events(pair, capsys, tmp_path):
    from dataclasses import asdict

    from engine.files.trace import read_trace

    target, draft = pair
    path = tmp_path / "t.jsonl"
    code, out, err = run_cli(capsys, "run", "--prompt", PROMPT, "--target", target, "--draft", draft,
                             "--temperature", "0.9", "--max-new-tokens", "10", "--trace", str(path))
    assert code == 0, err
    (run,) = read_trace(path)
    assert run.prompt == PROMPT and run.config.sampling.temperature == 0.9 and run.finish == "length"
    assert run.config.method == "draft" and run.config.max_new_tokens == 10
    records = [json.loads(line) for line in path.read_text().splitlines()][1:]
    for event, record in zip(run.events, records, strict=True):
        again = {"type": "round", "generation": 1, **asdict(event)}
        assert json.loads(json.dumps(again)) == record


def test_a_sweep_whose_plain_runs_drift_is_flagged():
    """engine.bench.suite.sweep_steadiness: silent on a steady sweep; a warning naming the spread when the
    plain
    runs paired with the Ks, or calibration's plain round, are more than 10% apart."""
    from engine.bench.suite import sweep_steadiness

    def rows(plain, calibrated_ms):
        return [{"k": k, "plain_tokens_per_s": p, "calibrated_plain_ms": calibrated_ms}
                for k, p in zip((1, 2, 4), plain)]

    assert sweep_steadiness(rows([3000, 3100, 2950], 1000 / 3050)) is None
    drifted = sweep_steadiness(rows([3000, 2000, 3050], 1000 / 3000))
    assert drifted and "2000 to 3050 tokens/s" in drifted and "52% apart" in drifted
    off = sweep_steadiness(rows([3000, 3020, 2990], 1000 / 2400))
    assert off and "calibration timed 2400 tokens/s against 3000" in off
    assert sweep_steadiness([{"k": 1, "speedup": 1.0}]) is None  # rows without paired plain runs


def test_a_sweep_is_swept_again_while_the_machine_drifts(monkeypatch):
    """engine.bench.suite.steadiest_k_sweep: a steady first sweep is the only one; an unsteady one is swept
    again,
    up to `passes` sweeps, and the complete sweep whose plain runs spread least is kept; a stopped sweep
    (fewer rows than Ks) is not repeated, nor kept over a complete one."""
    from engine.bench import suite as bench

    def sweep(plain):
        return [{"k": k, "plain_tokens_per_s": p, "calibrated_plain_ms": 1000 / plain[0], "speedup": 1.5}
                for k, p in zip((1, 2, 4), plain)]

    def replay(*sweeps):
        queue = list(sweeps)
        monkeypatch.setattr(bench, "bench_k_sweep", lambda *args, **kw: queue.pop(0))

    steady, drifted, less = sweep([3000, 3050, 2990]), sweep([3000, 2000, 3050]), sweep([3000, 2700, 3000])
    replay(steady)
    assert bench.steadiest_k_sweep(None, [], None, (1, 2, 4)) == (steady, 1)
    replay(drifted, steady)
    assert bench.steadiest_k_sweep(None, [], None, (1, 2, 4)) == (steady, 2)
    replay(drifted, less, drifted)
    assert bench.steadiest_k_sweep(None, [], None, (1, 2, 4), passes=3) == (less, 3)
    assert bench.plain_spread(less) == pytest.approx(3000 / 2700 - 1)
    replay(drifted[:2])
    assert bench.steadiest_k_sweep(None, [], None, (1, 2, 4)) == (drifted[:2], 1)
    again = []
    replay(drifted, steady[:1])  # the second sweep stopped: the complete first one stands
    assert bench.steadiest_k_sweep(None, [], None, (1, 2, 4), again=again.append) == (drifted, 2)
    assert again == [2]


def test_k_sweep_rows_carry_their_plain_runs():
    from engine.bench.suite import bench_k_sweep
    from engine.config import GenerationConfig

    rows = bench_k_sweep(RecordingDecoder("cpu"), ["p1"], GenerationConfig(method="draft", k=4), (1, 3))
    assert all(row["plain_tokens_per_s"] > 0 for row in rows)
