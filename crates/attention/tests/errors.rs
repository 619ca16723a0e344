//! Bad input is a typed error, never a panic, and a refused attention call leaves the store
//! unchanged.

use attention::{
    AttentionError, AttentionParams, Backend, BatchMetadata, CpuBackend, CpuConfig, DeviceTensor,
    DoubleSparseConfig, RequestKv, RopeConfig, RopeScaling,
};
use kv_pool::{HostKvStore, KvBuffer, KvDtype, KvLayout, KvPoolError, KvShape, KvStore, Slot};

fn slots(ids: impl IntoIterator<Item = u32>) -> Vec<Slot> {
    ids.into_iter().map(Slot).collect()
}

#[test]
fn metadata_refuses_bad_requests() {
    let s = slots(4..10);
    let err = BatchMetadata::new(
        4,
        &[RequestKv {
            slots: &s,
            extend_len: 0,
        }],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        AttentionError::InvalidRequest { request: 0, .. }
    ));
    let err = BatchMetadata::new(
        4,
        &[
            RequestKv {
                slots: &s,
                extend_len: 1,
            },
            RequestKv {
                slots: &s,
                extend_len: 7,
            },
        ],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        AttentionError::InvalidRequest { request: 1, .. }
    ));
    // Offset rule: position 1 at slot 6 (6 mod 4 = 2).
    let bad = slots([4, 6, 7]);
    assert_eq!(
        BatchMetadata::new(
            4,
            &[RequestKv {
                slots: &bad,
                extend_len: 1
            }]
        ),
        Err(AttentionError::PageRule {
            request: 0,
            position: 1,
            slot: Slot(6),
            page_size: 4,
            reason: "slot mod P != position mod P",
        })
    );
    // Same offsets, different page within one page index.
    let bad = slots([4, 5, 10, 11]);
    assert_eq!(
        BatchMetadata::new(
            4,
            &[RequestKv {
                slots: &bad,
                extend_len: 2
            }]
        ),
        Err(AttentionError::PageRule {
            request: 0,
            position: 2,
            slot: Slot(10),
            page_size: 4,
            reason: "not in the page of the request's page index",
        })
    );
    assert!(matches!(
        BatchMetadata::new(0, &[]),
        Err(AttentionError::InvalidConfig {
            field: "page_size",
            ..
        })
    ));
    assert!(matches!(
        BatchMetadata::new_decode(
            4,
            &[RequestKv {
                slots: &s,
                extend_len: 2
            }]
        ),
        Err(AttentionError::InvalidRequest { request: 0, .. })
    ));
}

/// Every byte of the store (`kv_pool::testing::dump_store`).
fn dump(s: &dyn KvStore) -> Vec<u8> {
    kv_pool::testing::dump_store(s).unwrap()
}

