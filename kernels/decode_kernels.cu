// specplay: decode kernels for short blocks (loaded by kernels/step.py after cuda_common.cuh and step_kernels.cu).
//
// A decode step reads every weight once for a handful of rows (one token, or a verification block of K + 1).
// cuBLAS reaches about 57% of the memory bandwidth on a 1B-shape layer at such sizes, and each small kernel
// between the matrix products costs a few microseconds; these kernels fuse the small work into the products:
//   sp_gemv       out = in @ W^T (+ bias) (+ residual) for up to 16 rows, `in` being x, RMSNorm(x) * w or
//                 SiLU(gate) * up, staged in shared memory by the block that reads the weights
//   sp_gemv_tc    the same on the tensor cores, for weights with short rows (kernels/step.py picks by K)
//   sp_attention  softmax(q k^T / sqrt(D)) v of a block of queries over the cache and the block's own rows
//                 (a chain's causal rows or a tree's ancestors), written in the layout o_proj reads
//   sp_ngram_lookup  n-gram prompt lookup over the committed tokens on the device (n-gram's round graph)
// Twins in kernels/step.py (gemv_reference, attention_reference) and engine/round_graph.py (NgramLookup); fuzz
// tests in tests/test_step_kernels_gpu.py.
//
// Batch invariance: every output is reduced in an order fixed by its own row, never by how many rows the block
// holds, so a verification block's logits equal, bit for bit, those of the same tokens decoded one at a time.
// That is what lets bf16 speculative decoding reproduce bf16 plain decoding token for token.

#define SP_FULL_MASK 0xffffffffu
#define SP_GEMV_WARPS 8      // output rows per block, one per warp
#ifndef SP_GEMV_TILE
#define SP_GEMV_TILE 2048  // columns of a row segment: 8 chunks of 8 values per lane (kernels/step.py passes its own)
#endif
#define SP_GEMV_MAX_ROWS 16
#ifndef SP_GEMV_BLOCKS
#define SP_GEMV_BLOCKS 2  // resident blocks per SM sp_gemv is built for (kernels/step.py passes its own)
#endif
#define SP_ATTN_WARPS 8
#define SP_ATTN_MAX_D 256
#ifndef SP_ATTN_AHEAD
#define SP_ATTN_AHEAD 16  // 16-byte loads a lane issues before it uses them in the attention loops (kernels/step.py)
#endif
#ifndef SP_ATTN_GROUPED_BLOCKS
#define SP_ATTN_GROUPED_BLOCKS 4  // resident blocks per SM sp_attention_grouped is built for (kernels/step.py)
#endif
#define SP_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float dk_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SP_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float dk_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SP_FULL_MASK, v, o));
    return v;
}

