"""Layer-skip self-speculation: the target's first L layers draft; lossless, cache right after rejections."""
import dataclasses

import pytest
import torch
from tiny_models import make_tiny_gpt2, make_tiny_llama

from engine.analysis.lossless import check_sampling
from engine.bench import suite as bench
from engine.cli.main import main
from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.methods import registry as methods
from engine.methods.layerskip.drafter import LayerSkipRunner, layer_skip_runner, resolve_draft_layers
from engine.models.loading import load_pair

PROMPT = "the cat sat on the mat. the cat sat on the"
LAYERS = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("layerskip") / "target", hidden=64, layers=LAYERS, seed=3)


@pytest.fixture(scope="module")
def decoder(target_dir):
    return SpeculativeDecoder(load_pair(str(target_dir), None, device="cpu", need_draft=False))


def layerskip(**kw) -> GenerationConfig:
    return GenerationConfig(method="layerskip", **kw)


def test_the_draft_runner_is_the_targets_own_weights(decoder):
    target = decoder.target
    runner = layer_skip_runner(target, 2)
    assert isinstance(runner, LayerSkipRunner) and len(runner.layers) == 2
    assert all(a is b for a, b in zip(runner.layers, target.layers[:2], strict=True))
    assert runner.embed_weight is target.embed_weight and runner.lm_head is target.lm_head
    assert runner.norm_weight is target.norm_weight
    assert runner.kv.data_ptr() == target.kv.data_ptr() and runner.kv.shape[0] == 2
    assert layer_skip_runner(target, 2) is runner  # kept per target: one runner (and its graphs) per L
    assert len(target.layers) == LAYERS and target.kv.shape[0] == LAYERS  # the target is untouched


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain(decoder, layers, k):
    plain = decoder.generate_ids(PROMPT, GenerationConfig(method="none", max_new_tokens=40))
    assert decoder.generate_ids(PROMPT, layerskip(k=k, draft_layers=layers, max_new_tokens=40)) == plain


def test_default_draft_layers_is_half_the_target(decoder):
    assert resolve_draft_layers(decoder.target, 0) == LAYERS // 2
    drafter = methods.get("layerskip").build(decoder, layerskip())
    assert drafter.layers == LAYERS // 2 and drafter.name == "layerskip"


def fresh_prefill(target, layers: int, tokens: list) -> tuple:
    """(KV rows [L, 2, kvh, n, D], logits of the next token [V]) of the first `layers` layers over `tokens`,
    from an empty cache of its own."""
    runner = LayerSkipRunner(target, layers, share_cache=False)
    out = runner.forward(torch.tensor(tokens, dtype=torch.long))
    return runner.kv[:, :, :, :len(tokens)].clone(), out.logits[-1]


def test_the_draft_cache_after_rejections_equals_a_fresh_prefill(decoder, monkeypatch):
    """Before every round (after rejections too), the rows the draft attends to equal a fresh prefill of the
    first L layers over the committed tokens, and its first draft token is that prefill's greedy choice."""
    layers, checked = 2, {"rounds": 0, "after_rejection": 0}
    method = methods.get("layerskip")
    state = {"rejected": False}

    def build(dec, cfg):
        drafter = method.build(dec, cfg)
        propose, commit = drafter.propose, drafter.commit

        def checked_propose(st, k):
            draft = propose(st, k)
            committed = st.tokens[:-1]
            rows = drafter.runner.kv[:, :, :, :len(committed)]
            expected_rows, _ = fresh_prefill(dec.target, layers, committed)
            torch.testing.assert_close(rows, expected_rows, rtol=1e-4, atol=1e-5)
            _, logits = fresh_prefill(dec.target, layers, st.tokens)
            assert int(draft.tokens[0]) == int(logits[:dec.vocab_size].argmax())
            checked["rounds"] += 1
            checked["after_rejection"] += int(state["rejected"])
            return draft

        def noting_commit(st, info):
            state["rejected"] = info.accepted < len(info.draft_tokens)
            return commit(st, info)

        drafter.propose, drafter.commit = checked_propose, noting_commit
        return drafter

    monkeypatch.setitem(methods.METHODS, "layerskip", dataclasses.replace(method, build=build))
    events = list(decoder.generate(PROMPT, layerskip(k=4, draft_layers=layers, max_new_tokens=30)))
    assert checked["rounds"] == len(events) and checked["after_rejection"] >= 2


