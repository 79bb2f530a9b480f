"""Qwen3 on the fast path (issue 51, item 3): tiny random Qwen3 checkpoints built by transformers run on
LlamaRunner (per-head q_norm / k_norm before rope), give transformers' fp32 greedy output and logits, and
speculative decoding on them stays greedy-lossless; a family off the fast path says so and why."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_fixtures import make_perturbed_copy
from tiny_models import _randomise, load_hf_reference, make_tiny_gpt2, make_tiny_tokenizer

from engine.config import GenerationConfig
from engine.core.batch import BatchDecoder
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.models.hf_runner import HFRunner
from engine.models.llama import LlamaRunner
from engine.models.loading import forward_paths, load_pair, load_runner

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3Config"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3 (Qwen3Config); a newer release does",
                allow_module_level=True)

PROMPT = "the cat sat on the mat. the cat sat on the"
NEW_TOKENS = 32
VOCAB = 96

# name -> Qwen3Config fields: tied and untied embeddings, head_dim != hidden / heads (both ways), GQA and MHA
CONFIGS = {
    "untied_gqa": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "tied_head_dim_32": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                             tie_word_embeddings=True),
    "untied_head_dim_8_mha": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=8),
}


def qwen3_config(**fields):
    base = dict(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = transformers.Qwen3Config(**{**base, **fields})
    config._attn_implementation = "eager"
    return config


def make_tiny_qwen3(path, seed: int = 0, std: float = 0.15, **fields):
    """A random Qwen3ForCausalLM saved by transformers (safetensors, config.json) with the tiny tokenizer."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(qwen3_config(**fields))
    _randomise(model, seed, std)  # q_norm / k_norm weights too: 1 + N(0, 0.1), not ones
    model.save_pretrained(str(path))
    make_tiny_tokenizer(path, VOCAB)
    return path


def transformers_greedy(path, ids: list, n: int) -> list:
    model = load_hf_reference(path)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(decoder, method: str, k: int = 4, n: int = NEW_TOKENS, **extra) -> list:
    return decoder.generate_ids(PROMPT, GenerationConfig(method=method, k=k, max_new_tokens=n, **extra))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def qwen3(request, tmp_path_factory):
    """(name, target dir, decoder over target + a perturbed Qwen3 copy as draft), fp32 on the CPU."""
    root = tmp_path_factory.mktemp(request.param)
    target = make_tiny_qwen3(root / "target", seed=4, std=0.3, **CONFIGS[request.param])
    draft = make_perturbed_copy(target, root / "draft", noise=0.1)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu", dtype=torch.float32))
    decoder.eos_ids = set()  # random weights: compare whole budgets with transformers (eos_token_id None)
    return request.param, target, decoder


def test_qwen3_runs_on_the_fast_path(qwen3):
    name, target, decoder = qwen3
    runner = decoder.pair.target
    assert isinstance(runner, LlamaRunner) and isinstance(decoder.pair.draft, LlamaRunner)
    assert runner.spec.qk_norm and runner.spec.head_dim == CONFIGS[name]["head_dim"]
    assert runner.layers[0].q_norm.shape == (runner.spec.head_dim,)
    tied = CONFIGS[name].get("tie_word_embeddings", False)
    assert (runner.lm_head is runner.embed_weight) == tied
    assert forward_paths(runner, decoder.pair.draft) == "target: fast path; draft: fast path"


def test_qwen3_logits_match_transformers(qwen3):
    _, target, decoder = qwen3
    ids = decoder.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = load_hf_reference(target)(torch.tensor([ids])).logits[0]  # [n, V]
    runner = decoder.pair.target
    runner.reset()
    ours = runner.forward(torch.tensor(ids)).logits  # [n, V]
    runner.reset()
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_qwen3_greedy_equals_transformers(qwen3):
    _, target, decoder = qwen3
    plain = greedy(decoder, "none")
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), NEW_TOKENS)
    assert len(set(plain)) > 3  # a degenerate repeat of one token would prove little


@pytest.mark.parametrize("method,k", [("draft", 4), ("draft", 2), ("lookahead", 4), ("ngram", 3)])
def test_qwen3_speculation_is_greedy_lossless(qwen3, method, k):
    """Chains (draft model, n-gram) and trees (lookahead's Jacobi branches: tree blocks and compaction)."""
    _, _, decoder = qwen3
    plain = greedy(decoder, "none")
    events = list(decoder.generate(PROMPT, GenerationConfig(method=method, k=k, max_new_tokens=NEW_TOKENS)))
    assert [t for e in events for t in e.emitted_ids] == plain
    if method == "draft":
        accepted = sum(e.accepted_count for e in events)
        assert 0 < accepted < len(plain), "the perturbed copy should have some drafts accepted, not all"


