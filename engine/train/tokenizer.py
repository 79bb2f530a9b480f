"""Byte-level BPE tokenizer for code, trained with the `tokenizers` library.

Byte-level pre-tokenisation maps every byte to a visible symbol, so spaces, tabs and newlines survive
encode -> decode exactly; no normaliser and no prefix space are used for the same reason. A template
post-processor prepends `<s>` (as Llama tokenizers do), and training documents are `<s> text </s>`, so a
prompt encoded by AutoTokenizer looks like the start of a training document.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIALS = [BOS, EOS, PAD, UNK]   # ids 0..3


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the four special tokens at ids 0..3."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def save_hf(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Save tokenizer.json + tokenizer_config.json loadable by transformers.AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        clean_up_tokenization_spaces=False, model_max_length=model_max_length,
    )
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes its own backend name; the generic class also loads on transformers 4.x
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def load_hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_documents(tok: Tokenizer, texts: list[str], lengths: Optional[list] = None) -> np.ndarray:
    """Concatenate `<s> text </s>` for every text into one uint16 stream [N]; when `lengths` is a list, each
    document's token count (with its two specials) is appended to it."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = [np.asarray([bos] + e.ids + [eos], dtype=np.uint16) for e in encs]
    if lengths is not None:
        lengths.extend(len(part) for part in parts)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def roundtrip_ok(tok: Tokenizer, texts: list[str]) -> bool:
    """True when decode(encode(t)) == t for every text (whitespace included)."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return all(tok.decode(e.ids, skip_special_tokens=False) == t for e, t in zip(encs, texts))
