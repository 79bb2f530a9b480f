// specplay: fused kernels of the decoder step (loaded by kernels/step.py through cupy.RawModule).
//
// The contract is kernels/step.py's torch twins (rope_qkv_reference, silu_mul_reference), which are the
// eager step's own operations.  Each kernel replaces several of the step's small kernels: in a replayed CUDA
// graph every kernel costs a few microseconds however little it does, and a decoder layer had about a dozen.
//
// Rounding follows the torch operations one by one: every operation's result is rounded to the tensor dtype
// (bf16/fp16 round to nearest even), computed in fp32 in between.  Compiled with --fmad=false, so no
// multiply-add is contracted here; torch's own kernels may contract theirs, so the twins agree to one unit in
// the last place, not always bit for bit.
//
// No headers: NVRTC compiles this as is (bf16/fp16 are raw 16-bit words).

// The dtype helpers (bf16_t, f16_t, to_f, rnd) come from kernels/cuda_common.cuh, prepended at compile.

// Rotary embedding of q and k, the k/v cache write and q's grouped layout, for one block of n tokens.
//   qkv [n, (heads + 2 kv_heads) * D]: each row is q (heads * D) | k (kv_heads * D) | v (kv_heads * D)
//   rope(x)[d] = x[d] * cos[d] + x[d ^ half] * sin_signed[d]   (the halves swapped; sin_signed = [-sin, sin])
//   k_cache/v_cache [kv_heads, cache_len, D]: row cache_index[i] of head h gets token i's k (roped) and v
//   q_out [heads, n, D] (head hq = h * group + g: the rows SDPA reads as [kv_heads, group * n, D])
//   start [1] (NULL: unused): a block at cache rows start..start+n-1 on the device; positions then holds each
//   token's depth in the block (its position is start + depth) and cache_index is not read (token i's row is
//   start + i), which saves the step the two kernels that would add start to both
// One thread per (token, head slot, d) with head slots 0..heads-1 for q, then kv heads for k and v.
template <typename T>
__global__ void sp_rope_qkv(const T* qkv, const T* cos_table, const T* sin_table, const long long* positions,
                            const long long* cache_index, const long long* start, T* k_cache, T* v_cache,
                            T* q_out, int n, int heads, int kv_heads, int D, int cache_len) {
    sp_let_next_start();
    sp_wait_for_previous();
    int slots = heads + 2 * kv_heads;
    long long total = (long long)n * slots * D;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    int d = (int)(idx % D);
    int slot = (int)((idx / D) % slots);
    int i = (int)(idx / ((long long)D * slots));
    int width = slots * D;
    const T* row = qkv + (long long)i * width;
    long long first = start != nullptr ? start[0] : 0;
    long long cache_row = start != nullptr ? first + i : cache_index[i];
    if (slot >= heads + kv_heads) {  // v: copied into the cache as is
        int h = slot - heads - kv_heads;
        v_cache[((long long)h * cache_len + cache_row) * D + d] = row[slot * D + d];
        return;
    }
    int half = D / 2;
    int partner = d < half ? d + half : d - half;
    long long pos = first + positions[i];
    float c = to_f(cos_table[pos * D + d]);
    float s = to_f(sin_table[pos * D + d]);
    float x = to_f(row[slot * D + d]);
    float xs = to_f(row[slot * D + partner]);
    float a = to_f(rnd<T>(x * c));  // torch: x * cos, rounded
    float b = xs * s;               // addcmul: a + swapped * sin in fp32, rounded once
    T out = rnd<T>(a + b);
    if (slot < heads) {
        q_out[((long long)slot * n + i) * D + d] = out;
    } else {
        int h = slot - heads;
        k_cache[((long long)h * cache_len + cache_row) * D + d] = out;
    }
}

