"""Measured benchmarks: methods side by side, K sweeps against the analytic model, kernels.

Speed is always reported as ratios measured in one run (every method against plain decoding on the same
prompts, same machine, same process), never as a lone absolute figure."""
from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Optional

from engine.analysis import analytic
from engine.config import GenerationConfig
from engine.core.metrics import RunTotals, final_metrics
from engine.errors import SpecplayError
from engine.methods import registry as method_registry
from engine.methods.registry import MethodSpec, parse_spec

DEFAULT_KS = "1,2,3,4,6,8,12,16"  # bench k-sweep's and bench batch's K values unless --ks names others

FALLBACK_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
]


def heldout_prompts(limit: int) -> list:
    """Held-out prompts shipped with the model family (validation files only), else a few built-in ones."""
    path = Path(__file__).resolve().parents[2] / "assets" / "models" / "heldout_prompts.json"
    prompts = FALLBACK_PROMPTS
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):  # {"source": ..., "corpus_sha256": ..., "prompts": [...]}
            data = data.get("prompts", [])
        texts = [p.get("text", p.get("prompt")) if isinstance(p, dict) else p for p in data]
        prompts = texts or FALLBACK_PROMPTS
    return prompts[:max(1, limit)]


def measure(decoder, prompts: list, config: GenerationConfig, repeats: int = 1) -> RunTotals:
    """Decode every prompt (repeats times) and add up the generations' final metrics."""
    totals = RunTotals(config.drafts)
    for _ in range(repeats):
        for prompt in prompts:
            totals.add(final_metrics(list(decoder.generate(prompt, config))))
    return totals


def measure_interleaved(decoder, prompts: list, configs: dict, repeats: int = 1,
                        after=None, before_repeat=None, keep_partial: bool = False) -> Optional[dict]:
    """Every configuration on every prompt, round-robin (prompt by prompt, each configuration in turn), added
    up per configuration: {label: RunTotals}. A slow stretch of the machine (an H200 host ran host-bound
    plain rounds at up to 1.7x their time after it had waited or idled) then slows every configuration
    alike, where timed one after another it would land on one configuration and skew every ratio to it.
    after: called after each generation; when it returns False the measurement stops and gives None, or with
    keep_partial the totals of the prompts every configuration ran; stopped in its first prompt, the
    configurations that ran it (None when there is none).
    before_repeat: called before each pass over the prompts (a session reset: no pass recalls the last)."""
    totals = {label: RunTotals(config.drafts) for label, config in configs.items()}
    cycles = 0
    for _ in range(repeats):
        if before_repeat is not None:
            before_repeat()
        for prompt in prompts:
            cycle = {}  # added once every configuration ran the prompt: the totals stay paired
            for label, config in configs.items():
                cycle[label] = final_metrics(list(decoder.generate(prompt, config)))
                if after is not None and not after():
                    if keep_partial and not cycles:  # stopped in the first prompt: what it measured of it
                        return _cycle_totals(cycle, configs)
                    return totals if keep_partial else None
            for label, metrics in cycle.items():
                totals[label].add(metrics)
            cycles += 1
    return totals


def _cycle_totals(cycle: dict, configs: dict) -> dict:
    """{label: RunTotals} of one prompt's generations (those of a stopped round-robin)."""
    totals = {label: RunTotals(configs[label].drafts) for label in cycle}
    for label, metrics in cycle.items():
        totals[label].add(metrics)
    return totals


