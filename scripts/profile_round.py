"""Where a decoding round spends its host time: cProfile over generate() for one method.

    python scripts/profile_round.py --device cuda --method none --max-new-tokens 256 [--top 30]

Runs one warm-up generation, then profiles a second one and prints the functions with the most own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--method", default="none")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree-nodes", type=int, default=0, help="medusa / eagle tree size (0: the default)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair, resolve_device

    device = resolve_device(args.device)
    decoder = SpeculativeDecoder(load_pair(None, None, device=device, need_draft=args.method == "draft"))
    decoder.backend.warm_up()
    config = GenerationConfig(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens,
                              tree_nodes=args.tree_nodes)
    prompt = heldout_prompts(1)[0]
    decoder.generate_ids(prompt, config)  # warm-up: kernels, graphs
    profile = cProfile.Profile()
    profile.enable()
    events = list(decoder.generate(prompt, config))
    profile.disable()
    rounds = len(events)
    total_ms = sum(e.round_ms for e in events)
    print(f"{args.method}: {rounds} rounds, {events[-1].metrics.emitted} tokens, "
          f"{total_ms / rounds:.3f} ms/round "
          f"(draft {sum(e.draft_ms for e in events) / rounds:.3f}, "
          f"verify {sum(e.verify_ms for e in events) / rounds:.3f},"
          f" rest {sum(e.overhead_ms for e in events) / rounds:.3f})")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
