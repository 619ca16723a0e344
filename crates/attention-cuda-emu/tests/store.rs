//! The device KV store (`CudaKvStore` over the emulated device) against kv-pool's host store:
//! the same operations leave the same bytes (raw rows and the canonical packed pages), bad
//! input gets the same typed errors, the rows handle a HiCache controller copies through moves
//! the same bytes from other threads, and the `store_kv` kernel that attention writes new
//! tokens with rounds to f16 / bf16 / fp8 (with the layer's scales) exactly as kv-pool's
//! encoder does.

use attention::{AttentionParams, Backend, BatchMetadata, RequestKv};
use attention_cuda::{CudaBackend, CudaConfig, CudaKvStore};
use attention_cuda_emu::{emu_or_skip, EmuDevice};
use kv_pool::rng::SplitMix64;
use kv_pool::{
    HostKvStore, KvBuffer, KvDtype, KvLayout, KvPoolError, KvShape, KvStore, Page, Slot,
};

type Store = CudaKvStore<EmuDevice>;

fn backend(test: &str) -> Option<CudaBackend<EmuDevice>> {
    emu_or_skip(test).map(|d| CudaBackend::new(d, CudaConfig::default()))
}

fn values(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() * 16.0 - 8.0) as f32)
        .collect()
}

fn bytes(n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn slots(ids: &[u32]) -> Vec<Slot> {
    ids.iter().map(|&s| Slot(s)).collect()
}

/// Every byte of the store (`kv_pool::testing::dump_store`).
fn dump(s: &dyn KvStore) -> Vec<u8> {
    kv_pool::testing::dump_store(s).unwrap()
}

fn same_ops(backend: &CudaBackend<EmuDevice>, layout: KvLayout, rng: &mut SplitMix64) {
    let mut host = HostKvStore::new(layout).unwrap();
    let mut dev: Store = backend.new_kv_store(layout).unwrap();
    host.set_scales(1, 0.5, 3.0).unwrap();
    dev.set_scales(1, 0.5, 3.0).unwrap();
    assert_eq!(dev.scales(1), Ok((0.5, 3.0)));
    let shape = layout.shape;
    let rows = layout.rows() as u32;
    let check = |host: &HostKvStore, dev: &Store, what: &str| {
        assert!(dump(host) == dump(dev), "{shape}: {what}");
    };
    for layer in 0..shape.layers as usize {
        // A repeated slot: the last occurrence wins.
        let s = slots(&[3, rows - 1, 7, 0, 3, 12]);
        let k = values(s.len() * shape.row_elems(KvBuffer::Key), rng);
        let v = values(s.len() * shape.row_elems(KvBuffer::Value), rng);
        host.write_kv(layer, &s, &k, &v).unwrap();
        dev.write_kv(layer, &s, &k, &v).unwrap();
        check(&host, &dev, "write_kv");
        if shape.has_buffer(KvBuffer::Label) {
            let l = values(s.len() * shape.row_elems(KvBuffer::Label), rng);
            host.write_labels(layer, &s, &l).unwrap();
            dev.write_labels(layer, &s, &l).unwrap();
            check(&host, &dev, "write_labels");
        }
        for &b in shape.buffers() {
            let s = slots(&[5, 6, 9, 5, rows - 2]);
            let raw = bytes(s.len() * shape.row_bytes(b), rng);
            host.write_raw(layer, b, &s, &raw).unwrap();
            dev.write_raw(layer, b, &s, &raw).unwrap();
            check(&host, &dev, "write_raw");
            let mut got = vec![0.0f32; s.len() * shape.row_elems(b)];
            let mut want = got.clone();
            host.read_f32(layer, b, &s, &mut want).unwrap();
            dev.read_f32(layer, b, &s, &mut got).unwrap();
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{shape}: read_f32");
        }
    }
    // Overlapping copies (a shift by one) read every source before writing.
    let (src, dst) = (slots(&[3, 4, 5, 6, 7]), slots(&[4, 5, 6, 7, 8]));
    host.copy_slots(&src, &dst).unwrap();
    dev.copy_slots(&src, &dst).unwrap();
    check(&host, &dev, "copy_slots");
    let pages = [Page(2), Page(1), Page(layout.pages() as u32), Page(2)];
    let data = bytes(pages.len() * layout.page_bytes(), rng);
    host.write_pages(&pages, &data).unwrap();
    dev.write_pages(&pages, &data).unwrap();
    check(&host, &dev, "write_pages");
    let regions = dev.memory_regions();
    assert_eq!(regions.len(), host.memory_regions().len());
    assert!(regions.iter().all(|r| r.addr != 0));
}

#[test]
fn device_store_matches_host_store() {
    let Some(backend) = backend("device_store_matches_host_store") else {
        return;
    };
    let mut rng = SplitMix64::new(11);
    for dtype in KvDtype::ALL {
        for shape in [
            KvShape::mha(1, 3, 3, 2, dtype).unwrap(),
            KvShape::mha(2, 8, 4, 2, dtype).unwrap(),
            KvShape::mla(12, 4, 2, dtype).unwrap(),
            KvShape::double_sparse(2, 8, 4, 3, 2, dtype).unwrap(),
        ] {
            same_ops(&backend, KvLayout::new(shape, 4, 64).unwrap(), &mut rng);
        }
    }
}

/// `CudaKvRows` (what a HiCache controller's IO thread copies through) passes kv-pool's
/// `check_device_rows` (the same bytes as the host store from other threads, the host store's
/// errors, nothing written on bad input, the buffers kept after the store is gone).
#[test]
fn device_rows_move_the_same_bytes_as_the_host_store_from_another_thread() {
    let Some(backend) = backend("device_rows_from_another_thread") else {
        return;
    };
    for (i, shape) in [
        KvShape::mha(2, 8, 4, 2, KvDtype::Bf16).unwrap(),
        KvShape::mla(12, 4, 2, KvDtype::Fp8E4m3).unwrap(),
        KvShape::double_sparse(2, 8, 4, 3, 2, KvDtype::F32).unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let dev: Store = backend
            .new_kv_store(KvLayout::new(shape, 4, 64).unwrap())
            .unwrap();
        let rows = dev.device_rows();
        kv_pool::testing::check_device_rows(dev, rows, 17 + i as u64);
    }
}

/// Each bad call fails on the device store exactly as on the host store and changes nothing.
#[test]
fn bad_inputs_get_the_host_stores_errors() {
    let Some(backend) = backend("bad_inputs_get_the_host_stores_errors") else {
        return;
    };
    let layout = KvLayout::new(KvShape::mha(2, 8, 4, 2, KvDtype::F16).unwrap(), 4, 64).unwrap();
    let mut host = HostKvStore::new(layout).unwrap();
    let mut dev: Store = backend.new_kv_store(layout).unwrap();
    let before = dump(&dev);
    let k = vec![0.5f32; 16];
    let v = vec![0.5f32; 8];
    type Op = Box<dyn Fn(&mut dyn KvStore) -> Result<(), KvPoolError>>;
    let ops: Vec<(&str, Op)> = vec![
        (
            "layer",
            Box::new(move |s| s.write_kv(2, &[Slot(1)], &[0.0; 16], &[0.0; 8])),
        ),
        (
            "slot",
            Box::new(move |s| s.write_kv(0, &[Slot(68)], &[0.0; 16], &[0.0; 8])),
        ),
        (
            "k len",
            Box::new(move |s| s.write_kv(0, &[Slot(1)], &[0.0; 15], &[0.0; 8])),
        ),
        (
            "labels",
            Box::new(move |s| s.write_labels(0, &[Slot(1)], &[0.0; 4])),
        ),
        (
            "raw",
            Box::new(|s| s.write_raw(0, KvBuffer::Key, &[Slot(1)], &[0; 3])),
        ),
        (
            "page",
            Box::new(|s| s.write_pages(&[Page(0)], &vec![0; 4 * 2 * 2 * 24])),
        ),
        ("copy", Box::new(|s| s.copy_slots(&[Slot(1)], &[]))),
        ("scales", Box::new(|s| s.set_scales(0, 0.0, 1.0))),
    ];
    for (what, op) in &ops {
        let (h, d) = (op(&mut host), op(&mut dev));
        assert!(h.is_err(), "{what}");
        assert_eq!(h, d, "{what}");
    }
    let mut out = vec![0f32; 15];
    assert_eq!(
        host.read_f32(0, KvBuffer::Value, &[Slot(1)], &mut out),
        dev.read_f32(0, KvBuffer::Value, &[Slot(1)], &mut out)
    );
    assert!(dump(&dev) == before, "a refused call changed the store");
    drop((k, v));
}

/// Values whose f16 / bf16 rounding is delicate: ties, subnormals, overflow to infinity,
/// signed zeros and NaN, plus random bit patterns of every exponent.
fn rounding_values(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
    let special = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.99,
        65520.0,
        -70000.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        5.960_464_5e-8,
        2.980_232_2e-8,
        8.940_697e-8,
        6.097_555e-5,
        1.000_488_3,
        1.001_464_8,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::MIN_POSITIVE,
        1e-40,
        f32::MAX,
        448.0,
        464.0,
        -500.0,
        57344.0,
        61440.0,
        0.001_953_125,
        0.000_976_562_5,
        0.002_929_687_5,
        1.0625,
        1.1875,
        1.125,
        1.375,
    ];
    let mut out: Vec<f32> = special.iter().copied().cycle().take(n.min(64)).collect();
    while out.len() < n {
        out.push(f32::from_bits(rng.next_u64() as u32));
    }
    out
}

