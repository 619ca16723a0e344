// Paged attention over the KV store: one kernel for extend and decode batches (MHA / GQA /
// MQA), causal over each request's cached prefix plus its new tokens, with the KV range of a
// query split across blocks (split-KV) and the partial softmax states merged by merge_states.
//
// Specialised by KV_DTYPE (store element), HEAD_DIM (query/key head), V_HEAD_DIM (value head)
// and PAGE_FAMILY (0: page size 1, the page table holds slots; 1: a power of two, positions
// split by shift and mask; 2: any page size). MLA 1 is absorbed multi-head latent attention
// (SGLang's MLA decode/extend): the store has one row of HEAD_DIM elements per token, the
// latent (V_HEAD_DIM = kv_lora_rank elements) then the rotary key; scores take the whole row
// and values are its first V_HEAD_DIM elements, so the host passes the key buffer as v_cache,
// kv_heads 1 and v_scale equal to k_scale.
//
// The plan buffer (built on the host, src/plan.rs) starts with a header of 4 offsets into
// itself: [tok_req, tok_pos, kv_indptr, kv_indices]. Token t of the batch belongs to request
// plan[tok_req + t] and sits at position plan[tok_pos + t]; request r's pages are
// plan[kv_indices + plan[kv_indptr + r] ..].

#ifndef MLA
#define MLA 0
#endif
#if MLA
#define V_ROW HEAD_DIM // a value is the head of the latent row
#else
#define V_ROW V_HEAD_DIM
#endif

// Query heads per block: up to HEADS_PER_BLOCK heads that share one KV head are served by one
// block, which reads each key and value row once for all of them (GQA's groups, and MLA, whose
// one latent head every query head reads; the host passes it as a define). 1 for MHA.
#ifndef HEADS_PER_BLOCK
#define HEADS_PER_BLOCK 1
#endif

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / WARP_SIZE)
// ATTN_MIN_BLOCKS (a tuning define, 3 by default): the compiler fits this many blocks per SM
// (it caps the registers per thread, spilling if it must). On an H100, f16/bf16 KV with 4
// heads per block: unbounded (198 registers, 2 blocks) 38-42 % of the memory bandwidth, 3
// blocks (168) 47-56 %, 4 (128, spilling) 42-50 %. 0: no bound. NVIDIA only (HIP's second
// bound means warps per execution unit; the emulation has no registers).
#ifndef ATTN_MIN_BLOCKS
#define ATTN_MIN_BLOCKS 3
#endif
#if ATTN_MIN_BLOCKS > 0 && defined(__CUDA_ARCH__)
#define ATTN_BOUNDS __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS)
#else
#define ATTN_BOUNDS
#endif

// Loads (see paged_attention's comment): keys and values are read as 16-byte vectors of
// K_EPV / V_EPV elements, which needs every row's byte length (and the value part's) to be a
// multiple of 16, so every vector of every row is aligned (the buffers are at least 16-byte
// aligned). Every specialisation meets it (src/kernels.rs checks the list); a shape that does
// not is a compile error rather than a slower untested path.
#if (HEAD_DIM * KV_BYTES) % 16 != 0 || (V_ROW * KV_BYTES) % 16 != 0 ||                         \
    (V_HEAD_DIM * KV_BYTES) % 16 != 0
#error "key and value rows must be whole 16-byte vectors"
#endif
#define K_EPV KV_PER_VEC
#define V_EPV KV_PER_VEC
#define K_LOAD(p, out) kv_load_vec16((p), (out))
// Loads per key row; K_LANES lanes read one row (its loads rounded up to a power of two, at
// most the warp), so a warp reads WARP_SIZE / K_LANES rows at once, K_VECS_PER_LANE loads
// each.
#define K_VECS (HEAD_DIM / K_EPV)
#define K_LANES                                                                                \
    (K_VECS > 16 ? 32 : K_VECS > 8 ? 16 : K_VECS > 4 ? 8 : K_VECS > 2 ? 4 : K_VECS > 1 ? 2 : 1)
#define K_VECS_PER_LANE ((K_VECS + K_LANES - 1) / K_LANES)
// Loads per value row; the block's threads form V_GROUPS groups of V_GROUP threads, each
// group reading one value row (V_VECS_PER_THREAD loads per thread).
#define V_VECS (V_HEAD_DIM / V_EPV)
#define V_GROUP (V_VECS < ATTN_THREADS ? V_VECS : ATTN_THREADS)
#define V_GROUPS (ATTN_THREADS / V_GROUP)
#define V_VECS_PER_THREAD ((V_VECS + V_GROUP - 1) / V_GROUP)

// The store row (slot) of position j of a request whose page list starts at `pages`.
__device__ inline unsigned int kvs_slot(const unsigned int* pages, unsigned int j,
                                        unsigned int page_size, unsigned int page_shift) {
#if PAGE_FAMILY == 0
    return pages[j];
#elif PAGE_FAMILY == 1
    return (pages[j >> page_shift] << page_shift) | (j & (page_size - 1));
#elif PAGE_FAMILY == 2
    return pages[j / page_size] * page_size + j % page_size;
#else
#error "PAGE_FAMILY must be 0, 1 or 2"
#endif
}

// The parameters of both paged-attention kernels (one contract: the host launches either).
#define KVS_ATTN_PARAMS                                                                        \
    const float *q, const kv_t *k_cache, const kv_t *v_cache, const unsigned int *plan,        \
        float *partial_o, float *partial_lse, unsigned int q_heads, unsigned int kv_heads,     \
        unsigned int page_size, unsigned int page_shift, unsigned int split_size, float scale, \
        float k_scale, float v_scale, float *out, unsigned int *counters,                      \
        unsigned int merge_in_kernel

// The work of one attention block (the grid of paged_attention, below): its token, its KV
// head kvh and query heads head0 .. head0 + nheads - 1 (all in kvh's group), its split of
// num_splits and the positions begin .. end - 1 of the split (empty past the token's causal
// end pos + 1), and the page list of the token's request.
struct kvs_attn_block {
    unsigned int tok, kvh, head0, nheads, split, num_splits, begin, end;
    const unsigned int* pages;
};

// The block's work when a block serves up to hpb query heads of a group (HEADS_PER_BLOCK; the
// tensor-core MLA form MMA_HEADS): the host's grid counts blocks the same way
// (geometry::attention_head_groups of Spec::heads_per_block_of the kernel).
__device__ inline kvs_attn_block kvs_attn_block_of(const unsigned int* plan, unsigned int q_heads,
                                                   unsigned int kv_heads, unsigned int split_size,
                                                   unsigned int hpb = HEADS_PER_BLOCK) {
    kvs_attn_block b;
    const unsigned int group_size = q_heads / kv_heads;
    const unsigned int blocks_per_kv = (group_size + hpb - 1) / hpb;
    const unsigned int per_token = kv_heads * blocks_per_kv;
    b.tok = blockIdx.x / per_token;
    b.kvh = blockIdx.x % per_token / blocks_per_kv;
    const unsigned int first = blockIdx.x % blocks_per_kv * hpb; // in the group
    b.head0 = b.kvh * group_size + first;
    b.nheads = group_size - first < hpb ? group_size - first : hpb;
    b.split = blockIdx.y;
    b.num_splits = gridDim.y;
    const unsigned int req = plan[plan[PLAN_TOK_REQ] + b.tok];
    const unsigned int pos = plan[plan[PLAN_TOK_POS] + b.tok];
    b.pages = plan + plan[PLAN_KV_INDICES] + plan[plan[PLAN_KV_INDPTR] + req];
    const unsigned int kv_end = pos + 1; // causal: positions 0..=pos
    b.begin = b.split * split_size;
    b.end = b.begin + split_size < kv_end ? b.begin + split_size : kv_end;
    return b;
}

// A partial state, read from L2 when `fresh` (volatile: past this SM's L1, which another
// block's writes during the same launch do not update).
template <bool fresh>
__device__ inline float kvs_partial(const float* p) {
    return fresh ? *(const volatile float*)p : *p;
}

// Merges the num_splits partial states of row `row` (a token's query head) by their
// log-sum-exp (SGLang's merge_state) into out_row: out = Σ_s exp(lse_s − M) · o_s /
// Σ_s exp(lse_s − M), elements d = t, t + stride, ….
template <bool fresh>
__device__ inline void kvs_merge_row(const float* partial_o, const float* partial_lse, size_t row,
                                     unsigned int num_splits, float* out_row, unsigned int t,
                                     unsigned int stride) {
    const size_t base = row * num_splits;
    float mx = KVS_NEG_INF;
    for (unsigned int s = 0; s < num_splits; ++s) {
        mx = fmaxf(mx, kvs_partial<fresh>(partial_lse + base + s));
    }
    float wsum = 0.0f;
    for (unsigned int s = 0; s < num_splits; ++s) {
        const float lse = kvs_partial<fresh>(partial_lse + base + s);
        wsum += lse == KVS_NEG_INF ? 0.0f : expf(lse - mx);
    }
    for (unsigned int d = t; d < V_HEAD_DIM; d += stride) {
        float o = 0.0f;
        for (unsigned int s = 0; s < num_splits; ++s) {
            const float lse = kvs_partial<fresh>(partial_lse + base + s);
            if (lse != KVS_NEG_INF) {
                o += expf(lse - mx) * kvs_partial<fresh>(partial_o + (base + s) * V_HEAD_DIM + d);
            }
        }
        out_row[d] = o / wsum;
    }
}

// The end of every attention block, after it wrote its partial states. With merge_in_kernel
// (the host's CudaConfig::fuse_split_merge, for a grid of more than one split), the block that
// finishes a (token, head group)'s last split merges all of them into `out`, as merge_states
// would (kvs_merge_row, so the same bits), and no merge launch follows: each block fences its
// partial states, then counts itself in counters[blockIdx.x]; the one that brings the count
// to num_splits reads every split's state (past L1) and resets the counter to 0 for the next
// launch (the host zeroes the counters once per plan). Every thread of the block calls it.
__device__ inline void kvs_attn_finish(const kvs_attn_block& b, unsigned int q_heads,
                                       const float* partial_o, const float* partial_lse,
                                       float* out, unsigned int* counters,
                                       unsigned int merge_in_kernel) {
    if (!merge_in_kernel) {
        return; // the whole grid: merge_states follows
    }
    __threadfence(); // this thread's partial state, before the count
    __syncthreads(); // every thread's
    // Whether this block is the last of its (token, head group), told to every thread by
    // __syncthreads_or: no shared variable, whose 4 bytes would take the tensor-core form's
    // static shared memory past 48 KiB (its stages fill it).
    int last = 0;
    if (threadIdx.x == 0) {
        last = atomicAdd(counters + blockIdx.x, 1u) == b.num_splits - 1;
    }
    if (!__syncthreads_or(last)) {
        return; // the whole block
    }
    __threadfence(); // the other splits' states, counted before this block's count
    for (unsigned int h = 0; h < b.nheads; ++h) {
        const size_t row = (size_t)b.tok * q_heads + b.head0 + h;
        kvs_merge_row<true>(partial_o, partial_lse, row, b.num_splits, out + row * V_HEAD_DIM,
                            threadIdx.x, blockDim.x);
    }
    if (threadIdx.x == 0) {
        counters[blockIdx.x] = 0;
    }
}

// part[k] (k < N, N a power of two ≤ WARP_SIZE) is this lane's partial sum for the k-th key
// of its group of N lanes (lanes that differ only in their low log2(N) bits); returns, in the
// lane at position i of the group, the group's full sum for key i. A butterfly that halves
// the live keys at each step (N − 1 shuffles, 31 for N = 32, against log2(N) per key for a
// reduction per key): at the step of width h a lane with bit h set keeps the upper half of
// its live keys and sends the lower half to lane ^ h, which keeps the lower half, so the keys
// a lane ends with are those whose index bits equal its own.
// One step of width H, then the narrower ones: a template per step, so every index into
// part is a compile-time constant and part stays in registers (as one loop nest, ptxas kept
// a 16-key part in local memory: a load and a store per partial product).
template <int H> struct kvs_transpose_steps {
    __device__ static inline void run(float* part) {
        const bool upper = (threadIdx.x & H) != 0;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float send = upper ? part[i] : part[i + H];
            const float keep = upper ? part[i + H] : part[i];
            part[i] = keep + KVS_SHFL_XOR(send, H);
        }
        kvs_transpose_steps<H / 2>::run(part);
    }
};
template <> struct kvs_transpose_steps<0> {
    __device__ static inline void run(float*) {}
};

template <int N> __device__ inline float kvs_lane_transpose_sum(float* part) {
    kvs_transpose_steps<N / 2>::run(part);
    return part[0];
}

