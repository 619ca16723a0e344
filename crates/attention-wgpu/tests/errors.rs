//! Typed errors: no adapter, bad configuration, unsupported dtypes and kinds, and bad op
//! input, which must be refused exactly as the CPU backend refuses it.

use attention::{
    AttentionError, AttentionParams, Backend, BatchMetadata, CpuBackend, DoubleSparseConfig,
    RequestKv,
};
use attention_wgpu::test_support::backend_or_skip;
use attention_wgpu::{WgpuBackend, WgpuConfig, WgpuError};
use kv_pool::{KvDtype, KvLayout, KvPoolError, KvShape, Slot};

/// No backend at all, and on Linux only Metal and DX12 (which do not exist there): a typed
/// error naming the backends, not a panic.
#[test]
fn no_adapter_is_a_clear_error() {
    let mut sets = vec![wgpu::Backends::empty()];
    if cfg!(target_os = "linux") {
        sets.push(wgpu::Backends::METAL | wgpu::Backends::DX12);
    }
    for backends in sets {
        let err = WgpuBackend::new(WgpuConfig {
            backends,
            ..WgpuConfig::default()
        })
        .unwrap_err();
        assert!(matches!(err, WgpuError::NoAdapter { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("no wgpu adapter"), "{msg}");
        println!("{msg}");
        let as_attention: AttentionError = err.into();
        assert!(matches!(as_attention, AttentionError::Device(_)));
    }
}

#[test]
fn bad_config_is_refused() {
    let err = WgpuBackend::new(WgpuConfig {
        split_kv_target_workgroups: 0,
        ..WgpuConfig::default()
    })
    .unwrap_err();
    assert!(matches!(
        err,
        WgpuError::InvalidConfig {
            field: "split_kv_target_workgroups",
            ..
        }
    ));
    let err = WgpuBackend::new(WgpuConfig {
        max_binding_bytes: Some(100),
        ..WgpuConfig::default()
    })
    .unwrap_err();
    assert!(matches!(
        err,
        WgpuError::InvalidConfig {
            field: "max_binding_bytes",
            ..
        }
    ));
}

#[test]
fn unsupported_dtypes_and_kinds_are_typed() {
    let Some(b) = backend_or_skip("unsupported_dtypes_and_kinds_are_typed") else {
        return;
    };
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3, KvDtype::Fp8E5m2] {
        let shape = KvShape::mha(2, 8, 8, 1, dtype).unwrap();
        assert!(b.kv_support(&shape).is_err());
        let err = b
            .new_kv_store(KvLayout::new(shape, 1, 8).unwrap())
            .unwrap_err();
        assert!(matches!(err, AttentionError::Unsupported(_)), "{err}");
    }
    let f16 = KvShape::mha(2, 8, 8, 1, KvDtype::F16).unwrap();
    assert_eq!(b.kv_support(&f16).is_ok(), b.report().f16);
    // DoubleSparse stores hold their buffers, but attention over them is refused.
    let ds = KvShape::double_sparse(1, 8, 8, 2, 1, KvDtype::F32).unwrap();
    assert!(b.kv_support(&ds).is_err());
    let mut store = b.new_kv_store(KvLayout::new(ds, 1, 8).unwrap()).unwrap();
    let slots = [Slot(1)];
    let meta = BatchMetadata::new(
        1,
        &[RequestKv {
            slots: &slots,
            extend_len: 1,
        }],
    )
    .unwrap();
    let plan = b.plan(&meta).unwrap();
    let t = b.upload(&[0.5; 8], &[1, 1, 8]).unwrap();
    let params = AttentionParams {
        scale: 1.0,
        double_sparse: Some(DoubleSparseConfig {
            top_k: 1,
            channels: vec![0, 5],
        }),
    };
    let err = b
        .attention(0, &plan, &mut store, &t, &t, &t, &params)
        .unwrap_err();
    assert!(matches!(err, AttentionError::Unsupported(_)), "{err}");
}

/// Runs `f` on both backends and requires the same error.
fn same_error<F, G>(what: &str, cpu: F, gpu: G)
where
    F: FnOnce() -> Result<(), AttentionError>,
    G: FnOnce() -> Result<(), AttentionError>,
{
    let want = cpu().expect_err(what);
    let got = gpu().expect_err(what);
    assert_eq!(got, want, "{what}");
}

#[test]
fn bad_op_input_gets_the_cpu_backends_errors() {
    let Some(g) = backend_or_skip("bad_op_input_gets_the_cpu_backends_errors") else {
        return;
    };
    let c = CpuBackend::default();
    macro_rules! both {
        ($what:expr, |$b:ident| $body:expr) => {
            same_error(
                $what,
                || {
                    let $b = &c;
                    $body
                },
                || {
                    let $b = &g;
                    $body
                },
            )
        };
    }
    both!("upload length", |b| b.upload(&[1.0; 5], &[2, 3]).map(drop));
    both!("matmul k", |b| {
        let x = b.upload(&[1.0; 6], &[2, 3])?;
        let w = b.upload(&[1.0; 8], &[2, 4])?;
        b.matmul(&x, &w).map(drop)
    });
    both!("matmul rank", |b| {
        let x = b.upload(&[1.0; 6], &[6])?;
        b.matmul(&x, &x).map(drop)
    });
    both!("rms_norm weight", |b| {
        let x = b.upload(&[1.0; 6], &[2, 3])?;
        let w = b.upload(&[1.0; 2], &[2])?;
        b.rms_norm(&x, &w, 1e-6).map(drop)
    });
    both!("rotary positions", |b| {
        let mut x = b.upload(&[1.0; 16], &[2, 1, 8])?;
        b.rotary(&mut x, &[1], &attention::RopeConfig::neox(8, 10_000.0))
    });
    both!("rotary config", |b| {
        let mut x = b.upload(&[1.0; 16], &[2, 1, 8])?;
        b.rotary(&mut x, &[1, 2], &attention::RopeConfig::neox(8, 0.5))
    });
    both!("silu_mul odd", |b| {
        let x = b.upload(&[1.0; 6], &[2, 3])?;
        b.silu_mul(&x).map(drop)
    });
    both!("add shapes", |b| {
        let mut x = b.upload(&[1.0; 6], &[2, 3])?;
        let y = b.upload(&[1.0; 6], &[3, 2])?;
        b.add_assign(&mut x, &y)
    });
    both!("embedding id", |b| {
        let t = b.upload(&[1.0; 6], &[3, 2])?;
        b.embedding(&t, &[0, 3]).map(drop)
    });
    both!("concat leading dims", |b| {
        let x = b.upload(&[1.0; 6], &[2, 3])?;
        let y = b.upload(&[1.0; 6], &[3, 2])?;
        b.concat_last(&x, &y).map(drop)
    });
    both!("reshape", |b| {
        let x = b.upload(&[1.0; 6], &[2, 3])?;
        b.reshape(x, &[4, 2]).map(drop)
    });
    let shape = KvShape::mha(2, 8, 8, 2, KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, 4, 16).unwrap();
    let slots: Vec<Slot> = (4..9).map(Slot).collect();
    let req = [RequestKv {
        slots: &slots,
        extend_len: 2,
    }];
    let meta = BatchMetadata::new(4, &req).unwrap();
    let p1 = BatchMetadata::new(1, &req).unwrap();
    both!("attention heads not multiple", |b| {
        let mut s = b.new_kv_store(layout)?;
        let plan = b.plan(&meta)?;
        let q = b.upload(&[0.1; 48], &[2, 3, 8])?;
        let kv = b.upload(&[0.1; 32], &[2, 2, 8])?;
        b.attention(0, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
            .map(drop)
    });
    both!("attention k shape", |b| {
        let mut s = b.new_kv_store(layout)?;
        let plan = b.plan(&meta)?;
        let q = b.upload(&[0.1; 64], &[2, 4, 8])?;
        let kv = b.upload(&[0.1; 16], &[1, 2, 8])?;
        b.attention(0, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
            .map(drop)
    });
    both!("attention layer", |b| {
        let mut s = b.new_kv_store(layout)?;
        let plan = b.plan(&meta)?;
        let q = b.upload(&[0.1; 64], &[2, 4, 8])?;
        let kv = b.upload(&[0.1; 32], &[2, 2, 8])?;
        b.attention(2, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
            .map(drop)
    });
    both!("attention page size", |b| {
        let mut s = b.new_kv_store(layout)?;
        let plan = b.plan(&p1)?;
        let q = b.upload(&[0.1; 64], &[2, 4, 8])?;
        let kv = b.upload(&[0.1; 32], &[2, 2, 8])?;
        b.attention(0, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
            .map(drop)
    });
    both!("attention slot out of range", |b| {
        let small = KvLayout::new(shape, 4, 4)?;
        let mut s = b.new_kv_store(small)?;
        let plan = b.plan(&meta)?;
        let q = b.upload(&[0.1; 64], &[2, 4, 8])?;
        let kv = b.upload(&[0.1; 32], &[2, 2, 8])?;
        b.attention(0, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
            .map(drop)
    });
    both!("mla on an mha store", |b| {
        let mut s = b.new_kv_store(layout)?;
        let plan = b.plan(&meta)?;
        let q = b.upload(&[0.1; 64], &[2, 4, 8])?;
        let l = b.upload(&[0.1; 16], &[2, 8])?;
        b.attention_mla(0, &plan, &mut s, &q, &l, &AttentionParams::dense(0.3))
            .map(drop)
    });
    // A store made by another wgpu backend (device) is refused.
    let Some(other) = backend_or_skip("other device") else {
        return;
    };
    let mut s = other.new_kv_store(layout).unwrap();
    let plan = g.plan(&meta).unwrap();
    let q = g.upload(&[0.1; 64], &[2, 4, 8]).unwrap();
    let kv = g.upload(&[0.1; 32], &[2, 2, 8]).unwrap();
    let err = g
        .attention(0, &plan, &mut s, &q, &kv, &kv, &AttentionParams::dense(0.3))
        .unwrap_err();
    assert!(
        matches!(err, AttentionError::InvalidConfig { field: "store", .. }),
        "{err}"
    );
    let _ = KvPoolError::Device(String::new());
}
