// The dense ops of a decoder layer, on f32 tensors (row-major). Not specialised: shapes are
// arguments. Launch geometry is chosen on the host (src/geometry.rs). A weight (a matmul's w,
// an embedding table, stacked experts) may be kept in 16 bits: the kernels that read one come
// in a variant per weight type (`matmul`, `matmul_f16`, `matmul_bf16`), each widening every
// element exactly to f32 as it loads it, so a variant's results are bitwise those of the f32
// kernel over the widened weight.

// How a kernel's weight is stored: W_F32 as floats, W_F16 and W_BF16 as 16-bit patterns.
#define W_F32 0
#define W_F16 1
#define W_BF16 2

// Element i of a weight stored as W, widened exactly to f32.
template <int W>
__device__ inline float kvs_weight(const void* w, size_t i);
template <>
__device__ inline float kvs_weight<W_F32>(const void* w, size_t i) {
    return ((const float*)w)[i];
}
template <>
__device__ inline float kvs_weight<W_F16>(const void* w, size_t i) {
    return kvs_f16_to_f32(((const unsigned short*)w)[i]);
}
template <>
__device__ inline float kvs_weight<W_BF16>(const void* w, size_t i) {
    return kvs_bf16_to_f32(((const unsigned short*)w)[i]);
}

// One entry point per weight type for a kernel body templated on it: NAME (f32), NAME_f16 and
// NAME_bf16, each taking PARAMS and calling BODY<W>(ARGS).
#define KVS_WEIGHT_VARIANTS(NAME, BODY, PARAMS, ARGS)                                          \
    KVS_KERNEL void NAME PARAMS { BODY<W_F32> ARGS; }                                          \
    KVS_KERNEL void NAME##_f16 PARAMS { BODY<W_F16> ARGS; }                                    \
    KVS_KERNEL void NAME##_bf16 PARAMS { BODY<W_BF16> ARGS; }

// matmul's launch: MATMUL_WARPS warps (output columns) per block, MATMUL_BLOCK_ROWS rows of x
// per block along grid.y, MATMUL_ROWS rows summed at once by a warp (accumulators per lane).
#define MATMUL_WARPS 4
#define MATMUL_BLOCK_ROWS 64
#define MATMUL_ROWS 4

// Elements of a weight of type W in 16 bytes: a chunk, what one lane reads at a time.
template <int W>
struct kvs_wchunk {
    enum { N = 8 };
};
template <>
struct kvs_wchunk<W_F32> {
    enum { N = 4 };
};

