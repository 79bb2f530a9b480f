"""Fused kernels of the decoder step (kernels/step_kernels.cu, decode_kernels.cu, round_kernels.cu) and their
torch twins.

`rope_qkv` replaces the step's rotary embedding (3 kernels), the k/v cache writes (2) and q's copy into the
grouped layout SDPA reads (1); `silu_mul` replaces SiLU and the product with up (2). For blocks of up to 16
rows in bf16/fp16, `gemv` does a matrix product with the RMSNorm before it, the SiLU * up before it or the
residual add after it fused in, and `attention` replaces the mask building and SDPA of a short block. For
drafting, `topk` ranks short rows (Medusa's heads, EAGLE's tree) in one block per row, `ngram_lookup` is
n-gram's lookup over the committed tokens and `gemv` also fuses an EAGLE head's feature with the next token's
embedding. A replayed chain round's bookkeeping is `chain_block` (its block) and `chain_commit` (the next
replay's inputs). The twins are the eager step's own operations (attention's is an fp64 softmax; topk's a
stable sort; the lookup's engine.core.graphs.NgramLookup; the round's the torch operations the round graph ran
before), and the fuzz tests (tests/test_step_kernels_gpu.py) hold the kernels to them.

Launches go through CuPy on torch's current stream, so a step that uses them is captured in the CUDA graph
like any torch operation; their Python cost is paid once, at capture. `StepKernels.load(device)` returns None
where CuPy or a CUDA device is missing, and the step then runs its torch operations.
"""
from __future__ import annotations

import math
import threading
from collections import namedtuple
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.launch_spec import CU_DIR, LOADS_AHEAD, KernelSpec, parse_kernels
from engine.kernels.pdl import PdlLauncher

SOURCE = CU_DIR / "step_kernels.cu"
# compiled as one module, in order
SOURCES = (CU_DIR / "cuda_common.cuh", SOURCE, CU_DIR / "decode_kernels.cu", CU_DIR / "round_kernels.cu")
THREADS = 256
GEMV_MAX_ROWS = 16  # SP_GEMV_MAX_ROWS: sp_gemv is instantiated for 1..16 rows
GEMV_ROWS_PER_BLOCK = 8  # SP_GEMV_WARPS
GEMV_STAGE = 20480  # SP_GEMV_STAGE: rows * K values a block stages
# columns of the row segment a warp of sp_gemv loads at a time (SP_GEMV_TILE: a multiple of 256, 8 values a
# lane a chunk). A lane's chunks come in the same order whatever it is, so the bits do not change; on an H200
# every shorter tile was slower (kernels/NOTES.md, runtimes_synthetic_gemv_tile.txt).
GEMV_TILE = 2048
GEMV_PREFETCH = 8192  # bytes per warp a programmatically launched sp_gemv pulls into L2 before it waits
# the kernel's launch bounds (SP_GEMV_BLOCKS): a grid of this many blocks per SM walks every row, all of
# them resident (grids of one block per SM, leaving room for the next kernel, were slower: gemv_probe at tag
# before-house-cleanup)
GEMV_BLOCKS_PER_SM = 2
# Weights with rows shorter than this multiply on the tensor cores (sp_gemv_tc, sm_80 on: a block's rows are
# the rows of m16n8k16 products, so 16 rows cost what one does, and the 8 warps of a block split each row):
# sp_gemv's warp a row leaves most lanes idle on a row shorter than its 2048-column segment, and each further
# row of a verification block adds its share of that work. Longer rows stream from memory faster in sp_gemv
# (the 7B shape: 4.31 ms a token against 4.52 on the tensor cores, docs/measurements/
# runtimes_synthetic_gemv_tc_{off,on}.txt). The choice depends on the weight alone, never on the rows, so a
# verification block's rows keep the bits of one-token steps.
GEMV_TC_K = 2048
# 16-byte loads a lane of the attention kernels issues before it uses them (SP_ATTN_AHEAD), and the resident
# blocks per SM sp_attention_grouped is built for (SP_ATTN_GROUPED_BLOCKS: its registers per thread); the
# attention kernels also ask L2 for a chunk's rows before they read them (kernels/NOTES.md)
ATTENTION_AHEAD = 16
ATTENTION_GROUPED_BLOCKS = 4
NORM_THREADS = 256  # SP_NORM_THREADS
ATTENTION_THREADS = 256  # SP_ATTN_WARPS warps of 32
ATTENTION_MAX_D = 256  # SP_ATTN_MAX_D
ATTENTION_SPLITS = 4  # blocks per (token, head): a one-token step of 32 heads fills 128 SMs, not 32
# ... when one token's (sequence, head) pairs are fewer than this; a batch of sequences has blocks enough
# without splitting (B = 64 of 32 heads split 4 ways ran 8,192 blocks, most of them without a key). Splits
# depend on the sequences and heads only, never on the block's length: a verification block's rows keep
# the bits of one-token steps.
ATTENTION_SPLIT_PAIRS = 128
# query heads per kv head that sp_attention_grouped is built for (SP_ATTN_GROUP_D: head dims up to 128); an
# unsplit launch of such a model reads each key and value row once per kv head, not once per query head.
ATTENTION_GROUPS = (2, 4, 8)
ATTENTION_GROUP_D = 128
# sp_attention_wide, for the batched step's unsplit launches (engine/models/batch_runner.py asks with
# wide=True):
# a tile of 32 cache rows (8 a warp) spread over the whole block, its key and value loads issued together.
# Its sums run in another order than sp_attention's, so it is never the one-sequence step's kernel (whose
# bits the batched step need not share: its losslessness is per sequence in fp32).
ATTENTION_WIDE_GROUPS = (1, 2, 4, 8)
# its warps a block (SP_WIDE_WARPS: blocks of 4 warps let 4 reside on an SM at its 128 registers a thread)
ATTENTION_WIDE_WARPS = 4
ATTENTION_WIDE_D = (32, 64, 128)
ATTENTION_PAIRS = 1 << 20  # the most (token, head) pairs a launch may have: the merge counters kept
NGRAM_MAX_N = 64  # SP_NGRAM_MAX_N: the longest suffix sp_ngram_lookup tries
TOPK_MAX = 16  # SP_TOPK_MAX: the largest k sp_topk takes (torch.topk beyond it)
# sp_topk splits a row into chunks of about TOPK_CHUNK columns, a block each, and the row's last block ranks
# their best k (at most TOPK_MERGE keys in all); rows beyond TOPK_ROWS are ranked a block a row
TOPK_CHUNK, TOPK_MERGE, TOPK_ROWS = 1024, 1024, 1 << 14
KEEP_MAX = 16  # SP_KEEP_MAX: the longest path sp_keep_path moves
MEDUSA_MAX_H = 8192  # SP_MEDUSA_MAX_H: the widest feature sp_medusa_heads takes
TREE_MAX = 64  # SP_TREE_MAX: the most candidates sp_tree_level ranks, and of nodes a growth has
# EAGLE's tree levels and final choice in one kernel each (sp_tree_level, sp_tree_choose) where the kernels
# are loaded (their fuzz test passed at 10,000 cases on an H200: docs/measurements/
# gpu_tests_tree_kernels_fuzz.log)
_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
HALF_DTYPES = (torch.bfloat16, torch.float16)  # what sp_gemv and sp_attention are built for
_NUMPY = {"Q": np.uint64, "i": np.int32, "f": np.float32}