// One block of ATTN_THREADS per (token, KV head, group of up to HEADS_PER_BLOCK of the query
// heads that read it, split): grid.x = tokens × kv_heads × ⌈group / HEADS_PER_BLOCK⌉ (group =
// q_heads / kv_heads), grid.y = num_splits. The block walks its split's keys ATTN_THREADS at a
// time with an online softmax per head, and writes each head's normalised partial output and
// its log-sum-exp (-inf and zeros for an empty split). Every key and value vector is loaded
// and decoded once per block and used by all its heads: for GQA, one KV read serves up to
// HEADS_PER_BLOCK query heads of its group; for MLA, one latent read serves HEADS_PER_BLOCK.
//
// Memory access (the kernel is bound by reading the cache):
// - Keys: warp w scores the chunk's keys w·32 … w·32 + 31. A key row is read by K_LANES lanes
//   (its 16-byte vectors rounded up to a power of two: 16 lanes for a 128-element f16 row of
//   256 bytes, 8 for an fp8 one), lane i of a group its i-th, (i + K_LANES)-th, … vector of
//   K_EPV elements (4 f32, 8 f16/bf16, 16 fp8). So one load instruction of the warp reads
//   32 × 16 = 512 bytes: whole rows of WARP_SIZE / K_LANES keys, every byte of each row
//   exactly once, coalesced (element-wise loads took four 64-byte instructions for an f16
//   row). Group g of the warp reads keys g·K_LANES, g·K_LANES + 1, … in turn and each lane
//   keeps partial dot products for them (the scaled query in shared memory);
//   kvs_lane_transpose_sum then leaves key l's score in lane l, so thread t holds the score
//   of key t of the chunk for the block-wide softmax step.
// - Values: the block splits into V_GROUPS groups; group g reads the value rows of keys g,
//   g + V_GROUPS, … of the chunk, thread i of the group the i-th (i + V_GROUP-th, …) vector of
//   each, so every load instruction reads whole 16-byte vectors of consecutive rows' elements
//   (again coalesced), V_UNROLL rows' loads issued before any is used. Each thread
//   accumulates its elements over its group's keys; at the end the groups' sums are added in
//   group order through shared memory (a fixed order, so the result does not depend on the
//   batch).
// - The page table: each thread resolves the slot of its own key once per chunk (s_slot).
// - Barriers: four per chunk whatever HEADS_PER_BLOCK (slots published; every head's chunk
//   maximum; every head's probabilities and sums; the chunk's shared memory free again).
#define V_ITERS ((ATTN_THREADS + V_GROUPS - 1) / V_GROUPS) // value rows a group reads, at most
// Value rows whose loads are issued together: up to V_UNROLL_MAX (a tuning define, 8 by
// default: the key phase's partial scores and queries are dead by then, so their registers
// hold the loads; 16 raised the kernel's registers and lowered its occupancy on an H100).
#ifndef V_UNROLL_MAX
#define V_UNROLL_MAX 8
#endif
#define V_UNROLL (V_ITERS < V_UNROLL_MAX ? V_ITERS : V_UNROLL_MAX)
// Loads (without decoding) value rows vgroup + (it0 + u)·V_GROUPS, u < V_UNROLL, of the chunk
// (those below count): this thread's vectors of each, into raw[u].
__device__ inline void kvs_load_value_rows(kvs_vec16 (&raw)[V_UNROLL][V_VECS_PER_THREAD],
                                           const kv_t* v_cache, const unsigned int* s_slot,
                                           unsigned int kv_heads, unsigned int kvh,
                                           unsigned int vgroup, unsigned int vlane,
                                           unsigned int it0, unsigned int count) {
#pragma unroll
    for (int u = 0; u < V_UNROLL; ++u) {
        const unsigned int jj = vgroup + (it0 + u) * V_GROUPS;
        if (jj < count) {
            const kv_t* vr = v_cache + ((size_t)s_slot[jj] * kv_heads + kvh) * V_ROW;
#pragma unroll
            for (int i = 0; i < V_VECS_PER_THREAD; ++i) {
                const unsigned int v = vlane + i * V_GROUP;
                if (v < V_VECS) {
                    raw[u][i] = kv_load_raw16(vr + v * V_EPV);
                }
            }
        }
    }
}

KVS_KERNEL void ATTN_BOUNDS paged_attention(KVS_ATTN_PARAMS) {
    __shared__ float s_q[HEADS_PER_BLOCK][HEAD_DIM];
    __shared__ float s_p[HEADS_PER_BLOCK][ATTN_THREADS];
    __shared__ unsigned int s_slot[ATTN_THREADS];
    __shared__ float s_max[HEADS_PER_BLOCK][ATTN_WARPS];
    __shared__ float s_sum[HEADS_PER_BLOCK][ATTN_WARPS];
    __shared__ float s_o[V_GROUPS * V_HEAD_DIM];

    const unsigned int t = threadIdx.x;
    const unsigned int lane = t % WARP_SIZE;
    const unsigned int warp = t / WARP_SIZE;
    const kvs_attn_block b = kvs_attn_block_of(plan, q_heads, kv_heads, split_size);
    const unsigned int tok = b.tok, kvh = b.kvh, head0 = b.head0, nheads = b.nheads;
    const unsigned int split = b.split, num_splits = b.num_splits, begin = b.begin, end = b.end;
    const unsigned int* pages = b.pages;

    // The scaled queries; a head slot past nheads (the last block of a group that is no
    // multiple of HEADS_PER_BLOCK) gets zeros and writes nothing.
    for (unsigned int h = 0; h < HEADS_PER_BLOCK; ++h) {
        for (unsigned int d = t; d < HEAD_DIM; d += ATTN_THREADS) {
            s_q[h][d] =
                h < nheads ? q[((size_t)tok * q_heads + head0 + h) * HEAD_DIM + d] * scale : 0.0f;
        }
    }
    __syncthreads();

    // This thread's value group and its place in it.
    const unsigned int vgroup = t / V_GROUP;
    const unsigned int vlane = t % V_GROUP;
    float m[HEADS_PER_BLOCK];
    float l[HEADS_PER_BLOCK];
    float acc[HEADS_PER_BLOCK][V_VECS_PER_THREAD * V_EPV];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        m[h] = KVS_NEG_INF;
        l[h] = 0.0f;
        for (int i = 0; i < V_VECS_PER_THREAD * V_EPV; ++i) {
            acc[h][i] = 0.0f;
        }
    }
    // Each chunk's slot of key t is read from the page table during the chunk before (its
    // latency hidden behind that chunk's loads, not paid before this one's).
    unsigned int next_slot = begin + t < end ? kvs_slot(pages, begin + t, page_size, page_shift) : 0;
    kvs_vec16 raw[V_UNROLL][V_VECS_PER_THREAD];
    for (unsigned int c = begin; c < end; c += ATTN_THREADS) {
        const unsigned int j = c + t;
        s_slot[t] = next_slot;
        __syncthreads(); // every lane reads its warp's slots below
        const unsigned int jn = j + ATTN_THREADS;
        next_slot = jn < end ? kvs_slot(pages, jn, page_size, page_shift) : 0;
        const unsigned int count = end - c < ATTN_THREADS ? end - c : ATTN_THREADS;
        // The warp's keys: first_key .. first_key + nkeys - 1 (the same for every lane).
        const unsigned int first_key = c + warp * WARP_SIZE;
        const unsigned int left = first_key < end ? end - first_key : 0;
        const unsigned int nkeys = left < WARP_SIZE ? left : WARP_SIZE;
        // This lane's key group (keys group·K_LANES …) and its place in the group.
        const unsigned int group = lane / K_LANES;
        const unsigned int glane = lane % K_LANES;
        float part[HEADS_PER_BLOCK][K_LANES];
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
            for (int kk = 0; kk < K_LANES; ++kk) {
                part[h][kk] = 0.0f;
            }
        }
        // Not unrolled (the key loop inside is): the code stays small for wide heads. Each
        // key vector is loaded once and dotted with every head's query.
