// DoubleSparse kernels (SGLang's `double_sparsity` backend): the label rows written with K, and
// decode attention over each query head's top_k positions by label score. Specialised by
// KV_DTYPE only; head dims, label channels and the page size are arguments (the general page
// walk: these kernels read a few rows per position, not a stream of whole pages).
//
// A write list is store.cu's: [count, slot_0 .. slot_{count-1}, row_0 .. row_{count-1}].

#define DS_THREADS 128
// The widest head (keys and values) ds_decode takes; the host checks.
#define DS_MAX_DIM 256
#define DS_DIMS_PER_THREAD (DS_MAX_DIM / DS_THREADS)

// labels[slot_i] = the key row k[row_i] at the label channels, per KV head: element
// g · heavy + c is k[row_i, g, channels[g · heavy + c]], converted to the store dtype unscaled
// (labels keep scale 1, as the host store's). One block per write-list entry.
KVS_KERNEL void store_labels(const float* k, const unsigned int* writes,
                             const unsigned int* channels, kv_t* labels, unsigned int kv_heads,
                             unsigned int head_dim, unsigned int heavy) {
    unsigned int count = writes[0];
    if (blockIdx.x >= count) {
        return;
    }
    unsigned int slot = writes[1 + blockIdx.x];
    unsigned int row = writes[1 + count + blockIdx.x];
    unsigned int width = kv_heads * heavy;
    const float* src = k + (size_t)row * kv_heads * head_dim;
    kv_t* dst = labels + (size_t)slot * width;
    for (unsigned int i = threadIdx.x; i < width; i += blockDim.x) {
        dst[i] = kv_from_f32(src[(i / heavy) * head_dim + channels[i]]);
    }
}

// The store row of position j of a request whose page list starts at `pages`.
__device__ inline unsigned int ds_slot(const unsigned int* pages, unsigned int j,
                                       unsigned int page_size) {
    return pages[j / page_size] * page_size + j % page_size;
}

