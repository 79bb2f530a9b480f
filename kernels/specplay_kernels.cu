// specplay: sampling and verification kernels (loaded by kernels/cuda.py through cupy.RawModule).
//
// The contract is kernels/reference.py.  One block of SP_BLOCK threads owns one row of logits (sampling)
// or one row's statistics (verification); a row is read several times, from L2 after the first pass.
//
// Warped distribution of a row (temperature T > 0, optional top-k / top-p), exactly as the reference:
//   s_j = x_j * (1/T)                    (fp32; torch multiplies by the fp32 reciprocal of a scalar on CUDA)
//   kth = k-th largest s (ties kept)     (radix select on order-preserving uint32 keys)
//   p_j = exp(s_j - m) / S               (fp32, S = sum over kept tokens, accumulated in fp64)
//   top-p: t* = smallest prob value v with mass(p > v) < top_p; p_j = p_j / S2 for p_j >= t*, else 0
//          (radix select over the prob bits with exact 2^-62 fixed-point mass histograms)
// T = 0 is the one-hot argmax (first index on ties).
// Inverse-CDF sampling: first token-id-order index whose fp64 cumulative mass exceeds u * total, falling
// back to the last non-zero token.
//
// No headers: NVRTC compiles this as is (bf16/fp16 are loaded as raw 16-bit words).

#ifndef SP_BLOCK
#define SP_BLOCK 1024
#endif
#define SP_WARPS (SP_BLOCK / 32)
#define SP_ITEMS 4
#define SP_TILE (SP_BLOCK * SP_ITEMS)
#define SP_MAX_V 262144
#define SP_MAX_TILES (SP_MAX_V / SP_TILE)
#define SP_MAX_N 64
#define SP_FULL 0xffffffffu
#define SP_INT_MAX 0x7fffffff
#define SP_NONE 0xffffffffu

// u32, bf16_t, f16_t and to_f come from kernels/cuda_common.cuh, prepended at compile (launch_spec.module_source).
typedef unsigned long long u64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// order-preserving map float -> uint32 (larger float -> larger key)
__device__ __forceinline__ u32 fkey(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_to_f(u32 k) {
    u32 b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    return __uint_as_float(b);
}

struct Cfg {
    float inv_t;   // fp32 reciprocal of the temperature (1 when greedy)
    int greedy;    // T == 0: one-hot argmax
    int top_k;     // 0 < top_k < V: top-k active
    int use_topp;  // top_p < 1
    u64 tp_fixed;  // float32(top_p) * 2^62
};

struct RowStats {
    float m;      // max of the scaled logits
    float kth;    // top-k threshold on scaled logits (-inf: none)
    float S;      // softmax denominator
    float tstar;  // top-p threshold on probabilities (0: none)
    float S2;     // top-p renormaliser (1: none)
    int argmax;   // first index of the max
    int nan;      // the row holds a NaN
    int pad;
};

struct Smem {
    double red[33];
    float redf[33];
    int redi[33];
    u32 hc[256];
    u64 hm[256];
    double tw[SP_MAX_TILES][SP_WARPS];
    double tiles[SP_MAX_TILES];
    int digit;
    u32 kk;
    u64 above;
    int t0;
    double prefix;
    double target;
    RowStats st;
};

// ------------------------------------------------------------------------------------------ block helpers
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SP_FULL, v, o);
    return v;
}
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SP_FULL, v, o);
    return v;
}

__device__ double block_sum_d(double v, Smem& sm) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    v = warp_sum_d(v);
    __syncthreads();
    if (l == 0) sm.red[w] = v;
    __syncthreads();
    if (w == 0) {
        double t = l < SP_WARPS ? sm.red[l] : 0.0;
        t = warp_sum_d(t);
        if (l == 0) sm.red[32] = t;
    }
    __syncthreads();
    return sm.red[32];
}

__device__ int block_max_i(int v, Smem& sm) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(SP_FULL, v, o));
    __syncthreads();
    if (l == 0) sm.redi[w] = v;
    __syncthreads();
    if (w == 0) {
        int t = l < SP_WARPS ? sm.redi[l] : -SP_INT_MAX;
        for (int o = 16; o > 0; o >>= 1) t = max(t, __shfl_xor_sync(SP_FULL, t, o));
        if (l == 0) sm.redi[32] = t;
    }
    __syncthreads();
    return sm.redi[32];
}

__device__ int block_min_i(int v, Smem& sm) { return -block_max_i(-v, sm); }

// (value, index): larger value wins, ties -> smaller index
__device__ __forceinline__ void argmax_combine(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}
__device__ void block_argmax(float& v, int& i, Smem& sm) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(SP_FULL, v, o);
        int oi = __shfl_xor_sync(SP_FULL, i, o);
        argmax_combine(v, i, ov, oi);
    }
    __syncthreads();
    if (l == 0) { sm.redf[w] = v; sm.redi[w] = i; }
    __syncthreads();
    if (w == 0) {
        float tv = l < SP_WARPS ? sm.redf[l] : neg_inf();
        int ti = l < SP_WARPS ? sm.redi[l] : SP_INT_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(SP_FULL, tv, o);
            int oi = __shfl_xor_sync(SP_FULL, ti, o);
            argmax_combine(tv, ti, ov, oi);
        }
        if (l == 0) { sm.redf[32] = tv; sm.redi[32] = ti; }
    }
    __syncthreads();
    v = sm.redf[32];
    i = sm.redi[32];
}

// exclusive prefix sum over the block (thread order); total returned through `total`
__device__ double block_excl_scan_d(double v, double& total, Smem& sm) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    double inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        double t = __shfl_up_sync(SP_FULL, inc, o);
        if (l >= o) inc += t;
    }
    __syncthreads();
    if (l == 31) sm.red[w] = inc;
    __syncthreads();
    if (w == 0) {
        double t = l < SP_WARPS ? sm.red[l] : 0.0;
        double ti = t;
        for (int o = 1; o < 32; o <<= 1) {
            double x = __shfl_up_sync(SP_FULL, ti, o);
            if (l >= o) ti += x;
        }
        if (l < SP_WARPS) sm.red[l] = ti - t;
        if (l == 31) sm.red[32] = ti;
    }
    __syncthreads();
    total = sm.red[32];
    return sm.red[w] + (inc - v);
}

// ------------------------------------------------------------------------------------------ warped probs
__device__ __forceinline__ float warped_p(float x, int j, const RowStats& st, const Cfg& c) {
    if (c.greedy) return j == st.argmax ? 1.0f : 0.0f;
    const float s = __fmul_rn(x, c.inv_t);
    if (s < st.kth) return 0.0f;
    float p = __fdiv_rn(expf(__fsub_rn(s, st.m)), st.S);
    if (c.use_topp) {
        if (!(p >= st.tstar)) return 0.0f;
        p = __fdiv_rn(p, st.S2);
    }
    return p;
}

template <typename T>
struct RowP {
    const T* row;
    RowStats st;
    Cfg c;
    __device__ __forceinline__ float operator()(int j) const { return warped_p(to_f(row[j]), j, st, c); }
};

struct ArrP {
    const float* p;
    __device__ __forceinline__ float operator()(int j) const { return p[j]; }
};

// before softmax normalisation (used by the top-p search): fp32 prob of token j given m, S, kth
template <typename T>
__device__ __forceinline__ float base_p(const T* row, int j, float m, float S, float kth, float inv_t) {
    const float s = __fmul_rn(to_f(row[j]), inv_t);
    if (s < kth) return 0.0f;
    return __fdiv_rn(expf(__fsub_rn(s, m)), S);
}

