//! The device KV store against kv-pool's host store: the same operations leave the same bytes
//! (raw rows and the canonical packed pages), bad input gets the same typed errors and changes
//! nothing, and layers split across several buffers behave like whole ones.

use attention::Backend;
use attention_wgpu::test_support::backend_or_skip_with;
use attention_wgpu::{WgpuBackend, WgpuConfig, WgpuKvStore};
use kv_pool::rng::SplitMix64;
use kv_pool::{
    HostKvStore, KvBuffer, KvDtype, KvLayout, KvPoolError, KvShape, KvStore, Page, Slot,
};

/// Values exactly representable in f16 (multiples of 1/64 in ±8), so both stores hold the
/// same bits whatever rounding the device uses.
fn values(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..n)
        .map(|_| ((rng.next_u64() % 1025) as f32 - 512.0) / 64.0)
        .collect()
}

fn bytes(n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn slots(ids: &[u32]) -> Vec<Slot> {
    ids.iter().map(|&s| Slot(s)).collect()
}

fn shapes(dtype: KvDtype) -> Vec<KvShape> {
    vec![
        // Rows of 3 elements: f16 rows straddle 4-byte words.
        KvShape::mha(1, 3, 3, 2, dtype).unwrap(),
        KvShape::mha(2, 8, 4, 2, dtype).unwrap(),
        KvShape::mla(12, 4, 2, dtype).unwrap(),
        KvShape::double_sparse(2, 8, 4, 3, 2, dtype).unwrap(),
    ]
}

/// Every byte of the store (`kv_pool::testing::dump_store`).
fn dump(s: &dyn KvStore) -> Vec<u8> {
    kv_pool::testing::dump_store(s).unwrap()
}

fn same_ops(backend: &WgpuBackend, layout: KvLayout, rng: &mut SplitMix64) {
    let mut host = HostKvStore::new(layout).unwrap();
    let mut dev: WgpuKvStore = backend.new_kv_store(layout).unwrap();
    let shape = layout.shape;
    let rows = layout.rows() as u32;
    let both = |host: &mut HostKvStore, dev: &mut WgpuKvStore, what: &str| {
        assert!(
            dump(host) == dump(dev),
            "{shape} P={}: {what}",
            layout.page_size
        );
    };
    for layer in 0..shape.layers as usize {
        // A repeated slot: the last occurrence wins.
        let s = slots(&[3, rows - 1, 7, 0, 3, 12]);
        let k = values(s.len() * shape.row_elems(KvBuffer::Key), rng);
        let v = values(s.len() * shape.row_elems(KvBuffer::Value), rng);
        host.write_kv(layer, &s, &k, &v).unwrap();
        dev.write_kv(layer, &s, &k, &v).unwrap();
        both(&mut host, &mut dev, "write_kv");
        if shape.has_buffer(KvBuffer::Label) {
            let l = values(s.len() * shape.row_elems(KvBuffer::Label), rng);
            host.write_labels(layer, &s, &l).unwrap();
            dev.write_labels(layer, &s, &l).unwrap();
            both(&mut host, &mut dev, "write_labels");
        }
        for &b in shape.buffers() {
            let s = slots(&[5, 6, 9, 5, rows - 2]);
            let raw = bytes(s.len() * shape.row_bytes(b), rng);
            host.write_raw(layer, b, &s, &raw).unwrap();
            dev.write_raw(layer, b, &s, &raw).unwrap();
            both(&mut host, &mut dev, "write_raw");
            let mut got = vec![0.0f32; s.len() * shape.row_elems(b)];
            let mut want = got.clone();
            host.read_f32(layer, b, &s, &mut want).unwrap();
            dev.read_f32(layer, b, &s, &mut got).unwrap();
            let (gb, wb): (Vec<u32>, Vec<u32>) = (
                got.iter().map(|x| x.to_bits()).collect(),
                want.iter().map(|x| x.to_bits()).collect(),
            );
            assert_eq!(gb, wb, "{shape}: read_f32");
        }
    }
    // Overlapping copies (a shift by one) read every source before writing.
    let src = slots(&[3, 4, 5, 6, 7]);
    let dst = slots(&[4, 5, 6, 7, 8]);
    host.copy_slots(&src, &dst).unwrap();
    dev.copy_slots(&src, &dst).unwrap();
    both(&mut host, &mut dev, "copy_slots");
    let pages = [Page(2), Page(1), Page(layout.pages() as u32)];
    let data = bytes(pages.len() * layout.page_bytes(), rng);
    host.write_pages(&pages, &data).unwrap();
    dev.write_pages(&pages, &data).unwrap();
    both(&mut host, &mut dev, "write_pages");
    let mut a = vec![0u8; 2 * layout.page_bytes()];
    let mut b = a.clone();
    host.read_pages(&[Page(1), Page(2)], &mut a).unwrap();
    dev.read_pages(&[Page(1), Page(2)], &mut b).unwrap();
    assert!(a == b, "read_pages");
    assert_eq!(dev.memory_regions().len(), host.memory_regions().len());
}

fn check_store_matches_host(config: WgpuConfig, test: &str) {
    let Some(backend) = backend_or_skip_with(test, config) else {
        return;
    };
    let mut seed = SplitMix64::new(11);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        for shape in shapes(dtype) {
            let layout = KvLayout::new(shape, 4, 64).unwrap();
            if let Err(e) = backend.new_kv_store(layout) {
                println!("SKIP {shape}: {e}");
                continue;
            }
            same_ops(&backend, layout, &mut seed);
        }
    }
}