#pragma unroll 1
        for (int i = 0; i < K_VECS_PER_LANE; ++i) {
            const unsigned int v = glane + i * K_LANES;
            if (v < K_VECS) {
                float qv[HEADS_PER_BLOCK][K_EPV];
#pragma unroll
                for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
                    for (int e = 0; e < K_EPV; ++e) {
                        qv[h][e] = s_q[h][v * K_EPV + e];
                    }
                }
#pragma unroll
                for (int kk = 0; kk < K_LANES; ++kk) {
                    const unsigned int key = group * K_LANES + kk; // of the warp's 32
                    if (key < nkeys) {
                        const kv_t* kr = k_cache +
                            ((size_t)s_slot[warp * WARP_SIZE + key] * kv_heads + kvh) * HEAD_DIM;
                        float kx[K_EPV];
                        K_LOAD(kr + v * K_EPV, kx);
#pragma unroll
                        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
                            float dot = 0.0f;
#pragma unroll
                            for (int e = 0; e < K_EPV; ++e) {
                                dot += qv[h][e] * kx[e];
                            }
                            part[h][kk] += dot;
                        }
                    }
                }
            }
        }
        // Every head's score of key t, and the chunk's maximum per head: each warp's in
        // s_max, then across warps in warp order.
        float s[HEADS_PER_BLOCK];
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            const float dot = kvs_lane_transpose_sum<K_LANES>(part[h]);
            s[h] = j < end ? dot * k_scale : KVS_NEG_INF;
            const float wmax = kvs_warp_max(s[h]);
            if (lane == 0) {
                s_max[h][warp] = wmax;
            }
        }
        // The first V_UNROLL value rows' loads, issued before the softmax's barriers so their
        // latency passes while it runs (the key phase's registers are free again).
        if (vgroup < V_GROUPS) {
            kvs_load_value_rows(raw, v_cache, s_slot, kv_heads, kvh, vgroup, vlane, 0, count);
        }
        __syncthreads();
        float alpha[HEADS_PER_BLOCK];
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            float chunk_max = s_max[h][0];
            for (int w = 1; w < ATTN_WARPS; ++w) {
                chunk_max = fmaxf(chunk_max, s_max[h][w]);
            }
            const float new_m = fmaxf(m[h], chunk_max);
            const float p = j < end ? expf(s[h] - new_m) : 0.0f;
            s_p[h][t] = p;
            alpha[h] = m[h] == KVS_NEG_INF ? 0.0f : expf(m[h] - new_m);
            m[h] = new_m;
            const float wsum = kvs_warp_sum(p);
            if (lane == 0) {
                s_sum[h][warp] = wsum;
            }
        }
        __syncthreads(); // publishes s_p and s_sum
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            float chunk_sum = 0.0f;
            for (int w = 0; w < ATTN_WARPS; ++w) {
                chunk_sum += s_sum[h][w];
            }
            l[h] = l[h] * alpha[h] + chunk_sum;
            for (int i = 0; i < V_VECS_PER_THREAD * V_EPV; ++i) {
                acc[h][i] *= alpha[h];
            }
        }
        // Each value vector is loaded once and accumulated into every head, V_UNROLL rows'
        // loads in flight before the first is used (the first batch's since the softmax).
        if (vgroup < V_GROUPS) {
            for (unsigned int it0 = 0; it0 < V_ITERS && vgroup + it0 * V_GROUPS < count;
                 it0 += V_UNROLL) {
                if (it0 > 0) {
                    kvs_load_value_rows(raw, v_cache, s_slot, kv_heads, kvh, vgroup, vlane, it0,
                                        count);
                }
#pragma unroll
                for (int u = 0; u < V_UNROLL; ++u) {
                    const unsigned int jj = vgroup + (it0 + u) * V_GROUPS;
                    if (jj < count) {
#pragma unroll
                        for (int i = 0; i < V_VECS_PER_THREAD; ++i) {
                            const unsigned int v = vlane + i * V_GROUP;
                            if (v < V_VECS) {
                                float vx[V_EPV];
                                kv_decode_vec16(raw[u][i], vx);
#pragma unroll
                                for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
                                    const float pj = s_p[h][jj];
#pragma unroll
                                    for (int e = 0; e < V_EPV; ++e) {
                                        acc[h][i * V_EPV + e] += pj * vx[e];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        __syncthreads(); // s_p, s_slot, s_max and s_sum are rewritten by the next chunk
    }

    // Per head: the groups' sums, added in group order through s_o.
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        if (vgroup < V_GROUPS) {
            for (int i = 0; i < V_VECS_PER_THREAD; ++i) {
                const unsigned int v = vlane + i * V_GROUP;
                if (v < V_VECS) {
#pragma unroll
                    for (int e = 0; e < V_EPV; ++e) {
                        s_o[vgroup * V_HEAD_DIM + v * V_EPV + e] = acc[h][i * V_EPV + e];
                    }
                }
            }
        }
        __syncthreads();
        if (h < nheads) {
            const size_t o_row = ((size_t)tok * q_heads + head0 + h) * num_splits + split;
            for (unsigned int d = t; d < V_HEAD_DIM; d += ATTN_THREADS) {
                float o = 0.0f;
                for (unsigned int g = 0; g < V_GROUPS; ++g) {
                    o += s_o[g * V_HEAD_DIM + d];
                }
                // l == 0: no key (an empty split). A NaN l (a NaN score: fmaxf's maxima
                // skip it, its exp does not) is no empty state: the NaN goes on to the output.
                partial_o[o_row * V_HEAD_DIM + d] = l[h] != 0.0f ? o / l[h] * v_scale : 0.0f;
            }
            if (t == 0) {
                partial_lse[o_row] = l[h] != 0.0f ? m[h] + logf(l[h]) : KVS_NEG_INF;
            }
        }
        __syncthreads(); // s_o is rewritten for the next head
    }
    kvs_attn_finish(b, q_heads, partial_o, partial_lse, out, counters, merge_in_kernel);
}

// Head h of block b's output from its warps' states, merged in warp order (a fixed order, so
// the result does not depend on the batch) and written to partial_o / partial_lse: warp w's
// running maximum m[w·stride], sum l[w·stride] and unnormalised output o[w·stride + d]
// (shared memory). Every thread of the block calls it.
__device__ inline void pl_merge_warps(const kvs_attn_block& b, unsigned int h,
                                      unsigned int q_heads, const float* m, const float* l,
                                      const float* o, unsigned int stride, float* partial_o,
                                      float* partial_lse, float v_scale) {
    float mx = KVS_NEG_INF;
    for (int w = 0; w < ATTN_WARPS; ++w) {
        mx = fmaxf(mx, m[w * stride]);
    }
    float wt[ATTN_WARPS];
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) {
        wt[w] = m[w * stride] == KVS_NEG_INF ? 0.0f : expf(m[w * stride] - mx);
        total += l[w * stride] * wt[w];
    }
    const size_t out = ((size_t)b.tok * q_heads + b.head0 + h) * b.num_splits + b.split;
    for (unsigned int d = threadIdx.x; d < V_HEAD_DIM; d += ATTN_THREADS) {
        float acc = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            acc += wt[w] * o[w * stride + d];
        }
        // total == 0: no key; a NaN total carries on (paged_attention's end says why)
        partial_o[out * V_HEAD_DIM + d] = total != 0.0f ? acc / total * v_scale : 0.0f;
    }
    if (threadIdx.x == 0) {
        partial_lse[out] = total != 0.0f ? mx + logf(total) : KVS_NEG_INF;
    }
}

// paged_attention_pipelined: paged_attention's contract (grid, arguments, partial outputs and
// log-sum-exps for merge_states) with another memory schedule, for GPUs whose attention is
// bound by the latency of reading the cache: keys and values are staged in shared memory by
// asynchronous copies (cp.async, sm_80 and later) PL_STAGES - 1 tiles ahead of the tile being
// computed, so the loads in flight are held in shared memory, not registers, and never wait
// for a barrier. FlashInfer's decode kernel reads the cache this way. Two forms: the
// tensor-core form (PL_MMA, below) for f16, bf16 and fp8 stores of head dim 64 or 128, and the
// lanes' form for every other store (f32, other head dims, MLA), described here.
//
// - Lanes: a row (a key, and its value) is read by PL_LANES lanes of a warp (its units of
//   PL_UNIT_BYTES rounded up to a power of two, at most the warp), lane x its units x,
//   x + PL_LANES, …; the block's threads form PL_SLOTS row slots of PL_LANES lanes. A tile is
//   PL_TILE rows: slot r takes rows r, r + PL_SLOTS, … (PL_ROWS_PER_THREAD of them), so each
//   copy instruction of a warp reads whole rows of consecutive positions.
// - Each thread copies exactly the units it reads back (its lane's units of its slot's rows),
//   so a tile is ready for a thread when its own copies are (cp.async.wait_group): the main
//   loop has no barrier. Where cp.async does not exist (HIP, the emulation, GPUs before
//   sm_80) the copies are plain loads and stores, and the schedule is the same.
// - Scores: a lane dots its units with the matching elements of every head's query (held in
//   registers, scaled), the slot's lanes add them up by shuffles, and each lane keeps an
//   online softmax per head over its slot's rows (every lane of a slot the same state) and
//   the weighted sum of its value units.
// - The end: the slots of a warp merge by shuffles (a butterfly: the same state in every
//   lane), the warps through shared memory in warp order (a fixed order, so the result does
//   not depend on the batch).
// - The page table: the slots of a thread's rows of the next tile to issue are read one
//   iteration ahead (their latency hidden behind a tile's compute).
// Tuning defines: PL_UNIT_BYTES (16, or 8 for fp8, whose 16-byte units hold 16 elements a lane
// would keep per head), PL_ROWS_PER_THREAD (4, below), PL_MAX_STAGES (4), PL_SMEM_BYTES (the
// stages' shared memory, 36 KiB: static shared memory ends at 48 KiB and the merge needs its
// own), PL_MIN_BLOCKS (the launch bound, as ATTN_MIN_BLOCKS; below).
#ifndef PL_UNIT_BYTES
#define PL_UNIT_BYTES (KV_BYTES == 1 ? 8 : 16)
#endif
#if PL_UNIT_BYTES == 16
typedef kvs_vec16 pl_unit;
#elif PL_UNIT_BYTES == 8
struct alignas(8) pl_unit {
    unsigned int w[2];
};
#else
#error "PL_UNIT_BYTES must be 8 or 16"
#endif
#define PL_EPU (PL_UNIT_BYTES / KV_BYTES) // elements per unit
#define PL_K_UNITS (HEAD_DIM / PL_EPU)
#define PL_V_UNITS (V_HEAD_DIM / PL_EPU) // MLA: the head of the key row
#define PL_LANES                                                                               \
    (PL_K_UNITS > 16   ? 32                                                                    \
     : PL_K_UNITS > 8  ? 16                                                                    \
     : PL_K_UNITS > 4  ? 8                                                                     \
     : PL_K_UNITS > 2  ? 4                                                                     \
     : PL_K_UNITS > 1  ? 2                                                                     \
                       : 1)
#define PL_K_UPL ((PL_K_UNITS + PL_LANES - 1) / PL_LANES) // key units per lane
#define PL_V_UPL ((PL_V_UNITS + PL_LANES - 1) / PL_LANES) // value units per lane
#define PL_SLOTS (ATTN_THREADS / PL_LANES)
#if MLA
#define PL_ROW_UNITS PL_K_UNITS // values are read from the key row
#else
#define PL_ROW_UNITS (PL_K_UNITS + PL_V_UNITS) // the key's units, then the value's
#endif
#ifndef PL_SMEM_BYTES
#define PL_SMEM_BYTES 36864
#endif
// 4 rows a thread (an H100: f16 decode 63 % of the memory bandwidth at 2, 68-69 % at 3 or 4,
// 54 % at 1), fewer where two stages of 4 would not fit PL_SMEM_BYTES (f32 at head dim 256).
#ifndef PL_ROWS_PER_THREAD
#define PL_ROWS_FIT (PL_SMEM_BYTES / (2 * PL_SLOTS * PL_ROW_UNITS * PL_UNIT_BYTES))
#define PL_ROWS_PER_THREAD (PL_ROWS_FIT < 4 ? PL_ROWS_FIT : 4)
#endif
#define PL_TILE (PL_SLOTS * PL_ROWS_PER_THREAD)
#define PL_STAGE_BYTES (PL_TILE * PL_ROW_UNITS * PL_UNIT_BYTES)
#ifndef PL_MAX_STAGES
#define PL_MAX_STAGES 4
#endif
#define PL_FIT_STAGES (PL_SMEM_BYTES / PL_STAGE_BYTES)
#define PL_STAGES (PL_FIT_STAGES < PL_MAX_STAGES ? PL_FIT_STAGES : PL_MAX_STAGES)
#if PL_STAGES < 2
#error "paged_attention_pipelined: two stages of PL_TILE rows exceed PL_SMEM_BYTES"
#endif
#if (HEAD_DIM * KV_BYTES) % PL_UNIT_BYTES != 0 || (V_HEAD_DIM * KV_BYTES) % PL_UNIT_BYTES != 0
#error "key and value rows must be whole units of PL_UNIT_BYTES"
#endif
// PL_MMA: the tensor-core form of the kernel (below), where it applies: NVIDIA GPUs from sm_80
// (mma.sync with bf16) and the emulation, which checks its layouts. HIP and older NVIDIA GPUs
// would run its portable stand-ins, slower than the lanes' form, so they take the latter.
// For MLA the host chooses (the block's head count depends on it): MMA_HEADS defined (16, by
// Spec for f16/bf16 stores where the device has mma: CudaConfig::mla_tensor_cores) selects the
// tensor-core MLA form below, whose blocks serve MMA_HEADS heads.
#ifndef PL_MMA
#if MLA
#ifdef MMA_HEADS
#define PL_MMA 1
#else
#define PL_MMA 0
#endif
#elif KV_BYTES <= 2 && HEAD_DIM == V_HEAD_DIM && (HEAD_DIM == 64 || HEAD_DIM == 128) &&         \
    HEADS_PER_BLOCK <= 8 && !defined(__HIP__) && !defined(__HIP_PLATFORM_AMD__) &&              \
    !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define PL_MMA 1
#else
#define PL_MMA 0
#endif
#endif
#if MLA && PL_MMA && !defined(MMA_HEADS)
#error "PL_MMA with MLA: the host defines MMA_HEADS (the heads a block serves)"
#endif
// 4 blocks per SM (at most 128 registers a thread: no specialisation spills on sm_90), MLA 2
// (its wide rows spill 500-600 bytes at 128 registers; 250 without spilling at 2), PL_MMA 3
// with f16/bf16 3 (166 registers unbounded, a few spilled at 128; on an H100, f16/bf16 decode
// read 86.7-87.5 % of the memory bandwidth at 3 against 84.2-87.1 % at 4), with fp8 4 (154
// registers unbounded, 128 without spilling; fp8 decode read 72-79 % of the bandwidth at 4
// against 67-78 % at 3, pages of one).
#ifndef PL_MIN_BLOCKS
#define PL_MIN_BLOCKS (MLA ? 2 : PL_MMA && KV_BYTES == 2 ? 3 : 4)
#endif
#if PL_MIN_BLOCKS > 0 && defined(__CUDA_ARCH__)
#define PL_BOUNDS __launch_bounds__(ATTN_THREADS, PL_MIN_BLOCKS)
#else
#define PL_BOUNDS
#endif
// The unit at src (global memory) into dst (shared memory): asynchronously where the GPU has
// cp.async (L2 only for 16 bytes: the cache is streamed once), else a load and a store. The
// emulation (KVS_EMU_CP_ASYNC) models cp.async: dst holds NaN bytes until the thread's
// kvs_cp_wait completes the copy's group.
__device__ inline void pl_copy(pl_unit* dst, const kv_t* src) {
#if KVS_SM80
    const unsigned int d = kvs_smem_addr(dst);
#if PL_UNIT_BYTES == 16
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
#endif
#elif defined(KVS_EMU_CP_ASYNC)
    kvs_emu_cp_async(dst, src, PL_UNIT_BYTES, PL_UNIT_BYTES);
#else
    *dst = *reinterpret_cast<const pl_unit*>(src);
#endif
}

__device__ inline void pl_decode(const pl_unit& u, float* out) {
#pragma unroll
    for (int w = 0; w < PL_UNIT_BYTES / 4; ++w) {
#pragma unroll
        for (int e = 0; e < KV_PER_WORD; ++e) {
            out[w * KV_PER_WORD + e] = kv_word_elem(u.w[w], e);
        }
    }
}

// The slots of this thread's rows (slot r of the tile starting at position tile_begin); 0 for a
// row at or past end (not copied, not read).
__device__ inline void pl_lookup(unsigned int (&slot)[PL_ROWS_PER_THREAD], const unsigned int* pages,
                                 unsigned int tile_begin, unsigned int end, unsigned int r,
                                 unsigned int page_size, unsigned int page_shift) {
#pragma unroll
    for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
        const unsigned int j = tile_begin + r + i * PL_SLOTS;
        slot[i] = j < end ? kvs_slot(pages, j, page_size, page_shift) : 0;
    }
}

// Issues the copies of this thread's units (lane x of slot r) of the tile at tile_begin.
__device__ inline void pl_issue(pl_unit (*stage)[PL_ROW_UNITS],
                                const unsigned int (&slot)[PL_ROWS_PER_THREAD], const kv_t* k_cache,
                                const kv_t* v_cache, unsigned int kv_heads, unsigned int kvh,
                                unsigned int tile_begin, unsigned int end, unsigned int r,
                                unsigned int x) {
#pragma unroll
    for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
        const unsigned int row = r + i * PL_SLOTS;
        if (tile_begin + row < end) {
            const kv_t* kr = k_cache + ((size_t)slot[i] * kv_heads + kvh) * HEAD_DIM;
#pragma unroll
            for (int k = 0; k < PL_K_UPL; ++k) {
                const unsigned int u = x + k * PL_LANES;
                if (u < PL_K_UNITS) {
                    pl_copy(&stage[row][u], kr + u * PL_EPU);
                }
            }
#if !MLA
            const kv_t* vr = v_cache + ((size_t)slot[i] * kv_heads + kvh) * V_HEAD_DIM;
#pragma unroll
            for (int k = 0; k < PL_V_UPL; ++k) {
                const unsigned int u = x + k * PL_LANES;
                if (u < PL_V_UNITS) {
                    pl_copy(&stage[row][PL_K_UNITS + u], vr + u * PL_EPU);
                }
            }
#endif
        }
    }
}

// PL_MMA (a tuning define; on by default where it applies: f16, bf16 or fp8 keys and values of
// one head dim, 64 or 128, at most 8 query heads a block, not MLA): paged_attention_pipelined
// computes on the tensor cores instead of the lanes' FMAs and shuffles (FlashInfer's decode
// with tensor cores, which it takes for GQA). On an H100 the lanes' form spent 68 % of the
// SMs' issue slots on f16 decode (dot products, their shuffle reductions and a softmax per
// lane) and read 63-73 % of the memory bandwidth; here a warp's 8 rows of a step cost a few
// dozen instructions, and f16/bf16 decode reads 80-87 % of it (Nsight Compute: the kernel
// alone at 91 % of DRAM throughput; `decode_bandwidth` also times the merge).
// - Each warp walks its own rows: step s of the block covers PM_STEP positions, warp w the 8
//   from begin + s·PM_STEP + 8w, staged in the warp's own shared memory by cp.async
//   PM_STAGES − 1 steps ahead (rows past the end are zero-filled); a warp waits for its
//   copies and meets its lanes (KVS_SYNCWARP), never the block, until the end.
// - Scores: S (heads × 8 rows) = Q · Kᵀ by mma.m16n8k16 (A: the block's heads, rows 8-15 of A
//   are zero; B: the key rows as loaded by ldmatrix, which a row-major key tile already is).
//   The query is f32: it enters as two halves, hi = round(q·scale), lo = round(q·scale − hi),
//   two mmas each (about 22 bits of the query kept; keys are exact).
// - Softmax: lane (g, t) = (lane / 4, lane % 4) holds head g's scores of rows 2t, 2t + 1 (the
//   mma's C layout); the row maximum is a max over the 4 lanes of g (two shuffles); l is kept
//   per lane and summed at the end.
// - Values: O (heads × head dim) += P · V by mma.m16n8k8, P split as the query is; P's C
//   layout from the scores is the A layout of this mma, so P never leaves registers; V comes
//   through ldmatrix.trans.
// - fp8 (e4m3, e5m2): the mmas take f16, to which every fp8 value converts exactly by a few
//   integer operations (e4m3 times 2^-8, undone on the scores and the output): no ldmatrix
//   (there is no 8-bit transpose); a lane reads whole units of shared memory and the mmas' k
//   and n indices are assigned to head dims so those units hold its fragments (pm_k_dim,
//   pm_v_dim); the value's B registers pair two rows' bytes by PRMT. On an H100 the lanes'
//   form read fp8 decode at 34-36 % of the memory bandwidth (compute-bound: slower per
//   position than f16).
// - Shared memory: each row's key units, then its value units, swizzled by the row
//   (PM_SWIZZLE), so the units a warp reads at once sit in different bank groups.
// - The end: the warps' states meet in shared memory (the stages' space) in warp order, as in
//   the lanes' form.
// Without mma (the emulation; HIP and NVIDIA GPUs before sm_80 only with PL_MMA=1 set) the
// same schedule runs with portable stand-ins (registers exchanged through a warp's shared
// scratch, tiles read from shared memory) in exactly the fragment layouts, so the emulation
// checks the layouts the GPU uses.

