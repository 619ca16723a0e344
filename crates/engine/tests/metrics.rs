//! `/metrics` (Prometheus text: every sample under a `# HELP` / `# TYPE` family, counters
//! that move with requests, cumulative histogram buckets that end at `_count`) and `--api-key`
//! (every endpoint but `/health` refused without the key, with an OpenAI-style 401).

mod common;

use std::collections::HashMap;

use common::{http, http_with, post, start, wait_idle};
use serde_json::{json, Value};

/// The samples of an exposition, by name with labels (`name{k="v"}`), after checking that
/// each belongs to a family declared with `# HELP` and `# TYPE`.
fn parse(text: &str) -> HashMap<String, f64> {
    let mut help = HashMap::new();
    let mut kinds: HashMap<&str, &str> = HashMap::new();
    let mut samples = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').unwrap();
            assert!(!h.is_empty(), "{line}");
            help.insert(name, h);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(help.contains_key(name), "TYPE before HELP: {line}");
            kinds.insert(name, kind);
        } else {
            let (key, value) = line.rsplit_once(' ').unwrap();
            let name = key.split('{').next().unwrap();
            assert!(name.starts_with("kvserve:"), "{line}");
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| kinds.get(f) == Some(&"histogram"))
                })
                .unwrap_or(name);
            assert!(kinds.contains_key(family), "no # TYPE for {line}");
            let v: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            assert!(v.is_finite() && v >= 0.0, "{line}");
            samples.insert(key.to_string(), v);
        }
    }
    samples
}

/// A histogram's buckets (bound, cumulative count), checked: increasing bounds, non-decreasing
/// counts, `+Inf` last and equal to `_count`. Returns `_count`.
fn histogram(m: &HashMap<String, f64>, name: &str) -> f64 {
    let prefix = format!("kvserve:{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = m
        .iter()
        .filter_map(|(k, &v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            Some((
                if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                },
                v,
            ))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(buckets.len() > 5, "{name}: {buckets:?}");
    assert!(
        buckets.windows(2).all(|w| w[0].1 <= w[1].1),
        "not cumulative: {name} {buckets:?}"
    );
    let count = m[&format!("kvserve:{name}_count")];
    let (last_le, last) = *buckets.last().unwrap();
    assert!(last_le.is_infinite());
    assert_eq!(last, count, "{name}: +Inf bucket != _count");
    assert!(m[&format!("kvserve:{name}_sum")] >= 0.0);
    count
}

fn metrics(port: u16, headers: &[(&str, &str)]) -> HashMap<String, f64> {
    let (status, text) = http_with(port, "GET", "/metrics", headers, "");
    assert_eq!(status, 200, "{text}");
    parse(&text)
}

#[test]
fn metrics_parse_and_move_with_requests() {
    let srv = start(&[]);
    let before = metrics(srv.port, &[]);
    assert_eq!(before["kvserve:num_requests_total"], 0.0);
    assert_eq!(histogram(&before, "time_to_first_token_seconds"), 0.0);
    assert!(before["kvserve:max_total_num_tokens"] > 0.0);

    // Three requests of 40 prompt tokens, two of them the same prompt.
    let a: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    let b: Vec<u32> = (0..40).map(|i| 3000 + i).collect();
    let mut completion = 0.0;
    for (path, body) in [
        (
            "/generate",
            json!({"input_ids": a, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": true}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": a, "max_tokens": 7, "temperature": 0, "ignore_eos": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": b, "max_tokens": 3, "temperature": 0, "ignore_eos": true, "stream": true}),
        ),
    ] {
        let (status, text) = http(srv.port, "POST", path, &body.to_string());
        assert_eq!(status, 200, "{text}");
    }
    completion += 5.0 + 7.0 + 3.0;
    // A rejected one (the prompt is too long) is not submitted; a refusal by the engine is.
    assert_eq!(
        post(
            srv.port,
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": 0})
        )
        .0,
        400
    );
    wait_idle(srv.port);
    let m = metrics(srv.port, &[]);
    assert_eq!(m["kvserve:num_requests_total"], 3.0);
    assert_eq!(
        m["kvserve:num_finished_requests_total{finish_reason=\"length\"}"],
        3.0
    );
    assert_eq!(
        m["kvserve:num_finished_requests_total{finish_reason=\"stop\"}"],
        0.0
    );
    assert_eq!(m["kvserve:num_aborted_requests_total"], 0.0);
    assert_eq!(m["kvserve:num_running_reqs"], 0.0);
    assert_eq!(m["kvserve:num_queue_reqs"], 0.0);
    assert_eq!(m["kvserve:prompt_tokens_total"], 120.0);
    assert_eq!(m["kvserve:generation_tokens_total"], completion);
    assert!(m["kvserve:cached_tokens_total"] >= 32.0, "{m:?}");
    let hit = m["kvserve:cache_hit_rate"];
    assert!((hit - m["kvserve:cached_tokens_total"] / 120.0).abs() < 1e-9);
    let usage = m["kvserve:token_usage"];
    assert!(
        usage > 0.0 && usage <= 1.0,
        "the cache holds the prompts: {usage}"
    );
    assert_eq!(
        usage,
        m["kvserve:num_used_tokens"] / m["kvserve:max_total_num_tokens"]
    );
    assert!(m["kvserve:gen_throughput"] > 0.0);
    assert_eq!(histogram(&m, "time_to_first_token_seconds"), 3.0);
    assert_eq!(histogram(&m, "e2e_request_latency_seconds"), 3.0);
    // Every token after a request's first is one inter-token interval.
    assert_eq!(
        histogram(&m, "inter_token_latency_seconds"),
        completion - 3.0
    );
}

#[test]
fn the_api_key_is_required_everywhere_but_health() {
    let srv = start(&["--api-key", "sk-secret"]);
    let port = srv.port;
    let good = [("Authorization", "Bearer sk-secret")];
    assert_eq!(http(port, "GET", "/health", "").0, 200);
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2}).to_string();
    for (method, path, body) in [
        ("GET", "/v1/models", ""),
        ("GET", "/metrics", ""),
        ("GET", "/get_model_info", ""),
        ("GET", "/get_server_info", ""),
        ("POST", "/flush_cache", "{}"),
        ("POST", "/v1/completions", body.as_str()),
        ("POST", "/generate", r#"{"input_ids": [1, 2]}"#),
    ] {
        for headers in [
            &[][..],
            &[("Authorization", "Bearer sk-wrong")][..],
            &[("Authorization", "sk-secret")][..],
            &[("Authorization", "Bearer sk-secre")][..],
        ] {
            let (status, text) = http_with(port, method, path, headers, body);
            assert_eq!(status, 401, "{path} {headers:?}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            assert!(v["error"]["param"].is_null());
            assert!(!v["error"]["message"].as_str().unwrap().is_empty());
        }
        let (status, text) = http_with(port, method, path, &good, body);
        assert_eq!(status, 200, "{path}: {text}");
    }
    // Refused requests never reached the engine.
    assert_eq!(metrics(port, &good)["kvserve:num_requests_total"], 2.0);
}