#[test]
fn device_store_matches_host_store() {
    check_store_matches_host(WgpuConfig::default(), "device_store_matches_host_store");
}

/// With a 1 KiB binding limit each per-layer buffer spans several wgpu buffers.
#[test]
fn chunked_device_store_matches_host_store() {
    let config = WgpuConfig {
        max_binding_bytes: Some(1024),
        ..WgpuConfig::default()
    };
    let Some(backend) = backend_or_skip_with("chunked_device_store", config.clone()) else {
        return;
    };
    let layout = KvLayout::new(KvShape::mha(2, 8, 4, 2, KvDtype::F32).unwrap(), 4, 64).unwrap();
    let store = backend.new_kv_store(layout).unwrap();
    assert!(
        store.chunks_per_buffer() >= 4,
        "{}",
        store.chunks_per_buffer()
    );
    check_store_matches_host(config, "chunked_device_store_matches_host_store");
}

/// Chunks so small that K and V would need more storage bindings than one attention kernel
/// may have (GL allows 16 storage buffers per kernel, lavapipe 32) grow until they fit, and
/// the store still behaves like the host store.
#[test]
fn chunks_grow_to_fit_the_adapters_storage_buffers() {
    let config = WgpuConfig {
        max_binding_bytes: Some(1024),
        ..WgpuConfig::default()
    };
    let test = "chunks_grow_to_fit";
    let Some(backend) = backend_or_skip_with(test, config) else {
        return;
    };
    // The attention kernel binds 4 buffers besides the chunks of K and V.
    let budget = (backend.report().max_storage_buffers as usize).saturating_sub(4) / 2;
    if !(2..=1024).contains(&budget) {
        println!("SKIP {test}: {budget} chunks per buffer fit; no small layout exceeds that");
        return;
    }
    // 64-byte rows, 16 per 1 KiB chunk: the configured size would need budget + 2 chunks.
    let shape = KvShape::mha(2, 8, 8, 2, KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, 4, 16 * (budget + 2)).unwrap();
    let store = backend.new_kv_store(layout).unwrap();
    let chunks = store.chunks_per_buffer();
    assert!(
        (2..=budget).contains(&chunks),
        "{chunks} chunks for a budget of {budget}"
    );
    same_ops(&backend, layout, &mut SplitMix64::new(17));
}