// SiLU(gate) * up for gate_up [n, 2 I] (gate | up per row) -> out [n, I].
//   torch: F.silu(gate) rounded, times up, rounded; silu(x) = x / (1 + exp(-x)) in fp32.
// Each thread takes `per_thread` consecutive values of a row (1, or 8 when I % 8 == 0 and T is 16-bit: one
// 16-byte load of gate and of up, one store).
template <typename T>
__global__ void sp_silu_mul(const T* gate_up, T* out, int n, int inter, int per_thread) {
    sp_let_next_start();
    sp_wait_for_previous();
    long long total = (long long)n * inter;
    long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * per_thread;
    if (first >= total) return;
    int j0 = (int)(first % inter);
    long long i = first / inter;
    const T* gate = gate_up + i * 2 * inter + j0;
    if (per_thread == 8 && sizeof(T) == 2) {
        uint4 g8 = *reinterpret_cast<const uint4*>(gate), u8 = *reinterpret_cast<const uint4*>(gate + inter);
        const T* g = reinterpret_cast<const T*>(&g8);
        const T* u = reinterpret_cast<const T*>(&u8);
        uint4 o8;
        T* o = reinterpret_cast<T*>(&o8);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float gv = to_f(g[e]);
            float silu = to_f(rnd<T>(gv / (1.0f + expf(-gv))));
            o[e] = rnd<T>(silu * to_f(u[e]));
        }
        *reinterpret_cast<uint4*>(out + first) = o8;
        return;
    }
    float g = to_f(gate[0]);
    float u = to_f(gate[inter]);
    float silu = to_f(rnd<T>(g / (1.0f + expf(-g))));
    out[first] = rnd<T>(silu * u);
}

// RMSNorm of rows x [n, H] -> out [n, H] as transformers' LlamaRMSNorm (rms_norm_reference): fp32 statistics,
// x * rsqrt(mean(x^2) + eps) rounded to T, times the weight, rounded (sp_gemv's mode 1 stages the same
// values).  One block of 256 threads per row; a row of up to 8,192 values, and its weights, stay in registers
// between the statistics and the output.
#define SP_NORM_THREADS 256
#define SP_NORM_PER_THREAD 32
template <typename T>
__global__ void __launch_bounds__(SP_NORM_THREADS) sp_rms_norm(const T* x, const T* weight, T* out, int H,
                                                               float eps) {
    __shared__ float partial[SP_NORM_THREADS / 32];
    __shared__ float scale_s;
    sp_let_next_start();
    sp_wait_for_previous();
    const T* row = x + (long long)blockIdx.x * H;
    T* out_row = out + (long long)blockIdx.x * H;
    int tid = threadIdx.x;
    float v[SP_NORM_PER_THREAD], w[SP_NORM_PER_THREAD];  // the weight is read with the row, not after the sum
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < SP_NORM_PER_THREAD; u++) {
        int c = tid + u * SP_NORM_THREADS;
        v[u] = c < H ? to_f(row[c]) : 0.f;
        w[u] = c < H ? to_f(weight[c]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < SP_NORM_PER_THREAD; u++) ss = fmaf(v[u], v[u], ss);
    for (int c = tid + SP_NORM_PER_THREAD * SP_NORM_THREADS; c < H; c += SP_NORM_THREADS) {
        float f = to_f(row[c]);
        ss = fmaf(f, f, ss);
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((tid & 31) == 0) partial[tid >> 5] = ss;
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < SP_NORM_THREADS / 32; w++) t += partial[w];
        scale_s = rsqrtf(t / (float)H + eps);
    }
    __syncthreads();
    float scale = scale_s;
#pragma unroll
    for (int u = 0; u < SP_NORM_PER_THREAD; u++) {
        int c = tid + u * SP_NORM_THREADS;
        if (c < H) out_row[c] = rnd<T>(w[u] * to_f(rnd<T>(v[u] * scale)));
    }
    for (int c = tid + SP_NORM_PER_THREAD * SP_NORM_THREADS; c < H; c += SP_NORM_THREADS) {
        out_row[c] = rnd<T>(to_f(weight[c]) * to_f(rnd<T>(to_f(row[c]) * scale)));
    }
}
