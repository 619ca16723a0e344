//! `kvserve serve --backend wgpu`: the engine runs the tiny model on the wgpu backend (Mesa's
//! lavapipe in CI) through the same scheduler, cache and HTTP API as on the CPU.
//!
//! Skips with a printed reason when no wgpu adapter exists, and fails instead when
//! `KVSERVE_REQUIRE_WGPU=1` (CI).
#![cfg(feature = "wgpu")]

mod common;

use common::{post, start, wait_idle};
use serde_json::json;

fn has_adapter() -> bool {
    attention_wgpu::test_support::backend_or_skip("engine wgpu_backend").is_some()
}

fn greedy(port: u16, input_ids: &[u32]) -> (Vec<u64>, u64) {
    let (status, v) = post(
        port,
        "/generate",
        json!({
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}
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
    let want: Vec<Vec<u64>> = prompts.iter().map(|p| greedy(cpu.port, p).0).collect();
    drop(cpu);

    let gpu = start(&["--backend", "wgpu"]);
    for (p, want) in prompts.iter().zip(&want) {
        let (cold, cached_cold) = greedy(gpu.port, p);
        assert_eq!(&cold, want, "wgpu vs cpu, cold");
        assert_eq!(cached_cold, 0);
        let (warm, cached_warm) = greedy(gpu.port, p);
        assert_eq!(&warm, want, "wgpu vs cpu, from the cache");
        assert!(
            cached_warm >= 32,
            "the repeat hits the cache: {cached_warm}"
        );
    }
    let info = wait_idle(gpu.port);
    assert_eq!(info["engine"]["ownership_ok"], true, "{info}");
}
