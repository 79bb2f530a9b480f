"""A reduced draft vocabulary for a published-layout EAGLE-3 head: keep the LM-head rows of the tokens the
training corpus uses most, and write the mapping the public heads carry (d2t: target id = draft id +
d2t[draft id]; t2d: which target ids the head can draft).

The public Llama-3.1-8B and Qwen3 EAGLE-3 heads draft over 32,000 of 128,000+ tokens, chosen by frequency in
their training data; the head's LM head then costs a quarter. Sampling stays lossless: the draft
distribution q is zero off the draft vocabulary, and verification only ever divides by q where it drafted.

    python -m engine.train.draft_vocab HEAD_DIR OUT_DIR --size 2048 --tokenizer assets/models/target

counts the tokens of the training split of the corpus the shipped family was trained on (the Python standard
library's sources, engine.train.corpus; the held-out prompts' files are in the other split), keeps the
`size` most frequent (the special tokens always) and writes OUT_DIR/config.json and model.safetensors in the
speculators layout, with `coverage` (the share of the counted tokens the draft vocabulary holds) in the
config's specplay section.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from engine.train import corpus
from engine.train.eagle3 import SPECULATORS_CONFIG, SPECULATORS_WEIGHTS

CORPUS_FILES = 4000  # files of the training split counted (a deterministic subset): enough for a stable order
MAX_FILE_BYTES = 256_000  # the full preset's cap (engine/train/presets.py)
VAL_FRACTION = 0.05  # the full preset's split


def corpus_counts(tokenizer_dir: Path, vocab: int, max_files: int = CORPUS_FILES) -> np.ndarray:
    """[vocab] token counts over the training split of the standard library's sources."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    files = corpus.load_corpus(max_files, MAX_FILE_BYTES, VAL_FRACTION)
    texts = [f.text for f in files if f.split == "train"]
    counts = np.zeros(vocab, dtype=np.int64)
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        counts += np.bincount(np.asarray(encoding.ids, dtype=np.int64), minlength=vocab)[:vocab]
    return counts


def choose_ids(counts: np.ndarray, size: int, always: tuple = ()) -> torch.Tensor:
    """The `size` most frequent token ids ([size] int64, ascending), `always` among them."""
    if not 0 < size <= len(counts):
        raise ValueError(f"a draft vocabulary of {size} from {len(counts)} tokens")
    order = np.argsort(-counts, kind="stable")
    keep = list(dict.fromkeys([int(i) for i in always] + [int(i) for i in order]))[:size]
    return torch.tensor(sorted(keep), dtype=torch.int64)


def special_ids(config: dict) -> tuple:
    """The target config's BOS, EOS and pad ids (EOS may be a list): a draft vocabulary keeps them."""
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(i) for i in ids)


def reduce_state(state: dict, keep: torch.Tensor, vocab: int) -> dict:
    """A speculators-layout state with its LM head cut to the rows of `keep` (target ids [Vd], ascending) and
    d2t / t2d for them. The head's draft ids may already be mapped (its own d2t): keep names target ids."""
    lm_head = state["lm_head.weight"]  # [Vd_old, H]
    old_d2t = state.get("d2t", torch.zeros(lm_head.shape[0], dtype=torch.int64))
    old_ids = torch.arange(lm_head.shape[0]) + old_d2t  # [Vd_old] the target id of each row
    row_of = {int(t): r for r, t in enumerate(old_ids.tolist())}
    missing = [int(t) for t in keep.tolist() if int(t) not in row_of]
    if missing:
        raise ValueError(f"target ids {missing[:5]} are not in the head's draft vocabulary")
    rows = torch.tensor([row_of[int(t)] for t in keep.tolist()], dtype=torch.int64)
    out = dict(state)
    out["lm_head.weight"] = lm_head[rows].contiguous()  # [Vd, H]
    out["d2t"] = keep - torch.arange(len(keep))  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    out["t2d"] = t2d
    return out


def reduce_head(src: Path, dst: Path, keep: torch.Tensor, coverage: float) -> dict:
    """Write the head of src (speculators layout) into dst with the draft vocabulary `keep`; returns the new
    config."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((Path(src) / SPECULATORS_CONFIG).read_text())
    vocab = cfg["transformer_layer_config"]["vocab_size"]
    state = reduce_state(load_file(str(Path(src) / SPECULATORS_WEIGHTS)), keep, vocab)
    cfg["draft_vocab_size"] = len(keep)
    cfg.setdefault("specplay", {})["draft_vocabulary"] = (
        f"the {len(keep)} tokens most frequent in the training split of the corpus "
        f"(engine/train/draft_vocab.py); they hold {coverage:.4f} of its tokens")
    Path(dst).mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(dst) / SPECULATORS_WEIGHTS),
              metadata={"format": "pt"})
    (Path(dst) / SPECULATORS_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", type=Path, help="an EAGLE-3 head in the speculators layout")
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/models/target"),
                        help="the target's folder: its tokenizer.json counts, its config.json names the "
                             "special tokens kept")
    parser.add_argument("--max-files", type=int, default=CORPUS_FILES)
    args = parser.parse_args(argv)
    cfg = json.loads((args.head / SPECULATORS_CONFIG).read_text())
    vocab = cfg["transformer_layer_config"]["vocab_size"]
    counts = corpus_counts(args.tokenizer, vocab, args.max_files)
    target_config = json.loads((args.tokenizer / "config.json").read_text())
    keep = choose_ids(counts, args.size, special_ids(target_config))  # EOS must stay draftable
    coverage = float(counts[keep.numpy()].sum() / max(1, counts.sum()))
    reduce_head(args.head, args.out, keep, coverage)
    print(f"{args.out}: draft vocabulary {len(keep)} of {vocab}, {coverage:.4f} of {int(counts.sum())} "
          "corpus tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
