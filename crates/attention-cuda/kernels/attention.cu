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
#define ATTN_V_PER_THREAD ((V_HEAD_DIM + ATTN_THREADS - 1) / ATTN_THREADS)

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

// One block of ATTN_THREADS per (token, query head, split): grid.x = tokens × q_heads,
// grid.y = num_splits. The block walks its split's keys ATTN_THREADS at a time: each thread
// scores one key (q·k over HEAD_DIM), the block takes the chunk's max and sum (online
// softmax), and each thread accumulates its value dimensions over the chunk. It writes the
// normalised partial output and its log-sum-exp (-inf and zeros for an empty split).
KVS_KERNEL void paged_attention(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                                const unsigned int* plan, float* partial_o, float* partial_lse,
                                unsigned int q_heads, unsigned int kv_heads,
                                unsigned int page_size, unsigned int page_shift,
                                unsigned int split_size, float scale, float k_scale,
                                float v_scale) {
    __shared__ float s_q[HEAD_DIM];
    __shared__ float s_p[ATTN_THREADS];
    __shared__ unsigned int s_slot[ATTN_THREADS];
    __shared__ float s_red[ATTN_THREADS / WARP_SIZE];

    const unsigned int t = threadIdx.x;
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
        float s = KVS_NEG_INF;
        unsigned int slot = 0;
        if (j < end) {
            slot = kvs_slot(pages, j, page_size, page_shift);
            const kv_t* kr = k_cache + ((size_t)slot * kv_heads + kvh) * HEAD_DIM;
            float dot = 0.0f;
            for (unsigned int d = 0; d < HEAD_DIM; ++d) {
                dot += s_q[d] * kv_load(kr, d);
            }
            s = dot * k_scale;
        }
        const float chunk_max = kvs_block_max(s, s_red);
        const float new_m = fmaxf(m, chunk_max);
        const float p = j < end ? expf(s - new_m) : 0.0f;
        s_p[t] = p;
        s_slot[t] = slot;
        const float alpha = m == KVS_NEG_INF ? 0.0f : expf(m - new_m);
        l = l * alpha + kvs_block_sum(p, s_red); // its barrier also publishes s_p and s_slot
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
