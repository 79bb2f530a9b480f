"""`bench batch`: the gain of speculation against the batch size, measured, beside the roofline's prediction.

For each batch B: plain batched decoding and speculative batched decoding of the same prompts (the same
loop, empty drafts for plain; every batch size decodes the whole prompt pool, prompt_groups), and the
target's forward timed alone for B and for B (K+1) tokens per forward
(the draft model's or the EAGLE head's for B and 2B). A roofline fitted to every measured step time predicts
each batch's speedup from the measured tokens per round; the crossover (speedup < 1) is reported measured and
predicted, and the best K of a small set is predicted per batch from the measured per-position acceptance
(measured too with sweep_k)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence

import torch

from engine.bench import roofline
from engine.config import GenerationConfig
from engine.core.batch import BatchDecoder, merged_results

WARM_ROUNDS = 2  # rounds of each configuration run before timing (graphs captured, kernels compiled)
STEP_REPEATS = 5


@dataclass
class BatchRow:
    batch: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    tokens_per_round: float  # speculative, per sequence per round (E, every sequence decoding)
    plain_tokens_per_round: float
    acceptance_rate: float
    plain_round_ms: float  # measured: decoding wall time / rounds
    spec_round_ms: float
    step_ms: float  # target forward, B tokens (one per sequence)
    verify_step_ms: float  # target forward, B (K+1) tokens
    draft_step_ms: float = 0.0  # draft model (or EAGLE head) forward, B tokens (0 for n-gram drafts)
    draft_step2_ms: float = 0.0  # draft model (or EAGLE head) forward, 2B tokens
    per_position_acceptance: list = field(default_factory=list)
    predicted_speedup: float = 0.0
    best_k: int = 0  # predicted
    best_k_speedup: float = 0.0
    measured_k_speedups: dict = field(default_factory=dict)  # K -> measured speedup (sweep_k)
    plain_cache_rows: float = 0.0  # cache rows a plain round's attention reads, every sequence's together
    plain_bound_ms: float = 0.0  # the roofline bound of a plain round (the function plain_bound_ms)
    plain_pct_bound: float = 0.0  # plain_bound_ms / the measured plain round
    plain_pct_weights: float = 0.0  # the weights' read time alone / the measured plain round

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0

    def overheads_ms(self, k: int) -> tuple:
        """(plain, speculative) round time the step times do not explain: host work, the verification
        kernel, copies; what the roofline prediction leaves out."""
        spec_steps = self.verify_step_ms
        if self.draft_step_ms:
            spec_steps += self.draft_step2_ms + (k - 1) * self.draft_step_ms
        return self.plain_round_ms - self.step_ms, self.spec_round_ms - spec_steps

    def as_dict(self, k: int = 0) -> dict:
        out = dict(vars(self))
        out["speedup"] = self.speedup
        out["plain_overhead_ms"], out["spec_overhead_ms"] = self.overheads_ms(k)
        out["measured_k_speedups"] = {str(k): v for k, v in self.measured_k_speedups.items()}
        return out


@dataclass
class BatchReport:
    rows: List[BatchRow]
    method: str
    k: int
    ks: list
    device: str
    max_new_tokens: int
    target_fit: roofline.Roofline
    draft_fit: Optional[roofline.Roofline]
    weight_bytes: int
    flops_per_token: float
    bandwidth: float  # measured, bytes/s
    matmul_flops: float  # measured, flop/s
    measured_crossover: Optional[float] = None
    predicted_crossover: Optional[float] = None
    note: str = ""
    cache_bytes_per_row: int = 0  # one token's keys and values, every layer (0: a report saved before it)

    def as_dict(self) -> dict:
        fitted = self.target_fit.rates(self.weight_bytes, self.flops_per_token)
        return {"method": self.method, "k": self.k, "ks": self.ks, "device": self.device,
                "max_new_tokens": self.max_new_tokens, "weight_bytes": self.weight_bytes,
                "cache_bytes_per_row": self.cache_bytes_per_row,
                "flops_per_token": self.flops_per_token, "measured_bandwidth": self.bandwidth,
                "measured_matmul_flops": self.matmul_flops, "fit": self.target_fit.as_dict(),
                "fit_bandwidth": fitted["bandwidth"], "fit_matmul_flops": fitted["matmul_flops"],
                "draft_fit": self.draft_fit.as_dict() if self.draft_fit else None,
                "measured_crossover": self.measured_crossover,
                "predicted_crossover": self.predicted_crossover,
                "note": self.note, "rows": [r.as_dict(self.k) for r in self.rows]}


# ------------------------------------------------------------------------------------------------ timing
@torch.inference_mode()
def time_step(runner, n: int, context: int, repeats: int = STEP_REPEATS) -> float:
    """The fastest of `repeats` batched forwards of n tokens per sequence at `context` cached rows each, in ms
    (lengths restored after each; the first call, which may capture a graph, is not counted). The fastest,
    not the median: other work on the machine only ever adds time."""
    context = max(1, min(context, runner.max_length - n))
    saved = list(runner.lengths)
    runner.lengths = [context] * runner.batch
    tokens = torch.zeros(runner.batch, n, dtype=torch.long, device=runner.device)
    times = []
    for _ in range(repeats + 1):
        _sync(runner.device)
        began = time.perf_counter()
        runner.forward(tokens)
        _sync(runner.device)
        times.append(1000.0 * (time.perf_counter() - began))
        runner.lengths = [context] * runner.batch
    runner.lengths = saved
    return min(times[1:])


def _warm(decoder: BatchDecoder, prompts, config) -> None:
    """A few rounds of this configuration, untimed: graphs are captured, kernels compiled."""
    rounds = [0]

    def stop() -> bool:
        rounds[0] += 1
        return rounds[0] > WARM_ROUNDS

    decoder.generate(prompts, config, should_stop=stop, texts=False)


def prompt_groups(prompts: list, batch: int) -> list:
    """The batches of `batch` prompts that decode the whole pool: one batch of the pool cycled where the
    batch is at least the pool, else ceil(pool / batch) batches of it in turn (cycled to fill the last). So
    every batch size decodes the same prompts, and tokens per round move with the batch, not with the prompt
    mix (one prompt alone at B = 1 had its own acceptance)."""
    count = max(1, -(-len(prompts) // batch))
    return [[prompts[(g * batch + i) % len(prompts)] for i in range(batch)] for g in range(count)]


def _widest(decoder: BatchDecoder, groups: list) -> list:
    """The group with the longest prompt: warmed up, its batched caches (kept while the context fits) and
    captured steps serve every group, so no timed run allocates a cache or captures a graph."""
    return max(groups, key=lambda g: max(len(decoder.encode(prompt)) for prompt in g))


def _fastest(decoder: BatchDecoder, groups: list, config: GenerationConfig, repeats: int):
    """Each group's fastest of `repeats` timed runs (noise on a shared machine only ever slows a run down),
    merged into one result."""
    fastest = []
    for prompts in groups:
        runs = [decoder.generate(prompts, config, until_first_done=True, texts=False)
                for _ in range(max(1, repeats))]
        fastest.append(max(runs, key=lambda r: r.tokens_per_s))
    return merged_results(fastest)


def measure_batch(decoder: BatchDecoder, groups: list, config: GenerationConfig, repeats: int = 1) -> tuple:
    """(plain BatchResult, speculative BatchResult, step times dict) over `groups` (prompt_groups: batches
    of B prompts each). Both run without EOS and stop when the first sequence of a batch reaches its budget,
    so every timed round decodes all B sequences."""
    config = replace(config, stop_at_eos=False)
    plain_config = config.plain()
    widest = _widest(decoder, groups)
    _warm(decoder, widest, plain_config)
    plain = _fastest(decoder, groups, plain_config, repeats)
    _warm(decoder, widest, config)
    spec = _fastest(decoder, groups, config, repeats)
    context = (max(s.prompt_len for s in plain.sequences) + config.max_new_tokens // 2)
    target = decoder.target_batch
    steps = {"step_ms": time_step(target, 1, context),
             "verify_step_ms": time_step(target, config.k + 1, context)}
    # the draft model's or the EAGLE head's batched runner
    drafter = decoder.batch_drafters.get(config.method)
    if config.method in ("draft", "eagle") and drafter is not None and drafter.batch is not None:
        steps["draft_step_ms"] = time_step(drafter.batch, 1, context)
        steps["draft_step2_ms"] = time_step(drafter.batch, 2, context)
    return plain, spec, steps


def cache_rows_per_round(result) -> float:
    """Cache rows a round's attention reads, every sequence's together, averaged over a plain run's rounds:
    a sequence of P prompt tokens reads P + j rows in its round j (the prefill caches P - 1, and each round
    adds its token's row before attending)."""
    rows = sum(s.rounds * s.prompt_len + s.rounds * (s.rounds - 1) / 2 for s in result.sequences)
    return rows / result.rounds if result.rounds else 0.0


def _row(batch: int, plain, spec, steps: dict) -> BatchRow:
    return BatchRow(batch=batch, plain_tokens_per_s=plain.tokens_per_s, spec_tokens_per_s=spec.tokens_per_s,
                    plain_cache_rows=cache_rows_per_round(plain),
                    tokens_per_round=spec.tokens_per_round, plain_tokens_per_round=plain.tokens_per_round,
                    acceptance_rate=spec.summary()["acceptance_rate"],
                    plain_round_ms=1000.0 * plain.seconds / max(plain.rounds, 1),
                    spec_round_ms=1000.0 * spec.seconds / max(spec.rounds, 1),
                    per_position_acceptance=spec.per_position_acceptance, **steps)


# ------------------------------------------------------------------------------------------------ the bench
def bench_batch(decoder: BatchDecoder, prompts: list, config: GenerationConfig, batches: Sequence[int],
                ks: Sequence[int], sweep_k: bool = False,
                progress: Optional[Callable[[BatchRow], object]] = None, repeats: int = 1) -> BatchReport:
    """Measure every batch in `batches` (prompts cycled to fill each), then fit and predict. Each timed
    figure is the fastest of `repeats` runs. progress(row) after each batch; returning False stops (the
    batches so far are reported)."""
    if config.method == "eagle":
        decoder.eagle_head()  # no head: fail before the plain runs, not after them
    rows = []
    for batch in batches:
        groups = prompt_groups(prompts, batch)
        plain, spec, steps = measure_batch(decoder, groups, config, repeats)
        row = _row(batch, plain, spec, steps)
        if sweep_k:
            row.measured_k_speedups = _sweep_k(decoder, groups, config, ks, plain.tokens_per_s, repeats)
        rows.append(row)
        if progress is not None and progress(row) is False:
            break
        _free(decoder)
    return analyse(rows, decoder, config, ks)


def _sweep_k(decoder, groups, config, ks, plain_tokens_per_s: float, repeats: int) -> dict:
    out = {}
    for k in ks:
        run = replace(config, k=k, stop_at_eos=False)
        _warm(decoder, _widest(decoder, groups), run)
        tokens_per_s = _fastest(decoder, groups, run, repeats).tokens_per_s
        out[k] = tokens_per_s / plain_tokens_per_s if plain_tokens_per_s else 0.0
    return out


def analyse(rows: List[BatchRow], decoder: BatchDecoder, config: GenerationConfig,
            ks: Sequence[int]) -> BatchReport:
    """Fit the rooflines to the rows' step times; predicted speedups, best K and crossovers."""
    from engine.models.synthetic import cache_bytes_per_row, weight_bytes_per_step

    report = BatchReport(rows=rows, method=config.method, k=config.k, ks=list(ks), device=decoder.device_name,
                         max_new_tokens=config.max_new_tokens, target_fit=roofline.Roofline(0.0, 0.0),
                         draft_fit=None, weight_bytes=weight_bytes_per_step(decoder.target),
                         cache_bytes_per_row=cache_bytes_per_row(decoder.target),
                         flops_per_token=2.0 * _params(decoder.target),
                         bandwidth=roofline.measure_bandwidth(decoder.device),
                         matmul_flops=roofline.measure_matmul_rate(decoder.device, decoder.target.dtype))
    return predict(report)


def predict(report: BatchReport) -> BatchReport:
    """The report's fits, predictions, best K, bounds and crossovers, from its measured rows and machine
    rates alone (so a saved report can be refitted: refit_report), in place; returns it."""
    rows, k = report.rows, report.k
    report.target_fit = roofline.fit_roofline([(r.batch, r.step_ms) for r in rows]
                                              + [(r.batch * (k + 1), r.verify_step_ms) for r in rows])
    report.draft_fit = None
    if any(r.draft_step_ms for r in rows):
        report.draft_fit = roofline.fit_roofline([(r.batch, r.draft_step_ms) for r in rows]
                                                 + [(2 * r.batch, r.draft_step2_ms) for r in rows])
    target_fit, draft_fit = report.target_fit, report.draft_fit
    for r in rows:
        r.predicted_speedup = roofline.predicted_speedup(target_fit, r.batch, k, r.tokens_per_round,
                                                         draft_fit, r.plain_tokens_per_round)
        r.best_k, r.best_k_speedup = roofline.best_k(target_fit, r.batch, r.per_position_acceptance,
                                                     report.ks, draft_fit)
        r.plain_bound_ms = plain_bound_ms(report, r)
        weights_ms = 1000.0 * report.weight_bytes / report.bandwidth if report.bandwidth else 0.0
        r.plain_pct_bound = 100.0 * r.plain_bound_ms / r.plain_round_ms if r.plain_round_ms else 0.0
        r.plain_pct_weights = 100.0 * weights_ms / r.plain_round_ms if r.plain_round_ms else 0.0
    report.measured_crossover = roofline.crossover([r.batch for r in rows], [r.speedup for r in rows])
    report.predicted_crossover = None
    if rows:
        def tokens_ratio(b: float) -> float:
            return _tokens_ratio_at(rows, b)

        report.predicted_crossover = roofline.predicted_crossover(target_fit, k, tokens_ratio, draft_fit)
    return report


def plain_bound_ms(report: BatchReport, row: BatchRow) -> float:
    """The roofline bound of a plain round at the measured machine rates: the bytes it must read (every
    weight once, and the cache rows its attention reads) at the read bandwidth, or its products' FLOPs at
    the matmul rate if that takes longer. At B = 64 and 140 cached rows a sequence the 8B shape's cache
    reads are 7% of the bytes; at a few thousand rows they outweigh the weights."""
    if not report.bandwidth:
        return 0.0
    read = (report.weight_bytes + report.cache_bytes_per_row * row.plain_cache_rows) / report.bandwidth
    products = report.flops_per_token * row.batch / report.matmul_flops if report.matmul_flops else 0.0
    return 1000.0 * max(read, products)


MEASURED_ROW_FIELDS = ("batch", "plain_tokens_per_s", "spec_tokens_per_s", "tokens_per_round",
                       "plain_tokens_per_round", "acceptance_rate", "plain_round_ms", "spec_round_ms",
                       "step_ms", "verify_step_ms", "draft_step_ms", "draft_step2_ms",
                       "per_position_acceptance", "plain_cache_rows")


def refit_report(saved: dict) -> dict:
    """A saved report (BatchReport.as_dict, `bench batch --json`) with its fits and predictions made again by
    this build's model from the same measurements (rows and machine rates; nothing is re-measured)."""
    rows = []
    for r in saved["rows"]:
        row = BatchRow(**{name: r[name] for name in MEASURED_ROW_FIELDS if name in r})
        row.measured_k_speedups = {int(key): v for key, v in r.get("measured_k_speedups", {}).items()}
        rows.append(row)
    report = BatchReport(rows=rows, method=saved["method"], k=saved["k"], ks=list(saved["ks"]),
                         device=saved["device"], max_new_tokens=saved["max_new_tokens"],
                         target_fit=roofline.Roofline(0.0, 0.0), draft_fit=None,
                         weight_bytes=saved["weight_bytes"],
                         cache_bytes_per_row=saved.get("cache_bytes_per_row", 0),
                         flops_per_token=saved["flops_per_token"], bandwidth=saved["measured_bandwidth"],
                         matmul_flops=saved["measured_matmul_flops"], note=saved.get("note", ""))
    return predict(report).as_dict()


def _tokens_ratio_at(rows: List[BatchRow], batch: float) -> float:
    """E / E_plain of the measured batch nearest to `batch` (what the predictions between batches use)."""
    nearest = min(rows, key=lambda r: abs(r.batch - batch))
    return nearest.tokens_per_round / (nearest.plain_tokens_per_round or 1.0)


def predicted_curve(report: BatchReport, max_batch: Optional[float] = None, per_octave: int = 8) -> list:
    """[(batch, predicted speedup)] on a 1/per_octave-octave grid from the smallest measured batch to
    max_batch (default: the largest), E from the nearest measured batch: the roofline's curve between the
    measured points (equal to each row's predicted_speedup at its batch)."""
    if not report.rows:
        return []
    low = min(r.batch for r in report.rows)
    high = max(max_batch or 0.0, max(r.batch for r in report.rows))
    steps = int(math.floor(per_octave * math.log2(high / low) + 1e-9))
    grid = [low * 2 ** (i / per_octave) for i in range(steps + 1)]
    return [(b, roofline.predicted_speedup(report.target_fit, b, report.k, _tokens_ratio_at(report.rows, b),
                                           report.draft_fit)) for b in grid]


def _params(runner) -> int:
    """Weights a token multiplies by (the matrices of every layer and the LM head)."""
    total = sum(t.numel() for layer in runner.layers for t in vars(layer).values()
                if t is not None and t.dim() == 2)
    return total + runner.lm_head.numel()


def _free(decoder: BatchDecoder) -> None:
    """Drop this batch's caches and graphs before the next batch allocates its own."""
    decoder.free_caches()
    if decoder.device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ output
def _fmt_batch(value: Optional[float]) -> str:
    return "none in range" if value is None else f"B = {value:.1f}"


def format_report(report: BatchReport) -> str:
    return format_json(report.as_dict())


def format_json(d: dict) -> str:
    """The table of a report, from its as_dict() form (what `bench batch --json` prints)."""
    fit = d["fit"]
    knee = f"{fit['knee_tokens']:.0f} tokens/forward" if fit["knee_tokens"] is not None else "not reached"
    intercept = f" (line + {fit['intercept_ms']:.3f} ms)" if fit.get("intercept_ms") else ""
    lines = [f"device={d['device']} method={d['method']} K={d['k']} max_new_tokens={d['max_new_tokens']}",
             f"measured: read bandwidth {d['measured_bandwidth'] / 1e9:.1f} GB/s, matmul "
             f"{d['measured_matmul_flops'] / 1e12:.2f} TFLOP/s; "
             f"target weights {d['weight_bytes'] / 1e9:.3f} GB, cache "
             + (f"{d['cache_bytes_per_row'] / 1024:.0f} KiB a token" if d["cache_bytes_per_row"]
                else "not recorded (the bound is the weights')"),
             f"roofline fit: floor {fit['floor_ms']:.3f} ms, "
             f"{fit['ms_per_token'] * 1e3:.3f} us/token{intercept}, "
             f"knee {knee} (implies {d['fit_bandwidth'] / 1e9:.1f} GB/s, "
             f"{d['fit_matmul_flops'] / 1e12:.2f} TFLOP/s)"
             + (f", the roofs joined smoothly (p = {fit['smoothness']:g})" if fit.get("smoothness") else "")]
    header = (f"{'B':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'pred':>6} {'E':>5} "
              f"{'step B ms':>10} {'step B(K+1)':>12} {'draft ms':>9} {'round ms':>15} {'best K':>11} "
              f"{'bound ms':>9} {'%bound':>7} {'%wts':>6}")
    lines += [header, "-" * len(header)]
    for r in d["rows"]:
        rounds = f"{r['plain_round_ms']:.2f}/{r['spec_round_ms']:.2f}"
        best = f"{r['best_k']} ({r['best_k_speedup']:.2f}x)"
        lines.append(f"{r['batch']:>5} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>11.1f} "
                     f"{r['speedup']:>8.2f} {r['predicted_speedup']:>6.2f} {r['tokens_per_round']:>5.2f} "
                     f"{r['step_ms']:>10.3f} {r['verify_step_ms']:>12.3f} {r['draft_step_ms']:>9.3f} "
                     f"{rounds:>15} {best:>11} {r['plain_bound_ms']:>9.3f} "
                     f"{r['plain_pct_bound']:>7.1f} {r['plain_pct_weights']:>6.1f}")
        if r["measured_k_speedups"]:
            sweep = ", ".join(f"K={k}: {s:.2f}x" for k, s in r["measured_k_speedups"].items())
            lines.append(f"{'':>5} measured K sweep: {sweep}")
    lines.append("E: tokens per sequence per round; round ms: plain/speculative, measured; best K: predicted "
                 "(0 = speculation off); bound ms: the roofline bound of a plain round (its weights and the "
                 "cache rows it reads at the measured read rate); %bound: that bound / the measured plain "
                 "round; %wts: the weights' read time alone / the measured plain round")
    lines.append(f"crossover (speedup < 1): measured {_fmt_batch(d['measured_crossover'])}, "
                 f"predicted {_fmt_batch(d['predicted_crossover'])}")
    if d.get("note"):
        lines.append(d["note"])
    return "\n".join(lines)
