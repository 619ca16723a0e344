//! Snapshot of the page-table metadata built for a small batch.

use attention::conformance::scattered_slots;
use attention::{BatchMetadata, RequestKv};
use kv_pool::rng::SplitMix64;

#[test]
fn page_table_snapshot() {
    // P = 4: an empty prefix, a page-aligned prefix (8), an unaligned prefix (5), all on a
    // shuffled pool.
    let requests = [(0, 6), (8, 3), (5, 4)];
    let slots = scattered_slots(4, 64, &requests, &mut SplitMix64::new(3)).unwrap();
    let reqs: Vec<RequestKv<'_>> = slots
        .iter()
        .zip(&requests)
        .map(|(s, &(_, ext))| RequestKv {
            slots: s,
            extend_len: ext,
        })
        .collect();
    let meta = BatchMetadata::new(4, &reqs).unwrap();
    let mut s = meta.to_string();
    for (r, sl) in slots.iter().enumerate() {
        let ids: Vec<u32> = sl.iter().map(|x| x.0).collect();
        s += &format!("slots req {r}: {ids:?}\n");
        for (p, &slot) in sl.iter().enumerate() {
            assert_eq!(meta.slot(r, p), slot);
        }
    }
    s += &format!("positions {:?}\n", meta.positions());
    insta::assert_snapshot!("page_table", s);

    let decode: Vec<RequestKv<'_>> = slots
        .iter()
        .map(|s| RequestKv {
            slots: s,
            extend_len: 1,
        })
        .collect();
    insta::assert_snapshot!(
        "page_table_decode",
        BatchMetadata::new_decode(4, &decode).unwrap().to_string()
    );
}
