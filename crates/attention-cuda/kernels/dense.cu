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
// Head `head` of x [rows, heads, k] into the same head of out [rows, heads, n]: rows
// (first + i) · heads + head, consecutive from `first` (bmm).
struct kvs_rows_head {
    unsigned int first;
    unsigned int heads;
    unsigned int head;
    __device__ unsigned int x(unsigned int i) const { return (first + i) * heads + head; }
    __device__ unsigned int out(unsigned int i) const { return (first + i) * heads + head; }
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

// out[m, heads, n] = x[m, heads, k] · w[heads, n, k]ᵀ, a matmul per head (MLA's absorptions,
// torch's bmm): matmul_body's warps and row blocks with the head along grid.z, by kvs_gemv, so
// each head's outputs have the bits matmul gives its rows.
template <int W>
__device__ inline void bmm_body(const float* x, const void* w, float* out, unsigned int m,
                                unsigned int k, unsigned int n, unsigned int heads) {
    const unsigned int col = blockIdx.x * MATMUL_WARPS + threadIdx.x / WARP_SIZE;
    const unsigned int first = blockIdx.y * MATMUL_BLOCK_ROWS;
    const unsigned int head = blockIdx.z;
    if (col >= n || first >= m || head >= heads) {
        return; // the whole warp
    }
    const unsigned int count = m - first < MATMUL_BLOCK_ROWS ? m - first : MATMUL_BLOCK_ROWS;
    kvs_gemv<W>(x, w, ((size_t)head * n + col) * k, out, k, n, col, count,
                kvs_rows_head{first, heads, head});
}
KVS_WEIGHT_VARIANTS(bmm, bmm_body,
                    (const float* x, const void* w, float* out, unsigned int m, unsigned int k,
                     unsigned int n, unsigned int heads),
                    (x, w, out, m, k, n, heads))

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
// sorted[] holds the rows of expert 0, then expert 1's, … (within an expert in the order the
// block's atomics give them: each row's output is its own whatever shares its tile, so the
// order changes no result); tiles[] one (expert, first index into sorted, row count ≤
// tile_rows) triple per tile_rows rows of an expert (MOE_TILE for moe_matmul, GEMM_MMA_ROWS for
// moe_matmul_mma), and count 0 in the unused tail (there are at most rows / tile_rows + experts
// tiles, the grid the matmul is launched with). The block's threads share the rows (a
// strided pass counts them per expert, another places them), so a prefill of 100k rows takes
// 100k / blockDim.x steps a thread. experts ≤ MOE_MAX_EXPERTS (checked on the host).
KVS_KERNEL void moe_align(const unsigned int* ids, unsigned int* sorted, unsigned int* tiles,
                          unsigned int rows, unsigned int experts, unsigned int max_tiles,
                          unsigned int tile_rows) {
    __shared__ unsigned int count[MOE_MAX_EXPERTS];
    __shared__ unsigned int cursor[MOE_MAX_EXPERTS];
    __shared__ unsigned int first_tile[MOE_MAX_EXPERTS + 1];
    for (unsigned int e = threadIdx.x; e < experts; e += blockDim.x) {
        count[e] = 0;
    }
    __syncthreads();
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) {
        atomicAdd(&count[ids[r]], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int row = 0;
        unsigned int tile = 0;
        for (unsigned int e = 0; e < experts; ++e) {
            cursor[e] = row;
            first_tile[e] = tile;
            row += count[e];
            tile += (count[e] + tile_rows - 1) / tile_rows;
        }
        first_tile[experts] = tile;
    }
    __syncthreads();
    // Tiles first: they need each expert's first row, which the placing pass below advances.
    for (unsigned int e = threadIdx.x; e < experts; e += blockDim.x) {
        for (unsigned int t = 0; t < first_tile[e + 1] - first_tile[e]; ++t) {
            unsigned int* tile = tiles + 3 * (size_t)(first_tile[e] + t);
            unsigned int left = count[e] - t * tile_rows;
            tile[0] = e;
            tile[1] = cursor[e] + t * tile_rows;
            tile[2] = left < tile_rows ? left : tile_rows;
        }
    }
    __syncthreads();
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) {
        sorted[atomicAdd(&cursor[ids[r]], 1u)] = r;
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

// The tensor-core GEMM for weights kept in bf16, out[r, c] = x[r] · w[c, :] over the bf16
// activations (rounded by round_bf16 first, as Backend::upload_weight allows for a bf16 weight
// and the BLAS path does), on NVIDIA GPUs from sm_80: a block computes up to GEMM_MMA_ROWS rows
// by GEMM_MMA_N outputs, its GEMM_MMA_WARPS warps 32 rows × 32 outputs each (2 × 4
// mma.m16n8k16 tiles, f32 accumulators); k advances GEMM_MMA_K a step, the x rows and weight
// rows staged GEMM_MMA_STAGES steps ahead by cp.async and read by ldmatrix. Every output sums
// its k steps in order and each mma's k in the hardware's order whatever rows share its block,
// so its bits depend on its row, its weight row and k alone (not moe_matmul's or matmul's
// bits). kdim must be a multiple of 8 (staged rows are whole 16-byte units; the host takes the
// lanes' kernels otherwise). Two entry points: moe_matmul_mma over moe_align's tiles
// (CudaConfig::moe_tensor_cores) and matmul_mma over consecutive rows
// (CudaConfig::gemm_tensor_cores).
#define GEMM_MMA_ROWS 64
#define GEMM_MMA_N 64
#define GEMM_MMA_K 32
// GEMM_MMA_STAGES (a tuning define, KVSERVE_CUDA_DEFINES; untimed default 4): k steps staged
// ahead, 8 KiB each.
#ifndef GEMM_MMA_STAGES
#define GEMM_MMA_STAGES 4
#endif
#if GEMM_MMA_STAGES < 2 || GEMM_MMA_STAGES > 6
#error "GEMM_MMA_STAGES: 2 to 6 (8 KiB a stage, 48 KiB of static shared memory)"
#endif
#define GEMM_MMA_WARPS 4
#define GEMM_MMA_UNITS (GEMM_MMA_K / 8) // 16-byte units of a staged row
// Staged rows a thread issues a copy for per step (of x, and as many of w).
#define GEMM_MMA_PASSES (GEMM_MMA_ROWS * GEMM_MMA_UNITS / (GEMM_MMA_WARPS * WARP_SIZE))
#if GEMM_MMA_N != GEMM_MMA_ROWS ||                                                             \
    GEMM_MMA_PASSES * GEMM_MMA_WARPS * WARP_SIZE != GEMM_MMA_ROWS * GEMM_MMA_UNITS
#error "the tensor-core GEMM: a step's x and w rows must split evenly over the block's threads"
#endif

// Unit u of staged row `row`, swizzled so that ldmatrix's 8 rows of one unit (rows of 64
// bytes, two to a 128-byte bank cycle) fall in 8 different bank groups.
struct gemm_mma_swizzle {
    __device__ static unsigned int at(unsigned int row, unsigned int u) {
        return row * GEMM_MMA_UNITS + (u ^ ((row >> 1) & (GEMM_MMA_UNITS - 1)));
    }
};
// A stage's tiles (kvs_tile_quad): ROW_BIT 0 an m-tile of x, 1 two n-tiles of the weight (its
// rows are the mma's columns).
template <int ROW_BIT> using gemm_mma_tiles = kvs_tile_quad<ROW_BIT, gemm_mma_swizzle>;

#if defined(__CUDA_ARCH__)
#define GEMM_MMA_BOUNDS __launch_bounds__(GEMM_MMA_WARPS * WARP_SIZE)
#else
#define GEMM_MMA_BOUNDS
#endif

// One block's rows.x(i) / rows.out(i), i < count (≤ GEMM_MMA_ROWS), times the weight rows
// col0 … col0 + GEMM_MMA_N − 1 (below n) of w ([n, kdim], bf16), into out ([·, n], f32).
template <class Rows>
__device__ inline void kvs_gemm_mma(const unsigned short* x, const unsigned short* w, float* out,
                                    unsigned int kdim, unsigned int n, unsigned int col0,
                                    unsigned int count, const Rows& rows) {
    __shared__ kvs_vec16 s_x[GEMM_MMA_STAGES][GEMM_MMA_ROWS * GEMM_MMA_UNITS];
    __shared__ kvs_vec16 s_w[GEMM_MMA_STAGES][GEMM_MMA_N * GEMM_MMA_UNITS];
    const unsigned int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const unsigned int g = lane >> 2, tq = lane & 3;
    const unsigned int wm = warp & 1u, wn = warp >> 1; // the warp's 32 rows and 32 outputs

    // The staged rows this thread copies: unit su of rows sr + p·(rows a pass), of x (the
    // block's row's x row) and of w (the output row col0 + that row).
    const unsigned int su = threadIdx.x % GEMM_MMA_UNITS, sr = threadIdx.x / GEMM_MMA_UNITS;
    const unsigned short* x_src[GEMM_MMA_PASSES];
    const unsigned short* w_src[GEMM_MMA_PASSES];
    bool x_live[GEMM_MMA_PASSES], w_live[GEMM_MMA_PASSES];
#pragma unroll
    for (int p = 0; p < GEMM_MMA_PASSES; ++p) {
        const unsigned int r = sr + p * (GEMM_MMA_ROWS / GEMM_MMA_PASSES);
        x_live[p] = r < count;
        w_live[p] = col0 + r < n;
        const size_t xr = x_live[p] ? rows.x(r) : 0;
        const size_t wr = w_live[p] ? col0 + r : 0;
        x_src[p] = x + xr * kdim + 8 * su;
        w_src[p] = w + wr * kdim + 8 * su;
    }
    // Step s's copies into stage slot: zeros past count rows, n outputs and kdim.
    auto issue = [&](unsigned int slot, unsigned int s) {
        const unsigned int k0 = s * GEMM_MMA_K;
        const bool k_live = k0 + 8 * su < kdim;
#pragma unroll
        for (int p = 0; p < GEMM_MMA_PASSES; ++p) {
            const unsigned int u = gemm_mma_swizzle::at(sr + p * (GEMM_MMA_ROWS / GEMM_MMA_PASSES), su);
            // A zero-filled copy reads nothing, but its source stays inside its row.
            const unsigned int k = k_live ? k0 : 0;
            kvs_cp_async16(&s_x[slot][u], x_src[p] + k, x_live[p] && k_live);
            kvs_cp_async16(&s_w[slot][u], w_src[p] + k, w_live[p] && k_live);
        }
    };

    const unsigned int steps = (kdim + GEMM_MMA_K - 1) / GEMM_MMA_K;
#pragma unroll
    for (unsigned int s = 0; s + 1 < GEMM_MMA_STAGES; ++s) {
        if (s < steps) {
            issue(s, s);
        }
        kvs_cp_commit(); // a group per step, empty or not, so the wait below counts steps
    }
    float acc[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[mt][nt][e] = 0.0f;
            }
        }
    }
    // A warp with no live row or output in its 32 × 32 (a partial block's tail) only takes
    // its part in the copies and the barriers. Warp-uniform; the mmas' stand-ins are per warp.
    const bool warp_live = 32 * wm < count && col0 + 32 * wn < n;
    for (unsigned int s = 0; s < steps; ++s) {
        kvs_cp_wait<GEMM_MMA_STAGES - 2>(); // this thread's copies of step s are in
        __syncthreads(); // everyone's are, and every warp is done with step s - 1's slot
        const unsigned int next = s + GEMM_MMA_STAGES - 1;
        if (next < steps) {
            issue(next % GEMM_MMA_STAGES, next); // into step s - 1's slot
        }
        kvs_cp_commit();
        if (!warp_live) {
            continue;
        }
        const kvs_vec16* sx = s_x[s % GEMM_MMA_STAGES];
        const kvs_vec16* sw = s_w[s % GEMM_MMA_STAGES];
#pragma unroll
        for (unsigned int kk = 0; kk < GEMM_MMA_K / 16; ++kk) {
            unsigned int a[2][4], b[2][4];
#pragma unroll
            for (unsigned int mt = 0; mt < 2; ++mt) {
                kvs_ldsm_x4<false>(gemm_mma_tiles<0>{sx, 32 * wm + 16 * mt, 2 * kk}, a[mt]);
            }
#pragma unroll
            for (unsigned int np = 0; np < 2; ++np) {
                kvs_ldsm_x4<false>(gemm_mma_tiles<1>{sw, 32 * wn + 16 * np, 2 * kk}, b[np]);
            }
#pragma unroll
            for (unsigned int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (unsigned int nt = 0; nt < 4; ++nt) {
                    kvs_mma_k16<true, GEMM_MMA_WARPS>(acc[mt][nt], a[mt], b[nt / 2][2 * (nt % 2)],
                                                     b[nt / 2][2 * (nt % 2) + 1]);
                }
            }
        }
    }
    // acc[mt][nt]: rows 32·wm + 16·mt + g (elements 0, 1) and + 8 (2, 3), outputs
    // col0 + 32·wn + 8·nt + 2·tq (0, 2) and + 1 (1, 3).
#pragma unroll
    for (unsigned int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (unsigned int h = 0; h < 2; ++h) {
            const unsigned int r = 32 * wm + 16 * mt + 8 * h + g;
            if (r >= count) {
                continue;
            }
            float* orow = out + (size_t)rows.out(r) * n;
#pragma unroll
            for (unsigned int nt = 0; nt < 4; ++nt) {
                const unsigned int c = col0 + 32 * wn + 8 * nt + 2 * tq;
                if (c < n) {
                    orow[c] = acc[mt][nt][2 * h];
                }
                if (c + 1 < n) {
                    orow[c + 1] = acc[mt][nt][2 * h + 1];
                }
            }
        }
    }
}

