"""A measured cost model of a decoding round: t_round(K) = t_draft(method, K) + t_verify(block) + t_overhead.

Every term is timed on this machine. The verification forward is a curve over block sizes (a forward over 9
tokens is not one forward over 1 on a CPU); the draft cost is per method (the draft model's step, EAGLE's head
step, Medusa's one heads call, the bookkeeping of model-free drafters); the overhead is the round's host work.
`calibrate_costs` measures them with warm-ups and repeats (median and spread); `CostModel.refit` updates them
from the phase times every RoundEvent carries, so a prediction follows the machine the run actually had.

TPOT_pred(K) = t_round(K) / E(K) and speedup_pred = TPOT_plain / TPOT_pred, TPOT_plain being a plain round:
the measured plain rounds' own time when there are some (their phases add up to it whatever timed them), else
the one-token verification + the plain overhead. The textbook view, E / (1 + cK), is kept beside it with c
measured: one draft step over one plain verification.

Why a plain round is not one-token verification + overhead on a GPU: the verification curve is timed block by
block, host and device in step, while plain decoding keeps two rounds in flight, so its verification phase is
the device's time and its overhead the host's remainder; adding the curve's one-token point to that remainder
counted the host twice (a plain round of the shipped pair: 0.47 ms measured, about 0.6 ms that way).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

# block sizes timed: K + 1 for K = 0, 1, 2, 3, 4, 6, 8, 16, 32, 64 (the K sweep's blocks measured, not
# interpolated: with block 4 read off the line between 3 and 5, the CPU prediction at K = 3 was 17% off)
VERIFY_SIZES = (1, 2, 3, 4, 5, 7, 9, 17, 33, 65)
STEP_METHODS = ("draft", "eagle", "eagle3", "layerskip")  # drafters whose cost grows with the depth
SPIN_UP_MS = 60.0  # decoding before calibration times anything (see _spin_up)
MIN_OBSERVATIONS = 3  # rounds at one block size before the run's own median replaces the calibrated point


@dataclass(frozen=True)
class Measured:
    """A timing: the median of repeats and its spread (half the interquartile range), in ms."""

    median: float
    spread: float = 0.0
    n: int = 1

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Measured":
        return cls._summary(samples, statistics.median)

    @classmethod
    def mean_of(cls, samples: Sequence[float]) -> "Measured":
        """The mean (what a run's totals, and so its tokens/s, add up), with the half-IQR spread."""
        return cls._summary(samples, statistics.fmean)

    @classmethod
    def _summary(cls, samples: Sequence[float], centre: Callable[[list], float]) -> "Measured":
        """centre(samples) with the half-IQR spread; no samples: all zero."""
        values = sorted(float(s) for s in samples)
        if not values:
            return cls(0.0, 0.0, 0)
        return cls(centre(values), _half_iqr(values), len(values))

    def scaled(self, factor: float) -> "Measured":
        return Measured(self.median * factor, self.spread * factor, self.n)

    def to_list(self) -> list:
        return [self.median, self.spread, self.n]


@dataclass(frozen=True)
class RoundTiming:
    """One round's phase times and shape (from a RoundEvent or a trace record)."""

    method: str
    k: int
    block: int  # tokens in the verification forward (RoundEvent.verified_tokens): mostly drafted + 1
    depth: int  # draft positions (a tree's depth)
    draft_ms: float
    verify_ms: float
    overhead_ms: float


@dataclass
class CostModel:
    verify: dict = field(default_factory=dict)  # block size -> Measured ms of the verification phase
    draft_step: dict = field(default_factory=dict)  # method -> Measured ms per draft depth (STEP_METHODS)
    draft_fixed: dict = field(default_factory=dict)  # method -> Measured ms per round (heads call, lookup)
    overhead: dict = field(default_factory=dict)  # method -> Measured ms of host bookkeeping a round
    plain: Optional[Measured] = None  # a plain round's whole time, from plain rounds (None: not observed)
    source: str = "calibration"  # "calibration", "calibration + run", "trace only"
    # rounds overlap the device (the GPU's pipelined loop): a run's verification phases are device time, the
    # calibrated curve host and device in step, so their ratio is no load level to carry over to a plain round
    pipelined: bool = False

    # ------------------------------------------------------------------------------------------ the terms
    def t_verify(self, block: int) -> float:
        """The verification phase over `block` tokens: linear between measured sizes, extended linearly."""
        points = sorted((n, m.median) for n, m in self.verify.items())
        if not points:
            return 0.0
        if len(points) == 1 or block <= points[0][0]:
            return points[0][1] if len(points) == 1 else _line(points[0], points[1], block, floor=True)
        for a, b in zip(points, points[1:]):
            if block <= b[0]:
                return _line(a, b, block)
        return _line(points[-2], points[-1], block)

    def t_draft(self, method: str, depth: int) -> float:
        """Drafting a round of `depth` positions (0 for plain decoding)."""
        if method == "none" or depth <= 0:
            return 0.0
        step = self.draft_step.get(method)
        fixed = self.draft_fixed.get(method)
        return (step.median * depth if step else 0.0) + (fixed.median if fixed else 0.0)

    def t_overhead(self, method: str) -> float:
        measured = self.overhead.get(method) or self.overhead.get("none")
        return measured.median if measured else 0.0

    def t_round(self, method: str, k: int, block: Optional[int] = None) -> float:
        """A round that drafts K positions (a chain: block K + 1; a tree: give its block)."""
        if method == "none" or k <= 0:
            return self.t_plain
        return self.t_draft(method, k) + self.t_verify(block or k + 1) + self.t_overhead(method)

    @property
    def t_plain(self) -> float:
        """A plain round (TPOT_plain): the plain rounds' measured time, else one-token verification and the
        plain bookkeeping."""
        if self.plain is not None and self.plain.median > 0:
            return self.plain.median
        return self.t_verify(1) + self.t_overhead("none")

    def tpot(self, method: str, k: int, expected: float, block: Optional[int] = None) -> float:
        """TPOT_pred = t_round / E."""
        return self.t_round(method, k, block) / max(expected, 1e-9)

    def speedup(self, method: str, k: int, expected: float, block: Optional[int] = None) -> float:
        """speedup_pred = TPOT_plain / TPOT_pred."""
        tpot = self.tpot(method, k, expected, block)
        return self.t_plain / tpot if tpot > 0 else 0.0

    def c(self, method: str) -> float:
        """The textbook c: one draft step over one plain verification. For step methods the step is the
        marginal one (the per-round part is not in 1 + cK); a drafter that costs per round, not per token,
        shows that cost (its bookkeeping) rather than a flat 0."""
        plain = self.t_verify(1)
        if plain <= 0 or method == "none":
            return 0.0
        step = self.draft_step.get(method)
        return (step.median if step else self.t_draft(method, 1)) / plain

    def c_spread(self, method: str) -> float:
        """c's spread, from the spreads of its two timings (relative errors added)."""
        plain, step = self.verify.get(1), self.draft_step.get(method) or self.draft_fixed.get(method)
        if plain is None or step is None or plain.median <= 0 or step.median <= 0:
            return 0.0
        return self.c(method) * (plain.spread / plain.median + step.spread / step.median)

    # ------------------------------------------------------------------------------------------ live refit
    def refit(self, rounds: Iterable[RoundTiming], keep_shape: bool = False) -> "CostModel":
        """A copy updated from a run's phase times. The verification curve keeps its calibrated shape and
        takes the run's level (median ratio observed / calibrated: the machine as loaded during the run), and
        each block size the run timed often enough takes the run's own mean; the method's draft cost and
        overhead become the run's means (means, not medians: a run's tokens/s adds up its rounds' times).
        keep_shape: only the level changes (calibration itself, whose forwards are the better shape)."""
        rounds = list(rounds)
        if not rounds:
            return self
        model = replace(self, verify=dict(self.verify), draft_step=dict(self.draft_step),
                        draft_fixed=dict(self.draft_fixed), overhead=dict(self.overhead),
                        source="calibration + run" if self.verify else "trace only")
        level = model._refit_verify(rounds, keep_shape)
        plain = [r.draft_ms + r.verify_ms + r.overhead_ms for r in rounds if r.method == "none"]
        if plain:
            model.plain = Measured.mean_of(plain)
        elif model.plain is not None and not model.pipelined:  # the machine's load, as the run saw it
            model.plain = model.plain.scaled(level)
        for method in {r.method for r in rounds}:
            mine = [r for r in rounds if r.method == method]
            model.overhead[method] = Measured.mean_of([r.overhead_ms for r in mine])
            if method != "none":
                model._refit_draft(method, [r for r in mine if r.depth > 0])
        return model

    def _refit_verify(self, rounds: list, keep_shape: bool) -> float:
        """Rescale the curve to the run's level and take the run's own points; returns the level."""
        by_block: dict = {}
        for r in rounds:
            by_block.setdefault(r.block, []).append(r.verify_ms)
        level = 1.0
        if self.verify:
            ratios = [statistics.median(v) / self.t_verify(n) for n, v in by_block.items()
                      if self.t_verify(n) > 0]
            if ratios:
                level = statistics.median(ratios)
                self.verify = {n: m.scaled(level) for n, m in self.verify.items()}
        for n, values in by_block.items():
            if not self.verify or (len(values) >= MIN_OBSERVATIONS and not keep_shape):
                self.verify[n] = Measured.mean_of(values)
        return level

    def _refit_draft(self, method: str, rounds: list) -> None:
        """Step methods cost fixed + step x depth: with a calibrated split, the run rescales both (one run at
        one K cannot separate them); without one, the run's cost is all step. Other methods: a cost a
        round."""
        if not rounds:
            return
        mean = Measured.mean_of([r.draft_ms for r in rounds])
        if method not in STEP_METHODS:
            self.draft_fixed[method] = mean
            return
        depth = statistics.fmean(r.depth for r in rounds)
        calibrated = self.t_draft(method, depth) if method in self.draft_step else 0.0
        if calibrated > 0:
            level = mean.median / calibrated
            self.draft_step[method] = self.draft_step[method].scaled(level)
            if method in self.draft_fixed:
                self.draft_fixed[method] = self.draft_fixed[method].scaled(level)
        else:
            self.draft_step[method] = Measured.mean_of([r.draft_ms / r.depth for r in rounds])
            self.draft_fixed.pop(method, None)

    def fit_draft(self, method: str, short: list, long: list) -> None:
        """Split a step method's cost into fixed + step x depth from runs at two draft depths."""
        d1, d2 = (statistics.fmean(r.depth for r in rs) for rs in (short, long))
        t1, t2 = (Measured.mean_of([r.draft_ms for r in rs]) for rs in (short, long))
        # the step from the medians (a difference of two means carries every hiccup of either run into c);
        # the fixed part from the long run's mean, so that fixed + step x depth still adds up to its total
        m1, m2 = (Measured.of([r.draft_ms for r in rs]).median for rs in (short, long))
        step = max(0.0, (m2 - m1) / (d2 - d1)) if d2 > d1 else m2 / max(d2, 1)
        fixed = max(0.0, t2.median - step * d2)
        self.draft_step[method] = Measured(step, t2.spread / max(d2, 1), t2.n)
        self.draft_fixed[method] = Measured(fixed, t1.spread, t1.n)

    # ------------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"verify": {str(n): m.to_list() for n, m in self.verify.items()},
                "draft_step": {k: m.to_list() for k, m in self.draft_step.items()},
                "draft_fixed": {k: m.to_list() for k, m in self.draft_fixed.items()},
                "overhead": {k: m.to_list() for k, m in self.overhead.items()},
                "plain": self.plain.to_list() if self.plain is not None else None, "source": self.source,
                "pipelined": self.pipelined}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        def table(name, key=str):
            return {key(k): Measured(*v) for k, v in data.get(name, {}).items()}

        plain = data.get("plain")
        return cls(verify=table("verify", int), draft_step=table("draft_step"),
                   draft_fixed=table("draft_fixed"), overhead=table("overhead"),
                   plain=Measured(*plain) if plain else None, source=data.get("source", "calibration"),
                   pipelined=bool(data.get("pipelined", False)))

    def describe(self, method: str, plain: bool = True) -> str:
        """One line of the figures and their spread. plain=False leaves out the cost model's own plain round
        (t_plain), for a view that shows TPOT_plain from one source of its own."""
        v1 = self.verify.get(1, Measured(self.t_verify(1)))
        step, fixed = self.draft_step.get(method), self.draft_fixed.get(method)
        draft = " + ".join(part for part in (f"{step.median:.2f} ms a step" if step else "",
                                             f"{fixed.median:.2f} ms a round" if fixed else "") if part)
        head = f"t_plain = {self.t_plain:.2f} ms, " if plain else ""
        return (f"{head}t_verify(1) = {v1.median:.2f} ± {v1.spread:.2f} ms, "
                f"t_verify(9) = {self.t_verify(9):.2f} ms, draft = {draft or '0'}, "
                f"overhead = {self.t_overhead(method):.2f} ms, c = {self.c(method):.3f} ± "
                f"{self.c_spread(method):.3f} ({self.source})")


