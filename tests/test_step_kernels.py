"""The fused step kernels' boundary on the CPU: specs match the .cu, and the twins are the eager step's
math."""
import pytest
import torch

from engine.kernels.step import (
    SPECS,
    StepKernels,
    attention_reference,
    gemv_reference,
    instance_names,
    rms_norm_reference,
    rope_qkv_reference,
    silu_mul_reference,
    source_specs,
    topk,
    topk_reference,
)
from engine.models.llama import apply_rope


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


def test_every_kernel_is_compiled_for_each_dtype_it_serves():
    names = instance_names()
    assert {n.split("<")[0] for n in names} == set(SPECS)
    assert "sp_gemv<bf16_t, 8>" in names and "sp_gemv<f16_t, 1>" in names and "sp_attention<bf16_t>" in names


def test_gemv_twin_is_the_eager_steps_products():
    """The twin's modes are the eager step's ops: F.linear after RMSNorm, SiLU * up, addmm's residual."""
    from engine.models.llama import rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=g), torch.randn(5, 16, generator=g)
    norm, residual = 1 + torch.randn(16, generator=g) * 0.1, torch.randn(3, 5, generator=g)
    normed = gemv_reference(x, w, norm_weight=norm, eps=1e-6)
    torch.testing.assert_close(normed, torch.nn.functional.linear(rms_norm(x, norm, 1e-6), w))
    gate_up = torch.randn(3, 32, generator=g)
    assert torch.equal(gemv_reference(gate_up, w, silu=True),
                       torch.nn.functional.linear(silu_mul_reference(gate_up), w))
    assert torch.equal(gemv_reference(x, w, residual=residual), torch.addmm(residual, x, w.t()))
    bias = torch.randn(5, generator=g)
    assert torch.equal(gemv_reference(x, w, bias, residual=residual),
                       residual + torch.nn.functional.linear(x, w, bias))
    assert gemv_reference(x.bfloat16(), w.bfloat16(), out_f32=True).dtype == torch.float32
    pairs = torch.randn(8, 16, generator=g)  # gate | up rows: the down product's input from gate|up's
    assert torch.equal(gemv_reference(x, pairs, norm_weight=norm, eps=1e-6, silu_pairs=True),
                       silu_mul_reference(torch.nn.functional.linear(rms_norm(x, norm, 1e-6), pairs)))


@pytest.mark.parametrize("tree", [False, True])
def test_attention_twin_is_the_eager_steps_attention(tmp_path, tree):
    """attention_reference gives what the eager step's SDPA gives over the runner's own masks (chain and
    tree blocks, GQA)."""
    import math

    from engine.models.runner import tree_ancestor_mask

    heads, kv_heads, d, start, n = 4, 2, 8, 6, 5
    g = torch.Generator().manual_seed(1)
    q = torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    k_cache = torch.randn(kv_heads, 16, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(kv_heads, 16, d, generator=g, dtype=torch.float64)
    parents = torch.tensor([-1, 0, 0, 1, 2]) if tree else torch.arange(-1, n - 1)
    visible = tree_ancestor_mask(parents).bool()
    out = attention_reference(q, k_cache, v_cache, start, visible)
    group = heads // kv_heads
    mask = torch.zeros(n, start + n, dtype=torch.float64)
    mask[:, start:].masked_fill_(~visible, float("-inf"))
    qg = q.reshape(1, kv_heads, group * n, d)
    keys, values = k_cache[None, :, :start + n], v_cache[None, :, :start + n]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        qg, keys, values, attn_mask=mask.repeat(group, 1)[None, None], scale=1 / math.sqrt(d))
    expected = sdpa.reshape(heads, n, d).transpose(0, 1).reshape(n, heads * d)
    torch.testing.assert_close(out, expected)