// Weights are read once per step: keep them out of L1.
__device__ __forceinline__ uint4 dk_load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float dk_half_to_f(u32 bits) {
    float f;
    unsigned short h = (unsigned short)(bits & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void dk_unpack2(u32 w, float* f, bf16_t) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void dk_unpack2(u32 w, float* f, f16_t) {
    f[0] = dk_half_to_f(w);
    f[1] = dk_half_to_f(w >> 16);
}

// 8 values of T packed in a uint4 -> 8 floats
template <typename T>
__device__ __forceinline__ void dk_unpack8(const uint4& u, float* f) {
    dk_unpack2(u.x, f, T());
    dk_unpack2(u.y, f + 2, T());
    dk_unpack2(u.z, f + 4, T());
    dk_unpack2(u.w, f + 6, T());
}

template <typename T>
__device__ __forceinline__ u32 dk_pack2(float a, float b) {
    return (u32)from_f<T>(a).v | ((u32)from_f<T>(b).v << 16);
}

// 8 floats (already representable in T) -> a uint4 of T
template <typename T>
__device__ __forceinline__ uint4 dk_pack8(const float* f) {
    uint4 u;
    u.x = dk_pack2<T>(f[0], f[1]);
    u.y = dk_pack2<T>(f[2], f[3]);
    u.z = dk_pack2<T>(f[4], f[5]);
    u.w = dk_pack2<T>(f[6], f[7]);
    return u;
}

// out[m, n] = sum_k in[m, k] * weight[n, k], m < M, n < N, as the eager step's F.linear / torch.addmm:
//   mode 0: in = x                                          x [M, x_stride], the first K columns
//   mode 1: in = rnd(norm_weight * rnd(x * rsqrt(mean(x^2) + eps)))   (RMSNorm as transformers computes it)
//   mode 2: in = rnd(rnd(silu(gate)) * up), gate | up = x   x [M, x_stride], x_stride >= 2 K
//   mode 3: in = [x | embed[tokens]]: row m's first K/2 columns from x [M, x_stride], the rest from row
//           tokens[m] of embed [V, K/2] (EAGLE's fusion of a feature with the next token's embedding; K % 16 == 0)
// prefetch_bytes: see dk_gemv_prefetch.
// Epilogue: bias (if not NULL) is added and rounded like F.linear's; residual [M, N] (if not NULL) is added like
// addmm (one rounding) or, after a bias, to the rounded linear.  out [M, N] is T, or float when out_f32 (the
// T-rounded value, as `.float()` of a T tensor).
// SiLU pairs (pair_rows > 0, sp_gemv only, no residual): weight [2 N, K] is gate | up (pair_rows = N), and
// out[m, j] = rnd(rnd(silu(gate_j)) * up_j) of the two rows' outputs, each rounded as above: the down
// product's mode 2 input, made once here instead of by every block of the down product, bit for bit.
// Each block stages `in` [M, K] once in shared memory (M * K <= SP_GEMV_STAGE values), then its warps walk
// output rows (warp w of block b takes rows b * 8 + w, then every 8 * gridDim.x further; giving each block a
// contiguous, even share of the rows instead measured no faster on an H200: docs/measurements/
// gemv_probe_first.txt).  A row is read in
// segments of 2048 columns, 8 chunks of 16 bytes per lane, and the next segment's loads are issued before the
// current one is multiplied (two register buffers), so loads stay in flight while the block computes; the
// first segment's loads go out before the statistics and the staging.  A lane's chunks come in the same order
// whatever the grid, and the warp's reduction is a fixed butterfly: row m's result depends on row m alone.
// K % 8 == 0, weight rows and x rows 16-byte aligned.
#define SP_GEMV_STAGE 20480  // values of T staged per block: 40 KB

template <typename T>
__device__ __forceinline__ void dk_gemv_load(uint4* w, const T* weight, int K, int row, int seg, int lane) {
    const uint4* p = reinterpret_cast<const uint4*>(weight + (long long)row * K) + seg * (SP_GEMV_TILE / 8);
    int left = K / 8 - seg * (SP_GEMV_TILE / 8);
#pragma unroll
    for (int j = 0; j < SP_GEMV_TILE / 256; j++) {
        int c = lane + 32 * j;
        if (c < left) w[j] = dk_load_stream(p + c);
    }
}

// While the previous kernel finishes (programmatic launch), the warp's weights after its first segment, up to
// `bytes` of its rows row, row + stride, ..., are pulled into L2.  Weights never change during a step, so this
// needs no wait.  (Launched the usual way, the kernel starts after its predecessor and prefetching only adds
// traffic: the host passes 0 then.)
template <typename T>
__device__ __forceinline__ void dk_gemv_prefetch(const T* weight, int K, int N, int row, int stride, int lane,
                                                 int bytes) {
    long long row_bytes = (long long)K * sizeof(T), first = SP_GEMV_TILE * sizeof(T);
    for (long long off = first + lane * 128LL; off < first + bytes; off += 32 * 128) {
        int r = row + (int)(off / row_bytes) * stride;
        if (r >= N) break;
        const char* p = reinterpret_cast<const char*>(weight + (long long)r * K) + off % row_bytes;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

template <typename T, int M>
__device__ __forceinline__ void dk_gemv_fma(const uint4* w, const uint4* staged, int K, int seg, int lane,
                                            float* acc) {
    int chunks = K / 8, base = seg * (SP_GEMV_TILE / 8);
#pragma unroll
    for (int j = 0; j < SP_GEMV_TILE / 256; j++) {
        int c = base + lane + 32 * j;
        if (c < chunks) {
            float wf[8];
            dk_unpack8<T>(w[j], wf);
#pragma unroll
            for (int m = 0; m < M; m++) {
                float f[8];
                dk_unpack8<T>(staged[m * chunks + c], f);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[m] = fmaf(wf[e], f[e], acc[m]);
            }
        }
    }
}

// Rows of a verification block reduce their sums together: the M sums (padded to P, a
// power of two) halve at each of the butterfly's first log2(P) steps, each lane keeping half and sending
// its partner the other half, so a warp shuffles P - 1 + 5 - log2(P) times, not 5 M. Every sum still adds
// the same pairs in the same order as dk_warp_sum's butterfly (lane L: its own partial + lane L ^ o's), so
// each row's bits are those of the one-row kernel. Row m ends on lanes m << SHIFT .. (m << SHIFT) + 2^SHIFT - 1.
template <int M>
struct dk_rows {
    static constexpr int P = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : M <= 8 ? 8 : 16;
    static constexpr int SHIFT = P == 1 ? 0 : P == 2 ? 4 : P == 4 ? 3 : P == 8 ? 2 : 1;
};

template <int M>
__device__ __forceinline__ float dk_reduce_rows(const float* acc, int lane) {
    constexpr int P = dk_rows<M>::P;
    float v[P];  // the padding's zeros are constants, not registers
#pragma unroll
    for (int m = 0; m < P; m++) v[m] = m < M ? acc[m] : 0.f;
    int count = P;  // sums left on this lane
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (count > 1) {
            int half = count >> 1;
            bool upper = (lane & o) != 0;  // keeps the upper half of the sums it holds
#pragma unroll
            for (int j = 0; j < P / 2; j++) {
                if (j < half) {
                    float send = upper ? v[j] : v[half + j];
                    float keep = upper ? v[half + j] : v[j];
                    v[j] = keep + __shfl_xor_sync(SP_FULL_MASK, send, o);
                }
            }
            count = half;
        } else {
            v[0] += __shfl_xor_sync(SP_FULL_MASK, v[0], o);
        }
    }
    return v[0];
}

// A row's epilogue inputs, read one work item before its store so that the store does not wait on memory:
// the lane that stores output row m (see dk_gemv_item) takes its residual and the row's bias (as floats; 0
// where absent).
template <typename T>
__device__ __forceinline__ void dk_gemv_preload(const T* bias, const T* residual, int row, int N, int m,
                                                bool storer, float* res, float* bias_f) {
    if (storer) {
        *bias_f = bias != nullptr ? to_f(bias[row]) : 0.f;
        *res = residual != nullptr ? to_f(residual[(long long)m * N + row]) : 0.f;
    }
}

// The warp's sums: a fixed butterfly per row (every lane ends with all M, lane m holds output row m), or
// dk_reduce_rows's (scatter: output row m = lane >> shift). The same bits either way. Zeroes acc.
template <int M>
__device__ __forceinline__ float dk_gemv_sum(float* acc, int lane, bool scatter) {
    float v = 0.f;
    if (scatter) {
        v = dk_reduce_rows<M>(acc, lane);
    } else {
#pragma unroll
        for (int m = 0; m < M; m++) {
            float t = dk_warp_sum(acc[m]);
            if (m == lane) v = t;
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    return v;
}

// A row's output as F.linear / torch.addmm round it: the sum v, its bias, its residual.
template <typename T>
__device__ __forceinline__ T dk_gemv_out(float v, bool has_bias, bool has_residual, float res, float bias_f) {
    if (has_bias) {
        v += bias_f;
        if (has_residual) v = to_f(rnd<T>(v));
    }
    if (has_residual) v += res;
    return rnd<T>(v);
}

// SiLU(gate) * up of a gate and an up output (as T), rounded as sp_silu_mul and sp_gemv's mode 2 round it.
template <typename T>
__device__ __forceinline__ T dk_silu_mul(float gate, float up) {
    float silu = to_f(rnd<T>(gate / (1.0f + expf(-gate))));
    return rnd<T>(silu * up);
}

template <typename T>
__device__ __forceinline__ void dk_gemv_put(T r, int m_out, int row, void* out, int N, int out_f32) {
    if (out_f32) reinterpret_cast<float*>(out)[(long long)m_out * N + row] = to_f(r);
    else reinterpret_cast<T*>(out)[(long long)m_out * N + row] = r;
}

// The warp's state between work items (row, half, segment): the accumulators, the epilogue inputs of the row
// being multiplied and of the next one, and (SiLU pairs) the pair's gate output.
template <int M>
struct dk_gemv_walk {
    float acc[M];
    float res, bias_f, res_next, bias_next, gate;
    int row, half, seg, m_out;
    bool storer;
};

// One work item: the next item's loads (and, when it starts a row, that row's residual and bias) go into
// `next` while the item in `now` is multiplied; a row's last segment stores it. With pair_rows (> 0) output
// row j is SiLU(gate) * up of weight rows j (half 0) and pair_rows + j (half 1), each summed as a row alone.
// Returns false past the warp's last row. (Called with the two buffers in turn, so that each call's
// registers are fixed.)
template <typename T, int M>
__device__ __forceinline__ bool dk_gemv_item(dk_gemv_walk<M>& s, const uint4* now, uint4* next,
                                             const uint4* staged, const T* weight, const T* bias,
                                             const T* residual, void* out, int K, int N, int segs, int stride,
                                             int lane, bool scatter, int out_f32, int pair_rows) {
    bool row_done = s.seg + 1 == segs, to_up = row_done && pair_rows > 0 && s.half == 0;
    int next_row = row_done && !to_up ? s.row + stride : s.row;
    int next_half = row_done ? (to_up ? 1 : 0) : s.half, next_seg = row_done ? 0 : s.seg + 1;
    if (next_row < N) {
        int weight_row = next_row + next_half * pair_rows;
        dk_gemv_load<T>(next, weight, K, weight_row, next_seg, lane);
        if (next_seg == 0) dk_gemv_preload<T>(bias, residual, weight_row, N, s.m_out, s.storer, &s.res_next,
                                              &s.bias_next);
    }
    dk_gemv_fma<T, M>(now, staged, K, s.seg, lane, s.acc);
    if (row_done) {
        float v = dk_gemv_sum<M>(s.acc, lane, scatter);
        if (s.storer) {
            T r = dk_gemv_out<T>(v, bias != nullptr, residual != nullptr, s.res, s.bias_f);
            if (to_up) s.gate = to_f(r);
            else dk_gemv_put<T>(pair_rows > 0 ? dk_silu_mul<T>(s.gate, to_f(r)) : r, s.m_out, s.row, out, N,
                                out_f32);
        }
        s.res = s.res_next;
        s.bias_f = s.bias_next;
    }
    s.row = next_row;
    s.half = next_half;
    s.seg = next_seg;
    return s.row < N;
}

// The warp's work items in order, from its first row (whose first segment's loads are in wa).
template <typename T, int M>
__device__ __forceinline__ void dk_gemv_rows(const uint4* staged, uint4* wa, uint4* wb, const T* weight,
                                             const T* bias, const T* residual, void* out, int K, int N,
                                             int row, int stride, int lane, bool scatter, int out_f32,
                                             int pair_rows) {
    int segs = (K + SP_GEMV_TILE - 1) / SP_GEMV_TILE;
    dk_gemv_walk<M> s;
#pragma unroll
    for (int m = 0; m < M; m++) s.acc[m] = 0.f;
    s.res = s.bias_f = s.res_next = s.bias_next = s.gate = 0.f;
    s.row = row;
    s.half = 0;
    s.seg = 0;
    s.m_out = scatter ? lane >> dk_rows<M>::SHIFT : lane;  // the output row this lane stores
    s.storer = s.m_out < M && (!scatter || (lane & ((1 << dk_rows<M>::SHIFT) - 1)) == 0);
    dk_gemv_preload<T>(bias, residual, row, N, s.m_out, s.storer, &s.res, &s.bias_f);
    while (dk_gemv_item<T, M>(s, wa, wb, staged, weight, bias, residual, out, K, N, segs, stride, lane,
                                   scatter, out_f32, pair_rows) &&
           dk_gemv_item<T, M>(s, wb, wa, staged, weight, bias, residual, out, K, N, segs, stride, lane,
                                   scatter, out_f32, pair_rows)) {
    }
}

// ---- sp_gemv_tc: sp_gemv on the tensor cores (sm_80 on) ----
// The block's M rows are the 16 rows of an m16n8k16 product's A (rows from M on are zeros), and 8 weight rows
// (a "unit", rows 8u .. 8u + 7) its 8 columns, so every M up to 16 costs one product per 16 k. Lane (g, t)
// (g = lane / 4, t = lane % 4) loads 16 bytes of weight row 8u + g at k = 32 kb + 8 t .. + 7 and the same
// columns of staged rows g and g + 8; a dot product may take its k in any order as long as both operands take
// the same, so those 8 values fill the fragment slots of t (k 2t, 2t + 1, 2t + 8, 2t + 9) of two products.
// The 8 warps of a block split a unit's k-blocks (warp w takes kb = w, w + 8, ...) and their sums are added in
// warp order through shared memory. Which rows a block holds changes no product's output for another row (the
// tensor cores reduce each output on its own) and nothing in the k order or the warp split depends on M, so
// row m's result depends on row m alone, as in the scalar kernel: one-token steps and verification blocks
// give the same bits. Weights are loaded 8 k-blocks a batch, the next batch (or the next unit's first)
// issued before the current one is multiplied.
// d += a b for one m16n8k16 product of T (bf16 or f16) with fp32 sums; the two differ in the type's name only.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DK_MMA(type)                                                                                          \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "   \
        "{%8, %9}, {%0, %1, %2, %3};"                                                                         \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                      \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
#else
#define DK_MMA(type)
#endif
__device__ __forceinline__ void dk_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, bf16_t) {
    DK_MMA("bf16");
}
__device__ __forceinline__ void dk_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, f16_t) {
    DK_MMA("f16");
}

// Batches of 8 k-blocks a warp walks in each unit (at least 1: a warp without k-blocks still meets the
// block's reduction).
__device__ __forceinline__ int dk_tc_batches(int K, int warp) {
    int kbs = (K + 31) / 32;
    int mine = warp < kbs ? (kbs - warp + SP_GEMV_WARPS - 1) / SP_GEMV_WARPS : 0;
    return max(1, (mine + 7) / 8);
}

template <typename T>
__device__ __forceinline__ void dk_tc_load(uint4* w, const T* weight, int K, int N, int unit, int batch,
                                           int warp, int lane) {
    int row = unit * 8 + (lane >> 2), t = lane & 3, chunks = K / 8;
    const uint4* p = reinterpret_cast<const uint4*>(weight + (long long)row * K);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = (warp + SP_GEMV_WARPS * (8 * batch + j)) * 4 + t;
        w[j] = row < N && c < chunks ? dk_load_stream(p + c) : make_uint4(0u, 0u, 0u, 0u);
    }
}

template <typename T, int M>
__device__ __forceinline__ void dk_tc_fma(const uint4* w, const uint4* staged, int K, int batch, int warp,
                                          int lane, float* d) {
    int g = lane >> 2, t = lane & 3, chunks = K / 8, kbs = (K + 31) / 32;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int kb = warp + SP_GEMV_WARPS * (8 * batch + j);
        if (kb >= kbs) break;  // the same for the whole warp
        int c = kb * 4 + t;
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;  // staged rows g and g + 8
        if (c < chunks) {
            if (g < M) lo = staged[g * chunks + c];
            if (M > 8 && g + 8 < M) hi = staged[(g + 8) * chunks + c];
        }
        dk_mma(d, lo.x, hi.x, lo.y, hi.y, w[j].x, w[j].y, T());
        dk_mma(d, lo.z, hi.z, lo.w, hi.w, w[j].z, w[j].w, T());
    }
}

// Fragment values a lane reduces through shared memory (rows g + 8 exist only past 8 rows), and how many
// reduction buffers fit beside the staging (48 KB of static shared memory: two buffers, one barrier a unit, up
// to 8 rows; one buffer and a second barrier past them).
template <int M>
struct dk_tc_red {
    static constexpr int V = M <= 8 ? 2 : 4;
    static constexpr int BUFS = M <= 8 ? 2 : 1;
};

// The unit's sums, warp by warp in order, and its outputs: thread e < 32 V takes the fragment value e % V of
// lane e / V, i.e. output row m = g + 8 (e % V / 2) and weight row 8 unit + 2 t + e % 2. The epilogue is the
// scalar kernel's (dk_gemv_out): bias rounded like F.linear's, the residual added like addmm.
template <typename T, int M>
__device__ __forceinline__ void dk_tc_store(float* d, float (*red)[32 * dk_tc_red<M>::V], int unit,
                                            const T* bias, const T* residual, void* out, int N, int warp,
                                            int lane, int out_f32) {
    constexpr int V = dk_tc_red<M>::V;
    int e = threadIdx.x, el = e / V, i = e % V;
    int m = (el >> 2) + 8 * (i >> 1), n = unit * 8 + 2 * (el & 3) + (i & 1);
    bool storer = e < 32 * V && m < M && n < N;
    float res = 0.f, bias_f = 0.f;
    if (storer) {
        if (bias != nullptr) bias_f = to_f(bias[n]);
        if (residual != nullptr) res = to_f(residual[(long long)m * N + n]);
    }
#pragma unroll
    for (int k = 0; k < V; k++) red[warp][lane * V + k] = d[k];
    __syncthreads();
    if (storer) {
        float v = red[0][e];
#pragma unroll
        for (int w = 1; w < SP_GEMV_WARPS; w++) v += red[w][e];
        dk_gemv_put<T>(dk_gemv_out<T>(v, bias != nullptr, residual != nullptr, res, bias_f), m, n, out, N,
                       out_f32);
    }
    if (dk_tc_red<M>::BUFS == 1) __syncthreads();  // the buffer is written again for the next unit
#pragma unroll
    for (int k = 0; k < 4; k++) d[k] = 0.f;
}

struct dk_tc_walk {
    float d[4];
    int unit, batch, parity;
};

// One batch: the next batch's loads into `next`, this one's products; a unit's last batch reduces and stores
// it (through red's buffers in turn). Returns false past the last unit.
template <typename T, int M>
__device__ __forceinline__ bool dk_tc_item(dk_tc_walk& s, const uint4* now, uint4* next, const uint4* staged,
                                           float (*red)[SP_GEMV_WARPS][32 * dk_tc_red<M>::V], const T* weight,
                                           const T* bias, const T* residual, void* out, int K, int N,
                                           int batches, int warp, int lane, int out_f32) {
    int units = (N + 7) / 8;
    bool last = s.batch == batches - 1;
    int next_unit = last ? s.unit + gridDim.x : s.unit, next_batch = last ? 0 : s.batch + 1;
    if (next_unit < units) dk_tc_load<T>(next, weight, K, N, next_unit, next_batch, warp, lane);
    dk_tc_fma<T, M>(now, staged, K, s.batch, warp, lane, s.d);
    if (last) {
        dk_tc_store<T, M>(s.d, red[s.parity], s.unit, bias, residual, out, N, warp, lane, out_f32);
        s.parity = (s.parity + 1) % dk_tc_red<M>::BUFS;
    }
    s.unit = next_unit;
    s.batch = next_batch;
    return s.unit < units;
}

template <typename T, int M>
__device__ __forceinline__ void dk_tc_units(const uint4* staged,
                                            float (*red)[SP_GEMV_WARPS][32 * dk_tc_red<M>::V], uint4* wa,
                                            uint4* wb, const T* weight, const T* bias, const T* residual,
                                            void* out, int K, int N, int warp, int lane, int out_f32) {
    if (blockIdx.x >= (N + 7) / 8) return;  // (the whole block: the grid has at most one block a unit)
    int batches = dk_tc_batches(K, warp);
    dk_tc_walk s;
#pragma unroll
    for (int k = 0; k < 4; k++) s.d[k] = 0.f;
    s.unit = blockIdx.x;
    s.batch = 0;
    s.parity = 0;
    while (dk_tc_item<T, M>(s, wa, wb, staged, red, weight, bias, residual, out, K, N, batches, warp, lane,
                            out_f32) &&
           dk_tc_item<T, M>(s, wb, wa, staged, red, weight, bias, residual, out, K, N, batches, warp, lane,
                            out_f32)) {
    }
}

// Stages `in` [M, K] (see sp_gemv's modes) in shared memory, every thread of the block taking part. A thread
// issues SP_STAGE_AHEAD chunks' loads before it uses any (one dependent load at a time, staging a K of 14,336
// was a chain of 7 round trips to L2); each value is computed as before, in the same order.
#define SP_STAGE_AHEAD 4

// The chunk `idx` of `in` [M, chunks] as loaded: x's (mode 3: the feature's or its embedding's), and the
// norm weight's (mode 1) or up's (mode 2) beside it.
template <typename T>
__device__ __forceinline__ void dk_stage_load(uint4& raw, uint4& aux, int idx, int chunks, int vec_stride,
                                              int mode, const uint4* xv, const uint4* norm_v,
                                              const uint4* embed_v, const long long* tokens) {
    int m = idx / chunks, c = idx - m * chunks;
    if (mode == 3) {  // a feature's chunks, then its next token's embedding's
        int half = chunks / 2;
        raw = c < half ? xv[m * vec_stride + c] : embed_v[tokens[m] * half + (c - half)];
        return;
    }
    raw = xv[m * vec_stride + c];
    if (mode == 1) aux = norm_v[c];
    else if (mode == 2) aux = xv[m * vec_stride + chunks + c];  // up
}

template <typename T, int M>
__device__ __forceinline__ void dk_gemv_stage(uint4* staged, float (*partial)[M], float* row_scale, const T* x,
                                              const T* norm_weight, int K, int x_stride, int mode, float eps,
                                              const T* embed, const long long* tokens) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int chunks = K / 8, vec_stride = x_stride / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    if (mode == 1) {  // RMSNorm statistics over the whole row, in fp32
        float ss[M];
#pragma unroll
        for (int m = 0; m < M; m++) ss[m] = 0.f;
        constexpr int AHEAD = M >= SP_STAGE_AHEAD ? 1 : SP_STAGE_AHEAD / M;  // M * AHEAD chunks in registers
        for (int base = tid; base < chunks; base += AHEAD * blockDim.x) {
            uint4 raw[AHEAD][M];
#pragma unroll
            for (int u = 0; u < AHEAD; u++) {
                int c = base + u * blockDim.x;
#pragma unroll
                for (int m = 0; m < M; m++)
                    if (c < chunks) raw[u][m] = xv[m * vec_stride + c];
            }
#pragma unroll
            for (int u = 0; u < AHEAD; u++) {
                if (base + u * blockDim.x >= chunks) break;
#pragma unroll
                for (int m = 0; m < M; m++) {
                    float f[8];
                    dk_unpack8<T>(raw[u][m], f);
#pragma unroll
                    for (int j = 0; j < 8; j++) ss[m] = fmaf(f[j], f[j], ss[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            float t = dk_warp_sum(ss[m]);
            if (lane == 0) partial[warp][m] = t;
        }
        __syncthreads();
        if (tid < M) {
            float t = 0.f;
            for (int w = 0; w < SP_GEMV_WARPS; w++) t += partial[w][tid];
            row_scale[tid] = rsqrtf(t / (float)K + eps);
        }
        __syncthreads();
    }
    const uint4* norm_v = reinterpret_cast<const uint4*>(norm_weight);
    const uint4* embed_v = reinterpret_cast<const uint4*>(embed);
    int total = M * chunks;
    for (int base = tid; base < total; base += SP_STAGE_AHEAD * blockDim.x) {
        uint4 raw[SP_STAGE_AHEAD], aux[SP_STAGE_AHEAD];
#pragma unroll
        for (int u = 0; u < SP_STAGE_AHEAD; u++) {
            int idx = base + u * blockDim.x;
            if (idx < total) dk_stage_load<T>(raw[u], aux[u], idx, chunks, vec_stride, mode, xv, norm_v, embed_v,
                                              tokens);
        }
#pragma unroll
        for (int u = 0; u < SP_STAGE_AHEAD; u++) {
            int idx = base + u * blockDim.x;
            if (idx >= total) break;
            if (mode == 0 || mode == 3) {
                staged[idx] = raw[u];
                continue;
            }
            float f[8], g[8];
            dk_unpack8<T>(raw[u], f);
            dk_unpack8<T>(aux[u], g);
            if (mode == 1) {
                int m = idx / chunks;
#pragma unroll
                for (int j = 0; j < 8; j++) f[j] = to_f(rnd<T>(g[j] * to_f(rnd<T>(f[j] * row_scale[m]))));
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) f[j] = to_f(dk_silu_mul<T>(f[j], g[j]));
            }
            staged[idx] = dk_pack8<T>(f);
        }
    }
    __syncthreads();
}

template <typename T, int M>
__global__ void __launch_bounds__(256, SP_GEMV_BLOCKS) sp_gemv(const T* x, const T* norm_weight, const T* weight,
                                                  const T* bias, const T* residual, void* out, int K, int N,
                                                  int x_stride, int mode, float eps, int out_f32,
                                                  int prefetch_bytes, const T* embed, const long long* tokens,
                                                  int pair_rows) {
    __shared__ uint4 staged[SP_GEMV_STAGE / 8];  // in [M, K] as T
    __shared__ float partial[SP_GEMV_WARPS][M];
    __shared__ float row_scale[M];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int stride = gridDim.x * SP_GEMV_WARPS;  // rows between a warp's consecutive rows
    int row = blockIdx.x * SP_GEMV_WARPS + warp;
    bool scatter = M > 1;
    uint4 wa[SP_GEMV_TILE / 256], wb[SP_GEMV_TILE / 256];
    sp_let_next_start();
    if (row < N) {
        dk_gemv_load<T>(wa, weight, K, row, 0, lane);  // SiLU pairs: the warp's next rows are row + pair_rows, ..
        dk_gemv_prefetch<T>(weight, K, N + pair_rows, row, pair_rows > 0 ? pair_rows : stride, lane,
                            prefetch_bytes);
    }
    sp_wait_for_previous();  // x, residual and out belong to the kernels around this one
    dk_gemv_stage<T, M>(staged, partial, row_scale, x, norm_weight, K, x_stride, mode, eps, embed, tokens);
    if (row >= N) return;
    dk_gemv_rows<T, M>(staged, wa, wb, weight, bias, residual, out, K, N, row, stride, lane, scatter, out_f32,
                       pair_rows);
}

// sp_gemv's products on the tensor cores (the parameters and the staging are sp_gemv's; prefetch_bytes is
// unused: the first batch's loads go out before the wait). The grid has at most one block a unit of 8 rows.
template <typename T, int M>
__global__ void __launch_bounds__(256, SP_GEMV_BLOCKS) sp_gemv_tc(const T* x, const T* norm_weight,
                                                     const T* weight, const T* bias, const T* residual,
                                                     void* out, int K, int N, int x_stride, int mode, float eps,
                                                     int out_f32, int prefetch_bytes, const T* embed,
                                                     const long long* tokens, int pair_rows) {
    __shared__ uint4 staged[SP_GEMV_STAGE / 8];  // in [M, K] as T
    __shared__ float partial[SP_GEMV_WARPS][M];
    __shared__ float row_scale[M];
    __shared__ float red[dk_tc_red<M>::BUFS][SP_GEMV_WARPS][32 * dk_tc_red<M>::V];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 wa[8], wb[8];
    sp_let_next_start();
    if (blockIdx.x < (N + 7) / 8) dk_tc_load<T>(wa, weight, K, N, blockIdx.x, 0, warp, lane);
    sp_wait_for_previous();  // x, residual and out belong to the kernels around this one
    dk_gemv_stage<T, M>(staged, partial, row_scale, x, norm_weight, K, x_stride, mode, eps, embed, tokens);
    dk_tc_units<T, M>(staged, red, wa, wb, weight, bias, residual, out, K, N, warp, lane, out_f32);
}

// A decode block's attention is a few chunks of 32 cache rows, so its time is memory round trips, not bytes:
// before a warp needs a chunk, it asks L2 for the chunk's key and value rows (lane j: key row j's lines, and
// two of the chunk's value lines), so that the loops' loads, issued a few at a time, find them there.  The
// first chunk's request goes out before q is staged.  Prefetching changes where bytes come from, not any sum.
template <typename T>
__device__ __forceinline__ void dk_attn_prefetch_chunk(const T* keys, const T* values, int c, long long total,
                                                       int D, int lane) {
    long long row = (long long)c * 32 + lane;
    int row_bytes = D * (int)sizeof(T);
    if (row < total) {
        const char* k = reinterpret_cast<const char*>(keys + row * D);
        for (int off = 0; off < row_bytes; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(k + off));
    }
    long long rows = min(32LL, total - (long long)c * 32);
    const char* v = reinterpret_cast<const char*>(values + (long long)c * 32 * D);
    for (long long off = lane * 128LL; off < rows * row_bytes; off += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v + off));
}

// q . key for G query rows staged in smem (q_rows[g * q_stride + d]), the key's D / 8 chunks loaded AHEAD at a
// time before they are used, so that a lane's loads travel together instead of a few at a time; the products
// are summed in d order whatever AHEAD is (the same bits).
template <typename T, int G, int AHEAD>
__device__ __forceinline__ void dk_attn_dots(const uint4* krow, const float* q_rows, int q_stride, int vchunks,
                                             float* dot) {
#pragma unroll
    for (int g = 0; g < G; g++) dot[g] = 0.f;
    for (int d0 = 0; d0 < vchunks; d0 += AHEAD) {
        uint4 ahead[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            if (d0 + u < vchunks) ahead[u] = krow[d0 + u];
        }
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            if (d0 + u >= vchunks) break;
            float f[8];
            dk_unpack8<T>(ahead[u], f);
#pragma unroll
            for (int g = 0; g < G; g++) {
#pragma unroll
                for (int e = 0; e < 8; e++) dot[g] = fmaf(q_rows[g * q_stride + (d0 + u) * 8 + e], f[e], dot[g]);
            }
        }
    }
}

// acc[g][e] += p_g(j) * v[j][8 sub + e] over the chunk's rows j = group, group + groups, ... < rows, in that
// order, for the G heads with live[g] (probs[g * 32 + j]: head g's p of row j); the value rows' loads go out
// AHEAD at a time before their products (the same bits whatever AHEAD is).
template <typename T, int G, int AHEAD>
__device__ __forceinline__ void dk_attn_values(const T* chunk_values, int D, int rows, int group, int groups,
                                               int sub, const float* probs, const bool* live, float (*acc)[8]) {
    for (int j0 = group; j0 < rows; j0 += AHEAD * groups) {
        uint4 ahead[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            int j = j0 + u * groups;
            if (j < rows) ahead[u] = reinterpret_cast<const uint4*>(chunk_values + (long long)j * D)[sub];
        }
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            int j = j0 + u * groups;
            if (j >= rows) break;
            float f[8];
            dk_unpack8<T>(ahead[u], f);
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (!live[g]) continue;
                float pj = probs[g * 32 + j];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] = fmaf(pj, f[e], acc[g][e]);
            }
        }
    }
}

