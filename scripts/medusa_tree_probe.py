"""Medusa's fixed tree against its tree chosen every round, on the GPU: where a round's time goes.

    python scripts/medusa_tree_probe.py [--prompts 8] [--tokens 128] [--passes 2]

For each tree (SPECPLAY_MEDUSA_DYNAMIC's two settings, alternated `--passes` times, a fresh decoder
each) on the shipped pair (bf16, greedy, K = 4): the held-out prompts decoded once to warm up, then again,
timed: rounds, tokens, wall microseconds a round, the clock's phases, and how many rounds were replays of
the round graph (_replay_round) or launched op by op (_launch_round). Then the round graph alone, replayed
back to back (scripts/round_replay_probe.py's timing: GPU microseconds a round and the host's to queue
one). Last, the host's own time per function over four generations (cProfile), per tree. One JSON line
per measurement.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COUNTED = ("_replay_round", "_launch_round")


def counting(counts: dict) -> None:
    """SpeculativeDecoder's COUNTED methods counted into counts."""
    from engine.decoder import SpeculativeDecoder

    for name in COUNTED:
        original = getattr(SpeculativeDecoder, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        setattr(SpeculativeDecoder, name, counted)


def decoder_for(dynamic: bool):
    from engine.decoder import SpeculativeDecoder
    from engine.drafters import medusa
    from engine.models import load_pair

    medusa.DYNAMIC_TREE = dynamic
    decoder = SpeculativeDecoder(load_pair(None, None, device="cuda", need_draft=False))
    decoder.warm_up()
    return decoder


def timed_rounds(dynamic: bool, prompts: list, config, counts: dict) -> dict:
    import torch

    decoder = decoder_for(dynamic)
    for prompt in prompts:
        decoder.generate_ids(prompt, config)
    counts.clear()
    rounds = tokens = 0
    phases = [0.0, 0.0, 0.0]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for prompt in prompts:
        events = list(decoder.generate(prompt, config))
        rounds += len(events)
        tokens += events[-1].metrics.emitted
        for e in events:
            phases[0] += e.draft_ms
            phases[1] += e.verify_ms
            phases[2] += e.overhead_ms
    torch.cuda.synchronize()
    wall = time.perf_counter() - began
    return {"dynamic": dynamic, "rounds": rounds, "tokens": tokens,
            "us_a_round": round(1e6 * wall / rounds, 1),
            "draft_ms": round(phases[0] / rounds, 4), "verify_ms": round(phases[1] / rounds, 4),
            "overhead_ms": round(phases[2] / rounds, 4), **counts}


def host_profile(dynamic: bool, prompts: list, config, top: int = 25) -> None:
    decoder = decoder_for(dynamic)
    decoder.generate_ids(prompts[0], config)
    profile = cProfile.Profile()
    profile.enable()
    for prompt in prompts[:4]:
        decoder.generate_ids(prompt, config)
    profile.disable()
    print(f"== host time by function, dynamic={dynamic}", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


def main() -> int:
    import round_replay_probe
    import torch

    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.drafters import medusa

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: medusa_tree_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    prompts = heldout_prompts(args.prompts)
    config = GenerationConfig(method="medusa", k=4, max_new_tokens=args.tokens)
    counts: dict = {}
    counting(counts)
    with torch.inference_mode():
        for _ in range(args.passes):
            for dynamic in (False, True):
                print(json.dumps(timed_rounds(dynamic, prompts, config, counts)), flush=True)
                medusa.DYNAMIC_TREE = dynamic  # round_replay_probe builds its own decoder
                replayed = round_replay_probe.probe("medusa", "on", prompts[0], 4)
                print(json.dumps({"dynamic": dynamic, **replayed}), flush=True)
        for dynamic in (False, True):
            host_profile(dynamic, prompts, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
