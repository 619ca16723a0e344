//! `kvserve serve` on loopback: /generate (plain, batch, streaming), the info endpoints, bad
//! input (4xx with a JSON error, other requests undisturbed), a full queue (503), a client that
//! disconnects mid-stream (its request aborted, its KV freed), greedy output equal with the
//! cache cold, warm and disabled, and concurrent clients with shared prefixes.

mod common;

use common::{assert_kv_freed, disconnect_mid_stream, get, http, post, sse_data, start, wait_idle};
use serde_json::{json, Value};

#[test]
fn generate_plain_batch_and_streaming() {
    let srv = start(&[]);
    assert_eq!(http(srv.port, "GET", "/health", "").0, 200);
    assert_eq!(get(srv.port, "/v1/models")["data"][0]["id"], "tiny");
    assert_eq!(get(srv.port, "/get_model_info")["vocab_size"], 50257);

    let (status, r) = post(
        srv.port,
        "/generate",
        json!({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["output_ids"].as_array().unwrap().len(), 8);
    assert_eq!(r["meta_info"]["completion_tokens"], 8);
    assert_eq!(r["meta_info"]["finish_reason"]["type"], "length");
    assert!(r["text"].is_string());
    let prompt_tokens = r["meta_info"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 0);

    let (status, b) = post(
        srv.port,
        "/generate",
        json!({"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{b}");
    assert_eq!(b.as_array().unwrap().len(), 2);
    assert_eq!(b[1]["meta_info"]["prompt_tokens"], 4);

    let (status, text) = http(srv.port, "POST", "/generate", &json!({"text": "The capital of France is", "stream": true, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}).to_string());
    assert_eq!(status, 200);
    let chunks = sse_data(&text);
    assert_eq!(*chunks.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(chunks[chunks.len() - 2]).unwrap();
    assert_eq!(
        last["output_ids"], r["output_ids"],
        "streaming gives the same greedy tokens"
    );
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    // The second run of the same prompt came from the cache.
    assert!(last["meta_info"]["cached_tokens"].as_u64().unwrap() > 0 || prompt_tokens < 16);
}

#[test]
fn greedy_output_is_the_same_cold_warm_chunked_and_without_the_cache() {
    let body = json!({"input_ids": (0..120u32).map(|i| 500 + i * 3).collect::<Vec<_>>(), "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}});
    let mut outs = Vec::new();
    for flags in [
        &[][..],
        &["--chunked-prefill-size", "16"][..],
        &["--disable-radix-cache"][..],
    ] {
        let srv = start(flags);
        for _ in 0..2 {
            let (status, r) = post(srv.port, "/generate", body.clone());
            assert_eq!(status, 200, "{r}");
            outs.push(r["output_ids"].clone());
        }
    }
    assert!(outs.iter().all(|o| *o == outs[0]), "{outs:?}");
}

#[test]
fn bad_input_is_a_4xx_json_error_and_disturbs_nothing() {
    let srv = start(&["--context-length", "256"]);
    let cases = [
        (r#"{"text": "#.to_string(), "EOF"),
        (json!({"text": ""}).to_string(), "empty"),
        (json!({"text": 42}).to_string(), ""),
        (json!({}).to_string(), "text or input_ids"),
        (
            json!({"input_ids": [1, 99999999]}).to_string(),
            "vocabulary",
        ),
        (
            json!({"input_ids": vec![1u32; 300]}).to_string(),
            "context length",
        ),
        (
            json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}).to_string(),
            "max_new_tokens",
        ),
        (
            json!({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}).to_string(),
            "temperature",
        ),
        (
            json!({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}).to_string(),
            "top_k",
        ),
        (
            json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}).to_string(),
            "",
        ),
        (
            json!({"input_ids": [1, 2], "bogus": 1}).to_string(),
            "bogus",
        ),
    ];
    for (body, needle) in cases {
        let (status, text) = http(srv.port, "POST", "/generate", &body);
        assert!((400..500).contains(&status), "{body}: {status} {text}");
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{body}: not JSON: {text}"));
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let (status, _) = post(
        srv.port,
        "/generate",
        json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(status, 200, "the server still serves");
    assert_eq!(wait_idle(srv.port)["engine"]["ownership_ok"], true);
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_kv() {
    let srv = start(&[]);
    let body = json!({"input_ids": (0..64u32).collect::<Vec<_>>(), "stream": true, "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": true}}).to_string();
    disconnect_mid_stream(srv.port, "/generate", &body);
    assert_kv_freed(srv.port);
}

#[test]
fn concurrent_clients_with_shared_prefixes_leave_a_consistent_pool() {
    let srv = start(&[]);
    let port = srv.port;
    // Warm the shared prefix, then 64 clients at once (requests admitted in one batch would
    // otherwise all compute it together, before any of them cached it).
    let warm: Vec<u32> = (0..96).map(|t| 1000 + t).collect();
    assert_eq!(
        post(
            port,
            "/generate",
            json!({"input_ids": warm, "sampling_params": {"max_new_tokens": 1}})
        )
        .0,
        200
    );
    let clients: Vec<_> = (0..64)
        .map(|i| {
            std::thread::spawn(move || {
                let mut ids: Vec<u32> = (0..96).map(|t| 1000 + t).collect();
                ids.extend([2000 + i, 2001 + i]);
                post(port, "/generate", json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}}))
            })
        })
        .collect();
    let mut cached = 0;
    for c in clients {
        let (status, r) = c.join().unwrap();
        assert_eq!(status, 200, "{r}");
        cached += r["meta_info"]["cached_tokens"].as_u64().unwrap();
    }
    assert!(
        cached >= 64 * 96,
        "every client reused the 96-token prefix: {cached}"
    );
    let info = wait_idle(port);
    let e = &info["engine"];
    assert_eq!(e["ownership_ok"], true);
    assert_eq!(e["protected_tokens"], 0);
    // Used tokens equal the tree's size when idle.
    assert_eq!(
        e["total_tokens"].as_u64().unwrap() - e["available_tokens"].as_u64().unwrap(),
        e["evictable_tokens"].as_u64().unwrap()
    );
    assert_eq!(post(port, "/flush_cache", json!({})).0, 200);
    assert_eq!(
        get(port, "/get_server_info")["engine"]["evictable_tokens"],
        0
    );
}

#[test]
fn a_full_queue_is_a_503() {
    let srv = start(&["--max-queued-requests", "1", "--max-running-requests", "1"]);
    let port = srv.port;
    let long = |_| {
        std::thread::spawn(move || {
            post(
                port,
                "/generate",
                json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": true, "temperature": 0}}),
            )
        })
    };
    let running: Vec<_> = (0..4).map(long).collect();
    let statuses: Vec<u16> = running.into_iter().map(|h| h.join().unwrap().0).collect();
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(
        statuses.contains(&503),
        "with one running and one queued, the rest are refused: {statuses:?}"
    );
}

/// `ignore_eos` ignores only EOS (SGLang): the request's own `stop_token_ids` still stop it,
/// and the text is the decoded output up to the stop token.
#[test]
fn ignore_eos_keeps_the_requests_own_stop_tokens() {
    let srv = start(&[]);
    let prompt: Vec<u32> = (0..24).map(|i| 300 + 11 * i).collect();
    let (status, free) = post(
        srv.port,
        "/generate",
        json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{free}");
    let ids: Vec<u64> = free["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // Stop on the first generated token (the tiny preset often repeats it, so it is the one
    // token sure to come).
    let k = 0;
    let (status, stopped) = post(
        srv.port,
        "/generate",
        json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true, "stop_token_ids": [ids[k]]}}),
    );
    assert_eq!(status, 200, "{stopped}");
    let got: Vec<u64> = stopped["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, ids[..=k], "{stopped}");
    assert_eq!(
        stopped["meta_info"]["finish_reason"]["type"], "stop",
        "{stopped}"
    );
}

/// `--config` gives the server its flags (the command line wins), and `/get_server_info`
/// reports the effective settings under SGLang's names.
#[test]
fn config_file_settings_show_in_server_info() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("serve-info.toml");
    std::fs::write(
        &path,
        "page-size = 8\nschedule-policy = \"lpm\"\nmax-total-tokens = 8192\nradix-eviction-policy = \"slru\"\nmax-running-requests = 7\ncuda-graph-max-bs = 4\n",
    )
    .unwrap();
    let srv = start(&[
        "--config",
        path.to_str().unwrap(),
        "--max-running-requests",
        "9",
    ]);
    let info = get(srv.port, "/get_server_info");
    assert_eq!(info["page_size"], 8, "{info}");
    assert_eq!(info["schedule_policy"], "lpm", "{info}");
    assert_eq!(info["radix_eviction_policy"], "slru", "{info}");
    assert_eq!(info["max_total_num_tokens"], 8192, "{info}");
    assert_eq!(
        info["max_running_requests"], 9,
        "the command line wins: {info}"
    );
    assert_eq!(info["backend"], "cpu", "{info}");
    assert_eq!(info["disable_radix_cache"], false, "{info}");
    assert_eq!(info["engine"]["total_tokens"], 8192, "{info}");
    // Accepted and ignored on the cpu backend, which has no graphs.
    assert_eq!(info["cuda_graph_max_bs"], 4, "{info}");
    assert_eq!(info["disable_cuda_graph"], false, "{info}");
    assert_eq!(info["cuda_graph_bs"], json!([]), "{info}");
    assert_eq!(info["cuda_graph_memory_bytes"], json!(0), "{info}");
}

/// SGLang's `extra_key`: a prompt cached under one key is not found under another, nor without
/// a key (its own namespace); the output does not depend on the namespace; a repeat under the
/// same key hits. A key that is not a non-empty string of at most 256 bytes is a 400 naming it.
#[test]
fn extra_key_namespaces_the_prefix_cache() {
    let srv = start(&[]);
    let ids: Vec<u32> = (0..40u32).map(|i| 700 + i * 7).collect();
    let run = |key: Option<&str>| {
        let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}});
        if let Some(k) = key {
            body["extra_key"] = json!(k);
        }
        let (status, r) = post(srv.port, "/generate", body);
        assert_eq!(status, 200, "{r}");
        let cached = r["meta_info"]["cached_tokens"].as_u64().unwrap();
        (cached, r["output_ids"].clone())
    };
    let (cached, first) = run(Some("tenant-a"));
    assert_eq!(cached, 0);
    let (cached, out) = run(Some("tenant-b"));
    assert_eq!(cached, 0, "another key shares nothing");
    assert_eq!(out, first, "the same greedy output in every namespace");
    let (cached, out) = run(None);
    assert_eq!(cached, 0, "no key is a namespace of its own");
    assert_eq!(out, first);
    for key in [Some("tenant-a"), Some("tenant-b"), None] {
        let (cached, out) = run(key);
        assert_eq!(cached, 32, "{key:?}: a repeat hits its two whole pages");
        assert_eq!(out, first);
    }
    for bad in [json!(7), json!(["a"]), json!(""), json!("k".repeat(257))] {
        let (status, r) = post(
            srv.port,
            "/generate",
            json!({"input_ids": [1, 2, 3], "extra_key": bad}),
        );
        assert_eq!(status, 400, "{bad}: {r}");
        assert_eq!(r["error"]["param"], "extra_key", "{r}");
    }
    assert_kv_freed(srv.port);
}
