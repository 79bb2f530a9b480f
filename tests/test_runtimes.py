"""`bench runtimes` and synthetic pairs on the CPU: real shapes are GPU work, the plumbing is tested here."""
import pytest
import torch

from engine.bench.runtimes import DEFAULT_HF, bench_runtimes, floor_ms, format_report
from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.models.synthetic import SHAPES, build_synthetic_pair, weight_bytes_per_step

PROMPTS = ["def add(a, b):\n    return", "class Box:\n    def size(self):"]


@pytest.fixture(scope="module")
def synthetic():
    return build_synthetic_pair("tiny", "cpu", torch.float32, max_length=512)


def test_synthetic_pair_shares_the_targets_first_layers(synthetic):
    target, draft = synthetic.hf_target, synthetic.hf_draft
    assert len(draft.model.layers) == 2 and len(target.model.layers) == SHAPES["tiny"]["num_hidden_layers"]
    assert draft.model.layers[1] is target.model.layers[1] and draft.lm_head is target.lm_head
    shape = SHAPES["tiny"]
    h, i = shape["hidden_size"], shape["intermediate_size"]
    layers, v = shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    # q, k, v, o, gate/up/down, two norms (fp32)
    per_layer = (h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h) * 4
    assert weight_bytes_per_step(synthetic.pair.target) == layers * per_layer + (h + v * h) * 4


def test_synthetic_greedy_output_equals_transformers(synthetic):
    decoder = SpeculativeDecoder(synthetic.pair)
    ids = synthetic.pair.tokenizer.encode(PROMPTS[0])
    out = synthetic.hf_target.generate(torch.tensor([ids]),
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=24, do_sample=False, pad_token_id=0)
    for spec in ("none", "draft"):
        config = GenerationConfig(k=4, max_new_tokens=24).with_spec(spec)
        assert decoder.generate_ids(PROMPTS[0], config) == out[0, len(ids):].tolist(), spec


def test_bench_runtimes_reports_every_runtime_on_the_same_tokens(synthetic):
    decoder = SpeculativeDecoder(synthetic.pair)
    seen = []
    report = bench_runtimes(decoder, PROMPTS, GenerationConfig(k=4, max_new_tokens=16), ["none", "draft"],
                            list(DEFAULT_HF), synthetic.hf_target, synthetic.hf_draft, progress=seen.append)
    names = [r.runtime for r in report.rows]
    assert names == ["specplay none", "specplay draft", *DEFAULT_HF] and seen == report.rows
    for row in report.rows:  # no EOS in a synthetic vocabulary: every runtime makes the whole budget
        assert row.tokens == 16 * len(PROMPTS), row
        assert row.seconds > 0 and len(row.first_token_ms) == len(PROMPTS)
        assert 0 < row.ttft_ms < 1000.0 * row.seconds
    assert report.rows[0].tokens_per_forward == 1.0 and report.rows[1].tokens_per_forward > 1.0
    assert report.bandwidth == 0.0 and report.floor_ms == 0.0  # no GPU: no floor is claimed
    table = format_report(report)
    assert "hf-assisted" in table and "specplay draft" in table
    assert report.as_dict()["rows"][0]["runtime"] == "specplay none"


def test_floor_and_bad_names():
    assert floor_ms(4_000_000_000, 4e12) == pytest.approx(1.0)
    with pytest.raises(SpecplayError, match="unknown synthetic shape"):
        build_synthetic_pair("llama-900b", "cpu", torch.float32)