#if PL_MMA
#if MLA
#if KV_BYTES > 2 || HEAD_DIM % 16 != 0 || V_HEAD_DIM % 8 != 0 || MMA_HEADS != 16 ||            \
    WARP_SIZE != 32 || defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) ||                     \
    (KV_BYTES == 1 && V_HEAD_DIM % (32 * ATTN_WARPS) != 0)
#error "PL_MMA with MLA: f16/bf16/fp8 rows of 16k elements, 8n values (fp8: 128n), 16 heads"
#endif
#elif KV_BYTES > 2 || HEAD_DIM != V_HEAD_DIM || HEAD_DIM % 64 != 0 || HEADS_PER_BLOCK > 8
#error "PL_MMA: f16/bf16/fp8 keys and values of one head dim (a multiple of 64), at most 8 heads"
#endif
#define PM_EPU (16 / KV_BYTES)                // elements per 16-byte unit
#define PM_UNITS (HEAD_DIM / PM_EPU)          // 16-byte units of a key (or value) row
#define PM_ROW_UNITS (MLA ? PM_UNITS : 2 * PM_UNITS) // a staged row: key units, then value's
#define PM_FP8 (KV_BYTES == 1)
// PL_MMA_SMEM_BYTES (a tuning define): the stages' shared memory (48 KiB, static shared
// memory's limit: 3 stages at head dim 128, PL_MMA_MAX_STAGES at 64 and for fp8; MLA at
// 576/512: 2 stages of 16 rows and the scores' scratch).
#ifndef PL_MMA_SMEM_BYTES
#define PL_MMA_SMEM_BYTES 49152
#endif
// PL_MMA_MAX_STAGES (a tuning define): at most this many stages (fp8's steps are half as many
// bytes, so more of them are in flight for the same shared memory).
#ifndef PL_MMA_MAX_STAGES
#define PL_MMA_MAX_STAGES (PM_FP8 ? 6 : PL_MAX_STAGES)
#endif
#if !MLA
#define PM_WARP_STAGE (8 * PM_ROW_UNITS)      // units of one warp's step (8 rows)
#define PM_STEP (8 * ATTN_WARPS)              // positions one step of the block covers
#define PM_NT (HEAD_DIM / 8)                  // n-tiles of the values mma (8 dims each)
#define PM_FIT_STAGES (PL_MMA_SMEM_BYTES / (ATTN_WARPS * PM_WARP_STAGE * 16))
#define PM_STAGES (PM_FIT_STAGES < PL_MMA_MAX_STAGES ? PM_FIT_STAGES : PL_MMA_MAX_STAGES)
#if PM_STAGES < 2
#error "PL_MMA: two stages exceed PL_MMA_SMEM_BYTES"
#endif
#define PM_SCRATCH (HEAD_DIM + 2) // a warp's head at the end: its output row, m, l
#if ATTN_WARPS * HEADS_PER_BLOCK * PM_SCRATCH * 4 > PM_STAGES * ATTN_WARPS * PM_WARP_STAGE * 16
#error "PL_MMA: the end's scratch exceeds the stages"
#endif
#endif
// The mmas' element type: the store's for f16 and bf16; f16 for fp8, whose values convert to
// f16 exactly (e4m3 scaled by 2^-8, which KV_FP8_F16_UNSCALE undoes on the scores and the
// output).
#define PM_BF16 (KV_DTYPE == 2)

// A row's swizzle: unit x of row `row` sits at x ^ PM_SWIZZLE(row), so the tiles a warp reads
// at once fall in different bank groups: ldmatrix's 8 rows of one unit (f16/bf16), and fp8's
// reads of whole units (scores: 2 rows a quarter-warp, 4 lanes each; values: 4 rows, 2 lanes
// each). Rows of 8 units (fp8 at head dim 64) need their own pattern: rows 2r and 2r + 1 take
// opposite halves of the bank groups, and rows 0, 2, 4, 6 (and 1, 3, 5, 7) differ in bits 1-2.
#if MLA
// MLA: steps of 16 rows, whose ldmatrix tiles are rows 0-7 and 8-15 of a unit (rows of
// 1152 bytes all start in bank 0); rows of fewer than 8 units (the small test shape) are not
// swizzled.
#if PM_ROW_UNITS % 8 == 0 && !PM_FP8
#define PM_SWIZZLE(row) ((row) & 7u)
#else
#define PM_SWIZZLE(row) 0u // fp8: lanes read words of the rows in place (no ldmatrix)
#endif
#elif PM_ROW_UNITS >= 16
#define PM_SWIZZLE(row) (row)
#else
#define PM_SWIZZLE(row) ((((row) & 1u) << 2) ^ (((row) >> 1) << 1))
#endif

// Unit u of row `row` of a stage (GQA: a warp's, rows < 8; MLA: the block's, rows < 16), key
// part 0 or value part 1 (GQA), swizzled.
__device__ inline unsigned int pm_unit(unsigned int row, unsigned int part, unsigned int u) {
    return row * PM_ROW_UNITS + ((part * PM_UNITS + u) ^ PM_SWIZZLE(row));
}

#if PM_FP8
// fp8 bytes 0 and 2 of x as f16x2 (byte 0 in the low half), exactly (kv_fp8x2_to_f16x2).
__device__ inline unsigned int pm_fp8_even(unsigned int x) { return kv_fp8x2_to_f16x2(x); }

// fp8 bytes 1 and 3 of x as f16x2 (byte 1 in the low half), as pm_fp8_even.
__device__ inline unsigned int pm_fp8_odd(unsigned int x) { return kv_fp8x2_to_f16x2(x >> 8); }

// Byte p of a in byte 0 and byte p of b in byte 2 (bytes 1 and 3 unspecified): PRMT.
template <int P> __device__ inline unsigned int pm_pair_bytes(unsigned int a, unsigned int b) {
#if KVS_SM80
    unsigned int r;
    asm("prmt.b32 %0, %1, %2, %3;"
        : "=r"(r)
        : "r"(a), "r"(b), "n"(P | P << 4 | (4 + P) << 8 | (4 + P) << 12));
    return r;
#else
    return ((a >> (8 * P)) & 0xffu) | (((b >> (8 * P)) & 0xffu) << 16);
#endif
}
#endif

// Which four 8×8 tiles of a stage one ldmatrix.x4 reads: tile j is rows row0(j) … row0(j) + 7
// of unit unit(j) (key units first; a GQA value unit is PM_UNITS + u).
struct pm_tiles_row {  // GQA: rows 0-7, units u0 … u0 + 3
    unsigned int u0;
    __device__ unsigned int row0(unsigned int) const { return 0; }
    __device__ unsigned int unit(unsigned int j) const { return u0 + j; }
};
struct pm_tiles_pair { // MLA: units ua, ub of rows 0-7, then of rows 8-15
    unsigned int ua, ub;
    __device__ unsigned int row0(unsigned int j) const { return (j & 2u) * 4u; }
    __device__ unsigned int unit(unsigned int j) const { return (j & 1u) ? ub : ua; }
};

// common.cuh's element conversions and mmas for this specialisation's mma type (PM_BF16) and
// block (ATTN_WARPS warps).
__device__ inline float pm_elem(unsigned int w, int e) { return kvs_b16_elem<PM_BF16>(w, e); }
__device__ inline unsigned int pm_pack(float lo, float hi) {
    return kvs_b16_pack<PM_BF16>(lo, hi);
}
__device__ inline void pm_mma_k16(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                  unsigned int b1) {
    kvs_mma_k16<PM_BF16, ATTN_WARPS>(c, a, b0, b1);
}
__device__ inline void pm_mma_k8(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int b) {
    kvs_mma_k8<PM_BF16, ATTN_WARPS>(c, a0, a1, b);
}

// The four tiles of `tiles` (row0, unit) of a stage as ldmatrix.x4 gives them (kvs_ldsm_x4).
template <class Tiles> struct pm_stage_tiles {
    const kvs_vec16* st;
    Tiles tiles;
    __device__ const kvs_vec16* row(unsigned int j, unsigned int i) const {
        return st + pm_unit(tiles.row0(j) + i, 0, tiles.unit(j));
    }
};
template <bool TRANS, class Tiles>
__device__ inline void pm_ldsm_tiles(const kvs_vec16* st, const Tiles& tiles,
                                     unsigned int (&r)[4]) {
    kvs_ldsm_x4<TRANS>(pm_stage_tiles<Tiles>{st, tiles}, r);
}

// Four 8×8 tiles of a warp's stage (rows 0-7, units u0 … u0 + 3 of one part).
template <bool TRANS>
__device__ inline void pm_ldsm(const kvs_vec16* st, unsigned int part, unsigned int u0,
                               unsigned int (&r)[4]) {
    pm_ldsm_tiles<TRANS>(st, pm_tiles_row{part * PM_UNITS + u0}, r);
}

// The head dim of the scores mma's k index in k-tile kt (half 0: k 2tq + e, half 1: k 8 + 2tq
// + e) for lane tq: f16/bf16 the key row in order (ldmatrix's layout); fp8 lane tq's own
// quarter of the row, whose word kt holds the k-tile (bytes 0 and 2 half 0, 1 and 3 half 1).
// The query's A registers follow the same order, so the dot products are the same.
__device__ inline unsigned int pm_k_dim(unsigned int kt, unsigned int half, unsigned int e,
                                        unsigned int tq) {
#if PM_FP8
    return tq * (HEAD_DIM / 4) + 4 * kt + half + 2 * e;
#else
    return 16 * kt + 8 * half + 2 * tq + e;
#endif
}

#if !MLA
// Issues the copies of one warp's step: the 8 rows from position row0 (each row's slot in lane
// row of `slot`), lane i the units i, i + 32, … of the step in row-major order (a copy
// instruction of the warp reads whole rows' keys and values).
__device__ inline void pm_issue(kvs_vec16* st, unsigned int slot, unsigned int row0, unsigned int end,
                                const kv_t* k_cache, const kv_t* v_cache, unsigned int kv_heads,
                                unsigned int kvh) {
    const unsigned int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (unsigned int c = 0; c < PM_WARP_STAGE / WARP_SIZE; ++c) {
        const unsigned int flat = c * WARP_SIZE + lane;
        const unsigned int row = flat / PM_ROW_UNITS;
        const unsigned int part = flat % PM_ROW_UNITS / PM_UNITS;
        const unsigned int u = flat % PM_UNITS;
        const unsigned int s = KVS_SHFL(slot, (int)row);
        const kv_t* src =
            (part ? v_cache : k_cache) + ((size_t)s * kv_heads + kvh) * HEAD_DIM + u * PM_EPU;
        kvs_cp_async16(st + pm_unit(row, part, u), src, row0 + row < end);
    }
}

// The head dim of column n of the values mma's n-tile nt: f16/bf16 8nt + n (ldmatrix.trans's
// layout); fp8 n·PM_NT + nt (lane g reads PM_NT consecutive bytes of a value row from g·PM_NT).
__device__ inline unsigned int pm_v_dim(unsigned int nt, unsigned int n) {
#if PM_FP8
    return n * PM_NT + nt;
#else
    return 8 * nt + n;
#endif
}

#if PM_FP8
// fp8: the PM_NT / 4 words of row `row`'s value from byte g·PM_NT (n-tile 4i + p's column g is
// byte p of word i).
__device__ inline void pm_value_words(const kvs_vec16* st, unsigned int row, unsigned int g,
                                      unsigned int (&y)[PM_NT / 4]) {
    const unsigned int w0 = g * (PM_NT / 4);
    const unsigned int* src = st[pm_unit(row, 1, w0 / 4)].w + w0 % 4;
#pragma unroll
    for (int i = 0; i < PM_NT / 4; ++i) {
        y[i] = src[i];
    }
}
#endif

KVS_KERNEL void PL_BOUNDS paged_attention_pipelined(KVS_ATTN_PARAMS) {
    __shared__ kvs_vec16 s_stage[PM_STAGES][ATTN_WARPS][PM_WARP_STAGE];

    const unsigned int t = threadIdx.x;
    const unsigned int lane = t % WARP_SIZE;
    const unsigned int warp = t / WARP_SIZE;
    const unsigned int g = lane >> 2;  // the head this lane's A and C elements belong to
    const unsigned int tq = lane & 3;  // its place in g's 4 lanes
    const kvs_attn_block b = kvs_attn_block_of(plan, q_heads, kv_heads, split_size);

    // Head g's scaled query (zero past nheads) as A registers of k-tile kt (dims pm_k_dim):
    // its rounding hi = round(q·scale) in rows 0-7 and the rest lo = round(q·scale − hi) in
    // rows 8-15, so one mma gives both parts' scores.
    unsigned int qa[HEAD_DIM / 16][4];
    {
        const bool live = g < b.nheads;
        const float* qg = q + ((size_t)b.tok * q_heads + b.head0 + (live ? g : 0)) * HEAD_DIM;
#pragma unroll
        for (int kt = 0; kt < HEAD_DIM / 16; ++kt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float x0 = live ? qg[pm_k_dim(kt, half, 0, tq)] * scale : 0.0f;
                const float x1 = live ? qg[pm_k_dim(kt, half, 1, tq)] * scale : 0.0f;
                const unsigned int hi = pm_pack(x0, x1);
                qa[kt][2 * half] = hi;
                qa[kt][2 * half + 1] = pm_pack(x0 - pm_elem(hi, 0), x1 - pm_elem(hi, 1));
            }
        }
    }
    // Head g's output, dims pm_v_dim(nt, 2tq), (nt, 2tq + 1): P's hi part's in [0], [1], its
    // lo part's in [2], [3].
    float acc[PM_NT][4];
