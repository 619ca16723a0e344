// Shared by every kvserve CUDA kernel source: prepended (after the specialisation #defines) to
// each .cu file by the host, so the sources need no #include. Written in the subset that NVRTC,
// hipRTC and the CPU emulation (attention-cuda-emu) all compile: no cooperative groups, no inline
// PTX, no CUDA headers; the warp size is a compile-time constant.
//
// KV_DTYPE (when a source is specialised by it): 0 f32, 1 f16, 2 bf16 (16-bit types are stored
// as their IEEE / bfloat16 bit patterns, converted here with round-to-nearest-even exactly as the
// host store does).

#ifndef WARP_SIZE
#define WARP_SIZE 32
#endif

#ifndef KVS_KERNEL
#define KVS_KERNEL extern "C" __global__
#endif

#if defined(__HIP_PLATFORM_AMD__)
#define KVS_SHFL_XOR(v, m) __shfl_xor((v), (m))
#else
#define KVS_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#endif

#define KVS_NEG_INF __int_as_float(0xff800000)

__device__ inline float kvs_f16_to_f32(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mant = (unsigned int)h & 0x3ffu;
    if (exp == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; // mant × 2^-24 (zero or subnormal)
        return sign ? -f : f;
    }
    if (exp == 31) {
        return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

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

#if defined(KV_DTYPE)
#if KV_DTYPE == 0
typedef float kv_t;
__device__ inline float kv_load(const kv_t* p, unsigned int i) { return p[i]; }
__device__ inline kv_t kv_from_f32(float f) { return f; }
#elif KV_DTYPE == 1
typedef unsigned short kv_t;
__device__ inline float kv_load(const kv_t* p, unsigned int i) { return kvs_f16_to_f32(p[i]); }
__device__ inline kv_t kv_from_f32(float f) { return kvs_f32_to_f16(f); }
#elif KV_DTYPE == 2
typedef unsigned short kv_t;
__device__ inline float kv_load(const kv_t* p, unsigned int i) { return kvs_bf16_to_f32(p[i]); }
__device__ inline kv_t kv_from_f32(float f) { return kvs_f32_to_bf16(f); }
#else
#error "KV_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif
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
