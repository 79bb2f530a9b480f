"""The corpus table n-gram prompt lookup fills its proposals from (engine.methods.ngram.corpus_table), built
for
a model directory's tokenizer from the standard library's training files (the split of engine.train.corpus:
the held-out prompts' validation files are left out).

    python main.py train --ngram-table assets/models/target
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

from engine.errors import SpecplayError

MAX_FILE_BYTES = 256_000
VAL_FRACTION = 0.05


def build_ngram_table(model_dir: Path, log=print, root=None):
    """Write model_dir/ngram_table.safetensors; returns the table. root: the standard library to read
    (default: the running interpreter's)."""
    from tokenizers import Tokenizer

    from engine.methods.ngram import corpus_table
    from engine.train.corpus import assign_splits, load_stdlib

    model_dir = Path(model_dir)
    tokenizer_file, config_file = model_dir / "tokenizer.json", model_dir / "config.json"
    if not (tokenizer_file.is_file() and config_file.is_file()):
        raise SpecplayError(f"{model_dir}: a corpus table needs the model's tokenizer.json and config.json")
    vocab = int(json.loads(config_file.read_text())["vocab_size"])
    files = load_stdlib(MAX_FILE_BYTES, root)
    splits = assign_splits([f.rel for f in files], VAL_FRACTION)
    train = [f.text for f in files if splits[f.rel] == "train"]
    if not train:
        raise SpecplayError("no standard-library training files found")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    sequences = [e.ids for e in tokenizer.encode_batch(train, add_special_tokens=False)]
    table = corpus_table.build(sequences, vocab, metadata={
        "tokenizer_sha256": corpus_table.tokenizer_sha256(model_dir),
        "corpus": f"Python {platform.python_version()} standard library, training split",
        "files": len(train), "files_held_out": len(files) - len(train)})
    path = model_dir / corpus_table.TABLE_FILE
    table.save(path)
    log(f"[ngram-table] {path}: {table.metadata['tokens']} tokens of {len(train)} files, "
        f"{table.metadata['pairs']} pairs, {path.stat().st_size} bytes")
    return table
