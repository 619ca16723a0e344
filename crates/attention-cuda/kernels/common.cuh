// Shared by every kvserve CUDA kernel source: prepended (after the specialisation #defines) to
// each .cu file by the host, so the sources need no #include. Written in the subset that NVRTC,
// hipRTC and the CPU emulation (attention-cuda-emu) all compile: no cooperative groups, no CUDA
// headers, inline PTX only behind `__CUDA_ARCH__` beside a portable form (which the emulation
// runs); the warp size is a compile-time constant.
//
// KV_DTYPE (when a source is specialised by it): 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3, 4 fp8 e5m2
// (stored as their bit patterns, converted here with round-to-nearest-even exactly as the host
// store does; fp8 saturates).

#ifndef WARP_SIZE
#define WARP_SIZE 32
#endif

#ifndef KVS_KERNEL
#define KVS_KERNEL extern "C" __global__
#endif

// HIP (clang defines __HIP__ for HIP sources, hipRTC included; hipRTC 5.x does not define
// __HIP_PLATFORM_AMD__ before the source): __shfl_xor over the whole wavefront. WARP_SIZE stays
// 32 on a 64-wide wavefront: xor masks below 32 never leave a lane's aligned group of 32, so
// the reductions below reduce over 32 lanes, as on NVIDIA.
// KVS_SHFL(v, src): v of lane src (0 … 31) of the caller's 32 lanes (width 32 on HIP, so a
// 64-wide wavefront shuffles within each half, as the xor masks do). KVS_SYNCWARP(): the
// 32 lanes meet, and each sees the shared-memory writes the others made before (a wavefront
// runs in lockstep, so HIP only needs the compiler not to move memory accesses across it).
#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#define KVS_SHFL_XOR(v, m) __shfl_xor((v), (m))
#define KVS_SHFL(v, src) __shfl((v), (src), 32)
#define KVS_SYNCWARP() __builtin_amdgcn_wave_barrier()
#else
#define KVS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define KVS_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
#define KVS_SYNCWARP() __syncwarp()
#endif

#define KVS_NEG_INF __int_as_float(0xff800000)

// The attention page table (src/plan.rs, `page_table`): words 0..3 are the offsets of its
// sections: each token's request, each token's position, FlashInfer's kv_indptr (each
// request's first entry in the page list) and kv_indices (the page list).
#define PLAN_TOK_REQ 0
#define PLAN_TOK_POS 1
#define PLAN_KV_INDPTR 2
#define PLAN_KV_INDICES 3

// Exact and branch-free: the exponent and mantissa bits moved to f32's places are the value
// times 2^-112 (a subnormal half becomes an f32 subnormal), so one multiply by 2^112 rebiases
// normal and subnormal halves alike; infinities and NaNs (exponent 31) take the f32 exponent
// 255 and keep their payload. Needs f32 subnormals (no flush to zero: NVRTC's and hipRTC's
// default, not --use_fast_math). The emulation and HIP run this form; NVIDIA GPUs the
// hardware conversion above (on an H100's decode attention, this form read 33-35 % of the
// memory bandwidth where the hardware one read 38-41 %).
#if defined(__CUDA_ARCH__) && !defined(KVS_SOFT_CVT)
// On an NVIDIA GPU: the hardware conversion (one instruction; exact, subnormals included; a
// NaN stays a NaN, its payload not kept). KVS_SOFT_CVT (a tuning define) selects the
// portable forms of this and the fp8 conversion, which the emulation and HIP compile.
__device__ inline float kvs_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
__device__ inline float kvs_f16_to_f32(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int em = (unsigned int)h & 0x7fffu;
    const float scaled = __uint_as_float(em << 13) * 5.192296858534828e33f; // × 2^112
    const unsigned int bits = em >= 0x7c00u ? 0x7f800000u | (em << 13) : __float_as_uint(scaled);
    return __uint_as_float(sign | bits);
}
#endif

__device__ inline unsigned short kvs_f32_to_f16(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { // inf, or NaN: quiet, keeping the payload's top bits
        unsigned int mant = ax & 0x7fffffu;
        return (unsigned short)(sign | 0x7c00u | (mant ? 0x200u : 0u) | (mant >> 13));
    }
    if (ax >= 0x477ff000u) { // at or above 65520: rounds to infinity
        return (unsigned short)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) { // below 2^-14: a subnormal half (scaling by 2^24 is exact)
        float a = __uint_as_float(ax) * 16777216.0f;
        return (unsigned short)(sign | (unsigned int)rintf(a));
    }
    unsigned int r = ax + 0xc8000fffu + ((ax >> 13) & 1u); // rebias, round to nearest even
    return (unsigned short)(sign | (r >> 13));
}