// Sum over the warps of acc[d] rescaled to the block's max `top`, in warp order (hidden warps skipped).
__device__ __forceinline__ float dk_attn_value(const float (*warp_acc)[SP_ATTN_MAX_D], const float* warp_max,
                                               float top, int d) {
    float value = 0.f;
    for (int w = 0; w < SP_ATTN_WARPS; w++) {
        if (warp_max[w] != SP_NEG_INF) value = fmaf(warp_acc[w][d], expf(warp_max[w] - top), value);
    }
    return value;
}

// Attention of blocks of query tokens over one layer's cache; one block of 8 warps per (token i, head h).
//   q [heads, n, D] (the rope kernel's output), out [n, heads * D].  The n tokens are n / block_n sequences'
//   blocks of block_n tokens each (one sequence: block_n = n): token i belongs to sequence b = i / block_n, is
//   its block's token t = i % block_n, and reads b's cache at k_cache + b * seq_stride (seq_stride: values
//   between two sequences' caches, 0 for one sequence), laid out [kv_heads, cache_len, D] (GQA: head h reads
//   kv head h / (heads / kv_heads)); start [n / block_n] (each block's first cache row, on the device);
//   visible [block_n, block_n] uint8 (token t sees block row j), the same for every sequence.
//   Token t sees cache rows r < start[b] and block rows start[b] + j with visible[t, j]; rows from
//   start[b] + block_n on are never read.  Scores q.k / sqrt(D), softmax and the weighted sum in fp32, rounded
//   to T once at the end.
// Each (token, head) pair has `splits` blocks (blockIdx = pair * splits + split), so that a short block over a
// short cache still fills the GPU; warp w of split s takes key chunks c = 8 s + w, then every 8 * splits further,
// of 32 rows: lane j scores row 32 c + j, then the lanes, in groups of D / 8 (each lane of a group owning 8 of
// the D values), sum p v over the chunk's rows, group g taking rows g, g + G, ...  Every row below
// start + block_n holds this step's or an earlier step's finite K/V, so a hidden row is read and adds p = 0
// exactly: token t's output is the same whatever block_n is (for the same splits).  The warps' online-softmax
// states and the groups' sums are merged in a fixed order; when more than one split holds keys, each such
// block leaves its state (max, sum, unnormalised p v) in partial [pairs * splits, D + 2], and the pair's last
// block to finish (counted in counters [pairs], zero before the launch and left zero after it) merges them in
// split order.  Splits past the cache's last chunk leave at once (a short cache costs no merge).
// D % 8 == 0, D <= 256.
template <typename T>
__global__ void __launch_bounds__(256) sp_attention(const T* q, const T* k_cache, const T* v_cache,
                                                    const long long* start, const unsigned char* visible,
                                                    T* out, int n, int heads, int kv_heads, int D,
                                                    int cache_len, float scale, int block_n,
                                                    int seq_stride, float* partial, int* counters,
                                                    int splits) {
    __shared__ __align__(16) float q_row[SP_ATTN_MAX_D];
    __shared__ float probs[SP_ATTN_WARPS][32];
    __shared__ float warp_max_s[SP_ATTN_WARPS], warp_sum_s[SP_ATTN_WARPS];
    __shared__ float warp_acc[SP_ATTN_WARPS][SP_ATTN_MAX_D];
    __shared__ int merges;
    sp_let_next_start();
    sp_wait_for_previous();
    int split = blockIdx.x % splits, pair = blockIdx.x / splits;
    int h = pair % heads, i = pair / heads;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int kvh = h / (heads / kv_heads);
    int b = i / block_n, t = i - b * block_n;
    long long first = start[b];
    long long total = first + block_n;
    int chunks = (int)((total + 31) / 32);
    // Splits from `active` on hold no key (a short cache): they leave at once and nothing waits for them.
    // Their state would be (-inf, 0, 0), which the merge skips, so the result is the same bits either way.
    int active = min(splits, (chunks + SP_ATTN_WARPS - 1) / SP_ATTN_WARPS);
    if (split >= active) return;
    long long base = (long long)b * seq_stride + (long long)kvh * cache_len * D;
    const T* keys = k_cache + base;
    const T* values = v_cache + base;
    int step = SP_ATTN_WARPS * splits;
    if (split * SP_ATTN_WARPS + warp < chunks)
        dk_attn_prefetch_chunk<T>(keys, values, split * SP_ATTN_WARPS + warp, total, D, lane);
    const T* q_in = q + ((long long)h * n + i) * D;
    for (int d = tid; d < D; d += blockDim.x) q_row[d] = to_f(q_in[d]);
    __syncthreads();

    const unsigned char* sees = visible + (long long)t * block_n;
    int vchunks = D / 8;               // lanes per group, each owning 8 output values
    int groups = 32 / vchunks;         // groups per warp (lanes from groups * vchunks on stay idle in p v)
    int group = lane / vchunks, sub = lane - group * vchunks;
    float run_max = SP_NEG_INF, run_sum = 0.f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.f;

    for (int c = split * SP_ATTN_WARPS + warp; c < chunks; c += step) {
        if (c + step < chunks) dk_attn_prefetch_chunk<T>(keys, values, c + step, total, D, lane);
        long long r = (long long)c * 32 + lane;
        bool seen = r < total && (r < first || sees[r - first] != 0);
        float s = SP_NEG_INF;
        if (r < total) {  // every row below total is finite: its key is read beside the visibility mark
            float dot;
            dk_attn_dots<T, 1, SP_ATTN_AHEAD>(reinterpret_cast<const uint4*>(keys + r * D), q_row, 0, vchunks,
                                              &dot);
            if (seen) s = dot * scale;
        }
        float chunk_max = dk_warp_max(s);
        if (chunk_max == SP_NEG_INF) continue;  // every key of the chunk hidden (the same for the whole warp)
        float new_max = fmaxf(run_max, chunk_max);
        float rescale = expf(run_max - new_max);  // 0 for the first chunk seen (run_max = -inf)
        float p = seen ? expf(s - new_max) : 0.f;
        run_sum = run_sum * rescale + dk_warp_sum(p);
        probs[warp][lane] = p;
        __syncwarp();
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= rescale;
        int rows = (int)min((long long)32, total - (long long)c * 32);  // rows of the chunk below start + block_n
        if (group < groups) {
            const bool live = true;
            dk_attn_values<T, 1, SP_ATTN_AHEAD>(values + (long long)c * 32 * D, D, rows, group, groups, sub,
                                                probs[warp], &live, reinterpret_cast<float(*)[8]>(acc));
        }
        __syncwarp();
        run_max = new_max;
    }
    // the warp's groups summed in order, then the warps merged in order
    float* mine = warp_acc[warp];
    for (int g = 0; g < groups; g++) {
        if (group == g) {
#pragma unroll
            for (int e = 0; e < 8; e++) mine[sub * 8 + e] = (g == 0 ? 0.f : mine[sub * 8 + e]) + acc[e];
        }
        __syncwarp();
    }
    if (lane == 0) {
        warp_max_s[warp] = run_max;
        warp_sum_s[warp] = run_sum;
    }
    __syncthreads();
    float top = SP_NEG_INF, total_sum = 0.f;
    for (int w = 0; w < SP_ATTN_WARPS; w++) top = fmaxf(top, warp_max_s[w]);
    for (int w = 0; w < SP_ATTN_WARPS; w++) {
        if (warp_max_s[w] == SP_NEG_INF) continue;
        total_sum = fmaf(warp_sum_s[w], expf(warp_max_s[w] - top), total_sum);
    }
    T* out_row = out + ((long long)i * heads + h) * D;
    if (active == 1) {  // the merge of one state is this division (x * expf(0) and x + 0 are exact)
        for (int d = tid; d < D; d += blockDim.x) {
            out_row[d] = rnd<T>(dk_attn_value(warp_acc, warp_max_s, top, d) / total_sum);
        }
        return;
    }
    // this split's softmax state (max, sum, unnormalised sum of p v) for the pair's last block to merge
    float* mine_out = partial + ((long long)pair * splits + split) * (D + 2);
    for (int d = tid; d < D; d += blockDim.x) mine_out[2 + d] = dk_attn_value(warp_acc, warp_max_s, top, d);
    if (tid == 0) {
        mine_out[0] = top;
        mine_out[1] = total_sum;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) merges = atomicAdd(counters + pair, 1) == active - 1;
    __syncthreads();
    if (!merges) return;
    __threadfence();
    const float* parts = partial + (long long)pair * splits * (D + 2);
    float m = SP_NEG_INF, l = 0.f;
    for (int sp = 0; sp < active; sp++) m = fmaxf(m, __ldcg(parts + sp * (D + 2)));
    for (int sp = 0; sp < active; sp++) {
        float ms = __ldcg(parts + sp * (D + 2));
        if (ms != SP_NEG_INF) l = fmaf(__ldcg(parts + sp * (D + 2) + 1), expf(ms - m), l);
    }
    for (int d = tid; d < D; d += blockDim.x) {
        float value = 0.f;
        for (int sp = 0; sp < active; sp++) {
            float ms = __ldcg(parts + sp * (D + 2));
            if (ms != SP_NEG_INF) value = fmaf(__ldcg(parts + sp * (D + 2) + 2 + d), expf(ms - m), value);
        }
        out_row[d] = rnd<T>(value / l);
    }
    if (tid == 0) counters[pair] = 0;  // ready for the next launch (or graph replay)
}

