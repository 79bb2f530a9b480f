"""Host time a host-drafted method spends in its drafter per round: propose (drafting) and commit (its
bookkeeping after acceptance), on the shipped pair, the held-out prompts decoded twice (the second pass finds
the first in suffix decoding's session memory).

    python scripts/drafter_host_time.py --method suffix|lookahead [--device cpu] [--prompts 8] [--tokens 96]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRAFTERS = {"suffix": ("engine.drafters.suffix", "SuffixDrafter"),
            "lookahead": ("engine.drafters.lookahead", "LookaheadDrafter")}


def timed(cls, name: str, spent: list) -> None:
    """Wrap cls.name so that each call's wall time is appended to spent."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        began = time.perf_counter()
        result = original(self, *args, **kwargs)
        spent.append(time.perf_counter() - began)
        return result

    setattr(cls, name, wrapper)


def main() -> int:
    import importlib

    import torch

    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(DRAFTERS), default="suffix")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    module, name = DRAFTERS[args.method]
    cls = getattr(importlib.import_module(module), name)
    spent = {"propose": [], "commit": []}
    for hook, times in spent.items():
        timed(cls, hook, times)
    decoder = SpeculativeDecoder(load_pair(None, None, device=args.device))
    for run in (1, 2):
        for times in spent.values():
            times.clear()
        for prompt in heldout_prompts(args.prompts):
            config = GenerationConfig(k=4, max_new_tokens=args.tokens).with_spec(args.method)
            list(decoder.generate(prompt, config))
        rounds = len(spent["propose"])
        print(f"{args.method} pass {run}: {rounds} rounds, propose "
              f"{1e6 * sum(spent['propose']) / rounds:.1f} us, commit "
              f"{1e6 * sum(spent['commit']) / max(1, len(spent['commit'])):.1f} us a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