// Warp digit search for top-k: the digit d where count_above(d) < kk <= count_above(d) + hist[d].
__device__ void topk_digit_search(Smem& sm) {
    const int l = threadIdx.x & 31;
    u32 hs[8];
    u32 lsum = 0;
    for (int b = 0; b < 8; ++b) { hs[b] = sm.hc[l * 8 + b]; lsum += hs[b]; }
    u32 inc = lsum;
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_down_sync(SP_FULL, inc, o);
        if (l + o < 32) inc += t;
    }
    u32 above = inc - lsum;
    const u32 kk = sm.kk;
    int found = -1;
    u32 newk = 0;
    for (int b = 7; b >= 0; --b) {
        if (above < kk && kk <= above + hs[b]) { found = l * 8 + b; newk = kk - above; }
        above += hs[b];
    }
    if (found >= 0) { sm.digit = found; sm.kk = newk; }
}

// Warp digit search for top-p: the lowest non-empty digit d with mass strictly above it < top_p.
__device__ void topp_digit_search(Smem& sm, u64 tp) {
    const int l = threadIdx.x & 31;
    u64 hm[8];
    u32 hc[8];
    u64 lsum = 0;
    for (int b = 0; b < 8; ++b) { hm[b] = sm.hm[l * 8 + b]; hc[b] = sm.hc[l * 8 + b]; lsum += hm[b]; }
    u64 inc = lsum;
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_down_sync(SP_FULL, inc, o);
        if (l + o < 32) inc += t;
    }
    u64 a = sm.above + (inc - lsum);
    int best = 256;
    u64 best_above = 0;
    for (int b = 7; b >= 0; --b) {
        if (hc[b] > 0 && a < tp) { best = l * 8 + b; best_above = a; }
        a += hm[b];
    }
    int wbest = best;
    for (int o = 16; o > 0; o >>= 1) wbest = min(wbest, __shfl_xor_sync(SP_FULL, wbest, o));
    if (best == wbest && best < 256) { sm.digit = best; sm.above = best_above; }
    if (l == 0 && wbest == 256) sm.digit = -1;
}

// ------------------------------------------------------------------------------------------ row statistics
// A thread's next N values of row, j = base, base + SP_BLOCK, ... (0 past V), all issued before any is used:
// N loads in flight, not one memory round trip a value
template <int N, typename T>
__device__ __forceinline__ void load_ahead(float (&ahead)[N], const T* __restrict__ row, int base, int V) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
        const int j = base + u * SP_BLOCK;
        ahead[u] = j < V ? to_f(row[j]) : 0.0f;
    }
}

// row_stats' loads in flight per thread (a thread has 64 registers at 1024 a block: from 4 on, some spill)
#define SP_STATS_AHEAD 3

// Fills sm.st (shared) for one row; every thread of the block calls it.
template <typename T>
__device__ void row_stats(const T* __restrict__ row, int V, const Cfg& c, Smem& sm) {
    const int tid = threadIdx.x, lane = tid & 31;
    const bool fuse = !c.greedy && c.top_k == 0;  // softmax sum in the max pass (online rescaling)
    float vmax = neg_inf();
    int imax = SP_INT_MAX;
    double ssum = 0.0;
    bool nan = false;
    // a thread's values in the order j = tid, tid + SP_BLOCK, ..., SP_STATS_AHEAD loads in flight at a time
    for (int base = tid; base < V; base += SP_STATS_AHEAD * SP_BLOCK) {
        float ahead[SP_STATS_AHEAD];
        load_ahead(ahead, row, base, V);
#pragma unroll
        for (int u = 0; u < SP_STATS_AHEAD; ++u) {
            const int j = base + u * SP_BLOCK;
            if (j >= V) break;
            const float x = ahead[u];
            if (x != x) { nan = true; continue; }
            const float s = __fmul_rn(x, c.inv_t);
            if (s > vmax) {
                if (fuse) ssum *= exp((double)vmax - (double)s);
                vmax = s;
                imax = j;
            } else if (s == vmax && j < imax) {
                imax = j;
            }
            if (fuse && s != neg_inf()) ssum += (double)expf(__fsub_rn(s, vmax));
        }
    }
    const int any_nan = __syncthreads_or(nan);
    float m = vmax;
    int am = imax;
    block_argmax(m, am, sm);
    if (tid == 0) {
        sm.st.m = m;
        sm.st.argmax = am == SP_INT_MAX ? 0 : am;
        sm.st.nan = any_nan;
        sm.st.kth = neg_inf();
        sm.st.S = 1.0f;
        sm.st.tstar = 0.0f;
        sm.st.S2 = 1.0f;
        sm.st.pad = 0;
    }
    if (any_nan || c.greedy) { __syncthreads(); return; }

    float kth = neg_inf();
    if (c.top_k > 0 && c.top_k < V) {
        // radix select of the top_k-th largest key, 8 bits at a time from the top
        u32 prefix = 0, mask = 0;
        if (tid == 0) sm.kk = (u32)c.top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += SP_BLOCK) sm.hc[i] = 0;
            __syncthreads();
            for (int base = 0; base < V; base += SP_BLOCK) {
                const int j = base + tid;
                u32 dig = SP_NONE;
                if (j < V) {
                    const float x = to_f(row[j]);
                    const u32 key = fkey(__fmul_rn(x, c.inv_t));
                    if ((key & mask) == prefix) dig = (key >> shift) & 255u;
                }
                const u32 peers = __match_any_sync(SP_FULL, dig);
                if (dig != SP_NONE && lane == __ffs(peers) - 1) atomicAdd(&sm.hc[dig], (u32)__popc(peers));
            }
            __syncthreads();
            if (tid < 32) topk_digit_search(sm);
            __syncthreads();
            prefix |= ((u32)sm.digit) << shift;
            mask |= 255u << shift;
        }
        kth = key_to_f(prefix);
        double acc = 0.0;
        for (int j = tid; j < V; j += SP_BLOCK) {
            const float s = __fmul_rn(to_f(row[j]), c.inv_t);
            if (s >= kth) acc += (double)expf(__fsub_rn(s, m));
        }
        ssum = acc;
    } else {
        ssum = (vmax == neg_inf()) ? 0.0 : ssum * exp((double)vmax - (double)m);
    }
    const float S = (float)block_sum_d(ssum, sm);
    if (tid == 0) { sm.st.kth = kth; sm.st.S = S; }

    if (c.use_topp) {
        u32 prefix = 0, mask = 0;
        if (tid == 0) sm.above = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += SP_BLOCK) { sm.hc[i] = 0; sm.hm[i] = 0; }
            __syncthreads();
            for (int base = 0; base < V; base += SP_BLOCK) {
                const int j = base + tid;
                u32 dig = SP_NONE;
                u64 fx = 0;
                if (j < V) {
                    const float p = base_p(row, j, m, S, kth, c.inv_t);
                    const u32 key = __float_as_uint(p);
                    if ((key & mask) == prefix) {
                        dig = (key >> shift) & 255u;
                        fx = (u64)__float2ull_rz(p * 4611686018427387904.0f);  // p * 2^62, exact for p >= 2^-39
                    }
                }
                const u32 peers = __match_any_sync(SP_FULL, dig);
                if (peers == SP_FULL) {  // whole warp in one bucket: aggregate first
                    if (dig != SP_NONE) {
                        const u64 tot = warp_sum_u64(fx);
                        if (lane == 0) { atomicAdd(&sm.hc[dig], 32u); atomicAdd(&sm.hm[dig], tot); }
                    }
                } else if (dig != SP_NONE) {
                    if (lane == __ffs(peers) - 1) atomicAdd(&sm.hc[dig], (u32)__popc(peers));
                    atomicAdd(&sm.hm[dig], fx);
                }
            }
            __syncthreads();
            if (tid < 32) topp_digit_search(sm, c.tp_fixed);
            __syncthreads();
            if (sm.digit < 0) { prefix = 0; break; }  // cannot happen for top_p > 0; keep everything
            prefix |= ((u32)sm.digit) << shift;
            mask |= 255u << shift;
        }
        const float tstar = __uint_as_float(prefix);
        double acc = 0.0;
        for (int j = tid; j < V; j += SP_BLOCK) {
            const float p = base_p(row, j, m, S, kth, c.inv_t);
            if (p >= tstar) acc += (double)p;
        }
        const float S2 = (float)block_sum_d(acc, sm);
        if (tid == 0) { sm.st.tstar = tstar; sm.st.S2 = S2; }
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------ sampling
// The inverse-CDF step shared by block_sample and the wide kernel: scan tiles t0.. of pf (SP_TILE tokens each,
// token-id order) from the known sum `prefix` of the earlier tiles; the token is the first whose running sum
// exceeds `target`, clamped to the last token of nonzero probability (last_nz; V - 1 when there is none).
template <class PF>
__device__ int scan_tiles_for_target(const PF& pf, int V, int t0, int ntiles, double prefix, double target,
                                     int last_nz, Smem& sm) {
    const int tid = threadIdx.x;
    int token = -1;
    for (int t = t0; t < ntiles; ++t) {
        const int j0 = t * SP_TILE + tid * SP_ITEMS;
        float vals[SP_ITEMS];
        double loc = 0.0;
#pragma unroll
        for (int k = 0; k < SP_ITEMS; ++k) {
            const int j = j0 + k;
            vals[k] = j < V ? pf(j) : 0.0f;
            loc += (double)vals[k];
        }
        double tile_total;
        double run = prefix + block_excl_scan_d(loc, tile_total, sm);
        int cand = SP_INT_MAX;
#pragma unroll
        for (int k = 0; k < SP_ITEMS; ++k) {
            run += (double)vals[k];
            if (cand == SP_INT_MAX && j0 + k < V && run > target) cand = j0 + k;
        }
        cand = block_min_i(cand, sm);
        if (cand != SP_INT_MAX) { token = cand; break; }
        prefix += tile_total;
    }
    const int last = last_nz >= 0 ? last_nz : V - 1;
    if (token < 0 || token > last) token = last;
    return token;
}

