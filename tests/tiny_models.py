"""Tiny random models and a tiny tokenizer for tests: deterministic (seeded), offline, fast.

Typical use:

    target = make_tiny_llama(tmp_path / "target", seed=0)          # also saves the shared tokenizer
    draft = make_tiny_llama(tmp_path / "draft", hidden=32, seed=1)
    gpt2 = make_tiny_gpt2(tmp_path / "gpt2")

Weights are drawn with a larger spread than transformers' default init (and norms/biases are randomised too),
so that logits are far from uniform and numerical comparisons are meaningful.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import torch

PathLike = Union[str, Path]

SPECIALS = ["<unk>", "<s>", "</s>"]
# Most frequent characters first so that small vocabularies still cover ordinary text.
CHARS = (
    " etaoinshrdlucmfwypvbgkjqxz.,\n"
    + "ETAOINSHRDLUCMFWYPVBGKJQXZ0123456789"
    + "!\"#$%&'()*+-/:;<=>?@[\\]^_`{|}~\t"
)

DEFAULT_VOCAB = 96


def tiny_vocab(vocab_size: int = DEFAULT_VOCAB) -> list:
    """The token strings, id order: 3 specials, then characters by frequency, then <extra_i> padding."""
    chars = list(dict.fromkeys(CHARS))
    tokens = SPECIALS + chars[: max(0, vocab_size - len(SPECIALS))]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    return tokens


def make_tiny_tokenizer(path: PathLike, vocab_size: int = DEFAULT_VOCAB):
    """Save a character-level fast tokenizer (ids < vocab_size) to `path` and return it.

    Built with `tokenizers` offline: a BPE model with no merges over single characters (unknown characters map
    to <unk>), a Fuse decoder so decode() concatenates characters, and <s>/</s>/<unk> specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tiny_vocab(vocab_size))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return tok


def _randomise(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter deterministically: matrices ~ N(0, std), norm weights ~ 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            is_norm = "norm" in name or name.split(".")[-2].startswith("ln")
            if p.dim() == 1 and is_norm and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)  # biases
            else:
                p.copy_(std * noise)


def _save_random_model(path: PathLike, config, seed: int, std: float, tokenizer_vocab: Optional[int]) -> Path:
    """Build `config`'s model (eager attention) with _randomise(seed, std), save it to `path` with
    make_tiny_tokenizer(path, tokenizer_vocab) unless that is None, and return the path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomise(model, seed, std)
    path = Path(path)
    model.save_pretrained(str(path))
    if tokenizer_vocab is not None:
        make_tiny_tokenizer(path, tokenizer_vocab)
    return path


def tiny_llama_config(
    arch: str = "llama",
    vocab: int = DEFAULT_VOCAB,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: Optional[int] = None,
    max_position: int = 256,
    tie: bool = False,
    rope: Optional[dict] = None,
    rope_theta: float = 10000.0,
):
    """A transformers config for arch "llama" | "qwen2" | "mistral" (eager attention, no sliding window).

    rope: extra rope parameters, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32} or {"rope_type": "linear", "factor": 2}.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    rope_params = {"rope_type": "default", "rope_theta": rope_theta, **(rope or {})}
    if hasattr(cls(), "rope_parameters"):  # transformers 5.x
        kwargs["rope_parameters"] = rope_params
    else:  # 4.x
        kwargs["rope_theta"] = rope_theta
        if rope:
            kwargs["rope_scaling"] = rope_params
    if arch == "mistral":
        kwargs["sliding_window"] = None
    config = cls(**kwargs)
    config._attn_implementation = "eager"
    return config


def make_tiny_llama(path: PathLike, seed: int = 0, std: float = 0.15, tokenizer: bool = True,
                    tokenizer_vocab: Optional[int] = None, **config) -> Path:
    """Save a tiny random Llama / Qwen2 / Mistral (safetensors) to `path` and return the path.

    config: tiny_llama_config's arguments by name (arch, vocab, hidden, layers, heads, kv_heads, tie, rope,
    rope_theta, ...). tokenizer=True also saves `make_tiny_tokenizer(path, tokenizer_vocab or vocab)`, so a
    target and a draft made with the same vocab share the tokenizer. Qwen2 gets random q/k/v biases."""
    model_config = tiny_llama_config(**config)
    vocab = tokenizer_vocab or model_config.vocab_size
    return _save_random_model(path, model_config, seed, std, vocab if tokenizer else None)


def make_tiny_gpt2(path: PathLike, vocab: int = DEFAULT_VOCAB, hidden: int = 32, layers: int = 2,
                   heads: int = 4, seed: int = 0, std: float = 0.15, tokenizer: bool = True) -> Path:
    """Save a tiny random GPT-2 (a non-Llama model, served by HFRunner) to `path` and return the path."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256,
        bos_token_id=1, eos_token_id=2,
    )
    return _save_random_model(path, config, seed, std, vocab if tokenizer else None)


def make_tiny_pair(root: PathLike, arch: str = "llama", vocab: int = DEFAULT_VOCAB) -> Tuple[Path, Path]:
    """(target_dir, draft_dir) under `root`: a 2-layer target and a 1-layer draft sharing one tokenizer."""
    root = Path(root)
    target = make_tiny_llama(root / "target", arch=arch, vocab=vocab, hidden=64, layers=2, seed=0)
    draft = make_tiny_llama(root / "draft", arch=arch, vocab=vocab, hidden=32, layers=1, seed=1)
    return target, draft


def load_hf_reference(path: PathLike):
    """The transformers model saved at `path`, fp32, eager attention, eval mode (the reference for tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").float().eval()
