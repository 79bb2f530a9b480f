"""Each kernel of a method's round graph, as Nsight Compute times it alone: run under ncu, which profiles the
kernels launched inside the NVTX range "rounds" (three replays of the round graph after a greedy generation).

    ncu --nvtx --nvtx-include "rounds/" --graph-profiling node --metrics gpu__time_duration.sum \
        --cache-control none --clock-control none --csv \
        python scripts/kernel_durations.py --methods none,ngram

    python scripts/kernel_durations.py --summarize ncu_none.csv   # per kernel: microseconds a round, calls

A kernel's time alone is not its share of a replayed round (programmatic launch overlaps a kernel's start
with the last one's end); their sum beside round_replay_probe's round time shows what the gaps cost.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def summarize(path: str, replays: int) -> None:
    """ncu's CSV (one row per kernel launch) as microseconds a round per kernel name, largest first."""
    import csv

    rows = list(csv.DictReader(line for line in open(path, encoding="utf-8") if line.startswith('"')))
    per_kernel: dict = {}
    for row in rows:
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0}.get(row["Metric Unit"], 1e-3)
        name = row["Kernel Name"].split("(")[0]
        per_kernel.setdefault(name, []).append(float(row["Metric Value"].replace(",", "")) * scale)
    total = sum(sum(times) for times in per_kernel.values()) / replays
    print(f"{path}: {len(rows) / replays:.0f} kernels a round, {total:.1f} us a round, each alone")
    for name, times in sorted(per_kernel.items(), key=lambda item: -sum(item[1])):
        print(f"  {sum(times) / replays:7.2f} us  x{len(times) / replays:4.1f}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--summarize", nargs="+", default=None, metavar="CSV",
                        help="print ncu's CSV of an earlier run per kernel instead (no GPU needed)")
    args = parser.parse_args()
    if args.summarize:
        for path in args.summarize:
            summarize(path, args.replays)
        return 0
    import torch
    from round_replay_probe import captured_graph

    from engine.bench import heldout_prompts
    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair

    prompt = heldout_prompts(1)[0]
    with torch.inference_mode():
        for method in args.methods.split(","):
            decoder = SpeculativeDecoder(load_pair(None, None, device="cuda", need_draft=method == "draft"))
            decoder.warm_up()
            graph = captured_graph(decoder, method, prompt, args.k)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("rounds")
            torch.cuda.nvtx.range_push(method)
            for _ in range(args.replays):
                graph.replay_draft()
                graph.replay()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_pop()
            print(f"method {method} replayed {args.replays}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