def test_launch_constants_match_the_cu_defines():
    """The block shapes Python launches with are the ones the kernels are written for."""
    import re

    from engine.kernels import step

    source = (step.CU_DIR / "decode_kernels.cu").read_text()
    defines = {k: int(v) for k, v in re.findall(r"#define (SP_\w+) (\d+)", source)}
    assert defines["SP_GEMV_WARPS"] == step.GEMV_ROWS_PER_BLOCK
    assert step.THREADS == 32 * defines["SP_GEMV_WARPS"]
    assert defines["SP_GEMV_STAGE"] == step.GEMV_STAGE and defines["SP_GEMV_MAX_ROWS"] == step.GEMV_MAX_ROWS
    assert 32 * defines["SP_ATTN_WARPS"] == step.ATTENTION_THREADS
    assert defines["SP_ATTN_MAX_D"] == step.ATTENTION_MAX_D
    assert "__launch_bounds__(256, SP_GEMV_BLOCKS) sp_gemv" in source
    assert "__launch_bounds__(256) sp_attention" in source
    assert f"-DSP_GEMV_BLOCKS={step.GEMV_BLOCKS_PER_SM}" in step.COMPILE_OPTIONS  # the grid's blocks per SM
    assert f"-DSP_GEMV_TILE={step.GEMV_TILE}" in step.COMPILE_OPTIONS and step.GEMV_TILE % 256 == 0
    assert "#ifndef SP_GEMV_TILE\n#define SP_GEMV_TILE 2048" in source  # the default the host passes
    # sp_attention_wide: blocks of SP_WIDE_WARPS warps, the value the host passes and launches with
    assert "#ifndef SP_WIDE_WARPS\n#define SP_WIDE_WARPS 4" in source and step.ATTENTION_WIDE_WARPS in (4, 8)
    assert f"-DSP_WIDE_WARPS={step.ATTENTION_WIDE_WARPS}" in step.COMPILE_OPTIONS
    assert "__launch_bounds__(SP_WIDE_THREADS, 16 / SP_WIDE_WARPS)" in source
    # its widest tile pass (D = 128: 16 lanes a row) must fit SP_WIDE_PASSES register slots
    assert defines["SP_WIDE_PASSES"] * (32 * step.ATTENTION_WIDE_WARPS // 16) == 8 * step.ATTENTION_WIDE_WARPS


WIDE_SHAPES = [(32, 8, 128, True), (32, 4, 64, True), (5, 5, 64, True), (4, 2, 32, True), (12, 4, 128, False),
               (4, 2, 16, False), (32, 32, 256, False), (64, 4, 128, False)]


@pytest.mark.parametrize("heads, kv_heads, d, fits", WIDE_SHAPES)
def test_wide_attention_takes_the_shapes_it_is_built_for(heads, kv_heads, d, fits):
    """sp_attention_wide serves groups of 1, 2, 4 or 8 query heads and head dims 32, 64 and 128 (a row's D / 8
    lanes must divide a warp, and its staged q fits SP_ATTN_GROUP_D); other shapes keep the other kernels."""
    from engine.kernels.step import StepKernels, instance_names

    assert StepKernels.wide_fits(heads, kv_heads, d) is fits
    if fits:
        assert f"sp_attention_wide<bf16_t, {heads // kv_heads}>" in instance_names()


def test_programmatic_launch_structs_match_cuda_h():
    """pdl.py's ctypes mirrors of CUlaunchAttribute and CUlaunchConfig have cuda.h's sizes, offsets
    (a wrong layout would hand the driver garbage), and the launcher stays off where it cannot work."""
    import ctypes

    from engine.kernels import pdl

    assert ctypes.sizeof(pdl._Attribute) == 72 and pdl._Attribute.value.offset == 8
    assert ctypes.sizeof(pdl._Config) == 56
    assert pdl._Config.hStream.offset == 32 and pdl._Config.attrs.offset == 40
    assert pdl._Config.numAttrs.offset == 48
    attribute = pdl._attribute()
    assert attribute.id == 6 and list(attribute.value)[:2] == [1, 0]
    assert pdl.PdlLauncher.load((8, 0)) is None  # below sm_90


def test_programmatic_launch_is_on_from_sm_90(monkeypatch):
    """On wherever the GPU is sm_90 or later and the driver has cuLaunchKernelEx (a stand-in driver here);
    below sm_90 it stays off without loading the driver."""
    from engine.kernels import pdl

    loaded = []
    monkeypatch.setattr(pdl.ctypes, "CDLL", lambda name: loaded.append(name) or
                        type("Driver", (), {"cuLaunchKernelEx": ctypes_function()})())
    assert pdl.PdlLauncher.load((8, 9)) is None and not loaded
    assert isinstance(pdl.PdlLauncher.load((9, 0)), pdl.PdlLauncher) and loaded == ["libcuda.so.1"]


def ctypes_function():
    """A stand-in for a ctypes foreign function (the loader sets restype and argtypes on it)."""
    return type("Function", (), {})()


def test_programmatic_launch_passes_grid_stream_and_arguments():
    """The launcher hands the driver the grid, the block, the stream, the attribute and one pointer per
    argument holding its value in the kernel's type (checked with a stand-in for cuLaunchKernelEx)."""
    import ctypes

    from engine.kernels import pdl

    seen = {}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(pdl._Config), ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    def fake_launch(config, function, params, extra):
        c = config.contents
        seen.update(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=(c.blockDimX, c.blockDimY, c.blockDimZ),
                    stream=c.hStream, attrs=c.numAttrs, attr_id=c.attrs[0].id, allowed=c.attrs[0].value[0],
                    function=function,
                    args=(ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0],
                          ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0],
                          ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float))[0]))
        return seen.setdefault("result", 0)

    launcher = pdl.PdlLauncher(fake_launch)
    assert launcher.launch(1234, (5,), 256, 0xabc, "Qif", [2**40 + 7, -3, 0.5])
    assert seen == dict(grid=(5, 1, 1), block=(256, 1, 1), stream=0xabc, attrs=1, attr_id=6, allowed=1,
                        function=1234, args=(2**40 + 7, -3, 0.5), result=0)
    seen["result"] = 1  # the driver refuses: the launcher says so and stays off
    assert not launcher.launch(1234, (5,), 256, 0xabc, "Qif", [1, 2, 3.0])
    assert not launcher.enabled and "error 1" in launcher.failure
    assert not launcher.launch(1234, (5,), 256, 0xabc, "Qif", [1, 2, 3.0])