def bench_methods(decoder, prompts, base: GenerationConfig, methods, repeats=1, progress=None,
                  keep_partial: bool = False) -> list:
    """Each method on the same prompts, timed round-robin (measure_interleaved); speedup = tokens/s over
    `none`'s, measured in this run.
    methods: specs, NAME or NAME:N for a tree of N nodes (eagle:8). Unavailable methods are skipped.
    progress(done, total): called after each generation (the warm-ups' included); returning False stops the
    run, which then gives no rows, or with keep_partial the rows of the prompts every method ran (stopped in
    the first prompt: of the methods that ran it, plain decoding first)."""
    availability = decoder.method_availability()
    specs = [parse_spec(m) for m in methods]
    for spec in specs:
        if spec.name not in availability:
            raise SpecplayError(f"unknown method {spec.name!r}")
    specs = [MethodSpec("none")] + [s for s in specs if availability.get(s.name) is None and s.name != "none"]
    configs = {str(spec): replace(base, method=spec.name, tree_nodes=spec.tree_nodes) for spec in specs}
    trees = {label: method_registry.get(c.method).is_tree(c) for label, c in configs.items()}
    total, done = len(configs) * (1 + repeats * len(prompts)), 0

    def after() -> bool:
        nonlocal done
        done += 1
        return progress is None or progress(done, total) is not False

    with kept_session(decoder) as reset:  # suffix decoding would otherwise recall the warm-ups' output
        for config in configs.values():
            measure(decoder, prompts[:1], config)  # warm-up: kernels compiled, CUDA graphs captured
            if not after():
                return []
        results = measure_interleaved(decoder, prompts, configs, repeats, after, before_repeat=reset,
                                      keep_partial=keep_partial)
    if not results or "none" not in results:
        return []
    plain = results["none"]
    rows = []
    for label, r in results.items():
        row = _method_row(label, r, plain.tokens_per_s)
        if label != "none":
            row.update(textbook(r, plain, trees[label]))
            row["textbook_share"] = _ratio(row["speedup"], row.get("textbook_speedup", 0.0))
        rows.append(row)
    return rows


def textbook(r: RunTotals, plain: RunTotals, tree: bool) -> dict:
    """The chapter's E / (1 + cK) with the run's own E and c, c = a draft step's time over one target step
    (plain decoding's verification phase, same run). A tree's form takes its drafting time and its
    verification block's measured time in units of that step: E * t_step / (t_draft + t_verify). The row's
    textbook_share (measured speedup / this) is the part of a round that is drafting and verification."""
    if not r.rounds or not plain.rounds or r.k <= 0:
        return {}
    step = plain.verify_ms / plain.rounds  # ms
    draft, verify = r.draft_ms / r.rounds, r.verify_ms / r.rounds  # ms a round
    if step <= 0:
        return {}
    if tree:
        total = draft + verify
        return {"c": draft / step, "textbook_speedup": r.tokens_per_forward * step / total if total else 0.0}
    c = draft / (r.k * step)
    return {"c": c, "textbook_speedup": r.tokens_per_forward / (1.0 + c * r.k)}


@contextlib.contextmanager
def kept_session(decoder):
    """Measurement runs leave the decoder's session (suffix decoding's memory of earlier generations) as they
    found it; the context gives reset(), which forgets what they added so far, so that each measured setting
    starts where the session was. Stand-in decoders without a session pass through."""
    state = decoder.session_state() if hasattr(decoder, "session_state") else None

    def reset() -> None:
        if hasattr(decoder, "restore_session"):
            decoder.restore_session(state)

    try:
        yield reset
    finally:
        reset()


def _method_row(label: str, r: RunTotals, plain_tokens_per_s: float) -> dict:
    return {"method": label, "k": r.k, "alpha": r.acceptance_rate,
            "mean_acceptance_length": r.mean_acceptance_length, "tokens_per_forward": r.tokens_per_forward,
            "tokens_per_s": r.tokens_per_s, "speedup": _ratio(r.tokens_per_s, plain_tokens_per_s),
            "analytic_tokens_per_forward": r.analytic_tokens_per_forward}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def bench_graphs(decoder, prompts, base: GenerationConfig, methods, repeats=1) -> list:
    """Each method run eagerly and with captured CUDA graphs, on the same prompts in this run."""
    if decoder.device.type != "cuda":
        raise SpecplayError("bench graphs needs a CUDA GPU (graphs are only used there)")
    by_mode = {}
    try:
        for graphs in (False, True):
            decoder.set_cuda_graphs(graphs)
            by_mode[graphs] = bench_methods(decoder, prompts, base, methods, repeats)
    finally:
        decoder.set_cuda_graphs(True)
    rows = []
    for eager, fast in zip(by_mode[False], by_mode[True]):
        rows.append({"method": eager["method"], "k": eager["k"], "alpha": fast["alpha"],
                     "eager_tokens_per_s": eager["tokens_per_s"], "graph_tokens_per_s": fast["tokens_per_s"],
                     "graph_gain": _ratio(fast["tokens_per_s"], eager["tokens_per_s"]),
                     "eager_speedup": eager["speedup"], "graph_speedup": fast["speedup"]})
    return rows


