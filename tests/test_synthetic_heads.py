"""Synthetic heads and shapes (issue 55, item 2): random-weight EAGLE-1/2, EAGLE-3 and Medusa-1 heads of the
published layouts built in memory for a synthetic pair, of the shapes the public-head loaders check (a real
folder of them loads through those loaders and drafts the same tokens), with finite logits and an in-range
draft vocabulary; the Qwen3 shapes build Qwen3 targets that run on LlamaRunner's fast path; the bench
commands run every head method on them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine.cli.main import SYNTHETIC_SHAPES, main
from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.methods import synthetic_heads as sh
from engine.models.llama import LlamaRunner, LlamaSpec
from engine.models.synthetic import SHAPES, build_synthetic_pair, model_config

pytest.importorskip("transformers")
PROMPT = "def fib(n):"


@pytest.fixture(scope="module", params=["tiny", "qwen3-tiny"])
def built(request):
    """(shape, SyntheticPair, head method -> SyntheticHead), fp32 on the CPU."""
    pair = build_synthetic_pair(request.param, "cpu", torch.float32, max_length=256)
    return request.param, pair, sh.build_heads(pair.pair.target, request.param, ["eagle", "eagle3", "medusa"])


def drafts(decoder, method: str, tree_nodes: int = 0) -> list:
    config = GenerationConfig(method=method, k=3, max_new_tokens=16, tree_nodes=tree_nodes)
    return [[d.token_id for d in event.drafted] for event in decoder.generate(PROMPT, config)]


def test_every_head_has_the_shapes_its_loader_checks(built):
    _, pair, heads = built
    target = pair.pair.target
    assert set(heads) == {"eagle", "eagle3", "medusa"}
    for head in heads.values():
        expected = sh.expected_shapes(head.info, target)
        assert {name: tuple(t.shape) for name, t in head.tensors.items() if name != "d2t"} == expected
    h = target.hidden_size
    eagle3 = heads["eagle3"].tensors
    assert eagle3["fc.weight"].shape == (h, 3 * h)
    assert eagle3["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h  # attention reads [embed ; g]
    assert eagle3["lm_head.weight"].shape == (sh.draft_vocab_size(target.vocab_size), h)
    assert heads["medusa"].head.lm_heads.shape == (sh.MEDUSA_HEADS, target.vocab_size, h)


def test_a_tensor_of_another_shape_is_refused(built, monkeypatch):
    shape, pair, _ = built
    made = sh.random_tensors

    def one_row_short(shapes, device, dtype, generator):
        out = made(shapes, device, dtype, generator)
        out["fc.weight"] = out["fc.weight"][1:]
        return out

    monkeypatch.setattr(sh, "random_tensors", one_row_short)
    for method in ("eagle", "eagle3"):
        with pytest.raises(SpecplayError, match="fc.weight"):
            sh.build_head(method, pair.pair.target, shape)


def test_the_draft_vocabulary_maps_into_the_target(built):
    _, pair, heads = built
    vocab = pair.pair.target.vocab_size
    head = heads["eagle3"]
    ids = head.head.target_ids
    assert ids is not None and len(ids) == head.info.draft_vocab < vocab
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert ids.unique().numel() == ids.numel()
    assert torch.equal(torch.arange(len(ids)) + head.tensors["d2t"], ids.cpu())  # d2t as a file holds it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_give_finite_logits(dtype):
    pair = build_synthetic_pair("qwen3-tiny", "cpu", dtype, max_length=64)
    target = pair.pair.target
    heads = sh.build_heads(target, "qwen3-tiny", ["eagle", "eagle3", "medusa-fixed"])
    torch.manual_seed(0)
    tokens = torch.tensor([3, 5])
    for method in ("eagle", "eagle3"):
        head = heads[method].head
        head.runner.reset()
        width = len(getattr(head, "tap_layers", (0,))) * target.hidden_size
        features = head.true_features(torch.randn(2, width, dtype=dtype))
        logits = head.runner.forward_embeds(head.fuse(features, tokens)).logits
        drafted = logits if method == "eagle" else logits[:, head.target_ids]
        assert logits.shape == (2, target.vocab_size) and torch.isfinite(drafted).all(), method
        assert drafted.std() > 0.1, method  # scaled to draft something, not a constant
    logits = heads["medusa"].head.logits(target, torch.randn(target.hidden_size, dtype=dtype))
    assert logits.shape == (sh.MEDUSA_HEADS, target.vocab_size) and torch.isfinite(logits).all()


def test_a_published_folder_of_the_heads_loads_and_drafts_the_same(built, tmp_path):
    """Written as the published layouts (config.json + weights), the real loaders take them and draft the
    very tokens the in-memory heads draft."""
    shape, pair, heads = built
    ours = SpeculativeDecoder(pair.pair)
    ours.use_built_heads({method: head.head for method, head in heads.items()})
    for method, head in heads.items():
        folder = tmp_path / method
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(head.info.config))
        weights = {name: t.contiguous() for name, t in head.tensors.items()}
        save_file(weights, str(folder / head.info.weights.name))
        loaded = SpeculativeDecoder(pair.pair)
        assert head.info.layout in loaded.use_heads(str(folder))
        specs = (("medusa", 0), ("medusa-fixed", 0)) if method == "medusa" else ((method, 0), (method, 6))
        for spec in specs:
            mine = drafts(ours, *spec)
            assert mine == drafts(loaded, *spec), (shape, spec)
            assert any(mine), spec


def test_the_head_methods_become_available_and_others_are_refused(built):
    _, pair, heads = built
    decoder = SpeculativeDecoder(pair.pair)
    reasons = decoder.method_availability()
    assert all(reasons[m] is not None for m in ("eagle", "eagle3", "medusa", "medusa-fixed"))
    decoder.use_built_heads({"eagle3": heads["eagle3"].head})
    reasons = decoder.method_availability()
    assert reasons["eagle3"] is None and reasons["eagle"] is not None
    with pytest.raises(SpecplayError, match="no head method"):
        decoder.use_built_heads({"draft": heads["eagle"].head})


def test_real_shapes_get_the_published_head_sizes_without_weights():
    """At llama-8b: EAGLE-3's 32,000-token draft vocabulary, its 3H fc and 2H attention input, Medusa-1's
    5 full-vocabulary LM heads (shapes only: nothing is allocated)."""
    spec = LlamaSpec.from_dict(model_config("llama-8b").to_dict())
    target = SimpleNamespace(spec=spec, hidden_size=4096, vocab_size=128256)
    eagle3 = sh.expected_shapes(sh.head_info("eagle3", target, "llama-8b"), target)
    assert eagle3["lm_head.weight"] == (32000, 4096) and eagle3["fc.weight"] == (4096, 3 * 4096)
    assert eagle3["midlayer.self_attn.k_proj.weight"] == (8 * 128, 2 * 4096)
    assert eagle3["midlayer.mlp.down_proj.weight"] == (4096, 14336)
    medusa = sh.expected_shapes(sh.head_info("medusa", target, "llama-8b"), target)
    assert sum(1 for shape in medusa.values() if shape == (128256, 4096)) == 5
    eagle = sh.expected_shapes(sh.head_info("eagle", target, "llama-8b"), target)
    assert eagle["fc.weight"] == (4096, 2 * 4096) and eagle["fc.bias"] == (4096,)


def test_qwen3_shapes_run_on_the_fast_path_and_match_transformers():
    published = {name: SHAPES[name] for name in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b")}
    for name, fields in published.items():
        spec = LlamaSpec.from_dict(model_config(name).to_dict())
        assert spec.qk_norm and spec.head_dim == 128 and spec.vocab_size == 151936, name
        assert (spec.num_layers, spec.num_kv_heads) == (fields["num_hidden_layers"], 8), name
    pair = build_synthetic_pair("qwen3-tiny", "cpu", torch.float32, max_length=64)
    target = pair.pair.target
    assert type(pair.hf_target).__name__ == "Qwen3ForCausalLM" and isinstance(target, LlamaRunner)
    assert target.spec.qk_norm and target.spec.head_dim == 32 != target.hidden_size // target.spec.num_heads
    ids = torch.tensor([[5, 9, 2, 7, 11]])
    with torch.no_grad():
        theirs = pair.hf_target(ids).logits[0, -1].float()
    ours = target.forward(ids[0]).logits[-1].float()
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_help_lists_every_shape():
    assert SYNTHETIC_SHAPES == tuple(SHAPES)


def test_bench_runtimes_runs_every_head_method_beside_its_prediction(capsys):
    code = main(["bench", "runtimes", "--synthetic", "tiny", "--methods", "none,eagle,eagle3,medusa",
                 "--synthetic-acceptance", "2.5", "--hf", "none", "--prompts", "1", "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "left out" not in out + err
    predicted = out[out.index("measured against predicted"):].splitlines()
    for method in ("none", "eagle", "eagle3", "medusa"):
        assert any(line.startswith(f"specplay {method} ") for line in out.splitlines()), method
        row = next(line for line in predicted if line.split()[:1] == [method])
        assert row.count("/") == 5, row  # E, c, round ms, tokens/s, speedup: measured/predicted
    assert "EAGLE-3 (SpecForge)" in err and "draft vocabulary 128 tokens" in err


def test_bench_k_sweep_and_methods_take_synthetic(capsys):
    code = main(["bench", "k-sweep", "--synthetic", "qwen3-tiny", "--method", "eagle3", "--ks", "1,2",
                 "--passes", "1", "--synthetic-acceptance", "0.7,", "--prompts", "1",
                 "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "synthetic eagle3 head" in err and "SYNTHETIC acceptance" in out
    code = main(["bench", "methods", "--synthetic", "tiny", "--methods", "none,medusa-fixed",
                 "--prompts", "1", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert any(line.startswith("medusa-fixed") for line in out.splitlines())
    assert main(["bench", "methods", "--synthetic", "llama-900b", "--methods", "eagle"]) == 2
    assert "unknown synthetic shape" in capsys.readouterr().err


def test_batched_eagle_at_a_synthetic_shape_is_lossless_and_benched(capsys):
    """bench batch --synthetic SHAPE --method eagle drafts with a random head of the layout batched EAGLE
    runs (synthetic_heads.batch_eagle_head); with real verification its greedy output is plain decoding's."""
    from engine.core.batch import BatchDecoder
    from engine.methods import synthetic_heads
    from engine.models.synthetic import build_synthetic_pair

    pair = build_synthetic_pair("tiny", torch.device("cpu"), torch.float32).pair
    decoder = BatchDecoder(pair, eagle_head=synthetic_heads.batch_eagle_head(pair.target))
    from engine.bench.suite import heldout_prompts

    prompts = heldout_prompts(2)
    plain = decoder.generate(prompts, GenerationConfig(method="none", k=1, max_new_tokens=12))
    eagle = decoder.generate(prompts, GenerationConfig(method="eagle", k=3, max_new_tokens=12))
    assert [s.ids for s in eagle.sequences] == [s.ids for s in plain.sequences]
    assert sum(s.drafted for s in eagle.sequences) > 0
    code = main(["bench", "batch", "--synthetic", "tiny", "--method", "eagle", "--k", "2", "--ks", "2",
                 "--batches", "1,2", "--synthetic-acceptance", "0.8,", "--device", "cpu",
                 "--batch-new-tokens", "8", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["tokens_per_round"] > 1 for r in rows)
