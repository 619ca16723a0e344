//! Tests of the host pool: byte-exact round trips with the device store in every layout,
//! the packed page format, sizing, and refused inputs.

use std::fmt::Write as _;

use super::*;
use crate::layout::KvDtype;
use crate::rng::SplitMix64;
use crate::store::HostKvStore;

fn slots(ids: impl IntoIterator<Item = usize>) -> Vec<Slot> {
    ids.into_iter().map(|s| Slot(s as u32)).collect()
}

fn shapes() -> Vec<KvShape> {
    vec![
        KvShape::mha(2, 8, 4, 3, KvDtype::Bf16).unwrap(),
        KvShape::mla(12, 4, 2, KvDtype::Fp8E4m3).unwrap(),
        KvShape::double_sparse(2, 8, 4, 3, 2, KvDtype::F32).unwrap(),
    ]
}

/// `n` distinct random pages of `1..=pages`, as slot lists (whole pages, in page order given).
fn random_pages(n: usize, pages: usize, p: usize, seed: &mut SplitMix64) -> (Vec<Page>, Vec<Slot>) {
    let mut all: Vec<usize> = (1..=pages).collect();
    seed.shuffle(&mut all);
    all.truncate(n);
    // Half the time keep a sorted run, so long contiguous runs are exercised too.
    if seed.next_u64() & 1 == 0 {
        all.sort_unstable();
    }
    let pg: Vec<Page> = all.iter().map(|&x| Page(x as u32)).collect();
    let sl: Vec<usize> = all.iter().flat_map(|&x| x * p..(x + 1) * p).collect();
    (pg, slots(sl))
}

fn packed(store: &dyn KvStore, pages: &[Page]) -> Vec<u8> {
    let mut out = vec![0u8; pages.len() * store.layout().page_bytes()];
    store.read_pages(pages, &mut out).unwrap();
    out
}

fn pool_packed(pool: &HostKvPool, pages: &[Page]) -> Vec<u8> {
    let mut out = vec![0u8; pages.len() * pool.layout().page_bytes()];
    pool.read_pages(pages, &mut out).unwrap();
    out
}