// Inverse-CDF sample of the distribution pf (token-id order); every thread returns the token.
template <class PF>
__device__ int block_sample(const PF& pf, int V, float u, Smem& sm) {
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31;
    const int ntiles = (V + SP_TILE - 1) / SP_TILE;
    int lastnz = -1;
    for (int t = 0; t < ntiles; ++t) {
        const int j0 = t * SP_TILE + tid * SP_ITEMS;
        double acc = 0.0;
#pragma unroll
        for (int k = 0; k < SP_ITEMS; ++k) {
            const int j = j0 + k;
            if (j < V) {
                const float p = pf(j);
                acc += (double)p;
                if (p > 0.0f) lastnz = j;
            }
        }
        acc = warp_sum_d(acc);
        if (l == 0) sm.tw[t][w] = acc;
    }
    lastnz = block_max_i(lastnz, sm);  // includes a __syncthreads after the tile writes
    if (tid < ntiles) {
        double s = 0.0;
        for (int i = 0; i < SP_WARPS; ++i) s += sm.tw[tid][i];
        sm.tiles[tid] = s;
    }
    __syncthreads();
    if (tid == 0) {
        double total = 0.0;
        for (int t = 0; t < ntiles; ++t) total += sm.tiles[t];
        const double target = (double)u * total;
        double prefix = 0.0;
        int t0 = ntiles;
        for (int t = 0; t < ntiles; ++t) {
            if (prefix + sm.tiles[t] > target) { t0 = t; break; }
            prefix += sm.tiles[t];
        }
        sm.t0 = t0;
        sm.prefix = prefix;
        sm.target = target;
    }
    __syncthreads();
    return scan_tiles_for_target(pf, V, sm.t0, ntiles, sm.prefix, sm.target, lastnz, sm);
}

// ------------------------------------------------------------------------------------------ kernels
// mode 0: sample -> tokens, token_probs; mode 1: warp -> probs_out [R, V]
template <typename T>
__device__ void sample_impl(const T* __restrict__ logits, int R, int V, const float* __restrict__ uniforms,
                            const Cfg& c, int mode, long long* __restrict__ tok_out,
                            float* __restrict__ prob_out, float* __restrict__ probs_out, int* nan_flag) {
    __shared__ Smem sm;
    const int r = blockIdx.x;
    if (r >= R) return;
    const T* row = logits + (size_t)r * V;
    row_stats(row, V, c, sm);
    const RowStats st = sm.st;
    if (st.nan) {
        if (threadIdx.x == 0) {
            *(volatile int*)nan_flag = 1;
            if (mode == 0) { tok_out[r] = -1; prob_out[r] = __int_as_float(0x7fc00000); }
        }
        if (mode == 1)
            for (int j = threadIdx.x; j < V; j += SP_BLOCK) probs_out[(size_t)r * V + j] = __int_as_float(0x7fc00000);
        return;
    }
    RowP<T> pf;
    pf.row = row;
    pf.st = st;
    pf.c = c;
    if (mode == 1) {
        for (int j = threadIdx.x; j < V; j += SP_BLOCK) probs_out[(size_t)r * V + j] = pf(j);
        return;
    }
    int token;
    if (c.greedy) token = st.argmax;  // inverse CDF of a one-hot row is its argmax
    else token = block_sample(pf, V, uniforms[r], sm);
    if (threadIdx.x == 0) {
        tok_out[r] = token;
        prob_out[r] = pf(token);
    }
}

template <typename T>
__global__ void __launch_bounds__(SP_BLOCK, 1)
sp_sample(const T* __restrict__ logits, int R, int V, const float* __restrict__ uniforms, float inv_t, int greedy,
          int top_k, int use_topp, u64 tp_fixed, int mode, long long* __restrict__ tok_out,
          float* __restrict__ prob_out, float* __restrict__ probs_out, int* nan_flag) {
    Cfg c;
    c.inv_t = inv_t; c.greedy = greedy; c.top_k = top_k; c.use_topp = use_topp; c.tp_fixed = tp_fixed;
    sample_impl(logits, R, V, uniforms, c, mode, tok_out, prob_out, probs_out, nan_flag);
}

// sample_from_probs: probs float32 [R, V] (already a distribution)
extern "C" __global__ void __launch_bounds__(SP_BLOCK, 1)
sp_sample_probs(const float* __restrict__ probs, int R, int V, const float* __restrict__ uniforms,
                long long* __restrict__ tok_out) {
    __shared__ Smem sm;
    const int r = blockIdx.x;
    if (r >= R) return;
    ArrP pf;
    pf.p = probs + (size_t)r * V;
    const int token = block_sample(pf, V, uniforms[r], sm);
    if (threadIdx.x == 0) tok_out[r] = token;
}