// moe_matmul over moe_align's tiles of GEMM_MMA_ROWS rows (its arguments; w bf16 and x the
// activations rounded to bf16): a block per (tile, GEMM_MMA_N outputs).
KVS_KERNEL void GEMM_MMA_BOUNDS moe_matmul_mma(const unsigned short* x, const unsigned short* w,
                                              const unsigned int* sorted,
                                              const unsigned int* tiles, float* out,
                                              unsigned int x_div, unsigned int kdim,
                                              unsigned int n) {
    const unsigned int* tile = tiles + 3 * (size_t)blockIdx.x;
    if (tile[2] == 0) {
        return; // an unused tile: the whole block
    }
    kvs_gemm_mma(x, w + (size_t)tile[0] * n * kdim, out, kdim, n, blockIdx.y * GEMM_MMA_N,
                 tile[2], kvs_rows_sorted{sorted, tile[1], x_div});
}

// out[m, n] = x[m, k] · w[n, k]ᵀ (w bf16, x the activations rounded to bf16): a block per
// (GEMM_MMA_ROWS rows, GEMM_MMA_N outputs), grid.x over rows, grid.y over outputs.
KVS_KERNEL void GEMM_MMA_BOUNDS matmul_mma(const unsigned short* x, const unsigned short* w,
                                          float* out, unsigned int m, unsigned int k,
                                          unsigned int n) {
    const unsigned int first = blockIdx.x * GEMM_MMA_ROWS;
    const unsigned int count = m - first < GEMM_MMA_ROWS ? m - first : GEMM_MMA_ROWS;
    kvs_gemm_mma(x, w, out, k, n, blockIdx.y * GEMM_MMA_N, count, kvs_rows_direct{first});
}

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
