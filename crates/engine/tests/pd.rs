//! PD disaggregation end to end, in process on loopback: a prefill and a decode server paired
//! by a bootstrap room give the same greedy tokens as one server (plain and chunked prefill,
//! cold and with the decode side's cache hit, over tcp and shm); failures (a corrupted frame,
//! an incompatible pair, a room that never gets its prefill) fail the request with a clear
//! error and leave nothing allocated on either side.

mod common;

use common::pd::{assert_nothing_held, pair, send, send_and_drop_prefill, Pair};
use common::{post, start};
use serde_json::{json, Value};

fn prompt(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| 300 + (i * 7 + seed * 13) % 4000).collect()
}

fn greedy(ids: &[u32], max_new: usize) -> Value {
    json!({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": true}})
}

fn single_server_outputs(prompts: &[Vec<u32>], max_new: usize) -> Vec<Value> {
    let single = start(&[]);
    prompts
        .iter()
        .map(|ids| {
            let (status, r) = post(single.port, "/generate", greedy(ids, max_new));
            assert_eq!(status, 200, "{r}");
            r["output_ids"].clone()
        })
        .collect()
}

fn pd_matches_one_server(backend: &str, prefill_flags: &[&str]) {
    // Page-aligned, not aligned, shorter than a page, longer than a chunk.
    let prompts = vec![prompt(64, 1), prompt(75, 2), prompt(9, 3), prompt(150, 4)];
    let want = single_server_outputs(&prompts, 10);
    let p = pair(backend, prefill_flags, &[]);
    for (i, ids) in prompts.iter().enumerate() {
        let ((ps, pr), (ds, dr)) = send(&p, "/generate", &greedy(ids, 10), 1000 + i as u64);
        assert_eq!(ps, 200, "prefill: {pr}");
        assert_eq!(ds, 200, "decode: {dr}");
        assert_eq!(dr["output_ids"], want[i], "prompt {i} over {backend}");
        assert_eq!(
            pr["output_ids"].as_array().unwrap().len(),
            1,
            "prefill: one token"
        );
        assert_eq!(pr["output_ids"][0], want[i][0]);
    }
    // The same prompt again: the decode side has it cached and only the missing pages move.
    let before = transferred_bytes(&p);
    let ((_, _), (ds, dr)) = send(&p, "/generate", &greedy(&prompts[3], 10), 2000);
    assert_eq!(ds, 200, "{dr}");
    assert_eq!(dr["output_ids"], want[3]);
    assert!(
        dr["meta_info"]["cached_tokens"].as_u64().unwrap() >= 144,
        "decode-side cache hit: {dr}"
    );
    let moved = transferred_bytes(&p) - before;
    let full = page_bytes(&p) * 150u64.div_ceil(16);
    assert!(
        moved < full / 4,
        "incremental transfer moved {moved} of {full} bytes"
    );
    assert_nothing_held(&p);
    // Both roles count their transfers and show their PD queues in /metrics.
    for (port, queue) in [
        (p.prefill.port, "kvserve:num_prefill_inflight_queue_reqs 0"),
        (p.decode.port, "kvserve:num_decode_transfer_queue_reqs 0"),
    ] {
        let (status, text) = common::http(port, "GET", "/metrics", "");
        assert_eq!(status, 200);
        assert!(text.contains(queue), "{text}");
        assert!(
            text.contains("kvserve:kv_transfer_success_total 5"),
            "{text}"
        );
        assert!(
            text.contains("kvserve:kv_transfer_failed_total 0"),
            "{text}"
        );
    }
}

fn transferred_bytes(p: &Pair) -> u64 {
    let info = common::get(p.prefill.port, "/get_server_info");
    info["engine"]["disaggregation"]["transfer"]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no transfer byte count: {info}"))
}

fn page_bytes(p: &Pair) -> u64 {
    let info = common::get(p.prefill.port, "/get_server_info");
    info["engine"]["disaggregation"]["page_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no page size in bytes: {info}"))
}

#[test]
fn tcp_pair_matches_one_server() {
    pd_matches_one_server("tcp", &[]);
}

#[test]
fn shm_pair_matches_one_server() {
    pd_matches_one_server("shm", &[]);
}

#[test]
fn chunked_prefill_pair_matches_one_server() {
    pd_matches_one_server("tcp", &["--chunked-prefill-size", "32"]);
}

#[test]
fn a_corrupted_frame_fails_the_request_and_frees_both_sides() {
    let p = pair("tcp", &["--disaggregation-test-corrupt-frame", "0"], &[]);
    let ((ps, pr), (ds, dr)) = send(&p, "/generate", &greedy(&prompt(80, 5), 6), 7);
    assert_eq!(
        ds, 500,
        "decode must not answer with KV that did not arrive intact: {dr}"
    );
    assert_eq!(dr["error"]["code"], "kv_transfer_failed", "{dr}");
    assert!(dr.to_string().contains("checksum"), "{dr}");
    assert_eq!(ps, 500, "the prefill side fails too: {pr}");
    assert_nothing_held(&p);
    // The pair still works afterwards.
    let ((_, _), (ds, dr)) = send(&p, "/generate", &greedy(&prompt(40, 6), 4), 8);
    assert_eq!(ds, 200, "{dr}");
    assert_nothing_held(&p);
}

#[test]
fn an_incompatible_pair_is_refused_with_a_clear_error() {
    for (flags, says) in [
        (
            &["--page-size", "32"][..],
            "page_size is 16 there but 32 here",
        ),
        (&["--kv-cache-dtype", "bfloat16"][..], "kv_dtype"),
    ] {
        let p = pair("tcp", &[], flags);
        let (ds, dr) = send_and_drop_prefill(&p, "/generate", &greedy(&prompt(40, 7), 4), 9);
        assert_eq!(ds, 500, "{dr}");
        assert!(dr.to_string().contains(says), "{flags:?}: {dr}");
        assert_nothing_held(&p);
    }
}

#[test]
fn requests_without_bootstrap_fields_are_refused_by_pd_servers() {
    let p = pair("fake", &[], &[]);
    for port in [p.prefill.port, p.decode.port] {
        let (status, r) = post(port, "/generate", greedy(&[1, 2, 3], 2));
        assert_eq!(status, 400, "{r}");
        assert!(r.to_string().contains("bootstrap_host"), "{r}");
    }
}

#[test]
fn a_room_whose_prefill_never_comes_times_out_cleanly() {
    let p = pair("tcp", &[], &["--disaggregation-waiting-timeout", "1"]);
    let body = common::pd::with_room(&greedy(&prompt(40, 8), 4), p.bootstrap_port, 4242);
    let (status, r) = post(p.decode.port, "/generate", body);
    assert_eq!(status, 500, "{r}");
    assert!(r.to_string().contains("waiting timeout"), "{r}");
    assert_nothing_held(&p);
}

#[test]
fn a_request_the_decode_pool_can_never_hold_fails_on_both_sides() {
    let p = pair("tcp", &[], &["--max-total-tokens", "512"]);
    let mut body = greedy(&prompt(300, 9), 400);
    body["sampling_params"]["max_new_tokens"] = json!(400);
    let ((ps, pr), (ds, dr)) = send(&p, "/generate", &body, 31);
    assert_eq!(ds, 200, "{dr}");
    assert_eq!(dr["meta_info"]["finish_reason"]["type"], "abort", "{dr}");
    assert!(dr.to_string().contains("KV pool"), "{dr}");
    assert_eq!(ps, 500, "the prefill side is told: {pr}");
    assert_nothing_held(&p);
}

/// HiCache on both servers of a PD pair: five 160-token prompts, then the first again, on a
/// 256-token prefill pool (each prompt evicts the one before) and a 704-token decode pool (the
/// decode side reserves 512 tokens for decoding, so the fifth prompt evicts the first): the
/// repeat comes back from the host tier on both sides, and the decode side loads its host hit
/// back instead of receiving it. Greedy tokens equal one plain server's,
/// the host tiers (4 × the device pool, so they hold all five) served the repeat, and neither
/// side holds anything afterwards.
#[test]
fn hicache_on_both_sides_of_a_pair_matches_one_server() {
    let prompts: Vec<Vec<u32>> = (5..10).map(|s| prompt(160, s)).collect();
    let want = single_server_outputs(&prompts, 6);
    let with_pool = |pool: &'static str| {
        [
            "--max-total-tokens",
            pool,
            "--page-size",
            "16",
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "4",
        ]
    };
    let p = pair("tcp", &with_pool("256"), &with_pool("704"));
    let mut moved = 0;
    for (turn, i) in [0usize, 1, 2, 3, 4, 0].into_iter().enumerate() {
        let room = 3000 + turn as u64;
        let before = transferred_bytes(&p);
        let ((ps, pr), (ds, dr)) = send(&p, "/generate", &greedy(&prompts[i], 6), room);
        assert_eq!(ps, 200, "prefill: {pr}");
        assert_eq!(ds, 200, "decode: {dr}");
        assert_eq!(dr["output_ids"], want[i], "turn {turn}");
        moved = transferred_bytes(&p) - before;
    }
    // The repeat moved only the pages after the decode side's host hit (144 tokens).
    assert_eq!(moved, page_bytes(&p), "the last page only");
    assert_nothing_held(&p);
    for (side, port) in [("prefill", p.prefill.port), ("decode", p.decode.port)] {
        let info = common::get(port, "/get_server_info");
        let t = &info["engine"]["hicache"];
        assert!(
            t["host_hit_tokens"].as_u64().unwrap() >= 144,
            "{side}: the repeat came back from host: {t}"
        );
    }
}
