"""Fuzz: the fused step kernels (kernels/step_kernels.cu) against their torch twins, on CUDA."""
import random

import pytest
import torch
from fuzz import cases as fuzz_cases

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from engine.kernels.step import (  # noqa: E402
    GEMV_MAX_ROWS,
    GEMV_STAGE,
    TREE_MAX,
    StepKernels,
    attention_reference,
    gemv_reference,
    medusa_heads_reference,
    rms_norm_reference,
    rope_qkv_reference,
    silu_mul_reference,
    topk,
    topk_reference,
    tree_choose_reference,
    tree_level_reference,
)
from engine.models.runner import graph_capture, warm_up_stream  # noqa: E402

CASES = fuzz_cases(2000)
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
        # the same block with its start on the device: positions as depths after it, rows start + i
        k_at, v_at = caches[0].clone(), caches[1].clone()
        q_at = kernels.rope_qkv(qkv, cos, sin, positions - start, None, k_at, v_at, heads, kv_heads,
                                start=torch.tensor([start], device="cuda"))
        assert torch.equal(q_at, q_out) and torch.equal(k_at, k_out) and torch.equal(v_at, v_out), case
        size = float(qkv.float().abs().max())
        worst = max(worst, _ulps_apart(q_out, q_ref, size), _ulps_apart(k_out, k_ref, size))
        assert worst <= 1.0, f"case {case}: {worst} ulps ({dtype}, n={n}, heads={heads}/{kv_heads}, D={d})"


def test_silu_mul_fuzz(kernels):
    rng = random.Random(1)
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        # I % 8 == 0 takes 8 values a thread in bf16/fp16; 37 (and fp32) one
        n, inter = rng.randint(1, 65), rng.choice([16, 37, 96, 1000, 5632])
        g = torch.Generator(device="cuda").manual_seed(case)
        scale = rng.choice([0.5, 3.0, 20.0])
        gate_up = (torch.randn(n, 2 * inter, generator=g, device="cuda") * scale).to(dtype)
        out, ref = kernels.silu_mul(gate_up), silu_mul_reference(gate_up)
        assert _ulps_apart(out, ref) <= 1.0, f"case {case}: {dtype}, n={n}, I={inter}"


def test_rms_norm_fuzz(kernels):
    """sp_rms_norm against transformers' RMSNorm (its twin): rows short and long (past the 8,192 values a
    block keeps in registers), every dtype. Its mean sums in another order, so a value may move by the
    rounding of x * scale: two units in the last place; four in fp32, where rsqrtf's own error (up to two
    units) is not hidden by a coarser rounding."""
    rng = random.Random(7)
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        n, h = rng.randint(1, 70), rng.choice([8, 64, 320, 2048, 4096, 8200, 12288])
        g = torch.Generator(device="cuda").manual_seed(case)
        x = (torch.randn(n, h, generator=g, device="cuda") * rng.choice([0.01, 1.0, 30.0])).to(dtype)
        weight = (torch.randn(h, generator=g, device="cuda") * 0.3 + 1.0).to(dtype)
        eps = rng.choice([1e-6, 1e-5])
        out, ref = kernels.rms_norm(x, weight, eps), rms_norm_reference(x, weight, eps)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        limit = 4.0 if dtype == torch.float32 else 2.0
        assert _ulps_apart(out, ref) <= limit, f"case {case}: {dtype}, n={n}, H={h}"


HALVES = [torch.bfloat16, torch.float16]
GEMV_MODES = ["plain", "rms_norm", "silu_mul", "embed_cat"]