__device__ inline float kvs_bf16_to_f32(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

__device__ inline unsigned short kvs_f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u); // quiet NaN
    }
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// fp8 e4m3 ("fn": no infinities, 0x7f / 0xff are NaN) to f32, exactly.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVS_SOFT_CVT)
// On an NVIDIA GPU with fp8 conversions (sm_89 and later): to f16 in hardware (every e4m3 value
// is an f16 value), then to f32 (the branchy form below took an H100 to 13 % of its memory
// bandwidth in decode attention).
__device__ inline float kvs_e4m3_to_f32(unsigned char b) {
    unsigned int pair;
    const unsigned short in = b; // the upper byte (0) converts into the upper half, unused
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(in));
    return kvs_f16_to_f32((unsigned short)(pair & 0xffffu));
}
#else
__device__ inline float kvs_e4m3_to_f32(unsigned char b) {
    unsigned int sign = ((unsigned int)b & 0x80u) << 24;
    unsigned int exp = ((unsigned int)b >> 3) & 0xfu;
    unsigned int mant = (unsigned int)b & 0x7u;
    if ((b & 0x7fu) == 0x7fu) {
        return __uint_as_float(0x7fc00000u);
    }
    if (exp == 0) {
        float f = (float)mant * 0.001953125f; // mant × 2^-9 (zero or subnormal)
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((exp + 120u) << 23) | (mant << 20));
}
#endif

// fp8 e4m3 bytes 0 and 2 of x as f16x2 (byte 0 in the low half), each its value times 2^-8,
// exactly, by integer operations alone: e4m3's exponent and mantissa bits moved to f16's
// places (its exponent bias is 8 below f16's; subnormals included), and its NaN (0x7f, 0xff)
// given f16's all-ones exponent as well, so it stays NaN (moved alone it would read as ±480).
__device__ inline unsigned int kvs_e4m3x2_to_f16x2_scaled(unsigned int x) {
    const unsigned int mag = x & 0x007f007fu;
    // bit 7 of a half set where its byte is 0x7f; times 0xf8, f16's exponent bits 0x7c00
    const unsigned int nan = (mag + 0x00010001u) & 0x00800080u;
    return (mag << 7) | ((x & 0x00800080u) << 8) | nan * 0xf8u;
}

// f32 to fp8, rounded to nearest even and saturating to ±max (NaN stays NaN): kv-pool's
// encoder, which clamps and then converts as CUDA's __nv_cvt_double_to_fp8 with SATFINITE
// (the float8 crate ports the same routine; this is that routine on the exact double).
__device__ inline unsigned char kvs_f32_to_fp8(float f, float max, int e4m3) {
    if (f == f) {
        f = fminf(fmaxf(f, -max), max);
    }
    unsigned long long xbits = (unsigned long long)__double_as_longlong((double)f);
    unsigned char maxnorm = e4m3 ? 0x7e : 0x7b;
    unsigned char mant_mask = e4m3 ? 0x7 : 0x3;
    unsigned int bias = e4m3 ? 7u : 15u;
    unsigned long long sig_bits = e4m3 ? 4ull : 3ull;
    unsigned long long mindenorm_o2 = e4m3 ? 0x3F50000000000000ull : 0x3EE0000000000000ull;
    unsigned long long overflow = e4m3 ? 0x407D000000000000ull : 0x40EE000000000000ull - 1ull;
    unsigned long long minnorm = e4m3 ? 0x3F90000000000000ull : 0x3F10000000000000ull;
    unsigned long long half_ulp = 1ull << (53ull - sig_bits - 1ull);
    unsigned char sign = (unsigned char)((xbits >> 63) << 7);
    unsigned char exp =
        (unsigned char)((((unsigned int)(xbits >> 52) & 0x7ffu) - 1023u + bias) & 0xffu);
    unsigned char mant = (unsigned char)((xbits >> (53ull - sig_bits)) & mant_mask);
    unsigned long long absx = xbits & 0x7FFFFFFFFFFFFFFFull;
    unsigned char res;
    if (absx <= mindenorm_o2) {
        res = 0;
    } else if (absx > 0x7FF0000000000000ull) {
        res = e4m3 ? 0x7f : (unsigned char)(0x7e | mant);
    } else if (absx > overflow) {
        res = maxnorm;
    } else if (absx >= minnorm) {
        res = (unsigned char)((exp << (sig_bits - 1ull)) | mant);
        unsigned long long round = xbits & ((half_ulp << 1) - 1ull);
        if (round > half_ulp || (round == half_ulp && (mant & 1u))) {
            res = (unsigned char)(res + 1);
        }
    } else {
        unsigned char shift = (unsigned char)(1u - exp);
        unsigned char m = (unsigned char)(mant | (1u << (sig_bits - 1ull)));
        res = (unsigned char)(m >> shift);
        unsigned long long round =
            (xbits | (1ull << 52)) & ((half_ulp << ((unsigned long long)shift + 1ull)) - 1ull);
        unsigned long long half = half_ulp << (unsigned long long)shift;
        if (round > half || (round == half && (res & 1u))) {
            res = (unsigned char)(res + 1);
        }
    }
    return (unsigned char)(res | sign);
}

