"""`bench runtimes`: specplay's methods and HF transformers' `generate` side by side, in one process, on the
same prompts and pair, end to end (what a user waits for), with the time to first token apart and the target's
weight-read floor measured on this machine beside them.

Every runtime gets one warm-up generation on a prompt that is not measured (kernels compiled, graphs
captured), so the measured prompts' lengths are new to it: their time to first token includes what a new
length costs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch

from engine.config import GenerationConfig
from engine.errors import SpecplayError

WARM_UP_PROMPT = "import math\n\n\ndef warm_up(values):\n    "
HF_RUNTIMES = ("hf-eager", "hf-assisted", "hf-lookup", "hf-compile")
DEFAULT_HF = ("hf-eager", "hf-assisted", "hf-lookup")


@dataclass
class RuntimeRow:
    runtime: str
    tokens: int = 0
    seconds: float = 0.0  # end to end, every prompt
    first_token_ms: list = field(default_factory=list)  # per prompt
    forwards: int = 0  # target forwards (specplay only; 0 = not known)
    note: str = ""
    # specplay only: the rounds' phase totals (ms) and draft positions, for c and the round time
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    round_ms: float = 0.0
    depth: int = 0  # draft positions over every round (a tree's depth)
    depths: dict = field(default_factory=dict)  # a round's draft depth -> rounds that drafted that deep
    spec: str = ""  # specplay only: the method spec ("draft", "eagle:8")
    k: int = 0  # specplay only: the K it ran at
    predicted: dict = field(default_factory=dict)  # the cost model's figures beside the measured ones

    @property
    def mean_round_ms(self) -> float:
        return self.round_ms / self.forwards if self.forwards else 0.0

    @property
    def round_tokens_per_s(self) -> float:
        """Tokens over the rounds' own time (the prefill apart): what the cost model predicts."""
        return 1000.0 * self.tokens / self.round_ms if self.round_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / self.tokens if self.tokens else 0.0

    @property
    def ttft_ms(self) -> float:
        return statistics.median(self.first_token_ms) if self.first_token_ms else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def as_dict(self, floor_ms: float) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "first_token_ms"}
        out.update(mean_round_ms=self.mean_round_ms, round_tokens_per_s=self.round_tokens_per_s)
        out.update(tokens_per_s=self.tokens_per_s, ms_per_token=self.ms_per_token, ttft_ms=self.ttft_ms,
                   tokens_per_forward=self.tokens_per_forward,
                   pct_of_floor=(100.0 * floor_ms / self.ms_per_token
                                 if floor_ms and self.ms_per_token else 0.0))
        return out


# ------------------------------------------------------------------------------------------------ the floor
def measure_read_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Bytes per second a reduction reads from device memory (best of `repeats`); 0 on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    data = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        data.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del data
    return gib * 2**30 / best


def floor_ms(weight_bytes: int, bandwidth: float) -> float:
    """The weight-read floor of one decode step: every weight read once at the measured bandwidth."""
    return 1000.0 * weight_bytes / bandwidth if bandwidth else 0.0


# ------------------------------------------------------------------------------------------------ timing
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_specplay(decoder, prompts: list, config: GenerationConfig, label: str) -> RuntimeRow:
    """End-to-end wall clock of decoder.generate on each prompt; first token = the first event."""
    list(decoder.generate(WARM_UP_PROMPT, config))
    row = RuntimeRow(label)
    split = getattr(decoder.target, "tp", 1) > 1  # engine.models.tp's TPRunner: it counts its all-reduce time
    since = (decoder.target.allreduce_s, decoder.target.forwards) if split else None
    for prompt in prompts:
        _sync(decoder.device)
        began = time.perf_counter()
        first = None
        events = []
        for event in decoder.generate(prompt, config):
            if first is None:
                _sync(decoder.device)
                first = time.perf_counter()
            events.append(event)
        _sync(decoder.device)
        row.seconds += time.perf_counter() - began
        row.first_token_ms.append(1000.0 * (first - began))
        row.tokens += sum(len(e.emitted_ids) for e in events)
        row.forwards += len(events)
        _add_phases(row, events)
    if since is not None:
        row.note = _allreduce_note(decoder.target, *since)
    return row