#pragma unroll
    for (int nt = 0; nt < PM_NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[nt][e] = 0.0f;
        }
    }
    float m = KVS_NEG_INF; // head g's running maximum (the same in g's 4 lanes)
    float l = 0.0f;        // this lane's share of head g's running sum
    const float ks = k_scale * KV_FP8_F16_UNSCALE;

    const unsigned int steps = b.begin < b.end ? (b.end - b.begin + PM_STEP - 1) / PM_STEP : 0;
    const unsigned int first = b.begin + warp * 8; // this warp's row 0 of step 0
    // The slot of row lane % 8 of the next step to issue (0 past the end: not read).
    unsigned int slot;
    {
        const unsigned int j = first + (lane & 7);
        slot = j < b.end ? kvs_slot(b.pages, j, page_size, page_shift) : 0;
    }
#pragma unroll
    for (int s = 0; s < PM_STAGES - 1; ++s) {
        if ((unsigned int)s < steps) {
            pm_issue(s_stage[s][warp], slot, first + s * PM_STEP, b.end, k_cache, v_cache,
                     kv_heads, b.kvh);
        }
        kvs_cp_commit();
        const unsigned int j = first + (s + 1) * PM_STEP + (lane & 7);
        slot = j < b.end ? kvs_slot(b.pages, j, page_size, page_shift) : 0;
    }
    for (unsigned int it = 0; it < steps; ++it) {
        // Step it + PM_STAGES - 1 into the stage step it - 1 used (the warp met after it).
        const unsigned int ahead = it + PM_STAGES - 1;
        if (ahead < steps) {
            pm_issue(s_stage[ahead % PM_STAGES][warp], slot, first + ahead * PM_STEP, b.end,
                     k_cache, v_cache, kv_heads, b.kvh);
        }
        kvs_cp_commit();
        {
            const unsigned int j = first + (ahead + 1) * PM_STEP + (lane & 7);
            slot = j < b.end ? kvs_slot(b.pages, j, page_size, page_shift) : 0;
        }
        kvs_cp_wait<PM_STAGES - 1>(); // this lane's copies of step it have landed
        KVS_SYNCWARP();           // and every lane's
        const kvs_vec16* st = s_stage[it % PM_STAGES][warp];
        const unsigned int row0 = first + it * PM_STEP;

        // Head g's scores of rows 2tq, 2tq + 1: the query's hi part's in c[0], c[1], its lo
        // part's in c[2], c[3].
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if PM_FP8
        {
            // Key row g's quarter tq (whole units): word kt is k-tile kt's B registers.
            unsigned int kw[HEAD_DIM / 16];
#pragma unroll
            for (int i = 0; i < PM_UNITS / 4; ++i) {
                const kvs_vec16 x = st[pm_unit(g, 0, tq * (PM_UNITS / 4) + i)];
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    kw[4 * i + w] = x.w[w];
                }
            }
#pragma unroll
            for (int kt = 0; kt < HEAD_DIM / 16; ++kt) {
                pm_mma_k16(c, qa[kt], pm_fp8_even(kw[kt]), pm_fp8_odd(kw[kt]));
            }
        }
#else
#pragma unroll
        for (unsigned int u0 = 0; u0 < PM_UNITS; u0 += 4) {
            unsigned int kb[4];
            pm_ldsm<false>(st, 0, u0, kb);
            pm_mma_k16(c, qa[u0 / 2], kb[0], kb[1]);
            pm_mma_k16(c, qa[u0 / 2 + 1], kb[2], kb[3]);
        }
#endif
        const float s0 = row0 + 2 * tq < b.end ? (c[0] + c[2]) * ks : KVS_NEG_INF;
        const float s1 = row0 + 2 * tq + 1 < b.end ? (c[1] + c[3]) * ks : KVS_NEG_INF;
        float mt = fmaxf(s0, s1);
        mt = fmaxf(mt, KVS_SHFL_XOR(mt, 1));
        mt = fmaxf(mt, KVS_SHFL_XOR(mt, 2));
        const float nm = fmaxf(m, mt);
        const float alpha = m == KVS_NEG_INF ? 0.0f : expf(m - nm);
        const float p0 = s0 == KVS_NEG_INF ? 0.0f : expf(s0 - nm);
        const float p1 = s1 == KVS_NEG_INF ? 0.0f : expf(s1 - nm);
        l = l * alpha + p0 + p1;
        m = nm;
#pragma unroll
        for (int nt = 0; nt < PM_NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[nt][e] *= alpha;
            }
        }
        // Values: P (rows 2tq, 2tq + 1 of head g: the scores' C layout is this mma's A
        // layout), its rounding in rows 0-7 and the rest in rows 8-15, times the value tile.
        const unsigned int p_hi = pm_pack(p0, p1);
        const unsigned int p_lo = pm_pack(p0 - pm_elem(p_hi, 0), p1 - pm_elem(p_hi, 1));
#if PM_FP8
        {
            // Value rows 2tq, 2tq + 1 from byte g·PM_NT: byte p of words i paired is n-tile
            // 4i + p's B register.
            unsigned int y0[PM_NT / 4], y1[PM_NT / 4];
            pm_value_words(st, 2 * tq, g, y0);
            pm_value_words(st, 2 * tq + 1, g, y1);
#pragma unroll
            for (int i = 0; i < PM_NT / 4; ++i) {
                pm_mma_k8(acc[4 * i], p_hi, p_lo, pm_fp8_even(pm_pair_bytes<0>(y0[i], y1[i])));
                pm_mma_k8(acc[4 * i + 1], p_hi, p_lo, pm_fp8_even(pm_pair_bytes<1>(y0[i], y1[i])));
                pm_mma_k8(acc[4 * i + 2], p_hi, p_lo, pm_fp8_even(pm_pair_bytes<2>(y0[i], y1[i])));
                pm_mma_k8(acc[4 * i + 3], p_hi, p_lo, pm_fp8_even(pm_pair_bytes<3>(y0[i], y1[i])));
            }
        }
#else
#pragma unroll
        for (unsigned int u0 = 0; u0 < PM_UNITS; u0 += 4) {
            unsigned int vb[4];
            pm_ldsm<true>(st, 1, u0, vb);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                pm_mma_k8(acc[u0 + j], p_hi, p_lo, vb[j]);
            }
        }
#endif
        KVS_SYNCWARP(); // every lane is done with this stage before it is refilled
    }
    kvs_cp_wait<0>();

    // Head g's sum over its 4 lanes; then the warps, in warp order, through shared memory.
    l += KVS_SHFL_XOR(l, 1);
    l += KVS_SHFL_XOR(l, 2);
    __syncthreads(); // every warp is done with the stages
    float* s_f = reinterpret_cast<float*>(&s_stage[0][0][0]);
    if (g < HEADS_PER_BLOCK) {
        float* w = s_f + (warp * HEADS_PER_BLOCK + g) * PM_SCRATCH;
#pragma unroll
        for (int nt = 0; nt < PM_NT; ++nt) {
            w[pm_v_dim(nt, 2 * tq)] = acc[nt][0] + acc[nt][2];
            w[pm_v_dim(nt, 2 * tq + 1)] = acc[nt][1] + acc[nt][3];
        }
        if (tq == 0) {
            w[HEAD_DIM] = m;
            w[HEAD_DIM + 1] = l;
        }
    }
    __syncthreads();
    for (unsigned int h = 0; h < b.nheads; ++h) {
        const float* hs = s_f + h * PM_SCRATCH;
        pl_merge_warps(b, h, q_heads, hs + HEAD_DIM, hs + HEAD_DIM + 1, hs,
                       HEADS_PER_BLOCK * PM_SCRATCH, partial_o, partial_lse,
                       v_scale * KV_FP8_F16_UNSCALE);
    }
    kvs_attn_finish(b, q_heads, partial_o, partial_lse, out, counters, merge_in_kernel);
}
#else  // MLA
// The tensor-core form for absorbed MLA (f16/bf16 stores, and fp8 ones whose latent rank is a
// multiple of 128; MMA_HEADS, defined by the host where the device has mma,
// CudaConfig::mla_tensor_cores): a block serves 16 query heads, which all
// read the one latent row, so each row it stages feeds 16 heads' scores and outputs (the lanes'
// form serves MLA_HEADS_PER_BLOCK, 4). The GQA form's per-warp rows cannot hold MLA's state: a
// warp's output for 16 heads × 512 value dims would take 256 accumulators a lane, so here the
// warps split the head dims instead of the rows (as FlashMLA's warp groups split the values).
// - Steps of PM_ROWS (16) positions, staged for the whole block by cp.async PM_STAGES − 1 steps
//   ahead (rows past the end zero-filled); each thread copies whole units, every warp reads
//   every row, so a step costs two block barriers (its copies visible; the scores' partial
//   sums visible).
// - Scores: S (16 heads × 16 rows) = Q · Kᵀ by mma.m16n8k16, two n-tiles (rows 0-7, 8-15);
//   warp w takes k-tiles w, w + 4, … of the row (PM_WKT of them), so each warp's sums are
//   partial; they meet in shared memory and every warp adds the four in warp order (the same
//   bits in every warp, so every warp keeps the same softmax state). The query is f32: hi =
//   round(q·scale) and lo = round(q·scale − hi) are two A operands into the same accumulators
//   (16 heads fill the mma's 16 rows, so the parts cannot share one as in the GQA form).
// - Softmax: lane (g, t) holds heads g and g + 8, rows 2t, 2t + 1 of each n-tile (the C
//   layout); the maxima take two shuffles.
// - Values: warp w owns n-tiles w·PM_WNT … of the value dims (128 dims at rank 512: 64
//   accumulators a lane); O += P · V by mma.m16n8k16 over the step's 16 rows, P's C layout from
//   the scores being this mma's A layout (hi and lo parts again), V by ldmatrix.trans from the
//   head of the staged row.
// - The end: every warp has the whole softmax state, so each writes its own dims of every
//   head's normalised output; no merge between warps.
// - fp8 (e4m3, e5m2), as in the GQA form: f16 mmas on exactly converted values (e4m3 times
//   2^-8, undone on the scores and the output), no ldmatrix: for the scores lane tq reads word
//   kt of its quarter of a key row (pm_k_dim), for the values lane g reads PM_WNT consecutive
//   bytes of four value rows (pm_mla_v_dim) and pairs two rows' bytes by PRMT.
// Without mma (the emulation) the portable stand-ins run the same layouts, as for GQA.
#define PM_ROWS 16                                             // positions a step covers
#define PM_KT (HEAD_DIM / 16)                                  // k-tiles of a key row
#define PM_WKT ((PM_KT + ATTN_WARPS - 1) / ATTN_WARPS)         // a warp's k-tiles, at most
#define PM_VNT (V_HEAD_DIM / 8)                                // n-tiles of the value dims
#define PM_WNT ((PM_VNT + ATTN_WARPS - 1) / ATTN_WARPS)        // a warp's n-tiles, at most
#define PM_STEP_UNITS (PM_ROWS * PM_ROW_UNITS)                 // units of a step
#define PM_COPIES ((PM_STEP_UNITS + ATTN_THREADS - 1) / ATTN_THREADS) // a thread's, at most
#define PM_PART_BYTES (ATTN_WARPS * WARP_SIZE * 8 * 4)         // the scores' partial sums
#define PM_FIT_STAGES ((PL_MMA_SMEM_BYTES - PM_PART_BYTES) / (PM_STEP_UNITS * 16))
#define PM_STAGES (PM_FIT_STAGES < PL_MMA_MAX_STAGES ? PM_FIT_STAGES : PL_MMA_MAX_STAGES)
#if PM_STAGES < 2
#error "PL_MMA with MLA: two stages exceed PL_MMA_SMEM_BYTES"
#endif

// Issues the copies of a step: the PM_ROWS rows from position row0 (row r's slot in lane r of
// `slot`), thread i the units i, i + ATTN_THREADS, … of the step in row-major order.
__device__ inline void pm_mla_issue(kvs_vec16* st, unsigned int slot, unsigned int row0,
                                    unsigned int end, const kv_t* k_cache, unsigned int kv_heads,
                                    unsigned int kvh) {
#pragma unroll
    for (unsigned int c = 0; c < PM_COPIES; ++c) {
        const unsigned int flat = c * ATTN_THREADS + threadIdx.x;
        const unsigned int row = flat / PM_ROW_UNITS;
        const unsigned int u = flat % PM_ROW_UNITS;
        // Every lane shuffles (a row past the step's reads lane 0's slot, unused).
        const unsigned int s = KVS_SHFL(slot, (int)(row < PM_ROWS ? row : 0));
        if (PM_STEP_UNITS % ATTN_THREADS == 0 || flat < PM_STEP_UNITS) {
            kvs_cp_async16(st + pm_unit(row, 0, u),
                           k_cache + ((size_t)s * kv_heads + kvh) * HEAD_DIM + u * PM_EPU,
                           row0 + row < end);
        }
    }
}

// The slot of row lane % PM_ROWS of the step from position row0 (0 past the end: not read).
__device__ inline unsigned int pm_mla_slot(const kvs_attn_block& b, unsigned int row0,
                                           unsigned int page_size, unsigned int page_shift) {
    const unsigned int j = row0 + threadIdx.x % WARP_SIZE % PM_ROWS;
    return j < b.end ? kvs_slot(b.pages, j, page_size, page_shift) : 0;
}

// The value dim of column n of warp w's n-tile j: f16/bf16 8(w·PM_WNT + j) + n (ldmatrix.trans's
// layout); fp8 w·8·PM_WNT + n·PM_WNT + j (lane g reads PM_WNT consecutive bytes of a value row
// from w·8·PM_WNT + g·PM_WNT, whole words).
__device__ inline unsigned int pm_mla_v_dim(unsigned int w, unsigned int j, unsigned int n) {
#if PM_FP8
    return w * 8 * PM_WNT + n * PM_WNT + j;
#else
    return 8 * (w * PM_WNT + j) + n;
#endif
}

#if PM_FP8
// Word i of lane g's value bytes (pm_mla_v_dim) of staged row `row`.
__device__ inline unsigned int pm_mla_v_word(const kvs_vec16* st, unsigned int row,
                                             unsigned int w, unsigned int g, unsigned int i) {
    return reinterpret_cast<const unsigned int*>(st + row * PM_ROW_UNITS)[(w * 8 + g) * PM_WNT / 4 + i];
}

