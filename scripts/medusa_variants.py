"""Medusa head designs side by side, trained on one medusa stage's greedy text, judged by replayed decoding.

Reads the texts a medusa stage made (<stage>/greedy_{train,val}.npy and greedy_top_{train,val}.npz, see
engine/train/stages.py), computes the target's features once, trains each design with the same schedule, and
replays greedy Medusa decoding on the held-out continuations and on the held-out prompts' own greedy text:
a round starts where the last one stopped and accepts the longest tree path whose tokens are the text's.
Two trees of N nodes, as the drafter builds them: "fixed", the top-N paths of the design's held-out path
accuracies (SPECPLAY_MEDUSA_DYNAMIC=0's), and "chosen", every round the N of the top 32 paths that the heads
score highest at that position (the drafter's default, engine.drafters.medusa.MedusaCandidates). Replay
counts the rounds after the first token (decoding's first round drafts from the prompt's last feature, so
`bench methods` reads a little differently).

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
from engine.drafters.medusa import default_choices, medusa_candidates  # noqa: E402
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
def hits_of(module, target, x, labels, bs: int = 8192) -> tuple:
    """([D, R, M] bool: head d's rank-r candidate is the text's token at position m, [D, R, M] float32: its
    log-probability)."""
    hits, log_ps = [], []
    for s in range(0, len(x), bs):
        logits = target.lm_head(module(x[s:s + bs])).float()  # [D, m, V]
        top = logits.topk(RANKS, dim=-1)  # [D, m, R]
        hits.append((top.indices == labels[s:s + bs].T[..., None]).transpose(1, 2))
        log_ps.append((top.values - logits.logsumexp(-1, keepdim=True)).transpose(1, 2))
    return torch.cat(hits, -1).cpu(), torch.cat(log_ps, -1).cpu()


def path_right(hits: torch.Tensor, path: tuple) -> torch.Tensor:
    """[M] bool: every step of the path is right."""
    right = torch.ones(hits.shape[-1], dtype=torch.bool)
    for d, r in enumerate(path):
        right &= hits[d, r]
    return right


def accepted_fixed(hits: torch.Tensor, tree: tuple) -> torch.Tensor:
    """[M] the drafts a round of the fixed tree accepts at each position."""
    accepted = torch.zeros(hits.shape[-1], dtype=torch.long)
    for path in tree:
        accepted = torch.where(path_right(hits, path), accepted.clamp_min(len(path)), accepted)
    return accepted


def accepted_chosen(hits: torch.Tensor, log_p: torch.Tensor, paths: tuple, nodes: int) -> torch.Tensor:
    """[M] the drafts a round accepts at each position when it keeps the `nodes` candidate paths of the
    highest summed log-probability (ties to the shallower, as MedusaCandidates.choose)."""
    scores = torch.stack([sum(log_p[d, r] for d, r in enumerate(p)) - 1e-4 * (len(p) - 1) for p in paths], 1)
    right = torch.stack([path_right(hits, p) for p in paths], 1)  # [M, T]
    lengths = torch.tensor([len(p) for p in paths])
    kept = scores.topk(nodes, dim=1).indices  # [M, nodes]
    return (right.gather(1, kept) * lengths[kept]).max(1).values


def replay(accepted: torch.Tensor, rows: int) -> float:
    """Tokens per round of greedy decoding over `rows` texts of n positions each (accepted [rows * n])."""
    n = accepted.shape[-1] // rows
    tokens = rounds = 0
    for row in accepted.view(rows, n).tolist():
        p = 0
        while p < n:
            step = min(1 + row[p], n - p)
            tokens, rounds, p = tokens + step, rounds + 1, p + step
    return tokens / rounds


def replayed(module, target, sets: dict, examples: dict, nodes: list) -> dict:
    """Head top-1 on the held-out continuations and replayed tokens a round on every set, with the fixed and
    the chosen tree, from the module's own held-out path accuracies."""
    held = hits_of(module, target, *examples["held-out continuations"])
    paths = heads.top_paths(heads.path_hits(held[0]), held[0].shape[-1])
    chances = tuple((tuple(p), c) for p, c in paths)
    result = {"head_top1": [round(held[0][d, 0].float().mean().item(), 4) for d in range(DEPTH)]}
    for name, texts in sets.items():
        hits, log_p = held if name.startswith("held-out cont") else hits_of(module, target, *examples[name])
        result[name] = {n: {"fixed": round(replay(accepted_fixed(hits, default_choices(n, chances)),
                                                  len(texts)), 3),
                            "chosen": round(replay(accepted_chosen(hits, log_p, medusa_candidates(
                                n, chances).paths, n), len(texts)), 3)}
                        for n in nodes}
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