// Tree verification.  grid = (N + 1, B): block (i, b) computes the statistics of row i of sequence b; the last
// block of sequence b to finish (atomic counter, reset by it) walks the tree.
// out_i: [B, 2 + N] int64 (accepted, next_token, path...); out_f: [3, B, N] float32 (p_draft, q_draft,
// accept_prob); tested: [B, N] uint8.  q: [B, N, V] float32 or null (one-hot drafts).  u: [B, N + 1].
// greedy_verify: plain greedy verification (Cfg must then be T = 1 without top-k/top-p).
template <typename T>
__global__ void __launch_bounds__(SP_BLOCK, 1)
sp_verify(const T* __restrict__ logits, int B, int N, int V, const long long* __restrict__ draft,
          const long long* __restrict__ parents, const float* __restrict__ q, const float* __restrict__ uniforms,
          float inv_t, int greedy, int top_k, int use_topp, u64 tp_fixed, int greedy_verify,
          RowStats* stats, u32* counters, float* scratch, long long* __restrict__ out_i,
          float* __restrict__ out_f, unsigned char* __restrict__ tested, int* nan_flag) {
    __shared__ Smem sm;
    __shared__ RowStats sst[SP_MAX_N + 1];
    __shared__ int spar[SP_MAX_N];
    __shared__ int s_last, s_action, s_child, s_x, s_mode, s_row, s_done;
    sp_let_next_start();  // a programmatic launch (kernels.cuda's `chained`) starts early and waits here
    sp_wait_for_previous();
    Cfg c;
    c.inv_t = inv_t; c.greedy = greedy; c.top_k = top_k; c.use_topp = use_topp; c.tp_fixed = tp_fixed;
    const int tid = threadIdx.x;
    const int i = blockIdx.x, b = blockIdx.y;
    const int R1 = N + 1;
    const T* rows = logits + (size_t)b * R1 * V;

    // ---- phase 1: statistics of row i
    row_stats(rows + (size_t)i * V, V, c, sm);
    if (tid == 0) {
        stats[(size_t)b * R1 + i] = sm.st;
        __threadfence();
        const u32 old = atomicAdd(&counters[b], 1u);
        s_last = (old == (u32)N);
    }
    __syncthreads();
    if (!s_last) return;

    // ---- phase 2 (last block of sequence b)
    if (tid == 0) counters[b] = 0;
    __threadfence();
    for (int r = tid; r < R1; r += SP_BLOCK) {
        volatile const RowStats* src = stats + (size_t)b * R1 + r;
        RowStats s;
        s.m = src->m; s.kth = src->kth; s.S = src->S; s.tstar = src->tstar; s.S2 = src->S2;
        s.argmax = src->argmax; s.nan = src->nan; s.pad = 0;
        sst[r] = s;
    }
    for (int n = tid; n < N; n += SP_BLOCK) spar[n] = (int)parents[n];
    long long* oi = out_i + (size_t)b * (2 + N);
    float* p_draft = out_f + (size_t)b * N;
    float* q_draft = out_f + (size_t)B * N + (size_t)b * N;
    float* acc_p = out_f + (size_t)2 * B * N + (size_t)b * N;
    unsigned char* tst = tested + (size_t)b * N;
    for (int n = tid; n < N; n += SP_BLOCK) {
        oi[2 + n] = -1; p_draft[n] = 0.0f; q_draft[n] = 1.0f; acc_p[n] = 0.0f; tst[n] = 0;
    }
    __syncthreads();
    int anynan = 0;
    for (int r = 0; r < R1; ++r) anynan |= sst[r].nan;
    if (anynan) {
        if (tid == 0) { *(volatile int*)nan_flag = 1; oi[0] = -1; oi[1] = -1; }
        return;
    }
    const long long* dr = draft + (size_t)b * N;
    const float* ub = uniforms + (size_t)b * R1;

    if (greedy_verify) {
        if (tid == 0) {
            int node = -1, depth = 0;
            while (true) {
                const int row = node + 1;
                const int want = sst[row].argmax;
                int match = -1;
                for (int ch = 0; ch < N; ++ch) {
                    if (spar[ch] != node) continue;
                    const long long x = dr[ch];
                    tst[ch] = 1;
                    p_draft[ch] = (x >= 0 && x < V) ? warped_p(to_f(rows[(size_t)row * V + x]), (int)x, sst[row], c) : 0.0f;
                    if (x == (long long)want) { acc_p[ch] = 1.0f; match = ch; break; }
                }
                if (match < 0) { oi[1] = want; break; }
                oi[2 + depth] = match;
                ++depth;
                node = match;
            }
            oi[0] = depth;
        }
        return;
    }

    // stochastic: walk the tree; p is row `s_row` (mode 0) or the residual in scratch (mode 1)
    float* res = scratch + (size_t)b * V;
    int node = -1, depth = 0, cstart = 0;  // thread 0's state
    if (tid == 0) { s_mode = 0; s_row = 0; s_done = 0; }
    __syncthreads();
    while (true) {
        if (tid == 0) {
            int action = 2;  // 0: accepted a child, 1: rejected child s_child -> residual, 2: sample next token
            for (int ch = cstart; ch < N; ++ch) {
                if (spar[ch] != node) continue;
                const long long x = dr[ch];
                const bool ok = x >= 0 && x < V;
                float px = 0.0f;
                if (ok) px = s_mode == 0 ? warped_p(to_f(rows[(size_t)s_row * V + x]), (int)x, sst[s_row], c) : res[x];
                const float qx = q ? (ok ? q[((size_t)b * N + ch) * V + x] : 0.0f) : 1.0f;
                const double accept = qx <= 0.0f ? 1.0 : fmin(1.0, (double)px / (double)qx);
                tst[ch] = 1;
                p_draft[ch] = px;
                q_draft[ch] = qx;
                acc_p[ch] = (float)accept;
                if ((double)ub[ch] < accept) {
                    oi[2 + depth] = ch;
                    ++depth;
                    node = ch;
                    cstart = 0;
                    s_mode = 0;
                    s_row = ch + 1;
                    action = 0;
                } else {
                    cstart = ch + 1;
                    s_child = ch;
                    s_x = ok ? (int)x : -1;
                    action = 1;
                }
                break;
            }
            s_action = action;
        }
        __syncthreads();
        const int action = s_action;
        if (action == 0) { __syncthreads(); continue; }
        if (action == 1) {
            // p <- normalize(max(p - q, 0)), or p unchanged when nothing is left
            const int ch = s_child, x = s_x, mode = s_mode, row = s_row;
            const float* qrow = q ? q + ((size_t)b * N + ch) * V : nullptr;
            const T* lrow = rows + (size_t)row * V;
            const RowStats st = sst[row];
            double acc = 0.0;
            for (int j = tid; j < V; j += SP_BLOCK) {
                const float p = mode == 0 ? warped_p(to_f(lrow[j]), j, st, c) : res[j];
                const float qq = qrow ? qrow[j] : (j == x ? 1.0f : 0.0f);
                const float r = __fsub_rn(p, qq);
                acc += r > 0.0f ? (double)r : 0.0;
            }
            const float total = (float)block_sum_d(acc, sm);
            if (total > 0.0f) {
                for (int j = tid; j < V; j += SP_BLOCK) {
                    const float p = mode == 0 ? warped_p(to_f(lrow[j]), j, st, c) : res[j];
                    const float qq = qrow ? qrow[j] : (j == x ? 1.0f : 0.0f);
                    const float r = __fsub_rn(p, qq);
                    res[j] = __fdiv_rn(r > 0.0f ? r : 0.0f, total);
                }
                __syncthreads();
                if (tid == 0) s_mode = 1;
            }
            __syncthreads();
            continue;
        }
        // action 2: sample the correction / bonus token from the current p
        int token;
        const float u = ub[N];
        if (s_mode == 0) {
            const int row = s_row;
            if (c.greedy) {
                token = sst[row].argmax;
            } else {
                RowP<T> pf;
                pf.row = rows + (size_t)row * V;
                pf.st = sst[row];
                pf.c = c;
                token = block_sample(pf, V, u, sm);
            }
        } else {
            ArrP pf;
            pf.p = res;
            token = block_sample(pf, V, u, sm);
        }
        if (tid == 0) { oi[0] = depth; oi[1] = token; }
        break;
    }
}

