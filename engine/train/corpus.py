"""The training corpus: the running interpreter's standard-library `.py` sources.

Every machine with Python has it, so the app can rebuild its models offline. Choices:
- `site-packages`/`dist-packages` are skipped (third-party code differs between machines).
- The stdlib test suites ARE kept: they double the code available (~31 MB instead of ~12 MB on 3.11),
  which matters more for a 7M-parameter model than their slightly unusual style.
- Files above `max_file_bytes` are skipped (generated tables, e.g. pydoc_data/topics.py).
- The train/validation split is per file, by a hash of the relative path, so it is stable across runs
  and machines; held-out prompts and the held-out text sample come from validation files only.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class SourceFile:
    rel: str       # path relative to the stdlib root, '/'-separated
    text: str
    split: str     # "train" | "val"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_bucket(rel: str, salt: str = "split") -> float:
    """A stable number in [0, 1) for a relative path (sha256, so no PYTHONHASHSEED dependence)."""
    digest = hashlib.sha256(f"{salt}:{rel}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def list_sources(root: Path, max_file_bytes: int) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted, without third-party dirs or giant files."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if full.is_file() and full.stat().st_size <= max_file_bytes:
                found.append(full.relative_to(root).as_posix())
    return sorted(found)


def choose_subset(rels: list[str], max_files: Optional[int]) -> list[str]:
    """A deterministic subset (lowest path hashes) for the tiny preset; all files otherwise."""
    if max_files is None or len(rels) <= max_files:
        return rels
    return sorted(sorted(rels, key=lambda r: path_bucket(r, "subset"))[:max_files])


def assign_splits(rels: list[str], val_fraction: float) -> dict[str, str]:
    """File-level split by path hash; guarantees at least one validation file."""
    splits = {r: ("val" if path_bucket(r) < val_fraction else "train") for r in rels}
    if rels and "val" not in splits.values():
        splits[min(rels, key=path_bucket)] = "val"
    return splits


def load_corpus(max_files: Optional[int], max_file_bytes: int, val_fraction: float,
                root: Optional[Path] = None) -> list[SourceFile]:
    root = root or stdlib_root()
    rels = choose_subset(list_sources(root, max_file_bytes), max_files)
    splits = assign_splits(rels, val_fraction)
    files = []
    for rel in rels:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if text.strip():
            files.append(SourceFile(rel, text, splits[rel]))
    return files


def manifest(files: list[SourceFile], root: Optional[Path] = None) -> dict:
    """File list with per-file sha256 and one sha256 over the whole corpus (paths and texts, in order)."""
    whole = hashlib.sha256()
    entries = []
    for f in files:
        data = f.text.encode("utf-8")
        whole.update(f.rel.encode("utf-8") + b"\0" + data + b"\0")
        entries.append({"path": f.rel, "split": f.split, "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest()})
    return {
        "source": "Python standard library (.py files)",
        "python_version": platform.python_version(),
        "stdlib_root": str(root or stdlib_root()),
        "corpus_sha256": whole.hexdigest(),
        "n_files": len(files),
        "n_train_files": sum(f.split == "train" for f in files),
        "n_val_files": sum(f.split == "val" for f in files),
        "total_bytes": sum(e["bytes"] for e in entries),
        "files": entries,
    }


def cut_prompt(text: str, start: int, lo: int, hi: int) -> Optional[str]:
    """The longest run of whole lines from `start` whose length is in [lo, hi], or None."""
    lines = text[start:].splitlines(keepends=True)
    out = ""
    for line in lines:
        if len(out) + len(line) > hi:
            break
        out += line
    return out if len(out) >= lo and out.strip() else None


def prompt_start(text: str, frac: float) -> int:
    """Offset of the first top-level (unindented, non-blank) line at or after `frac` of the file."""
    pos = text.rfind("\n", 0, int(len(text) * frac)) + 1
    while pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end + 1
        if text[pos] not in " \t\r\n#":
            return pos
        pos = end
    return 0


def heldout_prompts(files: list[SourceFile], n: int, lo: int = 100, hi: int = 300) -> list[dict]:
    """Code prefixes from validation files, cut at line boundaries, starting at a top-level line
    somewhere in the middle 70% of the file (file starts are mostly licence headers)."""
    val = sorted((f for f in files if f.split == "val"), key=lambda f: path_bucket(f.rel))
    prompts: list[dict] = []
    for round_ in range(20):
        for f in val:
            start = prompt_start(f.text, 0.15 + 0.7 * path_bucket(f.rel, f"prompt{round_}"))
            p = cut_prompt(f.text, start, lo, hi)
            if p and all(p != q["text"] for q in prompts):
                prompts.append({"id": len(prompts), "file": f.rel, "offset": start, "text": p})
            if len(prompts) >= n:
                return prompts
    return prompts


def heldout_sample(files: list[SourceFile], n_bytes: int, n_pieces: int = 30) -> str:
    """About n_bytes of validation text: whole-line pieces from the middle of many validation files
    (one file alone, e.g. a codec's mapping table, would not be representative)."""
    val = sorted((f for f in files if f.split == "val"), key=lambda f: path_bucket(f.rel))
    per_file = max(500, n_bytes // max(1, min(n_pieces, len(val))))
    out = ""
    for f in val:
        room = min(per_file, n_bytes - len(out))
        if room < 100:
            break
        start = prompt_start(f.text, 0.15 + 0.7 * path_bucket(f.rel, "sample"))
        piece = cut_prompt(f.text, start, 1, room)
        if piece:
            out += piece if piece.endswith("\n") else piece + "\n"
    return out


def write_heldout(files: list[SourceFile], out_dir: Path, n_prompts: int, sample_bytes: int) -> dict:
    """Write manifest.json, heldout_prompts.json and heldout_sample.txt into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    man = manifest(files)
    (out_dir / "manifest.json").write_text(json.dumps(man, indent=1))
    prompts = heldout_prompts(files, n_prompts)
    (out_dir / "heldout_prompts.json").write_text(json.dumps(
        {"source": "validation files of the corpus (see manifest.json)",
         "corpus_sha256": man["corpus_sha256"],
         "prompts": prompts}, indent=1))
    sample = heldout_sample(files, sample_bytes)
    (out_dir / "heldout_sample.txt").write_bytes(sample.encode("utf-8"))  # exact newlines
    return {"corpus_sha256": man["corpus_sha256"], "python_version": man["python_version"],
            "n_files": man["n_files"],
            "n_val_files": man["n_val_files"], "total_bytes": man["total_bytes"],
            "n_prompts": len(prompts), "sample_bytes": len(sample.encode("utf-8"))}