def _add_phases(row: RuntimeRow, events: list) -> None:
    for e in events:
        row.draft_ms += e.draft_ms
        row.verify_ms += e.verify_ms
        row.round_ms += e.round_ms
        depth = 1 + max((d.depth for d in e.drafted), default=-1)
        row.depth += depth
        row.depths[depth] = row.depths.get(depth, 0) + 1


def _allreduce_note(target, since_s: float, since_steps: int) -> str:
    """A tensor-parallel target's all-reduce time per target step since (since_s, since_steps): host time
    around the collectives (the whole wait with gloo; on CUDA only the launch, NCCL runs asynchronously)."""
    steps = target.forwards - since_steps
    ms = 1000.0 * (target.allreduce_s - since_s) / steps if steps else 0.0
    return f"tp={target.tp}: all-reduce {ms:.3f} ms/step"


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (the first put is the
    prompt)."""

    def __init__(self, device):
        self.device = device
        self.puts = 0
        self.first: Optional[float] = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            _sync(self.device)
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def time_hf(generate: Callable, device, prompt_ids: list, warm_ids: list, label: str) -> RuntimeRow:
    """End-to-end wall clock of one transformers generate call per prompt."""
    generate(warm_ids, None)
    row = RuntimeRow(label)
    for ids in prompt_ids:
        clock = _FirstTokenClock(device)
        _sync(device)
        began = time.perf_counter()
        new_tokens = generate(ids, clock)
        _sync(device)
        row.seconds += time.perf_counter() - began
        row.first_token_ms.append(1000.0 * ((clock.first or time.perf_counter()) - began))
        row.tokens += new_tokens
    return row


def hf_generator(model, device, max_new_tokens: int, **options) -> Callable:
    """generate(ids, streamer) -> count of new tokens, greedy, for one of the HF runtimes."""

    def generate(ids: list, streamer) -> int:
        inputs = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                 max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                                 pad_token_id=0, **options)
        return int(out.shape[1] - inputs.shape[1])

    return generate


def hf_options(runtime: str, model, hf_draft, k: int) -> tuple:
    """(model to call, generate options, note) for an HF runtime name."""
    if runtime == "hf-eager":
        return model, {}, "dynamic cache, eager"
    if runtime == "hf-assisted":
        if hf_draft is None:
            raise SpecplayError("hf-assisted needs a draft model")
        gen = hf_draft.generation_config
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = k, "constant"
        gen.assistant_confidence_threshold = 0.0
        return model, {"assistant_model": hf_draft}, f"assisted generation, same draft, K={k}"
    if runtime == "hf-lookup":
        return model, {"prompt_lookup_num_tokens": k}, f"prompt lookup, K={k}"
    if runtime == "hf-compile":
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        return model, {"cache_implementation": "static"}, "static cache + torch.compile"
    raise SpecplayError(f"unknown runtime {runtime!r}; choose from: {', '.join(HF_RUNTIMES)}")


# ------------------------------------------------------------------------------------------------ the bench
@dataclass
class RuntimesReport:
    rows: list  # [RuntimeRow]
    device: str
    bandwidth: float  # bytes/s measured
    weight_bytes: int
    floor_ms: float
    prompts: int
    max_new_tokens: int
    synthetic_acceptance: str = ""  # the profile the verdicts followed ("" = the target's own)
    left_out: dict = field(default_factory=dict)  # method spec -> why it could not run on this pair

    def as_dict(self) -> dict:
        return {"device": self.device, "bandwidth_tb_s": self.bandwidth / 1e12,
                "weight_bytes": self.weight_bytes, "floor_ms_per_token": self.floor_ms,
                "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
                "synthetic_acceptance": self.synthetic_acceptance, "left_out": dict(self.left_out),
                "rows": [r.as_dict(self.floor_ms) for r in self.rows]}


def bench_runtimes(decoder, prompts: list, config: GenerationConfig, specs: list, hf_runtimes: list,
                   hf_target=None, hf_draft=None, progress: Optional[Callable] = None,
                   ks: Optional[list] = None) -> RuntimesReport:
    """Each specplay method spec (e.g. 'none', 'draft', 'eagle:8') at each K of ks (default: config.k; plain
    decoding once) and each HF runtime on the same prompts."""
    from engine.models.synthetic import weight_bytes_per_step

    rows, left_out = [], {}
    availability = decoder.method_availability() if hasattr(decoder, "method_availability") else {}
    ks = list(ks or [config.k])
    for spec in specs:
        reason = availability.get(config.with_spec(spec).method)
        if reason is not None:  # a head this pair lacks: the other methods still run
            left_out[spec] = reason
            continue
        for k in ([config.k] if config.with_spec(spec).method == "none" else ks):
            label = f"specplay {spec}" + (f" K={k}" if len(ks) > 1 and spec != "none" else "")
            row = time_specplay(decoder, prompts, replace(config.with_spec(spec), k=k), label)
            row.spec, row.k = spec, k
            rows.append(_report(row, progress))
    if hf_runtimes:
        tok = decoder.tokenizer
        prompt_ids = [tok.encode(p) for p in prompts]
        warm_ids = tok.encode(WARM_UP_PROMPT)
        for runtime in hf_runtimes:
            model, options, note = hf_options(runtime, hf_target, hf_draft, config.k)
            generate = hf_generator(model, decoder.device, config.max_new_tokens, **options)
            row = time_hf(generate, decoder.device, prompt_ids, warm_ids, runtime)
            row.note = note
            rows.append(_report(row, progress))
    bandwidth = measure_read_bandwidth(decoder.device)
    weight_bytes = weight_bytes_per_step(decoder.target) if hasattr(decoder.target, "layers") else 0
    return RuntimesReport(rows, decoder.device_name, bandwidth, weight_bytes,
                          floor_ms(weight_bytes, bandwidth), len(prompts), config.max_new_tokens,
                          config.synthetic_acceptance, left_out)


# ------------------------------------------------------------------------------------------------ predictions
def add_predictions(report: RuntimesReport, costs, config: GenerationConfig) -> None:
    """Beside each specplay row, measured and predicted: c, the round time, tokens/s over the rounds, the
    speedup over plain decoding's rounds (the 'specplay none' row) and E. The prediction is the calibrated
    cost model (engine.analysis.costmodel) at E from the synthetic profile: t_round(K) / E against t_plain,
    and the textbook E / (1 + cK) with the calibrated c. Needs a synthetic profile (E known in advance)."""
    from engine.core.synthetic import SyntheticAcceptance
    from engine.methods import registry

    profile = SyntheticAcceptance.parse(config.synthetic_acceptance)
    plain = next((r for r in report.rows if r.spec == "none"), None)
    if profile is None or plain is None or not plain.forwards:
        return
    plain_verify_ms = plain.verify_ms / plain.forwards
    for row in report.rows:
        if not row.spec or not row.forwards:
            continue
        spec = replace(config.with_spec(row.spec), k=row.k)
        drafts = spec.drafts
        nodes = registry.node_budget(spec)(spec.k) if registry.get(spec.method).is_tree(spec) else 0
        expected = expected_at_depths(profile, spec.k, row.depths) if drafts else 1.0
        round_ms = costs.t_round(spec.method, drafts, (nodes or drafts) + 1)
        c = costs.c(spec.method)
        row.predicted = {
            "e": expected, "c": c, "round_ms": round_ms,
            "tokens_per_s": 1000.0 * expected / round_ms if round_ms else 0.0,
            "speedup": costs.speedup(spec.method, drafts, expected, (nodes or drafts) + 1) if drafts else 1.0,
            "textbook_speedup": expected / (1.0 + c * drafts),
            # both draft times a drafted position over plain decoding's verification: what the round costs
            # per position, the per-round part of a head's step included
            "draft_c": _ratio(costs.t_draft(spec.method, drafts) / max(drafts, 1), plain_verify_ms),
            "measured_e": row.tokens / row.forwards,
            "measured_c": _ratio(row.draft_ms / row.depth if row.depth else 0.0, plain_verify_ms),
            "measured_speedup": _ratio(row.round_tokens_per_s, plain.round_tokens_per_s)}
        # the cost model alone: its round times at the E the rounds reached (a short run's E strays from
        # the profile's by chance)
        row.predicted["speedup_at_measured_e"] = _ratio(costs.t_plain * row.predicted["measured_e"], round_ms)


def expected_at_depths(profile, k: int, depths: dict) -> float:
    """E the profile gives the rounds as deep as they were drafted (depth -> rounds): K for a chain, what
    the drafter chose for a tree (a shallow Medusa tree accepts fewer whatever the profile); E(K) when no
    round was seen."""
    rounds = sum(depths.values())
    if not rounds:
        return profile.expected_tokens(k)
    return sum(n * profile.expected_tokens(k, depth=min(d, k)) for d, n in depths.items()) / rounds


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def format_predictions(report: RuntimesReport) -> str:
    """The measured figures and the cost model's side by side, one line a specplay method ('' if none)."""
    rows = [r for r in report.rows if r.predicted]
    if not rows:
        return ""
    header = (f"{'method':<18} {'E meas/pred':>12} {'draft c meas/pred':>18} {'round ms meas/pred':>19} "
              f"{'tok/s meas/pred':>17} {'speedup meas/pred':>18} {'at meas E':>9} {'E/(1+cK)':>9}")
    lines = ["measured against predicted (the rounds' own time, the prefill apart; predicted: the calibrated "
             "cost model at E from the synthetic profile, at the depths each method drafted; draft c: draft "
             "time a drafted position over a plain verification)", header, "-" * len(header)]
    for row in rows:
        p = row.predicted
        lines.append(f"{row.runtime.removeprefix('specplay '):<18} "
                     f"{p['measured_e']:>5.2f}/{p['e']:<6.2f} {p['measured_c']:>9.3f}/{p['draft_c']:<8.3f} "
                     f"{row.mean_round_ms:>9.3f}/{p['round_ms']:<9.3f} "
                     f"{row.round_tokens_per_s:>8.1f}/{p['tokens_per_s']:<8.1f} "
                     f"{p['measured_speedup']:>8.2f}/{p['speedup']:<9.2f} {p['speedup_at_measured_e']:>9.2f} "
                     f"{p['textbook_speedup']:>9.2f}")
    return "\n".join(lines)