// Word kt of lane tq's quarter of staged key row `row` (pm_k_dim: the scores' B registers of
// k-tile kt, bytes 0 and 2 the first, 1 and 3 the second).
__device__ inline unsigned int pm_mla_k_word(const kvs_vec16* st, unsigned int row,
                                             unsigned int tq, unsigned int kt) {
    return reinterpret_cast<const unsigned int*>(st + row * PM_ROW_UNITS)[tq * (HEAD_DIM / 16) + kt];
}
#endif

KVS_KERNEL void PL_BOUNDS paged_attention_pipelined(KVS_ATTN_PARAMS) {
    __shared__ kvs_vec16 s_stage[PM_STAGES][PM_STEP_UNITS];
    // The scores' partial sums: warp w's element e of lane l at s_part[w][e][l] (a warp's
    // stores and loads of one e fall in 32 different banks).
    __shared__ float s_part[ATTN_WARPS][8][WARP_SIZE];

    const unsigned int lane = threadIdx.x % WARP_SIZE;
    const unsigned int warp = threadIdx.x / WARP_SIZE;
    const unsigned int g = lane >> 2; // heads g and g + 8 of the block: this lane's A and C rows
    const unsigned int tq = lane & 3; // its place in g's 4 lanes
    const kvs_attn_block b = kvs_attn_block_of(plan, q_heads, kv_heads, split_size, MMA_HEADS);

    // The scaled query of heads g (hh 0) and g + 8 (hh 1), zero past nheads, as the A registers
    // of this warp's k-tiles warp + i·ATTN_WARPS: qh the rounding, ql the rest.
    unsigned int qh[PM_WKT][4], ql[PM_WKT][4];
#pragma unroll
    for (int i = 0; i < PM_WKT; ++i) {
        const unsigned int kt = warp + i * ATTN_WARPS;
#pragma unroll
        for (unsigned int hh = 0; hh < 2; ++hh) {
            const unsigned int h = g + 8 * hh;
            const bool live = kt < PM_KT && h < b.nheads;
            const float* qrow = q + ((size_t)b.tok * q_heads + b.head0 + (live ? h : 0)) * HEAD_DIM;
#pragma unroll
            for (unsigned int half = 0; half < 2; ++half) {
                const float x0 = live ? qrow[pm_k_dim(kt, half, 0, tq)] * scale : 0.0f;
                const float x1 = live ? qrow[pm_k_dim(kt, half, 1, tq)] * scale : 0.0f;
                const unsigned int hi = pm_pack(x0, x1);
                qh[i][2 * half + hh] = hi;
                ql[i][2 * half + hh] = pm_pack(x0 - pm_elem(hi, 0), x1 - pm_elem(hi, 1));
            }
        }
    }
    // Heads g ([0], [1]) and g + 8 ([2], [3]) at dims 8nt + 2tq, + 1 of this warp's n-tiles
    // nt = warp·PM_WNT + j.
    float acc[PM_WNT][4];
#pragma unroll
    for (int j = 0; j < PM_WNT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[j][e] = 0.0f;
        }
    }
    float m[2] = {KVS_NEG_INF, KVS_NEG_INF}; // heads g, g + 8: running maxima (all g's lanes)
    float l[2] = {0.0f, 0.0f};               // this lane's share of their running sums
    const float ks = k_scale * KV_FP8_F16_UNSCALE;

    const unsigned int steps = b.begin < b.end ? (b.end - b.begin + PM_ROWS - 1) / PM_ROWS : 0;
    unsigned int slot = pm_mla_slot(b, b.begin, page_size, page_shift); // of the next issue
#pragma unroll
    for (int s = 0; s < PM_STAGES - 1; ++s) {
        if ((unsigned int)s < steps) {
            pm_mla_issue(s_stage[s], slot, b.begin + s * PM_ROWS, b.end, k_cache, kv_heads, b.kvh);
        }
        kvs_cp_commit();
        slot = pm_mla_slot(b, b.begin + (s + 1) * PM_ROWS, page_size, page_shift);
    }
    for (unsigned int it = 0; it < steps; ++it) {
        kvs_cp_wait<PM_STAGES - 2>(); // this thread's copies of step it have landed
        __syncthreads();          // and every thread's; every warp is done with step it - 1
        // Step it + PM_STAGES - 1 into the stage step it - 1 used.
        const unsigned int ahead = it + PM_STAGES - 1;
        if (ahead < steps) {
            pm_mla_issue(s_stage[ahead % PM_STAGES], slot, b.begin + ahead * PM_ROWS, b.end,
                         k_cache, kv_heads, b.kvh);
        }
        kvs_cp_commit();
        slot = pm_mla_slot(b, b.begin + (ahead + 1) * PM_ROWS, page_size, page_shift);
        const kvs_vec16* st = s_stage[it % PM_STAGES];
        const unsigned int row0 = b.begin + it * PM_ROWS;

        // This warp's part of the scores: c[n] rows 8n + 2tq, + 1 (n-tile n) of heads g
        // ([0], [1]) and g + 8 ([2], [3]).
        float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int i = 0; i < PM_WKT; ++i) {
            const unsigned int kt = warp + i * ATTN_WARPS;
            if (kt < PM_KT) {
                unsigned int kb[4];
#if PM_FP8
                const unsigned int x0 = pm_mla_k_word(st, g, tq, kt);
                const unsigned int x1 = pm_mla_k_word(st, 8 + g, tq, kt);
                kb[0] = pm_fp8_even(x0);
                kb[1] = pm_fp8_odd(x0);
                kb[2] = pm_fp8_even(x1);
                kb[3] = pm_fp8_odd(x1);
#else
                pm_ldsm_tiles<false>(st, pm_tiles_pair{2 * kt, 2 * kt + 1}, kb);
#endif
                pm_mma_k16(c[0], qh[i], kb[0], kb[1]);
                pm_mma_k16(c[0], ql[i], kb[0], kb[1]);
                pm_mma_k16(c[1], qh[i], kb[2], kb[3]);
                pm_mma_k16(c[1], ql[i], kb[2], kb[3]);
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            s_part[warp][e][lane] = c[e / 4][e % 4];
        }
        __syncthreads();
        float sc[2][4]; // heads g, g + 8: rows 2tq, 2tq + 1, 8 + 2tq, 9 + 2tq
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float x = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                x += s_part[w][e][lane];
            }
            const unsigned int n = e / 4, hh = e % 4 / 2, r = 8 * n + 2 * tq + e % 2;
            sc[hh][2 * n + e % 2] = row0 + r < b.end ? x * ks : KVS_NEG_INF;
        }
        float p[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mt = fmaxf(fmaxf(sc[hh][0], sc[hh][1]), fmaxf(sc[hh][2], sc[hh][3]));
            mt = fmaxf(mt, KVS_SHFL_XOR(mt, 1));
            mt = fmaxf(mt, KVS_SHFL_XOR(mt, 2));
            const float nm = fmaxf(m[hh], mt);
            const float alpha = m[hh] == KVS_NEG_INF ? 0.0f : expf(m[hh] - nm);
            float sum = 0.0f;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                p[hh][r] = sc[hh][r] == KVS_NEG_INF ? 0.0f : expf(sc[hh][r] - nm);
                sum += p[hh][r];
            }
            l[hh] = l[hh] * alpha + sum;
            m[hh] = nm;
#pragma unroll
            for (int j = 0; j < PM_WNT; ++j) {
                acc[j][2 * hh] *= alpha;
                acc[j][2 * hh + 1] *= alpha;
            }
        }
        // P as A registers (k = the step's rows): [0] head g's rows 2tq, 2tq + 1, [1] head
        // g + 8's, [2] and [3] rows 8 + 2tq, 9 + 2tq; ph the rounding, pl the rest.
        unsigned int ph[4], pl[4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float x0 = p[hh][2 * n], x1 = p[hh][2 * n + 1];
                const unsigned int hi = pm_pack(x0, x1);
                ph[2 * n + hh] = hi;
                pl[2 * n + hh] = pm_pack(x0 - pm_elem(hi, 0), x1 - pm_elem(hi, 1));
            }
        }
#if PM_FP8
        // Value rows 2tq, 2tq + 1 (y) and 8 + 2tq, 9 + 2tq (z) from byte w·8·PM_WNT + g·PM_WNT:
        // byte p of words i paired is n-tile 4i + p's B register (b0 from y, b1 from z).
#pragma unroll
        for (unsigned int i = 0; i < PM_WNT / 4; ++i) {
            const unsigned int y0 = pm_mla_v_word(st, 2 * tq, warp, g, i);
            const unsigned int y1 = pm_mla_v_word(st, 2 * tq + 1, warp, g, i);
            const unsigned int z0 = pm_mla_v_word(st, 8 + 2 * tq, warp, g, i);
            const unsigned int z1 = pm_mla_v_word(st, 9 + 2 * tq, warp, g, i);
            unsigned int yb[4], zb[4];
            yb[0] = pm_fp8_even(pm_pair_bytes<0>(y0, y1));
            yb[1] = pm_fp8_even(pm_pair_bytes<1>(y0, y1));
            yb[2] = pm_fp8_even(pm_pair_bytes<2>(y0, y1));
            yb[3] = pm_fp8_even(pm_pair_bytes<3>(y0, y1));
            zb[0] = pm_fp8_even(pm_pair_bytes<0>(z0, z1));
            zb[1] = pm_fp8_even(pm_pair_bytes<1>(z0, z1));
            zb[2] = pm_fp8_even(pm_pair_bytes<2>(z0, z1));
            zb[3] = pm_fp8_even(pm_pair_bytes<3>(z0, z1));
#pragma unroll
            for (unsigned int p = 0; p < 4; ++p) {
                pm_mma_k16(acc[4 * i + p], ph, yb[p], zb[p]);
                pm_mma_k16(acc[4 * i + p], pl, yb[p], zb[p]);
            }
        }
#else
#pragma unroll
        for (int j = 0; j < PM_WNT; j += 2) {
            const unsigned int nt = warp * PM_WNT + j;
            if (nt < PM_VNT) {
                // V rows 2tq, 2tq + 1 (tiles 0, 1) and 8 + 2tq, 9 + 2tq (tiles 2, 3) at dims
                // 8nt + g and 8(nt + 1) + g: the B registers of n-tiles nt and nt + 1 (a unit
                // of the row's rope part, or the next warp's, when nt + 1 is not this warp's).
                unsigned int vb[4];
                pm_ldsm_tiles<true>(st, pm_tiles_pair{nt, nt + 1}, vb);
                pm_mma_k16(acc[j], ph, vb[0], vb[2]);
                pm_mma_k16(acc[j], pl, vb[0], vb[2]);
                if (j + 1 < PM_WNT && nt + 1 < PM_VNT) {
                    pm_mma_k16(acc[j + 1], ph, vb[1], vb[3]);
                    pm_mma_k16(acc[j + 1], pl, vb[1], vb[3]);
                }
            }
        }
#endif
    }
    kvs_cp_wait<0>();

    // Every warp holds every head's state: each writes its own dims.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float total = l[hh];
        total += KVS_SHFL_XOR(total, 1);
        total += KVS_SHFL_XOR(total, 2);
        const unsigned int h = g + 8 * hh;
        if (h < b.nheads) {
            const size_t out_row = ((size_t)b.tok * q_heads + b.head0 + h) * b.num_splits + b.split;
            float* o = partial_o + out_row * V_HEAD_DIM;
            const float vs = v_scale * KV_FP8_F16_UNSCALE;
#pragma unroll
            for (int j = 0; j < PM_WNT; ++j) {
                if (warp * PM_WNT + j < PM_VNT) {
                    o[pm_mla_v_dim(warp, j, 2 * tq)] =
                        total != 0.0f ? acc[j][2 * hh] / total * vs : 0.0f;
                    o[pm_mla_v_dim(warp, j, 2 * tq + 1)] =
                        total != 0.0f ? acc[j][2 * hh + 1] / total * vs : 0.0f;
                }
            }
            if (warp == 0 && tq == 0) {
                partial_lse[out_row] = total != 0.0f ? m[hh] + logf(total) : KVS_NEG_INF;
            }
        }
    }
    kvs_attn_finish(b, q_heads, partial_o, partial_lse, out, counters, merge_in_kernel);
}
#endif // MLA
#else // the lanes' form
KVS_KERNEL void PL_BOUNDS paged_attention_pipelined(KVS_ATTN_PARAMS) {
    __shared__ pl_unit s_stage[PL_STAGES][PL_TILE][PL_ROW_UNITS];
    __shared__ float s_o[ATTN_WARPS][V_HEAD_DIM + 2]; // a warp's output of one head, its m, l

    const unsigned int t = threadIdx.x;
    const unsigned int x = t % PL_LANES; // this thread's lane in its row slot
    const unsigned int r = t / PL_LANES; // its row slot
    const unsigned int warp = t / WARP_SIZE;
    const kvs_attn_block b = kvs_attn_block_of(plan, q_heads, kv_heads, split_size);

    // This lane's elements of every head's scaled query (zeros past nheads and past the row).
    float qr[HEADS_PER_BLOCK][PL_K_UPL * PL_EPU];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
        for (int k = 0; k < PL_K_UPL; ++k) {
            const unsigned int u = x + k * PL_LANES;
            const bool live = (unsigned int)h < b.nheads && u < PL_K_UNITS;
            const float* qh = q + ((size_t)b.tok * q_heads + b.head0 + h) * HEAD_DIM + u * PL_EPU;
#pragma unroll
            for (int e = 0; e < PL_EPU; ++e) {
                qr[h][k * PL_EPU + e] = live ? qh[e] * scale : 0.0f;
            }
        }
    }
    float m[HEADS_PER_BLOCK];
    float l[HEADS_PER_BLOCK];
    float acc[HEADS_PER_BLOCK][PL_V_UPL * PL_EPU];
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        m[h] = KVS_NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int a = 0; a < PL_V_UPL * PL_EPU; ++a) {
            acc[h][a] = 0.0f;
        }
    }

    const unsigned int tiles = b.begin < b.end ? (b.end - b.begin + PL_TILE - 1) / PL_TILE : 0;
    unsigned int slot[PL_ROWS_PER_THREAD]; // of the next tile to issue
    pl_lookup(slot, b.pages, b.begin, b.end, r, page_size, page_shift);
    // The first PL_STAGES - 1 tiles; a group per tile, empty past the last.