def _half_iqr(values: list) -> float:
    if len(values) < 4:
        return (values[-1] - values[0]) / 2
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2


def _line(a: tuple, b: tuple, x: float, floor: bool = False) -> float:
    (x0, y0), (x1, y1) = a, b
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.0) if not floor else max(min(y, y0), 0.0)


# ------------------------------------------------------------------------------------------------ calibration
def round_robin_curve(time_block: Callable[[int], float], sizes: Sequence[int], warmup: int = 2,
                      repeats: int = 5) -> dict:
    """time_block(n) -> ms for each n in sizes, timed round-robin (one of each size a repeat). Each size is
    kept as its median ratio to the one-token time of the same repeat, times the one-token median: a burst of
    load from other processes then moves the level, not the shape. Returns {n: Measured}."""
    sizes = sorted(set(sizes) | {1})
    samples: dict = {n: [] for n in sizes}
    for i in range(warmup + repeats):
        for n in sizes:
            elapsed = time_block(n)
            if i >= warmup:
                samples[n].append(elapsed)
    one = Measured.of(samples[1])
    out = {1: one}
    for n in sizes[1:]:
        ratios = Measured.of([t / max(t1, 1e-9) for t, t1 in zip(samples[n], samples[1])])
        out[n] = Measured(ratios.median * one.median, ratios.spread * one.median, ratios.n)
    return out


