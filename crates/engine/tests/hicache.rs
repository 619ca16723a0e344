//! HiCache end to end (`--enable-hierarchical-cache`): greedy output identical with and
//! without the host tier for every write policy and host layout, with a device pool so small
//! that every reuse goes through the host tier; a repeated prompt served from host after
//! device eviction (host hits in `/metrics`, those tokens not prefilled); a restarted server
//! served from its `file` L3; retraction to host.

mod common;

use std::path::PathBuf;
use std::thread;

use common::redis::Redis;
use common::{assert_kv_freed, get, post, start, wait_idle};
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

/// A fresh directory for a `file` L3 store, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("kvserve-hicache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Flags of a server with a host tier over an L3 store configured by `extra` (JSON).
fn l3_flags(backend: &str, extra: &Value) -> Vec<String> {
    [
        "--max-total-tokens",
        "1024",
        "--page-size",
        "16",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        backend,
        "--hicache-storage-backend-extra-config",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([extra.to_string()])
    .collect()
}

fn start_with(flags: &[String]) -> common::Server {
    start(&flags.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn a_restarted_server_serves_prefixes_from_its_file_store() {
    let dir = TempDir::new("restart");
    let flags = l3_flags(
        "file",
        &json!({"file_path": dir.0, "prefetch_threshold": 64}),
    );
    let a = prompt(5, 320);
    let want = {
        let srv = start_with(&flags);
        let r = generate(srv.port, &a, 6);
        assert_eq!(r["meta_info"]["cached_tokens"], 0);
        // Idle means every write and L3 backup was acknowledged.
        let t = tiers(srv.port);
        assert!(t["backups"].as_u64().unwrap() > 0, "{t}");
        r["output_ids"].clone()
    };
    let srv = start_with(&flags);
    let r = generate(srv.port, &a, 6);
    assert_eq!(r["output_ids"], want);
    // 319 tokens are matched at most (the last is computed): 19 whole pages from storage.
    assert_eq!(r["meta_info"]["cached_tokens"], 304, "{r}");
    let t = tiers(srv.port);
    assert_eq!(t["storage_hit_tokens"], 304, "{t}");
    assert_eq!(t["device_hit_tokens"], 0, "{t}");
}

#[test]
fn redis_serves_after_a_flush_and_a_dead_redis_fails_no_request() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let extra = json!({"url": redis.url(), "prefetch_threshold": 64, "io_timeout_ms": 500, "connect_timeout_ms": 200});
    let srv = start_with(&l3_flags("redis", &extra));
    let a = prompt(6, 320);
    let want = generate(srv.port, &a, 6)["output_ids"].clone();
    assert!(tiers(srv.port)["backups"].as_u64().unwrap() > 0);
    // Device and host emptied: only Redis holds the prefix now.
    assert_eq!(post(srv.port, "/flush_cache", json!({})).0, 200);
    let r = generate(srv.port, &a, 6);
    assert_eq!(r["output_ids"], want);
    assert_eq!(r["meta_info"]["cached_tokens"], 304, "{r}");
    assert_eq!(tiers(srv.port)["storage_hit_tokens"], 304);

    // Redis dies while requests with fresh prompts (backups, prefetch queries) are in flight:
    // every request still succeeds, and nothing is left locked or leaked.
    let port = srv.port;
    let clients: Vec<_> = (0..8)
        .map(|k| {
            thread::spawn(move || {
                let ids = prompt(100 + k, 300);
                generate(port, &ids, 8)["output_ids"]
                    .as_array()
                    .unwrap()
                    .len()
            })
        })
        .collect();
    thread::sleep(std::time::Duration::from_millis(30));
    redis.kill();
    for c in clients {
        assert_eq!(c.join().unwrap(), 8);
    }
    let r = generate(srv.port, &prompt(200, 300), 4);
    assert_eq!(r["output_ids"].as_array().unwrap().len(), 4);
    assert_kv_freed(srv.port);
}

/// Eight long generations arriving a few milliseconds apart on a pool that cannot hold them
/// all: each is admitted beside running requests whose future growth admission discounts
/// (`--schedule-conservativeness 0.1`), so together they outgrow the pool and the scheduler
/// retracts.
fn retracting_run(extra: &[&str]) -> (Vec<Value>, Value) {
    let mut flags = vec![
        "--max-total-tokens",
        "512",
        "--page-size",
        "16",
        "--max-running-requests",
        "8",
        "--schedule-conservativeness",
        "0.1",
    ];
    flags.extend(extra);
    let srv = start(&flags);
    let port = srv.port;
    let clients: Vec<_> = (0..8)
        .map(|k| {
            thread::sleep(std::time::Duration::from_millis(15));
            thread::spawn(move || generate(port, &prompt(300 + k, 48), 200)["output_ids"].clone())
        })
        .collect();
    let outs = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let info = wait_idle(port);
    (outs, info["engine"].clone())
}

#[test]
fn retraction_to_host_keeps_greedy_output_and_loads_back_instead_of_recomputing() {
    // Retraction needs the eight generations to overlap, which their arrival timing decides
    // (a CI run once saw a plain run finish without outgrowing the pool): the pair runs again,
    // at most three times, until both retracted. The outputs must agree on every attempt.
    let retracted = |e: &Value| e["retractions"].as_u64().unwrap() > 0;
    let mut attempts = 0;
    let (plain, tiered) = loop {
        attempts += 1;
        let (want, plain) = retracting_run(&[]);
        let (got, tiered) = retracting_run(&["--enable-hierarchical-cache"]);
        assert_eq!(got, want);
        if (retracted(&plain) && retracted(&tiered)) || attempts == 3 {
            break (plain, tiered);
        }
    };
    assert!(plain["retractions"].as_u64().unwrap() > 0, "{plain}");
    assert!(tiered["retractions"].as_u64().unwrap() > 0, "{tiered}");
    // A retracted request comes back to prompt + outputs so far; what the host tier loads
    // back is not prefilled again (recompute prefills all of it but its device-cached prompt).
    let n = |e: &Value, k: &str| e[k].as_u64().unwrap();
    let h = &tiered["hicache"];
    assert!(n(h, "host_hit_tokens") > 0, "{tiered}");
    assert_eq!(
        n(&tiered, "prefill_tokens") + n(&tiered, "cached_tokens"),
        n(&tiered, "prompt_tokens"),
        "{tiered}"
    );
    let resumed = n(&tiered, "prompt_tokens") - 8 * 48;
    assert!(
        n(&tiered, "prefill_tokens") - 8 * 48 < resumed,
        "resumed requests prefilled all {resumed} of their tokens: {tiered}"
    );
}

fn kvserve(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args(args)
        .output()
        .expect("run kvserve")
}

#[test]
fn bench_reports_cached_tokens_per_tier_on_a_multi_turn_workload() {
    let dir = TempDir::new("bench");
    let json = dir.0.join("bench.json");
    let extra = json!({"file_path": dir.0.join("l3"), "prefetch_threshold": 64}).to_string();
    let o = kvserve(&[
        "bench",
        "--workload",
        "multiturn",
        "--mt-sessions",
        "6",
        "--mt-turns",
        "3",
        "--mt-input-len",
        "64",
        "--mt-output-len",
        "16",
        "--max-concurrency",
        "2",
        "--max-total-tokens",
        "512",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        &extra,
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        dir.0.join("bench.png").to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        text.contains("[radix] cached tokens by tier: device "),
        "{text}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let t = &v[0]["tier_hit_tokens"];
    let sum: u64 = ["device", "host", "storage"]
        .iter()
        .map(|k| t[k].as_u64().unwrap())
        .sum();
    assert_eq!(sum, v[0]["cached_tokens"].as_u64().unwrap(), "{v}");
    assert!(sum > 0, "{v}");
}

#[test]
fn bad_hicache_flags_exit_with_code_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--hicache-write-policy", "sometimes"],
            "--hicache-write-policy",
        ),
        (
            &["--hicache-mem-layout", "diagonal"],
            "--hicache-mem-layout",
        ),
        (
            &["--hicache-storage-backend", "s3"],
            "--hicache-storage-backend",
        ),
        (
            &["--hicache-storage-prefetch-policy", "never"],
            "--hicache-storage-prefetch-policy",
        ),
        (
            &["--hicache-storage-backend-extra-config", "{\"bogus\": 1}"],
            "bogus",
        ),
        (
            &["--hicache-storage-backend-extra-config", "{not json"],
            "--hicache-storage-backend-extra-config",
        ),
        (&["--hicache-ratio=-1"], "hicache-ratio"),
        // More host memory than this machine has (or than slot ids can name).
        (&["--hicache-size", "100000"], "--hicache-size"),
        (&["--disable-radix-cache"], "--disable-radix-cache"),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["bench", "--quiet", "--enable-hierarchical-cache"];
        args.extend_from_slice(flags);
        let o = kvserve(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // An L3 store without the host tier it sits behind.
    let o = kvserve(&["bench", "--quiet", "--hicache-storage-backend", "file"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--enable-hierarchical-cache"));
}

/// Twelve clients at once, three rounds, prompts sharing three prefixes, on a device pool that
/// holds about two of them: load-backs, demotions and write-through copies interleave with
/// admission under pressure.
fn concurrent_rounds(extra: &[&str]) -> (Vec<Value>, common::Server) {
    let mut flags = vec!["--max-total-tokens", "768", "--page-size", "16"];
    flags.extend(extra);
    let srv = start(&flags);
    let port = srv.port;
    let mut outs = Vec::new();
    for round in 0..3u32 {
        let clients: Vec<_> = (0..12u32)
            .map(|k| {
                thread::spawn(move || {
                    let mut ids = prompt(400 + k % 3, 224);
                    ids.extend(prompt(500 + k + 12 * round, 16 + 16 * (k % 4)));
                    generate(port, &ids, 8)["output_ids"].clone()
                })
            })
            .collect();
        outs.extend(clients.into_iter().map(|c| c.join().unwrap()));
    }
    (outs, srv)
}

#[test]
fn concurrent_clients_get_the_same_tokens_and_leave_both_tiers_consistent() {
    let (want, _plain) = concurrent_rounds(&[]);
    for policy in ["write_through", "write_back"] {
        let (got, srv) = concurrent_rounds(&[
            "--enable-hierarchical-cache",
            "--hicache-write-policy",
            policy,
        ]);
        assert_eq!(got, want, "{policy}");
        assert_kv_freed(srv.port);
        let t = tiers(srv.port);
        assert!(t["host_hit_tokens"].as_u64().unwrap() > 0, "{policy}: {t}");
    }
}

#[test]
fn info_lists_the_hierarchical_cache_choices() {
    let o = kvserve(&["info"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    assert!(
        text.contains("hicache policies:   write_through, write_through_selective, write_back"),
        "{text}"
    );
    assert!(text.contains("hicache layouts:    layer_first, page_first, page_first_direct"));
    assert!(text.contains("hicache storage:    file, redis"), "{text}");
}