// sp_attention for G query heads sharing a kv head at once (grouped-query attention), one split: one block of
// 8 warps per (token i, kv head), reading each key and value row once for the G heads instead of once per head.
// Arguments and layout as sp_attention's (splits 1, no partial state); G heads of D <= SP_ATTN_GROUP_D.  Every
// head's arithmetic is sp_attention's with splits = 1, in the same order (the same key chunks per warp, the
// same dot and p v order, the same merges), so each output is bit for bit what sp_attention gives: grouping is
// a speed choice only.
#define SP_ATTN_GROUP_D 128

// the grouped kernel's loads ahead: its accumulators grow with G, so it keeps SP_ATTN_AHEAD / G in flight
template <int G>
struct dk_grouped_ahead {
    static constexpr int N = SP_ATTN_AHEAD / G > 0 ? SP_ATTN_AHEAD / G : 1;
};

template <typename T, int G>
__global__ void __launch_bounds__(256, SP_ATTN_GROUPED_BLOCKS)
    sp_attention_grouped(const T* q, const T* k_cache, const T* v_cache, const long long* start,
                                                            const unsigned char* visible, T* out, int n,
                                                            int heads, int kv_heads, int D, int cache_len,
                                                            float scale, int block_n, int seq_stride) {
    __shared__ __align__(16) float q_rows[G][SP_ATTN_GROUP_D];
    __shared__ float probs[SP_ATTN_WARPS][G][32];
    __shared__ float warp_max_s[SP_ATTN_WARPS][G], warp_sum_s[SP_ATTN_WARPS][G];
    __shared__ float warp_acc[SP_ATTN_WARPS][G][SP_ATTN_GROUP_D];
    sp_let_next_start();
    sp_wait_for_previous();
    int kvh = blockIdx.x % kv_heads, i = blockIdx.x / kv_heads;
    int h0 = kvh * G;  // the group's first query head (heads / kv_heads == G)
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int b = i / block_n, t = i - b * block_n;
    long long first = start[b];
    long long total = first + block_n;
    int chunks = (int)((total + 31) / 32);
    long long base = (long long)b * seq_stride + (long long)kvh * cache_len * D;
    const T* keys = k_cache + base;
    const T* values = v_cache + base;
    if (warp < chunks) dk_attn_prefetch_chunk<T>(keys, values, warp, total, D, lane);
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        int g = idx / D, d = idx - g * D;
        q_rows[g][d] = to_f(q[((long long)(h0 + g) * n + i) * D + d]);
    }
    __syncthreads();

    const unsigned char* sees = visible + (long long)t * block_n;
    int vchunks = D / 8;
    int groups = 32 / vchunks;
    int group = lane / vchunks, sub = lane - group * vchunks;
    float run_max[G], run_sum[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        run_max[g] = SP_NEG_INF;
        run_sum[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
    }

    for (int c = warp; c < chunks; c += SP_ATTN_WARPS) {
        if (c + SP_ATTN_WARPS < chunks) dk_attn_prefetch_chunk<T>(keys, values, c + SP_ATTN_WARPS, total, D, lane);
        long long r = (long long)c * 32 + lane;
        bool seen = r < total && (r < first || sees[r - first] != 0);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; g++) s[g] = SP_NEG_INF;
        if (r < total) {  // every row below total is finite: its key is read beside the visibility mark
            float dot[G];
            dk_attn_dots<T, G, dk_grouped_ahead<G>::N>(reinterpret_cast<const uint4*>(keys + r * D), &q_rows[0][0],
                                                       SP_ATTN_GROUP_D, vchunks, dot);
#pragma unroll
            for (int g = 0; g < G; g++) s[g] = seen ? dot[g] * scale : SP_NEG_INF;
        }
        bool live[G];  // a head whose chunk has a visible key (all or none: visibility is the token's)
        float rescale[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            float chunk_max = dk_warp_max(s[g]);
            live[g] = chunk_max != SP_NEG_INF;
            float new_max = live[g] ? fmaxf(run_max[g], chunk_max) : run_max[g];
            rescale[g] = live[g] ? expf(run_max[g] - new_max) : 1.f;
            float p = live[g] && seen ? expf(s[g] - new_max) : 0.f;
            if (live[g]) run_sum[g] = run_sum[g] * rescale[g] + dk_warp_sum(p);
            probs[warp][g][lane] = p;
            run_max[g] = new_max;
        }
        __syncwarp();
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] = live[g] ? acc[g][e] * rescale[g] : acc[g][e];
        }
        int rows = (int)min((long long)32, total - (long long)c * 32);
        if (group < groups)
            dk_attn_values<T, G, dk_grouped_ahead<G>::N>(values + (long long)c * 32 * D, D, rows, group, groups, sub,
                                                         &probs[warp][0][0], live, acc);
        __syncwarp();
    }
    for (int gi = 0; gi < groups; gi++) {
        if (group == gi) {
#pragma unroll
            for (int g = 0; g < G; g++) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    float* slot = &warp_acc[warp][g][sub * 8 + e];
                    *slot = (gi == 0 ? 0.f : *slot) + acc[g][e];
                }
            }
        }
        __syncwarp();
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            warp_max_s[warp][g] = run_max[g];
            warp_sum_s[warp][g] = run_sum[g];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        int g = idx / D, d = idx - g * D;
        float top = SP_NEG_INF, total_sum = 0.f, value = 0.f;
        for (int w = 0; w < SP_ATTN_WARPS; w++) top = fmaxf(top, warp_max_s[w][g]);
        for (int w = 0; w < SP_ATTN_WARPS; w++) {
            if (warp_max_s[w][g] == SP_NEG_INF) continue;
            total_sum = fmaf(warp_sum_s[w][g], expf(warp_max_s[w][g] - top), total_sum);
        }
        for (int w = 0; w < SP_ATTN_WARPS; w++) {
            if (warp_max_s[w][g] != SP_NEG_INF) value = fmaf(warp_acc[w][g][d], expf(warp_max_s[w][g] - top), value);
        }
        out[((long long)i * heads + h0 + g) * D + d] = rnd<T>(value / total_sum);
    }
}

