"""Suffix decoding on a repeated task: for each of 8 held-out prompts a first generation (plain decoding),
then the same prompt again with that output as --suffix-corpus; prints tokens per forward beside n-gram
lookup.

    OMP_NUM_THREADS=1 python scripts/suffix_repeat.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(prompt: str, method: str, corpus: str | None = None) -> dict:
    """The CLI's --json summary of one generation of 96 tokens."""
    cmd = [sys.executable, str(ROOT / "main.py"), "run", "--prompt", prompt, "--method", method,
           "--max-new-tokens", "96", "--json"]
    if corpus:
        cmd += ["--suffix-corpus", corpus]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    held_out = json.loads((ROOT / "assets/models/heldout_prompts.json").read_text())
    prompts = [p["text"] for p in held_out["prompts"]]
    suffix, ngram = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts[:8]):
            corpus = Path(tmp) / f"first_{i}.txt"
            corpus.write_text(prompt + run(prompt, "none")["text"], encoding="utf-8")
            suffix.append(run(prompt, "suffix", str(corpus))["tokens_per_forward"])
            ngram.append(run(prompt, "ngram")["tokens_per_forward"])
            print(f"prompt {i}: suffix {suffix[-1]:.2f}  ngram {ngram[-1]:.2f} tokens/forward", flush=True)
    print(f"mean: suffix {sum(suffix) / len(suffix):.2f}  ngram {sum(ngram) / len(ngram):.2f} tokens/forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