// ================================================================================================ wide path
// One persistent launch spreads every row over many blocks (chunks of SP_TILE tokens) and joins its phases
// with grid barriers (all blocks are co-resident: the grid is at most one block per SM).  Used for sampling
// and chain verification without top-k / top-p; the arithmetic of each value is the one-block kernels'.
// kind 0: sample (R = B rows, uniforms [B]); kind 1: stochastic chain verify; kind 2: greedy chain verify.
// ws: Part1 [B, N+1, C] | RowStats [B, N+1] | Walk [B] | double P2 [B, C] | double P3 [B, C] | int L3 [B, C]
// sync (zeroed, left zeroed): bar[0] arrivals, bar[1] exits, counters[B] from sync + 2.
struct Part1 { double s; float m; int arg; int nan; int pad; };
struct Walk { int skip; int res; int row; int x; };

// loads that bypass L1 (data written by other blocks of the same launch)
__device__ __forceinline__ float ldcg(const float* p) { float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p)); return v; }
__device__ __forceinline__ int ldcg(const int* p) { int v; asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p)); return v; }
__device__ __forceinline__ double ldcg(const double* p) { double v; asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(v) : "l"(p)); return v; }

__device__ __forceinline__ void grid_barrier(u32* bar, u32 G, u32 epoch, int* err) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        const u32 target = epoch * G;
        const long long t0 = clock64();
        while (*(volatile u32*)bar < target) {
            if (clock64() - t0 > (1LL << 34)) { *(volatile int*)err = 2; break; }  // never expected
        }
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ RowStats load_stats(const RowStats* p) {
    RowStats s;
    s.m = ldcg(&p->m); s.kth = ldcg(&p->kth); s.S = ldcg(&p->S); s.tstar = ldcg(&p->tstar);
    s.S2 = ldcg(&p->S2); s.argmax = ldcg(&p->argmax); s.nan = ldcg(&p->nan); s.pad = 0;
    return s;
}