// ---- sp_attention_wide: the batched step's attention, the whole block on each tile of cache rows ----
// One block per (token i, kv head) as in sp_attention_grouped (arguments and layout the same), for the batched
// step's B sequences. The grouped kernel gives a warp whole chunks of 32 rows, a lane a key row, and reads a
// row's D / 8 chunks a few at a time: over a short cache most warps idle and each one waits on several memory
// round trips. Here a tile of SP_WIDE_TILE rows is spread over the block's SP_WIDE_WARPS warps, D / 8 lanes a
// row, and the tile's key and value loads go out together, about one round trip a tile; blocks of 4 warps
// let 4 reside on an SM at 128 registers a thread.
//   scores: lane (slot, c) multiplies 8 of row slot's D key values by each head's q; the row's D / 8 lanes add
//           their products in a fixed butterfly; softmax online over the tiles, per head, in tile order.
//   p v:    each lane adds p v over its rows, for its 8 values; the warp's slots, then the warps, are added
//           in a fixed order.
// The sums' order differs from sp_attention's, so its bits are not the one-sequence step's; they depend on the
// token's own visible rows alone (tiles start at row 0; hidden rows add exactly 0), so a verification block
// equals its tokens decoded one at a time, and a sequence in a batch equals that sequence launched alone.
// D in {32, 64, 128}; G = heads / kv_heads in {1, 2, 4, 8}.
#ifndef SP_WIDE_WARPS
#define SP_WIDE_WARPS 4  // warps a block (4 or 8; kernels/step.py passes its own)
#endif
#define SP_WIDE_THREADS (32 * SP_WIDE_WARPS)
#define SP_WIDE_TILE (8 * SP_WIDE_WARPS)           // rows a tile: D = 128 takes 4 passes of 2 rows a warp
#define SP_WIDE_PASSES 4                           // the most passes a tile takes (D = 128)
#define SP_WIDE_PER_LANE (SP_WIDE_TILE / 32)       // a tile's scores per lane in the softmax

