"""Where a K sweep's predictions part from its measurements: calibration's rounds beside a sweep's, round by
round, on the shipped pair (or --target/--draft).

    python scripts/calibration_probe.py --device cuda [--json out.json]

Prints, for plain decoding and the draft model at two K: each round's time (ms) as calibration runs it (its
prompt, short generations) and as a sweep runs it (held-out prompts, 128 tokens), the phase means, and the
cost model that calibration measured (three times: its spread). Then the K sweep itself with every column,
and the prediction from its largest K's run alone (engine.predict)."""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import bench  # noqa: E402
from engine.config import GenerationConfig  # noqa: E402
from engine.decoder import SpeculativeDecoder  # noqa: E402
from engine.models import load_pair  # noqa: E402
from engine.predict import format_report, predict_from_trace, trace_from_events  # noqa: E402

CALIBRATION_PROMPT = "def merge(a, b):\n    "


def round_ms(event) -> float:
    return event.draft_ms + event.verify_ms + event.overhead_ms


def rounds_of(decoder, prompt: str, config: GenerationConfig) -> list:
    return list(decoder.generate(prompt, config))


def summary(label: str, generations: list) -> dict:
    """Per-round times of some generations: all rounds, the first ones, the steady ones, the last ones."""
    times = [[round_ms(e) for e in g] for g in generations]
    flat = [t for g in times for t in g[1:]]
    phases = {p: statistics.fmean(getattr(e, p) for g in generations for e in g[1:])
              for p in ("draft_ms", "verify_ms", "overhead_ms")}
    out = {"label": label, "rounds": sum(len(g) for g in times),
           "tokens": sum(len(e.emitted_ids) for g in generations for e in g),
           "mean_ms_from_round_1": statistics.fmean(flat) if flat else 0.0,
           "median_ms_from_round_1": statistics.median(flat) if flat else 0.0,
           "mean_ms_all": statistics.fmean(t for g in times for t in g),
           "first_rounds_ms": [round(t, 3) for t in times[0][:6]],
           "last_rounds_ms": [round(t, 3) for t in times[0][-4:]],
           "steady_mean_ms": (statistics.fmean(t for g in times for t in g[4:-2])
                              if len(times[0]) > 8 else None),
           "phases_from_round_1": {k: round(v, 4) for k, v in phases.items()}}
    total_ms = sum(t for g in times for t in g)
    out["ms_per_token_all"] = total_ms / max(1, out["tokens"])
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    decoder = SpeculativeDecoder(load_pair(args.target, args.draft, device=args.device))
    decoder.warm_up()
    prompts = bench.heldout_prompts(args.prompts)
    ks = [int(k) for k in args.ks.split(",")]
    report: dict = {"calibrations": [], "rounds": []}

    for attempt in range(3):
        start = time.perf_counter()
        costs = decoder.calibrate(max(ks)).costs
        report["calibrations"].append({"seconds": time.perf_counter() - start, "costs": costs.to_dict(),
                                       "c_draft": costs.c("draft")})
        print(f"calibration {attempt}: {costs.describe('draft')}", flush=True)

    plain = GenerationConfig(method="none", k=1, stop_at_eos=False)
    twice = [CALIBRATION_PROMPT] * 2
    for label, prompt_list, tokens in (("plain, calibration's prompt, 24 tokens", twice, 24),
                                       ("plain, calibration's prompt, 128 tokens", twice, 128),
                                       ("plain, held-out prompts, 128 tokens", prompts, 128)):
        gens = [rounds_of(decoder, p, replace(plain, max_new_tokens=tokens)) for p in prompt_list]
        report["rounds"].append(summary(label, gens))
    for k in (1, max(ks)):
        config = GenerationConfig(method="draft", k=k, stop_at_eos=False)
        for label, prompt_list, tokens in ((f"draft K={k}, calibration's prompt, 24 tokens",
                                            [CALIBRATION_PROMPT] * 2, 24),
                                           (f"draft K={k}, held-out prompts, 128 tokens", prompts, 128)):
            rounds_of(decoder, prompt_list[0], replace(config, max_new_tokens=8))
            gens = [rounds_of(decoder, p, replace(config, max_new_tokens=tokens)) for p in prompt_list]
            report["rounds"].append(summary(label, gens))

    base = GenerationConfig(method="draft", k=4, max_new_tokens=128)
    rows = bench.bench_k_sweep(decoder, prompts, base, ks)
    report["sweep"] = rows
    for row in rows:
        rounded = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(rounded), flush=True)

    costs = decoder.calibrate(max(ks)).costs
    events = [(i, e) for i, p in enumerate(prompts)
              for e in rounds_of(decoder, p, replace(base, k=max(ks)))]
    text = format_report(predict_from_trace(trace_from_events(events), ks, costs))
    print(text, flush=True)
    report["from_largest_k"] = text
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