#[test]
fn attention_refuses_bad_input_and_leaves_the_store_unchanged() {
    let b = CpuBackend::default();
    // MHA: 2 layers, 2 KV heads of 8, P = 4, 32 slots (rows 0..36).
    let layout = KvLayout::new(KvShape::mha(2, 8, 8, 2, KvDtype::F16).unwrap(), 4, 32).unwrap();
    let mut store = HostKvStore::new(layout).unwrap();
    let s = slots(4..7);
    let meta = BatchMetadata::new(
        4,
        &[RequestKv {
            slots: &s,
            extend_len: 2,
        }],
    )
    .unwrap();
    let plan = b.plan(&meta).unwrap();
    let t = |shape: &[usize]| b.upload(&vec![0.5; shape.iter().product()], shape).unwrap();
    let p = AttentionParams::dense(0.3);
    let before = dump(&store);
    let check = |res: Result<_, AttentionError>, want: AttentionError| {
        assert_eq!(res.unwrap_err(), want);
    };
    // q heads not a multiple of kv heads
    check(
        b.attention(
            0,
            &plan,
            &mut store,
            &t(&[2, 3, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &p,
        ),
        AttentionError::HeadsNotMultiple {
            q_heads: 3,
            kv_heads: 2,
        },
    );
    // mismatched token count
    check(
        b.attention(
            0,
            &plan,
            &mut store,
            &t(&[3, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &p,
        ),
        AttentionError::ShapeMismatch {
            what: "q",
            expected: vec![2, 4, 8],
            got: vec![3, 4, 8],
        },
    );
    check(
        b.attention(
            0,
            &plan,
            &mut store,
            &t(&[2, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 7]),
            &p,
        ),
        AttentionError::ShapeMismatch {
            what: "v",
            expected: vec![2, 2, 8],
            got: vec![2, 2, 7],
        },
    );
    // layer out of range
    check(
        b.attention(
            2,
            &plan,
            &mut store,
            &t(&[2, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &p,
        ),
        AttentionError::KvPool(KvPoolError::LayerOutOfRange {
            layer: 2,
            layers: 2,
        }),
    );
    // slots out of range for the store
    let far = slots(36..39);
    let far_meta = BatchMetadata::new(
        4,
        &[RequestKv {
            slots: &far,
            extend_len: 2,
        }],
    )
    .unwrap();
    let far_plan = b.plan(&far_meta).unwrap();
    check(
        b.attention(
            0,
            &far_plan,
            &mut store,
            &t(&[2, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &p,
        ),
        AttentionError::KvPool(KvPoolError::SlotOutOfRange {
            slot: Slot(38),
            first: 0,
            end: 36,
        }),
    );
    // page size mismatch
    let p1 = b
        .plan(
            &BatchMetadata::new(
                1,
                &[RequestKv {
                    slots: &s,
                    extend_len: 2,
                }],
            )
            .unwrap(),
        )
        .unwrap();
    check(
        b.attention(
            0,
            &p1,
            &mut store,
            &t(&[2, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &p,
        ),
        AttentionError::PageSizeMismatch { plan: 1, store: 4 },
    );
    // DoubleSparse parameters on an MHA store; MLA entry point on an MHA store
    let ds = AttentionParams {
        scale: 0.3,
        double_sparse: Some(DoubleSparseConfig {
            top_k: 4,
            channels: vec![0, 1],
        }),
    };
    assert!(matches!(
        b.attention(
            0,
            &plan,
            &mut store,
            &t(&[2, 4, 8]),
            &t(&[2, 2, 8]),
            &t(&[2, 2, 8]),
            &ds
        ),
        Err(AttentionError::Unsupported(_))
    ));
    assert!(matches!(
        b.attention_mla(0, &plan, &mut store, &t(&[2, 4, 8]), &t(&[2, 8]), &p),
        Err(AttentionError::Unsupported(_))
    ));
    assert!(dump(&store) == before, "a refused call changed the store");
    // The good call works.
    b.attention(
        0,
        &plan,
        &mut store,
        &t(&[2, 4, 8]),
        &t(&[2, 2, 8]),
        &t(&[2, 2, 8]),
        &p,
    )
    .unwrap();

    // MLA store: attention() is unsupported, bad latent shape is refused.
    let mla = KvLayout::new(KvShape::mla(8, 4, 1, KvDtype::Bf16).unwrap(), 4, 32).unwrap();
    let mut ms = HostKvStore::new(mla).unwrap();
    let before = dump(&ms);
    assert!(matches!(
        b.attention(
            0,
            &plan,
            &mut ms,
            &t(&[2, 4, 12]),
            &t(&[2, 1, 12]),
            &t(&[2, 1, 12]),
            &p
        ),
        Err(AttentionError::Unsupported(_))
    ));
    check(
        b.attention_mla(0, &plan, &mut ms, &t(&[2, 4, 12]), &t(&[2, 11]), &p),
        AttentionError::ShapeMismatch {
            what: "latent",
            expected: vec![2, 12],
            got: vec![2, 11],
        },
    );
    assert!(dump(&ms) == before);

    // DoubleSparse store: parameters required and checked.
    let dsl = KvLayout::new(
        KvShape::double_sparse(2, 8, 8, 2, 1, KvDtype::F32).unwrap(),
        4,
        32,
    )
    .unwrap();
    let mut dss = HostKvStore::new(dsl).unwrap();
    let before = dump(&dss);
    let (q, k, v) = (t(&[2, 4, 8]), t(&[2, 2, 8]), t(&[2, 2, 8]));
    assert!(matches!(
        b.attention(0, &plan, &mut dss, &q, &k, &v, &p),
        Err(AttentionError::InvalidConfig {
            field: "double_sparse",
            ..
        })
    ));
    let with = |top_k, channels: Vec<u32>| AttentionParams {
        scale: 0.3,
        double_sparse: Some(DoubleSparseConfig { top_k, channels }),
    };
    check(
        b.attention(0, &plan, &mut dss, &q, &k, &v, &with(4, vec![0, 1, 2])),
        AttentionError::LengthMismatch {
            what: "channels",
            expected: 4,
            got: 3,
        },
    );
    assert!(matches!(
        b.attention(0, &plan, &mut dss, &q, &k, &v, &with(4, vec![0, 1, 2, 8])),
        Err(AttentionError::InvalidConfig {
            field: "channels",
            ..
        })
    ));
    assert!(matches!(
        b.attention(0, &plan, &mut dss, &q, &k, &v, &with(0, vec![0, 1, 2, 3])),
        Err(AttentionError::InvalidConfig { field: "top_k", .. })
    ));
    assert!(dump(&dss) == before);
    b.attention(0, &plan, &mut dss, &q, &k, &v, &with(1, vec![0, 1, 2, 3]))
        .unwrap();
    let mut labels = vec![0.0; 3 * 4];
    dss.read_f32(0, KvBuffer::Label, &s, &mut labels).unwrap();
    assert_eq!(&labels[4..], &[0.5; 8], "labels written for the new tokens");
}

#[test]
fn dense_ops_refuse_bad_shapes() {
    let b = CpuBackend::default();
    let t = |shape: &[usize]| b.upload(&vec![0.5; shape.iter().product()], shape).unwrap();
    assert!(matches!(
        b.upload(&[1.0; 5], &[2, 3]),
        Err(AttentionError::LengthMismatch { .. })
    ));
    assert!(matches!(
        b.reshape(t(&[2, 3]), &[4, 2]),
        Err(AttentionError::ShapeMismatch { .. })
    ));
    assert_eq!(b.reshape(t(&[2, 3]), &[3, 2]).unwrap().data().len(), 6);
    assert!(matches!(
        b.matmul(&t(&[2, 3]), &t(&[4, 2])),
        Err(AttentionError::ShapeMismatch { what: "w", .. })
    ));
    assert!(matches!(
        b.matmul(&t(&[2, 3, 1]), &t(&[4, 3])),
        Err(AttentionError::ShapeMismatch { what: "x", .. })
    ));
    assert!(matches!(
        b.rms_norm(&t(&[2, 3]), &t(&[4]), 1e-6),
        Err(AttentionError::ShapeMismatch { what: "weight", .. })
    ));
    let cfg = RopeConfig::neox(8, 10000.0);
    let mut x = t(&[2, 1, 8]);
    assert!(matches!(
        b.rotary(&mut x, &[0], &cfg),
        Err(AttentionError::LengthMismatch {
            what: "positions",
            ..
        })
    ));
    assert!(matches!(
        b.rotary(&mut t(&[2, 1, 6]), &[0, 1], &cfg),
        Err(AttentionError::ShapeMismatch { what: "x", .. })
    ));
    for bad in [
        RopeConfig {
            rotary_dim: 7,
            ..cfg
        },
        RopeConfig {
            rotary_dim: 10,
            ..cfg
        },
        RopeConfig { theta: 0.5, ..cfg },
        RopeConfig {
            scaling: RopeScaling::Linear { factor: 0.0 },
            ..cfg
        },
        RopeConfig {
            scaling: RopeScaling::Yarn {
                factor: 40.0,
                original_max_position_embeddings: 4096.0,
                beta_fast: 0.0,
                beta_slow: 1.0,
            },
            ..cfg
        },
        RopeConfig {
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 4.0,
                high_freq_factor: 1.0,
                original_max_position_embeddings: 8192.0,
            },
            ..cfg
        },
    ] {
        assert!(matches!(
            b.rotary(&mut x, &[0, 1], &bad),
            Err(AttentionError::InvalidConfig { .. })
        ));
    }
    assert!(matches!(
        b.silu_mul(&t(&[2, 3])),
        Err(AttentionError::ShapeMismatch { .. })
    ));
    let mut a = t(&[2, 3]);
    assert!(matches!(
        b.add_assign(&mut a, &t(&[3, 2])),
        Err(AttentionError::ShapeMismatch { what: "y", .. })
    ));
    assert!(matches!(
        b.embedding(&t(&[4, 2]), &[1, 4]),
        Err(AttentionError::InvalidConfig { field: "ids", .. })
    ));
    assert!(matches!(
        CpuBackend::new(CpuConfig {
            threads: 0,
            deterministic: true
        }),
        Err(AttentionError::InvalidConfig {
            field: "threads",
            ..
        })
    ));
}

#[test]
fn concat_last_joins_rows_and_refuses_mismatched_leading_dims() {
    let b = CpuBackend::default();
    let a = b.upload(&[1.0, 2.0, 3.0, 4.0], &[2, 1, 2]).unwrap();
    let c = b
        .upload(&[5.0, 6.0, 7.0, 8.0, 9.0, 10.0], &[2, 1, 3])
        .unwrap();
    let ac = b.concat_last(&a, &c).unwrap();
    assert_eq!(ac.shape(), &[2, 1, 5]);
    assert_eq!(
        b.download(&ac).unwrap(),
        vec![1.0, 2.0, 5.0, 6.0, 7.0, 3.0, 4.0, 8.0, 9.0, 10.0]
    );
    let bad = b.upload(&[0.0; 6], &[3, 2]).unwrap();
    let e = b.concat_last(&a, &bad).unwrap_err();
    assert!(matches!(e, AttentionError::ShapeMismatch { .. }), "{e}");
}

#[test]
fn yarn_inv_freqs_blend_extrapolated_and_interpolated_dims() {
    // DeepSeek-V2's numbers on a 16-dim rotary: correction dims c(32) = 2.62 → low 2,
    // c(1) = 5.63 → high 6; dims below low keep θ^(-2i/d), dims from high on are divided by
    // the factor, and the ones between blend linearly.
    let cfg = RopeConfig {
        head_dim: 16,
        rotary_dim: 16,
        theta: 10_000.0,
        style: attention::RopeStyle::GptJ,
        scaling: RopeScaling::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        },
    };
    let inv = cfg.inv_freqs().unwrap();
    for (i, &got) in inv.iter().enumerate() {
        let f = 10_000f64.powf(-(2.0 * i as f64) / 16.0);
        let ramp = ((i as f64 - 2.0) / 4.0).clamp(0.0, 1.0);
        let want = f / 40.0 * ramp + f * (1.0 - ramp);
        assert!((got - want).abs() <= 1e-15 * f, "dim {i}: {got} vs {want}");
    }
    assert_eq!(inv[0], 1.0);
    assert!((inv[7] - 10_000f64.powf(-14.0 / 16.0) / 40.0).abs() < 1e-18);
}

#[test]
fn fused_moe_refuses_bad_shapes_and_routing() {
    use attention::moe::{MoeExperts, MoeRouting};
    let cpu = CpuBackend::default();
    let (n, d, e, i) = (2, 8, 4, 6);
    let t = |len: usize, shape: &[usize]| cpu.upload(&vec![0.5; len], shape).unwrap();
    let experts = |gu: &[usize], dn: &[usize]| MoeExperts {
        gate_up: t(gu.iter().product(), gu),
        down: t(dn.iter().product(), dn),
        intermediate: i,
    };
    let good = experts(&[e, 2 * i * d], &[e, d * i]);
    let routing = |top_k, scale| MoeRouting {
        top_k,
        renormalize: false,
        routed_scaling_factor: scale,
    };
    let (h, logits) = (t(n * d, &[n, d]), t(n * e, &[n, e]));
    assert!(cpu.fused_moe(&h, &logits, &good, &routing(2, 1.0)).is_ok());
    let refused = |h: &attention::CpuTensor, l, x: &MoeExperts<_>, r: MoeRouting| match cpu
        .fused_moe(h, l, x, &r)
        .unwrap_err()
    {
        AttentionError::ShapeMismatch { what, .. } => what.to_string(),
        AttentionError::InvalidConfig { field, .. } => field.to_string(),
        other => panic!("{other:?}"),
    };
    let wrong_rows = t((n + 1) * e, &[n + 1, e]);
    assert_eq!(
        refused(&h, &wrong_rows, &good, routing(2, 1.0)),
        "router_logits"
    );
    let wrong_gu = experts(&[e, 2 * i * d - 1], &[e, d * i]);
    assert_eq!(refused(&h, &logits, &wrong_gu, routing(2, 1.0)), "gate_up");
    let wrong_down = experts(&[e + 1, 2 * i * d], &[e, d * i]);
    assert_eq!(
        refused(&h, &logits, &wrong_down, routing(2, 1.0)),
        "gate_up"
    );
    let wrong_down = experts(&[e, 2 * i * d], &[e, d * i + 1]);
    assert_eq!(refused(&h, &logits, &wrong_down, routing(2, 1.0)), "down");
    assert_eq!(refused(&h, &logits, &good, routing(0, 1.0)), "top_k");
    assert_eq!(refused(&h, &logits, &good, routing(e + 1, 1.0)), "top_k");
    assert_eq!(
        refused(&h, &logits, &good, routing(2, f64::NAN)),
        "routed_scaling_factor"
    );
    let overflowing = MoeExperts {
        intermediate: usize::MAX / 2,
        ..experts(&[e, 2 * i * d], &[e, d * i])
    };
    assert_eq!(
        refused(&h, &logits, &overflowing, routing(2, 1.0)),
        "fused_moe"
    );
}