# Written as in the .cu (tests/test_kernels_launch_spec.py-style check in tests/test_step_kernels.py).
SPECS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("sp_rope_qkv",
               "const T* qkv, const T* cos_table, const T* sin_table, const long long* positions, "
               "const long long* cache_index, const long long* start, T* k_cache, T* v_cache, T* q_out, "
               "int n, int heads, int kv_heads, int D, int cache_len", templated=True),
    KernelSpec("sp_silu_mul", "const T* gate_up, T* out, int n, int inter, int per_thread", templated=True),
    KernelSpec("sp_rms_norm", "const T* x, const T* weight, T* out, int H, float eps", templated=True),
    *(KernelSpec(name,
                 "const T* x, const T* norm_weight, const T* weight, const T* bias, const T* residual, "
                 "void* out, int K, int N, int x_stride, int mode, float eps, int out_f32, "
                 "int prefetch_bytes, const T* embed, const long long* tokens, int pair_rows", templated=True)
      for name in ("sp_gemv", "sp_gemv_tc")),
    KernelSpec("sp_attention",
               "const T* q, const T* k_cache, const T* v_cache, const long long* start, "
               "const unsigned char* visible, T* out, int n, int heads, int kv_heads, int D, int cache_len, "
               "float scale, int block_n, int seq_stride, float* partial, int* counters, int splits",
               templated=True),
    KernelSpec("sp_attention_grouped",
               "const T* q, const T* k_cache, const T* v_cache, const long long* start, "
               "const unsigned char* visible, T* out, int n, int heads, int kv_heads, int D, int cache_len, "
               "float scale, int block_n, int seq_stride",
               templated=True),
    KernelSpec("sp_attention_wide",
               "const T* q, const T* k_cache, const T* v_cache, const long long* start, "
               "const unsigned char* visible, T* out, int n, int heads, int kv_heads, int D, int cache_len, "
               "float scale, int block_n, int seq_stride",
               templated=True),
    KernelSpec("sp_topk",
               "const T* x, int R, int C, int stride, int k, int S, int chunk, float* values_out, "
               "long long* indices_out, const long long* gather, int G, long long* gathered, "
               "unsigned long long* partial, int* counters",
               templated=True),
    KernelSpec("sp_ngram_lookup",
               "long long* history, long long* length, int M, int max_n, int k, const long long* draft, "
               "const long long* next_token, const long long* accepted, long long* tokens_out, "
               "long long* count_out, const long long* chain, const long long* pair_keys, "
               "const long long* pair_tokens, int pairs, int width, int vocab, const long long* start, "
               "const unsigned short* embed, int row_halves, long long* block_tokens, "
               "long long* block_start, unsigned short* x_out"),
    KernelSpec("sp_chain_block",
               "const long long* next_token, const long long* chain, int K, const long long* start, "
               "const long long* accepted, const T* embed, int H, long long* tokens_out, "
               "long long* start_out, T* x_out", templated=True),
    KernelSpec("sp_chain_commit",
               "const long long* accepted_in, const long long* next_in, const long long* chain, int K, "
               "const long long* start_in, const long long* count, long long* accepted, "
               "long long* next_token, long long* draft, long long* start, float* count_out, "
               "const long long* path_in, long long* path, int P"),
    KernelSpec("sp_tree_level",
               "const float* top_values, const long long* top_indices, const float* frontier_scores, "
               "const long long* frontier, int F, int B, int W, int count, int T, unsigned char* ancestors, "
               "const long long* node_depth, const long long* true_length, long long* tokens_all, "
               "long long* parents_all, float* scores_all, long long* local_parent, long long* positions, "
               "long long* frontier_out, float* frontier_scores_out"),
    KernelSpec("sp_medusa_heads",
               "const T* x, int H, const long long* accepted, const long long* path, const T* norm_weight, "
               "float eps, const T* weight, const T* bias, int D, int M, T* out", templated=True),
    KernelSpec("sp_keep_path",
               "uint4* kv, int planes, int max_len, int chunks, const long long* start, "
               "const long long* path, int P"),
    KernelSpec("sp_tree_choose",
               "const long long* tokens_all, const long long* parents_all, const float* scores_all, "
               "const long long* node_depth, const unsigned char* ancestors, int T, int N, float tie_break, "
               "long long* tokens_out, long long* parents_out, long long* depth_out, "
               "unsigned char* visible_out"),
)}
GEMV_MODES = {"plain": 0, "rms_norm": 1, "silu_mul": 2, "embed_cat": 3}


def instance_names() -> list:
    """Every kernel instance the module is compiled with (NVRTC name expressions)."""
    names = [f"{name}<{t}>" for name in ("sp_rope_qkv", "sp_silu_mul", "sp_rms_norm")
             for t in _DTYPES.values()]
    halves = [_DTYPES[d] for d in HALF_DTYPES]
    names += [f"{kernel}<{t}, {m}>" for kernel in ("sp_gemv", "sp_gemv_tc") for t in halves
              for m in range(1, GEMV_MAX_ROWS + 1)]
    names += [f"sp_attention_grouped<{t}, {g}>" for t in halves for g in ATTENTION_GROUPS]
    names += [f"sp_attention_wide<{t}, {g}>" for t in halves for g in ATTENTION_WIDE_GROUPS]
    names += [f"sp_attention<{t}>" for t in halves]
    names += [f"sp_topk<{t}>" for t in _DTYPES.values()]
    names += [f"sp_chain_block<{t}>" for t in _DTYPES.values()]
    names += [f"sp_medusa_heads<{t}>" for t in halves]
    return names + ["sp_ngram_lookup", "sp_chain_commit", "sp_tree_level", "sp_tree_choose",
                    "sp_keep_path"]


def module_source() -> str:
    return "\n".join(path.read_text() for path in SOURCES)


COMPILE_OPTIONS = ("--std=c++17", "--fmad=false", f"-DSP_GEMV_BLOCKS={GEMV_BLOCKS_PER_SM}",
                   f"-DSP_LOADS_AHEAD={LOADS_AHEAD}", f"-DSP_ATTN_AHEAD={ATTENTION_AHEAD}",
                   f"-DSP_ATTN_GROUPED_BLOCKS={ATTENTION_GROUPED_BLOCKS}", f"-DSP_GEMV_TILE={GEMV_TILE}",
                   f"-DSP_WIDE_WARPS={ATTENTION_WIDE_WARPS}")


