"""The window's one door into the engine: build a decoder for a target/draft pair."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

SHIPPED_LABEL = "shipped pair"


def load_decoder(target: Optional[str], draft: Optional[str], device: str = "auto"):
    """target None = the shipped pair (with `draft` or the shipped draft). A target without a draft loads alone:
    the draft-model method is then unavailable, the model-free ones still work."""
    from engine.decoder import SpeculativeDecoder  # imported here so the window opens whatever the engine's state
    from engine.models import load_pair

    need_draft = target is None or draft is not None
    return SpeculativeDecoder(load_pair(target, draft, device=device, need_draft=need_draft))


def models_label(target: Optional[str], draft: Optional[str]) -> str:
    if target is None and draft is None:
        return SHIPPED_LABEL
    target_name = Path(target).name if target else "shipped target"
    draft_name = Path(draft).name if draft else ("shipped draft" if target is None else "no draft")
    return f"{target_name} + {draft_name}"