#[test]
fn every_layout_round_trips_with_the_device_store_byte_for_byte() {
    let mut seed = SplitMix64::new(13);
    for shape in shapes() {
        for p in [1u32, 4, 16] {
            let dev_layout = KvLayout::new(shape, p, 8 * p as usize).unwrap();
            let src = crate::testing::random_host_store(dev_layout, &mut seed);
            for hl in HostLayout::ALL {
                let mut pool = HostKvPool::new(shape, p, 12 * p as usize, hl).unwrap();
                for _ in 0..4 {
                    let n = 1 + seed.below(6);
                    let (dpages, dslots) = random_pages(n, 8, p as usize, &mut seed);
                    let (hpages, hslots) = random_pages(n, 12, p as usize, &mut seed);
                    // Device → host: the host pages hold exactly the device pages' bytes.
                    pool.copy_from_store(&src, &dslots, &hslots).unwrap();
                    assert_eq!(
                        pool_packed(&pool, &hpages),
                        packed(&src, &dpages),
                        "{hl} P={p}"
                    );
                    // Host → device, layer by layer, into other slots of a zeroed store.
                    let mut dst = HostKvStore::new(dev_layout).unwrap();
                    let (tpages, tslots) = random_pages(n, 8, p as usize, &mut seed);
                    for layer in 0..shape.layers as usize {
                        pool.copy_layer_to_store(&mut dst, layer, &hslots, &tslots)
                            .unwrap();
                    }
                    assert_eq!(packed(&dst, &tpages), packed(&src, &dpages), "{hl} P={p}");
                    // Packed pages in and out of the pool are the same bytes.
                    let data = packed(&src, &dpages);
                    let mut other = HostKvPool::new(shape, p, 12 * p as usize, hl).unwrap();
                    other.write_pages(&hpages, &data).unwrap();
                    assert_eq!(pool_packed(&other, &hpages), data);
                    // Rows read back one by one agree with the store's.
                    for layer in 0..shape.layers as usize {
                        for &b in shape.buffers() {
                            let rb = shape.row_bytes(b);
                            let mut want = vec![0u8; dslots.len() * rb];
                            src.read_raw(layer, b, &dslots, &mut want).unwrap();
                            let mut got = vec![0u8; hslots.len() * rb];
                            pool.read_raw(layer, b, &hslots, &mut got).unwrap();
                            assert_eq!(got, want);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn raw_offsets_match_the_rows_the_safe_paths_move() {
    let mut seed = SplitMix64::new(5);
    let shape = KvShape::mha(1, 4, 2, 2, KvDtype::F16).unwrap();
    for hl in HostLayout::ALL {
        let mut pool = HostKvPool::new(shape, 4, 16, hl).unwrap();
        let rows = slots(0..pool.layout().rows());
        for layer in 0..2 {
            for &b in shape.buffers() {
                let rb = shape.row_bytes(b);
                let bytes: Vec<u8> = (0..rows.len() * rb)
                    .map(|_| seed.next_u64() as u8)
                    .collect();
                pool.write_raw(layer, b, &rows, &bytes).unwrap();
                for (i, &s) in rows.iter().enumerate() {
                    let off = pool.row_offset(layer, b, s).unwrap();
                    // SAFETY: the offset is in bounds of the live pool; no one writes it now.
                    let got = unsafe { std::slice::from_raw_parts(pool.as_mut_ptr().add(off), rb) };
                    assert_eq!(got, &bytes[i * rb..(i + 1) * rb], "{hl} {s}");
                }
            }
        }
        assert_eq!(
            pool.contiguous_rows(Slot(5)),
            match hl {
                HostLayout::LayerFirst => 15,
                HostLayout::PageFirst => 1,
                HostLayout::PageFirstDirect => 3,
            }
        );
        assert_eq!(pool.contiguous_rows(Slot(20)), 0);
    }
}

#[test]
fn write_pages_shared_is_write_pages() {
    let mut seed = SplitMix64::new(8);
    let shape = KvShape::mla(6, 2, 3, KvDtype::Bf16).unwrap();
    let src = crate::testing::random_host_store(KvLayout::new(shape, 4, 32).unwrap(), &mut seed);
    let pages = [Page(3), Page(1)];
    let data = packed(&src, &pages);
    for hl in HostLayout::ALL {
        let pool = HostKvPool::new(shape, 4, 16, hl).unwrap();
        // SAFETY: no other thread uses the pool.
        unsafe { pool.write_pages_shared(&pages, &data).unwrap() };
        assert_eq!(pool_packed(&pool, &pages), data);
        // SAFETY: as above; the length is wrong, so nothing is written.
        let err = unsafe { pool.write_pages_shared(&pages, &data[1..]) };
        assert!(matches!(
            err,
            Err(KvPoolError::LengthMismatch { what: "data", .. })
        ));
    }
}

#[test]
fn bad_inputs_are_refused_and_change_nothing() {
    let shape = KvShape::mha(1, 4, 4, 2, KvDtype::F32).unwrap();
    let mut seed = SplitMix64::new(3);
    let store = crate::testing::random_host_store(KvLayout::new(shape, 4, 16).unwrap(), &mut seed);
    let mut pool = HostKvPool::new(shape, 4, 8, HostLayout::PageFirst).unwrap();
    pool.copy_from_store(&store, &slots(4..12), &slots(4..12))
        .unwrap();
    let before = pool_packed(&pool, &[Page(1), Page(2)]);
    let oob = KvPoolError::SlotOutOfRange {
        slot: Slot(12),
        first: 0,
        end: 12,
    };
    assert_eq!(
        pool.copy_from_store(&store, &slots(4..9), &slots(8..13)),
        Err(oob.clone())
    );
    assert_eq!(
        pool.copy_from_store(&store, &slots(4..8), &slots(4..7)),
        Err(KvPoolError::LengthMismatch {
            what: "host",
            expected: 4,
            got: 3
        })
    );
    assert_eq!(
        pool.write_pages(&[Page(3)], &vec![1; pool.layout().page_bytes()]),
        Err(KvPoolError::PageOutOfRange {
            page: Page(3),
            last: 2
        })
    );
    assert_eq!(pool.row_offset(0, KvBuffer::Key, Slot(12)), Err(oob));
    assert!(matches!(
        pool.row_offset(0, KvBuffer::Label, Slot(1)),
        Err(KvPoolError::Unsupported(_))
    ));
    assert_eq!(
        pool.row_offset(2, KvBuffer::Key, Slot(1)),
        Err(KvPoolError::LayerOutOfRange {
            layer: 2,
            layers: 2
        })
    );
    let mut other = HostKvStore::new(KvLayout::new(shape, 2, 16).unwrap()).unwrap();
    assert!(matches!(
        pool.copy_layer_to_store(&mut other, 0, &slots(4..6), &slots(2..4)),
        Err(KvPoolError::InvalidConfig {
            field: "host pool",
            ..
        })
    ));
    assert_eq!(pool_packed(&pool, &[Page(1), Page(2)]), before);
    assert!(matches!(
        HostKvPool::new(shape, 4, 10, HostLayout::LayerFirst),
        Err(KvPoolError::NotPageAligned {
            n: 10,
            page_size: 4
        })
    ));
}

#[test]
fn the_allocation_that_fails_is_host_out_of_memory() {
    // 2^47 bytes (beyond a 47-bit user address space): refused by the allocator.
    let big = KvShape::mha(1024, 1024, 1024, 64, KvDtype::F32).unwrap();
    let slots_needed = (1usize << 47) / big.slot_bytes();
    assert_eq!(
        HostKvPool::new(big, 1, slots_needed, HostLayout::LayerFirst).unwrap_err(),
        KvPoolError::HostOutOfMemory {
            bytes: (slots_needed + 1) * big.slot_bytes()
        }
    );
}

fn size_input(device_slots: usize, p: u32, bpt: usize, ratio: f64, gb: f64) -> HostPoolSizeInput {
    HostPoolSizeInput {
        device_slots,
        page_size: p,
        bytes_per_token: bpt,
        hicache_ratio: ratio,
        hicache_size_gb: gb,
        mem_available_bytes: 512 << 30,
        reserve_bytes: HOST_MEMORY_RESERVE_BYTES,
    }
}

#[test]
fn sizing_table_snapshot() {
    let llama8b = KvShape::mha(8, 128, 128, 32, KvDtype::Bf16)
        .unwrap()
        .slot_bytes();
    let dsv3 = KvShape::mla(512, 64, 61, KvDtype::Bf16)
        .unwrap()
        .slot_bytes();
    let mut s = String::from("device_slots P bytes/token ratio size_gb -> result\n");
    for (d, p, bpt, ratio, gb) in [
        (100_000, 1, llama8b, 2.0, 0.0),
        (100_000, 16, llama8b, 2.0, 0.0),
        (100_000, 64, llama8b, 2.0, 0.0),
        (100_000, 1, llama8b, 1.0, 0.0),
        (100_000, 1, llama8b, 0.5, 0.0),
        (100_000, 16, llama8b, 2.0, 50.0),
        (100_000, 16, llama8b, 2.0, 1000.0),
        (300_000, 64, dsv3, 3.0, 0.0),
        (8, 4, 96, 2.0, 0.0),
        (100_000, 1, llama8b, 0.0, 0.0),
        (100_000, 1, llama8b, 2.0, -1.0),
    ] {
        write!(s, "{d} {p} {bpt} {ratio} {gb} -> ").unwrap();
        match HostPoolSize::compute(size_input(d, p, bpt, ratio, gb)) {
            Ok(r) => writeln!(s, "{} slots {} bytes | {r}", r.slots, r.bytes).unwrap(),
            Err(e) => writeln!(s, "error: {e}").unwrap(),
        }
    }
    insta::assert_snapshot!("host_pool_sizing", s);
}

#[test]
fn sizing_refuses_a_pool_that_leaves_less_than_the_reserve() {
    let mut input = size_input(1000, 4, 1000, 2.0, 0.0);
    // 2004 slots × 1000 bytes = 2_004_000 bytes; 2 MB + 10 GiB available is not enough.
    input.mem_available_bytes = HOST_MEMORY_RESERVE_BYTES + 2_000_000;
    assert_eq!(
        HostPoolSize::compute(input),
        Err(KvPoolError::HostPoolTooLarge {
            slots: 2004,
            bytes: 2_004_000,
            mem_available_bytes: HOST_MEMORY_RESERVE_BYTES + 2_000_000,
            reserve_bytes: HOST_MEMORY_RESERVE_BYTES,
        })
    );
    let msg = HostPoolSize::compute(input).unwrap_err().to_string();
    assert!(
        msg.contains("--hicache-ratio") && msg.contains("2004 slots"),
        "{msg}"
    );
    input.mem_available_bytes += 4_000;
    assert_eq!(HostPoolSize::compute(input).unwrap().slots, 2004);
}