template <typename T>
__global__ void __launch_bounds__(SP_BLOCK, 1)
sp_wide(const T* __restrict__ logits, int B, int N, int V, const long long* __restrict__ draft,
        const float* __restrict__ q, const float* __restrict__ uniforms, float inv_t, int greedy, int kind,
        char* ws, u32* sync, long long* __restrict__ out_i, float* __restrict__ out_f,
        unsigned char* __restrict__ tested, long long* __restrict__ tok_out, float* __restrict__ prob_out,
        int* nan_flag) {
    __shared__ Smem sm;
    __shared__ RowStats sst[SP_MAX_N + 1];
    __shared__ float s_px[SP_MAX_N], s_qx[SP_MAX_N];
    __shared__ double s_acc[SP_MAX_N];
    __shared__ int s_match[SP_MAX_N];
    __shared__ double s_cs[SP_MAX_TILES];
    __shared__ int s_last;
    __shared__ float s_total;
    // every block is resident once it triggers, so a dependent launched early cannot crowd the grid barrier
    sp_let_next_start();
    sp_wait_for_previous();
    Cfg c;
    c.inv_t = inv_t; c.greedy = greedy; c.top_k = 0; c.use_topp = 0; c.tp_fixed = 0;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const u32 G = gridDim.x;
    const int R1 = N + 1;
    const int C = (V + SP_TILE - 1) / SP_TILE;
    Part1* p1 = (Part1*)ws;
    RowStats* rs = (RowStats*)(p1 + (size_t)B * R1 * C);
    Walk* wk = (Walk*)(rs + (size_t)B * R1);
    double* p2 = (double*)(wk + B + (B & 1));
    double* p3 = p2 + (size_t)B * C;
    int* l3 = (int*)(p3 + (size_t)B * C);
    u32* bar = sync;
    u32* counters = sync + 2;
    u32 epoch = 0;

    // ---- phase 1: per-chunk max / first argmax / fp64 sum of exp(s - chunk max) / NaN
    const int n1 = B * R1 * C;
    for (int t = blockIdx.x; t < n1; t += G) {
        const int cc = t % C, br = t / C;
        const T* row = logits + (size_t)br * V;
        const int j0 = cc * SP_TILE + tid * SP_ITEMS;
        float s[SP_ITEMS];
        bool valid[SP_ITEMS];
        bool nan = false;
        float vmax = neg_inf();
        int imax = SP_INT_MAX;
#pragma unroll
        for (int k = 0; k < SP_ITEMS; ++k) {
            const int j = j0 + k;
            valid[k] = false;
            s[k] = neg_inf();
            if (j < V) {
                const float x = to_f(row[j]);
                if (x != x) { nan = true; }
                else {
                    valid[k] = true;
                    s[k] = __fmul_rn(x, c.inv_t);
                    if (s[k] > vmax || (s[k] == vmax && j < imax)) { vmax = s[k]; imax = j; }
                }
            }
        }
        const int any_nan = __syncthreads_or(nan);
        block_argmax(vmax, imax, sm);
        double acc = 0.0;
        if (!c.greedy && vmax != neg_inf()) {
#pragma unroll
            for (int k = 0; k < SP_ITEMS; ++k)
                if (valid[k] && s[k] != neg_inf()) acc += (double)expf(__fsub_rn(s[k], vmax));
        }
        acc = block_sum_d(acc, sm);
        if (tid == 0) {
            Part1 p;
            p.s = acc; p.m = vmax; p.arg = imax; p.nan = any_nan; p.pad = 0;
            p1[t] = p;
        }
    }
    grid_barrier(bar, G, ++epoch, nan_flag);

    // ---- walk: one block per sequence combines its row statistics and tests the chain
    for (int b = blockIdx.x; b < B; b += G) {
        for (int r = wid; r < R1; r += SP_WARPS) {
            const Part1* pp = p1 + ((size_t)b * R1 + r) * C;
            float m = neg_inf();
            int am = SP_INT_MAX, nan = 0;
            for (int cc = lane; cc < C; cc += 32) {
                const float cm = ldcg(&pp[cc].m);
                const int ca = ldcg(&pp[cc].arg);
                nan |= ldcg(&pp[cc].nan);
                if (ca != SP_INT_MAX) argmax_combine(m, am, cm, ca);
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float om = __shfl_xor_sync(SP_FULL, m, o);
                const int oa = __shfl_xor_sync(SP_FULL, am, o);
                argmax_combine(m, am, om, oa);
                nan |= __shfl_xor_sync(SP_FULL, nan, o);
            }
            double ssum = 0.0;
            if (m != neg_inf()) {
                for (int cc = lane; cc < C; cc += 32) {
                    const float cm = ldcg(&pp[cc].m);
                    if (cm != neg_inf()) ssum += ldcg(&pp[cc].s) * exp((double)cm - (double)m);
                }
            }
            ssum = warp_sum_d(ssum);
            if (lane == 0) {
                RowStats st;
                st.m = m; st.argmax = am == SP_INT_MAX ? 0 : am; st.nan = nan; st.kth = neg_inf();
                st.S = c.greedy ? 1.0f : (float)ssum; st.tstar = 0.0f; st.S2 = 1.0f; st.pad = 0;
                sst[r] = st;
                rs[(size_t)b * R1 + r] = st;
            }
        }
        __syncthreads();
        int anynan = 0;
        for (int r = 0; r < R1; ++r) anynan |= sst[r].nan;
        const T* rows = logits + (size_t)b * R1 * V;
        if (!anynan) {
            for (int i = tid; i < N; i += SP_BLOCK) {  // node i is tested against row i
                const long long x = draft[(size_t)b * N + i];
                const bool ok = x >= 0 && x < V;
                const float px = ok ? warped_p(to_f(rows[(size_t)i * V + x]), (int)x, sst[i], c) : 0.0f;
                s_px[i] = px;
                if (kind == 2) {
                    s_qx[i] = 1.0f;
                    s_match[i] = x == (long long)sst[i].argmax;
                    s_acc[i] = s_match[i] ? 1.0 : 0.0;
                } else {
                    const float qx = q ? (ok ? q[((size_t)b * N + i) * V + x] : 0.0f) : 1.0f;
                    s_qx[i] = qx;
                    s_acc[i] = qx <= 0.0f ? 1.0 : fmin(1.0, (double)px / (double)qx);
                    s_match[i] = (double)uniforms[(size_t)b * R1 + i] < s_acc[i];
                }
            }
        }
        __syncthreads();
        if (tid == 0) {
            Walk w;
            w.skip = 1; w.res = 0; w.row = 0; w.x = -1;
            if (kind == 0) {
                if (anynan) {
                    *(volatile int*)nan_flag = 1;
                    tok_out[b] = -1; prob_out[b] = __int_as_float(0x7fc00000);
                } else if (c.greedy) {
                    tok_out[b] = sst[0].argmax; prob_out[b] = 1.0f;
                } else {
                    w.skip = 0;
                }
            } else {
                long long* oi = out_i + (size_t)b * (2 + N);
                float* p_draft = out_f + (size_t)b * N;
                float* q_draft = out_f + (size_t)B * N + (size_t)b * N;
                float* acc_p = out_f + (size_t)2 * B * N + (size_t)b * N;
                unsigned char* tst = tested + (size_t)b * N;
                for (int n = 0; n < N; ++n) {
                    oi[2 + n] = -1; p_draft[n] = 0.0f; q_draft[n] = 1.0f; acc_p[n] = 0.0f; tst[n] = 0;
                }
                if (anynan) {
                    *(volatile int*)nan_flag = 1;
                    oi[0] = -1; oi[1] = -1;
                } else {
                    int d = 0;
                    while (d < N) {
                        tst[d] = 1; p_draft[d] = s_px[d]; q_draft[d] = s_qx[d]; acc_p[d] = (float)s_acc[d];
                        if (!s_match[d]) break;
                        oi[2 + d] = d;
                        ++d;
                    }
                    oi[0] = d;
                    if (kind == 2) {
                        oi[1] = sst[d].argmax;
                    } else if (d < N) {
                        const long long x = draft[(size_t)b * N + d];
                        w.skip = 0; w.res = 1; w.row = d; w.x = (x >= 0 && x < V) ? (int)x : -1;
                    } else if (c.greedy) {
                        oi[1] = sst[N].argmax;
                    } else {
                        w.skip = 0; w.row = N;
                    }
                }
            }
            wk[b] = w;
        }
        __syncthreads();
    }
    if (kind != 2) {
        grid_barrier(bar, G, ++epoch, nan_flag);
        const int n2 = B * C;
        // ---- phase 2 (stochastic verify): chunk sums of max(p - q, 0) on the rejection row
        if (kind == 1) {
            for (int t = blockIdx.x; t < n2; t += G) {
                const int cc = t % C, b = t / C;
                const int skip = ldcg(&wk[b].skip), res = ldcg(&wk[b].res);
                if (skip || !res) continue;
                const int row = ldcg(&wk[b].row), x = ldcg(&wk[b].x);
                const RowStats st = load_stats(rs + (size_t)b * R1 + row);
                const T* lrow = logits + ((size_t)b * R1 + row) * V;
                const float* qrow = q ? q + ((size_t)b * N + row) * V : nullptr;
                const int j0 = cc * SP_TILE + tid * SP_ITEMS;
                double acc = 0.0;
#pragma unroll
                for (int k = 0; k < SP_ITEMS; ++k) {
                    const int j = j0 + k;
                    if (j < V) {
                        const float p = warped_p(to_f(lrow[j]), j, st, c);
                        const float qq = qrow ? qrow[j] : (j == x ? 1.0f : 0.0f);
                        const float r = __fsub_rn(p, qq);
                        acc += r > 0.0f ? (double)r : 0.0;
                    }
                }
                acc = block_sum_d(acc, sm);
                if (tid == 0) p2[t] = acc;
            }
            grid_barrier(bar, G, ++epoch, nan_flag);
        }
        // ---- phase 3: chunk sums of the sampled distribution; the last block of a sequence finds the token
        int cur_b = -1;
        for (int t = blockIdx.x; t < n2; t += G) {
            const int cc = t % C, b = t / C;
            const int skip = ldcg(&wk[b].skip);
            if (skip) continue;
            const int res = ldcg(&wk[b].res), row = ldcg(&wk[b].row), x = ldcg(&wk[b].x);
            if (b != cur_b) {
                cur_b = b;
                if (res) {  // residual total: same fixed-order reduction in every block
                    if (wid == 0) {
                        double a = 0.0;
                        for (int k = lane; k < C; k += 32) a += ldcg(&p2[(size_t)b * C + k]);
                        a = warp_sum_d(a);
                        if (lane == 0) s_total = (float)a;
                    }
                    __syncthreads();
                }
            }
            const float total = res ? s_total : 0.0f;
            const bool use_res = res && total > 0.0f;
            const RowStats st = load_stats(rs + (size_t)b * R1 + row);
            const T* lrow = logits + ((size_t)b * R1 + row) * V;
            const float* qrow = (q && use_res) ? q + ((size_t)b * N + row) * V : nullptr;
            auto pf = [&](int j) -> float {
                const float p = warped_p(to_f(lrow[j]), j, st, c);
                if (!use_res) return p;
                const float qq = qrow ? qrow[j] : (j == x ? 1.0f : 0.0f);
                const float r = __fsub_rn(p, qq);
                return __fdiv_rn(r > 0.0f ? r : 0.0f, total);
            };
            const int j0 = cc * SP_TILE + tid * SP_ITEMS;
            double acc = 0.0;
            int lastnz = -1;
#pragma unroll
            for (int k = 0; k < SP_ITEMS; ++k) {
                const int j = j0 + k;
                if (j < V) {
                    const float p = pf(j);
                    acc += (double)p;
                    if (p > 0.0f) lastnz = j;
                }
            }
            // same grouping as block_sample's tile sums: warp sums, then warps in order
            acc = warp_sum_d(acc);
            __syncthreads();
            if (lane == 0) sm.red[wid] = acc;
            lastnz = block_max_i(lastnz, sm);
            if (tid == 0) {
                double s = 0.0;
                for (int i = 0; i < SP_WARPS; ++i) s += sm.red[i];
                p3[t] = s;
                l3[t] = lastnz;
                __threadfence();
                const u32 old = atomicAdd(&counters[b], 1u);
                s_last = (old == (u32)(C - 1));
            }
            __syncthreads();
            if (!s_last) continue;
            // last block of sequence b: inverse CDF over the chunk sums, then scan inside the chunk
            if (tid == 0) counters[b] = 0;
            __threadfence();
            int lz = -1;
            for (int k = tid; k < C; k += SP_BLOCK) {
                s_cs[k] = ldcg(&p3[(size_t)b * C + k]);
                lz = max(lz, ldcg(&l3[(size_t)b * C + k]));
            }
            lz = block_max_i(lz, sm);
            if (tid == 0) {
                double tot = 0.0;
                for (int k = 0; k < C; ++k) tot += s_cs[k];
                const double target = (double)uniforms[(size_t)b * R1 + N] * tot;
                double prefix = 0.0;
                int t0 = C;
                for (int k = 0; k < C; ++k) {
                    if (prefix + s_cs[k] > target) { t0 = k; break; }
                    prefix += s_cs[k];
                }
                sm.t0 = t0; sm.prefix = prefix; sm.target = target;
            }
            __syncthreads();
            const int token = scan_tiles_for_target(pf, V, sm.t0, C, sm.prefix, sm.target, lz, sm);
            if (tid == 0) {
                if (kind == 0) { tok_out[b] = token; prob_out[b] = pf(token); }
                else out_i[(size_t)b * (2 + N) + 1] = token;
            }
            __syncthreads();
        }
    }
    // exit: the last block out resets the barrier (every block has left every barrier by then)
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        const u32 old = atomicAdd(&bar[1], 1u);
        if (old == G - 1) { bar[0] = 0; bar[1] = 0; __threadfence(); }
    }
}

