"""n-gram's tokens per forward with and without the target's corpus table, replayed exactly on plain greedy
outputs (greedy verification accepts a proposal's prefix that matches the output, so the rounds follow from
the output alone: engine.predict.ngram_replay).

    python scripts/ngram_table_replay.py [--prompts 32] [--max-new-tokens 128] [--ks 4,8] [--dtype bfloat16]

Generates plain greedy decoding of the held-out prompts once (CPU), then counts the rounds each way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.drafters import corpus_table
    from engine.models import load_pair, shipped_pair
    from engine.predict import ngram_replay

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="4,8")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    table = corpus_table.load(shipped_pair()[0])
    if table is None:
        print("error: the shipped target has no corpus table", file=sys.stderr)
        return 2
    decoder = SpeculativeDecoder(load_pair(None, None, device="cpu", need_draft=False, dtype=args.dtype))
    config = GenerationConfig(method="none", max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    runs = []
    for prompt in heldout_prompts(args.prompts):
        runs.append((decoder._encode(prompt), decoder.generate_ids(prompt, config)))
    tokens = sum(len(out) for _, out in runs)
    print(f"{len(runs)} held-out prompts, {tokens} tokens of plain greedy decoding ({args.dtype}, CPU)")
    n = GenerationConfig().ngram_n
    for k in (int(x) for x in args.ks.split(",")):
        for label, used in (("lookup alone", None), ("with the table", table)):
            replayed = [r for ids, out in runs for r in ngram_replay(ids, out, k, n, used)]
            rounds, empty = len(replayed), sum(proposed == 0 for proposed, _ in replayed)
            print(f"K = {k}  {label:15s} {tokens / rounds:.3f} tokens per forward ({rounds} rounds, "
                  f"{100 * empty / rounds:.1f}% of them drafting nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
