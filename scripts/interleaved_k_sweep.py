"""An interleaved K sweep: predicted (from the K = max run alone + calibration) against measured speedups.

`bench k-sweep` measures plain decoding once, then each K in turn; on a loaded machine the load then differs
between the baseline and each K. Here every prompt runs plain and every K back to back, `--reps` times (the K
order reversed every other repeat), so a burst of load falls on all of them alike.

    python scripts/interleaved_k_sweep.py --ks 1,2,3,4,6,8 --prompts 4 --max-new-tokens 64 [--temperature 0.8]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import bench  # noqa: E402
from engine.cli import build_parser, load_decoder  # noqa: E402
from engine.config import GenerationConfig, SamplingParams  # noqa: E402
from engine.costmodel import timing_of  # noqa: E402
from engine.metrics import RunTotals, final_metrics  # noqa: E402
from engine.predict import predict_from_trace, trace_from_events  # noqa: E402


def sweep(decoder, prompts, base, ks, reps):
    """(totals by K, 0 = plain; events by K as (generation, event) pairs)."""
    totals = {k: RunTotals(k) for k in [0, *ks]}
    events: dict = {k: [] for k in ks}
    generation = 0
    for rep in range(reps):
        for prompt in prompts:
            for k in [0, *(ks if rep % 2 == 0 else ks[::-1])]:
                config = replace(base, method="none") if k == 0 else replace(base, k=k, seed=rep)
                run = list(decoder.generate(prompt, config))
                totals[k].add(final_metrics(run))
                if k:
                    events[k] += [(generation, e) for e in run]
                    generation += 1
    return totals, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    ks = sorted(int(k) for k in args.ks.split(","))
    decoder = load_decoder(build_parser().parse_args(["bench", "k-sweep"]), "draft")
    base = GenerationConfig(method="draft", max_new_tokens=args.max_new_tokens,
                            sampling=SamplingParams(temperature=args.temperature))
    prompts = bench.heldout_prompts(args.prompts)
    costs = decoder.calibrate(max(ks)).costs
    bench.measure(decoder, prompts[:1], replace(base, max_new_tokens=8))  # warm-up
    totals, events = sweep(decoder, prompts, base, ks, args.reps)
    plain = totals[0].tokens_per_s
    report = predict_from_trace(trace_from_events(events[max(ks)]), ks, costs)
    predicted = {p.k: p for p in report.predictions}
    rows = []
    for k in ks:
        t = totals[k]
        own = costs.refit(timing_of(e) for _, e in events[k]).speedup("draft", k, t.tokens_per_forward)
        p = predicted[k]
        rows.append({"k": k, "tokens_per_forward": t.tokens_per_forward, "predicted_tokens_per_forward":
                     p.tokens_per_forward, "speedup": t.tokens_per_s / plain, "predicted_speedup": own,
                     "from_run_speedup": p.speedup, "textbook_speedup": p.textbook_speedup, "basis": p.basis})
    print(f"T={args.temperature} {costs.describe('draft')}")
    print(f"{'K':>2} {'tok/fwd':>7} {'pred':>6} {'measured':>8} {'pred(K)':>7} {'from run':>8} {'error':>6} "
          f"{'textbook':>8}  basis")
    for r in rows:
        error = 100 * (r["from_run_speedup"] / r["speedup"] - 1)
        print(f"{r['k']:>2} {r['tokens_per_forward']:7.3f} {r['predicted_tokens_per_forward']:6.3f} "
              f"{r['speedup']:7.3f}x {r['predicted_speedup']:6.3f}x {r['from_run_speedup']:7.3f}x "
              f"{error:5.1f}% "
              f"{r['textbook_speedup']:7.3f}x  {r['basis']}")
    best = max(rows, key=lambda r: r["speedup"])
    guess = max(rows, key=lambda r: r["from_run_speedup"])
    print(f"measured best K = {best['k']} ({best['speedup']:.3f}x); predicted best K = {guess['k']}, "
          f"measured there {guess['speedup']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
