"""Fuzz: the fused step kernels (kernels/step_kernels.cu) against their torch twins, on CUDA."""
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from kernels.step import StepKernels, rope_qkv_reference, silu_mul_reference  # noqa: E402

CASES = int(os.environ.get("SPECPLAY_FUZZ_CASES", "2000"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("cupy")
    loaded = StepKernels.load("cuda")
    assert loaded is not None
    return loaded


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, operands: float = 0.0) -> float:
    """Largest difference in units of the dtype's last place, at the magnitude of b or of the operands (a sum
    that cancels is only as exact as its terms)."""
    eps = torch.finfo(a.dtype).eps
    scale = (b.float().abs() + operands).clamp_min(torch.finfo(a.dtype).tiny / eps)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max()) if a.numel() else 0.0


def test_rope_qkv_fuzz(kernels):
    rng = random.Random(0)
    worst = 0.0
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        kv_heads = rng.choice([1, 2, 4, 8])
        heads = kv_heads * rng.choice([1, 2, 4])
        d = rng.choice([8, 32, 64, 128])
        cache_len = rng.choice([64, 256])
        n = rng.randint(1, min(65, cache_len))
        g = torch.Generator(device="cuda").manual_seed(case)
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g, device="cuda").to(dtype)
        angle = torch.rand(cache_len, d // 2, generator=g, device="cuda") * 6.3
        cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
        sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
        start = rng.randint(0, cache_len - n)
        cache_index = torch.arange(start, start + n, device="cuda")
        positions = cache_index - rng.randint(0, start) if start else cache_index.clone()
        caches = [torch.randn(kv_heads, cache_len, d, generator=g, device="cuda").to(dtype) for _ in range(4)]
        k_ref, v_ref, k_out, v_out = caches[0], caches[1], caches[0].clone(), caches[1].clone()
        q_ref = rope_qkv_reference(qkv, cos, sin, positions, cache_index, k_ref, v_ref, heads, kv_heads)
        q_out = kernels.rope_qkv(qkv, cos, sin, positions, cache_index, k_out, v_out, heads, kv_heads)
        assert torch.equal(v_out, v_ref), f"case {case}: v cache"
        size = float(qkv.float().abs().max())
        worst = max(worst, _ulps_apart(q_out, q_ref, size), _ulps_apart(k_out, k_ref, size))
        assert worst <= 1.0, f"case {case}: {worst} ulps ({dtype}, n={n}, heads={heads}/{kv_heads}, D={d})"


def test_silu_mul_fuzz(kernels):
    rng = random.Random(1)
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        n, inter = rng.randint(1, 65), rng.choice([16, 96, 1000, 5632])
        g = torch.Generator(device="cuda").manual_seed(case)
        scale = rng.choice([0.5, 3.0, 20.0])
        gate_up = (torch.randn(n, 2 * inter, generator=g, device="cuda") * scale).to(dtype)
        out, ref = kernels.silu_mul(gate_up), silu_mul_reference(gate_up)
        assert _ulps_apart(out, ref) <= 1.0, f"case {case}: {dtype}, n={n}, I={inter}"


def test_graphs_and_eager_steps_agree_with_fused_kernels(tmp_path):
    """The runner uses the fused kernels on CUDA; its fp32 forward stays within rounding of the torch path."""
    from tiny_models import make_tiny_llama

    from engine.models import load_runner

    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=64, layers=2, seed=3)
    fused = load_runner(str(path), "cuda", torch.float32)
    plain = load_runner(str(path), "cuda", torch.float32)
    plain.fused_kernels = None
    assert fused.fused_kernels is not None
    tokens = torch.arange(5, 40, device="cuda")
    with torch.inference_mode():
        a = fused.forward(tokens).logits
        b = plain.forward(tokens).logits
        step_a = fused.forward(tokens[:1]).logits
        step_b = plain.forward(tokens[:1]).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step_a, step_b, atol=1e-4, rtol=1e-4)
