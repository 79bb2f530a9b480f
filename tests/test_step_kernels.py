"""The fused step kernels' boundary on the CPU: specs match the .cu, and the twins are the eager step's
math."""
import pytest
import torch

from engine.llama import apply_rope
from kernels.step import SPECS, rope_qkv_reference, silu_mul_reference, source_specs


def test_specs_match_the_cu_signatures():
    parsed = source_specs()
    assert set(parsed) == set(SPECS)
    for name, spec in SPECS.items():
        assert parsed[name].args == spec.args and parsed[name].templated == spec.templated, name


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 8), (6, 6, 16), (8, 1, 4)])
def test_rope_twin_is_the_eager_steps_rope_and_cache_write(heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads * 100 + d)
    n, cache_len = 5, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(cache_len, d, generator=g), torch.randn(cache_len, d, generator=g)
    positions = torch.tensor([3, 4, 4, 5, 6])
    cache_index = torch.tensor([10, 11, 12, 13, 14])
    k_cache, v_cache = torch.zeros(kv_heads, cache_len, d), torch.zeros(kv_heads, cache_len, d)
    q = rope_qkv_reference(qkv, cos, sin, positions, cache_index, k_cache, v_cache, heads, kv_heads)
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].unflatten(-1, (-1, d)), cos[positions][:, None],
                    sin[positions][:, None])  # the step's own rope
    assert torch.equal(q, qk[:, :heads].transpose(0, 1))
    assert torch.equal(k_cache[:, cache_index], qk[:, heads:].transpose(0, 1))
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d).transpose(0, 1)
    assert torch.equal(v_cache[:, cache_index], v)
    untouched = [r for r in range(cache_len) if r not in cache_index.tolist()]
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


def test_silu_twin():
    gate_up = torch.randn(3, 10)
    expected = torch.nn.functional.silu(gate_up[:, :5]) * gate_up[:, 5:]
    assert torch.equal(silu_mul_reference(gate_up), expected)