def _report(row: RuntimeRow, progress) -> RuntimeRow:
    if progress is not None:
        progress(row)
    return row


def load_hf_models(target_dir, draft_dir, device, dtype) -> tuple:
    """The pair as transformers models, for the HF runtimes (local files only, no remote code)."""
    from transformers import AutoModelForCausalLM

    def load(path):
        if path is None:
            return None
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True)
        return model.to(device).eval()

    return load(target_dir), load(draft_dir)


def format_report(report: RuntimesReport) -> str:
    lines = [f"device={report.device} prompts={report.prompts} max_new_tokens={report.max_new_tokens} "
             f"read bandwidth={report.bandwidth / 1e12:.2f} TB/s (measured) "
             f"target weights={report.weight_bytes / 1e9:.3f} GB floor={report.floor_ms:.3f} ms/token"]
    header = (f"{'runtime':<22} {'tokens/s':>10} {'ms/token':>9} {'TTFT ms':>8} {'tok/fwd':>8} "
              f"{'% floor':>8}  note")
    lines += [header, "-" * len(header)]
    for row in report.rows:
        d = row.as_dict(report.floor_ms)
        tpf = f"{d['tokens_per_forward']:.2f}" if row.forwards else "-"
        pct = f"{d['pct_of_floor']:.1f}" if report.floor_ms else "-"
        lines.append(f"{row.runtime:<22} {d['tokens_per_s']:>10.1f} {d['ms_per_token']:>9.3f} "
                     f"{d['ttft_ms']:>8.2f} {tpf:>8} {pct:>8}  {row.note}")
    lines += [f"left out {spec}: {reason}" for spec, reason in report.left_out.items()]
    predictions = format_predictions(report)
    if predictions:
        lines += ["", predictions]
    if report.synthetic_acceptance:
        from engine.core.synthetic import NOTE

        lines.append(f"{NOTE}: {report.synthetic_acceptance}")
    return "\n".join(lines)