// Four consecutive 32-bit words, 16-byte aligned, so one load instruction reads them all
// (`ld.global.v4.u32` on NVIDIA, `global_load_dwordx4` on AMD).
struct alignas(16) kvs_vec16 {
    unsigned int w[4];
};

// The 16 bytes at p (which must be 16-byte aligned), read in one load.
__device__ inline kvs_vec16 kvs_load16(const void* p) {
    return *reinterpret_cast<const kvs_vec16*>(p);
}

#if defined(KV_DTYPE)
#if KV_DTYPE == 0
typedef float kv_t;
__device__ inline kv_t kv_from_f32(float f) { return f; }
#elif KV_DTYPE == 1
typedef unsigned short kv_t;
__device__ inline kv_t kv_from_f32(float f) { return kvs_f32_to_f16(f); }
#elif KV_DTYPE == 2
typedef unsigned short kv_t;
__device__ inline kv_t kv_from_f32(float f) { return kvs_f32_to_bf16(f); }
#elif KV_DTYPE == 3 || KV_DTYPE == 4
typedef unsigned char kv_t;
__device__ inline kv_t kv_from_f32(float f) {
#if KV_DTYPE == 3
    return kvs_f32_to_fp8(f, 448.0f, 1);
#else
    return kvs_f32_to_fp8(f, 57344.0f, 0);
#endif
}
#else
#error "KV_DTYPE must be 0 (f32), 1 (f16), 2 (bf16), 3 (fp8 e4m3) or 4 (fp8 e5m2)"
#endif

// One stored element as f32.
__device__ inline float kv_to_f32(kv_t x) {
#if KV_DTYPE == 0
    return x;
#elif KV_DTYPE == 1
    return kvs_f16_to_f32(x);
#elif KV_DTYPE == 2
    return kvs_bf16_to_f32(x);
#elif KV_DTYPE == 3
    return kvs_e4m3_to_f32(x);
#else
    return kvs_f16_to_f32((unsigned short)((unsigned int)x << 8));
#endif
}

// Bytes per stored element (a preprocessor constant, so kernels can check row sizes with #if)
// and elements per 32-bit word.
#if KV_DTYPE == 0
#define KV_BYTES 4
#elif KV_DTYPE == 1 || KV_DTYPE == 2
#define KV_BYTES 2
#else
#define KV_BYTES 1
#endif
#define KV_PER_WORD (4 / KV_BYTES)

// Element e (0 ≤ e < KV_PER_WORD) of a 32-bit word of the store, as f32. Elements at lower
// addresses sit in the lower bits (NVIDIA and AMD GPUs, and the emulation's x86/Arm hosts, are
// little-endian).
__device__ inline float kv_word_elem(unsigned int w, int e) {
#if KV_DTYPE == 0
    (void)e;
    return __uint_as_float(w);
#elif KV_DTYPE == 1
    return kvs_f16_to_f32((unsigned short)(w >> (16 * e)));
#elif KV_DTYPE == 2
    return kvs_bf16_to_f32((unsigned short)(w >> (16 * e)));
#elif KV_DTYPE == 3
    return kvs_e4m3_to_f32((unsigned char)(w >> (8 * e)));
#else
    return kvs_f16_to_f32((unsigned short)(((w >> (8 * e)) & 0xffu) << 8));
#endif
}