def _gemv_case(rng, case):
    """Random operands of one sp_gemv launch: (x, weight, kwargs) on CUDA."""
    dtype = HALVES[case % 2]
    mode = GEMV_MODES[(case // 2) % 4]
    k = rng.choice([8, 64, 320, 576, 2048, 2056, 4104, 5632, 14336])
    if mode == "embed_cat":  # a feature and an embedding of K / 2 each
        k = rng.choice([16, 64, 320, 640, 2048, 4096, 8192])
    rows = rng.randint(1, min(GEMV_MAX_ROWS, GEMV_STAGE // k))
    n_out = rng.choice([1, 7, 8, 40, 320, 1000, 2560, 5000, 11264])
    g = torch.Generator(device="cuda").manual_seed(case)
    scale = rng.choice([0.05, 1.0, 4.0])
    width = 2 * k if mode == "silu_mul" else k // 2 if mode == "embed_cat" else k
    x = (torch.randn(rows, width, generator=g, device="cuda") * scale).to(dtype)
    weight = (torch.randn(n_out, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    kwargs = {}
    if mode == "rms_norm":
        kwargs.update(norm_weight=(1 + 0.3 * torch.randn(k, generator=g, device="cuda")).to(dtype), eps=1e-5)
    if mode == "silu_mul":
        kwargs["silu"] = True
    if mode == "embed_cat":
        vocab = rng.choice([1, 50, 8192])
        kwargs["embed"] = (torch.randn(vocab, k // 2, generator=g, device="cuda") * scale).to(dtype)
        kwargs["tokens"] = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    if rng.random() < 0.3:
        kwargs["bias"] = torch.randn(n_out, generator=g, device="cuda").to(dtype)
    if rng.random() < 0.5:
        kwargs["residual"] = torch.randn(rows, n_out, generator=g, device="cuda").to(dtype)
    kwargs["out_f32"] = rng.random() < 0.25
    return x, weight, kwargs


def _gemv_tolerance(inputs, weight, kwargs, ref):
    """Rounding of the output (and of a residual's sum), fp32 accumulation in another order (a random walk:
    its error grows with sqrt(K)), and a few inputs staged one unit apart (the RMSNorm statistics are summed
    in another order)."""
    eps = torch.finfo(weight.dtype).eps
    magnitude = inputs.float().abs() @ weight.float().abs().t()  # [M, N]
    largest = inputs.float().abs().amax(1, keepdim=True) * weight.float().abs().amax(1)[None, :]
    accumulation = max(2e-5, 8 * weight.shape[1] ** 0.5 * 2.0 ** -24)
    tol = 1.01 * eps * ref.float().abs() + accumulation * magnitude + 4 * eps * largest
    if kwargs.get("residual") is not None:
        tol = tol + eps * kwargs["residual"].float().abs()
        if kwargs.get("bias") is not None:  # rounded twice (the biased product, then the sum)
            linear = inputs.float() @ weight.float().t() + kwargs["bias"].float()
            tol = tol + eps * linear.abs()
    return tol


@pytest.fixture
def fp32_reductions(monkeypatch):
    """cuBLAS's half-precision products reduce in fp32: torch lets them reduce split-K partials in half
    precision by default, which the twin's tolerance (fp32 accumulation) does not allow for."""
    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_fp16_reduced_precision_reduction", False)
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", False)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["sp_gemv", "sp_gemv_tc"])
def test_gemv_fuzz(kernels, fp32_reductions, tensor_cores):
    rng = random.Random(2)
    for case in range(CASES):
        x, weight, kwargs = _gemv_case(rng, case)
        out = kernels.gemv(x, weight, tensor_cores=tensor_cores, **kwargs)
        ref = gemv_reference(x, weight, **kwargs)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        inputs = _staged_inputs(x, kwargs)
        tol = _gemv_tolerance(inputs, weight, kwargs, ref)
        err = (out.float() - ref.float()).abs()
        worst = float((err / tol).max())
        assert bool((err <= tol).all()), (f"case {case}: {x.dtype} rows={x.shape[0]} K={weight.shape[1]} "
                                          f"N={weight.shape[0]} {sorted(kwargs)}: worst {worst}")


def test_gemv_takes_the_tensor_cores_for_short_rows(kernels, monkeypatch):
    """By default a weight whose rows are shorter than GEMV_TC_K multiplies on sp_gemv_tc, a longer one on
    sp_gemv, whatever the block's rows; tensor_cores= forces either."""
    from engine.kernels.step import GEMV_TC_K

    launched = []
    launch = kernels._launch_grid
    monkeypatch.setattr(kernels, "_launch_grid", lambda name, *a, **kw: (launched.append(name),
                                                                         launch(name, *a, **kw)))
    for k in (320, GEMV_TC_K - 8, GEMV_TC_K, 4096):
        weight = torch.randn(40, k, device="cuda").to(torch.bfloat16)
        for rows in (1, 5):
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            kernels.gemv(x, weight)
            assert launched.pop() == ("sp_gemv_tc" if k < GEMV_TC_K else "sp_gemv"), (k, rows)
            for forced in (False, True):
                kernels.gemv(x, weight, tensor_cores=forced)
                assert launched.pop() == ("sp_gemv_tc" if forced else "sp_gemv")


def _staged_inputs(x, kwargs):
    """What sp_gemv multiplies: x, RMSNorm(x) * w, SiLU(gate) * up or [x | embed[tokens]] (the twin's own
    staging)."""
    if kwargs.get("embed") is not None:
        return torch.cat((x, kwargs["embed"][kwargs["tokens"]]), -1)
    if kwargs.get("silu"):
        return silu_mul_reference(x)
    if kwargs.get("norm_weight") is not None:
        return rms_norm_reference(x, kwargs["norm_weight"], kwargs["eps"])
    return x


def test_gemv_rows_do_not_depend_on_the_block(kernels):
    """Row m of an M-row launch equals, bit for bit, the same row launched alone: what makes bf16
    verification blocks reproduce one-token steps."""
    rng = random.Random(3)
    for case in range(max(CASES // 10, 50)):
        x, weight, kwargs = _gemv_case(rng, case)
        for tensor_cores in (False, True):
            together = kernels.gemv(x, weight, tensor_cores=tensor_cores, **kwargs)
            for m in range(x.shape[0]):
                alone = {k: (v[m:m + 1] if k in ("residual", "tokens") else v) for k, v in kwargs.items()}
                row = kernels.gemv(x[m:m + 1], weight, tensor_cores=tensor_cores, **alone)[0]
                assert torch.equal(row, together[m]), f"case {case} (tensor cores: {tensor_cores})"


def test_gemv_silu_pairs_are_the_down_products_input_bit_for_bit(kernels):
    """gate|up's product with SiLU(gate) * up in its epilogue equals sp_silu_mul over the plain product, row
    by row as launched alone, and the down product over it equals the down product's own SiLU staging
    (mode 2): the step's bits do not change."""
    rng = random.Random(4)
    for case in range(max(CASES // 10, 50)):
        dtype = HALVES[case % 2]
        k = rng.choice([8, 320, 2048, 2056, 4096, 5632])
        rows = rng.randint(1, min(GEMV_MAX_ROWS, GEMV_STAGE // k))
        inter = rng.choice([1, 7, 8, 40, 1000, 2816])
        g = torch.Generator(device="cuda").manual_seed(case)
        x = (torch.randn(rows, k, generator=g, device="cuda") * rng.choice([0.05, 1.0, 4.0])).to(dtype)
        gate_up = (torch.randn(2 * inter, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
        kwargs = {}
        if rng.random() < 0.5:
            norm = 1 + 0.3 * torch.randn(k, generator=g, device="cuda")
            kwargs.update(norm_weight=norm.to(dtype), eps=1e-5)
        if rng.random() < 0.3:
            kwargs["bias"] = torch.randn(2 * inter, generator=g, device="cuda").to(dtype)
        paired = kernels.gemv(x, gate_up, silu_pairs=True, **kwargs)  # [rows, inter]
        plain = kernels.gemv(x, gate_up, tensor_cores=False, **kwargs)  # [rows, 2 inter]
        assert torch.equal(paired, kernels.silu_mul(plain)), f"case {case}"
        for m in range(rows):
            assert torch.equal(kernels.gemv(x[m:m + 1], gate_up, silu_pairs=True, **kwargs)[0], paired[m])
        if inter % 8 == 0 and rows * inter <= GEMV_STAGE:
            down = (torch.randn(rng.choice([8, 40, 512]), inter, generator=g, device="cuda") / inter ** 0.5
                    ).to(dtype)
            residual = torch.randn(rows, down.shape[0], generator=g, device="cuda").to(dtype)
            assert torch.equal(kernels.gemv(paired, down, residual=residual, tensor_cores=False),
                               kernels.gemv(plain, down, residual=residual, silu=True, tensor_cores=False))
    with pytest.raises(ValueError, match="SiLU pairs"):
        kernels.gemv(x, gate_up, silu_pairs=True, tensor_cores=True)


def _chain_or_tree(rng, n: int, device: str = "cuda") -> torch.Tensor:
    """A block's visibility [n, n] bool: half the time a chain (causal), else a tree of random parents whose
    nodes each see their ancestors and themselves."""
    if rng.random() < 0.5:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    from engine.models.runner import tree_ancestor_mask

    parents = torch.tensor([-1] + [rng.randrange(i) for i in range(1, n)])
    return tree_ancestor_mask(parents).to(device, torch.bool).contiguous()


def _attention_case(rng, case):
    dtype = HALVES[case % 2]
    kv_heads = rng.choice([1, 2, 4, 8])
    heads = kv_heads * rng.choice([1, 2, 4, 8])
    d = rng.choice([8, 16, 64, 128, 256])
    n = rng.choice([1, 2, 5, 8, 9, 17, 64])
    start = rng.choice([0, 1, 31, 32, 33, 100, 300, 1100])  # 1100: every split has several chunks
    cache_len = start + n + rng.choice([0, 7, 64])
    g = torch.Generator(device="cuda").manual_seed(case)
    scale = rng.choice([0.3, 1.0, 3.0])
    q = (torch.randn(heads, n, d, generator=g, device="cuda") * scale).to(dtype)
    k_cache = (torch.randn(kv_heads, cache_len, d, generator=g, device="cuda") * scale).to(dtype)
    v_cache = torch.randn(kv_heads, cache_len, d, generator=g, device="cuda").to(dtype)
    visible = _chain_or_tree(rng, n)
    return q, k_cache, v_cache, start, visible


def _exact_attention(q, k_cache, v_cache, start: int, visible) -> torch.Tensor:
    """fp64 attention of one sequence's block q [heads, n, D] over caches [kv_heads, L, D] -> [n, heads D]."""
    heads, n, d = q.shape
    group = heads // k_cache.shape[0]
    keys = k_cache[:, :start + n].double().repeat_interleave(group, 0)
    values = v_cache[:, :start + n].double().repeat_interleave(group, 0)
    seen = torch.cat([torch.ones(n, start, dtype=torch.bool, device="cuda"), visible], dim=1)
    scores = (q.double() @ keys.transpose(1, 2) / d ** 0.5).masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(n, heads * d)


def _assert_near_exact(out, exact, v_cache, what: str) -> None:
    """out within one rounding of its dtype of the fp64 exact, plus fp32's accumulated error."""
    tol = torch.finfo(out.dtype).eps * exact.abs() + 1e-5 * float(v_cache.float().abs().max()) + 1e-6
    err = (out.double() - exact).abs()
    assert bool((err <= tol).all()), f"{what}: worst {float((err / tol).max())}"


def test_attention_fuzz(kernels):
    rng = random.Random(4)
    for case in range(CASES):
        q, k_cache, v_cache, start, visible = _attention_case(rng, case)
        out = kernels.attention(q, k_cache, v_cache, torch.tensor([start], device="cuda"), visible)
        exact = _exact_attention(q, k_cache, v_cache, start, visible)
        what = f"case {case}: {q.dtype} heads={q.shape[0]}/{k_cache.shape[0]} D={q.shape[2]} n={q.shape[1]}"
        _assert_near_exact(out, exact, v_cache, f"{what} start={start}")
        assert torch.equal(attention_reference(q, k_cache, v_cache, start, visible), exact.to(q.dtype))
    assert int(kernels._attention_counters.abs().sum()) == 0  # the splits' merge counters are left zero


def _wide_case(rng, case):
    """B sequences' caches [B, kvh, L, D] (B = 1: [kvh, L, D]) of a shape sp_attention_wide is built for, a
    block of block_n tokens each (a chain or a tree), starts crossing its 64-row tiles."""
    dtype = HALVES[case % 2]
    kv_heads, group = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8])
    heads, d = kv_heads * group, rng.choice([32, 64, 128])
    seqs, block_n = rng.choice([1, 2, 3, 8]), rng.choice([1, 2, 5, 9])
    starts = [rng.choice([0, 1, 59, 63, 64, 65, 127, 200, 1100]) for _ in range(seqs)]
    cache_len = max(starts) + block_n + rng.choice([0, 9])
    g = torch.Generator(device="cuda").manual_seed(200 + case)
    scale = rng.choice([0.3, 1.0, 3.0])
    shape = (seqs, kv_heads, cache_len, d) if seqs > 1 else (kv_heads, cache_len, d)
    q = (torch.randn(heads, seqs * block_n, d, generator=g, device="cuda") * scale).to(dtype)
    k_cache = (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    return q, k_cache, v_cache, starts, _chain_or_tree(rng, block_n)


def _launched(kernels, monkeypatch) -> list:
    """The kernel names `kernels` launches from now on."""
    names, launch = [], kernels._launch_grid

    def recording(name, *args, **kwargs):
        names.append(name)
        return launch(name, *args, **kwargs)

    monkeypatch.setattr(kernels, "_launch_grid", recording)
    return names


def test_wide_attention_fuzz(kernels, monkeypatch):
    """sp_attention_wide (the batched step's kernel) against fp64 attention, every sequence of the batch."""
    launched = _launched(kernels, monkeypatch)
    rng = random.Random(9)
    for case in range(CASES):
        q, k_cache, v_cache, starts, visible = _wide_case(rng, case)
        out = kernels.attention(q, k_cache, v_cache, torch.tensor(starts, device="cuda"), visible, splits=1,
                                wide=True)
        assert launched.pop() == "sp_attention_wide"
        block_n = visible.shape[0]
        for b, start in enumerate(starts):
            rows = slice(b * block_n, (b + 1) * block_n)
            caches = (k_cache[b], v_cache[b]) if len(starts) > 1 else (k_cache, v_cache)
            exact = _exact_attention(q[:, rows], *caches, start, visible)
            _assert_near_exact(out[rows], exact, v_cache, f"case {case}: {q.dtype} heads={q.shape[0]}/"
                                                         f"{caches[0].shape[0]} D={q.shape[2]} n={block_n} "
                                                         f"start={start}")


def test_wide_attention_rows_do_not_depend_on_the_block_or_the_batch(kernels, monkeypatch):
    """sp_attention_wide: token i of a chain block at `start` equals, bit for bit, that token alone at
    start + i, and a sequence of a batch equals that sequence launched alone."""
    launched = _launched(kernels, monkeypatch)
    rng = random.Random(10)
    for case in range(max(CASES // 20, 50)):
        q, k_cache, v_cache, starts, _ = _wide_case(rng, case)
        block_n = q.shape[1] // len(starts)
        chain = torch.ones(block_n, block_n, dtype=torch.bool, device="cuda").tril()
        block = kernels.attention(q, k_cache, v_cache, torch.tensor(starts, device="cuda"), chain, splits=1,
                                  wide=True)
        one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
        for b, start in enumerate(starts):
            caches = (k_cache[b], v_cache[b]) if len(starts) > 1 else (k_cache, v_cache)
            for i in range(block_n):
                row = b * block_n + i
                alone = kernels.attention(q[:, row:row + 1].contiguous(), *caches,
                                          torch.tensor([start + i], device="cuda"), one, splits=1, wide=True)
                assert torch.equal(alone[0], block[row]), f"case {case}, sequence {b}, token {i}"
    assert set(launched) == {"sp_attention_wide"}


def test_attention_rows_do_not_depend_on_the_block(kernels):
    """Token i of a chain block at `start` gets, bit for bit, what it gets alone at start + i."""
    rng = random.Random(5)
    for case in range(max(CASES // 20, 50)):
        q, k_cache, v_cache, start, _ = _attention_case(rng, case)
        n = q.shape[1]
        chain = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        block = kernels.attention(q, k_cache, v_cache, torch.tensor([start], device="cuda"), chain)
        one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
        for i in range(n):
            alone = kernels.attention(q[:, i:i + 1].contiguous(), k_cache, v_cache,
                                      torch.tensor([start + i], device="cuda"), one)
            assert torch.equal(alone[0], block[i]), f"case {case}, token {i}"


def test_attention_batched_equals_each_sequence_alone(kernels):
    """B sequences' blocks in one launch (caches [B, kvh, L, D], one start each): every sequence's rows are,
    bit for bit, what a launch of that sequence alone with the same splits gives, and they match the fp64
    twin."""
    from engine.kernels.step import attention_splits

    rng = random.Random(6)
    for case in range(max(CASES // 20, 50)):
        dtype = HALVES[case % 2]
        kv_heads = rng.choice([1, 2, 8])
        heads = kv_heads * rng.choice([1, 4])
        d = rng.choice([8, 64, 128])
        seqs, block_n = rng.choice([2, 3, 8]), rng.choice([1, 2, 5])
        starts = [rng.choice([0, 1, 33, 100]) for _ in range(seqs)]
        cache_len = max(starts) + block_n + rng.choice([0, 9])
        g = torch.Generator(device="cuda").manual_seed(case)
        q = torch.randn(heads, seqs * block_n, d, generator=g, device="cuda").to(dtype)
        k_cache = torch.randn(seqs, kv_heads, cache_len, d, generator=g, device="cuda").to(dtype)
        v_cache = torch.randn(seqs, kv_heads, cache_len, d, generator=g, device="cuda").to(dtype)
        chain = torch.ones(block_n, block_n, dtype=torch.bool, device="cuda").tril()
        out = kernels.attention(q, k_cache, v_cache, torch.tensor(starts, device="cuda"), chain)
        for b, start in enumerate(starts):
            rows = slice(b * block_n, (b + 1) * block_n)
            alone = kernels.attention(q[:, rows].contiguous(), k_cache[b], v_cache[b],
                                      torch.tensor([start], device="cuda"), chain,
                                      splits=attention_splits(seqs, heads))
            assert torch.equal(out[rows], alone), f"case {case}, sequence {b}"
        ref = attention_reference(q, k_cache, v_cache, starts, chain)
        tol = 2 * torch.finfo(dtype).eps * ref.float().abs() + 1e-3
        assert bool(((out.float() - ref.float()).abs() <= tol).all()), f"case {case}"


def test_grouped_attention_gives_the_per_head_bits(kernels, monkeypatch):
    """Unsplit launches of grouped-query models take sp_attention_grouped (one block per kv head): every row
    equals, bit for bit, the one-block-per-head kernel's (chains and trees, one sequence and several), and
    the fp64 twin."""
    import engine.kernels.step as step

    rng = random.Random(8)
    for case in range(max(CASES // 20, 60)):
        dtype = HALVES[case % 2]
        kv_heads, group = rng.choice([1, 2, 4]), rng.choice([2, 4, 8])
        heads, d = kv_heads * group, rng.choice([8, 64, 128])
        seqs, block_n = rng.choice([1, 2, 5]), rng.choice([1, 2, 5, 9])
        starts = [rng.choice([0, 1, 31, 33, 100, 300]) for _ in range(seqs)]
        cache_len = max(starts) + block_n + rng.choice([0, 9])
        g = torch.Generator(device="cuda").manual_seed(100 + case)
        q = torch.randn(heads, seqs * block_n, d, generator=g, device="cuda").to(dtype)
        shape = (seqs, kv_heads, cache_len, d) if seqs > 1 else (kv_heads, cache_len, d)
        k_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
        v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
        visible = _chain_or_tree(rng, block_n)
        start = torch.tensor(starts, device="cuda")
        grouped = kernels.attention(q, k_cache, v_cache, start, visible, splits=1)
        with monkeypatch.context() as patch:
            patch.setattr(step, "ATTENTION_GROUPS", ())  # as for a model whose group is not built: per head
            per_head = kernels.attention(q, k_cache, v_cache, start, visible, splits=1)
        assert torch.equal(grouped, per_head), f"case {case}: heads {heads}/{kv_heads} d {d} n {block_n}"
        caches = (k_cache, v_cache) if seqs > 1 else (k_cache[None], v_cache[None])
        ref = attention_reference(q, *caches, starts, visible)
        tol = 2 * torch.finfo(dtype).eps * ref.float().abs() + 1e-3
        assert bool(((grouped.float() - ref.float()).abs() <= tol).all()), f"case {case}"


def test_rope_qkv_writes_batched_caches(kernels):
    """rope_qkv over B caches [B, kvh, L, D] (cache_index = b * kvh * L + row) writes what a launch per
    sequence writes into that sequence's cache, and returns the same q."""
    rng = random.Random(7)
    for case in range(max(CASES // 20, 50)):
        dtype = DTYPES[case % 3]
        kv_heads, heads, d, cache_len = 2, 4, rng.choice([8, 64]), 64
        seqs, n = rng.choice([2, 5]), rng.choice([1, 3])
        g = torch.Generator(device="cuda").manual_seed(case)
        qkv = torch.randn(seqs * n, (heads + 2 * kv_heads) * d, generator=g, device="cuda").to(dtype)
        angle = torch.rand(cache_len, d // 2, generator=g, device="cuda") * 6.3
        cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
        sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
        starts = torch.tensor([rng.randint(0, cache_len - n) for _ in range(seqs)], device="cuda")
        positions = (starts[:, None] + torch.arange(n, device="cuda")).reshape(-1)  # [seqs n]
        batch_rows = torch.arange(seqs, device="cuda").repeat_interleave(n) * kv_heads * cache_len
        k_all = torch.randn(seqs, kv_heads, cache_len, d, generator=g, device="cuda").to(dtype)
        v_all = torch.randn(seqs, kv_heads, cache_len, d, generator=g, device="cuda").to(dtype)
        k_each, v_each = k_all.clone(), v_all.clone()
        q_all = kernels.rope_qkv(qkv, cos, sin, positions, batch_rows + positions, k_all, v_all, heads,
                                 kv_heads)
        for b in range(seqs):
            rows = slice(b * n, (b + 1) * n)
            q_b = kernels.rope_qkv(qkv[rows].contiguous(), cos, sin, positions[rows].contiguous(),
                                   positions[rows].contiguous(), k_each[b], v_each[b], heads, kv_heads)
            assert torch.equal(q_all[:, rows], q_b), f"case {case}, sequence {b}"
        assert torch.equal(k_all, k_each) and torch.equal(v_all, v_each), f"case {case}"


def test_topk_fuzz(kernels):
    """sp_topk gives topk_reference's values and indices bit for bit, and the indices torch's take picks
    from them: rows of random values or of a few symbols (ties, +-0, +-inf, NaN), strided rows (a slice of a
    wider row), every dtype, k 1..16."""
    rng = random.Random(5)
    symbols = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 2.5],
                           device="cuda")
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        rows, columns = rng.randint(1, 40), rng.choice([1, 3, 12, 255, 256, 1000, 8192, rng.randint(1, 9000)])
        k = rng.randint(1, min(16, columns))
        wider = columns + rng.choice([0, 0, 5])
        if case % 4 == 0:
            x = symbols[torch.randint(0, len(symbols), (rows, wider), device="cuda")]
        else:
            x = torch.randn(rows, wider, device="cuda") * rng.choice([1e-3, 1.0, 30.0])
        x = x.to(dtype)[:, :columns]  # [rows, columns], rows `wider` apart
        values, indices = kernels.topk(x, k)
        expected_values, expected_indices = topk_reference(x, k)
        assert torch.equal(indices, expected_indices), (case, dtype, rows, columns, k)
        assert torch.allclose(values, expected_values, rtol=0, atol=0, equal_nan=True), case
        index = torch.randint(0, rows * k, (rng.randint(1, 3), rng.randint(1, 40)), device="cuda")
        assert torch.equal(kernels.topk_take(x, k, index), expected_indices.take(index)), case


def test_topk_takes_the_kernel_on_cuda_and_keeps_torch_order_of_values(kernels):
    """step.topk: the kernel for short k on CUDA (3-d and 1-d inputs too), torch.topk past TOPK_MAX,
    both give the same values, largest first."""
    x = torch.randn(4, 9, 8192, device="cuda")[:, :, :8000]
    values, indices = topk(x, 3)
    assert values.shape == (4, 9, 3) and torch.equal(indices, topk_reference(x, 3)[1])
    assert torch.equal(values, torch.topk(x, 3, dim=-1).values)
    line = torch.randn(12, device="cuda")
    assert torch.equal(topk(line, 4).indices, topk_reference(line, 4)[1])
    assert torch.equal(topk(x, 20).values, torch.topk(x, 20, dim=-1).values)


def test_ngram_lookup_fuzz(kernels):
    """sp_ngram_lookup gives its twin's tokens (stray ones included) and count, and lookup_continuation's
    proposal (every eighth case): random strings over a few symbols (many matches of every length), lengths
    0..M, n 1..6."""
    from engine.methods.ngram.drafter import lookup_continuation
    from engine.methods.ngram.graphs import ngram_lookup

    rng = random.Random(11)
    for case in range(CASES):
        m = rng.choice([8, 64, 300, 1030])
        length, max_n, k = rng.randint(0, m), rng.randint(1, 6), rng.randint(1, 32)
        history = torch.randint(0, rng.randint(2, 6), (m,), device="cuda")
        length_t = torch.tensor([length], device="cuda")
        tokens, count = kernels.ngram_lookup(history, length_t, max_n, k)
        twin_tokens, twin_count = ngram_lookup(history, length_t, max_n, k)
        assert torch.equal(tokens, twin_tokens) and torch.equal(count, twin_count), (case, length, max_n, k)
        if case % 8 == 0:  # the host lookup is a Python loop: on every eighth case
            expected = lookup_continuation(history[:length].tolist(), max_n, k)
            assert int(count) == len(expected) and tokens[:len(expected)].tolist() == expected, case


def test_ngram_lookup_with_a_corpus_table_fuzz(kernels):
    """sp_ngram_lookup with a corpus table gives corpus_fill's tokens (stray ones included) and count, and
    lookup_continuation's proposal with the table (every eighth case): tables of 2..9 ids (history ids past
    them too), rows of 1..6 cut short at random, 0..40 pairs; appended or not."""
    from test_round_graph import random_table

    from engine.methods.ngram.drafter import lookup_continuation
    from engine.methods.ngram.graphs import append_emitted, ngram_lookup

    rng = random.Random(14)
    generator = torch.Generator().manual_seed(14)
    for case in range(CASES):
        m, max_n, k = rng.choice([8, 64, 300]) + 34, rng.randint(1, 6), rng.randint(1, 32)
        length = rng.randint(0, m - k - 2)
        vocab = rng.randint(2, 9)
        table = random_table(vocab, rng.randint(1, 6), rng.randint(0, 40), generator).to("cuda")
        history = torch.randint(0, vocab + 1, (m,), device="cuda")
        emitted = None
        twin_history, twin_length = history.clone(), torch.tensor([length], device="cuda")
        if case % 2:
            emitted = (torch.randint(0, vocab, (k,), device="cuda"),
                       torch.randint(0, vocab, (1,), device="cuda"),
                       torch.tensor([rng.randint(0, k)], device="cuda"))
            append_emitted(twin_history, twin_length, *emitted)
        twin_tokens, twin_count = ngram_lookup(twin_history, twin_length, max_n, k, table)
        length_t = torch.tensor([length], device="cuda")
        tokens, count = kernels.ngram_lookup(history, length_t, max_n, k, emitted=emitted, table=table)
        assert torch.equal(history, twin_history) and torch.equal(length_t, twin_length), case
        assert torch.equal(tokens, twin_tokens) and torch.equal(count, twin_count), (case, length, max_n, k)
        if case % 8 == 0:
            context = twin_history[:int(twin_length)].tolist()
            expected = lookup_continuation(context, max_n, k, table.to("cpu"))
            assert int(count) == len(expected) and tokens[:len(expected)].tolist() == expected, case


def test_ngram_lookup_with_the_append_fuzz(kernels):
    """sp_ngram_lookup with the last round's emitted tokens appended first gives append_emitted's history and
    length, then the lookup's tokens and count."""
    from engine.methods.ngram.graphs import append_emitted, ngram_lookup

    rng = random.Random(12)
    for case in range(CASES):
        k, max_n = rng.randint(1, 16), rng.randint(1, 6)
        m = rng.choice([8, 64, 300]) + k + 2
        length, accepted = rng.randint(0, m - k - 2), rng.randint(0, k)
        history = torch.randint(0, rng.randint(2, 6), (m,), device="cuda")
        draft = torch.randint(0, 6, (k,), device="cuda")
        next_token = torch.randint(0, 6, (1,), device="cuda")
        accepted_t = torch.tensor([accepted], device="cuda")
        twin_history, twin_length = history.clone(), torch.tensor([length], device="cuda")
        append_emitted(twin_history, twin_length, draft, next_token, accepted_t)
        twin_tokens, twin_count = ngram_lookup(twin_history, twin_length, max_n, k)
        length_t, count = torch.tensor([length], device="cuda"), torch.full((1,), -7, device="cuda")
        tokens, out = kernels.ngram_lookup(history, length_t, max_n, k,
                                           emitted=(draft, next_token, accepted_t), count=count)
        assert out is count and torch.equal(history, twin_history), case
        assert torch.equal(length_t, twin_length), case
        assert torch.equal(tokens, twin_tokens) and torch.equal(count, twin_count), (case, k, accepted)


def test_ngram_block_fuzz(kernels):
    """sp_ngram_lookup building the round's block too gives the lookup's history, length, tokens and
    count, and chain_block_reference's block of its tokens: every dtype, hidden sizes 8..2048, with a table
    or not."""
    from test_round_graph import random_table

    from engine.kernels.step import chain_block_reference
    from engine.methods.ngram.graphs import append_emitted, ngram_lookup

    rng = random.Random(15)
    generator = torch.Generator().manual_seed(15)
    for case in range(CASES):
        dtype, k, max_n = DTYPES[case % 3], rng.randint(1, 16), rng.randint(1, 6)
        m, vocab, h = rng.choice([8, 64, 300]) + k + 2, rng.randint(2, 9), rng.choice([8, 40, 320, 2048])
        length, accepted = rng.randint(0, m - k - 2), rng.randint(0, k)
        table = random_table(vocab, rng.randint(1, 6), rng.randint(0, 40), generator).to("cuda") \
            if case % 2 else None
        embed = torch.randn(vocab + 1, h, generator=generator).to("cuda", dtype)
        history = torch.randint(0, vocab + 1, (m,), device="cuda")
        emitted = (torch.randint(0, vocab, (k,), device="cuda"), torch.randint(0, vocab, (1,), device="cuda"),
                   torch.tensor([accepted], device="cuda"))
        start = torch.randint(0, 900, (1,), device="cuda")
        twin_history, twin_length = history.clone(), torch.tensor([length], device="cuda")
        append_emitted(twin_history, twin_length, *emitted)
        twin_tokens, twin_count = ngram_lookup(twin_history, twin_length, max_n, k, table)
        twin_block = chain_block_reference(emitted[1], twin_tokens, start, emitted[2], embed)
        length_t, count = torch.tensor([length], device="cuda"), torch.full((1,), -7, device="cuda")
        tokens, block = kernels.ngram_block(history, length_t, max_n, k, emitted, count, start, embed, table)
        assert torch.equal(history, twin_history) and torch.equal(length_t, twin_length), case
        assert torch.equal(tokens, twin_tokens) and torch.equal(count, twin_count), (case, k, accepted)
        for a, b in zip(block, twin_block):
            assert torch.equal(a, b), (case, k, h, dtype)


def test_chain_round_kernels_fuzz(kernels):
    """sp_chain_block and sp_chain_commit give their twins' values, every dtype, chains of 0..16."""
    from engine.kernels.step import chain_block_reference, chain_commit_reference

    rng = random.Random(13)
    for case in range(CASES):
        dtype, k = DTYPES[case % 3], rng.randint(0, 16)
        vocab, h = rng.randint(1, 300), rng.choice([8, 40, 320, 2048])
        g = torch.Generator(device="cuda").manual_seed(case)
        embed = torch.randn(vocab, h, generator=g, device="cuda").to(dtype)

        def ints(n, hi, g=g):
            return torch.randint(0, hi, (n,), generator=g, device="cuda")

        next_token, chain, start, accepted = ints(1, vocab), ints(k, vocab), ints(1, 900), ints(1, k + 1)
        got = kernels.chain_block(next_token, chain, start, accepted, embed)
        for a, b in zip(got, chain_block_reference(next_token, chain, start, accepted, embed)):
            assert torch.equal(a, b), (case, k, h, dtype)

        next_in = torch.tensor([rng.choice([-1, rng.randint(0, vocab - 1)])], device="cuda")
        count = ints(1, k + 1) if rng.random() < 0.5 else None
        outs = [torch.full((n,), -5, device="cuda") for n in (1, 1, k, 1)]
        twins = [t.clone() for t in outs]
        value, twin_value = (None, None) if count is None else (torch.zeros(1, device="cuda"),
                                                                   torch.zeros(1, device="cuda"))
        accepted_in = accepted if rng.random() < 0.8 else torch.tensor([-1], device="cuda")  # -1: NaN's flag
        path_in = ints(rng.randint(1, 16), k + 1) - 1 if rng.random() < 0.5 else None  # a tree's, or none
        path, twin_path = ((None, None) if path_in is None else
                           (torch.full_like(path_in, -5), torch.full_like(path_in, -5)))
        kernels.chain_commit(accepted_in, next_in, chain, start, *outs, count, value, path_in, path)
        chain_commit_reference(accepted_in, next_in, chain, start, *twins, count, twin_value, path_in,
                               twin_path)
        assert all(torch.equal(a, b) for a, b in zip(outs, twins)) and (
            count is None or torch.equal(value, twin_value)), case
        assert path_in is None or torch.equal(path, twin_path), case


def test_decode_path_matches_the_cublas_path(tmp_path, monkeypatch):
    """bf16: the decode kernels' step is as close to the fp32 step's logits as the cuBLAS + SDPA step is, for
    a prefill, chain blocks (sp_gemv's up to 16 rows, cuBLAS past them) and single tokens. The two bf16 paths
    round their products' sums in different orders, so they differ from each other by a few bf16 steps of the
    hidden states (0.072 at one logit of 480 in a 10,000-case run)."""
    from tiny_models import make_tiny_llama

    from engine.models.loading import load_runner

    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=64, layers=2, seed=3)
    fast = load_runner(str(path), "cuda", torch.bfloat16)
    exact = load_runner(str(path), "cuda", torch.float32)
    slow = load_runner(str(path), "cuda", torch.bfloat16)
    slow.use_torch_twins()
    assert fast.decode_kernels is not None and slow.decode_kernels is None
    tokens = torch.arange(5, 40, device="cuda")
    with torch.inference_mode():
        for block in (tokens[:20], tokens[20:25], tokens[25:26], tokens[26:34], tokens[34:35]):
            a, b = fast.forward(block).logits, slow.forward(block).logits
            reference = exact.forward(block).logits
            torch.testing.assert_close(a, b, atol=0.15, rtol=0.05)
            fast_error, slow_error = (a - reference).abs().max(), (b - reference).abs().max()
            assert fast_error <= 2 * slow_error + 0.02, (block.numel(), fast_error, slow_error)


def test_tree_level_step_matches_the_masked_step(tmp_path):
    """LlamaRunner.step_tree_level (a draft tree's level on the decode kernels, after its earlier nodes) is as
    close to the fp32 masked step (step_embeds over the whole cache) as the bf16 masked step is: 20 committed
    rows, 3 earlier nodes, a level of 4 whose parents are among them."""
    from tiny_models import make_tiny_llama

    from engine.models.loading import load_runner

    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=64, layers=2, seed=4)
    g = torch.Generator().manual_seed(0)
    earlier_x, level_x = torch.randn(3, 64, generator=g), torch.randn(4, 64, generator=g)
    ancestors = torch.eye(7, dtype=torch.bool)
    for child, parent in ((3, 0), (4, 0), (5, 1), (6, 2)):
        ancestors[child, parent] = True
    ancestors = ancestors.cuda()

    def level_features(dtype, tree_level: bool):
        runner = load_runner(str(path), "cuda", dtype)
        with torch.inference_mode():
            runner.forward(torch.arange(5, 25, device="cuda"))
            start = torch.tensor([runner.length], device="cuda")
            column = torch.arange(runner.max_length, device="cuda") - start  # [kv]: the node a column holds

            def masked(x, depth, first, rows):
                seen = ancestors[rows][:, column.clamp(0, 6)] & (column >= 0) & (column < 7) | (column < 0)
                mask = torch.full(seen.shape, float("-inf"), dtype=dtype, device="cuda")
                rows_n = torch.arange(x.shape[0], device="cuda")
                positions, cache_index = start + depth + 0 * rows_n, start + first + rows_n
                mask.masked_fill_(seen, 0.0)
                return runner.step_embeds(x.to("cuda", dtype), positions, cache_index, mask)

            masked(earlier_x, 0, 0, slice(0, 3))
            if not tree_level:
                return masked(level_x, 1, 3, slice(3, 7)).float()
            assert runner.takes_tree_levels(4, 7)
            positions = start + 1 + torch.zeros(4, dtype=torch.long, device="cuda")
            return runner.step_tree_level(level_x.to("cuda", dtype), positions, start, 3, ancestors).float()

    exact = level_features(torch.float32, False)
    fast, slow = level_features(torch.bfloat16, True), level_features(torch.bfloat16, False)
    fast_error, slow_error = (fast - exact).abs().max(), (slow - exact).abs().max()
    assert fast_error <= 2 * slow_error + 0.02, (fast_error, slow_error)


def test_programmatic_launch_changes_no_bit(tmp_path, monkeypatch):
    """The decode path with programmatic dependent launch (pdl.py, sm_90 on) and with CuPy's plain
    launches gives the same logits bit for bit, for a captured prefill bucket (cuBLAS products before the
    rope kernel), a chain block and replayed single-token steps, and the driver took every launch (the
    launcher stayed on)."""
    from tiny_models import make_tiny_llama

    from engine.kernels.pdl import PdlLauncher
    from engine.models.loading import load_runner

    kernels = StepKernels.load("cuda")
    launcher = PdlLauncher.load(torch.cuda.get_device_capability())
    if launcher is None:
        pytest.skip("programmatic dependent launch needs sm_90 and a driver with cuLaunchKernelEx")
    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=64, layers=2, seed=3)
    tokens = torch.arange(5, 40, device="cuda")
    blocks = [tokens[:20], tokens[20:25]] + [tokens[i:i + 1] for i in range(25, 31)]
    results, saved = {}, kernels.pdl
    try:
        for label, pdl in (("pdl", launcher), ("plain", None)):
            kernels.pdl = pdl
            runner = load_runner(str(path), "cuda", torch.bfloat16)
            assert runner.decode_kernels is kernels
            with torch.inference_mode():
                results[label] = [runner.forward(block).logits for block in blocks]
            assert runner._graphs  # the single-token steps were captured and replayed
    finally:
        kernels.pdl = saved
    assert launcher.enabled, launcher.failure
    for i, (a, b) in enumerate(zip(results["pdl"], results["plain"], strict=True)):
        assert torch.equal(a, b), f"block {i}"


def test_graphs_and_eager_steps_agree_with_fused_kernels(tmp_path):
    """The runner uses the fused kernels on CUDA; its fp32 forward stays within rounding of the torch path."""
    from tiny_models import make_tiny_llama

    from engine.models.loading import load_runner

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


def test_padded_prefill_matches_unpadded_and_replays_one_graph_per_bucket(tmp_path):
    """bf16: prefills of 19, 27 and 38 tokens padded to their bucket (32, 32, 64) give the unpadded runner's
    next tokens and logits within bf16 rounding, and at the cache's start they replay a captured step: one per
    bucket, captured on the bucket's first prefill only."""
    from tiny_models import make_tiny_llama

    from engine.models.loading import load_runner

    path = make_tiny_llama(tmp_path / "m", vocab=96, hidden=64, layers=2, seed=3)
    padded = load_runner(str(path), "cuda", torch.bfloat16)
    plain = load_runner(str(path), "cuda", torch.bfloat16)
    plain.pad_blocks = False
    assert padded.pad_blocks and padded.use_graphs and padded.decode_kernels is not None
    new_graphs = []
    with torch.inference_mode():
        for length in (19, 27, 38):
            tokens = (torch.arange(length, device="cuda") * 7 + 5) % 96
            padded.reset()
            plain.reset()
            before = len(padded._graphs)
            a, b = padded.forward(tokens), plain.forward(tokens)
            new_graphs.append(len(padded._graphs) - before)
            assert padded.length == plain.length == length and a.logits.shape == (length, 96)
            torch.testing.assert_close(a.logits, b.logits, atol=0.05, rtol=0.05)
            assert int(a.logits[-1].argmax()) == int(b.logits[-1].argmax())
            step = b.logits[-1:].argmax(-1)  # [1] the greedy next token, fed to both
            sa, sb = padded.forward(step), plain.forward(step)
            torch.testing.assert_close(sa.logits, sb.logits, atol=0.05, rtol=0.05)
            assert int(sa.logits.argmax()) == int(sb.logits.argmax())
    assert new_graphs == [1, 0, 1]
    assert (32, 0, ()) in padded._graphs and (64, 0, ()) in padded._graphs
    assert not any(key[0] in (19, 27, 38) for key in plain._graphs)  # unpadded prefills stay eager


def _level_widths(branch: int, frontier: int, depth: int) -> list:
    """Nodes per level of a growth: min(frontier, nodes of the level above * branch), the root alone above."""
    widths, above = [], 1
    for _ in range(depth):
        above = min(frontier, above * branch)
        widths.append(above)
    return widths


def _growth_state(total: int) -> dict:
    """A growth's buffers before its first level: T candidates, the frontier the root alone."""
    return {"ancestors": torch.zeros(total, total, dtype=torch.bool, device="cuda"),
            "tokens": torch.zeros(total, dtype=torch.long, device="cuda"),
            "parents": torch.zeros(total, dtype=torch.long, device="cuda"),
            "scores": torch.zeros(total, dtype=torch.float32, device="cuda"),
            "frontier": torch.full((1,), -1, dtype=torch.long, device="cuda"),
            "frontier_scores": torch.zeros(1, dtype=torch.float32, device="cuda")}


def test_tree_level_and_choose_fuzz(kernels):
    """sp_tree_level and sp_tree_choose give their twins' outputs bit for bit over whole random growths, level
    after level on the outputs of the last: random scores or a few symbols (ties, -inf, NaN), branch 1..4,
    frontier 1..6, depth 1..8, every tree size 1..T."""
    rng = random.Random(13)
    symbols = torch.tensor([0.0, -0.5, -1.0, -1.0, float("-inf"), -2.0, float("nan"), -0.25], device="cuda")
    for case in range(CASES):
        branch, frontier_max, depth = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 8)
        widths = _level_widths(branch, frontier_max, depth)
        total = sum(widths)
        assert total <= TREE_MAX
        node_depth = torch.repeat_interleave(torch.arange(depth), torch.tensor(widths)).cuda()
        true_length = torch.tensor([rng.randint(0, 500)], device="cuda")
        twin, kernel = (_growth_state(total) for _ in range(2))
        count, rows = 0, 1
        for width in widths:
            if case % 4 == 0:
                top_values = symbols[torch.randint(0, len(symbols), (rows, branch), device="cuda")]
            else:
                top_values = -torch.rand(rows, branch, device="cuda") * rng.choice([1e-3, 1.0, 20.0])
            top_indices = torch.randint(0, 8192, (rows, branch), device="cuda")
            outs = []
            for run, level in ((twin, tree_level_reference), (kernel, kernels.tree_level)):
                outs.append(level(top_values, top_indices, run["frontier_scores"], run["frontier"], width,
                                  count, run["ancestors"], node_depth, true_length, run["tokens"],
                                  run["parents"], run["scores"]))
                run["frontier"], run["frontier_scores"] = outs[-1][2], outs[-1][3]
            for expected, got in zip(*outs):
                assert torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True), (case, count, width)
            for name in ("ancestors", "tokens", "parents", "scores"):
                assert torch.allclose(kernel[name].float(), twin[name].float(), rtol=0, atol=0,
                                      equal_nan=True), (case, name)
            count, rows = count + width, width
        nodes = rng.randint(1, total)
        expected = tree_choose_reference(twin["tokens"], twin["parents"], twin["scores"], node_depth,
                                         twin["ancestors"], nodes, 1e-4)
        got = kernels.tree_choose(kernel["tokens"], kernel["parents"], kernel["scores"], node_depth,
                                  kernel["ancestors"], nodes, 1e-4)
        for e, g in zip(expected, got):
            assert torch.equal(g, e), (case, nodes, total)


def test_medusa_heads_fuzz(kernels):
    """sp_medusa_heads against its twin (the final RMSNorm, the stacked heads' F.linear, SiLU, the residual):
    features up to the kernel's widest, 1..5 heads, every row of a block or the accepted row picked on the
    device. The dot products sum in another order than cuBLAS's, so a value may move by a few units in the
    last place of its terms' sizes (|W| . |xn|), and by the roundings of the norm, SiLU and the sum."""
    from engine.kernels.step import MEDUSA_MAX_H

    rng = random.Random(17)
    for case in range(CASES):
        dtype = HALVES[case % 2]
        h, depth = rng.choice([8, 64, 320, 1024, 4096, MEDUSA_MAX_H]), rng.randint(1, 5)
        nodes = rng.randint(1, 16)
        g = torch.Generator(device="cuda").manual_seed(case)
        x = (torch.randn(nodes + 1, h, generator=g, device="cuda") * rng.choice([0.01, 1.0, 30.0])).to(dtype)
        norm_weight = (torch.randn(h, generator=g, device="cuda") * 0.3 + 1.0).to(dtype)
        weight = (torch.randn(depth * h, h, generator=g, device="cuda") * (2.0 / h ** 0.5)).to(dtype)
        bias = (torch.randn(depth * h, generator=g, device="cuda") * 0.1).to(dtype) if case % 3 else None
        eps = rng.choice([1e-6, 1e-5])
        picked = rng.random() < 0.5
        accepted = torch.tensor([rng.randint(0, nodes)], device="cuda") if picked else None
        path = torch.randint(0, nodes, (nodes,), generator=g, device="cuda") if picked else None
        out = kernels.medusa_heads(x, norm_weight, eps, weight, bias, depth, accepted, path)
        ref = medusa_heads_reference(x, norm_weight, eps, weight, bias, depth, accepted, path)
        assert out.shape == ref.shape and out.dtype == ref.dtype, case
        rows = x if accepted is None else x[[0 if int(accepted) == 0 else int(path[int(accepted) - 1]) + 1]]
        normed = rms_norm_reference(rows, norm_weight, eps).float()  # [M, H]
        terms = (weight.float().abs() @ normed.abs().T).view(depth, h, -1).permute(0, 2, 1)  # [D, M, H]
        bound = torch.finfo(dtype).eps * (4 * (ref.float().abs() + normed.abs()) + 4 * terms)
        worst = float(((out.float() - ref.float()).abs() - bound).max())
        assert worst <= 0, f"case {case}: {dtype}, H={h}, D={depth}, picked={picked}: {worst}"


def test_keep_path_fuzz(kernels):
    """sp_keep_path moves the accepted path's rows as its twin does, bit for bit, every dtype: paths of
    1..KEEP_MAX nodes (increasing node ids, as a tree in topological order gives, then -1), starts anywhere
    the block fits, caches of several layers and heads."""
    from engine.kernels.step import KEEP_MAX, keep_path_reference

    rng = random.Random(19)
    for case in range(CASES):
        dtype = DTYPES[case % 3]
        layers, kv_heads, d = rng.randint(1, 4), rng.randint(1, 4), rng.choice([8, 64, 128])
        depth, nodes = rng.randint(1, KEEP_MAX), rng.randint(1, 40)
        max_len = rng.randint(depth + nodes + 2, 300)  # the twin copies every row of the path's length
        g = torch.Generator(device="cuda").manual_seed(case)
        kv = torch.randn(layers, 2, kv_heads, max_len, d, generator=g, device="cuda").to(dtype)
        accepted = rng.randint(0, min(depth, nodes))
        ids = sorted(rng.sample(range(nodes), accepted))  # node ids along the path, increasing
        path = torch.tensor(ids + [-1] * (depth - accepted), device="cuda")
        start = torch.tensor([rng.randint(0, max_len - max(nodes, depth) - 2)], device="cuda")
        twin = kv.clone()
        kernels.keep_path(kv, start, path)
        keep_path_reference(twin, start, path, torch.arange(depth, device="cuda"))
        assert torch.equal(kv, twin), (case, dtype, ids, int(start))


def test_verification_and_readout_launched_programmatically_behind_the_lm_head(kernels):
    """The greedy verifications, the readout and the greedy readout (kernels/cuda.py) launched `chained`
    behind sp_gemv's LM head, eagerly and replayed from a captured graph, give the results of their plain
    launches."""
    kc = pytest.importorskip("engine.kernels.cuda")
    rng = random.Random(16)
    for case in range(200):
        rows, hidden, vocab = rng.randint(1, 9), rng.choice([64, 320]), rng.choice([1000, 8192, 32000])
        g = torch.Generator(device="cuda").manual_seed(case)
        x = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
        head = (torch.randn(vocab, hidden, generator=g, device="cuda") * 0.2).to(torch.bfloat16)
        logits = kernels.gemv(x, head, out_f32=True)  # [rows, V]
        argmax = logits.argmax(-1)
        chain = torch.where(torch.rand(rows - 1, generator=g, device="cuda") < 0.7, argmax[:-1], 3)
        parents = torch.arange(-1, rows - 2)
        plain = (kc.verify_chain_greedy(logits[None], chain[None]),
                 kc.verify_tree_greedy(logits[None], chain[None], parents))
        values = kc.readout(logits, plain[0], chain, 1.0, 4) if rows > 1 else None
        joined = kc.greedy_readout(logits, chain, 4)
        inputs = (kernels, x, head, chain, parents)
        eager = _chained_round(*inputs)
        graph = torch.cuda.CUDAGraph()
        with warm_up_stream(x.device):  # the capture's stream: its workspaces exist before the capture
            _chained_round(*inputs)
        with graph_capture(graph, None, x.device):  # the product's guards (no cyclic collection inside)
            captured = _chained_round(*inputs)
        graph.replay()
        torch.cuda.synchronize()
        for got in (eager, captured):
            for mine, theirs in zip(got[:2], plain):
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (case, rows, vocab)
            if values is not None:
                assert torch.equal(got[2], values), (case, rows, vocab)
            assert all(torch.equal(a, b) for a, b in zip(got[3][0], joined[0])), (case, rows, vocab)
            assert torch.equal(got[3][1], joined[1]), (case, rows, vocab)


def _chained_round(kernels, x, head, chain, parents) -> tuple:
    """The LM head in sp_gemv, then the greedy verifications, the readout and the greedy readout launched
    behind it."""
    from engine.kernels import cuda as kc

    logits = kernels.gemv(x, head, out_f32=True)
    chain_result = kc.verify_chain_greedy(logits[None], chain[None], chained=True)
    tree_result = kc.verify_tree_greedy(logits[None], chain[None], parents, chained=True)
    read = kc.readout(logits, chain_result, chain, 1.0, 4, chained=True) if chain.numel() else None
    return chain_result, tree_result, read, kc.greedy_readout(logits, chain, 4, chained=True)
