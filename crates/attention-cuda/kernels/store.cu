// KV store kernels. Specialised by KV_DTYPE (store_kv converts); the row copies move raw bytes.
//
// A write list (built on the host, src/plan.rs) is [count, slot_0 .. slot_{count-1},
// row_0 .. row_{count-1}]: row row_i of a compact source goes to slot slot_i. A slot appears at
// most once (the host keeps the last write of a repeated slot), so blocks never race.

// dst[slot_i] = kv(src[row_i] / scale) for every entry of the write list: one block per entry
// (blocks past the count do nothing: a captured graph launches one per token, and padding
// tokens share the padding slot). The host passes scale 1 except for fp8; a scale of 1 leaves
// values untouched (a division would quiet signalling NaNs, and f32 stores must keep the bits
// they are given).
KVS_KERNEL void store_kv(const float* src, const unsigned int* writes, kv_t* dst,
                         unsigned int row_elems, float scale) {
    unsigned int count = writes[0];
    if (blockIdx.x >= count) {
        return;
    }
    unsigned int slot = writes[1 + blockIdx.x];
    unsigned int row = writes[1 + count + blockIdx.x];
    const float* s = src + (size_t)row * row_elems;
    kv_t* d = dst + (size_t)slot * row_elems;
    for (unsigned int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        d[i] = kv_from_f32(scale == 1.0f ? s[i] : s[i] / scale);
    }
}

// out[i] = src row slots[i] (raw bytes): one block per slot.
KVS_KERNEL void gather_rows(const unsigned char* src, const unsigned int* slots,
                            unsigned char* out, unsigned int row_bytes) {
    const unsigned char* s = src + (size_t)slots[blockIdx.x] * row_bytes;
    unsigned char* d = out + (size_t)blockIdx.x * row_bytes;
    for (unsigned int i = threadIdx.x; i < row_bytes; i += blockDim.x) {
        d[i] = s[i];
    }
}

// dst[slot_i] = src[row_i] (raw bytes) for every entry of the write list.
KVS_KERNEL void scatter_rows(const unsigned char* src, const unsigned int* writes,
                             unsigned char* dst, unsigned int row_bytes) {
    unsigned int count = writes[0];
    if (blockIdx.x >= count) {
        return;
    }
    unsigned int slot = writes[1 + blockIdx.x];
    unsigned int row = writes[1 + count + blockIdx.x];
    const unsigned char* s = src + (size_t)row * row_bytes;
    unsigned char* d = dst + (size_t)slot * row_bytes;
    for (unsigned int i = threadIdx.x; i < row_bytes; i += blockDim.x) {
        d[i] = s[i];
    }
}