// A float's bits as an unsigned integer of the same order (larger float, larger key).
__device__ inline unsigned int ds_key(float s) {
    unsigned int u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The label score of one position: Σ_c qlab[c] · label[c], fused multiply-adds in channel
// order, so every pass over a position computes the same bits.
__device__ inline float ds_score(const float* qlab, const kv_t* label, unsigned int heavy) {
    float s = 0.0f;
    for (unsigned int c = 0; c < heavy; ++c) {
        s = fmaf(qlab[c], kv_to_f32(label[c]), s);
    }
    return s;
}

// DoubleSparse decode: one block per (token, query head) of a decode batch. The head scores
// every position 0..=pos of its request by its query at its KV head's label channels, keeps
// the top_k best (ties: the earlier position; every position when there are at most top_k),
// and attends exactly over them. `plan` is the attention page table (attention.cu's layout).
// out is [tokens, q_heads, v_head_dim].
//
// 1. The top_k-th largest score's key by radix select, 8 bits a pass from the top: a
//    histogram of the keys that match the digits chosen so far, then the digit where the
//    count from the top reaches the keys still wanted. It ends with the threshold key and
//    how many positions of exactly that key to keep (the earliest ones).
// 2. The kept positions in chunks of DS_THREADS, one per thread: a block scan ranks the
//    threshold ties by position; each kept thread computes its q·k; an online softmax over
//    the chunks accumulates the values, each thread owning value dims threadIdx.x + i ·
//    DS_THREADS.
KVS_KERNEL void ds_decode(const float* q, const kv_t* k_cache, const kv_t* v_cache,
                          const kv_t* labels, const unsigned int* plan,
                          const unsigned int* channels, float* out, unsigned int q_heads,
                          unsigned int kv_heads, unsigned int head_dim, unsigned int v_head_dim,
                          unsigned int heavy, unsigned int top_k, unsigned int page_size,
                          float scale, float k_scale, float v_scale) {
    __shared__ float qs[DS_MAX_DIM];
    __shared__ float qlab[DS_MAX_DIM];
    __shared__ unsigned int hist[256];
    __shared__ unsigned int pick[2];
    __shared__ unsigned int ties[DS_THREADS];
    __shared__ float probs[DS_THREADS];
    __shared__ unsigned int rows[DS_THREADS];
    __shared__ float red[DS_THREADS / WARP_SIZE];

    const unsigned int tid = threadIdx.x;
    const unsigned int tok = blockIdx.x / q_heads;
    const unsigned int h = blockIdx.x % q_heads;
    const unsigned int g = h / (q_heads / kv_heads);
    const unsigned int req = plan[plan[PLAN_TOK_REQ] + tok];
    const unsigned int kv_len = plan[plan[PLAN_TOK_POS] + tok] + 1;
    const unsigned int* pages = plan + plan[PLAN_KV_INDICES] + plan[plan[PLAN_KV_INDPTR] + req];
    const float* qrow = q + ((size_t)tok * q_heads + h) * head_dim;
    for (unsigned int i = tid; i < head_dim; i += DS_THREADS) {
        qs[i] = qrow[i];
    }
    __syncthreads();
    for (unsigned int c = tid; c < heavy; c += DS_THREADS) {
        qlab[c] = qs[channels[g * heavy + c]];
    }
    __syncthreads();
    const size_t label_row = (size_t)kv_heads * heavy;
    const kv_t* lab = labels + (size_t)g * heavy;

    // 1. The threshold key and how many of its ties to keep.
    const bool keep_all = kv_len <= top_k;
    unsigned int thr = 0;
    unsigned int keep_ties = 0;
    if (!keep_all) {
        unsigned int prefix = 0, mask = 0, wanted = top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (unsigned int i = tid; i < 256; i += DS_THREADS) {
                hist[i] = 0;
            }
            __syncthreads();
            for (unsigned int j = tid; j < kv_len; j += DS_THREADS) {
                unsigned int slot = ds_slot(pages, j, page_size);
                unsigned int key = ds_key(ds_score(qlab, lab + slot * label_row, heavy));
                if ((key & mask) == prefix) {
                    atomicAdd(&hist[(key >> shift) & 255u], 1u);
                }
            }
            __syncthreads();
            if (tid == 0) {
                unsigned int above = 0, digit = 0;
                for (int b = 255; b >= 0; --b) {
                    if (above + hist[b] >= wanted) {
                        digit = (unsigned int)b;
                        break;
                    }
                    above += hist[b];
                }
                pick[0] = digit;
                pick[1] = wanted - above;
            }
            __syncthreads();
            prefix |= pick[0] << shift;
            mask |= 255u << shift;
            wanted = pick[1];
        }
        thr = prefix;
        keep_ties = wanted;
    }

    // 2. Attention over the kept positions.
    float m = KVS_NEG_INF, l = 0.0f;
    float acc[DS_DIMS_PER_THREAD];
    for (int i = 0; i < DS_DIMS_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    const size_t k_row = (size_t)kv_heads * head_dim, v_row = (size_t)kv_heads * v_head_dim;
    unsigned int ties_before = 0;
    for (unsigned int base = 0; base < kv_len; base += DS_THREADS) {
        const unsigned int j = base + tid;
        const bool in = j < kv_len;
        unsigned int slot = 0, key = 0;
        if (in) {
            slot = ds_slot(pages, j, page_size);
            if (!keep_all) {
                key = ds_key(ds_score(qlab, lab + slot * label_row, heavy));
            }
        }
        const unsigned int tie = in && !keep_all && key == thr ? 1u : 0u;
        // Inclusive scan of the ties over the chunk (Hillis–Steele).
        ties[tid] = tie;
        __syncthreads();
        for (unsigned int off = 1; off < DS_THREADS; off <<= 1) {
            unsigned int add = tid >= off ? ties[tid - off] : 0u;
            __syncthreads();
            ties[tid] += add;
            __syncthreads();
        }
        const unsigned int rank = ties_before + ties[tid] - tie;
        ties_before += ties[DS_THREADS - 1];
        const bool keep = in && (keep_all || key > thr || (tie && rank < keep_ties));
        float s = KVS_NEG_INF;
        if (keep) {
            const kv_t* kr = k_cache + slot * k_row + (size_t)g * head_dim;
            float dot = 0.0f;
            for (unsigned int i = 0; i < head_dim; ++i) {
                dot = fmaf(qs[i], kv_to_f32(kr[i]), dot);
            }
            s = dot * k_scale * scale;
            // A NaN score (a NaN key) as +inf: the block maximum (fmaxf) would drop a NaN, and a
            // chunk whose only kept key is NaN would be skipped as empty. +inf makes the chunk's
            // exp(s - max) NaN instead, so the output is NaN, as the reference's.
            if (s != s) {
                s = __int_as_float(0x7f800000);
            }
        }
        const float chunk_max = kvs_block_max(s, red);
        if (chunk_max == KVS_NEG_INF) {
            continue; // nothing kept in this chunk (the same for every thread)
        }
        const float m_new = fmaxf(m, chunk_max);
        const float corr = expf(m - m_new);
        const float p = keep ? expf(s - m_new) : 0.0f;
        probs[tid] = p;
        rows[tid] = slot;
        l = l * corr + kvs_block_sum(p, red);
        for (int i = 0; i < DS_DIMS_PER_THREAD; ++i) {
            const unsigned int dim = tid + (unsigned int)i * DS_THREADS;
            if (dim >= v_head_dim) {
                break;
            }
            float a = acc[i] * corr;
            for (unsigned int t = 0; t < DS_THREADS; ++t) {
                if (probs[t] != 0.0f) {
                    a = fmaf(probs[t], kv_to_f32(v_cache[rows[t] * v_row + g * v_head_dim + dim]),
                             a);
                }
            }
            acc[i] = a;
        }
        m = m_new;
        __syncthreads(); // probs and rows are rewritten by the next chunk
    }
    float* o = out + ((size_t)tok * q_heads + h) * v_head_dim;
    for (int i = 0; i < DS_DIMS_PER_THREAD; ++i) {
        const unsigned int dim = tid + (unsigned int)i * DS_THREADS;
        if (dim < v_head_dim) {
            o[dim] = acc[i] * v_scale / l;
        }
    }
}
