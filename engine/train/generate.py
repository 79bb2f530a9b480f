"""Batched generation with a transformers causal LM (left-padded prompts, a KV cache): the held-out
plausibility metric's greedy completions and the target's own sampled text that the heads are distilled on.

Shapes: B = batch, P = padded prompt length, N = new tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from engine.train.lm import PAD_ID, autocast


def left_pad(prompts: list, pad: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, P] left-padded, attention mask [B, P] with 1 on real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, ids: torch.Tensor, mask: Optional[torch.Tensor], new_tokens: int,
             temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Continue ids [B, P] (left-padded where mask [B, P] is 0) by new_tokens tokens: the argmax when
    temperature is 0, else samples at that temperature (drawn with `generator`, a generator on ids' device,
    so that runs are reproducible). Returns the new tokens [B, N]. Tokens after an EOS are generated too
    (callers cut)."""
    device = ids.device
    if mask is None:
        mask = torch.ones_like(ids)
    mask = mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)                      # [B, P]
    out_tokens = []
    past = None
    step_ids, step_pos, step_mask = ids, positions, mask
    for _ in range(new_tokens):
        with autocast(device):
            out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_pos,
                        past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1].float()                                 # [B, V]
        if temperature <= 0:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        out_tokens.append(token)
        step_ids = token[:, None]
        step_pos = step_pos[:, -1:] + 1
        step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
    return torch.stack(out_tokens, dim=1)
