// specplay: dtype helpers shared by the step and decode kernels (kernels/step.py prepends this file).
//
// No headers: NVRTC compiles this as is (bf16/fp16 are raw 16-bit words).  Rounding to bf16/fp16 is round to
// nearest even, as torch rounds.

typedef unsigned int u32;

// Loops that keep a running best (a row's top values) issue this many of a thread's loads before they compare
// any: a compare-and-insert between loads leaves one load in flight per thread, and a short row's scan is then
// its loads' round trips one after another (engine/kernels/launch_spec.py's LOADS_AHEAD is passed in; 1 would
// be the one-at-a-time scan, the same results either way)
#ifndef SP_LOADS_AHEAD
#define SP_LOADS_AHEAD 8
#endif

struct bf16_t { unsigned short v; };
struct f16_t { unsigned short v; };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(((u32)x.v) << 16); }
__device__ __forceinline__ float to_f(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) {
    u32 b = __float_as_uint(f);
    bf16_t out;
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu)) {  // NaN stays NaN
        out.v = (unsigned short)((b >> 16) | 0x40u);
        return out;
    }
    b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest, ties to even
    out.v = (unsigned short)(b >> 16);
    return out;
}
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) {
    f16_t out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.v) : "f"(f));
    return out;
}
template <typename T> __device__ __forceinline__ T rnd(float f) { return from_f<T>(f); }

// Programmatic dependent launch (sm_90 on): a kernel launched with the programmatic-serialization attribute
// (kernels/step.py does so for the step kernels) may start while the stream's previous kernel still runs.  It
// must wait before it reads anything that kernel writes or writes anything it reads; the wait returns once the
// previous kernel has finished and its writes are visible.  Without the attribute, or below sm_90, both are
// no-ops.  A kernel lets the next one start early with sp_let_next_start (the next one still waits).
__device__ __forceinline__ void sp_wait_for_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void sp_let_next_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
