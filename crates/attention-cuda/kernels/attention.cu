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

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / WARP_SIZE)
#define ATTN_V_PER_THREAD ((V_HEAD_DIM + ATTN_THREADS - 1) / ATTN_THREADS)
#define ATTN_K_PER_LANE ((HEAD_DIM + WARP_SIZE - 1) / WARP_SIZE)

#define PLAN_TOK_REQ 0
#define PLAN_TOK_POS 1
#define PLAN_KV_INDPTR 2
#define PLAN_KV_INDICES 3

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

// part[k] is this lane's partial sum for key k of its warp (WARP_SIZE keys); returns the full
// sum over the warp's lanes of key `lane`. A butterfly that halves the live keys at each step
// (16 + 8 + 4 + 2 + 1 = 31 shuffles for 32 keys, against 5 per key for a reduction per key): at
// the step of width h a lane with bit h set keeps the upper half of its live keys and sends
// the lower half to lane ^ h, which keeps the lower half, so the keys a lane ends with are
// those whose index bits equal its own.
__device__ inline float kvs_warp_transpose_sum(float* part) {
#pragma unroll
    for (int h = WARP_SIZE / 2; h > 0; h >>= 1) {
        const bool upper = (threadIdx.x & h) != 0;
#pragma unroll
        for (int i = 0; i < h; ++i) {
            const float send = upper ? part[i] : part[i + h];
            const float keep = upper ? part[i + h] : part[i];
            part[i] = keep + KVS_SHFL_XOR(send, h);
        }
    }
    return part[0];
}