// The tile's key (or value) chunks of this lane: row tile0 + u * slots + slot, chunk c (rows past total: none)
template <typename T>
__device__ __forceinline__ void dk_wide_load(uint4* into, const T* rows, long long tile0, long long total,
                                             int slots, int passes, int slot, int c, int D) {
#pragma unroll
    for (int u = 0; u < SP_WIDE_PASSES; u++) {
        long long r = tile0 + u * slots + slot;
        if (u < passes && r < total) into[u] = reinterpret_cast<const uint4*>(rows + r * D)[c];
    }
}

// Head g's softmax over a tile's scores (p_s[g]), online across tiles: the scores become p against the
// running max, whose change rescales the sums so far (rescale_s[g]); a tile of hidden rows changes nothing.
__device__ __forceinline__ void dk_wide_softmax(float* p_row, float* run_max, float* run_sum, float* rescale,
                                                int lane) {
    float s[SP_WIDE_PER_LANE], top = SP_NEG_INF;
#pragma unroll
    for (int j = 0; j < SP_WIDE_PER_LANE; j++) {
        s[j] = p_row[lane + 32 * j];
        top = fmaxf(top, s[j]);
    }
    top = dk_warp_max(top);
    float scale_by = 1.f, part = 0.f;
    if (top != SP_NEG_INF) {
        float new_max = fmaxf(*run_max, top);
        scale_by = expf(*run_max - new_max);  // 0 for the first tile seen (run_max = -inf)
#pragma unroll
        for (int j = 0; j < SP_WIDE_PER_LANE; j++) {
            s[j] = expf(s[j] - new_max);
            part += s[j];
        }
        float tile_sum = dk_warp_sum(part);
        if (lane == 0) {
            *run_sum = *run_sum * scale_by + tile_sum;
            *run_max = new_max;
        }
    } else {
#pragma unroll
        for (int j = 0; j < SP_WIDE_PER_LANE; j++) s[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < SP_WIDE_PER_LANE; j++) p_row[lane + 32 * j] = s[j];
    if (lane == 0) *rescale = scale_by;
}

template <typename T, int G>
__global__ void __launch_bounds__(SP_WIDE_THREADS, 16 / SP_WIDE_WARPS)
    sp_attention_wide(const T* q, const T* k_cache, const T* v_cache, const long long* start,
                      const unsigned char* visible, T* out, int n, int heads, int kv_heads, int D, int cache_len,
                      float scale, int block_n, int seq_stride) {
    // q by column within a lane's 8: lane c reads column c * 8 + e at e * lanes + c, so the row's D / 8 lanes
    // read consecutive words (the plain layout, a stride of 8 words, met 4-way bank conflicts on every read)
    __shared__ float q_s[G][SP_ATTN_GROUP_D];
    __shared__ float p_s[G][SP_WIDE_TILE];  // the tile's scores, then its p
    __shared__ float rescale_s[G], max_s[G], sum_s[G];
    __shared__ float red_s[SP_WIDE_WARPS][G][SP_ATTN_GROUP_D];
    sp_let_next_start();
    sp_wait_for_previous();
    int kvh = blockIdx.x % kv_heads, i = blockIdx.x / kv_heads;
    int h0 = kvh * G;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int b = i / block_n, t = i - b * block_n;
    long long first = start[b];
    long long total = first + block_n;
    long long base = (long long)b * seq_stride + (long long)kvh * cache_len * D;
    const T* keys = k_cache + base;
    const T* values = v_cache + base;
    int lanes = D / 8;                       // lanes a row: 4, 8 or 16
    int slots = SP_WIDE_THREADS / lanes;     // rows a pass of the block covers
    int passes = SP_WIDE_TILE / slots;       // 1, 2 or 4
    int slot = tid / lanes, c = tid - slot * lanes;
    uint4 kr[SP_WIDE_PASSES], vr[SP_WIDE_PASSES];
    dk_wide_load<T>(kr, keys, 0, total, slots, passes, slot, c, D);
    dk_wide_load<T>(vr, values, 0, total, slots, passes, slot, c, D);
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        int g = idx / D, d = idx - g * D;
        q_s[g][(d & 7) * lanes + (d >> 3)] = to_f(q[((long long)(h0 + g) * n + i) * D + d]);
    }
    if (tid < G) {
        max_s[tid] = SP_NEG_INF;
        sum_s[tid] = 0.f;
    }
    __syncthreads();

    const unsigned char* sees = visible + (long long)t * block_n;
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
    }
    for (long long tile0 = 0;;) {
#pragma unroll
        for (int u = 0; u < SP_WIDE_PASSES; u++) {
            if (u >= passes) break;
            long long r = tile0 + u * slots + slot;
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; g++) dot[g] = 0.f;
            if (r < total) {
                float f[8];
                dk_unpack8<T>(kr[u], f);
#pragma unroll
                for (int g = 0; g < G; g++) {
#pragma unroll
                    for (int e = 0; e < 8; e++) dot[g] = fmaf(q_s[g][e * lanes + c], f[e], dot[g]);
                }
            }
            for (int o = lanes >> 1; o > 0; o >>= 1) {
#pragma unroll
                for (int g = 0; g < G; g++) dot[g] += __shfl_xor_sync(SP_FULL_MASK, dot[g], o);
            }
            if (c == 0) {
                bool seen = r < total && (r < first || sees[r - first] != 0);
#pragma unroll
                for (int g = 0; g < G; g++) p_s[g][u * slots + slot] = seen ? dot[g] * scale : SP_NEG_INF;
            }
        }
        __syncthreads();
        for (int g = warp; g < G; g += SP_WIDE_WARPS)
            dk_wide_softmax(p_s[g], &max_s[g], &sum_s[g], &rescale_s[g], lane);
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; g++) {
            float rs = rescale_s[g];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= rs;
        }
