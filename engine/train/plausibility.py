"""Held-out evaluation of a model family: the syntactic plausibility of greedy completions of function
signatures, and perplexity on the held-out standard-library files.

Plausibility, exactly:
1. Signatures come from the standard library's validation files (the split both corpora share, see
   corpus.stdlib_val_files): every `def` / `async def` whose header is one line ending in `:`, found with
   `ast`. If the body starts with a docstring, the docstring's first line is part of the prompt (the model
   must close it). At most 4 per file; the order is by a hash of (file, line), and the first `limit`
   (default 200) are used. The prompt is that text dedented to column 0 (a method becomes a function),
   without its last newline: byte-level BPE merges a newline with the next line's indentation, so a prompt
   ending in a bare newline would read like a line at column 0 follows.
2. The target continues the prompt greedily by 96 tokens (one batch, left-padded; the tokenizer adds `<s>`);
   the completion stops at the first `</s>`.
3. The function is cut out of prompt + completion: it ends before the first non-blank line, after the
   prompt, that is not indented (the model went on to the next top-level statement); otherwise it is cut
   at the end of its last complete logical line (Python's tokenizer: brackets and strings closed), which
   drops the line cut off by the token budget. Block headers left at the end with no body (`if x:` whose
   body was cut) are dropped as well.
4. The completion is plausible when the function has at least one non-blank line after the prompt's lines
   and `ast.parse` accepts it. The metric is the share of plausible completions.

Perplexity: mean next-token loss of each held-out stdlib file as `<s> text </s>` in windows of the model's
context, over all their tokens, with the family's own tokenizer; also in nats per byte (tokenizer-independent,
so two families with different tokenizers compare).
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import textwrap
import time
import tokenize
from pathlib import Path
from typing import Optional

import torch

from engine.train import corpus
from engine.train.lm import EOS_ID, autocast

NEW_TOKENS = 96
SIGNATURES = 200
PER_FILE = 4


# ----------------------------------------------------------------------------- prompts

def signature_prompts(files: list, limit: int = SIGNATURES, per_file: int = PER_FILE) -> list[dict]:
    """[{"file", "line", "prompt"}] from the given SourceFiles (see the module docstring, step 1)."""
    found = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        lines = f.text.splitlines()
        picked = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            start = node.lineno - 1  # the def line (decorators come before it)
            header = lines[start] if start < len(lines) else ""
            first_body = node.body[0].lineno - 1
            if first_body != start + 1 or not header.rstrip().endswith(":") or \
                    not header.lstrip().startswith(("def ", "async def ")):
                continue
            text = header.rstrip()
            body = node.body[0]
            if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and \
                    isinstance(body.value.value, str):
                text += "\n" + lines[first_body].rstrip()
            key = hashlib.sha256(f"{f.rel}:{start}".encode()).hexdigest()
            picked.append((key, {"file": f.rel, "line": start + 1, "prompt": textwrap.dedent(text)}))
        picked.sort()
        found.extend(picked[:per_file])
    found.sort(key=lambda item: item[0])
    return [p for _, p in found[:limit]]


# ----------------------------------------------------------------------------- the rule

def _logical_line_ends(text: str) -> list[int]:
    """Line numbers (1-based) where a complete logical line ends, until the tokenizer gives up."""
    ends = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NEWLINE and tok.string:   # not the implicit one the tokenizer adds at EOF
                ends.append(tok.end[0])
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return ends


def function_text(prompt: str, completion: str) -> tuple[str, bool]:
    """(the function cut out of prompt + completion, whether the model ended it itself); see the module
    docstring, step 3."""
    n_prompt = len(prompt.splitlines())
    lines = (prompt + completion).splitlines(keepends=True)
    for i in range(n_prompt, len(lines)):
        line = lines[i]
        if line.strip() and not line[0].isspace():
            return "".join(lines[:i]), True
    text = "".join(lines)
    ends = _logical_line_ends(text)
    keep = ends[-1] if ends else 0
    return "".join(lines[:keep]), False


def _drop_empty_headers(text: str, n_prompt: int) -> str:
    lines = text.splitlines(keepends=True)
    while len(lines) > n_prompt:
        last = lines[-1].split("#", 1)[0].rstrip()
        if not lines[-1].strip():
            lines.pop()
        elif last.endswith(":"):
            lines.pop()
        else:
            break
    return "".join(lines)


def is_plausible(prompt: str, completion: str) -> bool:
    """The rule of the module docstring, steps 3-4, on one completion (already cut at EOS)."""
    n_prompt = len(prompt.splitlines())
    text, _ = function_text(prompt, completion)
    text = _drop_empty_headers(text, n_prompt)
    body = [ln for ln in text.splitlines()[n_prompt:] if ln.strip()]
    if not body:
        return False
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- the measurements

@torch.no_grad()
def completions(model, tokenizer, prompts: list[str], device, new_tokens: int = NEW_TOKENS,
                batch: int = 100) -> list[str]:
    """Greedy completions (text after the prompt, cut at the first EOS)."""
    from engine.train.generate import generate, left_pad

    texts = []
    for i in range(0, len(prompts), batch):
        chunk = [tokenizer(p, verbose=False)["input_ids"] for p in prompts[i:i + batch]]
        ids, mask = left_pad(chunk, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        new = generate(model, ids.to(device), mask.to(device), new_tokens).cpu().tolist()
        for row in new:
            if EOS_ID in row:
                row = row[:row.index(EOS_ID)]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


@torch.no_grad()
def file_losses(model, tokenizer, texts: list[str], device, window: int, batch: int = 16) -> dict:
    """Next-token loss over `<s> text </s>` of every text, in windows of `window` tokens."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS_ID
    pieces = []
    n_bytes = 0
    for text in texts:
        ids = tokenizer(text, verbose=False)["input_ids"] + [eos]
        n_bytes += len(text.encode("utf-8"))
        for s in range(0, len(ids) - 1, window):
            pieces.append(ids[s:s + window + 1])
    total, count = 0.0, 0
    pieces.sort(key=len)
    for i in range(0, len(pieces), batch):
        chunk = [p for p in pieces[i:i + batch] if len(p) >= 2]
        if not chunk:
            continue
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        labels = torch.full((len(chunk), width - 1), -100, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, :len(p)] = torch.tensor(p)
            labels[r, :len(p) - 1] = torch.tensor(p[1:])
        ids, labels = ids.to(device), labels.to(device)
        with autocast(device):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                   ignore_index=-100, reduction="sum").item()
        count += int((labels != -100).sum())
    loss = total / max(1, count)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count, "bytes": n_bytes,
            "nats_per_byte": total / max(1, n_bytes)}


