"""The round loop's CUDA calls, torch's against the raw ones (engine.cuda_calls), in one process, interleaved.

    python scripts/raw_calls_ab.py [--methods none,ngram,medusa,eagle3] [--passes 3] [--prompts 8]

Bench methods runs each setting in a process of its own, one after the other, and an H200 host's speed
drifts between processes; here every prompt runs each (method, setting) in turn on one decoder of the shipped
pair (bf16). Printed per pass and in all: tokens/s from the events' round times (what bench methods
reports) and from the wall clock around each generation (prefill included), and each method's speedup over
plain decoding under the same setting.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from engine import cuda_calls
    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.metrics import RunTotals, final_metrics
    from engine.models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram,medusa,eagle3")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: raw_calls_ab needs a CUDA GPU", file=sys.stderr)
        return 2
    methods = args.methods.split(",")
    decoder = SpeculativeDecoder(load_pair(None, None, device="cuda", need_draft="draft" in methods))
    decoder.warm_up()
    prompts = heldout_prompts(args.prompts)
    configs = {m: GenerationConfig(k=4, max_new_tokens=args.tokens, stop_at_eos=False).with_spec(m)
               for m in methods}
    keys = [(m, raw) for m in methods for raw in (False, True)]
    for method, raw in keys:  # captures and warm-up
        cuda_calls.RAW_CALLS, decoder._calls = raw, None
        list(decoder.generate(prompts[0], configs[method]))
    grand = {key: [RunTotals(configs[key[0]].drafts), 0, 0.0] for key in keys}  # totals, tokens, wall s
    for index in range(args.passes):
        passed = {key: [RunTotals(configs[key[0]].drafts), 0, 0.0] for key in keys}
        for prompt in prompts:
            for key in keys:
                cuda_calls.RAW_CALLS, decoder._calls = key[1], None
                began = time.perf_counter()
                events = list(decoder.generate(prompt, configs[key[0]]))
                wall = time.perf_counter() - began
                for store in (passed[key], grand[key]):
                    store[0].add(final_metrics(events))
                    store[1] += sum(len(e.emitted_ids) for e in events)
                    store[2] += wall
        report(f"pass {index + 1}", passed, methods)
    report("all", grand, methods)
    return 0


def report(label: str, table: dict, methods: list) -> None:
    for raw in (False, True):
        plain = table[("none", raw)] if ("none", raw) in table else None
        for method in methods:
            totals, tokens, seconds = table[(method, raw)]
            row = {"pass": label, "method": method, "raw_calls": raw,
                   "tokens_per_s": round(totals.tokens_per_s, 1),
                   "wall_tokens_per_s": round(tokens / seconds, 1),
                   "tokens_per_forward": round(totals.tokens_per_forward, 3)}
            if plain is not None:
                row["speedup"] = round(totals.tokens_per_s / plain[0].tokens_per_s, 3)
                row["wall_speedup"] = round((tokens / seconds) / (plain[1] / plain[2]), 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