def captures_graphs(decoder) -> bool:
    """True when the decoder captures CUDA graphs on first use of a shape (a config's first run is slow)."""
    device = getattr(decoder, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


def bench_k_sweep(decoder, prompts, base: GenerationConfig, ks, repeats=1, progress=None) -> list:
    """Measured speedup per K next to three predictions:
    - predicted_speedup: the cost model (calibrated, refitted on this K's phase times) and this K's measured
      tokens per forward: t_plain / (t_round(K) / E);
    - textbook_speedup: the chapter's E_uniform / (1 + cK) at the measured alpha and a measured c;
    - from_run_speedup: "predicted from this run": the counterfactual from the largest K's run alone
      (engine.analysis.predict), filled into every row once that run was measured.
    progress(row), when given, is called after each K; returning False stops the sweep (the rows so far
    return)."""
    calibration = decoder.calibrate(max(ks), sampling=base.sampling)
    costs = getattr(calibration, "costs", None)
    if base.method == "layerskip":  # its c is a partial target step, measured apart
        c = draft_cost(decoder, base, max(ks))
    else:
        c = calibration.c_for(base.method) if hasattr(calibration, "c_for") else calibration.c
    # TPOT_plain of the predictions stays the calibrated one: taking this run's plain rounds would make the
    # prediction this run's own ratio. The measured speedup pairs each K with plain runs of the same prompts
    # taken between its own: a slow stretch of the machine then slows both sides. Every pass starts from the
    # session as it was (suffix decoding would recall the last K's outputs of the same prompts)
    plain_config = base.plain()
    rows, traces = [], {}
    with kept_session(decoder) as reset:
        measure(decoder, prompts[:1], replace(base, max_new_tokens=8))  # warm-up
        for k in ks:
            if captures_graphs(decoder):  # each K has its own block sizes: capture their graphs before timing
                measure(decoder, prompts[:1], replace(base, k=k))
            runs = _paired_runs(decoder, prompts, plain_config, replace(base, k=k), repeats, reset)
            plain, r, events, plain_events, memories = runs
            traces[k] = (events, plain_events, memories)
            rows.append(dict(_sweep_row(k, r, plain.tokens_per_s, c, costs, events),
                             plain_tokens_per_s=plain.tokens_per_s,
                             calibrated_plain_ms=None if costs is None else costs.t_plain))
            if progress is not None and progress(rows[-1]) is False:
                break
    _add_from_run(rows, traces, costs, _generation_headers(decoder, prompts, base, repeats),
                  _suffix_replayer(decoder, base))
    return rows


def _suffix_replayer(decoder, config: GenerationConfig):
    """replayer(trace, memories) -> the trace's replay (engine.analysis.predict.Trace.replay) of suffix
    decoding, each
    generation from the documents the session's memory held as it began; None for other methods."""
    if config.method != "suffix" or not hasattr(decoder, "vocab_size"):
        return None
    from engine.methods.suffix.drafter import generations_replay

    def replayer(trace, memories):
        outputs = [[t for r in generation for t in r.emitted] for generation in trace.generations]
        if trace.prompt_ids is None or len(memories) != len(outputs):
            return None
        return generations_replay(list(zip(memories, trace.prompt_ids, outputs)),
                                  method_registry.node_budget(config), decoder.vocab_size)

    return replayer


def _generation_headers(decoder, prompts, config: GenerationConfig, repeats: int) -> list:
    """A trace header per run of _paired_runs, in its order (settings, device, the prompt's ids), so that the
    prediction from a run replays a lookup drafter exactly; [] where the decoder cannot encode prompts."""
    encode = getattr(decoder, "prompt_ids", None)
    if encode is None:
        return []
    from engine.files.trace import make_header

    device = getattr(decoder, "device_name", None)
    target = getattr(getattr(decoder, "pair", None), "target_name", None)  # whose n-gram table it used
    return [make_header(prompt, config, target, device=device, prompt_ids=encode(prompt))
            for _ in range(repeats) for prompt in prompts]


UNSTEADY = 0.10  # plain decoding's speed moving this much during a sweep makes its predictions suspect


def steadiest_k_sweep(decoder, prompts, base: GenerationConfig, ks, repeats=1, passes=2,
                      progress=None, again=None) -> tuple:
    """bench_k_sweep, swept again (up to `passes` sweeps) while the machine's speed moved during the last
    one (sweep_steadiness): that sweep's measurements and predictions are suspect. again(n), when given, is
    called before sweep n > 1. Returns (the rows of the complete sweep whose plain runs spread least, or of
    a stopped first sweep; the sweeps run). A sweep stopped by progress is not repeated."""
    best, best_spread, ran = None, float("inf"), 0
    for n in range(1, passes + 1):
        if n > 1 and again is not None:
            again(n)
        rows = bench_k_sweep(decoder, prompts, base, ks, repeats, progress)
        ran += 1
        complete = len(rows) == len(ks)
        spread = plain_spread(rows)
        if best is None or (complete and spread < best_spread):
            best, best_spread = rows, spread
        if not complete or sweep_steadiness(rows) is None:
            break
    return best, ran


def plain_spread(rows: list) -> float:
    """How far apart a sweep's plain runs were: the fastest over the slowest, less one (calibration's plain
    round counted as one more run); 0 without paired plain runs."""
    plain = [r["plain_tokens_per_s"] for r in rows if r.get("plain_tokens_per_s")]
    if rows and rows[0].get("calibrated_plain_ms"):
        plain.append(1000.0 / rows[0]["calibrated_plain_ms"])
    return max(plain) / min(plain) - 1 if plain else 0.0


def sweep_steadiness(rows: list) -> Optional[str]:
    """A warning when the machine's speed moved during a K sweep, else None: the plain runs paired with each K
    (rows' plain_tokens_per_s) more than UNSTEADY apart, or calibration's plain round (calibrated_plain_ms)
    that far from them. The
    predictions rest on calibration's timings, so they can be off by as much (seen on H200 machines whose
    host slowed down for minutes, docs/measurements/idle_probe_gpu.txt)."""
    plain = [r["plain_tokens_per_s"] for r in rows if r.get("plain_tokens_per_s")]
    if not plain:
        return None
    calibrated_plain_ms = rows[0].get("calibrated_plain_ms")
    low, high = min(plain), max(plain)
    median = sorted(plain)[len(plain) // 2]
    notes = []
    if high > low * (1 + UNSTEADY):
        notes.append(f"plain decoding ran at {low:.0f} to {high:.0f} tokens/s between the Ks "
                     f"({100 * (high / low - 1):.0f}% apart)")
    if calibrated_plain_ms:
        calibrated = 1000.0 / calibrated_plain_ms
        if abs(calibrated / median - 1) > UNSTEADY:
            notes.append(f"calibration timed {calibrated:.0f} tokens/s against {median:.0f} in the sweep")
    if not notes:
        return None
    return ("the machine's speed moved during the sweep: " + "; ".join(notes) + ". The predictions rest on "
            "calibration's timings and may be off by as much; run the sweep again.")


COLUMN_UNITS = {  # the unit each bench column is in, shown in its header
    "k": "tokens", "alpha": "ratio", "mean_acceptance_length": "tokens", "tokens_per_forward": "tokens",
    "analytic_tokens_per_forward": "tokens", "tokens_per_s": "tok/s", "speedup": "x",
    "predicted_speedup": "x", "from_run_speedup": "x", "from_run_tokens_per_forward": "tokens",
    "textbook_speedup": "x", "eager_tokens_per_s": "tok/s",
    "graph_tokens_per_s": "tok/s", "graph_gain": "x",
    "eager_speedup": "x", "graph_speedup": "x", "c": "ratio", "textbook_share": "ratio",
    "plain_tokens_per_s": "tok/s",
}
# plain decoding drafts nothing: no K, no alpha, no textbook figure
PLAIN_BLANKS = ("k", "alpha", "mean_acceptance_length", "c", "textbook_speedup", "textbook_share")


def _cell(row: dict, column: str) -> str:
    value = row.get(column, "-")
    if row.get("method") == "none" and column in PLAIN_BLANKS:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def draft_cost(decoder, config: GenerationConfig, k: int) -> float:
    """c, one draft step's time over one target step's, measured on this machine: the draft model's, layer
    skip's (its L layers), 0 for the model-free and head methods (their draft cost is not a model step)."""
    if config.method == "draft":
        return decoder.calibrate(k).c
    if config.method == "layerskip":
        from engine.methods.layerskip.drafter import resolve_draft_layers

        return layer_skip_cost(decoder, resolve_draft_layers(decoder.target, config.draft_layers))
    return 0.0


def layer_skip_cost(decoder, layers: int, repeats: int = 5) -> float:
    """c of layer skip: the median time of one step of the target's first `layers` layers (one token after a
    short prefix) over one full target step. Between generations only: like decoder.calibrate, it writes the
    cache rows it times."""
    import torch  # here, not at the top: the CLI parses and checks its arguments without importing torch

    from engine.methods.layerskip.drafter import layer_skip_runner

    probe = torch.full((8,), decoder.tokenizer.encode("def ")[0], dtype=torch.long, device=decoder.device)
    with torch.inference_mode():
        full = _step_ms(decoder.target, probe, repeats)
        part = _step_ms(layer_skip_runner(decoder.target, layers), probe, repeats)
    return _ratio(part, full)


def _step_ms(runner, probe, repeats: int) -> float:
    """Median ms of a one-token forward after the probe [n]'s prefix (rolled back each time); one warm-up."""
    from engine.bench.timing import Stopwatch

    runner.reset()
    runner.forward(probe)
    times = []
    for _ in range(repeats + 1):
        watch = Stopwatch(runner.device)
        runner.forward(probe[:1])
        times.append(watch.elapsed_ms())
        runner.rollback(probe.numel())
    runner.reset()
    return sorted(times[1:])[repeats // 2]


def bench_layer_sweep(decoder, prompts, base: GenerationConfig, layer_counts=None, repeats=1,
                      progress=None) -> list:
    """Layer skip with L = each of layer_counts (default: 1 .. N-1) drafting layers, on the same prompts, next
    to plain decoding measured in this run, and the speedup E/(1+cK) predicts at the measured alpha and the
    measured c of L layers (layer_skip_cost). progress(row) is called after each L; returning False stops
    the sweep (the rows so far return)."""
    from engine.methods.layerskip.drafter import resolve_draft_layers

    total = len(getattr(decoder.target, "layers", ()))
    counts = list(layer_counts or range(1, total))
    for count in counts:  # a bad L is reported before anything runs
        if count < 1:
            raise SpecplayError(f"draft layer counts must be >= 1 (got {count})")
        resolve_draft_layers(decoder.target, count)
    config = replace(base, method="layerskip", tree_nodes=0)
    measure(decoder, prompts[:1], replace(config, draft_layers=counts[0], max_new_tokens=8))  # warm-up
    plain = measure(decoder, prompts, base.plain(), repeats).tokens_per_s
    rows = []
    for count in counts:
        run = replace(config, draft_layers=count)
        if captures_graphs(decoder):
            measure(decoder, prompts[:1], run)
        r = measure(decoder, prompts, run, repeats)
        c = layer_skip_cost(decoder, count)
        rows.append({"layers": count, "k": r.k, "alpha": r.acceptance_rate,
                     "tokens_per_forward": r.tokens_per_forward,
                     "analytic_tokens_per_forward": r.analytic_tokens_per_forward,
                     "tokens_per_s": r.tokens_per_s,
                     "speedup": _ratio(r.tokens_per_s, plain),
                     "predicted_speedup": analytic.speedup(r.acceptance_rate, r.k, c), "c": c})
        if progress is not None and progress(rows[-1]) is False:
            break
    return rows


def _paired_runs(decoder, prompts, plain_config, config, repeats, reset) -> tuple:
    """Each prompt decoded plainly, then with config (repeats times, each pass after reset(): the session as
    it was): (plain RunTotals, config's RunTotals, config's events as (generation, event) pairs for the
    predictions, the plain runs' events, and for suffix decoding the documents its memory held as each
    generation began, for the replay)."""
    plain, totals, events, plain_events, index = RunTotals(0), RunTotals(config.drafts), [], [], 0
    memories = []
    for _ in range(repeats):
        reset()
        for prompt in prompts:
            plain_generation = list(decoder.generate(prompt, plain_config))
            plain.add(final_metrics(plain_generation))
            plain_events += plain_generation
            generation = list(decoder.generate(prompt, config))
            totals.add(final_metrics(generation))
            events += [(index, e) for e in generation]
            index += 1
            if config.method == "suffix" and hasattr(decoder, "suffix_memory"):
                memories.append(list(decoder.suffix_memory().begun_with))
    return plain, totals, events, plain_events, memories


def _sweep_row(k, r: RunTotals, plain: float, c: float, costs, events) -> dict:
    """One K's measured figures beside its predictions; the cost model is refitted on this K's rounds (the
    live refit), its plain round kept from calibration."""
    row = {"k": k, "alpha": r.acceptance_rate, "tokens_per_forward": r.tokens_per_forward,
           "analytic_tokens_per_forward": analytic.expected_tokens(r.acceptance_rate, k),
           "tokens_per_s": r.tokens_per_s, "speedup": _ratio(r.tokens_per_s, plain),
           "textbook_speedup": analytic.speedup(r.acceptance_rate, k, c), "c": c}
    row["predicted_speedup"] = row["textbook_speedup"]
    if costs is not None and events:
        from engine.analysis.costmodel import timing_of

        method = events[0][1].method
        timings = [timing_of(e) for _, e in events]
        refitted = costs.refit(timings)
        # each round at the block it verified: a lookup drafter's short proposals (and misses) verify fewer
        # rows on the CPU, which one typical block size misstated (on the GPU n-gram verifies K + 1 rows)
        round_ms = statistics.fmean(refitted.t_round(method, k, t.block) for t in timings)
        tpot = round_ms / max(r.tokens_per_forward, 1e-9)
        row["predicted_speedup"] = refitted.t_plain / tpot if tpot > 0 else 0.0
    return row


def _add_from_run(rows: list, traces: dict, costs, headers: list = (), replayer=None) -> None:
    """Fill from_run_speedup / from_run_tokens_per_forward / from_run_basis from the largest K's run: its
    rounds and the plain runs paired with it (the plain round timed in the same stretch as that run's rounds,
    not at calibration: a machine that sped up in between had put every from-run speedup 16-30% high).
    headers: each generation's trace header (_generation_headers); replayer: _suffix_replayer's."""
    if costs is None or not rows:
        return
    from engine.analysis.costmodel import timing_of
    from engine.analysis.predict import predict_from_trace, trace_from_events

    source = max(r["k"] for r in rows)
    events, plain_events, memories = traces[source]
    try:
        trace = trace_from_events(events)
        if headers and len(headers) == len(trace.generations):
            trace.header, trace.headers = headers[0], list(headers)
        if replayer is not None:
            trace.replay = replayer(trace, memories)
        plain = [timing_of(e) for e in plain_events if e.round > 0]  # the first waits for the prefill
    except (AttributeError, TypeError, KeyError):  # stand-in decoders without full events
        return
    report = predict_from_trace(trace, [r["k"] for r in rows], costs, plain)
    by_k = {p.k: p for p in report.predictions}
    for row in rows:
        p = by_k[row["k"]]
        row.update(from_run_speedup=p.speedup, from_run_tokens_per_forward=p.tokens_per_forward,
                   from_run_basis=p.basis, from_run_k=source)


def format_rows(rows: list, columns: list) -> str:
    """An aligned table: headers with units ('tokens_per_s [tok/s]'), each column as wide as its widest cell,
    text left-aligned and numbers right-aligned; plain decoding's K and alpha shown as '-'."""
    headers = [f"{c} [{COLUMN_UNITS[c]}]" if c in COLUMN_UNITS else c for c in columns]
    cells = [[_cell(row, c) for c in columns] for row in rows]
    widths = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row.get(c), (int, float)) for row in rows) for c in columns]

    def line(values: list) -> str:
        return " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric,
                                                                                 strict=True)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(values) for values in cells])
