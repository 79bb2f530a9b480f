"""Shared test helpers for decoder / lossless tests: a draft that agrees with the target often but not
always, and a decoder over such a pair."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_perturbed_copy(src, dst, noise: float = 0.5, seed: int = 0) -> Path:
    """Copy the model directory src to dst with every weight matrix perturbed by relative Gaussian noise.

    The copy shares the tokenizer and architecture; its greedy choices agree with the source's often but not
    always, so a speculative run sees accepted drafts, partial acceptance and rejections."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if value.dim() == 2:
            tensors[name] = value + noise * value.std() * torch.randn(value.shape, generator=gen)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_close_pair_dirs(root) -> tuple:
    """(target, draft) directories under root: a 2-layer tiny Llama (vocab 96, hidden 64) and a copy of it
    perturbed by 0.3 as its draft, so rounds accept some drafts, not all."""
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(Path(root) / "target", vocab=96, hidden=64, layers=2, seed=0)
    draft = make_perturbed_copy(target, Path(root) / "draft", noise=0.3, seed=2)
    return str(target), str(draft)


def make_close_decoder(root, noise: float = 0.3):
    """A CPU SpeculativeDecoder over the tiny pair's target (made under root) and, as its draft, a copy of it
    perturbed by `noise` (root/perturbed): rounds accept some drafts, not all."""
    from tiny_models import make_tiny_pair

    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    target, _ = make_tiny_pair(root)
    draft = make_perturbed_copy(target, Path(root) / "perturbed", noise=noise)
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


def target_only_decoder(target_dir):
    """A fresh CPU SpeculativeDecoder over the model at target_dir alone: no draft, a fresh session memory."""
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    return SpeculativeDecoder(load_pair(str(target_dir), None, device="cpu", need_draft=False))
