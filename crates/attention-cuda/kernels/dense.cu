// The dense ops of a decoder layer, on f32 tensors (row-major). Not specialised: shapes are
// arguments. Launch geometry is chosen on the host (src/geometry.rs).

#define MATMUL_TILE 16

// out[m, n] = x[m, k] · w[n, k]ᵀ. One block of MATMUL_TILE² threads per MATMUL_TILE² output
// tile (grid.x over n, grid.y over m); both operands are staged through shared memory one
// MATMUL_TILE-wide slice of k at a time.
KVS_KERNEL void matmul(const float* x, const float* w, float* out, unsigned int m, unsigned int k,
                       unsigned int n) {
    __shared__ float xs[MATMUL_TILE][MATMUL_TILE + 1];
    __shared__ float ws[MATMUL_TILE][MATMUL_TILE + 1];
    unsigned int tx = threadIdx.x % MATMUL_TILE;
    unsigned int ty = threadIdx.x / MATMUL_TILE;
    unsigned int row = blockIdx.y * MATMUL_TILE + ty;
    unsigned int col = blockIdx.x * MATMUL_TILE + tx;
    unsigned int wrow = blockIdx.x * MATMUL_TILE + ty;
    float acc = 0.0f;
    for (unsigned int k0 = 0; k0 < k; k0 += MATMUL_TILE) {
        unsigned int kk = k0 + tx;
        xs[ty][tx] = (row < m && kk < k) ? x[(size_t)row * k + kk] : 0.0f;
        ws[ty][tx] = (wrow < n && kk < k) ? w[(size_t)wrow * k + kk] : 0.0f;
        __syncthreads();
        for (unsigned int i = 0; i < MATMUL_TILE; ++i) {
            acc += xs[ty][i] * ws[tx][i];
        }
        __syncthreads();
    }
    if (row < m && col < n) {
        out[(size_t)row * n + col] = acc;
    }
}

// out[r] = x[r] / sqrt(mean(x[r]²) + eps) · weight: one block per row.
KVS_KERNEL void rms_norm(const float* x, const float* weight, float* out, unsigned int d,
                         float eps) {
    __shared__ float red[1024 / WARP_SIZE];
    const float* xr = x + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        ss += xr[i] * xr[i];
    }
    ss = kvs_block_sum(ss, red);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        out[(size_t)blockIdx.x * d + i] = xr[i] * inv * weight[i];
    }
}

// Rotary embedding in place on x[n, heads, head_dim]: one thread per rotated pair. `cs` holds,
// per token, (cos, sin) for each of the rotary_dim / 2 frequencies (computed on the host in
// f64). NeoX pairs element i with i + rotary_dim / 2, GPT-J pairs 2i with 2i + 1.
KVS_KERNEL void rotary(float* x, const float* cs, unsigned int n, unsigned int heads,
                       unsigned int head_dim, unsigned int rotary_dim, unsigned int neox) {
    unsigned int half_dim = rotary_dim / 2;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * heads * half_dim) {
        return;
    }
    unsigned int f = (unsigned int)(i % half_dim);
    size_t head = i / half_dim;
    size_t tok = head / heads;
    float* xr = x + head * head_dim;
    unsigned int a = neox ? f : 2 * f;
    unsigned int b = neox ? f + half_dim : 2 * f + 1;
    float c = cs[(tok * half_dim + f) * 2];
    float s = cs[(tok * half_dim + f) * 2 + 1];
    float x0 = xr[a];
    float x1 = xr[b];
    xr[a] = x0 * c - x1 * s;
    xr[b] = x1 * c + x0 * s;
}

// SGLang's SiluAndMul: x[m, 2d] (gate, then up) to out[m, d] = silu(gate) · up.
KVS_KERNEL void silu_mul(const float* x, float* out, unsigned int m, unsigned int d) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)m * d) {
        return;
    }
    size_t r = i / d;
    size_t c = i % d;
    float g = x[r * 2 * d + c];
    float u = x[r * 2 * d + d + c];
    out[i] = g / (1.0f + expf(-g)) * u;
}

// x += y, elementwise over `len` elements.
KVS_KERNEL void add_assign(float* x, const float* y, unsigned int len) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) {
        x[i] += y[i];
    }
}

// out[i] = table[ids[i]]: one block per id (ids are checked against the table on the host).
KVS_KERNEL void embedding(const float* table, const unsigned int* ids, float* out,
                          unsigned int d) {
    const float* src = table + (size_t)ids[blockIdx.x] * d;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        out[(size_t)blockIdx.x * d + i] = src[i];
    }
}

// Concatenation along the last dimension: out[r] = a[r] (da elements) then b[r] (db), one block
// per row.
KVS_KERNEL void concat_last(const float* a, const float* b, float* out, unsigned int da,
                            unsigned int db) {
    const size_t r = blockIdx.x;
    for (unsigned int i = threadIdx.x; i < da + db; i += blockDim.x) {
        out[r * (da + db) + i] = i < da ? a[r * da + i] : b[r * db + i - da];
    }
}
