"""Model loading (local dirs, HF cache ids, errors), HFRunner, vocab checks, device/dtype resolution."""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import SpecplayError
from engine.models import loading as models
from engine.models.hf_runner import HFRunner, _cache_kwarg, crop_cache
from engine.models.llama import LlamaRunner
from tests.tiny_models import (
    load_hf_reference,
    make_tiny_gpt2,
    make_tiny_llama,
    make_tiny_pair,
    make_tiny_tokenizer,
)

TOL = 1e-4
VOCAB = 96


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = make_tiny_pair(root, vocab=VOCAB)
    return {"target": target, "draft": draft, "gpt2": make_tiny_gpt2(root / "gpt2", vocab=VOCAB)}


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- load_ru


def test_load_runner_picks_the_implementation(dirs):
    assert isinstance(models.load_runner(str(dirs["target"]), "cpu"), LlamaRunner)
    gpt2 = models.load_runner(str(dirs["gpt2"]), "cpu")
    assert isinstance(gpt2, HFRunner) and not gpt2.supports_tree
    assert gpt2.dtype == torch.float32 and gpt2.vocab_size == VOCAB


def test_unsupported_llama_config_falls_back_to_transformers(tmp_path):
    path = make_tiny_llama(tmp_path / "m", tokenizer=False, rope={"rope_type": "dynamic", "factor": 2.0})
    assert isinstance(models.load_runner(path, "cpu"), HFRunner)


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SpecplayError, match="nope: no such model directory"):
        models.load_runner(str(missing), "cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(SpecplayError, match=f"{tmp_path}: no config.json"):
        models.load_runner(str(tmp_path), "cpu")


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecplayError, match="corrupt config.json") as err:
        models.load_runner(str(tmp_path), "cpu")
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("maker", ["llama", "gpt2"])
def test_corrupt_weights(tmp_path, maker):
    path = make_tiny_llama(tmp_path / "m", tokenizer=False) if maker == "llama" else make_tiny_gpt2(
        tmp_path / "m", tokenizer=False
    )
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage garbage")
    with pytest.raises(SpecplayError) as err:
        models.load_runner(str(path), "cpu")
    assert str(path) in str(err.value)


def test_missing_weight_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_llama(tmp_path / "m", tokenizer=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecplayError, match="model.norm.weight"):
        models.load_runner(str(path), "cpu")


# ---------------------------------------------------------------------------------------------------- Hub ids


def _offline_cache(monkeypatch, cache_dir):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True, raising=False)


def test_hub_id_not_in_cache(monkeypatch, tmp_path):
    _offline_cache(monkeypatch, tmp_path / "hub")
    with pytest.raises(SpecplayError, match="some-org/some-model: not a local directory and not in the"):
        models.load_runner("some-org/some-model", "cpu")


