"""Shared test helpers for decoder / lossless tests: a draft that agrees with the target often but not
always."""
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