/// Attention writes the batch's new K/V with the `store_kv` kernel, converting on the device;
/// the bytes it leaves must equal kv-pool's host encoder's for the same values.
#[test]
fn store_kv_kernel_rounds_like_the_host_encoder() {
    let Some(backend) = backend("store_kv_kernel_rounds_like_the_host_encoder") else {
        return;
    };
    let mut rng = SplitMix64::new(23);
    for dtype in KvDtype::ALL {
        let (heads, d) = (2usize, 64usize);
        let shape = KvShape::mha(heads as u32, d as u32, d as u32, 1, dtype).unwrap();
        let layout = KvLayout::new(shape, 1, 64).unwrap();
        let mut host = HostKvStore::new(layout).unwrap();
        let mut dev: Store = backend.new_kv_store(layout).unwrap();
        // fp8 divides by the scales before rounding (other dtypes ignore them).
        host.set_scales(0, 0.75, 1.0 / 3.0).unwrap();
        dev.set_scales(0, 0.75, 1.0 / 3.0).unwrap();
        let s = slots(&[9, 4, 30, 31, 2, 17, 5, 60]);
        let n = s.len();
        let k = rounding_values(n * heads * d, &mut rng);
        let v = rounding_values(n * heads * d, &mut rng);
        host.write_kv(0, &s, &k, &v).unwrap();
        let meta = BatchMetadata::new(
            1,
            &[RequestKv {
                slots: &s,
                extend_len: n,
            }],
        )
        .unwrap();
        let plan = backend.plan(&meta).unwrap();
        let q = backend
            .upload(&vec![0.25; n * heads * d], &[n, heads, d])
            .unwrap();
        let kt = backend.upload(&k, &[n, heads, d]).unwrap();
        let vt = backend.upload(&v, &[n, heads, d]).unwrap();
        // NaN and infinite keys make the scores meaningless; only the stored bytes matter.
        backend
            .attention(
                0,
                &plan,
                &mut dev,
                &q,
                &kt,
                &vt,
                &AttentionParams::dense(0.125),
            )
            .unwrap();
        assert!(dump(&host) == dump(&dev), "{dtype}: store_kv bytes differ");
    }
}