def time_forward_curve(runner, probe_ids: list, sizes: Sequence[int], warmup: int = 2, repeats: int = 5,
                       prefix: int = 32) -> dict:
    """Raw forwards of a runner over n tokens after a `prefix`-token context (round_robin_curve); for a
    decoder, SpeculativeDecoder.verify_curve times the whole verification phase instead."""
    import torch

    from engine.bench.timing import Stopwatch

    sizes = [n for n in sizes if prefix + n <= runner.max_length]
    ids = (list(probe_ids) * (1 + (prefix + max(sizes)) // max(1, len(probe_ids))))[:prefix + max(sizes)]
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)

    def time_block(n: int) -> float:
        watch = Stopwatch(runner.device)
        runner.forward(tokens[prefix:prefix + n])
        elapsed = watch.elapsed_ms()
        runner.rollback(prefix)
        return elapsed

    with torch.inference_mode():
        runner.reset()
        runner.forward(tokens[:prefix])
        curve = round_robin_curve(time_block, sizes, warmup, repeats)
        runner.reset()
    return curve


def calibrate_costs(decoder, prompt: str, methods: Sequence[str], k: int = 4, repeats: int = 5,
                    warmup: int = 2, sizes: Sequence[int] = VERIFY_SIZES, tokens: int = 24,
                    sampling=None) -> CostModel:
    """Measure the cost model on this machine.

    The verification curve: the decoder's verification phase over each block size (round-robin, see
    round_robin_curve; raw target forwards for a decoder that cannot time its phase). The
    draft and overhead terms: short generations of plain decoding and of each method at K (each warmed up
    once, then timed round-robin after a spin-up), their phase times; their verification phases refit the
    curve's level like a live run would, and the plain runs' rounds from the second on give TPOT_plain.
    sampling: the SamplingParams the predictions are for (default greedy): a sampled round does more work
    (on the H200 a sampled plain round cost 15% more than a greedy one)."""
    from engine.config import GenerationConfig, SamplingParams

    curve_repeats = 6 * repeats  # one forward of each size a repeat: cheap, and the shape needs them
    if hasattr(decoder, "verify_curve"):
        curve = decoder.verify_curve(prompt, sizes, warmup, curve_repeats)
    else:
        curve = time_forward_curve(decoder.target, decoder.tokenizer.encode(prompt) or [0], sizes, warmup,
                                   curve_repeats)
    model = CostModel(verify=curve, pipelined=bool(getattr(decoder, "pipelined", False)))
    sampling = sampling or SamplingParams()
    configs = [(method, GenerationConfig(method=method, k=depth, sampling=sampling, max_new_tokens=tokens,
                                         stop_at_eos=False))
               for method in ["none"] + [m for m in methods if m != "none"]
               for depth in ((1, max(k, 2)) if method in STEP_METHODS else (k,))]
    for _, config in configs:  # kernels compiled, graphs captured
        for _ in range(max(1, warmup // 2)):
            list(decoder.generate(prompt, replace(config, max_new_tokens=4)))
    _spin_up(decoder, prompt, configs[0][1])
    # round-robin over the configurations: a slow stretch of the machine (a host-bound GPU round doubled in
    # time for tens of ms after the host idled) lands on all of them alike, not on the one timed then
    timed: list = [[] for _ in configs]
    for _ in range(max(1, repeats // 2)):
        for rounds, (method, config) in zip(timed, configs):
            # TPOT_plain from steady-state rounds: on a GPU a generation's first round also waits for the
            # prefill, which a short calibration run spreads over a few rounds (a long run over many)
            rounds += [timing_of(e) for e in decoder.generate(prompt, config)
                       if e.round > 0 or method != "none"]
    runs, by_method = [], {}
    for rounds, (method, _) in zip(timed, configs):
        by_method.setdefault(method, []).append(rounds)
        runs += rounds
    model = model.refit(runs, keep_shape=True)
    for method, (short, *rest) in by_method.items():
        if method in STEP_METHODS and rest:
            model.fit_draft(method, [r for r in short if r.depth], [r for r in rest[0] if r.depth])
    model.source = "calibration"
    return model


def _spin_up(decoder, prompt: str, config, min_ms: float = SPIN_UP_MS) -> None:
    """Decode until min_ms have passed (one generation at least): the host's clocks up before timing."""
    import time

    start = time.perf_counter()
    while True:
        list(decoder.generate(prompt, config))
        if (time.perf_counter() - start) * 1000.0 >= min_ms:
            return


def timing_of(event) -> RoundTiming:
    """The phase times of a RoundEvent or of a trace record (a dict), at the block the round verified."""
    if isinstance(event, dict):
        drafted = event.get("drafted", [])
        depth = 1 + max((d["depth"] for d in drafted), default=-1)
        block = event.get("verified_tokens") or len(drafted) + 1
        return RoundTiming(event["method"], event["k"], block, depth, event["draft_ms"], event["verify_ms"],
                           event["overhead_ms"])
    depth = 1 + max((d.depth for d in event.drafted), default=-1)
    block = getattr(event, "verified_tokens", None) or len(event.drafted) + 1
    return RoundTiming(event.method, event.k, block, depth, event.draft_ms, event.verify_ms,
                       event.overhead_ms)


def from_trace(rounds: Iterable[RoundTiming]) -> CostModel:
    """A cost model from a run's phase times alone (no calibration): the verification curve has only the
    block sizes the run used, flat beyond them, and the plain round is assumed to cost the run's smallest
    verification (a memory-bound assumption; calibrate for a real curve)."""
    model = CostModel().refit(rounds)
    model.source = "trace only"
    if 1 not in model.verify and model.verify:
        smallest = min(model.verify)
        model.verify[1] = model.verify[smallest]
    if "none" not in model.overhead and model.overhead:
        model.overhead["none"] = min(model.overhead.values(), key=lambda m: m.median)
    return model
