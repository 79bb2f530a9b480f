"""The window's one door into the engine: build a decoder for a target/draft pair."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.errors import SpecplayError

SHIPPED_LABEL = "shipped pair"
THREADS: Optional[int] = None  # `main.py gui --threads N`; None: engine.core.threads chooses for the models


def load_decoder(target: Optional[str], draft: Optional[str], device: str = "auto"):
    """target None = the shipped pair (with `draft` or the shipped draft). A target without a draft loads
    alone: the draft-model method is then unavailable, the model-free ones still work.

    The engine is imported here, off the GUI thread, so the window opens whatever the engine's state."""
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    need_draft = target is None or draft is not None
    pair = load_pair(target, draft, device=device, need_draft=need_draft)
    set_threads(pair)
    decoder = SpeculativeDecoder(pair)
    decoder.warm_up()  # CUDA kernels and prefill buckets now, while the window says "loading" (CPU: no-op)
    return decoder


def shipped_draft() -> Optional[str]:
    """The shipped draft model's folder (None where the project ships none)."""
    from engine.models.loading import shipped_pair

    try:
        return str(shipped_pair()[1])
    except SpecplayError:
        return None


def set_threads(pair) -> int:
    """torch's CPU threads for the loaded pair: THREADS, else engine.core.threads' choice (a small model one
    thread, a larger one the physical cores less one, which leaves a core for the window to draw on)."""
    from engine.core.threads import apply_threads

    return apply_threads((pair.target, pair.draft), THREADS)


def preload_engine() -> None:
    """Import the engine (torch, transformers) on the calling thread. Called before the window opens: a first
    import of torch inside a worker thread, racing the GUI thread for the GIL, can crawl for a minute."""
    # transformers resolves its modules lazily on first attribute access: do it here, not in the loader thread
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    # with the decoder, what the end of every generation uses on the GUI thread (the kept session, the
    # diagnosis): imported there the first time, they stalled the event loop ~20 ms
    import engine.analysis.diagnose  # noqa: F401
    import engine.core.decoder  # noqa: F401
    import engine.files.exports  # noqa: F401
    import engine.models.loading  # noqa: F401


def models_label(target: Optional[str], draft: Optional[str]) -> str:
    if target is None and draft is None:
        return SHIPPED_LABEL
    target_name = Path(target).name if target else "shipped target"
    draft_name = Path(draft).name if draft else ("shipped draft" if target is None else "no draft")
    return f"{target_name} + {draft_name}"


def forward_path_text(decoder) -> str:
    """Which forward runs each loaded model and, off the fast path, why (engine.models.loading's
    forward_paths), e.g. "target: fast path; draft: transformers path: model_type 'gpt2' is not on the fast
    path (…)"; "" when the decoder has no pair."""
    from engine.models.loading import forward_paths

    pair = getattr(decoder, "pair", None)
    return forward_paths(pair.target, pair.draft) if pair is not None else ""


def off_fast_path(forward_path: str) -> bool:
    """Whether forward_path_text names a model on the transformers path."""
    return "transformers path" in forward_path


def path_suffix(forward_path: str) -> str:
    """The status bar's short word for forward_path_text: " · fast path" when every model runs on it,
    " · transformers path" when one does not (the tooltip and the load message say which and why)."""
    if not forward_path:
        return ""
    return " · transformers path" if off_fast_path(forward_path) else " · fast path"


def context_limit(decoder):
    """Tokens the loaded pair can hold (the smaller of target and draft), or None when unknown."""
    limits = []
    for name in ("target", "draft"):
        runner = getattr(getattr(decoder, "pair", None), name, None) if name == "draft" else \
            getattr(decoder, "target", None)
        limit = getattr(runner, "max_length", None)
        if isinstance(limit, int) and limit > 0:
            limits.append(limit)
    return min(limits) if limits else None


def count_tokens(decoder, text: str) -> int:
    """The prompt's length in tokens (0 when the decoder has no tokenizer)."""
    tokenizer = getattr(decoder, "tokenizer", None)
    return len(tokenizer.encode(text)) if tokenizer is not None else 0


def prompt_ids(decoder, text: str) -> Optional[list]:
    """The prompt's token ids as the decoder reads them, for the trace header (None where it cannot say)."""
    encode = getattr(decoder, "prompt_ids", None)
    if encode is None:
        return None
    try:
        return encode(text)
    except SpecplayError:
        return None


def suffix_replay(decoder, config) -> Optional[tuple]:
    """(documents, vocab) that replay the suffix generation that just ended (app.session.Generation.replay):
    what the session's memory held as it began; None for other methods or stand-in decoders."""
    if getattr(config, "method", None) != "suffix" or not hasattr(decoder, "suffix_memory"):
        return None
    return list(decoder.suffix_memory().begun_with), decoder.vocab_size


def dtype_name(decoder):
    """'float32', 'bfloat16', ... of the target's weights, or None."""
    dtype = getattr(getattr(decoder, "target", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def forget_session(decoder) -> None:
    """Session → Clear: suffix decoding's memory of the session's generations goes too (a corpus file is read
    again by the next suffix generation that names it)."""
    restore = getattr(decoder, "restore_session", None)
    if restore is not None:
        restore(None)


def remember_generations(decoder, generations: list) -> None:
    """Suffix decoding's memory takes the session's suffix generations read back or made on another load of
    these models ((prompt ids, output) each, in order; those without prompt ids are left out)."""
    memory = getattr(decoder, "suffix_memory", None)
    documents = [list(ids) + list(output) for ids, output in generations if ids]
    if memory is not None and documents:
        memory().remember(documents)
