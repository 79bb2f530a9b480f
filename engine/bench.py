"""Measured benchmarks: methods side by side, K sweeps against the analytic model, kernels.

Speed is always reported as ratios measured in one run (every method against plain decoding on the same
prompts, same machine, same process), never as a lone absolute figure."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from engine import analytic
from engine.config import GenerationConfig
from engine.errors import SpecplayError

FALLBACK_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
]


def heldout_prompts(limit: int) -> list:
    """Held-out prompts shipped with the model family (validation files only), else a few built-in ones."""
    path = Path(__file__).resolve().parents[1] / "assets" / "models" / "heldout_prompts.json"
    prompts = FALLBACK_PROMPTS
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):  # {"source": ..., "corpus_sha256": ..., "prompts": [...]}
            data = data.get("prompts", [])
        prompts = [p.get("text", p.get("prompt")) if isinstance(p, dict) else p for p in data] or FALLBACK_PROMPTS
    return prompts[:max(1, limit)]


@dataclass
class Measurement:
    method: str
    k: int
    emitted: int
    rounds: int
    drafted: int
    accepted: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 0.0


def measure(decoder, prompts: list, config: GenerationConfig, repeats: int = 1) -> Measurement:
    """Decode every prompt (repeats times) and add up tokens, rounds and round time."""
    total = Measurement(config.method, config.k, 0, 0, 0, 0, 0.0)
    for _ in range(repeats):
        for prompt in prompts:
            events = list(decoder.generate(prompt, config))
            m = events[-1].metrics
            total.emitted += m.emitted
            total.rounds += m.rounds
            total.drafted += m.drafted
            total.accepted += m.accepted
            total.seconds += sum(e.round_ms for e in events) / 1000.0
    return total


def parse_method(spec: str) -> tuple[str, int]:
    """'eagle:8' -> ('eagle', 8): a method with a tree node budget; 'draft' -> ('draft', 0)."""
    name, _, nodes = spec.partition(":")
    try:
        return name, int(nodes) if nodes else 0
    except ValueError:
        raise SpecplayError(f"bad method {spec!r}: use NAME or NAME:TREE_NODES") from None


def bench_methods(decoder, prompts, base: GenerationConfig, methods, repeats=1) -> list:
    """Each method on the same prompts; speedup = tokens/s over `none`'s, measured in this run.
    methods: names, or NAME:N for a tree of N nodes (eagle:8). Unavailable methods are skipped."""
    availability = decoder.method_availability()
    variants = [parse_method(m) for m in methods]
    for name, _ in variants:
        if name not in availability:
            raise SpecplayError(f"unknown method {name!r}")
    variants = [("none", 0)] + [(m, n) for m, n in variants if availability[m] is None and m != "none"]
    results = {}
    for name, nodes in variants:
        label = f"{name}:{nodes}" if nodes else name
        config = replace(base, method=name, tree_nodes=nodes)
        measure(decoder, prompts[:1], config)  # warm-up: kernels compiled, CUDA graphs captured
        results[label] = measure(decoder, prompts, config, repeats)
    plain = results["none"].tokens_per_s
    rows = []
    for method, r in results.items():
        rows.append({"method": method, "k": r.k if method != "none" else 0, "alpha": r.alpha,
                     "mean_acceptance_length": r.mean_acceptance_length,
                     "tokens_per_forward": r.tokens_per_forward, "tokens_per_s": r.tokens_per_s,
                     "speedup": r.tokens_per_s / plain if plain else 0.0,
                     "analytic_tokens_per_forward": analytic.expected_tokens(r.alpha, r.k) if method != "none"
                     else 1.0})
    return rows


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
                     "graph_gain": fast["tokens_per_s"] / eager["tokens_per_s"] if eager["tokens_per_s"] else 0.0,
                     "eager_speedup": eager["speedup"], "graph_speedup": fast["speedup"]})
    return rows


def captures_graphs(decoder) -> bool:
    """True when the decoder captures CUDA graphs on first use of a shape (the first run of a config is slow)."""
    device = getattr(decoder, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


def bench_k_sweep(decoder, prompts, base: GenerationConfig, ks, repeats=1, progress=None) -> list:
    """Measured speedup per K next to the analytic E/(1+cK) at the measured alpha and calibrated c.
    progress(row), when given, is called after each K; returning False stops the sweep (the rows so far return)."""
    calibration = decoder.calibrate(max(ks))
    c = calibration.c if base.method == "draft" else 0.0
    measure(decoder, prompts[:1], replace(base, max_new_tokens=8))  # warm-up
    plain = measure(decoder, prompts, replace(base, method="none"), repeats).tokens_per_s
    rows = []
    for k in ks:
        if captures_graphs(decoder):  # each K has its own block sizes: capture their graphs before timing
            measure(decoder, prompts[:1], replace(base, k=k))
        r = measure(decoder, prompts, replace(base, k=k), repeats)
        rows.append({"k": k, "alpha": r.alpha, "tokens_per_forward": r.tokens_per_forward,
                     "analytic_tokens_per_forward": analytic.expected_tokens(r.alpha, k),
                     "tokens_per_s": r.tokens_per_s, "speedup": r.tokens_per_s / plain if plain else 0.0,
                     "predicted_speedup": analytic.speedup(r.alpha, k, c), "c": c})
        if progress is not None and progress(rows[-1]) is False:
            break
    return rows


def format_rows(rows: list, columns: list) -> str:
    header = " | ".join(f"{c:>12}" for c in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for c in columns:
            v = row[c]
            cells.append(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def run_bench_command(args) -> int:
    from engine.cli import config_from_args, load_decoder

    if args.what == "kernels":
        return _bench_kernels()
    config = config_from_args(args)
    prompts = [args.prompt] if args.prompt else heldout_prompts(args.prompts)
    if args.what in ("methods", "graphs"):
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        decoder = load_decoder(args, "draft" if "draft" in methods else "none")
        if args.what == "graphs":
            rows = bench_graphs(decoder, prompts, config, methods, args.repeats)
            columns = ["method", "k", "alpha", "eager_tokens_per_s", "graph_tokens_per_s", "graph_gain",
                       "eager_speedup", "graph_speedup"]
        else:
            rows = bench_methods(decoder, prompts, config, methods, args.repeats)
            columns = ["method", "k", "alpha", "mean_acceptance_length", "tokens_per_forward",
                       "analytic_tokens_per_forward", "tokens_per_s", "speedup"]
    else:
        try:
            ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
        except ValueError:
            raise SpecplayError(f"--ks must be a comma-separated list of integers (got {args.ks!r})") from None
        if not ks or ks[0] < 1 or ks[-1] > 32:
            raise SpecplayError("--ks values must be between 1 and 32")
        decoder = load_decoder(args, config.method)
        rows = bench_k_sweep(decoder, prompts, config, ks, args.repeats)
        columns = ["k", "alpha", "tokens_per_forward", "analytic_tokens_per_forward", "tokens_per_s", "speedup",
                   "predicted_speedup"]
        best = max(rows, key=lambda r: r["speedup"])
        print(f"fastest measured K = {best['k']} ({best['speedup']:.2f}x over plain decoding)", file=sys.stderr)
    print(f"device={decoder.device_name} prompts={len(prompts)} max_new_tokens={config.max_new_tokens} "
          f"T={config.sampling.temperature}")
    print(format_rows(rows, columns))
    return 0


def _bench_kernels() -> int:
    try:
        from kernels.bench_kernels import format_table, run_kernel_bench
    except ImportError as exc:
        raise SpecplayError(f"kernel benchmark unavailable: {exc}") from None
    import torch

    if not torch.cuda.is_available():
        raise SpecplayError("bench kernels needs a CUDA GPU")
    print(format_table(run_kernel_bench()))
    return 0