@pytest.mark.parametrize("bad", [LAYERS, LAYERS + 3])
def test_bad_draft_layers_are_clean_errors(decoder, target_dir, capsys, bad):
    with pytest.raises(SpecplayError, match=f"between 1 and {LAYERS - 1}"):
        decoder.generate_ids(PROMPT, layerskip(draft_layers=bad, max_new_tokens=4))
    code = main(["run", "--prompt", PROMPT, "--target", str(target_dir), "--method", "layerskip",
                 "--draft-layers", str(bad), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "draft layers must be between 1 and 3" in err and len(err.strip().splitlines()) == 1


def test_negative_draft_layers_fail_validation():
    with pytest.raises(SpecplayError, match="draft layers must be between 0 and"):
        layerskip(draft_layers=-1).validate()


def test_layerskip_needs_a_llama_family_target(tmp_path):
    reasons = methods.availability(has_draft_model=False, supports_tree=False, target_dir=str(tmp_path))
    assert "Llama-family" in reasons["layerskip"]
    gpt2 = SpeculativeDecoder(load_pair(str(make_tiny_gpt2(tmp_path / "gpt2")), None, device="cpu",
                                        need_draft=False))
    assert "Llama-family" in gpt2.method_availability()["layerskip"]
    with pytest.raises(SpecplayError, match="not available"):
        gpt2.generate_ids(PROMPT, layerskip(max_new_tokens=4))


def test_one_layer_targets_are_refused(tmp_path):
    one = SpeculativeDecoder(load_pair(str(make_tiny_llama(tmp_path / "one", layers=1)), None, device="cpu",
                                       need_draft=False))
    with pytest.raises(SpecplayError, match="at least 2 layers"):
        one.generate_ids(PROMPT, layerskip(max_new_tokens=4))


def test_layer_sweep_rows(decoder):
    rows = bench.bench_layer_sweep(decoder, [PROMPT], layerskip(k=3, max_new_tokens=12), [1, 3])
    assert [r["layers"] for r in rows] == [1, 3]
    assert all(r["tokens_per_forward"] >= 1.0 and r["c"] > 0.0 for r in rows)
    with pytest.raises(SpecplayError, match="between 1 and"):
        bench.bench_layer_sweep(decoder, [PROMPT], layerskip(), [LAYERS])


@pytest.mark.slow  # a statistical or end-to-end check: `make test-fast` skips it
def test_sampling_is_lossless(tmp_path_factory):
    root = tmp_path_factory.mktemp("chi_layerskip")
    target = make_tiny_llama(root / "target", vocab=24, hidden=32, layers=2, seed=11, std=0.3)
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    config = layerskip(k=3, draft_layers=1, sampling=SamplingParams(0.8, 0, 0.9), seed=500)
    report = check_sampling(decoder, "a tea at the tea at", config, samples=800)
    assert report.bins >= 8 and report.passed, report


def test_bench_layerskip_from_the_command_line(target_dir, capsys):
    code = main(["bench", "layerskip", "--ls", "1,2", "--target", str(target_dir), "--prompt", PROMPT,
                 "--k", "2", "--max-new-tokens", "6", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert "layers" in out and len(rows) == 2
    code = main(["bench", "layerskip", "--ls", "1,x", "--target", str(target_dir), "--prompt", PROMPT])
    assert code == 2 and "--ls must be" in capsys.readouterr().err