def test_qwen3_with_an_independent_smaller_draft(tmp_path):
    """A draft of another Qwen3 shape (1 layer, hidden 32, head_dim 16 != 32 / 4) next to the target."""
    target = make_tiny_qwen3(tmp_path / "target", seed=5, **CONFIGS["untied_gqa"])
    draft = make_tiny_qwen3(tmp_path / "draft", seed=6, hidden_size=32, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_hidden_layers=1, tie_word_embeddings=True)
    decoder = SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu", dtype=torch.float32))
    decoder.eos_ids = set()
    assert isinstance(decoder.pair.draft, LlamaRunner)
    plain = greedy(decoder, "none")
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), NEW_TOKENS)
    assert greedy(decoder, "draft", k=3) == plain


def test_qwen3_batched_greedy_equals_plain(tmp_path):
    """The batched runner (engine/models/batch_runner.py) shares the per-head norms."""
    target = make_tiny_qwen3(tmp_path / "target", seed=7, **CONFIGS["untied_gqa"])
    draft = make_perturbed_copy(target, tmp_path / "draft", noise=0.3)
    pair = load_pair(str(target), str(draft), device="cpu", dtype=torch.float32)
    single, batched = SpeculativeDecoder(pair), BatchDecoder(pair)
    single.eos_ids = batched.eos_ids = set()
    prompts = [PROMPT, "a", "def f(x):\n    return x"]
    for method in ("none", "draft"):
        result = batched.generate(prompts, GenerationConfig(method=method, k=3, max_new_tokens=16))
        for prompt, seq in zip(prompts, result.sequences, strict=True):
            expected = single.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=16))
            assert seq.ids == expected, (method, seq.index)


def test_qwen3_sliding_window_as_transformers(tmp_path):
    """use_sliding_window with max_window_layers 1: layer 1 attends through a window of 5, layer 0 fully."""
    target = make_tiny_qwen3(tmp_path / "target", seed=8, use_sliding_window=True, sliding_window=5,
                             max_window_layers=1, **CONFIGS["untied_gqa"])
    runner = load_runner(str(target), "cpu", torch.float32)
    assert isinstance(runner, LlamaRunner)
    assert runner.spec.sliding_window == 5 and runner.spec.sliding_layers == (False, True)
    pair = load_pair(str(target), None, device="cpu", need_draft=False, dtype=torch.float32)
    decoder = SpeculativeDecoder(pair)
    decoder.eos_ids = set()
    plain = greedy(decoder, "none", n=24)
    assert plain == transformers_greedy(target, decoder.tokenizer.encode(PROMPT), 24)


def test_qwen3_missing_or_misshapen_head_norm_is_refused(tmp_path):
    """The per-head norms are checked from the safetensors header before anything is allocated."""
    target = make_tiny_qwen3(tmp_path / "m", seed=9, **CONFIGS["untied_gqa"])
    weights = target / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.self_attn.k_norm.weight"
    tensors[name] = torch.ones(8)  # head_dim is 16
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(SpecplayError, match=r"k_norm.weight has shape \[8\] but .* implies \[head_dim 16\]"):
        load_runner(str(target), "cpu")
    del tensors[name]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(SpecplayError, match="k_norm.weight' missing from the checkpoint"):
        load_runner(str(target), "cpu")


def test_a_family_off_the_fast_path_says_why(tmp_path):
    gpt2 = make_tiny_gpt2(tmp_path / "gpt2")
    runner = load_runner(str(gpt2), "cpu")
    assert isinstance(runner, HFRunner)
    assert runner.forward_path.startswith("transformers path: model_type 'gpt2' is not on the fast path")
    assert "qwen3" in runner.forward_path  # the families that are


def test_a_fast_family_with_an_unsupported_feature_says_which(tmp_path):
    target = make_tiny_qwen3(tmp_path / "yarn", seed=10, **CONFIGS["untied_gqa"])
    cfg_path = target / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                              "original_max_position_embeddings": 128}
    cfg_path.write_text(json.dumps(cfg))
    runner = load_runner(str(target), "cpu")
    assert isinstance(runner, HFRunner)
    expected = "transformers path: rope type 'yarn' is not supported by the compact forward"
    assert runner.forward_path == expected