// The factor that undoes kv_fp8x2_to_f16x2's scaling (below): e4m3 converts to its value times
// 2^-8; every other dtype to its value.
#if KV_DTYPE == 3
#define KV_FP8_F16_UNSCALE 256.0f
#else
#define KV_FP8_F16_UNSCALE 1.0f
#endif

#if KV_DTYPE >= 3
// fp8 bytes 0 and 2 of x as f16x2 (byte 0 in the low half), exactly, by integer operations
// alone (what the tensor-core forms' f16 mmas take): e5m2 is the top byte of an f16; e4m3
// scaled by 2^-8 (kvs_e4m3x2_to_f16x2_scaled, KV_FP8_F16_UNSCALE).
__device__ inline unsigned int kv_fp8x2_to_f16x2(unsigned int x) {
#if KV_DTYPE == 3
    return kvs_e4m3x2_to_f16x2_scaled(x);
#else
    return (x << 8) & 0xff00ff00u;
#endif
}
#endif

// Elements per 16-byte vector of the store.
#define KV_PER_VEC (4 * KV_PER_WORD)

// The 16 bytes at p (which must be 16-byte aligned), read in one load.
__device__ inline kvs_vec16 kv_load_raw16(const kv_t* p) {
    return kvs_load16(p);
}

// The KV_PER_VEC elements of a 16-byte vector of the store, decoded into out.
__device__ inline void kv_decode_vec16(const kvs_vec16& x, float* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int e = 0; e < KV_PER_WORD; ++e) {
            out[i * KV_PER_WORD + e] = kv_word_elem(x.w[i], e);
        }
    }
}

// Reads the 16 bytes at p (which must be 16-byte aligned) in one load and decodes their
// KV_PER_VEC elements into out.
__device__ inline void kv_load_vec16(const kv_t* p, float* out) {
    kv_decode_vec16(kv_load_raw16(p), out);
}
#endif

__device__ inline float kvs_warp_sum(float v) {
    for (int m = WARP_SIZE / 2; m > 0; m >>= 1) {
        v += KVS_SHFL_XOR(v, m);
    }
    return v;
}

__device__ inline float kvs_warp_max(float v) {
    for (int m = WARP_SIZE / 2; m > 0; m >>= 1) {
        v = fmaxf(v, KVS_SHFL_XOR(v, m));
    }
    return v;
}

// Block-wide sum / max over every thread of the block (blockDim.x a multiple of WARP_SIZE);
// every thread gets the result. `red` is __shared__ scratch of blockDim.x / WARP_SIZE floats,
// free again when the call returns.
__device__ inline float kvs_block_sum(float v, float* red) {
    v = kvs_warp_sum(v);
    unsigned int warps = blockDim.x / WARP_SIZE;
    if (threadIdx.x % WARP_SIZE == 0) {
        red[threadIdx.x / WARP_SIZE] = v;
    }
    __syncthreads();
    float t = 0.0f;
    for (unsigned int w = 0; w < warps; ++w) {
        t += red[w];
    }
    __syncthreads();
    return t;
}

__device__ inline float kvs_block_max(float v, float* red) {
    v = kvs_warp_max(v);
    unsigned int warps = blockDim.x / WARP_SIZE;
    if (threadIdx.x % WARP_SIZE == 0) {
        red[threadIdx.x / WARP_SIZE] = v;
    }
    __syncthreads();
    float t = red[0];
    for (unsigned int w = 1; w < warps; ++w) {
        t = fmaxf(t, red[w]);
    }
    __syncthreads();
    return t;
}

// ---- Tensor cores (mma.sync), ldmatrix and asynchronous copies (cp.async) ----
// KVS_SM80: an NVIDIA GPU of sm_80 or later, which has all three. Everywhere else (the
// emulation, HIP, older NVIDIA GPUs) the portable forms below run instead, in the same
// register layouts, so the emulation checks a kernel's fragment bookkeeping; it also models
// cp.async (KVS_EMU_CP_ASYNC: a copy's destination reads NaN until its group is waited for).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KVS_SM80 1
#else
#define KVS_SM80 0
#endif

#if KVS_SM80
// The shared-state-space address of a pointer into shared memory.
__device__ inline unsigned int kvs_smem_addr(const void* p) {
    unsigned int a;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(a)
                 : "l"(p));
    return a;
}
#endif

// The 16 bytes at src (global memory) into dst (shared memory, 16-byte aligned), or zeros
// where !live (src is then not read): asynchronously where the GPU has cp.async (through L2
// only: what is staged is read once), else a load and a store.
__device__ inline void kvs_cp_async16(void* dst, const void* src, bool live) {
#if KVS_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(kvs_smem_addr(dst)),
                 "l"(src), "r"(live ? 16u : 0u)
                 : "memory");
