//! `kvserve serve --backend wgpu`: the engine runs the tiny model on the wgpu backend (Mesa's
//! lavapipe in CI) through the same scheduler, cache, PD disaggregation and HTTP API as on the
//! CPU.
//!
//! Skips with a printed reason when no wgpu adapter exists, and fails instead when
//! `KVSERVE_REQUIRE_WGPU=1` (CI).
#![cfg(feature = "wgpu")]

mod common;

use common::pd::{assert_nothing_held, pair, send};
use common::{post, start, wait_idle};
use serde_json::json;

fn has_adapter() -> bool {
    attention_wgpu::test_support::backend_or_skip("engine wgpu_backend").is_some()
}

/// Greedy output of `max_new_tokens` tokens and the prompt's cached tokens. (Each forward of the
/// tiny model takes about half a second on lavapipe, Mesa's software Vulkan device in CI, so
/// the tests generate few tokens: the first from the prefill over the prompt's cached or
/// loaded-back KV, the rest from decode steps attending over it.)
fn greedy(port: u16, input_ids: &[u32], max_new_tokens: u32) -> (Vec<u64>, u64) {
    let (status, v) = post(
        port,
        "/generate",
        json!({
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": true
            }
        }),
    );
    assert_eq!(status, 200, "{v}");
    let ids = v["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (ids, v["meta_info"]["cached_tokens"].as_u64().unwrap())
}

/// Greedy tokens on wgpu equal the CPU backend's for the same prompts (the model crate's test
/// bounds the logits; these prompts have no near tie), cold and from the cache, and the pool is
/// consistent afterwards.
#[test]
fn wgpu_serves_the_same_greedy_tokens_as_the_cpu() {
    if !has_adapter() {
        return;
    }
    let prompts: Vec<Vec<u32>> = vec![
        (0..40).map(|i| 1000 + 7 * i).collect(),
        (0..70).map(|i| 20_000 + 13 * i).collect(),
    ];
    let cpu = start(&["--backend", "cpu"]);
    let want: Vec<Vec<u64>> = prompts.iter().map(|p| greedy(cpu.port, p, 4).0).collect();
    drop(cpu);

    let gpu = start(&["--backend", "wgpu"]);
    for (p, want) in prompts.iter().zip(&want) {
        let (cold, cached_cold) = greedy(gpu.port, p, 4);
        assert_eq!(&cold, want, "wgpu vs cpu, cold");
        assert_eq!(cached_cold, 0);
        let (warm, cached_warm) = greedy(gpu.port, p, 4);
        assert_eq!(&warm, want, "wgpu vs cpu, from the cache");
        assert!(
            cached_warm >= 32,
            "the repeat hits the cache: {cached_warm}"
        );
    }
    let info = wait_idle(gpu.port);
    assert_eq!(info["engine"]["ownership_ok"], true, "{info}");
}

/// HiCache on wgpu: two 160-token prompts take turns (twice each) on a 256-token device pool, so
/// each evicts the other and every reuse after the first pair comes back from the host tier through the
/// store's device-rows handle (kernels and readbacks on the device queue). Greedy tokens equal
/// those of the same server without the host tier, for a write-through and the write-back
/// policy and two host layouts; the host tier served the reuses, and both pools are
/// consistent afterwards.
#[test]
fn wgpu_hicache_loads_back_from_host_with_the_same_greedy_tokens() {
    if !has_adapter() {
        return;
    }
    let a: Vec<u32> = (0..160).map(|i| 100 + (7919 + i * 31) % 30000).collect();
    let b: Vec<u32> = (0..160)
        .map(|i| 100 + (2 * 7919 + i * 31) % 30000)
        .collect();
    let run = |extra: &[&str]| {
        let mut flags = vec![
            "--backend",
            "wgpu",
            "--max-total-tokens",
            "256",
            "--page-size",
            "16",
        ];
        flags.extend_from_slice(extra);
        let srv = start(&flags);
        let outs: Vec<Vec<u64>> = (0..4)
            .map(|turn| greedy(srv.port, if turn % 2 == 0 { &a } else { &b }, 2).0)
            .collect();
        let info = wait_idle(srv.port);
        assert_eq!(info["engine"]["ownership_ok"], true, "{extra:?}: {info}");
        (outs, info["engine"]["hicache"].clone())
    };
    let (want, _) = run(&[]);
    for (policy, layout) in [
        ("write_through", "layer_first"),
        ("write_back", "page_first"),
    ] {
        let (got, tiers) = run(&[
            "--enable-hierarchical-cache",
            "--hicache-write-policy",
            policy,
            "--hicache-mem-layout",
            layout,
        ]);
        assert_eq!(got, want, "{policy} {layout}");
        assert!(
            tiers["host_hit_tokens"].as_u64().unwrap() >= 2 * 144,
            "{policy} {layout}: {tiers}"
        );
    }
}