def evaluate_family(models_dir: Path, device="cpu", limit: int = SIGNATURES, max_files: Optional[int] = None,
                    new_tokens: int = NEW_TOKENS, log=print, keep_examples: int = 5) -> dict:
    """Plausibility and held-out stdlib perplexity of models_dir/target (and the draft's perplexity).
    limit: signatures; max_files: held-out files for the perplexity (None = all), for quick runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    device = torch.device(device)
    models_dir = Path(models_dir)
    files = corpus.stdlib_val_files()
    prompts = signature_prompts(files, limit)
    ppl_files = files if max_files is None else \
        sorted(files, key=lambda f: corpus.path_bucket(f.rel))[:max_files]
    tok = AutoTokenizer.from_pretrained(str(models_dir / "target"))
    out: dict = {"models_dir": str(models_dir), "n_signatures": len(prompts), "new_tokens": new_tokens,
                 "n_heldout_files": len(ppl_files), "rule": "engine/train/plausibility.py (module docstring)"}
    for name in ("target", "draft"):
        if not (models_dir / name / "config.json").exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(str(models_dir / name), dtype=torch.float32).to(device)
        model.eval()
        window = min(1024, model.config.max_position_embeddings)
        losses = file_losses(model, tok, [f.text for f in ppl_files], device, window)
        out[f"{name}_heldout"] = losses
        if name == "target":
            texts = completions(model, tok, [p["prompt"] for p in prompts], device, new_tokens)
            verdicts = [is_plausible(p["prompt"], c) for p, c in zip(prompts, texts)]
            out["plausible"] = sum(verdicts)
            out["plausibility"] = sum(verdicts) / max(1, len(verdicts))
            out["examples"] = [{"file": p["file"], "line": p["line"], "ok": v, "text": p["prompt"] + c}
                               for p, c, v in list(zip(prompts, texts, verdicts))[:keep_examples]]
        log(f"[eval] {models_dir.name or models_dir}/{name}: held-out stdlib loss {losses['loss']:.4f} "
            f"(ppl {losses['ppl']:.2f}, {losses['nats_per_byte']:.4f} nats/byte, {losses['tokens']} tokens)"
            + (f"; plausibility {out['plausibility']:.3f} ({out['plausible']}/{len(prompts)})"
               if name == "target" else ""))
        del model
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def main(argv=None) -> int:
    import argparse

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser(description="plausibility of greedy completions of held-out signatures and "
                                             "held-out stdlib perplexity of a model family")
    ap.add_argument("models_dir", type=Path, nargs="+", help="family directories (with target/ and draft/)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--limit", type=int, default=SIGNATURES, help="signatures (default 200)")
    ap.add_argument("--max-files", type=int, default=None, help="held-out files for the perplexity")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    from engine.train.lm import pick_device

    device = pick_device(args.device)
    results = [evaluate_family(d, device, args.limit, args.max_files) for d in args.models_dir]
    for r in results:
        r.pop("examples", None)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0
