//! Batch invariance of the CPU backend in deterministic mode: a request's attention output is
//! bitwise the same alone or batched, chunked or in one pass, with its prefix from the cache or
//! recomputed, on scattered paged slots or contiguous ones, with one thread or several.

use attention::conformance::{nonzero_vec, scattered_slots};
use attention::{
    AttentionParams, Backend, BatchMetadata, CpuBackend, CpuConfig, DoubleSparseConfig, RequestKv,
};
use kv_pool::rng::SplitMix64;
use kv_pool::{HostKvStore, KvDtype, KvLayout, KvShape, KvStore, Slot};

const LAYER: usize = 0;

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// GQA 8 query heads over 2 KV heads of 64.
    Gqa,
    /// MLA 4 heads, latent 32 + rope 16.
    Mla,
    /// DoubleSparse 8/2 x 64 with 8 label channels, top 16.
    Ds,
}

impl Kind {
    fn shape(self, dtype: KvDtype) -> KvShape {
        match self {
            Kind::Gqa => KvShape::mha(2, 64, 64, 1, dtype).unwrap(),
            Kind::Mla => KvShape::mla(32, 16, 1, dtype).unwrap(),
            Kind::Ds => KvShape::double_sparse(2, 64, 64, 8, 1, dtype).unwrap(),
        }
    }
    /// (q heads, q/k dim, elements per K row, elements per V row)
    fn dims(self) -> (usize, usize, usize, usize) {
        match self {
            Kind::Gqa | Kind::Ds => (8, 64, 128, 128),
            Kind::Mla => (4, 48, 48, 0),
        }
    }
    fn params(self) -> AttentionParams {
        let mut p = AttentionParams::dense(0.2);
        if let Kind::Ds = self {
            p.double_sparse = Some(DoubleSparseConfig {
                top_k: 16,
                channels: (0..16).map(|i| (i * 7 % 64) as u32).collect(),
            });
        }
        p
    }
}

/// One request's inputs for every position: q, k, v rows.
struct Req {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn request(kind: Kind, len: usize, seed: u64) -> Req {
    let (qh, d, kr, vr) = kind.dims();
    let mut rng = SplitMix64::new(seed);
    Req {
        q: nonzero_vec(&mut rng, len * qh * d),
        k: nonzero_vec(&mut rng, len * kr),
        v: nonzero_vec(&mut rng, len * vr),
    }
}

/// One request's part of a batch: its slots for positions `0..end`, new tokens `start..end`.
struct Part<'a> {
    req: &'a Req,
    slots: &'a [Slot],
    start: usize,
    end: usize,
}