/// Prompts whose greedy tokens on wgpu equal the CPU's (no near tie): 40 and 70 tokens.
fn pd_prompts() -> Vec<Vec<u32>> {
    vec![
        (0..40).map(|i| 1000 + 7 * i).collect(),
        (0..70).map(|i| 20_000 + 13 * i).collect(),
    ]
}

/// PD with a KV store on the device: a prefill and a decode server, each on `prefill_backend`
/// / `decode_backend`, over `transfer`, give one CPU server's greedy tokens. A wgpu server moves
/// its KV through a host mirror of its store (staged from the device before each send, copied
/// to the device when a transfer lands), so the pair also mixes backends: the pages are the
/// same bytes in the same layout. A repeat of the longer prompt hits the decode side's cache
/// and moves only its last page, which must land next to the cached ones on the device.
fn pd_pair_with_a_device_store(transfer: &str, prefill_backend: &str, decode_backend: &str) {
    let prompts = pd_prompts();
    let cpu = start(&["--backend", "cpu"]);
    let want: Vec<Vec<u64>> = prompts.iter().map(|p| greedy(cpu.port, p, 3).0).collect();
    drop(cpu);
    let p = pair(
        transfer,
        &["--backend", prefill_backend],
        &["--backend", decode_backend],
    );
    let what = format!("{transfer}: prefill on {prefill_backend}, decode on {decode_backend}");
    let body = |ids: &[u32]| json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": true}});
    let ids_of = |v: &serde_json::Value| -> Vec<u64> {
        v["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    for (i, ids) in prompts.iter().enumerate() {
        let ((ps, pr), (ds, dr)) = send(&p, "/generate", &body(ids), 500 + i as u64);
        assert_eq!(ps, 200, "{what}: prefill: {pr}");
        assert_eq!(ds, 200, "{what}: decode: {dr}");
        assert_eq!(ids_of(&dr), want[i], "{what}: prompt {i}");
        assert_eq!(
            ids_of(&pr),
            want[i][..1],
            "{what}: prompt {i}, prefill's token"
        );
    }
    let ((ps, pr), (ds, dr)) = send(&p, "/generate", &body(&prompts[1]), 600);
    assert_eq!(ps, 200, "{what}: prefill: {pr}");
    assert_eq!(ds, 200, "{what}: decode: {dr}");
    assert_eq!(ids_of(&dr), want[1], "{what}: the repeat");
    assert!(
        dr["meta_info"]["cached_tokens"].as_u64().unwrap() >= 64,
        "{what}: the repeat hits the decode side's cache: {dr}"
    );
    assert_nothing_held(&p);
}

#[test]
fn wgpu_pd_pair_over_tcp_serves_the_cpu_greedy_tokens() {
    if !has_adapter() {
        return;
    }
    pd_pair_with_a_device_store("tcp", "wgpu", "wgpu");
}

#[test]
fn wgpu_pd_decode_over_shm_lands_a_cpu_prefill_s_kv() {
    if !has_adapter() {
        return;
    }
    pd_pair_with_a_device_store("shm", "cpu", "wgpu");
}

#[test]
fn wgpu_pd_prefill_sends_its_kv_to_a_cpu_decode() {
    if !has_adapter() {
        return;
    }
    pd_pair_with_a_device_store("tcp", "wgpu", "cpu");
}