#pragma unroll
        for (int u = 0; u < SP_WIDE_PASSES; u++) {
            if (u >= passes) break;
            if (tile0 + u * slots + slot >= total) break;
            float f[8];
            dk_unpack8<T>(vr[u], f);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float pj = p_s[g][u * slots + slot];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] = fmaf(pj, f[e], acc[g][e]);
            }
        }
        tile0 += SP_WIDE_TILE;
        if (tile0 >= total) break;
        __syncthreads();  // p_s is the next tile's
        dk_wide_load<T>(kr, keys, tile0, total, slots, passes, slot, c, D);
        dk_wide_load<T>(vr, values, tile0, total, slots, passes, slot, c, D);
    }
    // the warp's slots added in a fixed butterfly, then the warps in order
    for (int o = 16; o >= lanes; o >>= 1) {
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] += __shfl_xor_sync(SP_FULL_MASK, acc[g][e], o);
        }
    }
    if (lane < lanes) {
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int e = 0; e < 8; e++) red_s[warp][g][c * 8 + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        int g = idx / D, d = idx - g * D;
        float value = 0.f;
        for (int w = 0; w < SP_WIDE_WARPS; w++) value += red_s[w][g][d];
        out[((long long)i * heads + h0 + g) * D + d] = rnd<T>(value / sum_s[g]);
    }
}

// sp_ngram_lookup: n-gram prompt lookup over the committed tokens, as engine.round_graph.NgramLookup (its twin)
// and engine.drafters.ngram.lookup_continuation compute it, in one block instead of two dozen torch operations.
// history [M] holds the committed tokens in [0, L), L = *length (anything past them); the longest suffix of
// n <= max_n tokens that occurs earlier (n <= L - 1), its most recent occurrence ending at t <= L - 2, gives
// tokens_out[j] = history[t + 1 + j] for j < k (clamped into [0, M)) and *count_out = min(L - t - 1, k), or 0
// with tokens from row 0 when no suffix occurs earlier. Thread x tries the occurrences ending at x, x + blockDim,
// ...; each keeps, per n, the latest end that matched, by an atomicMax in shared memory.
// Where draft is not NULL the last round's emitted tokens are appended first (engine.round_graph.append_emitted,
// the twin): history[L + j] = draft[j] for j < k, except history[L + accepted] = *next_token, and
// history[L + k] = *next_token (rows past L + accepted are stray); *length becomes L + accepted + 1.
// Where chain is not NULL (a corpus table: chain [V, W], pair_keys [P] ascending, pair_tokens [P, W], int64,
// -1 past a row's end) the slots from the count on take the table's continuation of the context (history's
// L tokens, then the count's), as engine.round_graph.corpus_fill (the twin): the pair (prev, last)'s row when
// pair_keys holds prev * V + last, else last's chain row, up to its first -1; the count grows by what it fills.
// Where embed is not NULL (and draft is: the round's outcome) the launch also builds the block the round
// verifies, as sp_chain_block does: block_tokens [k+1] = [*next_token, tokens_out], *block_start = *start + 1
// + *accepted, x_out [k+1, H] = embed[block_tokens] (rows of row_halves 16-bit words: H values of any dtype).
#define SP_NGRAM_MAX_N 64
#define SP_NGRAM_MAX_K 256  // k <= the block's threads (kernels/step.py THREADS)
#define SP_INT_MAX_NGRAM 0x7fffffff

// the context's token at position: history's below L, the lookup's tokens (from begin) past it
__device__ __forceinline__ long long sp_context_token(const long long* history, int M, int L, int begin,
                                                      long long position) {
    long long at = position < L ? position : (long long)begin + (position - L);
    return history[min(max(at, 0LL), (long long)M - 1)];
}

