"""Decoding stays exact on awkward checkpoints: padded vocabularies, a tokenizer with a token past the model's
vocabulary, a Qwen2 target with a Llama draft, sliding-window attention (issue 15, model side)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_fixtures import make_perturbed_copy
from tiny_models import load_hf_reference, make_tiny_llama

from engine.analysis.lossless import check_sampling, exact_two_token_distribution
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.models.loading import load_pair, load_tokenizer

PROMPT = "the cat sat on the mat. the cat sat on the"
NEW_TOKENS = 40


def set_config(path, **fields):
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(fields)
    cfg_path.write_text(json.dumps(cfg))
    return path


def narrow_vocab(path, vocab: int):
    """Keep the first `vocab` rows of the embedding and the LM head (a draft with a smaller padded vocab)."""
    tensors = load_file(str(path / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return set_config(path, vocab_size=vocab)


def transformers_greedy(path, ids: list, n: int) -> list:
    model = load_hf_reference(path)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(decoder, method: str, n: int = NEW_TOKENS, k: int = 4, prompt: str = PROMPT) -> list:
    return decoder.generate_ids(prompt, GenerationConfig(method=method, k=k, max_new_tokens=n))


# ------------------------------------------------------------------------------------------ padded vocabulary


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """Target vocab 384, draft vocab 320, tokenizer 300 (the issue's pair): the draft cannot propose ids
    320..383, and the target's padded rows 300..383 carry probability like any other row."""
    root = tmp_path_factory.mktemp("padded")
    target = make_tiny_llama(root / "target", vocab=384, tokenizer_vocab=300, seed=0)
    draft = narrow_vocab(make_perturbed_copy(target, root / "draft", noise=0.1), 320)
    return target, draft, SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


def test_padded_pair_keeps_the_target_width(padded):
    _, _, decoder = padded
    assert decoder.vocab_size == 384 and decoder.pair.draft.vocab_size == 320
    assert decoder.pair.draft.input_fill == 0  # the draft reads the target's ids past 320 as <unk>


@pytest.mark.parametrize("k", [2, 4])
def test_padded_pair_greedy_equals_plain_and_transformers(padded, k):
    target, _, decoder = padded
    plain = greedy(decoder, "none")
    assert greedy(decoder, "draft", k=k) == plain
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), NEW_TOKENS)
    assert any(t >= 320 for t in plain), "the run should emit an id only the target can score"


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
def test_padded_pair_sampling_is_lossless(tmp_path):
    """The same layout, small enough for the exact two-token distribution: target 48, draft 40,
    tokenizer 30, peaked weights (as in test_lossless)."""
    target = make_tiny_llama(tmp_path / "target", vocab=48, tokenizer_vocab=30, hidden=32, layers=1, seed=11,
                             std=0.3)
    draft = narrow_vocab(make_perturbed_copy(target, tmp_path / "draft", noise=0.3, seed=2), 40)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))
    prompt, sampling = "a tea at the tea at", SamplingParams(1.0, 0, 0.9)
    expected = exact_two_token_distribution(decoder, prompt, sampling)
    beyond_draft = sum(p for (a, b), p in expected.items() if a >= 40 or b >= 40)
    assert beyond_draft > 0.2, "the target must keep mass on ids the draft cannot propose"
    config = GenerationConfig(method="draft", k=3, sampling=sampling, seed=500)
    report = check_sampling(decoder, prompt, config, samples=1000)
    assert report.bins >= 8 and report.passed, report


# ------------------------------------------------------------------------------------------ Qwen2 tokenizers


def use_tokenizer_class(path, cls: str):
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = cls
    cfg_path.write_text(json.dumps(cfg))
    return path


def add_token_past_vocab(path):
    """Save the folder's tokenizer with one more special token: ids past the model's vocab_size."""
    tok = load_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(str(path))
    return path


def test_tokenizer_with_a_token_past_the_vocabulary_runs_as_transformers_does(tmp_path):
    path = add_token_past_vocab(make_tiny_llama(tmp_path / "qwen", arch="qwen2", seed=3))
    decoder = SpeculativeDecoder(load_pair(str(path), None, device="cpu", need_draft=False))
    assert len(decoder.tokenizer) > decoder.vocab_size
    ids = decoder.tokenizer.encode(PROMPT)
    assert greedy(decoder, "none", n=24) == transformers_greedy(path, ids, 24)


def test_qwen2_target_with_a_llama_draft_of_the_same_tokenizer_files(tmp_path):
    """The Qwen2 tokenizer class adds <|endoftext|> past the vocabulary (transformers 5: 97 vs 96 tokens);
    the ids both models can emit agree, so the pair is accepted and stays lossless."""
    target = use_tokenizer_class(make_tiny_llama(tmp_path / "qwen", arch="qwen2", seed=3), "Qwen2Tokenizer")
    draft = make_tiny_llama(tmp_path / "llama", arch="llama", hidden=32, layers=1, seed=4)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))
    plain = greedy(decoder, "none", n=24)
    assert greedy(decoder, "draft", n=24) == plain
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), 24)


# ------------------------------------------------------------------------------------------ sliding window


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral whose window (6) is far shorter than prompt + generation (82 tokens), with a close draft."""
    root = tmp_path_factory.mktemp("windowed")
    target = set_config(make_tiny_llama(root / "target", arch="mistral", seed=5), sliding_window=6)
    draft = make_perturbed_copy(target, root / "draft", noise=0.2)
    return target, SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


def test_sliding_window_model_generates_past_its_window(windowed):
    target, decoder = windowed
    ids = decoder.tokenizer.encode(PROMPT)
    assert len(ids) + NEW_TOKENS > 6 * 10 and decoder.target.max_length == 256
    plain = greedy(decoder, "none")
    assert plain == transformers_greedy(target, ids, NEW_TOKENS)


@pytest.mark.parametrize("method", ["draft", "ngram", "lookahead"])  # chains and a tree method
def test_sliding_window_speculation_equals_plain(windowed, method):
    _, decoder = windowed
    assert greedy(decoder, method) == greedy(decoder, "none")


def test_sliding_window_through_transformers_rolls_back(tmp_path):
    """A windowed Mistral the compact forward does not cover (dynamic rope) runs through HFRunner, whose
    cache must roll back past the window: full-length layers, the window applied by the mask."""
    from engine.models.hf_runner import HFRunner

    target = set_config(make_tiny_llama(tmp_path / "target", arch="mistral", seed=5,
                                        rope={"rope_type": "dynamic", "factor": 2.0}), sliding_window=6)
    draft = make_perturbed_copy(target, tmp_path / "draft", noise=0.2)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))
    assert isinstance(decoder.target, HFRunner)
    plain = greedy(decoder, "none")
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), NEW_TOKENS)
    assert greedy(decoder, "draft") == plain