def test_topk_off_cuda_is_torch_topk_and_the_twin_breaks_ties_to_the_lower_index():
    """engine.kernels.step.topk on the CPU is torch.topk (as TopK, read by name in drafting); the twin ranks
    values descending, a tie to the lower index, NaN first, +0 and -0 as equals."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ranked = topk(x, 4)
    assert torch.equal(ranked.values, torch.topk(x, 4).values)
    assert torch.equal(ranked.indices, torch.topk(x, 4).indices)
    row = torch.tensor([1.0, 3.0, float("nan"), 3.0, -0.0, 0.0, float("inf")])
    values, indices = topk_reference(row, 7)
    assert indices.tolist() == [2, 6, 1, 3, 0, 4, 5]
    assert values[1:].tolist() == [float("inf"), 3.0, 3.0, 1.0, 0.0, 0.0]


def test_topk_chunks_cover_every_column_and_bound_the_merge():
    """sp_topk's split: every chunk (ceil(C / S) columns, the last one shorter) holds at least one column,
    the chunks' best k make at most TOPK_MERGE keys for the merge, and rows past TOPK_ROWS stay whole."""
    from engine.kernels.step import TOPK_CHUNK, TOPK_MAX, TOPK_MERGE, TOPK_ROWS, topk_parts

    for columns in (1, 3, 16, 1023, 1024, 1025, 8192, 32000, 128256, 262144):
        for k in range(1, min(TOPK_MAX, columns) + 1):
            parts = topk_parts(4, columns, k)
            chunk = -(-columns // parts)
            assert parts >= 1 and parts * k <= max(TOPK_MERGE, k), (columns, k)
            assert columns - (parts - 1) * chunk >= 1, (columns, k, parts)
            assert parts == 1 or chunk >= TOPK_CHUNK // 2, (columns, k, parts)
    assert topk_parts(TOPK_ROWS + 1, 8192, 4) == 1
    assert topk_parts(4, 8192, 4) == 8  # Medusa's rows of the shipped vocabulary: 8 blocks each


def test_the_ngram_kernel_takes_every_chain_the_launch_allows():
    """sp_ngram_lookup keeps the block's tokens in shared memory: room for the longest chain that THREADS
    allows; sp_topk's largest k is TOPK_MAX."""
    import re

    from engine.kernels import step

    source = (step.CU_DIR / "decode_kernels.cu").read_text()
    defines = {k: int(v) for k, v in re.findall(r"#define (SP_\w+) (\d+)", source)}
    assert defines["SP_NGRAM_MAX_K"] >= step.THREADS and defines["SP_TOPK_MAX"] == step.TOPK_MAX


def test_programmatic_round_launches_only_where_a_kernel_of_ours_comes_before():
    """The round graphs ask the CUDA backend for a programmatic launch only behind a step kernel: never
    without the round kernels, never for a runner that cannot say."""
    from engine.core import graphs as round_graph

    class EndsInKernel:
        def step_ends_in_kernel(self, n):
            return n <= 9

    assert not round_graph.ends_in_kernel(EndsInKernel(), None, 5)  # no round kernels (CPU, reference)
    assert not round_graph.ends_in_kernel(object(), object(), 5)  # a runner without the question
    assert round_graph.ends_in_kernel(EndsInKernel(), object(), 5)
    assert not round_graph.ends_in_kernel(EndsInKernel(), object(), 17)  # a block past sp_gemv's rows
    assert round_graph.chained(True) == {"chained": True} and round_graph.chained(False) == {}


@pytest.mark.parametrize("pairs", [True, False])
def test_after_attention_chains_the_layers_products_as_the_eager_layer(pairs):
    """StepKernels.after_attention (LlamaRunner's layers and the published heads' on the decode path) over
    the twin's products: o with the residual, gate|up after the post-attention norm (SiLU * up in its
    epilogue, or staged by the down product), down with the residual; every launch chained behind the last."""
    g = torch.Generator().manual_seed(1)
    hidden, inter, width = 16, 24, 32
    attn, residual = torch.randn(3, width, generator=g), torch.randn(3, hidden, generator=g)
    w_o, w_gate_up = torch.randn(hidden, width, generator=g), torch.randn(2 * inter, hidden, generator=g)
    w_down, norm = torch.randn(hidden, inter, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    calls = []

    class Twins:
        def gemv(self, x, weight, bias=None, **kwargs):
            calls.append(kwargs)
            return gemv_reference(x, weight, bias, **kwargs)

        def takes_silu_pairs(self, gate_up):
            return pairs

    out = StepKernels.after_attention(Twins(), attn, residual, w_o, w_gate_up, norm, 1e-6, w_down)
    h = torch.addmm(residual, attn, w_o.t())
    gate, up = torch.nn.functional.linear(rms_norm_reference(h, norm, 1e-6), w_gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.addmm(h, torch.nn.functional.silu(gate) * up, w_down.t()))
    assert [c["chained"] for c in calls] == [True] * 3
    assert calls[1]["silu_pairs"] is pairs and calls[2]["silu"] is not pairs
