"""Per-depth E against measured tokens per forward on the shipped pair, for trees and chains.

For each method: generate the held-out prompts, count per-depth acceptance from the rounds (what `predict`
and the GUI fit), and print E = 1 + sum_d prod_{j<=d} alpha_j beside the measured tokens per forward and the
chapter's chain formula at the per-node alpha.
    python scripts/tree_depth_check.py [--methods eagle:8,medusa,...] [--k 4] [--prompts 8]
        [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from engine import analytic  # noqa: E402
from engine.acceptance import DepthAcceptance  # noqa: E402
from engine.bench import heldout_prompts  # noqa: E402
from engine.config import GenerationConfig  # noqa: E402
from engine.decoder import SpeculativeDecoder  # noqa: E402
from engine.methods import parse_spec  # noqa: E402
from engine.models import load_pair  # noqa: E402
from engine.predict import trace_round  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="eagle:8,eagle3:8,medusa,eagle,eagle3,draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    decoder = SpeculativeDecoder(load_pair(None, None, device=args.device))
    prompts = heldout_prompts(args.prompts)
    print("method     measured  per-depth E  error   chain formula at per-node alpha")
    for name in args.methods.split(","):
        spec = parse_spec(name)
        config = GenerationConfig(method=spec.name, k=args.k, tree_nodes=spec.tree_nodes,
                                  max_new_tokens=args.max_new_tokens)
        rounds = [trace_round(e) for p in prompts for e in decoder.generate(p, config)]
        drafted = [r for r in rounds if r.method != "none"]
        measured = sum(len(r.emitted) for r in rounds) / len(rounds)
        fitted = DepthAcceptance.from_rounds(r.shape for r in drafted)
        depth = max(r.depth for r in drafted)
        per_depth = fitted.expected(depth)
        nodes = sum(len(r.drafted) for r in drafted)
        alpha = sum(r.accepted for r in drafted) / nodes if nodes else 0.0
        chain = analytic.expected_tokens(alpha, depth)
        print(f"{name:10s} {measured:8.3f} {per_depth:12.3f} {100 * (per_depth / measured - 1):+5.1f} % "
              f"{chain:8.3f}")


if __name__ == "__main__":
    main()