/// Runs one batch and returns each part's output rows.
fn run(
    backend: &CpuBackend,
    kind: Kind,
    store: &mut HostKvStore,
    parts: &[Part<'_>],
) -> Vec<Vec<f32>> {
    run_mode(backend, kind, store, parts, false)
}

/// Runs one decode batch (every part one token).
fn run_decode(
    backend: &CpuBackend,
    kind: Kind,
    store: &mut HostKvStore,
    parts: &[Part<'_>],
) -> Vec<Vec<f32>> {
    run_mode(backend, kind, store, parts, true)
}

fn run_mode(
    backend: &CpuBackend,
    kind: Kind,
    store: &mut HostKvStore,
    parts: &[Part<'_>],
    decode: bool,
) -> Vec<Vec<f32>> {
    let (qh, d, kr, vr) = kind.dims();
    let reqs: Vec<RequestKv<'_>> = parts
        .iter()
        .map(|p| RequestKv {
            slots: &p.slots[..p.end],
            extend_len: p.end - p.start,
        })
        .collect();
    let page = store.layout().page_size;
    let meta = if decode {
        BatchMetadata::new_decode(page, &reqs).unwrap()
    } else {
        BatchMetadata::new(page, &reqs).unwrap()
    };
    let plan = backend.plan(&meta).unwrap();
    let n = meta.num_tokens();
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for p in parts {
        q.extend_from_slice(&p.req.q[p.start * qh * d..p.end * qh * d]);
        k.extend_from_slice(&p.req.k[p.start * kr..p.end * kr]);
        v.extend_from_slice(&p.req.v[p.start * vr..p.end * vr]);
    }
    let qt = backend.upload(&q, &[n, qh, d]).unwrap();
    let params = kind.params();
    let (out, dv) = match kind {
        Kind::Mla => {
            let lt = backend.upload(&k, &[n, kr]).unwrap();
            let out = backend
                .attention_mla(LAYER, &plan, store, &qt, &lt, &params)
                .unwrap();
            (out, 32)
        }
        Kind::Gqa | Kind::Ds => {
            let kt = backend.upload(&k, &[n, 2, 64]).unwrap();
            let vt = backend.upload(&v, &[n, 2, 64]).unwrap();
            let out = backend
                .attention(LAYER, &plan, store, &qt, &kt, &vt, &params)
                .unwrap();
            (out, 64)
        }
    };
    let out = backend.download(&out).unwrap();
    (0..parts.len())
        .map(|r| out[meta.qo_range(r).start * qh * dv..meta.qo_range(r).end * qh * dv].to_vec())
        .collect()
}

fn store(kind: Kind, dtype: KvDtype, page_size: u32) -> HostKvStore {
    let layout = KvLayout::new(kind.shape(dtype), page_size, 4096).unwrap();
    let mut s = HostKvStore::new(layout).unwrap();
    if dtype.is_fp8() {
        s.set_scales(LAYER, 0.5, 0.25).unwrap();
    }
    s
}

/// Slots for requests of `lens` on a shuffled pool of page size `p`.
fn slots(p: u32, lens: &[usize], seed: u64) -> Vec<Vec<Slot>> {
    let reqs: Vec<(usize, usize)> = lens.iter().map(|&l| (0, l)).collect();
    scattered_slots(p, 4096, &reqs, &mut SplitMix64::new(seed)).unwrap()
}

const LENS: [usize; 3] = [130, 37, 300];
const CASES: [(Kind, KvDtype, u32); 5] = [
    (Kind::Gqa, KvDtype::F16, 16),
    (Kind::Gqa, KvDtype::Fp8E4m3, 1),
    (Kind::Gqa, KvDtype::Bf16, 64),
    (Kind::Mla, KvDtype::F16, 16),
    (Kind::Ds, KvDtype::F32, 16),
];

#[test]
fn request_alone_equals_request_in_a_batch() {
    let backend = CpuBackend::default();
    for (kind, dtype, p) in CASES {
        let reqs: Vec<Req> = (0..3)
            .map(|i| request(kind, LENS[i] + 1, 10 + i as u64))
            .collect();
        let sl = slots(p, &LENS.map(|l| l + 1), 5);
        // Prefill alone, then decode alone.
        let mut alone = store(kind, dtype, p);
        let prefill = |s: &mut HostKvStore, which: &[usize]| {
            let parts: Vec<Part<'_>> = which
                .iter()
                .map(|&i| Part {
                    req: &reqs[i],
                    slots: &sl[i],
                    start: 0,
                    end: LENS[i],
                })
                .collect();
            run(&backend, kind, s, &parts)
        };
        let decode = |s: &mut HostKvStore, which: &[usize]| {
            let parts: Vec<Part<'_>> = which
                .iter()
                .map(|&i| Part {
                    req: &reqs[i],
                    slots: &sl[i],
                    start: LENS[i],
                    end: LENS[i] + 1,
                })
                .collect();
            run_decode(&backend, kind, s, &parts)
        };
        let a_pre = prefill(&mut alone, &[0]);
        let a_dec = decode(&mut alone, &[0]);
        let mut batched = store(kind, dtype, p);
        let b_pre = prefill(&mut batched, &[2, 0, 1]);
        let b_dec = decode(&mut batched, &[1, 2, 0]);
        assert!(
            a_pre[0] == b_pre[1],
            "{kind:?} {dtype} P={p}: prefill differs"
        );
        assert!(
            a_dec[0] == b_dec[2],
            "{kind:?} {dtype} P={p}: decode differs"
        );
        // The decode query at position L equals the same query in an extend over 0..=L
        // (except DoubleSparse, whose decode is sparse by design).
        if let Kind::Ds = kind {
            continue;
        }
        let mut one = store(kind, dtype, p);
        let whole = run(
            &backend,
            kind,
            &mut one,
            &[Part {
                req: &reqs[0],
                slots: &sl[0],
                start: 0,
                end: LENS[0] + 1,
            }],
        );
        let row = a_dec[0].len();
        assert!(
            whole[0][whole[0].len() - row..] == a_dec[0][..],
            "{kind:?} {dtype} P={p}: decode differs from the extend's last row"
        );
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let backend = CpuBackend::default();
    for (kind, dtype, p) in CASES {
        let len = 150;
        let req = request(kind, len, 99);
        let sl = slots(p, &[len], 6);
        let mut s = store(kind, dtype, p);
        let once = run(
            &backend,
            kind,
            &mut s,
            &[Part {
                req: &req,
                slots: &sl[0],
                start: 0,
                end: len,
            }],
        )
        .remove(0);
        for chunk in [1, 7, 64] {
            let mut s = store(kind, dtype, p);
            let mut got = Vec::new();
            for start in (0..len).step_by(chunk) {
                let end = (start + chunk).min(len);
                got.extend(
                    run(
                        &backend,
                        kind,
                        &mut s,
                        &[Part {
                            req: &req,
                            slots: &sl[0],
                            start,
                            end,
                        }],
                    )
                    .remove(0),
                );
            }
            assert!(got == once, "{kind:?} {dtype} P={p}: chunk {chunk} differs");
        }
    }
}

#[test]
fn cached_prefix_equals_full_prefill() {
    let backend = CpuBackend::default();
    for (kind, dtype, p) in CASES {
        let (_, _, kr, vr) = kind.dims();
        let len = 200;
        let req = request(kind, len, 7);
        let sl = slots(p, &[len], 8);
        let mut s = store(kind, dtype, p);
        let full = run(
            &backend,
            kind,
            &mut s,
            &[Part {
                req: &req,
                slots: &sl[0],
                start: 0,
                end: len,
            }],
        )
        .remove(0);
        let row = full.len() / len;
        for prefix in [16, 64, 77] {
            // The prefix's KV is already in the store (another request wrote it); only the
            // suffix is extended.
            let mut s = store(kind, dtype, p);
            let k = &req.k[..prefix * kr];
            let v = &req.v[..prefix * vr];
            s.write_kv(LAYER, &sl[0][..prefix], k, v).unwrap();
            if let Kind::Ds = kind {
                let ch = kind.params().double_sparse.unwrap().channels;
                let labels: Vec<f32> = k
                    .chunks_exact(kr)
                    .flat_map(|row| {
                        ch.iter()
                            .enumerate()
                            .map(move |(i, &c)| row[(i / 8) * 64 + c as usize])
                    })
                    .collect();
                s.write_labels(LAYER, &sl[0][..prefix], &labels).unwrap();
            }
            let got = run(
                &backend,
                kind,
                &mut s,
                &[Part {
                    req: &req,
                    slots: &sl[0],
                    start: prefix,
                    end: len,
                }],
            )
            .remove(0);
            assert!(
                got[..] == full[prefix * row..],
                "{kind:?} {dtype} P={p}: prefix {prefix} differs"
            );
        }
    }
}

#[test]
fn scattered_paged_slots_equal_contiguous_slots() {
    let backend = CpuBackend::default();
    for (kind, dtype, p) in CASES {
        let lens = [90, 33];
        let reqs: Vec<Req> = (0..2)
            .map(|i| request(kind, lens[i], 40 + i as u64))
            .collect();
        let run_on = |page: u32, sl: &[Vec<Slot>]| {
            let mut s = store(kind, dtype, page);
            let parts: Vec<Part<'_>> = (0..2)
                .map(|i| Part {
                    req: &reqs[i],
                    slots: &sl[i],
                    start: 0,
                    end: lens[i],
                })
                .collect();
            let mut out = run(&backend, kind, &mut s, &parts);
            // and one decode step each
            let parts: Vec<Part<'_>> = (0..2)
                .map(|i| Part {
                    req: &reqs[i],
                    slots: &sl[i],
                    start: lens[i] - 1,
                    end: lens[i],
                })
                .collect();
            let mut s2 = s.clone();
            // re-run the last position as a decode over the stored KV
            out.extend(run_decode(&backend, kind, &mut s2, &parts));
            out
        };
        let contiguous: Vec<Vec<Slot>> =
            vec![(1..=90).map(Slot).collect(), (100..133).map(Slot).collect()];
        let scattered = slots(p, &lens, 77);
        assert!(
            run_on(1, &contiguous) == run_on(p, &scattered),
            "{kind:?} {dtype} P={p}: placement changed the result"
        );
    }
}

#[test]
fn threads_do_not_change_results() {
    let one = CpuBackend::default();
    let three = CpuBackend::new(CpuConfig {
        threads: 3,
        ..CpuConfig::default()
    })
    .unwrap();
    for (kind, dtype, p) in CASES {
        let reqs: Vec<Req> = (0..3)
            .map(|i| request(kind, LENS[i], 60 + i as u64))
            .collect();
        let sl = slots(p, &LENS, 9);
        let parts: Vec<Part<'_>> = (0..3)
            .map(|i| Part {
                req: &reqs[i],
                slots: &sl[i],
                start: 0,
                end: LENS[i],
            })
            .collect();
        let a = run(&one, kind, &mut store(kind, dtype, p), &parts);
        let b = run(&three, kind, &mut store(kind, dtype, p), &parts);
        assert!(a == b, "{kind:?} {dtype} P={p}");
    }
}

/// A decode batch of fewer requests than threads is cut by KV head over the pool: its output is
/// bitwise the one-thread output (where nothing is cut), for one request on 2 and 3 threads and
/// two requests on 3, over every KV dtype path (in place: f32, f16, bf16; decoded to scratch:
/// fp8), MLA (one KV head: not cut) and DoubleSparse (sparse decode: not cut).
#[test]
fn decode_cut_by_kv_head_equals_one_thread() {
    let backends: Vec<CpuBackend> = (1..=3)
        .map(|threads| {
            CpuBackend::new(CpuConfig {
                threads,
                ..CpuConfig::default()
            })
            .unwrap()
        })
        .collect();
    let cases = CASES.iter().copied().chain([(Kind::Gqa, KvDtype::F32, 16)]);
    for (kind, dtype, p) in cases {
        let reqs: Vec<Req> = (0..2)
            .map(|i| request(kind, LENS[i], 80 + i as u64))
            .collect();
        let sl = slots(p, &LENS[..2], 5);
        for batch in [1, 2] {
            // Each backend prefills all but the last token, then decodes the last one.
            let decode = |b: &CpuBackend| {
                let mut s = store(kind, dtype, p);
                let part = |i: usize, start: usize, end: usize| Part {
                    req: &reqs[i],
                    slots: &sl[i],
                    start,
                    end,
                };
                let pre: Vec<Part<'_>> = (0..batch).map(|i| part(i, 0, LENS[i] - 1)).collect();
                run(b, kind, &mut s, &pre);
                let dec: Vec<Part<'_>> =
                    (0..batch).map(|i| part(i, LENS[i] - 1, LENS[i])).collect();
                run_decode(b, kind, &mut s, &dec)
            };
            let want = decode(&backends[0]);
            for b in &backends[1..] {
                assert!(
                    decode(b) == want,
                    "{kind:?} {dtype} P={p}, {batch} requests: {} threads differ from 1",
                    b.config().threads
                );
            }
        }
    }
}

/// Mixture of experts on the CPU: a token's `fused_moe` row is bitwise the same alone or in
/// a batch (each expert's MLP runs over its rows, a token's experts added in rank order), for
/// f32 and bf16 expert weights, with one thread or several; and the CPU's in-place expert
/// matrices give bitwise what the default path (`fused_moe_by_embedding`, a copy per expert)
/// gives for f32 weights.
#[test]
fn fused_moe_rows_do_not_depend_on_the_batch() {
    use attention::moe::{fused_moe_by_embedding, MoeExperts, MoeRouting};
    use attention::TensorDtype;
    let (n, d, e, i) = (7, 48, 8, 24);
    let mut rng = SplitMix64::new(0x0E);
    let h = nonzero_vec(&mut rng, n * d);
    let logits = nonzero_vec(&mut rng, n * e);
    let (gate_up, down) = (
        nonzero_vec(&mut rng, e * 2 * i * d),
        nonzero_vec(&mut rng, e * d * i),
    );
    let routing = MoeRouting {
        top_k: 3,
        renormalize: true,
        routed_scaling_factor: 1.0,
    };
    for dtype in [TensorDtype::F32, TensorDtype::Bf16] {
        for threads in [1, 3] {
            let cpu = CpuBackend::new(CpuConfig {
                threads,
                ..CpuConfig::default()
            })
            .unwrap();
            let experts = MoeExperts {
                gate_up: cpu.upload_weight(&gate_up, &[e, 2 * i * d], dtype).unwrap(),
                down: cpu.upload_weight(&down, &[e, d * i], dtype).unwrap(),
                intermediate: i,
            };
            let moe = |rows: std::ops::Range<usize>| {
                let m = rows.len();
                let h = cpu
                    .upload(&h[rows.start * d..rows.end * d], &[m, d])
                    .unwrap();
                let l = cpu
                    .upload(&logits[rows.start * e..rows.end * e], &[m, e])
                    .unwrap();
                let got = cpu.fused_moe(&h, &l, &experts, &routing).unwrap();
                if dtype == TensorDtype::F32 {
                    let by_copy = fused_moe_by_embedding(&cpu, &h, &l, &experts, &routing).unwrap();
                    assert_eq!(got.data(), by_copy.data(), "in place vs copied experts");
                }
                cpu.download(&got).unwrap()
            };
            let batch = moe(0..n);
            for t in 0..n {
                let alone = moe(t..t + 1);
                assert_eq!(
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    batch[t * d..(t + 1) * d]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    "token {t}, {dtype:?}, {threads} threads"
                );
            }
        }
    }
}