/// Each bad call must fail on the device store exactly as on the host store (the same
/// result, error for error) and leave the device store unchanged.
#[test]
fn bad_inputs_get_the_host_stores_errors() {
    let Some(backend) = backend_or_skip_with("store_bad_inputs", WgpuConfig::default()) else {
        return;
    };
    let mut seed = SplitMix64::new(5);
    for shape in shapes(KvDtype::F32) {
        let layout = KvLayout::new(shape, 4, 16).unwrap();
        let mut host = HostKvStore::new(layout).unwrap();
        let mut dev = backend.new_kv_store(layout).unwrap();
        let s = slots(&[1, 2, 3]);
        let k = values(3 * shape.row_elems(KvBuffer::Key), &mut seed);
        let v = values(3 * shape.row_elems(KvBuffer::Value), &mut seed);
        host.write_kv(1, &s, &k, &v).unwrap();
        dev.write_kv(1, &s, &k, &v).unwrap();
        let before = dump(&dev);
        let bad = slots(&[1, 20]);
        type Op = Box<dyn Fn(&mut dyn KvStore) -> Result<(), KvPoolError>>;
        let k2 = values(2 * shape.row_elems(KvBuffer::Key), &mut seed);
        let v2 = values(2 * shape.row_elems(KvBuffer::Value), &mut seed);
        let rb = shape.row_bytes(KvBuffer::Key);
        let ops: Vec<(&str, Op)> = vec![
            ("layer", Box::new(move |st| st.write_kv(2, &s, &k, &v))),
            ("slot", {
                let bad = bad.clone();
                Box::new(move |st| st.write_kv(0, &bad, &k2, &v2))
            }),
            (
                "k len",
                Box::new(|st| st.write_kv(0, &slots(&[1]), &[1.0], &[])),
            ),
            (
                "labels",
                Box::new(|st| st.write_labels(0, &slots(&[1]), &[])),
            ),
            (
                "raw len",
                Box::new(move |st| st.write_raw(0, KvBuffer::Key, &slots(&[1, 2]), &vec![0; rb])),
            ),
            // MLA has no value buffer (for the others this empty write is accepted by both).
            (
                "raw value",
                Box::new(|st| st.write_raw(0, KvBuffer::Value, &[], &[])),
            ),
            ("read slot", {
                let bad = bad.clone();
                Box::new(move |st| st.read_raw(0, KvBuffer::Key, &bad, &mut vec![0; 2 * rb]))
            }),
            (
                "copy len",
                Box::new(|st| st.copy_slots(&slots(&[1]), &slots(&[2, 3]))),
            ),
            ("copy slot", {
                let bad = bad.clone();
                Box::new(move |st| st.copy_slots(&bad, &slots(&[2, 3])))
            }),
            ("page 0", Box::new(|st| st.read_pages(&[Page(0)], &mut []))),
            (
                "page data",
                Box::new(|st| st.write_pages(&[Page(1)], &[1, 2, 3])),
            ),
            (
                "page range",
                Box::new(|st| {
                    let pb = st.layout().page_bytes();
                    st.write_pages(&[Page(5)], &vec![0; pb])
                }),
            ),
            ("scale", Box::new(|st| st.set_scales(0, f32::NAN, 1.0))),
        ];
        for (what, op) in &ops {
            let want = op(&mut host);
            let got = op(&mut dev);
            assert_eq!(got, want, "{shape} {what}");
        }
        assert!(
            dump(&dev) == before,
            "{shape}: a refused call changed the store"
        );
        assert_eq!(dev.scales(9), host.scales(9));
    }
}

/// `WgpuKvStore::device_rows`: the handle another thread copies through (HiCache's controller)
/// passes kv-pool's `check_device_rows` (the same bytes as the host store from other threads,
/// the host store's errors, the buffers kept after the store is gone).
#[test]
fn device_rows_move_the_same_bytes_as_the_host_store_from_another_thread() {
    let Some(backend) = backend_or_skip_with("store_device_rows", WgpuConfig::default()) else {
        return;
    };
    for (i, shape) in shapes(KvDtype::F32).into_iter().enumerate() {
        let layout = KvLayout::new(shape, 4, 64).unwrap();
        let dev: WgpuKvStore = backend.new_kv_store(layout).unwrap();
        let rows = dev.device_rows();
        kv_pool::testing::check_device_rows(dev, rows, 17 + i as u64);
    }
}
