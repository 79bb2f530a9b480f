"""What Medusa's heads can reach on the held-out prompts, whatever the round costs.

Decodes each prompt greedily without speculation (the text every lossless method emits), then, at every
position p of the continuation, ranks each head's candidates from the target's feature at p and counts the
longest path of the fixed N-node tree (`default_choices`, the drafter's with SPECPLAY_MEDUSA_DYNAMIC=0) whose
tokens all equal the text's: the tokens a greedy round starting at p would accept. Their mean, plus the bonus
token, bounds the tokens per forward of `medusa:N` with that tree (a round starts only where the last one
ended, so the measured figure may differ a little; scripts/medusa_variants.py replays the tree chosen every
round).

    OMP_NUM_THREADS=1 python scripts/medusa_tree_cap.py --nodes 8,16,32,64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.bench import heldout_prompts  # noqa: E402
from engine.drafters.medusa import MedusaHeads, default_choices  # noqa: E402
from engine.models import load_runner, load_tokenizer  # noqa: E402


def greedy_text(runner, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompt [P] -> prompt and its plain greedy continuation [P + new_tokens]."""
    runner.reset()
    tokens = prompt.tolist()
    logits = runner.forward(prompt).logits
    for _ in range(new_tokens):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward(torch.tensor(tokens[-1:])).logits
    return torch.tensor(tokens)


def head_ranks(runner, heads: MedusaHeads, text: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """[positions, D, width]: each head's top-`width` candidates at every position from `start` on."""
    runner.reset()
    hidden = runner.forward(text).hidden  # [n, H]
    return torch.stack([heads.logits(runner, hidden[p]).topk(width, dim=-1).indices
                        for p in range(start, len(text))])


def accepted(ranks: torch.Tensor, truth: torch.Tensor, choices: tuple) -> int:
    """The longest path of `choices` whose tokens (rank r_d of head d) are truth[d] all the way."""
    return max((len(path) for path in choices
                if all(int(ranks[d, r]) == int(truth[d]) for d, r in enumerate(path))), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "assets/models/target"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--nodes", default="8,16,32,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = load_runner(args.model, "cpu", torch.float32)
    tokenizer = load_tokenizer(args.model)
    heads = MedusaHeads.load(args.model, "cpu", torch.float32)
    prompts = heldout_prompts(args.prompts)
    trees = {n: default_choices(n, heads.path_chances(heads.count)) for n in map(int, args.nodes.split(","))}
    width = 1 + max(max(path) for choices in trees.values() for path in choices)
    totals, top1, positions = dict.fromkeys(trees, 0), [0] * heads.count, 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor(tokenizer.encode(prompt), dtype=torch.long)
            text = greedy_text(runner, ids, args.max_new_tokens)
            start = len(ids) - 1  # the prompt's last token: the first round's feature
            ranks = head_ranks(runner, heads, text, start, width)
            for i in range(len(text) - start - 1 - heads.count):  # every head has its label
                p = start + i
                truth = text[p + 2:p + 2 + heads.count]
                for d in range(heads.count):
                    top1[d] += int(ranks[i, d, 0] == truth[d])
                for n, choices in trees.items():
                    totals[n] += accepted(ranks[i], truth, choices)
                positions += 1
    print(f"{len(prompts)} prompts, {args.max_new_tokens} greedy tokens each, {positions} positions")
    print("head top-1 on this text: " + ", ".join(f"{c / positions:.3f}" for c in top1))
    chances = dict(heads.path_chances(heads.count))
    print("| nodes | accepted a round (measured) | tokens per forward bound | path_accuracy's sum |")
    print("| --- | --- | --- | --- |")
    for n, choices in trees.items():
        mean = totals[n] / positions
        print(f"| {n} | {mean:.3f} | {1 + mean:.2f} | {sum(chances[c] for c in choices):.3f} |")


if __name__ == "__main__":
    main()