#elif defined(KVS_EMU_CP_ASYNC)
    kvs_emu_cp_async(dst, src, 16, live ? 16u : 0u);
#else
    kvs_vec16 v;
    if (live) {
        v = kvs_load16(src);
    } else {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            v.w[w] = 0;
        }
    }
    *reinterpret_cast<kvs_vec16*>(dst) = v;
#endif
}

// Closes the group of this thread's copies issued since its last commit.
__device__ inline void kvs_cp_commit() {
#if KVS_SM80
    asm volatile("cp.async.commit_group;" ::: "memory");
#elif defined(KVS_EMU_CP_ASYNC)
    kvs_emu_cp_commit();
#endif
}

// Waits until at most N of this thread's committed groups are still in flight (the others'
// bytes are in shared memory, visible to this thread; other threads see them after a barrier).
template <int N> __device__ inline void kvs_cp_wait() {
#if KVS_SM80
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#elif defined(KVS_EMU_CP_ASYNC)
    kvs_emu_cp_wait(N);
#endif
}

// Element e (0: the low half) of a word of two 16-bit mma elements (bf16, or f16), as f32.
template <bool BF16> __device__ inline float kvs_b16_elem(unsigned int w, int e) {
    const unsigned short h = (unsigned short)(w >> (16 * e));
    return BF16 ? kvs_bf16_to_f32(h) : kvs_f16_to_f32(h);
}

// Two f32 as a word of two 16-bit mma elements (bf16, or f16), each rounded to nearest even:
// lo in the low half.
template <bool BF16> __device__ inline unsigned int kvs_b16_pack(float lo, float hi) {
#if KVS_SM80
    unsigned int r;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    return BF16 ? (unsigned int)kvs_f32_to_bf16(lo) | ((unsigned int)kvs_f32_to_bf16(hi) << 16)
                : (unsigned int)kvs_f32_to_f16(lo) | ((unsigned int)kvs_f32_to_f16(hi) << 16);
#endif
}

#if !KVS_SM80
// The mmas below where the GPU has none, over k = 8·KK in the same fragment layouts: a lane's
// A registers a[2kk + h] hold row g + 8h's k 8kk + 2t, + 1, its B registers b[kk] column g's;
// row g of A is in lanes 4g + s and column n of B in lanes 4n + s (s < 4). Every lane's
// registers go through its warp's shared scratch (WARPS: the block's warps; two warp barriers
// per mma, where shuffles would take 12 to 16: the emulation runs a barrier as a switch to
// every lane).
template <bool BF16, int WARPS, int KK>
__device__ inline void kvs_mma_portable(float (&c)[4], const unsigned int (&a)[2 * KK],
                                        const unsigned int (&b)[KK]) {
    __shared__ unsigned int s_x[WARPS][WARP_SIZE][3 * KK];
    const unsigned int lane = threadIdx.x % WARP_SIZE, g = lane >> 2, t = lane & 3;
    unsigned int(&x)[WARP_SIZE][3 * KK] = s_x[threadIdx.x / WARP_SIZE];
#pragma unroll
    for (int i = 0; i < 2 * KK; ++i) {
        x[lane][i] = a[i];
    }
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        x[lane][2 * KK + kk] = b[kk];
    }
    KVS_SYNCWARP();
#pragma unroll
    for (unsigned int s = 0; s < 4; ++s) {
#pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                // rows g and g + 8 times columns 2t and 2t + 1
                const float x0 = kvs_b16_elem<BF16>(x[4 * g + s][2 * kk], e);
                const float x8 = kvs_b16_elem<BF16>(x[4 * g + s][2 * kk + 1], e);
                const float y0 = kvs_b16_elem<BF16>(x[8 * t + s][2 * KK + kk], e);
                const float y1 = kvs_b16_elem<BF16>(x[8 * t + 4 + s][2 * KK + kk], e);
                c[0] += x0 * y0;
                c[1] += x0 * y1;
                c[2] += x8 * y0;
                c[3] += x8 * y1;
            }
        }
    }
    KVS_SYNCWARP(); // every lane has read the scratch before it is rewritten
}
#endif