def test_hub_id_found_in_cache(monkeypatch, tmp_path, dirs):
    import shutil

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(dirs["target"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _offline_cache(monkeypatch, cache)
    assert isinstance(models.load_runner("tiny-org/tiny-llama", "cpu"), LlamaRunner)
    assert len(models.load_tokenizer("tiny-org/tiny-llama")) == VOCAB


# ---------------------------------------------------------------------------------------------------- tokeniz


def test_load_tokenizer_round_trips(dirs):
    tok = models.load_tokenizer(dirs["target"])
    ids = tok("def f(x): return x")["input_ids"]
    assert max(ids) < VOCAB and tok.decode(ids) == "def f(x): return x"


def test_load_tokenizer_without_tokenizer_files(tmp_path):
    path = make_tiny_llama(tmp_path / "m", tokenizer=False)
    with pytest.raises(SpecplayError, match="cannot load its tokenizer") as err:
        models.load_tokenizer(path)
    assert str(path) in str(err.value)


def swap_token_ids(path, a: str = "e", b: str = "t"):
    """Rewrite the folder's tokenizer.json so that tokens a and b trade ids: same strings, other ids."""
    tok_path = path / "tokenizer.json"
    data = json.loads(tok_path.read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_path.write_text(json.dumps(data))
    return path


def test_check_same_vocab(dirs, tmp_path):
    same_a, same_b = models.load_tokenizer(dirs["target"]), models.load_tokenizer(dirs["draft"])
    models.check_same_vocab(same_a, same_b, "T", "D")
    make_tiny_tokenizer(tmp_path / "other")
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_file=str(swap_token_ids(tmp_path / "other") / "tokenizer.json"))
    with pytest.raises(SpecplayError, match=r"target T and draft D do not share a tokenizer \(2 of 96"):
        models.check_same_vocab(same_a, other, "T", "D")


def test_check_same_vocab_skips_added_tokens_only_one_tokenizer_has(tmp_path):
    """The Qwen2 class adds <|endoftext|> past the vocabulary; another class of the same files does not."""
    from transformers import PreTrainedTokenizerFast

    base = make_tiny_tokenizer(tmp_path / "base")
    extra = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "base" / "tokenizer.json"))
    extra.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    assert len(extra) == len(base) + 1
    models.check_same_vocab(extra, base, "T", "D", width=96)
    models.check_same_vocab(base, extra, "T", "D", width=128)
    other = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "base" / "tokenizer.json"))
    other.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})  # id 96 too, another token
    models.check_same_vocab(extra, other, "T", "D", width=96)  # neither model emits id 96
    with pytest.raises(SpecplayError, match=r"1 of 97 ids differ, e.g. id 96: '<\|endoftext\|>' vs"):
        models.check_same_vocab(extra, other, "T", "D", width=128)


def test_check_same_vocab_refuses_a_truncated_tokenizer(tmp_path):
    """A tokenizer lacking some of the other's base tokens is another tokenizer, even as a prefix."""
    wide = make_tiny_tokenizer(tmp_path / "wide", vocab_size=96)
    narrow = make_tiny_tokenizer(tmp_path / "narrow", vocab_size=64)
    with pytest.raises(SpecplayError, match="32 of 96 ids differ"):
        models.check_same_vocab(wide, narrow, "T", "D", width=64)


def test_check_tokenizer_fits():
    class Tok:
        vocab_size = 96

        def __len__(self):
            return 97  # one added token past the base vocabulary (the Qwen2 class adds <|endoftext|>)

    models.check_tokenizer_fits(Tok(), 96, "M")
    models.check_tokenizer_fits(Tok(), 128, "M")  # padded rows past the tokenizer
    with pytest.raises(SpecplayError, match="M: the model scores 90 tokens but its tokenizer has 96"):
        models.check_tokenizer_fits(Tok(), 90, "M")


# ---------------------------------------------------------------------------------------------------- pairs


def test_load_pair(dirs, tmp_path):
    pair = models.load_pair(str(dirs["target"]), str(dirs["draft"]), device="cpu")
    assert isinstance(pair.target, LlamaRunner) and isinstance(pair.draft, LlamaRunner)
    assert pair.vocab_size == VOCAB and pair.draft_name == str(dirs["draft"])
    alone = models.load_pair(str(dirs["target"]), None, device="cpu", need_draft=False)
    assert alone.draft is None
    with pytest.raises(SpecplayError, match="--draft"):
        models.load_pair(str(dirs["target"]), None, device="cpu", need_draft=True)
    mismatched = swap_token_ids(make_tiny_llama(tmp_path / "other", hidden=32, layers=1))
    with pytest.raises(SpecplayError, match="do not share a tokenizer") as err:
        models.load_pair(str(dirs["target"]), str(mismatched), device="cpu")
    assert str(mismatched) in str(err.value) and str(dirs["target"]) in str(err.value)


def test_shipped_pair_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "SHIPPED_DIR", tmp_path / "models")
    with pytest.raises(SpecplayError, match="No shipped models in assets/models yet"):
        models.shipped_pair()
    with pytest.raises(SpecplayError, match="No shipped models"):
        models.load_pair(None, None, device="cpu")


