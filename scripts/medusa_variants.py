"""Medusa head designs side by side, trained on one medusa stage's greedy text, judged by replayed decoding.

Reads the texts a medusa stage made (<stage>/greedy_{train,val}.npy and greedy_top_{train,val}.npz, see
engine/train/stages.py), computes the target's features once, trains each design with the same schedule, and
replays greedy Medusa decoding on the held-out continuations and on the held-out prompts' own greedy text:
a round starts where the last one stopped and accepts the longest tree path whose tokens are the text's. The
tree is the top-N paths of the design's held-out path accuracies, as the drafter builds it. Replay counts the
rounds after the first token (decoding's first round drafts nothing, so `bench methods` reads a little lower).

    python scripts/medusa_variants.py --stage /tmp/run/medusa --device cuda --layers 1,2 \
        --steps 6000 --batch 2048
    python scripts/medusa_variants.py --stage /tmp/run/medusa --layers "" --heads assets/models/target
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.bench import heldout_prompts  # noqa: E402
from engine.drafters.medusa import default_choices  # noqa: E402
from engine.train import heads  # noqa: E402
from engine.train.presets import MedusaGreedy  # noqa: E402
from engine.train.stages import read_top_level_text  # noqa: E402

DEPTH, RANKS, NEW_TOKENS = 4, heads.RANKS, MedusaGreedy.new_tokens


def stage_texts(stage: Path, split: str, device) -> list:
    """[(ids [P + N], P)]: the stage's line-end and top-level continuations of one split."""
    import numpy as np

    rows = torch.from_numpy(np.load(stage / f"greedy_{split}.npy").astype(np.int64)).to(device)
    texts = [(row, MedusaGreedy.prompt_len) for row in rows]
    top = stage / f"greedy_top_{split}.npz"
    if top.exists():
        texts += read_top_level_text(top, NEW_TOKENS, device)
    return texts


@torch.no_grad()
def prompt_texts(target, tokenizer_file: Path, count: int) -> list:
    """The held-out prompts' plain greedy continuations (NEW_TOKENS), as [(ids, P)]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    out = []
    for text in heldout_prompts(count):
        ids = torch.tensor([tok.encode(text).ids], device=target.device)
        new = target.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append((new[0], ids.shape[1]))
    return out


def train(module, target, x, labels, steps: int, batch: int, lr: float) -> None:
    """AdamW with warm-up and cosine decay on random positions (x [M, H], labels [M, D])."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    pick = torch.Generator(device=x.device).manual_seed(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.randint(0, len(x), (batch,), device=x.device, generator=pick)
        loss = heads.medusa_greedy_loss(module, target, x[idx], labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@torch.no_grad()
def hits_of(module, target, x, labels, bs: int = 8192) -> torch.Tensor:
    """[D, R, M] bool: head d's rank-r candidate is the text's token at position m."""
    parts = []
    for s in range(0, len(x), bs):
        ranks = target.lm_head(module(x[s:s + bs])).float().topk(RANKS, dim=-1).indices   # [D, m, R]
        parts.append((ranks == labels[s:s + bs].T[..., None]).transpose(1, 2))
    return torch.cat(parts, -1).cpu()


def replay(hits: torch.Tensor, rows: int, tree: tuple) -> float:
    """Tokens per round of greedy decoding over `rows` texts of n positions each (hits [D, R, rows * n])."""
    n = hits.shape[-1] // rows
    accepted = torch.zeros(rows * n, dtype=torch.long)
    for path in tree:
        right = torch.ones(rows * n, dtype=torch.bool)
        for d, r in enumerate(path):
            right &= hits[d, r]
        accepted = torch.where(right, accepted.clamp_min(len(path)), accepted)
    tokens = rounds = 0
    for row in accepted.view(rows, n).tolist():
        p = 0
        while p < n:
            step = min(1 + row[p], n - p)
            tokens, rounds, p = tokens + step, rounds + 1, p + step
    return tokens / rounds


def replayed(module, target, sets: dict, examples: dict, nodes: list) -> dict:
    """Head top-1 on the held-out continuations and replayed tokens a round on every set, the tree from the
    module's own held-out path accuracies."""
    held_hits = hits_of(module, target, *examples["held-out continuations"])
    paths = heads.top_paths(heads.path_hits(held_hits), held_hits.shape[-1])
    chances = tuple((tuple(p), c) for p, c in paths)
    result = {"head_top1": [round(held_hits[d, 0].float().mean().item(), 4) for d in range(DEPTH)]}
    for name, texts in sets.items():
        hits = held_hits if name.startswith("held-out cont") else hits_of(module, target, *examples[name])
        result[name] = {n: round(replay(hits, len(texts), default_choices(n, chances)), 3) for n in nodes}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=Path, required=True, help="a medusa stage's folder (its text)")
    parser.add_argument("--model", type=Path, default=REPO / "assets/models/target")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", default="1,2", help="blocks a head, one design each ('': none)")
    parser.add_argument("--heads", type=Path, default=None,
                        help="also replay the heads saved in this folder, as they are")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nodes", default="8,16")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device(args.device)
    nodes = [int(n) for n in args.nodes.split(",")]
    target = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    target = heads.freeze(target.to(device))
    held = stage_texts(args.stage, "val", device)
    prompts = prompt_texts(target, args.model / "tokenizer.json", 32)
    # equal position counts per text within each set: every continuation has NEW_TOKENS tokens
    sets = {"held-out continuations": held, "held-out prompts 1-8": prompts[:8],
            "held-out prompts 9-32": prompts[8:]}
    examples = {name: heads.greedy_examples_of(target, texts, DEPTH) for name, texts in sets.items()}
    if args.heads is not None:
        module = heads.load_medusa(args.heads).to(device).eval()
        print(json.dumps({"heads": str(args.heads), **replayed(module, target, sets, examples, nodes)}))
    designs = [int(n) for n in args.layers.split(",") if n]
    if not designs:
        return
    x, labels = heads.greedy_examples_of(target, stage_texts(args.stage, "train", device), DEPTH)
    print(f"{len(x)} training positions; device {device}; {args.steps} steps of {args.batch}, lr {args.lr}")
    for layers in designs:
        t0 = time.time()
        torch.manual_seed(0)
        module = heads.MedusaHeads(x.shape[1], DEPTH, layers).to(device)
        train(module, target, x, labels, args.steps, args.batch, args.lr)
        result = replayed(module, target, sets, examples, nodes)
        print(json.dumps({"layers": layers, "seconds": round(time.time() - t0, 1), **result}), flush=True)


if __name__ == "__main__":
    main()
