"""The training corpus: the running interpreter's standard-library `.py` sources and (preset `full`) the
`.py` sources of the installed distributions whose licence is permissive.

Every machine with Python has the standard library, so the app can rebuild its models offline. Choices:
- The standard library walk skips `site-packages`/`dist-packages`; installed distributions are a second source
  (`package_sources`), read through `importlib.metadata` (each distribution's own file list), kept only when
  its metadata names a permissive licence (`classify_licence`: License-Expression, else the licence
  classifiers, else the License field); unknown, proprietary and copyleft ones are skipped and listed.
- The stdlib test suites ARE kept: they double the code available (~31 MB instead of ~12 MB on 3.11),
  which matters more for a 7M-parameter model than their slightly unusual style.
- Files above `max_file_bytes` are skipped (generated tables, e.g. pydoc_data/topics.py).
- The train/validation split is per file, by a hash of the relative path, so it is stable across runs
  and machines; held-out prompts and the held-out text sample come from validation files only. A standard
  library file keeps its path relative to the stdlib root (`json/decoder.py`), so its split is the same as in
  the stdlib-only corpus; a package file is `pkg/<distribution>/<path in site-packages>`.
- With packages, files are deduplicated by content (sha256 of the text; the standard library comes first, so
  a vendored copy of a stdlib file never lands in training when the original is held out), and near-empty,
  generated (a `DO NOT EDIT` style header, data-table line lengths) and huge files are skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class SourceFile:
    rel: str       # path relative to the stdlib root, '/'-separated (packages: pkg/<dist>/<path>)
    text: str
    split: str     # "train" | "val"
    source: str = "stdlib"   # "stdlib" or the distribution's name


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


TEST_SUITE_DIRS = {"test", "tests", "idle_test"}


def in_test_suite(rel: str) -> bool:
    """Whether a stdlib path lies in a test-suite directory (`test/`, `tests/`, `idlelib/idle_test/`)."""
    return any(part in TEST_SUITE_DIRS for part in rel.split("/")[:-1])


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


def manifest(files: list[SourceFile], root: Optional[Path] = None, info: Optional[dict] = None,
             list_train: bool = True) -> dict:
    """File list with per-file sha256 and one sha256 over the whole corpus (paths and texts, in order).
    info: build_corpus's (distributions included and skipped, files dropped), recorded when given.
    list_train=False lists the validation files only (a corpus of many thousand files would make the
    shipped manifest larger than a model); the hash still covers every file."""
    whole = hashlib.sha256()
    entries = []
    total = 0
    for f in files:
        data = f.text.encode("utf-8")
        total += len(data)
        whole.update(f.rel.encode("utf-8") + b"\0" + data + b"\0")
        if list_train or f.split == "val":
            entries.append({"path": f.rel, "split": f.split, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
    out = {
        "source": "Python standard library (.py files)" if info is None else
                  "Python standard library and permissively licensed installed packages (.py files)",
        "python_version": platform.python_version(),
        "stdlib_root": str(root or stdlib_root()),
        "corpus_sha256": whole.hexdigest(),
        "n_files": len(files),
        "n_train_files": sum(f.split == "train" for f in files),
        "n_val_files": sum(f.split == "val" for f in files),
        "total_bytes": total,
        "files_listed": "all" if list_train else "validation files only",
    }
    if info is not None:
        out.update(packages=info["included"], skipped_packages=info["skipped"], dropped_files=info["dropped"])
    out["files"] = entries
    return out


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


def write_heldout(files: list[SourceFile], out_dir: Path, n_prompts: int, sample_bytes: int,
                  info: Optional[dict] = None) -> dict:
    """Write manifest.json, heldout_prompts.json and heldout_sample.txt into out_dir (and, for a corpus with
    packages, manifest_full.json listing every file). Prompts and the sample come from standard-library
    validation files, so that they stay comparable with the stdlib-only family."""
    out_dir.mkdir(parents=True, exist_ok=True)
    man = manifest(files, info=info, list_train=info is None)
    (out_dir / "manifest.json").write_text(json.dumps(man, indent=1))
    if info is not None:
        (out_dir / "manifest_full.json").write_text(json.dumps(manifest(files, info=info)))
    stdlib = [f for f in files if f.source == "stdlib"] or files
    prompts = heldout_prompts(stdlib, n_prompts)
    (out_dir / "heldout_prompts.json").write_text(json.dumps(
        {"source": "validation files of the corpus (see manifest.json)",
         "corpus_sha256": man["corpus_sha256"],
         "prompts": prompts}, indent=1))
    sample = heldout_sample(stdlib, sample_bytes)
    (out_dir / "heldout_sample.txt").write_bytes(sample.encode("utf-8"))  # exact newlines
    return {"corpus_sha256": man["corpus_sha256"], "python_version": man["python_version"],
            "n_files": man["n_files"],
            "n_val_files": man["n_val_files"], "total_bytes": man["total_bytes"],
            "n_prompts": len(prompts), "sample_bytes": len(sample.encode("utf-8"))}


# ----------------------------------------------------------------------------- installed packages

# SPDX ids (lower case) of permissive licences: code under them may be used to train and ship a model
PERMISSIVE_SPDX = {
    "mit", "mit-0", "mit-cmu", "0bsd", "bsd-2-clause", "bsd-3-clause", "bsd-3-clause-clear", "bsd-4-clause",
    "apache-2.0", "apache-1.1", "psf-2.0", "python-2.0", "python-2.0.1", "cnri-python", "isc", "zlib",
    "cc0-1.0", "unlicense", "bsl-1.0", "hpnd", "x11", "ncsa", "postgresql", "upl-1.0", "blueoak-1.0.0",
    "wtfpl", "ftl", "libpng", "curl",
}
# spellings found in License fields and classifiers, matched as whole words in lower case
PERMISSIVE_WORDS = [
    ("mit", "MIT"), ("bsd", "BSD"), ("apache", "Apache-2.0"), ("psf", "PSF-2.0"),
    ("python software foundation", "PSF-2.0"), ("isc", "ISC"), ("zlib", "Zlib"), ("unlicense", "Unlicense"),
    ("cc0", "CC0-1.0"), ("public domain", "public domain"), ("boost software license", "BSL-1.0"),
    ("historical permission notice", "HPND"),
]
COPYLEFT_SPDX_PREFIXES = ("gpl", "lgpl", "agpl", "mpl", "epl", "eupl", "cddl", "osl", "sspl", "cecill",
                          "cc-by-sa", "cc-by-nc", "licenseref-proprietary")
COPYLEFT_WORDS = ("gpl", "gnu", "mpl", "mozilla public", "epl", "eclipse public", "eupl", "cddl", "osl",
                  "cecill", "sspl", "commons clause", "cc-by-sa", "share-alike", "non-commercial", "cc-by-nc",
                  "affero", "proprietary", "copyleft")
LICENCE_TEXT_MARKERS = (("permission is hereby granted, free of charge", "MIT"),
                        ("redistribution and use in source and binary forms", "BSD"),
                        ("licensed under the apache license", "Apache-2.0"),
                        ("apache license, version 2.0", "Apache-2.0"))


@dataclass
class Licence:
    ok: bool
    name: str      # the licence as the metadata spells it (shortened), or why it is unknown
    field: str     # which metadata field decided: License-Expression, Classifier, License, none


def spdx_permissive(expression: str) -> Optional[bool]:
    """True when an SPDX expression allows permissive use (an OR needs one permissive side, an AND all;
    `X WITH exception` counts as X), False when it does not, None when it names nothing known."""
    text = expression.replace("(", " ( ").replace(")", " ) ")
    tokens = text.split()

    def parse_joined(i: int, word: str, parse_side, combine):   # side (word side)*, folded by combine
        ok, i = parse_side(i)
        while i < len(tokens) and tokens[i].upper() == word:
            right, i = parse_side(i + 1)
            ok = combine(ok, right)
        return ok, i

    def parse_or(i: int):
        return parse_joined(i, "OR", parse_and, _either)

    def parse_and(i: int):
        return parse_joined(i, "AND", parse_atom, _both)

    def parse_atom(i: int):
        if i >= len(tokens):
            return None, i
        if tokens[i] == "(":
            ok, i = parse_or(i + 1)
            return ok, i + 1 if i < len(tokens) and tokens[i] == ")" else i
        ident = tokens[i].lower().rstrip("+")
        i += 1
        if i < len(tokens) and tokens[i].upper() == "WITH":   # an exception only widens what is allowed
            i += 2
        if ident in PERMISSIVE_SPDX:
            return True, i
        if ident.startswith(COPYLEFT_SPDX_PREFIXES):
            return False, i
        return None, i

    ok, _ = parse_or(0)
    return ok


def _either(a: Optional[bool], b: Optional[bool]) -> Optional[bool]:
    return True if (a or b) else (False if (a is False and b is False) else None)


def _both(a: Optional[bool], b: Optional[bool]) -> Optional[bool]:
    return False if (a is False or b is False) else (True if (a and b) else None)


def _free_text_licence(text: str) -> Optional[tuple[bool, str]]:
    """A License field or classifier in words: copyleft/proprietary wins over any permissive word."""
    lower = text.lower()
    if any(re.search(rf"(?<![a-z]){re.escape(w)}", lower) for w in COPYLEFT_WORDS):
        return False, text
    for marker, name in LICENCE_TEXT_MARKERS:
        if marker in lower:
            return True, name
    for word, name in PERMISSIVE_WORDS:
        if re.search(rf"(?<![a-z]){re.escape(word)}(?![a-z])", lower):
            return True, name
    return None


def classify_licence(meta) -> Licence:
    """Whether a distribution's metadata (an email.message-like object: get / get_all) names a permissive
    licence. License-Expression (SPDX) decides when present; else the `License ::` classifiers (a copyleft
    one vetoes); else the License field (a short name, or the licence's text). Anything else is unknown and
    skipped."""
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        verdict = spdx_permissive(expression)
        return Licence(bool(verdict), expression if verdict is not None else f"unknown ({expression})",
                       "License-Expression")
    classifiers = [c for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    named = [c.split("::")[-1].strip() for c in classifiers if c.count("::") >= 2 and not
             c.rstrip().endswith(("OSI Approved", "DFSG approved"))]
    verdicts = [(_free_text_licence(c), c) for c in named]
    if any(v is not None and not v[0] for v, _ in verdicts):
        return Licence(False, next(c for v, c in verdicts if v is not None and not v[0]), "Classifier")
    good = [c for v, c in verdicts if v is not None and v[0]]
    if good:
        return Licence(True, "; ".join(good), "Classifier")
    field = (meta.get("License") or "").strip()
    if field and field.upper() != "UNKNOWN":
        short = " ".join(field.split())[:80]
        spdx = spdx_permissive(field) if len(field) < 80 else None
        if spdx is not None:
            return Licence(spdx, short, "License")
        verdict = _free_text_licence(field)
        if verdict is not None:
            return Licence(verdict[0], verdict[1] if verdict[0] and len(field) > 80 else short, "License")
        return Licence(False, f"unknown ({short})", "License")
    return Licence(False, "unknown (no licence metadata)", "none")


GENERATED_MARKERS = ("DO NOT EDIT", "do not edit", "@generated", "auto-generated", "autogenerated",
                     "Autogenerated", "Auto-generated", "Generated by the protocol buffer compiler",
                     "This file was automatically generated", "THIS FILE IS GENERATED",
                     "generated automatically", "gencodec.py", "generated from")


def skip_reason(text: str, max_file_bytes: int, min_code_lines: int = 4) -> Optional[str]:
    """Why a source file is left out ("huge", "near-empty", "generated"), or None to keep it."""
    size = len(text.encode("utf-8"))
    if size > max_file_bytes:
        return "huge"
    lines = text.splitlines()
    code = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if len(code) < min_code_lines:
        return "near-empty"
    head = "\n".join(lines[:12])
    if any(m in head for m in GENERATED_MARKERS):
        return "generated"
    longest = max(len(ln) for ln in lines)
    if longest > 2000 or size / max(1, len(lines)) > 160:   # data tables, minified or embedded blobs
        return "generated"
    return None


def _dist_name(dist) -> str:
    return (dist.metadata.get("Name") or "").strip()


def package_sources(max_file_bytes: int, max_package_bytes: Optional[int], exclude=("specplay",),
                    distributions=None) -> tuple[list[SourceFile], list[dict], list[dict]]:
    """The `.py` files of installed distributions with a permissive licence.

    Returns (files, included, skipped): files carry rel = pkg/<dist>/<path> and split "" (assigned later);
    included: one row per kept distribution (name, version, licence, the field that decided); skipped: one
    row per left-out distribution with the reason. A distribution larger than max_package_bytes keeps a
    deterministic subset of its files (lowest path hashes) up to that size, so one huge package does not
    crowd out the rest. distributions: for tests (default importlib.metadata.distributions())."""
    from importlib import metadata

    dists = list(distributions if distributions is not None else metadata.distributions())
    seen: set = set()
    files: list[SourceFile] = []
    included, skipped = [], []
    for dist in sorted(dists, key=lambda d: _dist_name(d).lower()):
        name = _dist_name(dist)
        key = name.lower().replace("_", "-")
        if not name or key in seen:
            continue
        seen.add(key)
        if key in exclude:
            skipped.append({"name": name, "version": dist.version, "reason": "this project"})
            continue
        licence = classify_licence(dist.metadata)
        if not licence.ok:
            skipped.append({"name": name, "version": dist.version, "reason": f"licence: {licence.name}"})
            continue
        listed = [f for f in (dist.files or []) if str(f).endswith(".py")]
        if not listed:
            skipped.append({"name": name, "version": dist.version, "reason": "no .py files listed"})
            continue
        rels = sorted({f"pkg/{name}/{Path(str(f)).as_posix()}": f for f in listed}.items())
        chosen, total, eligible = [], 0, 0
        for rel, f in sorted(rels, key=lambda item: path_bucket(item[0], "subset")):
            try:
                path = Path(dist.locate_file(f))
                size = path.stat().st_size
            except (OSError, ValueError):
                continue
            if size > max_file_bytes or "__pycache__" in rel:
                continue
            eligible += size
            if max_package_bytes is not None and total + size > max_package_bytes:
                continue
            total += size
            chosen.append((rel, path))
        for rel, path in sorted(chosen):
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            files.append(SourceFile(rel, text, "", source=name))
        included.append({"name": name, "version": dist.version, "licence": licence.name,
                         "licence_field": licence.field, "capped": total < eligible})
    return files, included, skipped


def load_stdlib(max_file_bytes: int, root: Optional[Path] = None) -> list[SourceFile]:
    root = root or stdlib_root()
    return [SourceFile(rel, (root / rel).read_text(encoding="utf-8", errors="replace"), "")
            for rel in list_sources(root, max_file_bytes)]


def build_corpus(max_file_bytes: int, val_fraction: float, max_package_bytes: Optional[int],
                 stdlib_files: Optional[list] = None,
                 package_files: Optional[tuple] = None) -> tuple[list, dict]:
    """The standard library plus permissive packages, filtered, deduplicated and split.

    Returns (files, info): info has `included` and `skipped` distributions and `dropped` counts by reason
    (huge, near-empty, generated, duplicate). The split of each file is by its path's hash, as in
    load_corpus, so a stdlib file has the same split in both corpora. stdlib_files / package_files: for tests
    (the standard library's SourceFiles; package_sources' result)."""
    stdlib = stdlib_files if stdlib_files is not None else load_stdlib(max_file_bytes)
    pkg_files, included, skipped = package_files if package_files is not None else \
        package_sources(max_file_bytes, max_package_bytes)
    dropped: dict = {}
    kept: list[SourceFile] = []
    hashes: set = set()
    for f in list(stdlib) + list(pkg_files):       # stdlib first: a vendored copy loses to the original
        reason = skip_reason(f.text, max_file_bytes)
        if reason is None:
            digest = hashlib.sha256(f.text.encode("utf-8")).digest()
            reason = "duplicate" if digest in hashes else None
            hashes.add(digest)
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        kept.append(f)
    splits = assign_splits([f.rel for f in kept], val_fraction)
    for f in kept:
        f.split = splits[f.rel]
    return kept, {"included": included, "skipped": skipped, "dropped": dropped}


def source_table(files: list[SourceFile], token_counts: Optional[dict] = None) -> list[dict]:
    """Per source (stdlib, then each distribution): files, bytes and (when given) tokens, by split."""
    rows: dict = {}
    for f in files:
        row = rows.setdefault(f.source, {"source": f.source, "files": 0, "val_files": 0, "bytes": 0})
        row["files"] += 1
        row["val_files"] += f.split == "val"
        row["bytes"] += len(f.text.encode("utf-8"))
    for source, count in (token_counts or {}).items():
        if source in rows:
            rows[source]["tokens"] = int(count)
    return sorted(rows.values(), key=lambda r: (r["source"] != "stdlib", -r["bytes"]))


def stdlib_val_files(max_file_bytes: int = 256_000, val_fraction: float = 0.05,
                     root: Optional[Path] = None) -> list[SourceFile]:
    """The held-out standard-library files of this interpreter: the validation split of both corpora (the
    split is by path hash), so both the shipped and a new family can be evaluated on them."""
    files = load_corpus(None, max_file_bytes, val_fraction, root)
    return [f for f in files if f.split == "val" and skip_reason(f.text, max_file_bytes) is None]