def test_shipped_pair_present(monkeypatch, dirs):
    monkeypatch.setattr(models, "SHIPPED_DIR", dirs["target"].parent)
    assert models.shipped_pair() == (dirs["target"], dirs["draft"])


# ---------------------------------------------------------------------------------------------------- device


def test_resolve_device(monkeypatch):
    assert models.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(SpecplayError, match="--device cuda: no usable CUDA GPU"):
        models.resolve_device("cuda")
    with pytest.raises(SpecplayError):
        models.resolve_device("tpu")


def test_resolve_dtype():
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert models.resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(SpecplayError):
        models.resolve_dtype("int3", torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------- HFRunne


def test_hf_runner_chain_matches_full_forward(dirs):
    runner = HFRunner.from_pretrained(dirs["gpt2"])
    ref = load_hf_reference(dirs["gpt2"])
    tokens = _tokens(16, seed=1)
    with torch.no_grad():
        expected = ref(input_ids=tokens[None]).logits[0]
    outs, pos = [], 0
    for size in (7, 1, 3, 5):
        outs.append(runner.forward(tokens[pos : pos + size]))
        pos += size
    logits = torch.cat([o.logits for o in outs])
    assert logits.dtype == torch.float32 and (logits - expected).abs().max().item() <= TOL
    hidden = torch.cat([o.hidden for o in outs])
    assert (runner.logits_from_hidden(hidden) - logits).abs().max().item() <= TOL
    assert runner.embed(tokens[:3]).shape == (3, runner.hidden_size)


def test_hf_runner_rollback_and_compact(dirs):
    runner = HFRunner.from_pretrained(dirs["gpt2"])
    fresh = HFRunner.from_pretrained(dirs["gpt2"])
    seq, wrong, right = _tokens(9, seed=2), _tokens(4, seed=3), _tokens(3, seed=4)
    runner.forward(seq)
    runner.forward(wrong)
    runner.rollback(7)
    assert runner.length == 7 and runner.cache.get_seq_length() == 7
    got = runner.forward(right).logits
    want = fresh.forward(torch.cat([seq[:7], right])).logits[-3:]
    assert (got - want).abs().max().item() <= TOL
    runner.compact(7, torch.tensor([0, 1]))  # keep the first two of the last block
    assert runner.length == 9
    runner.rollback(0)
    assert runner.length == 0 and runner.cache.get_seq_length() == 0


def test_hf_runner_refuses_trees(dirs):
    runner = HFRunner.from_pretrained(dirs["gpt2"])
    with pytest.raises(SpecplayError, match="tree drafting needs a Llama-family model"):
        runner.forward(_tokens(3, seed=5), torch.tensor([-1, 0, 0]))


def test_hf_runner_max_length(dirs):
    runner = HFRunner.from_pretrained(dirs["gpt2"], max_length=8)
    with pytest.raises(SpecplayError, match="max_length 8"):
        runner.forward(_tokens(9, seed=6))


class _Layer:
    def __init__(self, t):
        self.keys, self.values = t.clone(), t.clone()


class _OldCropCache:
    """Emulates transformers 4.x: crop takes the absolute length to keep, negative counts are not
    understood."""

    def __init__(self, n):
        self.layers = [_Layer(torch.zeros(1, 2, n, 4)) for _ in range(2)]

    def get_seq_length(self):
        return self.layers[0].keys.shape[-2]

    def crop(self, length):
        if length < 0:
            raise ValueError("negative")
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


class _BrokenCropCache(_OldCropCache):
    def crop(self, length):  # silently does nothing: the fallback must slice the tensors itself
        pass


@pytest.mark.parametrize("cls", [_OldCropCache, _BrokenCropCache])
def test_crop_cache_conventions(cls):
    cache = cls(10)
    crop_cache(cache, 6)
    assert cache.get_seq_length() == 6 and all(layer.values.shape[-2] == 6 for layer in cache.layers)


def test_cache_kwarg_detection():
    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert _cache_kwarg(New()) == "cache"
    assert _cache_kwarg(Old()) == "past_key_values"
