// Kernels that test the emulator itself (not part of the backend): warp shuffles against their
// definition, block reductions across warps, and a barrier mismatch the scheduler must report
// instead of hanging. Compiled over emu.h and common.cuh like the backend's sources.

// out[i] = in[i ^ mask within the warp] for every mask, one row of blockDim.x per mask.
KVS_KERNEL void shfl_xor_table(const float* in, float* out) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = in[i];
    for (int m = 0; m < WARP_SIZE; ++m) {
        out[(size_t)m * gridDim.x * blockDim.x + i] = KVS_SHFL_XOR(v, m);
    }
}

// out[b] = the sum and out[gridDim.x + b] = the max of block b's inputs, through
// kvs_block_sum / kvs_block_max (shuffles, shared memory, barriers).
KVS_KERNEL void block_reduce(const float* in, float* out) {
    __shared__ float red[1024 / WARP_SIZE];
    const float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    const float s = kvs_block_sum(v, red);
    const float m = kvs_block_max(v, red);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = s;
        out[gridDim.x + blockIdx.x] = m;
    }
}

// out[i] = kvs_f16_to_f32(i) for every f16 bit pattern i < 65536 (a grid of 65536 threads),
// then out[65536 + b] = kvs_e4m3_to_f32(b) for every fp8 e4m3 byte: the portable conversions
// (the ones the emulation and HIP run) against the host's, bit for bit; then the tensor-core
// forms' pair conversion, kvs_e4m3x2_to_f16x2_scaled, of bytes b and b ^ 0x5a (both halves of
// every byte) into out[65792 + 2b] and out[65792 + 2b + 1], unscaled.
KVS_KERNEL void decode_tables(const float* in, float* out) {
    (void)in;
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = kvs_f16_to_f32((unsigned short)i);
    if (i < 256) {
        out[65536 + i] = kvs_e4m3_to_f32((unsigned char)i);
        const unsigned int pair = kvs_e4m3x2_to_f16x2_scaled(i | (i ^ 0x5au) << 16);
        out[65792 + 2 * i] = kvs_f16_to_f32((unsigned short)(pair & 0xffffu)) * 256.0f;
        out[65792 + 2 * i + 1] = kvs_f16_to_f32((unsigned short)(pair >> 16)) * 256.0f;
    }
}

// out[3·b + r] = __syncthreads_or of round r of block b, every thread's result: round 0 where
// thread in[b] alone (none when in[b] < 0) has a non-zero predicate, round 1 where none has,
// round 2 where all have (three calls in a row, so one call's answer must not leak into the
// next). Each thread adds its result in turn, so out[3·b + r] is blockDim.x or 0 exactly when
// every thread agreed.
KVS_KERNEL void syncthreads_or(const float* in, float* out) {
    const int chosen = (int)in[blockIdx.x];
    const int results[3] = {
        __syncthreads_or((int)threadIdx.x == chosen),
        __syncthreads_or(0),
        __syncthreads_or(1),
    };
    for (unsigned int t = 0; t < blockDim.x; ++t) {
        if (t == threadIdx.x) {
            for (int r = 0; r < 3; ++r) {
                out[3 * blockIdx.x + r] += results[r] != 0 ? 1.0f : 0.0f;
            }
        }
        __syncthreads();
    }
}

// out[in[0]] = 1 from one thread: an index past the end of `out` must fault on the guard page
// after it, and with buffers placed at the start of their mappings, an index of −1 on the one
// before it (the emulation's stand-in for compute-sanitizer's memcheck).
KVS_KERNEL void store_at(const float* in, float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[(long long)in[0]] = 1.0f;
    }
}

// out[b·blockDim.x + t] = what thread t of block b reads from a shared array before any thread
// writes it (then each thread writes its element, so the next block would read those values
// if shared memory were not refilled before every block).
KVS_KERNEL void shared_before_write(const float* in, float* out) {
    (void)in;
    __shared__ float s[1024];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = (float)threadIdx.x;
}

// Lane 0 waits at the block barrier while the rest of its warp waits on a shuffle that needs
// lane 0: no barrier can ever complete (undefined on a GPU; the emulator must say so).
KVS_KERNEL void mismatched_barriers(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x % WARP_SIZE == 0) {
        __syncthreads();
    } else {
        v = KVS_SHFL_XOR(v, 1);
    }
    out[threadIdx.x] = v;
}