#pragma unroll
    for (int s = 0; s < PL_STAGES - 1; ++s) {
        if ((unsigned int)s < tiles) {
            pl_issue(s_stage[s], slot, k_cache, v_cache, kv_heads, b.kvh, b.begin + s * PL_TILE,
                     b.end, r, x);
        }
        kvs_cp_commit();
        pl_lookup(slot, b.pages, b.begin + (s + 1) * PL_TILE, b.end, r, page_size, page_shift);
    }
    for (unsigned int it = 0; it < tiles; ++it) {
        // Tile it + PL_STAGES - 1 into the stage tile it - 1 used (read by this thread only).
        const unsigned int ahead = it + PL_STAGES - 1;
        if (ahead < tiles) {
            pl_issue(s_stage[ahead % PL_STAGES], slot, k_cache, v_cache, kv_heads, b.kvh,
                     b.begin + ahead * PL_TILE, b.end, r, x);
        }
        kvs_cp_commit();
        pl_lookup(slot, b.pages, b.begin + (ahead + 1) * PL_TILE, b.end, r, page_size,
                  page_shift);
        kvs_cp_wait<PL_STAGES - 1>(); // tile it's group (and every earlier one) has landed
        const pl_unit(*tile)[PL_ROW_UNITS] = s_stage[it % PL_STAGES];
        const unsigned int tile_begin = b.begin + it * PL_TILE;

        // Every head's score of this slot's rows (-inf past end).
        float p[PL_ROWS_PER_THREAD][HEADS_PER_BLOCK];
#pragma unroll
        for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
            const unsigned int row = r + i * PL_SLOTS;
            float part[HEADS_PER_BLOCK];
#pragma unroll
            for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
                part[h] = 0.0f;
            }
            if (tile_begin + row < b.end) {
#pragma unroll
                for (int k = 0; k < PL_K_UPL; ++k) {
                    const unsigned int u = x + k * PL_LANES;
                    if (u < PL_K_UNITS) {
                        float kx[PL_EPU];
                        pl_decode(tile[row][u], kx);
#pragma unroll
                        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
                            for (int e = 0; e < PL_EPU; ++e) {
                                part[h] += qr[h][k * PL_EPU + e] * kx[e];
                            }
                        }
                    }
                }
            }
            // The slot's lanes' sums (every lane of a slot takes the same branch above).
#pragma unroll
            for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
                for (int mask = 1; mask < PL_LANES; mask <<= 1) {
                    part[h] += KVS_SHFL_XOR(part[h], mask);
                }
                p[i][h] = tile_begin + row < b.end ? part[h] * k_scale : KVS_NEG_INF;
            }
        }
        // The online softmax per head: scores become probabilities against the new maximum.
#pragma unroll
        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
            float new_m = m[h];
#pragma unroll
            for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
                new_m = fmaxf(new_m, p[i][h]);
            }
            const float alpha = m[h] == KVS_NEG_INF ? 0.0f : expf(m[h] - new_m);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
                p[i][h] = p[i][h] == KVS_NEG_INF ? 0.0f : expf(p[i][h] - new_m);
                sum += p[i][h];
            }
            l[h] = l[h] * alpha + sum;
            m[h] = new_m;
#pragma unroll
            for (int a = 0; a < PL_V_UPL * PL_EPU; ++a) {
                acc[h][a] *= alpha;
            }
        }
        // Values: each unit decoded once, accumulated into every head.
#pragma unroll
        for (int i = 0; i < PL_ROWS_PER_THREAD; ++i) {
            const unsigned int row = r + i * PL_SLOTS;
            if (tile_begin + row < b.end) {
#pragma unroll
                for (int k = 0; k < PL_V_UPL; ++k) {
                    const unsigned int u = x + k * PL_LANES;
                    if (u < PL_V_UNITS) {
                        float vx[PL_EPU];
                        pl_decode(tile[row][MLA ? u : PL_K_UNITS + u], vx);
#pragma unroll
                        for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
                            for (int e = 0; e < PL_EPU; ++e) {
                                acc[h][k * PL_EPU + e] += p[i][h] * vx[e];
                            }
                        }
                    }
                }
            }
        }
    }

    // The row slots of a warp: lane x merges with lane x of the other slots (masks PL_LANES …
    // 16), each pair's weights by its maxima; both lanes of a pair compute the same sums.
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
#pragma unroll
        for (int mask = PL_LANES; mask < WARP_SIZE; mask <<= 1) {
            const float mo = KVS_SHFL_XOR(m[h], mask);
            const float lo = KVS_SHFL_XOR(l[h], mask);
            const float nm = fmaxf(m[h], mo);
            const float wa = m[h] == KVS_NEG_INF ? 0.0f : expf(m[h] - nm);
            const float wb = mo == KVS_NEG_INF ? 0.0f : expf(mo - nm);
            l[h] = l[h] * wa + lo * wb;
#pragma unroll
            for (int a = 0; a < PL_V_UPL * PL_EPU; ++a) {
                const float ao = KVS_SHFL_XOR(acc[h][a], mask);
                acc[h][a] = acc[h][a] * wa + ao * wb;
            }
            m[h] = nm;
        }
    }
    // The warps, in warp order, through shared memory (one head at a time).
    const bool writer = t % WARP_SIZE < PL_LANES; // the warp's first slot
#pragma unroll
    for (int h = 0; h < HEADS_PER_BLOCK; ++h) {
        if (writer) {
#pragma unroll
            for (int k = 0; k < PL_V_UPL; ++k) {
                const unsigned int u = x + k * PL_LANES;
                if (u < PL_V_UNITS) {
#pragma unroll
                    for (int e = 0; e < PL_EPU; ++e) {
                        s_o[warp][u * PL_EPU + e] = acc[h][k * PL_EPU + e];
                    }
                }
            }
            if (x == 0) {
                s_o[warp][V_HEAD_DIM] = m[h];
                s_o[warp][V_HEAD_DIM + 1] = l[h];
            }
        }
        __syncthreads();
        if ((unsigned int)h < b.nheads) {
            pl_merge_warps(b, h, q_heads, &s_o[0][V_HEAD_DIM], &s_o[0][V_HEAD_DIM + 1], &s_o[0][0],
                           V_HEAD_DIM + 2, partial_o, partial_lse, v_scale);
        }
        __syncthreads(); // s_o is rewritten for the next head
    }
    kvs_attn_finish(b, q_heads, partial_o, partial_lse, out, counters, merge_in_kernel);
}

#endif // PL_MMA

// counters[i] = 0 for i < n: the in-kernel merge's counters (kvs_attn_finish), once per plan.
KVS_KERNEL void zero_counters(unsigned int* counters, unsigned int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        counters[i] = 0;
    }
}

// Merges the splits of every (token, query head): one block per (token, head).
KVS_KERNEL void merge_states(const float* partial_o, const float* partial_lse, float* out,
                             unsigned int num_splits) {
    kvs_merge_row<false>(partial_o, partial_lse, blockIdx.x, num_splits,
                         out + (size_t)blockIdx.x * V_HEAD_DIM, threadIdx.x, blockDim.x);
}

// ---- paged_prefill: extend batches on the tensor cores (CudaConfig::prefill_tensor_cores) ----
// FlashAttention-2's schedule over the paged store: a block serves PF_ROWS query rows, a tile
// of up to PF_ROWS / pack consecutive new tokens of one request (the host's tile table: (first
// token of the batch, count) pairs, src/plan.rs prefill_tiles) for `pack` query heads of one
// KV head (src/plan.rs prefill_pack: GQA's heads share the rows the block stages, and a short
// extend fills more rows), row r being token r / pack and head head0 + r % pack. So every key
// and value row it stages serves PF_ROWS queries, where paged_attention's blocks serve one
// token each and read its whole causal prefix again.
// - Its PF_WARPS warps own 16 query rows each: the scores S = Q·Kᵀ of PF_KEYS positions a
//   step (mma.m16n8k16; the scaled query as a rounded part plus its remainder, two mmas, as
//   the decode form keeps ~22 bits of it), masked causally (position j of the step against
//   each row's own position), an online softmax per row (the row's maximum over its 4 lanes
//   of a quad), and O += P·V with P from the scores' registers (again a rounded part and its
//   remainder) and V through ldmatrix.trans. A warp with no live row skips the mmas.
// - Keys and values are staged by cp.async PF_STAGES steps deep.
// - The KV range splits across blocks as the attention kernels' does (grid.z, positions
//   split·split_size …, the host's SplitPlan over tiles × head blocks: a short extend over a
//   long prefix has too few tiles to fill the GPU), each writing its rows' normalised partial
//   outputs and log-sum-exps for merge_states; unsplit, the partial output is the output.
// - NaN: a NaN key reaches exactly the rows that attend it (the mask replaces a masked
//   score); a NaN or infinite value row also reaches the tile's earlier rows, which weight it
//   by 0 in P·V (0 · NaN), as FlashAttention's kernels do (in a model a NaN value row comes
//   with a NaN key, whose own row and every later one are NaN already).
// - f16, bf16 and fp8 stores with keys and values of one head dim, 64 or 128
//   (Spec::has_prefill); fp8 rows are staged as they are stored, then converted once a step
//   into f16 rows (exactly: e5m2 is an f16's top byte, e4m3's bits moved to f16's places are
//   its value times 2^-8, undone with the scales), which the mmas read as f16.
// The mmas run their portable stand-ins in the emulation, on HIP and before sm_80 (the host
// takes the kernel on sm_80 and later only).
#if !MLA && KV_DTYPE >= 1 && HEAD_DIM == V_HEAD_DIM && (HEAD_DIM == 64 || HEAD_DIM == 128)
#define PF_FORM 1
#define PF_ROWS 64                 // query rows of a block: (token, head) pairs
#define PF_WARPS (PF_ROWS / 16)    // 16 query rows a warp
#define PF_THREADS (PF_WARPS * WARP_SIZE)
#define PF_KEYS 32                 // positions a step stages and scores
// Tuning defines (KVSERVE_CUDA_DEFINES), untimed defaults: PF_STAGES steps staged ahead (3
// fills 48 KiB at head dim 128 for f16/bf16); PF_QSPLIT 1 runs the query and P as a rounded
// part plus its remainder (two mmas, ~22 bits, the decode form's precision), 0 the rounded
// part alone (one mma, FlashAttention's); PF_MIN_BLOCKS blocks per SM the registers must allow
// (2, the default, allows all 255: a bound only from 3 up).
#ifndef PF_STAGES
#define PF_STAGES 2
#endif
#ifndef PF_QSPLIT
#define PF_QSPLIT 1
#endif
#ifndef PF_MIN_BLOCKS
#define PF_MIN_BLOCKS 2
#endif
#define PF_UNITS (HEAD_DIM / 8)    // 16-byte units of a key or value row as the mmas read it
#define PF_SUNITS (HEAD_DIM * KV_BYTES / 16) // 16-byte units of a row as stored and staged
#define PF_FP8 (KV_DTYPE >= 3)
#define PF_KT (HEAD_DIM / 16)      // k-tiles of the scores' mmas
#define PF_NT (HEAD_DIM / 8)       // n-tiles of the output's mmas
#define PF_BF16 (KV_DTYPE == 2)
#if PF_STAGES < 2
#error "paged_prefill: PF_STAGES must be at least 2"
#endif
#if 2 * PF_STAGES * PF_KEYS * PF_SUNITS * 16 + (PF_FP8 ? 2 * PF_KEYS * PF_UNITS * 16 : 0) > 49152
#error "paged_prefill: the stages exceed 48 KiB of static shared memory"
#endif
#if defined(__CUDA_ARCH__)
#define PF_BOUNDS __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS)
#else
#define PF_BOUNDS
#endif

// Unit u of staged row `row` (a key or value row of the step), swizzled so that ldmatrix's 8
// rows of one unit (rows of 128 or 256 bytes all start in bank 0) fall in 8 bank groups.
struct pf_swizzle {
    __device__ static unsigned int at(unsigned int row, unsigned int u) {
        return row * PF_UNITS + (u ^ (row & 7u));
    }
};

// Copies a thread issues per step (of the keys, and as many of the values).
#define PF_COPIES (PF_KEYS * PF_SUNITS / PF_THREADS)
#if PF_COPIES * PF_THREADS != PF_KEYS * PF_SUNITS
#error "paged_prefill: a step's units must split evenly over the block's threads"
#endif

// Where a thread's copies of one step come from: element offsets into either cache (the key
// and value rows of a position share them), and whether each position is live.
struct pf_step_addrs {
    size_t at[PF_COPIES];
    bool in[PF_COPIES];
};

// A stage's tiles (kvs_tile_quad): ROW_BIT 1 the scores' B registers of two key n-tiles, 0
// with .trans the values' B registers of two dim n-tiles.
template <int ROW_BIT> using pf_tiles = kvs_tile_quad<ROW_BIT, pf_swizzle>;

