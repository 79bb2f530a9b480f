"""Calibration repeated N times on this machine: t_plain and each method's c, their median and the largest
deviation from it (the issue's "c within +-10% of its median").

    python scripts/calibration_spread.py --device cuda --repeats 5 [--k 8] [--methods draft,eagle,eagle3]"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.decoder import SpeculativeDecoder  # noqa: E402
from engine.models import load_pair  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--methods", default="draft,eagle,eagle3,layerskip")
    args = parser.parse_args()
    methods = args.methods.split(",")
    decoder = SpeculativeDecoder(load_pair(None, None, device=args.device))
    decoder.warm_up()
    figures: dict = {"t_plain": []} | {f"c[{m}]": [] for m in methods}
    for attempt in range(args.repeats):
        costs = decoder.calibrate(args.k, methods_to_time=methods).costs
        figures["t_plain"].append(costs.t_plain)
        for m in methods:
            figures[f"c[{m}]"].append(costs.c(m))
        print(f"calibration {attempt}: t_plain {costs.t_plain:.3f} ms, "
              + ", ".join(f"c[{m}] {costs.c(m):.3f}" for m in methods), flush=True)
    for name, values in figures.items():
        median = statistics.median(values)
        worst = max(abs(v / median - 1.0) for v in values) if median else 0.0
        print(f"{name}: median {median:.4f}, largest deviation {100 * worst:.1f}% "
              f"({'within' if worst <= 0.10 else 'outside'} +-10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