# ------------------------------------------------------------------------------------------------ twins
def rope_qkv_reference(qkv, cos_table, sin_table, positions, cache_index, k_cache, v_cache, heads: int,
                       kv_heads: int):
    """The eager step's ops: rope on q and k, k/v written at cache_index, q as [heads, n, D].
    qkv [n, (heads + 2 kv_heads) * D]; tables [max_len, D]; k_cache, v_cache [kv_heads, max_len, D]."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    q_dim, kv_dim = heads * d, kv_heads * d
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [n, 1, D]
    x = qkv[:, :q_dim + kv_dim].unflatten(-1, (-1, d))  # [n, heads + kv_heads, D]
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    qk = torch.addcmul(x * cos, swapped, sin)
    k_cache.index_copy_(1, cache_index, qk[:, heads:].transpose(0, 1))
    v_cache.index_copy_(1, cache_index, qkv[:, q_dim + kv_dim:].view(n, kv_heads, d).transpose(0, 1))
    return qk[:, :heads].transpose(0, 1).contiguous()  # [heads, n, D]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 I] (gate | up) -> SiLU(gate) * up [n, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, rounded to x's dtype, then times the weight (rounded)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


TopK = namedtuple("TopK", "values indices")


def topk_reference(x: torch.Tensor, k: int) -> tuple:
    """sp_topk's order: x [..., C] -> (values [..., k] float32, indices [..., k] int64), values descending, a
    tie to the lower index, NaN above everything (torch.sort's order, stable)."""
    values, indices = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def chain_block_reference(next_token, chain, start, accepted, embed) -> tuple:
    """sp_chain_block's twin, a chain round's block as the round graph built it: (tokens [K+1] = [next
    token, chain], the block's start [1] = start + 1 + accepted, its embeddings [K+1, H])."""
    tokens = torch.cat((next_token, chain))
    return tokens, start + 1 + accepted, F.embedding(tokens, embed)


def medusa_heads_reference(x, norm_weight, eps: float, weight, bias, depth: int, accepted=None,
                           path=None) -> torch.Tensor:
    """sp_medusa_heads' twin: Medusa's first `depth` heads on features x [M, H] (pre-norm), their weights
    stacked (weight [depth * H, H], bias [depth * H] or None) -> [depth, M, H], out[d, m] = xn + SiLU(W_d xn
    + b_d) with xn the final RMSNorm of row m. With accepted and path (device [1] and [N]): the one row that
    gave the last round's next token (0 when nothing was accepted, else path[accepted - 1] + 1), M = 1."""
    if accepted is not None:
        row = torch.cat((torch.full((1,), -1, dtype=torch.long, device=x.device), path))
        x = x.index_select(0, row.index_select(0, accepted) + 1)  # [1, H]
    rows, hidden = x.shape
    normed = rms_norm_reference(x, norm_weight, eps)  # [M, H]
    outs = normed[:, None, :] + F.silu(F.linear(normed, weight, bias)).view(rows, depth, hidden)  # [M, D, H]
    return outs.transpose(0, 1).contiguous()  # [D, M, H]


def keep_path_reference(kv: torch.Tensor, start: torch.Tensor, path: torch.Tensor,
                        rows: torch.Tensor) -> None:
    """sp_keep_path's twin: a tree block at cache row start (device [1]; its row 0 the last committed token)
    keeps its accepted path in kv [L, 2, kv_heads, max_len, D], in place: rows start+1+i take rows
    start+1+path[i] (path [P], -1 past the accepted count: those rows copy themselves; rows = arange(P)). The
    gather comes first, so rows moving down over each other are safe."""
    source = start + 1 + torch.where(path >= 0, path, rows)  # [P]
    kv.index_copy_(3, start + 1 + rows, kv.index_select(3, source))


def chain_commit_reference(accepted_in, next_in, chain, start_in, accepted, next_token, draft, start,
                           count=None, count_out=None, path_in=None, path=None) -> None:
    """sp_chain_commit's twin: the round's outcome copied into the next replay's inputs (in place); a tree
    round's accepted path too (path_in -> path, Medusa's)."""
    accepted.copy_(accepted_in[:1].clamp_min(0))  # -1 flags NaN: the readout raises
    next_token.copy_(next_in[:1].clamp_min(0))
    draft.copy_(chain)
    start.copy_(start_in)
    if count is not None:
        count_out.copy_(count.float())
    if path_in is not None:
        path.copy_(path_in)


def topk_parts(rows: int, columns: int, k: int) -> int:
    """The chunks (blocks) sp_topk splits each of `rows` rows of `columns` into for the best k."""
    if rows > TOPK_ROWS:
        return 1
    return max(1, min(-(-columns // TOPK_CHUNK), TOPK_MERGE // k))


def topk(x: torch.Tensor, k: int) -> tuple:
    """The k largest along the last dimension, as (values, indices), for the short rankings of drafting:
    sp_topk on CUDA (topk_reference's order, values float32) where it applies and a runner has loaded the
    kernels, else torch.topk."""
    kernels = StepKernels.loaded(x.device) if x.is_cuda and 1 <= k <= TOPK_MAX else None
    if kernels is None or x.dtype not in _DTYPES or x.numel() == 0 or k > x.shape[-1]:
        return TopK(*torch.topk(x, k, dim=-1))
    return kernels.topk(x, k)


def tree_level_reference(top_values, top_indices, frontier_scores, frontier, width: int, count: int,
                         ancestors, node_depth, true_length, tokens_all, parents_all, scores_all) -> tuple:
    """sp_tree_level's twin, one level of EAGLE's tree: the frontier's F nodes with their B best children
    (top_values [F, B] log-probabilities, top_indices [F, B] tokens), each child scored by its parent's
    score (frontier_scores [F]) plus its own; the `width` best in topk_reference's order become nodes
    count..count+width-1: written into tokens_all, parents_all (frontier ids, -1 = the root), scores_all [T]
    and their ancestor-or-self rows of ancestors [T, T] bool, in place. Returns (local_parent [W], the
    frontier index of each node's parent; positions [W] = true_length + its depth; the next frontier [W] and
    its scores [W])."""
    branch = top_values.shape[-1]
    candidates = (frontier_scores[:, None] + top_values).flatten()  # [F * B]
    values, indices = topk_reference(candidates, width)  # [W] each, best first
    local_parent = indices // branch
    parents = frontier[local_parent]  # [W]
    rows = slice(count, count + width)
    tokens_all[rows], parents_all[rows], scores_all[rows] = top_indices.flatten()[indices], parents, values
    ancestors[rows] = ancestors[parents.clamp_min(0)] & (parents >= 0)[:, None]
    ancestors[rows, rows].diagonal().fill_(True)
    positions = true_length + node_depth[rows]  # [W]
    frontier_out = torch.arange(count, count + width, device=top_values.device)
    return local_parent, positions, frontier_out, values


def tree_choose_reference(tokens_all, parents_all, scores_all, node_depth, ancestors, nodes: int,
                          tie_break: float) -> tuple:
    """sp_tree_choose's twin: the `nodes` best of the growth's T candidates by scores_all - tie_break *
    node_depth (topk_reference's order) as a draft tree in candidate order: (tokens [N], parents [N] in the
    tree, -1 = the last committed token; the verification block's depth [N+1] and visibility [N+1, N+1], row 0
    the last committed token)."""
    device = tokens_all.device
    keys = scores_all - tie_break * node_depth  # [T]
    chosen = topk_reference(keys, nodes)[1].sort().values  # [N] in candidate order
    slot = torch.full((tokens_all.numel(),), -1, dtype=torch.long, device=device)
    slot[chosen] = torch.arange(nodes, device=device)
    chosen_parents = parents_all[chosen]  # [N] candidate ids
    tree_parents = torch.where(chosen_parents >= 0, slot[chosen_parents.clamp_min(0)], chosen_parents)
    block_visible = torch.zeros(nodes + 1, nodes + 1, dtype=torch.bool, device=device)
    block_visible[:, 0] = True  # every row sees the last committed token
    block_visible[1:, 1:] = ancestors[chosen][:, chosen]
    block_depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), node_depth[chosen] + 1])
    return tokens_all[chosen], tree_parents, block_depth, block_visible


def tree_kernels(device) -> Optional["StepKernels"]:
    """The loaded step kernels where EAGLE's tree levels run in them, else None (the twins)."""
    device = torch.device(device)
    return StepKernels.loaded(device) if device.type == "cuda" else None


def gemv_reference(x, weight, bias=None, *, residual=None, norm_weight=None, eps: float = 0.0,
                   silu: bool = False, out_f32: bool = False, chained: bool = False, embed=None,
                   tokens=None, silu_pairs: bool = False) -> torch.Tensor:
    """The eager ops sp_gemv fuses: in = x, RMSNorm(x) * norm_weight, SiLU(gate) * up (x = gate | up), or
    [x | embed[tokens]] (EAGLE's fusion: x [M, K/2], embed [V, K/2], tokens [M]); out = in @ weight.T
    (+ bias), + residual as torch.addmm adds it. x [M, K] ([M, 2K] with silu), weight [N, K] -> [M, N] in
    x's dtype (float32 with out_f32). silu_pairs: weight [2 I, K] is gate | up and the output SiLU(gate) *
    up [M, I]."""
    if silu_pairs:
        return silu_mul_reference(gemv_reference(x, weight, bias, norm_weight=norm_weight, eps=eps))
    if embed is not None:
        inputs = torch.cat((x, F.embedding(tokens, embed)), -1)
    elif silu:
        inputs = silu_mul_reference(x)
    elif norm_weight is not None:
        inputs = rms_norm_reference(x, norm_weight, eps)
    else:
        inputs = x
    if residual is None:
        out = F.linear(inputs, weight, bias)
    elif bias is None:
        out = torch.addmm(residual, inputs, weight.t())
    else:
        out = residual + F.linear(inputs, weight, bias)
    return out.float() if out_f32 else out


def attention_reference(q, k_cache, v_cache, start, visible) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in fp64 over the rows each query sees: every cache row before start, and
    block row j where visible[i, j]. q [heads, n, D]; caches [kv_heads, cache_len, D]; visible [n, n] bool.
    Batched: caches [B, kv_heads, cache_len, D], start a list of B starts, q [heads, B * block_n, D] (sequence
    b's block is tokens b * block_n ..), visible [block_n, block_n]. Returns [n, heads * D] in q's dtype."""
    if k_cache.dim() == 4:
        block_n = visible.shape[0]
        return torch.cat([attention_reference(q[:, b * block_n:(b + 1) * block_n], k_cache[b], v_cache[b],
                                              int(s), visible) for b, s in enumerate(start)])
    heads, n, d = q.shape
    group = heads // k_cache.shape[0]
    keys = k_cache[:, :start + n].double().repeat_interleave(group, 0)  # [heads, L, D]
    values = v_cache[:, :start + n].double().repeat_interleave(group, 0)
    scores = q.double() @ keys.transpose(1, 2) / math.sqrt(d)  # [heads, n, L]
    seen = torch.cat([torch.ones(n, start, dtype=torch.bool, device=q.device), visible.bool()], dim=1)
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return (probs @ values).transpose(0, 1).reshape(n, heads * d).to(q.dtype)


# ------------------------------------------------------------------------------------------------ kernels
class StepKernels:
    """The compiled step kernels of one device."""

    _lock = threading.Lock()
    _loaded: dict = {}  # device index -> StepKernels or None

    def __init__(self, module, device: torch.device):
        self.device = device
        self._kernels = {name: module.get_function(name) for name in instance_names()}
        self._streams: dict = {}  # torch stream pointer -> CuPy's view of it, made once
        properties = torch.cuda.get_device_properties(device)
        self._gemv_blocks = GEMV_BLOCKS_PER_SM * properties.multi_processor_count  # every block resident
        self.has_tensor_cores = properties.major >= 8  # sp_gemv_tc's m16n8k16 products
        # pdl.py: each kernel may start while the previous one finishes (sm_90 on; None: CuPy launches)
        self.pdl = PdlLauncher.load((properties.major, properties.minor))
        # sp_attention's merge counters, zero between launches (each launch leaves them zero)
        self._attention_counters = torch.zeros(ATTENTION_PAIRS, dtype=torch.int32, device=device)
        self._topk_counters = torch.zeros(TOPK_ROWS, dtype=torch.int32, device=device)  # sp_topk's, the same

    @classmethod
    def load(cls, device) -> Optional["StepKernels"]:
        """The kernels for a CUDA device, compiled once; None without CuPy/CUDA."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cls._lock:
            if index not in cls._loaded:
                cls._loaded[index] = cls._compile(torch.device("cuda", index))
            return cls._loaded[index]

    @classmethod
    def loaded(cls, device) -> Optional["StepKernels"]:
        """The kernels of a CUDA device if a runner loaded them already, else None (never compiles: a
        ranking inside a graph capture must not start a compilation)."""
        device = torch.device(device)
        return cls._loaded.get(device.index if device.index is not None else torch.cuda.current_device())

    @classmethod
    def _compile(cls, device) -> Optional["StepKernels"]:
        try:
            import cupy
        except Exception:  # noqa: BLE001 - no CuPy: the step keeps its torch operations
            return None
        with cupy.cuda.Device(device.index):
            module = cupy.RawModule(code=module_source(), options=COMPILE_OPTIONS,  # extern "C" ones by name
                                    name_expressions=[n for n in instance_names() if "<" in n])
            return cls(module, device)

    def _launch(self, name: str, dtype: torch.dtype, count: int, chained: bool, **args) -> None:
        """One thread per item: `count` items, THREADS to a block."""
        self._launch_grid(name, f"{name}<{_DTYPES[dtype]}>", ((count + THREADS - 1) // THREADS,), THREADS,
                          chained, **args)

    def _launch_grid(self, name: str, instance: str, grid: tuple, threads: int, chained: bool,
                     **args) -> None:
        """chained: the caller knows the stream's previous kernel is one of these step kernels, so this one
        may be a programmatic launch (pdl.py; a programmatic edge in a captured graph needs a kernel
        before it, and cuBLAS or torch may have queued a memset there)."""
        spec = SPECS[name]
        pointer = torch.cuda.current_stream(self.device).cuda_stream
        function = self._kernels[instance]
        if self._programmatic(chained) and self.pdl.launch(_function_pointer(function), grid, threads,
                                                           pointer, spec.layout, spec.values(args)):
            return
        values = [_NUMPY[fmt](v) for fmt, v in zip(spec.layout, spec.values(args))]
        function(grid, (threads,), tuple(values), stream=self._stream(pointer))

    def _stream(self, pointer: int):
        stream = self._streams.get(pointer)
        if stream is None:
            import warnings

            import cupy

            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; 13 lacks its successor
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[pointer] = cupy.cuda.ExternalStream(pointer)
        return stream

    def _programmatic(self, chained: bool) -> bool:
        return chained and self.pdl is not None and self.pdl.enabled

    @staticmethod
    def _groups(heads: int, kv_heads: int, d: int) -> bool:
        """Whether an unsplit attention launch takes sp_attention_grouped."""
        return heads // kv_heads in ATTENTION_GROUPS and d <= ATTENTION_GROUP_D

    @staticmethod
    def wide_fits(heads: int, kv_heads: int, d: int) -> bool:
        """Whether sp_attention_wide is built for this attention shape."""
        return heads // kv_heads in ATTENTION_WIDE_GROUPS and d in ATTENTION_WIDE_D

    def rope_qkv(self, qkv, cos_table, sin_table, positions, cache_index, k_cache, v_cache, heads: int,
                 kv_heads: int, chained: bool = False, start: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As rope_qkv_reference; returns q [heads, n, D]. Every tensor contiguous, one dtype, one device.
        B sequences' caches [B, kv_heads, max_len, D] work too: token i's rows are written at (b, h,
        r) when cache_index[i] = b * kv_heads * max_len + r (the kernel adds h * max_len itself).
        start [1] int64 on the device: a block at cache rows start.. of one sequence, positions the tokens'
        depths (positions start + depth, rows start + i, both added in the kernel); cache_index is then
        unused (None)."""
        n, d = qkv.shape[0], k_cache.shape[-1]
        _check(qkv, cos_table, sin_table, k_cache, v_cache)
        indexes = ((positions, n), (cache_index, n) if start is None else (start, 1))
        if any(t.dtype != torch.long or not t.is_contiguous() or t.numel() != size for t, size in indexes):
            raise ValueError("positions and cache_index must be contiguous int64 tensors of n entries "
                             "(start: one entry)")
        q_out = torch.empty(heads, n, d, dtype=qkv.dtype, device=qkv.device)
        self._launch("sp_rope_qkv", qkv.dtype, n * (heads + 2 * kv_heads) * d, chained, qkv=qkv.data_ptr(),
                     cos_table=cos_table.data_ptr(), sin_table=sin_table.data_ptr(),
                     positions=positions.data_ptr(), cache_index=_pointer(cache_index), start=_pointer(start),
                     k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), q_out=q_out.data_ptr(), n=n,
                     heads=heads, kv_heads=kv_heads, D=d, cache_len=k_cache.shape[-2])
        return q_out

    def silu_mul(self, gate_up: torch.Tensor, chained: bool = False) -> torch.Tensor:
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        _check(gate_up)
        out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
        # 8 values a thread where 16-byte loads line up: a 16-bit dtype, I % 8 == 0, an aligned tensor
        per_thread = 8 if (gate_up.dtype in HALF_DTYPES and inter % 8 == 0 and gate_up.data_ptr() % 16 == 0
                           and out.data_ptr() % 16 == 0) else 1
        self._launch("sp_silu_mul", gate_up.dtype, n * inter // per_thread, chained,
                     gate_up=gate_up.data_ptr(), out=out.data_ptr(), n=n, inter=inter, per_thread=per_thread)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 chained: bool = False) -> torch.Tensor:
        """As rms_norm_reference for rows x [n, H] (contiguous; weight [H], same dtype): one block a row."""
        _check(x, weight)
        if x.dim() != 2 or tuple(weight.shape) != (x.shape[1],):
            raise ValueError(f"rms_norm: rows {tuple(x.shape)} with a weight {tuple(weight.shape)}")
        out = torch.empty_like(x)
        self._launch_grid("sp_rms_norm", f"sp_rms_norm<{_DTYPES[x.dtype]}>", (x.shape[0],), NORM_THREADS,
                          chained, x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), H=x.shape[1],
                          eps=eps)
        return out


    def gemv(self, x, weight, bias=None, *, residual=None, norm_weight=None, eps: float = 0.0,
             silu: bool = False, out_f32: bool = False, chained: bool = False, embed=None,
             tokens=None, tensor_cores: Optional[bool] = None, silu_pairs: bool = False) -> torch.Tensor:
        """As gemv_reference, for M <= 16 rows of bf16/fp16 with M * K <= GEMV_STAGE (`gemv_fits` says
        when); with embed and tokens (int64 [M] on the device) K % 16 == 0. tensor_cores: sp_gemv_tc or
        sp_gemv (default: by the weight's row length, see GEMV_TC_K; tests force each). silu_pairs (sp_gemv,
        no residual, `takes_silu_pairs` says when): weight [2 I, K] is gate | up, the output SiLU(gate) * up
        [M, I], the down product's input made once."""
        rows, (n_out, k) = x.shape[0], weight.shape
        pair_rows = 0
        if silu_pairs:
            if residual is not None or out_f32 or silu or embed is not None or n_out % 2 or tensor_cores:
                raise ValueError("gemv: SiLU pairs take a gate | up weight, no residual, on sp_gemv")
            n_out = pair_rows = n_out // 2
            tensor_cores = False
        width = 2 * k if silu else k // 2 if embed is not None else k
        if not 1 <= rows <= GEMV_MAX_ROWS or rows * k > GEMV_STAGE or x.shape[1] != width:
            raise ValueError(f"gemv: {rows} rows of {x.shape[1]} for a weight {tuple(weight.shape)}")
        _check_aligned(x, weight, *(t for t in (norm_weight, embed) if t is not None))
        _check(*(t for t in (x, bias, residual) if t is not None))
        if residual is not None and tuple(residual.shape) != (rows, n_out):
            raise ValueError(f"gemv: residual {tuple(residual.shape)} for an output of ({rows}, {n_out})")
        if embed is not None:
            _check_longs(tokens)
            if k % 16 or embed.shape[1] != k // 2 or tokens.numel() != rows:
                raise ValueError(f"gemv: embeddings {tuple(embed.shape)} of {tokens.numel()} tokens for a "
                                 f"weight {tuple(weight.shape)}")
        mode = GEMV_MODES["embed_cat" if embed is not None else "silu_mul" if silu
                          else "rms_norm" if norm_weight is not None else "plain"]
        out = torch.empty(rows, n_out, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
        # a block of either kernel takes 8 output rows at a time (sp_gemv one a warp, sp_gemv_tc one unit)
        grid = (min((n_out + GEMV_ROWS_PER_BLOCK - 1) // GEMV_ROWS_PER_BLOCK, self._gemv_blocks),)
        if tensor_cores is None:
            tensor_cores = k < GEMV_TC_K and self.has_tensor_cores
        if tensor_cores and not self.has_tensor_cores:
            raise ValueError("gemv: tensor-core products need sm_80 or later")
        name = "sp_gemv_tc" if tensor_cores else "sp_gemv"
        self._launch_grid(name, f"{name}<{_DTYPES[x.dtype]}, {rows}>", grid, THREADS, chained,
                          x=x.data_ptr(),
                          norm_weight=_pointer(norm_weight), weight=weight.data_ptr(), bias=_pointer(bias),
                          residual=_pointer(residual), out=out.data_ptr(), K=k, N=n_out, x_stride=x.shape[1],
                          mode=mode, eps=eps, out_f32=int(out_f32),
                          prefetch_bytes=GEMV_PREFETCH if self._programmatic(chained) else 0,
                          embed=_pointer(embed), tokens=_pointer(tokens), pair_rows=pair_rows)
        return out

    def after_attention(self, attn, residual, w_o, w_gate_up, post_norm, eps: float, w_down, b_o=None,
                        b_gate_up=None, b_down=None) -> torch.Tensor:
        """A decoder layer after its attention, as the decode path runs it (the previous kernel is a step
        kernel): h = residual + o(attn), then h + down(SiLU(gate) * up) of gate|up(RMSNorm(h)), SiLU * up made
        once in gate|up's epilogue where sp_gemv takes the weight (else staged by the down product). attn
        [n, heads * D], residual [n, H] -> [n, H]. LlamaRunner's layers and the published heads' share it."""
        h = self.gemv(attn, w_o, b_o, residual=residual, chained=True)  # [n, H]
        pairs = self.takes_silu_pairs(w_gate_up)
        act = self.gemv(h, w_gate_up, b_gate_up, norm_weight=post_norm, eps=eps, chained=True,
                        silu_pairs=pairs)  # [n, I] with pairs, else gate | up [n, 2 I]
        return self.gemv(act, w_down, b_down, residual=h, silu=not pairs, chained=True)

    def takes_silu_pairs(self, gate_up: torch.Tensor) -> bool:
        """Whether gemv(.., silu_pairs=True) runs this gate | up weight: one sp_gemv would take by default
        (rows of GEMV_TC_K columns or more)."""
        return gate_up.shape[1] >= GEMV_TC_K or not self.has_tensor_cores

    def topk(self, x: torch.Tensor, k: int, chained: bool = False) -> tuple:
        """As topk_reference for x [..., C] (float32, bf16 or fp16; rows may be strided, columns contiguous),
        1 <= k <= min(TOPK_MAX, C): one block per row."""
        return self._topk(x, k, chained, None)[0]

    def topk_take(self, x: torch.Tensor, k: int, index: torch.Tensor, chained: bool = False) -> torch.Tensor:
        """topk(x, k).indices.take(index) in the same launch: index (int64 on the device, any shape) holds
        flat positions in the [R, k] indices of x's R rows."""
        return self.topk_and_take(x, k, index, chained)[1]

    def topk_and_take(self, x: torch.Tensor, k: int, index: torch.Tensor, chained: bool = False) -> tuple:
        """(topk(x, k), its indices taken at index, as topk_take) from one launch."""
        if index.dtype != torch.long or index.device != self.device:
            raise ValueError("topk_take: the index must be int64 on the device")
        return self._topk(x, k, chained, index.contiguous())

    def _topk(self, x: torch.Tensor, k: int, chained: bool, index: Optional[torch.Tensor]) -> tuple:
        """(TopK, the indices taken at index or None)."""
        if x.device != self.device or x.dtype not in _DTYPES or not 1 <= k <= min(TOPK_MAX, x.shape[-1]):
            raise ValueError(f"topk: k = {k} of {tuple(x.shape)} {x.dtype}")
        lead, columns = x.shape[:-1], x.shape[-1]
        rows = x if x.dim() == 2 else x.reshape(-1, columns)  # a view where the leading dims collapse
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < columns):
            rows = rows.contiguous()
        count = rows.shape[0]
        values = torch.empty(count, k, dtype=torch.float32, device=self.device)
        indices = torch.empty(count, k, dtype=torch.long, device=self.device)
        taken = None if index is None else torch.empty(index.shape, dtype=torch.long, device=self.device)
        parts = topk_parts(count, columns, k)
        chunk = -(-columns // parts)
        partial = torch.empty(count * parts * k if parts > 1 else 1, dtype=torch.long, device=self.device)
        self._launch_grid("sp_topk", f"sp_topk<{_DTYPES[x.dtype]}>", (count * parts,), THREADS, chained,
                          x=rows.data_ptr(), R=count, C=columns,
                          stride=rows.stride(0) if count > 1 else columns, k=k, S=parts, chunk=chunk,
                          values_out=values.data_ptr(), indices_out=indices.data_ptr(),
                          gather=_pointer(index), G=0 if index is None else index.numel(),
                          gathered=_pointer(taken), partial=partial.data_ptr(),
                          counters=self._topk_counters.data_ptr())
        return TopK(values.reshape(*lead, k), indices.reshape(*lead, k)), taken

    def ngram_lookup(self, history: torch.Tensor, length: torch.Tensor, max_n: int, k: int,
                     chained: bool = False, emitted: Optional[tuple] = None,
                     count: Optional[torch.Tensor] = None, table=None) -> tuple:
        """As engine.core.graphs.NgramLookup: history [M] int64, length [1] int64 (both on the device) ->
        (tokens [k] int64, count [1] int64), in one launch that reads nothing on the host. emitted: the last
        round's (chain [k], next token [1], accepted [1]), appended to history first and length moved on, in
        place (engine.core.graphs.append_emitted's twin). count: the [1] int64 tensor the count goes to.
        table: a CorpusTable on the device whose continuation fills the slots past the lookup's count
        (engine.core.graphs.corpus_fill's twin), or None."""
        tokens, count = self._ngram_outputs(history, length, max_n, k, emitted, count, table)
        self._ngram_launch(history, length, max_n, k, chained, emitted, tokens, count, table, None)
        return tokens, count

    def ngram_block(self, history: torch.Tensor, length: torch.Tensor, max_n: int, k: int, emitted: tuple,
                    count: torch.Tensor, start: torch.Tensor, embed: torch.Tensor, table=None,
                    chained: bool = False) -> tuple:
        """ngram_lookup with the last round's emitted tokens, then the block the round verifies, as
        chain_block makes it from them (chain_block_reference(next token, tokens, start, accepted, embed)),
        in the same launch: -> (tokens [k], (block tokens [k+1], block start [1], x [k+1, H]))."""
        if emitted is None:
            raise ValueError("ngram_block: the block needs the last round's emitted tokens")
        tokens, count = self._ngram_outputs(history, length, max_n, k, emitted, count, table)
        _check_longs(start)
        _check(embed)
        block = (torch.empty(k + 1, dtype=torch.long, device=self.device),
                 torch.empty(1, dtype=torch.long, device=self.device),
                 torch.empty(k + 1, embed.shape[1], dtype=embed.dtype, device=self.device))
        self._ngram_launch(history, length, max_n, k, chained, emitted, tokens, count, table,
                           (start, embed) + block)
        return tokens, block

    def _ngram_outputs(self, history, length, max_n: int, k: int, emitted, count, table) -> tuple:
        """sp_ngram_lookup's arguments checked; its (tokens [k], count [1]) outputs."""
        extra = () if emitted is None else tuple(emitted)
        if table is not None:
            extra += (table.chain, table.pair_keys, table.pair_tokens)
        for t in (history, length) + extra + (() if count is None else (count,)):
            if t.dtype != torch.long or not t.is_contiguous() or t.device != self.device:
                raise ValueError("ngram_lookup: history, length, emitted and count must be contiguous int64 "
                                 "on the device")
        if not (1 <= max_n <= NGRAM_MAX_N and 1 <= k <= THREADS and length.numel() == 1):
            raise ValueError(f"ngram_lookup: n = {max_n} (1..{NGRAM_MAX_N}), k = {k} (1..{THREADS})")
        if emitted is not None and [t.numel() for t in emitted] != [k, 1, 1]:
            raise ValueError(f"ngram_lookup: emitted must be a chain of {k}, a next token and a count")
        tokens = torch.empty(k, dtype=torch.long, device=self.device)
        if count is None:
            count = torch.empty(1, dtype=torch.long, device=self.device)
        return tokens, count

    def _ngram_launch(self, history, length, max_n: int, k: int, chained: bool, emitted, tokens, count, table,
                      block) -> None:
        """sp_ngram_lookup; block: (start, embed, block tokens, block start, x) or None."""
        draft, next_token, accepted = (None, None, None) if emitted is None else emitted
        start, embed, block_tokens, block_start, x = (None,) * 5 if block is None else block
        halves = 0 if embed is None else embed.shape[1] * embed.element_size() // 2
        self._launch_grid("sp_ngram_lookup", "sp_ngram_lookup", (1,), THREADS, chained,
                          history=history.data_ptr(), length=length.data_ptr(), M=history.numel(),
                          max_n=max_n, k=k, draft=_pointer(draft), next_token=_pointer(next_token),
                          accepted=_pointer(accepted), tokens_out=tokens.data_ptr(),
                          count_out=count.data_ptr(), **_table_arguments(table), start=_pointer(start),
                          embed=_pointer(embed), row_halves=halves, block_tokens=_pointer(block_tokens),
                          block_start=_pointer(block_start), x_out=_pointer(x))

    def chain_block(self, next_token, chain, start, accepted, embed, chained: bool = False) -> tuple:
        """As chain_block_reference: next_token, start, accepted [1] and chain [K] int64, embed [V, H] ->
        (tokens [K+1], start [1], x [K+1, H]) in one launch."""
        _check_longs(next_token, chain, start, accepted)
        _check(embed)
        k, h = chain.numel(), embed.shape[1]
        tokens = torch.empty(k + 1, dtype=torch.long, device=self.device)
        block_start = torch.empty(1, dtype=torch.long, device=self.device)
        x = torch.empty(k + 1, h, dtype=embed.dtype, device=self.device)
        self._launch("sp_chain_block", embed.dtype, (k + 1) * h, chained, next_token=next_token.data_ptr(),
                     chain=_pointer(chain), K=k, start=start.data_ptr(), accepted=accepted.data_ptr(),
                     embed=embed.data_ptr(), H=h, tokens_out=tokens.data_ptr(),
                     start_out=block_start.data_ptr(), x_out=x.data_ptr())
        return tokens, block_start, x

    def medusa_heads(self, x, norm_weight, eps: float, weight, bias, depth: int, accepted=None, path=None,
                     chained: bool = False) -> torch.Tensor:
        """As medusa_heads_reference, in one launch: x [M, H] bf16/fp16 with H % 8 == 0 and H <=
        MEDUSA_MAX_H, every tensor contiguous; -> [depth, M, H] (M = 1 with accepted and path)."""
        rows, hidden = x.shape
        if hidden % 8 or hidden > MEDUSA_MAX_H or tuple(weight.shape) != (depth * hidden, hidden):
            raise ValueError(f"medusa_heads: features {tuple(x.shape)}, weight {tuple(weight.shape)}")
        _check_aligned(x, weight, norm_weight)
        _check(x, weight, norm_weight, *(() if bias is None else (bias,)))
        if accepted is not None:
            _check_longs(accepted, path)
            rows = 1
        out = torch.empty(depth, rows, hidden, dtype=x.dtype, device=self.device)
        self._launch_grid("sp_medusa_heads", f"sp_medusa_heads<{_DTYPES[x.dtype]}>",
                          ((depth * hidden + 7) // 8, rows), THREADS, chained, x=x.data_ptr(), H=hidden,
                          accepted=_pointer(accepted), path=_pointer(path),
                          norm_weight=norm_weight.data_ptr(), eps=eps, weight=weight.data_ptr(),
                          bias=_pointer(bias), D=depth, M=rows, out=out.data_ptr())
        return out

    def takes_path(self, kv: torch.Tensor, path: torch.Tensor) -> bool:
        """Whether sp_keep_path moves this path in this cache: P <= KEEP_MAX, 16-byte rows."""
        row_bytes = kv.shape[-1] * kv.element_size()
        return (path.numel() <= KEEP_MAX and kv.is_cuda and kv.is_contiguous() and row_bytes % 16 == 0
                and kv.data_ptr() % 16 == 0)

    def keep_path(self, kv: torch.Tensor, start: torch.Tensor, path: torch.Tensor,
                  chained: bool = False) -> None:
        """As keep_path_reference, in one launch (takes_path says where): kv [..., max_len, D]."""
        _check_longs(start, path)
        if not self.takes_path(kv, path):
            raise ValueError(f"keep_path: a path of {path.numel()} in a cache {tuple(kv.shape)} {kv.dtype}")
        max_len, chunks = kv.shape[-2], kv.shape[-1] * kv.element_size() // 16
        planes = kv.numel() // (max_len * kv.shape[-1])
        grid = ((planes * chunks + THREADS - 1) // THREADS,)
        self._launch_grid("sp_keep_path", "sp_keep_path", grid, THREADS, chained, kv=kv.data_ptr(),
                          planes=planes, max_len=max_len, chunks=chunks, start=start.data_ptr(),
                          path=path.data_ptr(), P=path.numel())

    def chain_commit(self, accepted_in, next_in, chain, start_in, accepted, next_token, draft, start,
                     count=None, count_out=None, path_in=None, path=None, chained: bool = False) -> None:
        """As chain_commit_reference, in one launch (count_out: a float32 [1], with count)."""
        _check_longs(chain, start_in, accepted, next_token, draft, start,
                     *(() if count is None else (count,)), *(() if path_in is None else (path_in, path)))
        if path_in is not None and path_in.numel() != path.numel():
            raise ValueError(f"chain_commit: a path of {path_in.numel()} into {path.numel()}")
        for t in (accepted_in, next_in):
            if t.dtype != torch.long or t.device != self.device:
                raise ValueError("chain_commit: the result's accepted and next token must be int64")
        if count is not None and (count_out is None or count_out.dtype != torch.float32):
            raise ValueError("chain_commit: a count goes to a float32 count_out")
        self._launch_grid("sp_chain_commit", "sp_chain_commit", (1,), 32, chained,
                          accepted_in=accepted_in.data_ptr(), next_in=next_in.data_ptr(),
                          chain=_pointer(chain), K=chain.numel(), start_in=start_in.data_ptr(),
                          count=_pointer(count), accepted=accepted.data_ptr(),
                          next_token=next_token.data_ptr(), draft=_pointer(draft), start=start.data_ptr(),
                          count_out=_pointer(count_out), path_in=_pointer(path_in),
                          path=_pointer(path), P=0 if path_in is None else path_in.numel())

    def tree_level(self, top_values, top_indices, frontier_scores, frontier, width: int, count: int,
                   ancestors, node_depth, true_length, tokens_all, parents_all, scores_all,
                   chained: bool = False) -> tuple:
        """As tree_level_reference (top_values float32, ancestors bool, the rest int64 or float32 as there,
        contiguous, on this device; at most TREE_MAX candidates and nodes)."""
        rows, branch = top_values.shape
        total = ancestors.shape[0]
        if (rows * branch > TREE_MAX or total > TREE_MAX or not 1 <= width <= rows * branch
                or count + width > total or tuple(ancestors.shape) != (total, total)):
            raise ValueError(f"tree_level: {rows} x {branch} candidates, {width} kept at {count} of {total}")
        _check_longs(top_indices, frontier, node_depth, true_length, tokens_all, parents_all)
        _check_floats(top_values, frontier_scores, scores_all)
        if ancestors.dtype != torch.bool or not ancestors.is_contiguous():
            raise ValueError("tree_level: ancestors must be a contiguous bool tensor")
        local_parent, positions, frontier_out = (torch.empty(width, dtype=torch.long, device=self.device)
                                                 for _ in range(3))
        frontier_scores_out = torch.empty(width, dtype=torch.float32, device=self.device)
        self._launch_grid("sp_tree_level", "sp_tree_level", (1,), 64, chained,
                          top_values=top_values.data_ptr(), top_indices=top_indices.data_ptr(),
                          frontier_scores=frontier_scores.data_ptr(), frontier=frontier.data_ptr(), F=rows,
                          B=branch, W=width, count=count, T=total, ancestors=ancestors.data_ptr(),
                          node_depth=node_depth.data_ptr(), true_length=true_length.data_ptr(),
                          tokens_all=tokens_all.data_ptr(), parents_all=parents_all.data_ptr(),
                          scores_all=scores_all.data_ptr(), local_parent=local_parent.data_ptr(),
                          positions=positions.data_ptr(), frontier_out=frontier_out.data_ptr(),
                          frontier_scores_out=frontier_scores_out.data_ptr())
        return local_parent, positions, frontier_out, frontier_scores_out

    def tree_choose(self, tokens_all, parents_all, scores_all, node_depth, ancestors, nodes: int,
                    tie_break: float, chained: bool = False) -> tuple:
        """As tree_choose_reference (at most TREE_MAX candidates)."""
        total = tokens_all.numel()
        if total > TREE_MAX or not 1 <= nodes <= total or tuple(ancestors.shape) != (total, total):
            raise ValueError(f"tree_choose: {nodes} of {total} candidates")
        _check_longs(tokens_all, parents_all, node_depth)
        _check_floats(scores_all)
        if ancestors.dtype != torch.bool or not ancestors.is_contiguous():
            raise ValueError("tree_choose: ancestors must be a contiguous bool tensor")
        tokens, parents = (torch.empty(nodes, dtype=torch.long, device=self.device) for _ in range(2))
        depth = torch.empty(nodes + 1, dtype=torch.long, device=self.device)
        visible = torch.empty(nodes + 1, nodes + 1, dtype=torch.bool, device=self.device)
        self._launch_grid("sp_tree_choose", "sp_tree_choose", (1,), 64, chained,
                          tokens_all=tokens_all.data_ptr(), parents_all=parents_all.data_ptr(),
                          scores_all=scores_all.data_ptr(), node_depth=node_depth.data_ptr(),
                          ancestors=ancestors.data_ptr(), T=total, N=nodes, tie_break=tie_break,
                          tokens_out=tokens.data_ptr(), parents_out=parents.data_ptr(),
                          depth_out=depth.data_ptr(), visible_out=visible.data_ptr())
        return tokens, parents, depth, visible

    def attention(self, q, k_cache, v_cache, start, visible, chained: bool = False,
                  splits: Optional[int] = None, wide: bool = False) -> torch.Tensor:
        """As attention_reference with start a device tensor int64: [1] for one sequence's caches
        [kv_heads, cache_len, D], [B] for B sequences' caches [B, kv_heads, cache_len, D] (q [heads,
        B * block_n, D], visible [block_n, block_n]). Returns [n, heads * D]. splits: blocks per (token,
        head), by default attention_splits(B, heads); wide: an unsplit launch takes sp_attention_wide where
        it is built for the shape. A row's bits depend on these two, and on nothing else."""
        heads, n, d = q.shape
        kv_heads, cache_len = k_cache.shape[-3], k_cache.shape[-2]
        seqs = k_cache.shape[0] if k_cache.dim() == 4 else 1
        block_n = visible.shape[0]
        if (d % 8 or d > ATTENTION_MAX_D or heads % kv_heads or tuple(visible.shape) != (block_n, block_n)
                or block_n * seqs != n or tuple(v_cache.shape) != tuple(k_cache.shape)):
            raise ValueError(f"attention: head dim {d}, heads {heads}/{kv_heads}, visible "
                             f"{tuple(visible.shape)} for {n} tokens of {seqs} sequence(s)")
        _check_aligned(q, k_cache, v_cache)
        if start.dtype != torch.long or start.numel() != seqs or not visible.is_contiguous():
            raise ValueError(f"attention: start must be {seqs} int64 value(s) and visible contiguous")
        out = torch.empty(n, heads * d, dtype=q.dtype, device=q.device)
        if splits is None:
            splits = attention_splits(seqs, heads)
        if not 1 <= splits <= ATTENTION_SPLITS:
            raise ValueError(f"attention: {splits} splits (1 to {ATTENTION_SPLITS})")
        if n * heads > ATTENTION_PAIRS:
            splits = 1
        args = dict(q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                    start=start.data_ptr(), visible=visible.data_ptr(), out=out.data_ptr(), n=n, heads=heads,
                    kv_heads=kv_heads, D=d, cache_len=cache_len, scale=1.0 / math.sqrt(d), block_n=block_n,
                    seq_stride=kv_heads * cache_len * d if seqs > 1 else 0)
        if splits == 1 and wide and self.wide_fits(heads, kv_heads, d):  # a tile of rows on the whole block
            instance = f"sp_attention_wide<{_DTYPES[q.dtype]}, {heads // kv_heads}>"
            self._launch_grid("sp_attention_wide", instance, (n * kv_heads,), 32 * ATTENTION_WIDE_WARPS,
                              chained, **args)
            return out
        if splits == 1 and self._groups(heads, kv_heads, d):  # one block per kv head: rows read once
            instance = f"sp_attention_grouped<{_DTYPES[q.dtype]}, {heads // kv_heads}>"
            self._launch_grid("sp_attention_grouped", instance, (n * kv_heads,), ATTENTION_THREADS, chained,
                              **args)
            return out
        pairs = n * heads
        partial = torch.empty(pairs * splits * (d + 2) if splits > 1 else 1, dtype=torch.float32,
                              device=q.device)  # [pairs * splits, D + 2]: each split's softmax state
        self._launch_grid("sp_attention", f"sp_attention<{_DTYPES[q.dtype]}>", (pairs * splits,),
                          ATTENTION_THREADS, chained, partial=partial.data_ptr(),
                          counters=self._attention_counters.data_ptr(), splits=splits, **args)
        return out


def _function_pointer(kernel) -> int:
    """The CUfunction of a CuPy RawKernel (its compiled Function's handle); 0 if CuPy hides it (the
    programmatic launcher then refuses it and CuPy launches)."""
    function = getattr(kernel, "kernel", kernel)
    return int(getattr(function, "ptr", 0) or 0)


def attention_splits(seqs: int, heads: int) -> int:
    """Blocks per (token, head) for `seqs` sequences of `heads` heads: up to ATTENTION_SPLITS, enough for
    one token's ATTENTION_SPLIT_PAIRS blocks."""
    return max(1, min(ATTENTION_SPLITS, ATTENTION_SPLIT_PAIRS // (seqs * heads)))


def gemv_fits(weight: torch.Tensor, rows: int = 1) -> bool:
    """Whether sp_gemv can multiply `rows` rows by this weight [N, K]: bf16/fp16, contiguous, K % 8 == 0,
    16-byte aligned, rows * K <= GEMV_STAGE."""
    return (weight.dtype in HALF_DTYPES and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] % 8 == 0 and weight.data_ptr() % 16 == 0
            and 1 <= rows <= GEMV_MAX_ROWS and rows * weight.shape[1] <= GEMV_STAGE)


def _pointer(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_aligned(*tensors: torch.Tensor) -> None:
    """The decode kernels read 16 bytes at a time: one half dtype, contiguous, 16-byte aligned rows."""
    dtype = tensors[0].dtype
    for t in tensors:
        if (t.dtype != dtype or dtype not in HALF_DTYPES or not t.is_contiguous() or t.data_ptr() % 16
                or t.shape[-1] % 8):
            raise ValueError(f"decode kernels need contiguous, 16-byte aligned {dtype} tensors whose rows "
                             f"are a multiple of 8 (got {t.dtype} {tuple(t.shape)})")


def _check_longs(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.long or not t.is_contiguous() or (t.numel() and not t.is_cuda):
            raise ValueError(f"round kernels need contiguous int64 tensors on the device (got {t.dtype})")


def _check_floats(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"round kernels need contiguous float32 tensors on the device (got {t.dtype})")


def _check(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if not t.is_contiguous() or t.dtype != dtype or t.dtype not in _DTYPES:
            raise ValueError(f"step kernels need contiguous {dtype} tensors (got {t.dtype}, "
                             f"contiguous={t.is_contiguous()})")


def source_specs() -> dict:
    """The kernels as the .cu sources declare them (for the signature test)."""
    return parse_kernels(module_source())


def _source_names_options():
    """(source, instance names, options) as the module is compiled (for an offline NVRTC check)."""
    return module_source(), instance_names(), COMPILE_OPTIONS


def _table_arguments(table) -> dict:
    """sp_ngram_lookup's corpus-table arguments (NULL pointers: no table)."""
    if table is None:
        return dict(chain=0, pair_keys=0, pair_tokens=0, pairs=0, width=0, vocab=0)
    return dict(chain=table.chain.data_ptr(), pair_keys=table.pair_keys.data_ptr(),
                pair_tokens=table.pair_tokens.data_ptr(), pairs=table.pair_keys.numel(), width=table.width,
                vocab=table.vocab)