extern "C" __global__ void __launch_bounds__(256)
sp_ngram_lookup(long long* history, long long* length, int M, int max_n, int k, const long long* draft,
                const long long* next_token, const long long* accepted, long long* tokens_out,
                long long* count_out, const long long* chain, const long long* pair_keys,
                const long long* pair_tokens, int pairs, int width, int vocab, const long long* start,
                const unsigned short* embed, int row_halves, long long* block_tokens, long long* block_start,
                unsigned short* x_out) {
    __shared__ long long suffix[SP_NGRAM_MAX_N];  // the last tokens, last first
    __shared__ int latest_end[SP_NGRAM_MAX_N];    // per n - 1: the latest end t that matched, -1 none
    __shared__ int begin_s, count_s, filled_s;
    __shared__ const long long* row_s;            // the table's row that fills the slots from count_s
    __shared__ long long key_s;                   // prev * vocab + last, the pair to look for (-1: none)
    __shared__ int pair_s;                        // the pair's row (SP_INT_MAX_NGRAM: none)
    __shared__ long long block_s[SP_NGRAM_MAX_K + 1];  // the block's tokens (embed not NULL)
    sp_let_next_start();
    sp_wait_for_previous();  // history and length come from the kernels before this one
    int tid = threadIdx.x;
    long long committed = *length;
    long long took = 0, next = 0;
    if (draft != nullptr) {
        took = *accepted;
        next = *next_token;
        for (int j = tid; j <= k; j += blockDim.x) {
            if (committed + j < M) history[committed + j] = (j == took || j == k) ? next : draft[j];
        }
        committed += took + 1;
        __syncthreads();  // every thread has read *length and written its rows
        if (tid == 0) *length = committed;
    }
    int L = (int)min((long long)M, max(0LL, committed));
    for (int i = tid; i < max_n; i += blockDim.x) {
        suffix[i] = history[max(L - 1 - i, 0)];
        latest_end[i] = -1;
    }
    __syncthreads();
    for (int t = tid; t <= L - 2; t += blockDim.x) {
        int matched = 0;
        while (matched < max_n && t - matched >= 0 && history[t - matched] == suffix[matched]) matched++;
        for (int n = 0; n < matched; n++) atomicMax(&latest_end[n], t);
    }
    __syncthreads();
    if (tid == 0) {
        int longest = 0;  // the n - 1 of the longest suffix that occurs (0 when none does, as the twin's argmax)
        for (int n = max_n - 1; n >= 0; n--) {
            if (latest_end[n] >= 0) {
                longest = n;
                break;
            }
        }
        begin_s = latest_end[longest] + 1;
        count_s = latest_end[longest] >= 0 ? min(max(L - begin_s, 0), k) : 0;
        filled_s = width;
        row_s = nullptr;
        key_s = -1;
        pair_s = SP_INT_MAX_NGRAM;
        long long last_at = (long long)L + count_s - 1;
        if (chain != nullptr && last_at >= 0) {
            long long last = sp_context_token(history, M, L, begin_s, last_at);
            long long prev = last_at >= 1 ? sp_context_token(history, M, L, begin_s, last_at - 1) : -1;
            if (last >= 0 && last < vocab) {
                row_s = chain + last * width;
                if (prev >= 0 && prev < vocab && pairs > 0) key_s = prev * vocab + last;
            }
        }
    }
    __syncthreads();
    // The table's row, found by every thread at once (a search by one thread is a chain of dependent loads):
    // the pair's first row with the key (its only one: keys ascend), else the last token's chain row.
    if (key_s >= 0) {  // (the same for the whole block)
        for (int i = tid; i < pairs; i += blockDim.x)
            if (pair_keys[i] == key_s) atomicMin(&pair_s, i);
        __syncthreads();
        if (tid == 0 && pair_s != SP_INT_MAX_NGRAM) row_s = pair_tokens + (long long)pair_s * width;
        __syncthreads();
    }
    if (row_s == nullptr) {
        if (tid == 0) filled_s = 0;
    } else {  // its real tokens: those before its first -1
        for (int j = tid; j < width; j += blockDim.x)
            if (row_s[j] < 0) atomicMin(&filled_s, j);
    }
    __syncthreads();
    for (int j = tid; j < k; j += blockDim.x) {
        int slot = j - count_s;
        long long token = slot >= 0 && slot < filled_s ? row_s[slot] : history[min(max(begin_s + j, 0), M - 1)];
        tokens_out[j] = token;
        block_s[j + 1] = token;
    }
    if (tid == 0) *count_out = count_s + min(filled_s, k - count_s);
    if (embed == nullptr) return;
    if (tid == 0) {
        block_s[0] = next;
        *block_start = *start + 1 + took;
    }
    __syncthreads();
    for (int j = tid; j <= k; j += blockDim.x) block_tokens[j] = block_s[j];
    bool wide = row_halves % 8 == 0 && (((unsigned long long)embed | (unsigned long long)x_out) & 15) == 0;
    int unit = wide ? 8 : 1, units = row_halves / unit;  // a row's 16-byte pieces, else its 16-bit words
    for (int idx = tid; idx < (k + 1) * units; idx += blockDim.x) {
        int i = idx / units, c = idx - i * units;
        long long from = block_s[i] * units + c;
        if (wide) reinterpret_cast<uint4*>(x_out)[idx] = reinterpret_cast<const uint4*>(embed)[from];
        else x_out[idx] = embed[from];
    }
}

// sp_topk: the k <= SP_TOPK_MAX largest of each row of x [R, C] (row r at x + r * stride), as
// torch.sort(x, descending=True, stable=True)[:k] (kernels.step.topk_reference, its twin): values descending, a
// tie to the lower index, NaN above everything. torch.topk's radix select takes several passes over a short
// row (16-50 us for the rows a draft tree ranks). Each value and its index are one 64-bit key whose order is
// that order (sp_topk_key), so keys never tie. A row is split into S chunks of `chunk` columns, one block
// each (a row's scan by one block set the pace of a round that ranks a few rows): every thread keeps the best k keys of its columns, k rounds of a block-wide max take the
// chunk's best k; with S > 1 each chunk leaves them in partial [R, S, k] and the row's last block to finish
// (counted in counters [R], zero before the launch and left zero) ranks the S * k the same way. Where G > 0,
// gathered [G] also takes the indices at gather [G] (flat positions in indices_out [R, k]), as torch's take
// (Medusa's tree tokens).
#define SP_TOPK_MAX 16

__device__ __forceinline__ unsigned long long sp_topk_key(float v, int column) {
    u32 bits = v == 0.f ? 0u : __float_as_uint(v);  // -0 ties with +0, as in torch.sort
    u32 ordered = isnan(v) ? 0xffffffffu : (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (0xffffffffu - (u32)column);
}

__device__ __forceinline__ float sp_topk_value(unsigned long long key) {
    u32 ordered = (u32)(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

__device__ __forceinline__ int sp_topk_column(unsigned long long key) {
    return (int)(0xffffffffu - (u32)(key & 0xffffffffu));
}

// The block's best k keys of key_of(j), j < n (0 is below every key and never kept), into best_out[0..k)
// (0 past the n keys), descending. Every thread keeps its own best k; then k rounds of a block-wide max.
template <typename KeyOf>
__device__ __forceinline__ void sp_block_topk(KeyOf key_of, int n, int k, unsigned long long* best_out,
                                              unsigned long long* warp_best, unsigned long long& winner) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = (blockDim.x + 31) >> 5;
    unsigned long long best[SP_TOPK_MAX];  // this thread's best keys, descending
    int have = 0;
    for (int base = tid; base < n; base += SP_LOADS_AHEAD * blockDim.x) {
        unsigned long long ahead[SP_LOADS_AHEAD];
#pragma unroll
        for (int u = 0; u < SP_LOADS_AHEAD; u++) {
            int j = base + u * blockDim.x;
            ahead[u] = j < n ? key_of(j) : 0ull;
        }
#pragma unroll
        for (int u = 0; u < SP_LOADS_AHEAD; u++) {
            unsigned long long key = ahead[u];
            if (key == 0ull || (have == k && key <= best[k - 1])) continue;
            int pos = have < k ? have++ : k - 1;
            while (pos > 0 && best[pos - 1] < key) {
                best[pos] = best[pos - 1];
                pos--;
            }
            best[pos] = key;
        }
    }
    int head = 0;  // this thread's next key
    for (int r = 0; r < k; r++) {
        unsigned long long mine = head < have ? best[head] : 0ull;
        unsigned long long top = mine;
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long other = __shfl_xor_sync(SP_FULL_MASK, top, o);
            top = other > top ? other : top;
        }
        if (lane == 0) warp_best[warp] = top;
        __syncthreads();
        if (tid == 0) {
            unsigned long long w = warp_best[0];
            for (int i = 1; i < warps; i++) w = warp_best[i] > w ? warp_best[i] : w;
            winner = w;
            best_out[r] = w;
        }
        __syncthreads();
        if (head < have && mine == winner) head++;  // keys are unique: one thread owned it
    }
}

template <typename T>
__global__ void __launch_bounds__(256) sp_topk(const T* x, int R, int C, int stride, int k, int S, int chunk,
                                               float* values_out, long long* indices_out,
                                               const long long* gather, int G, long long* gathered,
                                               unsigned long long* partial, int* counters) {
    __shared__ unsigned long long warp_best[32];
    __shared__ unsigned long long winner;
    __shared__ unsigned long long row_best[SP_TOPK_MAX];
    __shared__ int last;
    sp_let_next_start();
    sp_wait_for_previous();
    int tid = threadIdx.x, row = blockIdx.x / S, part = blockIdx.x - row * S;
    const T* xr = x + (long long)row * stride;
    int c0 = part * chunk, n = min(chunk, C - c0);
    sp_block_topk([&](int j) { return sp_topk_key(to_f(xr[c0 + j]), c0 + j); }, n, k, row_best, warp_best,
                  winner);
    if (S > 1) {
        unsigned long long* mine = partial + ((long long)row * S + part) * k;
        if (tid < k) mine[tid] = row_best[tid];
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(&counters[row], 1) == S - 1;
        __syncthreads();
        if (!last) return;
        if (tid == 0) counters[row] = 0;
        __threadfence();
        const unsigned long long* lists = partial + (long long)row * S * k;
        sp_block_topk([&](int j) { return __ldcg(lists + j); }, S * k, k, row_best, warp_best, winner);
    }
    for (int r = tid; r < k; r += blockDim.x) {
        values_out[(long long)row * k + r] = sp_topk_value(row_best[r]);
        indices_out[(long long)row * k + r] = sp_topk_column(row_best[r]);
    }
    for (int g = tid; g < G; g += blockDim.x) {  // the row's entries of the take
        long long at = gather[g];
        if (at / k == row) gathered[g] = sp_topk_column(row_best[at - (long long)row * k]);
    }
}
