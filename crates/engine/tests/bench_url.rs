//! `kvserve bench --url` against `kvserve serve` on loopback: the remote run sees the same
//! requests, tokens and cache hits that the server reports.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{http_with, start};

fn bench_url(port: u16, extra: &[&str]) -> (std::process::Output, serde_json::Value) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let json = dir.join(format!("bench-url-{port}.json"));
    let png = dir.join(format!("bench-url-{port}.png"));
    let url = format!("http://127.0.0.1:{port}");
    let mut args = vec![
        "bench",
        "--url",
        &url,
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        png.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args(&args)
        .output()
        .unwrap();
    let v = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    (o, v)
}

#[test]
fn a_shared_prefix_workload_over_http_reports_the_servers_cache_hits() {
    let server = start(&["--api-key", "sk-bench"]);
    let (o, v) = bench_url(
        server.port,
        &[
            "--api-key",
            "sk-bench",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "4",
            "--gsp-system-prompt-len",
            "64",
            "--gsp-question-len",
            "8",
            "--gsp-output-len",
            "3",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "2",
            "--vocab-size",
            "50000",
            "--warmup-requests",
            "0",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("[remote] 8 requests (0 aborted)"), "{text}");
    assert_eq!(v[0]["cache"], "remote");
    assert_eq!(v[0]["prompt_tokens"], 8 * 72);
    assert_eq!(v[0]["output_tokens"], 8 * 3);
    // With two at a time, every request after the first of its group can reuse the 64-token
    // system prompt (4 pages of 16); the server's own counter agrees with what usage reported.
    let cached = v[0]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 64, "{v}");
    assert!(cached <= 6 * 64, "{v}");
    assert!(v[0]["ttft_p50_s"].as_f64().unwrap() > 0.0);
    let (status, info) = http_with(
        server.port,
        "GET",
        "/get_server_info",
        &[("Authorization", "Bearer sk-bench")],
        "",
    );
    assert_eq!(status, 200, "{info}");
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["engine"]["cached_tokens"].as_u64(),
        Some(cached),
        "{info}"
    );
    assert_eq!(info["engine"]["ownership_ok"], true, "{info}");
}

/// `--warmup-requests 2`: two copies of the first request (at most 16 output tokens) reach the
/// server before the timed run and stay out of the bench's figures.
#[test]
fn warmup_requests_reach_the_server_and_stay_out_of_the_figures() {
    let server = start(&[]);
    let (o, v) = bench_url(
        server.port,
        &[
            "--workload",
            "random",
            "--num-prompts",
            "3",
            "--random-input-len",
            "24",
            "--random-output-len",
            "20",
            "--random-range-ratio",
            "1",
            "--request-rate",
            "inf",
            "--warmup-requests",
            "2",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(v[0]["requests"], 3, "{v}");
    assert_eq!(v[0]["prompt_tokens"], 3 * 24, "{v}");
    assert_eq!(v[0]["output_tokens"], 3 * 20, "{v}");
    let (status, info) = http_with(server.port, "GET", "/get_server_info", &[], "");
    assert_eq!(status, 200, "{info}");
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["engine"]["prompt_tokens"], 5 * 24, "{info}");
    assert_eq!(info["engine"]["output_tokens"], 3 * 20 + 2 * 16, "{info}");
}

#[test]
fn a_bad_key_or_a_dead_server_is_a_clean_error() {
    let server = start(&["--api-key", "sk-right"]);
    let (o, _) = bench_url(
        server.port,
        &["--api-key", "sk-wrong", "--num-prompts", "2"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--url") && err.contains("401"), "{err}");
    drop(server);
    let (o, _) = bench_url(1, &["--num-prompts", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--url"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