// ------------------------------------------------------------------------------------------ round readout
// Everything the host reads of a one-sequence round, as one float32 vector (ids are exact below 2^24):
//   out = [accepted, next_token, path[N], draft[N], p[N], q[N], accept_prob[N], tested[N],
//          next_p[R], top_p[R, W], top_i[R, W]]      R = N + 1 rows of logits [R, V], W <= SP_READ_MAX_W
// under p = softmax(x * inv_t): next_p[r] is row r's p of next_token[0], top_* its W most probable tokens
// (ties -> the smaller id).  grid = (R, 1): block r reads row r; block 0 also copies the verdict.
// Each thread keeps its best SP_READ_MAX_W (value, id) in registers; W rounds of a warp argmax over the
// threads' heads merge them per warp, then warp 0 merges the warps' lists the same way.
#define SP_READ_MAX_W 8

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(SP_FULL, v, o);
        const int oi = __shfl_xor_sync(SP_FULL, i, o);
        argmax_combine(v, i, ov, oi);
    }
}

// W rounds: every lane offers the head of its sorted list (vals/ids, `count` long); the winner pops it.
// Lane 0 ends with the merged W best in out_v/out_i.
__device__ __forceinline__ void warp_merge_lists(const float* vals, const int* ids, int count, int W,
                                                 float* out_v, int* out_i) {
    int head = 0;
    for (int k = 0; k < W; ++k) {
        float v = neg_inf();
        int i = SP_INT_MAX;
        #pragma unroll
        for (int h = 0; h < SP_READ_MAX_W; ++h)
            if (h == head && h < count) { v = vals[h]; i = ids[h]; }
        float mv = v;
        int mi = i;
        warp_argmax(mv, mi);
        if (mi == i && mi != SP_INT_MAX) ++head;  // ids are distinct: only the owner pops
        if ((threadIdx.x & 31) == 0) { out_v[k] = mv; out_i[k] = mi; }
    }
}

// sp_readout's per-row shared memory: the warps' best lists, then the row's merged W best.
struct ReadSmem {
    float wv[SP_WARPS][SP_READ_MAX_W];
    int wi[SP_WARPS][SP_READ_MAX_W];
    float tv[SP_READ_MAX_W];
    int ti[SP_READ_MAX_W];
};

struct ReadRow {
    float m;     // max of the scaled row
    float S;     // sum of exp(scaled - m), fp64 block sum rounded once
    int argmax;  // first index of the max (0 for a row of -inf)
    int nan;     // the row holds a NaN
};

// One block's row of a readout: its W most probable tokens under softmax(x * inv_t) into top_p[W], top_i[W]
// (ties -> the smaller id), and the row's statistics, the same for every thread on return.
template <typename T>
__device__ ReadRow readout_row(const T* __restrict__ row, int V, float inv_t, int W, float* top_p, float* top_i,
                               Smem& sm, ReadSmem& rs) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float bv[SP_READ_MAX_W];
    int bi[SP_READ_MAX_W];
    #pragma unroll
    for (int h = 0; h < SP_READ_MAX_W; ++h) { bv[h] = neg_inf(); bi[h] = SP_INT_MAX; }
    bool nan = false;
    for (int base = tid; base < V; base += SP_LOADS_AHEAD * SP_BLOCK) {  // ids rise: a tie keeps the earlier
        float ahead[SP_LOADS_AHEAD];                                      // id in front
        #pragma unroll
        for (int u = 0; u < SP_LOADS_AHEAD; ++u) {
            const int j = base + u * SP_BLOCK;
            ahead[u] = j < V ? to_f(row[j]) * inv_t : neg_inf();  // -inf never enters
        }
        #pragma unroll
        for (int u = 0; u < SP_LOADS_AHEAD; ++u) {
            float v = ahead[u];
            nan |= v != v;
            if (v > bv[SP_READ_MAX_W - 1]) {
                int i = base + u * SP_BLOCK;
                #pragma unroll
                for (int h = 0; h < SP_READ_MAX_W; ++h) {
                    if (v > bv[h]) {
                        const float tv = bv[h]; const int ti = bi[h];
                        bv[h] = v; bi[h] = i; v = tv; i = ti;
                    }
                }
            }
        }
    }
    const int any_nan = __syncthreads_or(nan);
    warp_merge_lists(bv, bi, SP_READ_MAX_W, W, rs.wv[warp], rs.wi[warp]);
    __syncthreads();
    if (warp == 0) {
        float lv[SP_READ_MAX_W];
        int li[SP_READ_MAX_W];
        #pragma unroll
        for (int h = 0; h < SP_READ_MAX_W; ++h) {
            const bool mine = lane < SP_WARPS && h < W;
            lv[h] = mine ? rs.wv[lane][h] : neg_inf();
            li[h] = mine ? rs.wi[lane][h] : SP_INT_MAX;
        }
        warp_merge_lists(lv, li, W, W, rs.tv, rs.ti);
    }
    __syncthreads();
    const float m = rs.tv[0];
    double s = 0.0;
    for (int base = tid; base < V; base += SP_LOADS_AHEAD * SP_BLOCK) {  // loads first, then the sum in order
        float ahead[SP_LOADS_AHEAD];
        load_ahead(ahead, row, base, V);
        #pragma unroll
        for (int u = 0; u < SP_LOADS_AHEAD; ++u)
            if (base + u * SP_BLOCK < V) s += (double)expf(ahead[u] * inv_t - m);
    }
    const float S = (float)block_sum_d(s, sm);
    if (tid < W) {
        const int id = rs.ti[tid];
        top_p[tid] = id == SP_INT_MAX ? 0.0f : expf(rs.tv[tid] - m) / S;
        top_i[tid] = id == SP_INT_MAX ? 0.0f : (float)id;
    }
    ReadRow out;
    out.m = m; out.S = S; out.argmax = rs.ti[0] == SP_INT_MAX ? 0 : rs.ti[0]; out.nan = any_nan;
    return out;
}