// The `count` (≤ N) elements of `base` from element i (f32 activations, or a weight stored as
// W) widened into out: one 16-byte load when `vec` (then count is N and the elements are
// 16-byte aligned), else one element at a time. Elements past count are 0.
template <int W>
__device__ inline void kvs_weight_chunk(const void* base, size_t i, bool vec, unsigned int count,
                                        float* out) {
    constexpr int N = kvs_wchunk<W>::N;
    if (vec) {
        const kvs_vec16 v = kvs_load16((const unsigned short*)base + i * (W == W_F32 ? 2 : 1));
#pragma unroll
        for (int e = 0; e < N; ++e) {
            const unsigned int word = v.w[e * 4 / N];
            out[e] = W == W_F32 ? __uint_as_float(word)
                     : W == W_F16
                         ? kvs_f16_to_f32((unsigned short)(word >> (16 * (e % 2))))
                         : kvs_bf16_to_f32((unsigned short)(word >> (16 * (e % 2))));
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < N; ++e) {
        out[e] = (unsigned int)e < count ? kvs_weight<W>(base, i + e) : 0.0f;
    }
}

// The rows a kvs_gemv call computes, row i of `count`: x's row x(i) into out's row out(i).
// Consecutive rows from `first` (matmul).
struct kvs_rows_direct {
    unsigned int first;
    __device__ unsigned int x(unsigned int i) const { return first + i; }
    __device__ unsigned int out(unsigned int i) const { return first + i; }
};
// moe_align's rows sorted[first + i] of (token, rank) pairs, reading hidden row row / x_div.
struct kvs_rows_sorted {
    const unsigned int* sorted;
    unsigned int first;
    unsigned int x_div;
    __device__ unsigned int x(unsigned int i) const { return sorted[first + i] / x_div; }
    __device__ unsigned int out(unsigned int i) const { return sorted[first + i]; }
};

// One warp's output column `col` of `count` rows (`rows`): out[rows.out(i), col] =
// x[rows.x(i)] · the weight row at element `wrow` of w (k elements each). Lane l reads the
// chunks of k (16 bytes of the weight each: kvs_wchunk) numbered l, l + WARP_SIZE, …, and sums
// x[r, e] · w[e] over its elements in increasing e with fused multiply-adds, for MATMUL_ROWS
// rows at a time; then lane r adds row r's 32 lane sums in lane order (through shared memory:
// one warp barrier, where a butterfly of shuffles takes five per row). So an output's bits
// depend on its row of x, its weight row and k alone: not on how many rows the call has, the
// rows beside it or whether the chunks were read as vectors (when k is a multiple of a chunk,
// every row starts 16-byte aligned), and a row's product is the same in every batch (batch
// invariance), through matmul and moe_matmul alike. A decode step's few rows read each weight
// row once, every lane's loads 16 bytes wide.
template <int W, class Rows>
__device__ inline void kvs_gemv(const float* x, const void* w, size_t wrow, float* out,
                                unsigned int k, unsigned int n, unsigned int col,
                                unsigned int count, const Rows& rows) {
    __shared__ float parts[MATMUL_WARPS][MATMUL_ROWS][WARP_SIZE + 1];
    float(*part)[WARP_SIZE + 1] = parts[threadIdx.x / WARP_SIZE];
    constexpr unsigned int N = kvs_wchunk<W>::N;
    const unsigned int lane = threadIdx.x % WARP_SIZE;
    const bool vec = k % N == 0;
    for (unsigned int r0 = 0; r0 < count; r0 += MATMUL_ROWS) {
        const unsigned int nrows = count - r0 < MATMUL_ROWS ? count - r0 : MATMUL_ROWS;
        float acc[MATMUL_ROWS];
#pragma unroll
        for (int r = 0; r < MATMUL_ROWS; ++r) {
            acc[r] = 0.0f;
        }
        for (unsigned int c = lane * N; c < k; c += WARP_SIZE * N) {
            const unsigned int cnt = k - c < N ? k - c : N;
            float wv[N];
            kvs_weight_chunk<W>(w, wrow + c, vec, cnt, wv);
#pragma unroll
            for (unsigned int r = 0; r < MATMUL_ROWS; ++r) {
                if (r < nrows) {
                    const size_t xi = (size_t)rows.x(r0 + r) * k + c;
                    float xv[N];
                    kvs_weight_chunk<W_F32>(x, xi, vec, cnt, xv);
                    if (N == 8) {
                        kvs_weight_chunk<W_F32>(x, xi + 4, vec, cnt < 4 ? 0 : cnt - 4, xv + 4);
                    }
#pragma unroll
                    for (unsigned int e = 0; e < N; ++e) {
                        if (e < cnt) {
                            acc[r] = fmaf(xv[e], wv[e], acc[r]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (unsigned int r = 0; r < MATMUL_ROWS; ++r) {
            part[r][lane] = acc[r];
        }
        KVS_SYNCWARP();
        if (lane < nrows) {
            float sum = 0.0f;
            for (unsigned int l = 0; l < WARP_SIZE; ++l) {
                sum += part[lane][l];
            }
            out[(size_t)rows.out(r0 + lane) * n + col] = sum;
        }
        KVS_SYNCWARP(); // part is rewritten for the next rows
    }
}

// out[m, n] = x[m, k] · w[n, k]ᵀ: a warp per output column (grid.x over columns in blocks of
// MATMUL_WARPS), blocks of MATMUL_BLOCK_ROWS rows (grid.y), by kvs_gemv.
template <int W>
__device__ inline void matmul_body(const float* x, const void* w, float* out, unsigned int m,
                                   unsigned int k, unsigned int n) {
    const unsigned int col = blockIdx.x * MATMUL_WARPS + threadIdx.x / WARP_SIZE;
    const unsigned int first = blockIdx.y * MATMUL_BLOCK_ROWS;
    if (col >= n || first >= m) {
        return; // the whole warp
    }
    const unsigned int count = m - first < MATMUL_BLOCK_ROWS ? m - first : MATMUL_BLOCK_ROWS;
    kvs_gemv<W>(x, w, (size_t)col * k, out, k, n, col, count, kvs_rows_direct{first});
}
KVS_WEIGHT_VARIANTS(matmul, matmul_body,
                    (const float* x, const void* w, float* out, unsigned int m, unsigned int k,
                     unsigned int n),
                    (x, w, out, m, k, n))

// out[i] = w[i], an f16 weight widened exactly to f32: what the vendor BLAS multiplies a large
// batch by (it has no f16 × f32 GEMM).
KVS_KERNEL void widen_f16(const unsigned short* w, float* out, unsigned int len) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) {
        out[i] = kvs_f16_to_f32(w[i]);
    }
}

// out[i] = x[i] rounded to bf16 (to nearest, ties to even): the activations a bf16 weight's
// GEMM runs on when the vendor BLAS computes it.
KVS_KERNEL void round_bf16(const float* x, unsigned short* out, unsigned int len) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) {
        out[i] = kvs_f32_to_bf16(x[i]);
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

// out[i] = table[ids[i]] (widened to f32): one block per id (ids are checked against the table
// on the host).
template <int W>
__device__ inline void embedding_body(const void* table, const unsigned int* ids, float* out,
                                      unsigned int d) {
    size_t src = (size_t)ids[blockIdx.x] * d;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        out[(size_t)blockIdx.x * d + i] = kvs_weight<W>(table, src + i);
    }
}
KVS_WEIGHT_VARIANTS(embedding, embedding_body,
                    (const void* table, const unsigned int* ids, float* out, unsigned int d),
                    (table, ids, out, d))

// Concatenation along the last dimension: out[r] = a[r] (da elements) then b[r] (db), one block
// per row.
KVS_KERNEL void concat_last(const float* a, const float* b, float* out, unsigned int da,
                            unsigned int db) {
    const size_t r = blockIdx.x;
    for (unsigned int i = threadIdx.x; i < da + db; i += blockDim.x) {
        out[r * (da + db) + i] = i < da ? a[r * da + i] : b[r * db + i - da];
    }
}

// Mixture of experts (SGLang's FusedMoE): kernels that keep the routing on the device.

// Rows of one expert a moe_matmul block computes (a tile of moe_align's).
#define MOE_TILE 16
// The most experts moe_align groups rows for (its shared-memory tables).
#define MOE_MAX_EXPERTS 512

// Greedy top-k routing, one thread per token: softmax over logits[t, 0..experts), the k largest
// (ties to the lower expert index: the j-th pick is the largest logit below the previous pick
// in the order (value descending, index ascending)), written in rank order as ids[t, j] and
// weights[t, j]: the probabilities renormalised to sum to 1 (renormalize and k > 1) or
// multiplied by `scaling` (the host's route_token, in f32).
KVS_KERNEL void moe_topk(const float* logits, unsigned int* ids, float* weights, unsigned int n,
                         unsigned int experts, unsigned int k, unsigned int renormalize,
                         float scaling) {
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) {
        return;
    }
    const float* row = logits + t * experts;
    float max = KVS_NEG_INF;
    for (unsigned int e = 0; e < experts; ++e) {
        max = fmaxf(max, row[e]);
    }
    float sum = 0.0f;
    for (unsigned int e = 0; e < experts; ++e) {
        sum += expf(row[e] - max);
    }
    float total = 0.0f;
    float prev = 0.0f;
    unsigned int prev_id = 0;
    for (unsigned int j = 0; j < k; ++j) {
        unsigned int best = experts;
        for (unsigned int e = 0; e < experts; ++e) {
            float v = row[e];
            bool after_prev = j == 0 || v < prev || (v == prev && e > prev_id);
            if (after_prev && (best == experts || v > row[best])) {
                best = e;
            }
        }
        // Fewer than k experts remain only for a k above the expert count (which the host
        // refuses) or after NaN logits (never greater than another value): such a slot takes
        // expert 0 at weight 0. NaN logits make every weight NaN, as on the host.
        float p = best < experts ? expf(row[best] - max) / sum : 0.0f;
        ids[t * k + j] = best < experts ? best : 0;
        weights[t * k + j] = p;
        total += p;
        prev = best < experts ? row[best] : prev;
        prev_id = best < experts ? best : prev_id;
    }
    for (unsigned int j = 0; j < k; ++j) {
        float w = weights[t * k + j];
        weights[t * k + j] = (renormalize && k > 1) ? w / (total + 1e-20f) : w * scaling;
    }
}

// Rows of (token, rank) pairs grouped by expert (SGLang's moe_align_block_size), one block:
// sorted[] holds the rows of expert 0 in ascending order, then expert 1's, …; tiles[] one
// (expert, first index into sorted, row count ≤ MOE_TILE) triple per MOE_TILE rows of an
// expert, and count 0 in the unused tail (there are at most rows / MOE_TILE + experts tiles,
// the grid moe_matmul is launched with). experts ≤ MOE_MAX_EXPERTS (checked on the host).
KVS_KERNEL void moe_align(const unsigned int* ids, unsigned int* sorted, unsigned int* tiles,
                          unsigned int rows, unsigned int experts, unsigned int max_tiles) {
    __shared__ unsigned int count[MOE_MAX_EXPERTS];
    __shared__ unsigned int first_row[MOE_MAX_EXPERTS];
    __shared__ unsigned int first_tile[MOE_MAX_EXPERTS + 1];
    for (unsigned int e = threadIdx.x; e < experts; e += blockDim.x) {
        unsigned int c = 0;
        for (unsigned int r = 0; r < rows; ++r) {
            c += ids[r] == e;
        }
        count[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int row = 0;
        unsigned int tile = 0;
        for (unsigned int e = 0; e < experts; ++e) {
            first_row[e] = row;
            first_tile[e] = tile;
            row += count[e];
            tile += (count[e] + MOE_TILE - 1) / MOE_TILE;
        }
        first_tile[experts] = tile;
    }
    __syncthreads();
    for (unsigned int e = threadIdx.x; e < experts; e += blockDim.x) {
        unsigned int at = first_row[e];
        for (unsigned int r = 0; r < rows; ++r) {
            if (ids[r] == e) {
                sorted[at++] = r;
            }
        }
        for (unsigned int t = 0; t < first_tile[e + 1] - first_tile[e]; ++t) {
            unsigned int* tile = tiles + 3 * (size_t)(first_tile[e] + t);
            unsigned int left = count[e] - t * MOE_TILE;
            tile[0] = e;
            tile[1] = first_row[e] + t * MOE_TILE;
            tile[2] = left < MOE_TILE ? left : MOE_TILE;
        }
    }
    for (unsigned int t = first_tile[experts] + threadIdx.x; t < max_tiles; t += blockDim.x) {
        tiles[3 * (size_t)t + 2] = 0;
    }
}

// The experts' matmuls over moe_align's tiles: out[r, c] = x[r / x_div] · w[e][c, :] for the
// rows r of a tile of expert e, w stacked as [experts, n, kdim]; x_div is top-k for the
// gate/up projection (each of a token's rows reads its hidden row) and 1 for the down
// projection. A block per tile and MATMUL_WARPS outputs (grid.x over tiles, grid.y over
// outputs), a warp per output by kvs_gemv: an expert's weight row is read once per tile of
// its rows, not once per row, and each output's bits are matmul's on that row (batch-invariant).
template <int W>
__device__ inline void moe_matmul_body(const float* x, const void* w, const unsigned int* sorted,
                                       const unsigned int* tiles, float* out, unsigned int x_div,
                                       unsigned int kdim, unsigned int n) {
    const unsigned int* tile = tiles + 3 * (size_t)blockIdx.x;
    const unsigned int col = blockIdx.y * MATMUL_WARPS + threadIdx.x / WARP_SIZE;
    const unsigned int count = tile[2];
    if (count == 0 || col >= n) {
        return; // the whole warp (an unused tile: the whole block)
    }
    const size_t wrow = ((size_t)tile[0] * n + col) * kdim;
    kvs_gemv<W>(x, w, wrow, out, kdim, n, col, count, kvs_rows_sorted{sorted, tile[1], x_div});
}
KVS_WEIGHT_VARIANTS(moe_matmul, moe_matmul_body,
                    (const float* x, const void* w, const unsigned int* sorted,
                     const unsigned int* tiles, float* out, unsigned int x_div,
                     unsigned int kdim, unsigned int n),
                    (x, w, sorted, tiles, out, x_div, kdim, n))

// out[t, c] = Σ_j weights[t, j] · y[t · k + j, c], j in rank order from 0 (as the host adds a
// token's experts).
KVS_KERNEL void moe_combine(const float* y, const float* weights, float* out, unsigned int n,
                            unsigned int k, unsigned int d) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * d) {
        return;
    }
    size_t t = i / d;
    size_t c = i % d;
    float acc = 0.0f;
    for (unsigned int j = 0; j < k; ++j) {
        acc += weights[t * k + j] * y[(t * k + j) * d + c];
    }
    out[i] = acc;
}