KVS_KERNEL void PF_BOUNDS paged_prefill(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                                        const unsigned int* plan, const unsigned int* tiles,
                                        float* partial_o, float* partial_lse,
                                        unsigned int q_heads, unsigned int kv_heads,
                                        unsigned int pack,
                                        unsigned int page_size, unsigned int page_shift,
                                        unsigned int split_size, float scale, float k_scale,
                                        float v_scale) {
    __shared__ kvs_vec16 s_k[PF_STAGES][PF_KEYS * PF_SUNITS];
    __shared__ kvs_vec16 s_v[PF_STAGES][PF_KEYS * PF_SUNITS];
#if PF_FP8
    __shared__ kvs_vec16 s_kc[PF_KEYS * PF_UNITS]; // the step's rows converted to f16
    __shared__ kvs_vec16 s_vc[PF_KEYS * PF_UNITS];
#endif
    const unsigned int first = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
    // The block's query heads: head0 … head0 + nheads − 1 of KV head kvh's group, in blocks of
    // `pack` (a group of 7 in blocks of 4 takes a block of 4 and one of 3).
    const unsigned int group = q_heads / kv_heads;
    const unsigned int blocks_per_kv = (group + pack - 1) / pack;
    const unsigned int kvh = blockIdx.y / blocks_per_kv;
    const unsigned int in_group = blockIdx.y % blocks_per_kv * pack;
    const unsigned int head0 = kvh * group + in_group;
    const unsigned int nheads = group - in_group < pack ? group - in_group : pack;
    const unsigned int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const unsigned int g = lane >> 2, tq = lane & 3;
    const unsigned int req = plan[plan[PLAN_TOK_REQ] + first];
    const unsigned int pos0 = plan[plan[PLAN_TOK_POS] + first]; // the tile's positions are pos0 + i
    const unsigned int* pages = plan + plan[PLAN_KV_INDICES] + plan[plan[PLAN_KV_INDPTR] + req];
    // This block's split of the tile's positions: kv_begin (= split · split_size) up to
    // kv_end, causal (the tile's last query sees positions below pos0 + count). A split past
    // the tile's end (a short request beside a long one) has no step: its rows write the empty
    // state.
    const unsigned int kv_begin = blockIdx.z * split_size;
    const unsigned int kv_end =
        pos0 + count < kv_begin + split_size ? pos0 + count : kv_begin + split_size;

    // This lane's rows of the warp's 16: r[h] = 16·warp + g + 8h, which is token r / pack of
    // the tile and head head0 + r % pack (qrow, below), live for the tile's tokens and the
    // block's heads; a dead row reads the tile's first token's query and attends without a
    // mask (finite, never written). seen[h]: how many of the split's positions the row sees
    // (its causal end, from kv_begin).
    unsigned int seen[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned int r = 16 * warp + g + 8 * h;
        live[h] = r / pack < count && r % pack < nheads;
        const unsigned int t = live[h] ? r / pack : 0;
        const unsigned int end = live[h] && pos0 + t + 1 < kv_end ? pos0 + t + 1 : kv_end;
        seen[h] = end > kv_begin ? end - kv_begin : 0;
    }
    // Row h's query (and output) row of the batch: token × q_heads + head.
    auto qrow = [&](int h) -> size_t {
        const unsigned int r = 16 * warp + g + 8 * h;
        return live[h] ? (size_t)(first + r / pack) * q_heads + head0 + r % pack
                       : (size_t)first * q_heads + head0;
    };
    // The scaled query as A registers of k-tile kt: hi = its rounding, lo = the rest (in f16
    // for f16 and fp8 stores: a scaled query element beyond f16's 65504 would give NaN scores,
    // as in the decode form; attention queries are far below it). Not loaded by a split with
    // no step.
    unsigned int qh[PF_KT][4], ql[PF_KT][4];
    if (kv_begin < kv_end) {
#pragma unroll
        for (int kt = 0; kt < PF_KT; ++kt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // a[0]/a[2]: row g, dims 16kt + 2tq (+ 8 for a[2]); a[1]/a[3]: row g + 8
                const float* qr = q + qrow(i & 1) * HEAD_DIM + 16 * kt + 8 * (i >> 1) + 2 * tq;
                const float x0 = qr[0] * scale, x1 = qr[1] * scale;
                const unsigned int hi = kvs_b16_pack<PF_BF16>(x0, x1);
                qh[kt][i] = hi;
                ql[kt][i] = kvs_b16_pack<PF_BF16>(x0 - kvs_b16_elem<PF_BF16>(hi, 0),
                                                  x1 - kvs_b16_elem<PF_BF16>(hi, 1));
            }
        }
    }

    // Step s's copies: the key and value rows of positions kv_begin + s·PF_KEYS + row, zeros past
    // kv_end; thread t copies units t, t + PF_THREADS, … of each (f16/bf16 swizzled for
    // ldmatrix; fp8 in place, for the conversion). `locate` resolves their page-table entries,
    // a step before `issue` copies them, so the lookups' latency hides behind a step's mmas.
    auto locate = [&](unsigned int s) {
        pf_step_addrs a;
#pragma unroll
        for (unsigned int c = 0; c < PF_COPIES; ++c) {
            const unsigned int flat = c * PF_THREADS + threadIdx.x;
            const unsigned int j = kv_begin + s * PF_KEYS + flat / PF_SUNITS;
            a.in[c] = j < kv_end;
            a.at[c] = a.in[c] ? ((size_t)kvs_slot(pages, j, page_size, page_shift) * kv_heads + kvh) *
                                        HEAD_DIM +
                                    flat % PF_SUNITS * (16 / KV_BYTES)
                              : 0;
        }
        return a;
    };
    auto issue = [&](unsigned int slot, const pf_step_addrs& a) {
#pragma unroll
        for (unsigned int c = 0; c < PF_COPIES; ++c) {
            const unsigned int flat = c * PF_THREADS + threadIdx.x;
            const unsigned int to =
                PF_FP8 ? flat : pf_swizzle::at(flat / PF_SUNITS, flat % PF_SUNITS);
            kvs_cp_async16(&s_k[slot][to], k_cache + a.at[c], a.in[c]);
            kvs_cp_async16(&s_v[slot][to], v_cache + a.at[c], a.in[c]);
        }
    };

    float o[PF_NT][4];
#pragma unroll
    for (int nt = 0; nt < PF_NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[nt][e] = 0.0f;
        }
    }
    float m[2] = {KVS_NEG_INF, KVS_NEG_INF}; // rows g, g + 8: running maxima (the quad's)
    float l[2] = {0.0f, 0.0f};               // this lane's share of their running sums
    const unsigned int steps = kv_begin < kv_end ? (kv_end - kv_begin + PF_KEYS - 1) / PF_KEYS : 0;
#pragma unroll
    for (unsigned int s = 0; s + 1 < PF_STAGES; ++s) {
        if (s < steps) {
            issue(s, locate(s));
        }
        kvs_cp_commit();
    }
    pf_step_addrs ahead = locate(PF_STAGES - 1); // the next step to issue
    // A warp with no live row (a short tile's tail) only takes its part in the copies and the
    // barriers. Warp-uniform; the mmas' stand-ins are per warp.
    const bool warp_live = 16 * warp / pack < count;
    for (unsigned int s = 0; s < steps; ++s) {
        kvs_cp_wait<PF_STAGES - 2>(); // this thread's copies of step s are in
        __syncthreads(); // everyone's, and every warp is done with step s − 1's slot
        const unsigned int next = s + PF_STAGES - 1;
        if (next < steps) {
            issue(next % PF_STAGES, ahead);
        }
        kvs_cp_commit();
        ahead = locate(next + 1);
#if PF_FP8
        // The step's fp8 rows as f16 rows: each staged unit (16 values) into two units.
        for (unsigned int flat = threadIdx.x; flat < PF_KEYS * PF_SUNITS; flat += PF_THREADS) {
            const unsigned int row = flat / PF_SUNITS, u = flat % PF_SUNITS;
#pragma unroll
            for (int part = 0; part < 2; ++part) {
                const kvs_vec16 raw = (part ? s_v : s_k)[s % PF_STAGES][flat];
                kvs_vec16* dst = part ? s_vc : s_kc;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    // The halves in turn, units 4-7 of a row's first 8 from the odd half first,
                    // so the 8 threads of a store phase (one row, u = 0 … 7) write 8 bank
                    // groups (in u order they would write units 0, 2, 4, 6 twice).
                    const int half = hh ^ (int)((u >> 2) & 1u);
                    // This half's words of raw, chosen by selects: an index that depends on u
                    // would put raw in local memory.
                    const unsigned int lo = half ? raw.w[2] : raw.w[0];
                    const unsigned int hi = half ? raw.w[3] : raw.w[1];
                    kvs_vec16 h;
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        // bytes 2w, 2w + 1 of this half, moved to bytes 0 and 2
                        const unsigned int x = (w < 2 ? lo : hi) >> (16 * (w % 2));
                        h.w[w] = kv_fp8x2_to_f16x2((x & 0xffu) | ((x & 0xff00u) << 8));
                    }
                    dst[pf_swizzle::at(row, 2 * u + half)] = h;
                }
            }
        }
        __syncthreads(); // the converted rows, before any warp reads them
        const kvs_vec16* sk = s_kc;
        const kvs_vec16* sv = s_vc;
#else
        const kvs_vec16* sk = s_k[s % PF_STAGES];
        const kvs_vec16* sv = s_v[s % PF_STAGES];
#endif
        if (!warp_live) {
            continue;
        }

        // Scores of the step's 4 key n-tiles: sc[nt] rows g ([0], [1]) and g + 8 ([2], [3]),
        // positions s·PF_KEYS + 8nt + 2tq, + 1.
        float sc[PF_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sc[nt][e] = 0.0f;
            }
        }
#pragma unroll
        for (unsigned int kt = 0; kt < PF_KT; ++kt) {
#pragma unroll
            for (unsigned int np = 0; np < PF_KEYS / 16; ++np) {
                unsigned int kb[4];
                kvs_ldsm_x4<false>(pf_tiles<1>{sk, 16 * np, 2 * kt}, kb);
                kvs_mma_k16<PF_BF16, PF_WARPS>(sc[2 * np], qh[kt], kb[0], kb[1]);
                kvs_mma_k16<PF_BF16, PF_WARPS>(sc[2 * np + 1], qh[kt], kb[2], kb[3]);
                if (PF_QSPLIT) {
                    kvs_mma_k16<PF_BF16, PF_WARPS>(sc[2 * np], ql[kt], kb[0], kb[1]);
                    kvs_mma_k16<PF_BF16, PF_WARPS>(sc[2 * np + 1], ql[kt], kb[2], kb[3]);
                }
            }
        }
        // The causal mask, the rows' step maxima and the rescale of what came before.
        float step_max[2] = {KVS_NEG_INF, KVS_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int j = s * PF_KEYS + 8 * nt + 2 * tq + (e & 1); // from kv_begin
                const int h = e >> 1;
                const float x = j < seen[h]
                                    ? sc[nt][e] * (k_scale * KV_FP8_F16_UNSCALE)
                                    : KVS_NEG_INF;
                sc[nt][e] = x;
                step_max[h] = fmaxf(step_max[h], x);
            }
        }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            step_max[h] = fmaxf(step_max[h], KVS_SHFL_XOR(step_max[h], 1));
            step_max[h] = fmaxf(step_max[h], KVS_SHFL_XOR(step_max[h], 2));
            const float m_new = fmaxf(m[h], step_max[h]);
            // A row with no position yet (m_new = −inf) keeps zeros: corr 1, p 0.
            corr[h] = m_new == KVS_NEG_INF ? 1.0f : expf(m[h] - m_new);
            m[h] = m_new;
            l[h] *= corr[h];
        }
#pragma unroll
        for (int nt = 0; nt < PF_NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[nt][e] *= corr[e >> 1];
            }
        }
        // P = exp(S − m) as A registers of the values' k-tiles (16 positions each): its
        // rounding and the rest, from the scores' registers (their C layout is the A layout).
#pragma unroll
        for (unsigned int kk = 0; kk < PF_KEYS / 16; ++kk) {
            unsigned int ph[4], pl[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // a[0]: row g of n-tile 2kk; a[1]: row g + 8; a[2], a[3]: n-tile 2kk + 1
                const int nt = 2 * kk + (i >> 1), h = i & 1;
                float p[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x = sc[nt][2 * h + e];
                    p[e] = x == KVS_NEG_INF ? 0.0f : expf(x - m[h]);
                    l[h] += p[e];
                }
                ph[i] = kvs_b16_pack<PF_BF16>(p[0], p[1]);
                pl[i] = kvs_b16_pack<PF_BF16>(p[0] - kvs_b16_elem<PF_BF16>(ph[i], 0),
                                              p[1] - kvs_b16_elem<PF_BF16>(ph[i], 1));
            }
#pragma unroll
            for (unsigned int up = 0; up < PF_NT / 2; ++up) {
                unsigned int vb[4];
                kvs_ldsm_x4<true>(pf_tiles<0>{sv, 16 * kk, 2 * up}, vb);
                kvs_mma_k16<PF_BF16, PF_WARPS>(o[2 * up], ph, vb[0], vb[1]);
                kvs_mma_k16<PF_BF16, PF_WARPS>(o[2 * up + 1], ph, vb[2], vb[3]);
                if (PF_QSPLIT) {
                    kvs_mma_k16<PF_BF16, PF_WARPS>(o[2 * up], pl, vb[0], vb[1]);
                    kvs_mma_k16<PF_BF16, PF_WARPS>(o[2 * up + 1], pl, vb[2], vb[3]);
                }
            }
        }
    }
    // The rows' sums over their quads, then each live row's state for its split, as the
    // attention kernels write theirs: O / l · v_scale (o[nt] rows g ([0], [1]) and g + 8
    // ([2], [3]) at dims 8nt + 2tq, + 1) and log-sum-exp m + ln l. Unsplit, partial_o is the
    // output. A row that sees no position of the split (l == 0: its causal end is before it)
    // writes the empty state, zeros and −inf; a NaN l carries on.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += KVS_SHFL_XOR(l[h], 1);
        l[h] += KVS_SHFL_XOR(l[h], 2);
        if (!live[h]) {
            continue;
        }
        const size_t row = qrow(h) * gridDim.z + blockIdx.z;
        float* orow = partial_o + row * V_HEAD_DIM;
        const bool empty = l[h] == 0.0f;
        const float inv = empty ? 0.0f : v_scale * KV_FP8_F16_UNSCALE / l[h];
#pragma unroll
        for (int nt = 0; nt < PF_NT; ++nt) {
            orow[8 * nt + 2 * tq] = o[nt][2 * h] * inv;
            orow[8 * nt + 2 * tq + 1] = o[nt][2 * h + 1] * inv;
        }
        if (tq == 0) {
            partial_lse[row] = empty ? KVS_NEG_INF : m[h] + logf(l[h]);
        }
    }
}
#endif // paged_prefill