// c += A·B over k = 16 (mma.m16n8k16.row.col, 16-bit inputs, f32 accumulators), in the mma's
// fragment layouts (lane (g, t) = (lane / 4, lane % 4)): a[0] and a[2] row g's k 2t, 2t + 1
// and 2t + 8, 2t + 9, a[1] and a[3] row g + 8's; b0, b1 column g's k 2t, 2t + 1 and 2t + 8,
// 2t + 9; c[0], c[1] row g's columns 2t, 2t + 1, c[2], c[3] row g + 8's. WARPS: the block's
// warps (the portable form's scratch).
template <bool BF16, int WARPS>
__device__ inline void kvs_mma_k16(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                   unsigned int b1) {
#if KVS_SM80
#define KVS_MMA_K16(T)                                                                         \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 "                      \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"             \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (BF16) {
        KVS_MMA_K16("bf16");
    } else {
        KVS_MMA_K16("f16");
    }
#undef KVS_MMA_K16
#else
    const unsigned int bb[2] = {b0, b1};
    kvs_mma_portable<BF16, WARPS, 2>(c, a, bb);
#endif
}

// c += A·B over k = 8 (mma.m16n8k8): a0 row g's k 2t, 2t + 1, a1 row g + 8's; b column g's k
// 2t, 2t + 1; c as kvs_mma_k16's.
template <bool BF16, int WARPS>
__device__ inline void kvs_mma_k8(float (&c)[4], unsigned int a0, unsigned int a1,
                                  unsigned int b) {
#if KVS_SM80
#define KVS_MMA_K8(T)                                                                          \
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32." T "." T ".f32 "                       \
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"                         \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                              \
                 : "r"(a0), "r"(a1), "r"(b))
    if constexpr (BF16) {
        KVS_MMA_K8("bf16");
    } else {
        KVS_MMA_K8("f16");
    }
#undef KVS_MMA_K8
#else
    const unsigned int aa[2] = {a0, a1};
    const unsigned int bb[1] = {b};
    kvs_mma_portable<BF16, WARPS, 1>(c, aa, bb);
#endif
}

// The four 8×8 tiles of a stage that one kvs_ldsm_x4 reads from its staged rows row0 … row0 + 15
// and 16-byte units u0, u0 + 1, Swizzle::at(row, u) being unit u of staged row `row` (the
// stage's layout). ROW_BIT 0 orders them (rows 0-7, u0), (rows 8-15, u0), (rows 0-7, u0 + 1),
// (rows 8-15, u0 + 1): one m-tile's A registers, or with .trans two n-tiles' B registers from
// rows along k. ROW_BIT 1 orders them (rows 0-7, u0), (rows 0-7, u0 + 1), (rows 8-15, u0),
// (rows 8-15, u0 + 1): two n-tiles' B registers from rows along n.
template <int ROW_BIT, class Swizzle> struct kvs_tile_quad {
    const kvs_vec16* st;
    unsigned int row0, u0;
    __device__ const kvs_vec16* row(unsigned int j, unsigned int i) const {
        const unsigned int r = row0 + ((j >> ROW_BIT) & 1u) * 8u + i;
        return st + Swizzle::at(r, u0 + ((j >> (1 - ROW_BIT)) & 1u));
    }
};

// Four 8×8 tiles of 16-bit elements in shared memory, as ldmatrix.x4 gives them: r[j] holds
// tile j's elements (row g, columns 2t, 2t + 1), or with TRANS its elements (rows 2t, 2t + 1,
// column g). tiles.row(j, i) is the 16 bytes of tile j's row i (i < 8).
template <bool TRANS, class Tiles>
__device__ inline void kvs_ldsm_x4(const Tiles& tiles, unsigned int (&r)[4]) {
    const unsigned int lane = threadIdx.x % WARP_SIZE;
#if KVS_SM80
    // Lane i gives the address of row i % 8 of tile i / 8.
    const unsigned int addr = kvs_smem_addr(tiles.row(lane >> 3, lane & 7));
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
    }
#else
    const unsigned int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (unsigned int j = 0; j < 4; ++j) {
        if (TRANS) {
            const unsigned short* r0 = reinterpret_cast<const unsigned short*>(tiles.row(j, 2 * t));
            const unsigned short* r1 =
                reinterpret_cast<const unsigned short*>(tiles.row(j, 2 * t + 1));
            r[j] = (unsigned int)r0[g] | (unsigned int)r1[g] << 16;
        } else {
            r[j] = reinterpret_cast<const unsigned int*>(tiles.row(j, g))[t];
        }
    }
#endif
}