template <typename T>
__global__ void __launch_bounds__(SP_BLOCK, 1)
sp_readout(const T* __restrict__ logits, int R, int V, float inv_t, int W, const long long* __restrict__ accepted,
           const long long* __restrict__ next_token, const long long* __restrict__ path,
           const long long* __restrict__ draft, const float* __restrict__ p_draft,
           const float* __restrict__ q_draft, const float* __restrict__ accept_prob,
           const unsigned char* __restrict__ tested, float* __restrict__ out) {
    __shared__ Smem sm;
    __shared__ ReadSmem rs;
    const int tid = threadIdx.x;
    const int r = blockIdx.x, N = R - 1;
    sp_let_next_start();
    sp_wait_for_previous();
    if (r == 0) {
        for (int j = tid; j < 2 + 6 * N; j += SP_BLOCK) {
            float v;
            if (j == 0) v = (float)accepted[0];
            else if (j == 1) v = (float)next_token[0];
            else {
                const int part = (j - 2) / N, e = (j - 2) - part * N;
                v = part == 0 ? (float)path[e] : part == 1 ? (float)draft[e] : part == 2 ? p_draft[e]
                  : part == 3 ? q_draft[e] : part == 4 ? accept_prob[e] : (float)tested[e];
            }
            out[j] = v;
        }
    }
    float* next_p = out + 2 + 6 * N;
    float* top_p = next_p + R;
    float* top_i = top_p + (size_t)R * W;
    const T* row = logits + (size_t)r * V;
    const ReadRow st = readout_row<T>(row, V, inv_t, W, top_p + (size_t)r * W, top_i + (size_t)r * W, sm, rs);
    if (tid == 0) {
        const long long nt = next_token[0];
        const int j = nt < 0 ? 0 : (nt >= V ? V - 1 : (int)nt);
        next_p[r] = expf(to_f(row[j]) * inv_t - st.m) / st.S;
    }
}

// A greedy round's verification and readout in one launch (batch 1), in place of sp_verify's greedy walk (or
// sp_wide's chain), the cut of a chain at its real drafts and sp_readout at T = 1: the same outputs.  grid = (R, 1), R = N + 1: block
// r reads row r (readout_row: its top W into the readout, its statistics into stats[r]); the last block to
// finish (counter: zero before, left zero) walks the tree `parents` [N] (null: a chain) from the root, testing
// node ch against row parent + 1 (p_draft = softmax there at T = 1; a match with the row's first argmax is
// accepted), then cuts a chain at limit[0] real drafts where limit is given (chain_limit_reference's rule), and
// writes the verdict: out_i [2 + N] (accepted, next_token, path), out_f [3, N] (p_draft, q_draft, accept_prob),
// tested [N], and the readout's header and next_p.  A NaN in any row: accepted = next_token = -1, the flag set.
template <typename T>
__global__ void __launch_bounds__(SP_BLOCK, 1)
sp_greedy_readout(const T* __restrict__ logits, int R, int V, int W, const long long* __restrict__ draft,
                  const long long* __restrict__ parents, const long long* __restrict__ limit, RowStats* stats,
                  u32* counter, long long* __restrict__ out_i, float* __restrict__ out_f,
                  unsigned char* __restrict__ tested, float* __restrict__ out, int* nan_flag) {
    __shared__ Smem sm;
    __shared__ ReadSmem rs;
    __shared__ RowStats sst[SP_MAX_N + 1];
    __shared__ int s_last;
    const int tid = threadIdx.x, r = blockIdx.x, N = R - 1;
    sp_let_next_start();
    sp_wait_for_previous();
    float* next_p = out + 2 + 6 * N;
    float* top_p = next_p + R;
    float* top_i = top_p + (size_t)R * W;
    const ReadRow rr = readout_row<T>(logits + (size_t)r * V, V, 1.0f, W, top_p + (size_t)r * W,
                                      top_i + (size_t)r * W, sm, rs);
    if (tid == 0) {
        RowStats st;
        st.m = rr.m; st.kth = neg_inf(); st.S = rr.S; st.tstar = 0.0f; st.S2 = 1.0f;
        st.argmax = rr.argmax; st.nan = rr.nan; st.pad = 0;
        stats[r] = st;
        __threadfence();
        s_last = atomicAdd(counter, 1u) == (u32)N;
    }
    __syncthreads();
    if (!s_last) return;

    if (tid == 0) *counter = 0;
    __threadfence();
    for (int i = tid; i < R; i += SP_BLOCK) {
        volatile const RowStats* src = stats + i;
        RowStats s;
        s.m = src->m; s.kth = src->kth; s.S = src->S; s.tstar = src->tstar; s.S2 = src->S2;
        s.argmax = src->argmax; s.nan = src->nan; s.pad = 0;
        sst[i] = s;
    }
    // the verdict is made in shared memory by thread 0, then written out by every thread
    __shared__ long long s_verdict[2];  // accepted, next_token
    __shared__ int s_path[SP_MAX_N];
    __shared__ float s_p[SP_MAX_N], s_acc[SP_MAX_N];
    __shared__ unsigned char s_tested[SP_MAX_N];
    for (int n = tid; n < N; n += SP_BLOCK) { s_path[n] = -1; s_p[n] = 0.0f; s_acc[n] = 0.0f; s_tested[n] = 0; }
    __syncthreads();
    if (tid == 0) {
        int anynan = 0;
        for (int i = 0; i < R; ++i) anynan |= sst[i].nan;
        long long accepted = -1, next = -1;
        if (anynan) {
            *(volatile int*)nan_flag = 1;
        } else {
            Cfg c;  // T = 1, no top-k / top-p: warped_p is the row's softmax
            c.inv_t = 1.0f; c.greedy = 0; c.top_k = 0; c.use_topp = 0; c.tp_fixed = 0;
            int node = -1, depth = 0;
            while (true) {
                const int row = node + 1;
                const int want = sst[row].argmax;
                int match = -1;
                for (int ch = parents ? 0 : node + 1; ch < N; ++ch) {
                    if (parents && parents[ch] != node) continue;
                    const long long x = draft[ch];
                    s_tested[ch] = 1;
                    s_p[ch] = (x >= 0 && x < V) ? warped_p(to_f(logits[(size_t)row * V + x]), (int)x, sst[row], c)
                                                : 0.0f;
                    if (x == (long long)want) { s_acc[ch] = 1.0f; match = ch; break; }
                    if (!parents) break;  // a chain's node has one child
                }
                if (match < 0) { next = want; break; }
                s_path[depth] = match;
                ++depth;
                node = match;
            }
            accepted = depth;
        }
        if (limit) {  // sp_chain_limit's cut, also over a NaN verdict
            const long long real = limit[0], kept = min(accepted, real);
            for (int j = 0; j < N; ++j) {
                if (j >= kept) s_path[j] = -1;
                if (j >= real) s_tested[j] = 0;
            }
            if (accepted > real && next >= 0) next = draft[min(real, (long long)N - 1)];
            accepted = kept;
        }
        s_verdict[0] = accepted;
        s_verdict[1] = next;
    }
    __syncthreads();
    for (int n = tid; n < N; n += SP_BLOCK) {
        out_i[2 + n] = s_path[n];
        out_f[n] = s_p[n];
        out_f[N + n] = 1.0f;  // q: one-hot drafts
        out_f[2 * N + n] = s_acc[n];
        tested[n] = s_tested[n];
    }
    if (tid < 2) out_i[tid] = s_verdict[tid];
    for (int j = tid; j < 2 + 6 * N; j += SP_BLOCK) {
        float v;
        if (j < 2) v = (float)s_verdict[j];
        else {
            const int part = (j - 2) / N, e = (j - 2) - part * N;
            v = part == 0 ? (float)s_path[e] : part == 1 ? (float)draft[e] : part == 2 ? s_p[e]
              : part == 3 ? 1.0f : part == 4 ? s_acc[e] : (float)s_tested[e];
        }
        out[j] = v;
    }
    const long long nt = s_verdict[1];
    const int j = nt < 0 ? 0 : (nt >= V ? V - 1 : (int)nt);
    for (int i = tid; i < R; i += SP_BLOCK)
        next_p[i] = expf(to_f(logits[(size_t)i * V + j]) - sst[i].m) / sst[i].S;
}