// One block of ATTN_THREADS per (token, query head, split): grid.x = tokens × q_heads,
// grid.y = num_splits. The block walks its split's keys ATTN_THREADS at a time with an online
// softmax, and writes the normalised partial output and its log-sum-exp (-inf and zeros for an
// empty split).
//
// Memory access (the kernel is bound by reading the cache):
// - Keys: warp w scores the chunk's keys w·32 … w·32 + 31. For each of them in turn the whole
//   warp reads the key row, lane l the elements l, l + 32, …: one instruction reads 32
//   consecutive elements of one row (64 bytes for f16, 128 for f32), a coalesced access, where
//   a thread per key would touch 32 rows, 32 transactions per instruction. Each lane keeps
//   partial dot products for the warp's 32 keys (the scaled query in shared memory), and
//   kvs_warp_transpose_sum leaves key l's score in lane l, so thread t holds the score of key
//   t of the chunk for the block-wide softmax step.
// - Values: thread t accumulates value element t (and t + 128, …) over the chunk's keys, so
//   for each key the block reads consecutive elements of one value row: coalesced as well.
// - The page table: each thread resolves the slot of its own key once per chunk (s_slot).
KVS_KERNEL void paged_attention(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                                const unsigned int* plan, float* partial_o, float* partial_lse,
                                unsigned int q_heads, unsigned int kv_heads,
                                unsigned int page_size, unsigned int page_shift,
                                unsigned int split_size, float scale, float k_scale,
                                float v_scale) {
    __shared__ float s_q[HEAD_DIM];
    __shared__ float s_p[ATTN_THREADS];
    __shared__ unsigned int s_slot[ATTN_THREADS];
    __shared__ float s_red[ATTN_WARPS];

    const unsigned int t = threadIdx.x;
    const unsigned int lane = t % WARP_SIZE;
    const unsigned int warp = t / WARP_SIZE;
    const unsigned int tok = blockIdx.x / q_heads;
    const unsigned int head = blockIdx.x % q_heads;
    const unsigned int kvh = head / (q_heads / kv_heads);
    const unsigned int split = blockIdx.y;
    const unsigned int num_splits = gridDim.y;

    const unsigned int req = plan[plan[PLAN_TOK_REQ] + tok];
    const unsigned int pos = plan[plan[PLAN_TOK_POS] + tok];
    const unsigned int* pages = plan + plan[PLAN_KV_INDICES] + plan[plan[PLAN_KV_INDPTR] + req];
    const unsigned int kv_end = pos + 1; // causal: positions 0..=pos
    const unsigned int begin = split * split_size;
    const unsigned int end = begin + split_size < kv_end ? begin + split_size : kv_end;

    for (unsigned int d = t; d < HEAD_DIM; d += ATTN_THREADS) {
        s_q[d] = q[((size_t)tok * q_heads + head) * HEAD_DIM + d] * scale;
    }
    __syncthreads();

    float m = KVS_NEG_INF;
    float l = 0.0f;
    float acc[ATTN_V_PER_THREAD];
    for (int i = 0; i < ATTN_V_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    for (unsigned int c = begin; c < end; c += ATTN_THREADS) {
        const unsigned int j = c + t;
        s_slot[t] = j < end ? kvs_slot(pages, j, page_size, page_shift) : 0;
        __syncthreads(); // every lane reads its warp's slots below
        // The warp's keys: first .. first + nkeys - 1 (the same for every lane of the warp).
        const unsigned int first = c + warp * WARP_SIZE;
        const unsigned int left = first < end ? end - first : 0;
        const unsigned int nkeys = left < WARP_SIZE ? left : WARP_SIZE;
        float part[WARP_SIZE];
#pragma unroll
        for (int kk = 0; kk < WARP_SIZE; ++kk) {
            part[kk] = 0.0f;
        }
        // Not unrolled (the key loop inside is): the code stays small for wide heads.
#pragma unroll 1
        for (int i = 0; i < ATTN_K_PER_LANE; ++i) {
            const unsigned int d = lane + i * WARP_SIZE;
            if (d < HEAD_DIM) {
                const float qd = s_q[d];
#pragma unroll
                for (int kk = 0; kk < WARP_SIZE; ++kk) {
                    if ((unsigned int)kk < nkeys) {
                        const kv_t* kr = k_cache +
                            ((size_t)s_slot[warp * WARP_SIZE + kk] * kv_heads + kvh) * HEAD_DIM;
                        part[kk] += qd * kv_load(kr, d);
                    }
                }
            }
        }
        const float dot = kvs_warp_transpose_sum(part);
        const float s = j < end ? dot * k_scale : KVS_NEG_INF;
        const float chunk_max = kvs_block_max(s, s_red);
        const float new_m = fmaxf(m, chunk_max);
        const float p = j < end ? expf(s - new_m) : 0.0f;
        s_p[t] = p;
        const float alpha = m == KVS_NEG_INF ? 0.0f : expf(m - new_m);
        l = l * alpha + kvs_block_sum(p, s_red); // its barrier also publishes s_p
        m = new_m;
        const unsigned int count = end - c < ATTN_THREADS ? end - c : ATTN_THREADS;
        for (int i = 0; i < ATTN_V_PER_THREAD; ++i) {
            const unsigned int d = t + i * ATTN_THREADS;
            if (d < V_HEAD_DIM) {
                float a = acc[i] * alpha;
                for (unsigned int jj = 0; jj < count; ++jj) {
                    const kv_t* vr = v_cache + ((size_t)s_slot[jj] * kv_heads + kvh) * V_ROW;
                    a += s_p[jj] * kv_load(vr, d);
                }
                acc[i] = a;
            }
        }
        __syncthreads(); // s_p and s_slot are rewritten by the next chunk
    }

    const size_t out = ((size_t)tok * q_heads + head) * num_splits + split;
    for (int i = 0; i < ATTN_V_PER_THREAD; ++i) {
        const unsigned int d = t + i * ATTN_THREADS;
        if (d < V_HEAD_DIM) {
            partial_o[out * V_HEAD_DIM + d] = l > 0.0f ? acc[i] / l * v_scale : 0.0f;
        }
    }
    if (t == 0) {
        partial_lse[out] = l > 0.0f ? m + logf(l) : KVS_NEG_INF;
    }
}

// Merges the splits of every (token, query head) by their log-sum-exp (SGLang's merge_state):
// out = Σ_s exp(lse_s − M) · o_s / Σ_s exp(lse_s − M). One block per (token, head).
KVS_KERNEL void merge_states(const float* partial_o, const float* partial_lse, float* out,
                             unsigned int num_splits) {
    const size_t base = (size_t)blockIdx.x * num_splits;
    float mx = KVS_NEG_INF;
    for (unsigned int s = 0; s < num_splits; ++s) {
        mx = fmaxf(mx, partial_lse[base + s]);
    }
    float wsum = 0.0f;
    for (unsigned int s = 0; s < num_splits; ++s) {
        const float lse = partial_lse[base + s];
        wsum += lse == KVS_NEG_INF ? 0.0f : expf(lse - mx);
    }
    for (unsigned int d = threadIdx.x; d < V_HEAD_DIM; d += blockDim.x) {
        float o = 0.0f;
        for (unsigned int s = 0; s < num_splits; ++s) {
            const float lse = partial_lse[base + s];
            if (lse != KVS_NEG_INF) {
                o += expf(lse - mx) * partial_o[(base + s) * V_HEAD_DIM + d];
            }
        }
        out[(size_t)blockIdx.x * V_HEAD_DIM + d] = o / wsum;
    }
}
