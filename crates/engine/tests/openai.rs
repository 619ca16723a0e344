//! The OpenAI-compatible endpoints on loopback: `/v1/completions` and `/v1/chat/completions`
//! plain and streaming (chunk shapes, the role chunk, the finish chunk, the usage chunk,
//! `[DONE]`), `usage.prompt_tokens_details.cached_tokens` on a repeated prompt, prompt forms
//! and `echo`, stop strings, every kind of bad input (a 4xx with an OpenAI error body naming
//! the field), a full queue (503), a client that disconnects mid-stream (its request aborted,
//! its KV freed), and the official `openai` Python client against the `kvserve` binary.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_kv_freed, disconnect_mid_stream, get, http, post, sse_data, start, wait_idle};
use serde_json::{json, Value};

/// A streamed response: its chunks (parsed) and whether it ended with `[DONE]`.
fn stream(port: u16, path: &str, body: Value) -> Vec<Value> {
    let (status, text) = http(port, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn usage_is_consistent(u: &Value) {
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap(),
        "{u}"
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64(), "{u}");
}

/// A repeated prompt: `usage` reports tokens served from the cache.
fn assert_cache_hit(usage: &Value, why: &str) {
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.unwrap() > 0, "{why}: {usage}");
}

#[test]
fn completions_plain_and_streaming() {
    let srv = start(&[]);
    // Longer than two pages of 16, so that a repeat finds whole pages in the cache.
    let prompt = "The quick brown fox jumps over the lazy dog because it was in a hurry to get home before the rain started, and the dog, being lazy, did not mind at all.";
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, r) = post(srv.port, "/v1/completions", body.clone());
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"), "{r}");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["model"], "tiny");
    assert!(r["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &r["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    let text = choice["text"].as_str().unwrap().to_string();
    let u = &r["usage"];
    usage_is_consistent(u);
    assert_eq!(u["completion_tokens"], 8);

    // The same greedy tokens as /generate.
    let (_, g) = post(
        srv.port,
        "/generate",
        json!({"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(g["text"], text.as_str());

    // Streaming: text deltas, a finish chunk, a usage chunk; the prompt is cached by now.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let chunks = stream(srv.port, "/v1/completions", sbody);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    usage_is_consistent(&usage_chunk["usage"]);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 8);
    assert_cache_hit(&usage_chunk["usage"], "the repeated completion prompt");
    let mut streamed = String::new();
    for c in rest {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], rest[0]["id"]);
        assert!(c["usage"].is_null(), "usage only in the last chunk: {c}");
        streamed += c["choices"][0]["text"].as_str().unwrap();
    }
    assert_eq!(streamed, text);
    let last = rest.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(rest[..rest.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // Without include_usage: no usage chunk, no usage field.
    let mut plain = body;
    plain["stream"] = json!(true);
    let chunks = stream(srv.port, "/v1/completions", plain);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[test]
fn chat_completions_plain_and_streaming() {
    let srv = start(&[]);
    assert_eq!(
        get(srv.port, "/get_model_info")["chat_template"]["source"],
        "fallback"
    );
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
    ]);
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (status, r) = post(srv.port, "/v1/chat/completions", body.clone());
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"), "{r}");
    assert_eq!(r["object"], "chat.completion");
    let choice = &r["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    usage_is_consistent(&r["usage"]);
    assert_eq!(r["usage"]["completion_tokens"], 6);

    // The same prompt again, streamed: role chunk, content deltas, finish chunk, usage chunk.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let chunks = stream(srv.port, "/v1/chat/completions", sbody);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_cache_hit(&usage_chunk["usage"], "the repeated chat, streamed");
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens"],
        r["usage"]["prompt_tokens"]
    );
    let streamed: String = rest
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    let finish = rest.last().unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(finish["choices"][0]["delta"], json!({}));

    // The non-streamed repeat reports the cache hit too.
    let (_, again) = post(srv.port, "/v1/chat/completions", body);
    assert_cache_hit(&again["usage"], "the repeated chat");
}

#[test]
fn prompt_forms_echo_and_stop_strings() {
    let srv = start(&[]);
    let port = srv.port;
    let complete = |body: Value| {
        let (status, r) = post(port, "/v1/completions", body);
        assert_eq!(status, 200, "{r}");
        r
    };
    // Token ids, a batch of texts, a batch of token-id lists.
    let r = complete(json!({"prompt": [464, 2068, 7586], "max_tokens": 3, "temperature": 0}));
    assert_eq!(r["usage"]["prompt_tokens"], 3);
    let r = complete(
        json!({"prompt": ["Hello", "Goodbye, world"], "max_tokens": 2, "temperature": 0, "ignore_eos": true}),
    );
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].clone(), choices[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(r["usage"]["completion_tokens"], 4);
    let r = complete(
        json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r["usage"]["prompt_tokens"], 5);
    // Echo puts the prompt before the completion.
    let r = complete(json!({"prompt": "Echo me", "echo": true, "max_tokens": 2, "temperature": 0}));
    assert!(r["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("Echo me"));

    // Stop strings: pick one from the greedy output, then generation ends right before it,
    // streamed or not.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let full = complete(body.clone())["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    assert!(chars.len() > 12, "{full:?}");
    let (a, b) = (chars[chars.len() / 2].0, chars[chars.len() / 2 + 3].0);
    let stop = &full[a..b];
    let expected = &full[..full.find(stop).unwrap()];
    let mut with_stop = body.clone();
    with_stop["stop"] = json!([stop, "never appears \u{1F600}"]);
    let r = complete(with_stop.clone());
    assert_eq!(
        r["choices"][0]["text"], expected,
        "stop {stop:?} in {full:?}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    with_stop["stream"] = json!(true);
    let chunks = stream(port, "/v1/completions", with_stop);
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, expected);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    assert_kv_freed(port);
}

#[test]
fn bad_input_is_a_4xx_openai_error_naming_the_field() {
    let srv = start(&["--context-length", "256"]);
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, String, u16, &str, Option<&str>)> = vec![
        (c, r#"{"prompt": "#.into(), 400, "not valid JSON", None),
        (chat, r#"{"messages": ["#.into(), 400, "not valid JSON", None),
        (c, json!({"prompt": 42}).to_string(), 400, "expected a string", Some("prompt")),
        (c, json!({"prompt": "x", "max_tokens": "many"}).to_string(), 400, "invalid type", Some("max_tokens")),
        (c, json!({"prompt": "x", "temperature": "hot"}).to_string(), 400, "invalid type", Some("temperature")),
        (chat, json!({"messages": "hi"}).to_string(), 400, "invalid type", Some("messages")),
        (chat, json!({"messages": [{"role": "user", "content": 7}]}).to_string(), 400, "expected a string", Some("messages[0].content")),
        (c, json!({"prompt": ""}).to_string(), 400, "empty", Some("prompt")),
        (c, json!({"prompt": []}).to_string(), 400, "empty", Some("prompt")),
        (c, json!({}).to_string(), 400, "required", Some("prompt")),
        (chat, json!({"messages": []}).to_string(), 400, "empty", Some("messages")),
        (chat, json!({}).to_string(), 400, "required", Some("messages")),
        (c, json!({"prompt": vec![1u32; 300]}).to_string(), 400, "context length", Some("prompt")),
        (c, json!({"prompt": [1, 2], "max_tokens": 0}).to_string(), 400, "max_tokens", Some("max_tokens")),
        (c, json!({"prompt": [1, 2], "max_tokens": 1000}).to_string(), 400, "max_tokens must be in 1..=254", Some("max_tokens")),
        (chat, json!({"messages": user, "max_completion_tokens": 0}).to_string(), 400, "max_completion_tokens", Some("max_completion_tokens")),
        (c, json!({"prompt": [1, 99999999]}).to_string(), 400, "vocabulary", Some("prompt")),
        (c, json!({"prompt": [1, -3]}).to_string(), 400, "expected a string", Some("prompt")),
        (c, json!({"prompt": [1], "stop_token_ids": [70000]}).to_string(), 400, "vocabulary", Some("stop_token_ids")),
        (c, json!({"prompt": [1], "top_p": 0}).to_string(), 400, "top_p", Some("top_p")),
        (c, json!({"prompt": [1], "frequency_penalty": 3}).to_string(), 400, "frequency_penalty", Some("frequency_penalty")),
        (c, json!({"prompt": [1], "stop": [""]}).to_string(), 400, "empty", Some("stop")),
        (c, json!({"prompt": [1], "stop": vec!["x"; 65]}).to_string(), 400, "at most 64 stop strings", Some("stop")),
        (c, json!({"prompt": [1], "stop": ["y".repeat(1025)]}).to_string(), 400, "at most 1024 bytes", Some("stop")),
        (c, json!({"prompt": [1], "n": 2}).to_string(), 400, "n > 1", Some("n")),
        (c, json!({"prompt": [1], "logprobs": 1}).to_string(), 400, "logprobs are not supported", Some("logprobs")),
        (chat, json!({"messages": user, "logprobs": true}).to_string(), 400, "logprobs are not supported", Some("logprobs")),
        (chat, json!({"messages": user, "top_logprobs": 2}).to_string(), 400, "logprobs are not supported", Some("top_logprobs")),
        (c, json!({"prompt": [1], "bogus": 1}).to_string(), 400, "unknown field `bogus`", Some("bogus")),
        (c, json!({"prompt": [1], "messages": user}).to_string(), 400, "belongs to /v1/chat/completions", Some("messages")),
        (chat, json!({"messages": user, "prompt": "x"}).to_string(), 400, "belongs to /v1/completions", Some("prompt")),
        (chat, json!({"messages": [{"role": "tool", "content": "x"}]}).to_string(), 400, "not supported", Some("messages[0].role")),
        (chat, json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).to_string(), 400, "only text", Some("messages[0].content[0].type")),
        (c, json!({"prompt": [1], "stream_options": {"include_usage": true}}).to_string(), 400, "only allowed when stream", Some("stream_options")),
        (c, json!({"prompt": ["a", "b"], "stream": true}).to_string(), 400, "one prompt", Some("prompt")),
    ];
    for (path, body, status, needle, param) in cases {
        let (got, text) = http(srv.port, "POST", path, &body);
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{body}: not JSON: {text}"));
        assert_eq!(got, status, "{path} {body}: {text}");
        let e = &v["error"];
        for key in ["message", "type", "param", "code"] {
            assert!(e.get(key).is_some(), "{body}: no {key} in {v}");
        }
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{path} {body}: {msg}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{path} {body}: {v}");
        }
    }
    // Nothing was disturbed.
    let (status, r) = post(srv.port, c, json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 200, "{r}");
    assert_eq!(wait_idle(srv.port)["engine"]["ownership_ok"], true);
}

#[test]
fn a_full_queue_is_a_503_on_the_openai_endpoints() {
    let srv = start(&["--max-queued-requests", "1", "--max-running-requests", "1"]);
    let port = srv.port;
    let clients: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                let path = if i % 2 == 0 { "/v1/completions" } else { "/v1/chat/completions" };
                let body = if i % 2 == 0 {
                    json!({"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": true, "temperature": 0})
                } else {
                    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": true, "temperature": 0})
                };
                post(port, path, body)
            })
        })
        .collect();
    let results: Vec<(u16, Value)> = clients.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = results.iter().map(|r| r.0).collect();
    assert!(statuses.contains(&200), "{statuses:?}");
    let busy = results.iter().find(|r| r.0 == 503).unwrap_or_else(|| {
        panic!("one running and one queued: the rest are refused: {statuses:?}")
    });
    assert_eq!(busy.1["error"]["code"], "queue_full", "{}", busy.1);
}

#[test]
fn a_client_that_disconnects_mid_openai_stream_frees_its_kv() {
    let srv = start(&[]);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": true, "max_tokens": 1900, "ignore_eos": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": (0..64u32).collect::<Vec<_>>(), "stream": true, "max_tokens": 1900, "ignore_eos": true}),
        ),
    ] {
        disconnect_mid_stream(srv.port, path, &body.to_string());
        assert_kv_freed(srv.port);
    }
    let (_, metrics) = http(srv.port, "GET", "/metrics", "");
    assert!(
        metrics.contains("kvserve:num_aborted_requests_total 2"),
        "{metrics}"
    );
}

#[test]
fn the_official_openai_python_client_works() {
    if !common::python_can_import("openai", "KVSERVE_REQUIRE_OPENAI_CLIENT") {
        return;
    }
    // The built binary, as a user runs it.
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args([
            "serve",
            "--port",
            "0",
            "--threads",
            "1",
            "--api-key",
            "sk-kvserve-test",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = server.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(addr) = line.split("http://").nth(1) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(120));
    let result = addr.map(|addr| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
        let start = Instant::now();
        let out = Command::new("python3")
            .args([script, &format!("http://{addr}/v1"), "sk-kvserve-test"])
            .output()
            .unwrap();
        (out, start.elapsed())
    });
    let _ = server.kill();
    let _ = server.wait();
    let (out, took) = result.expect("the server printed its address");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_client.py failed after {took:?}:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("openai client: ok"), "{stdout}\n{stderr}");
}

/// vLLM's `cache_salt` on both endpoints: two salts never share a cached prefix, no salt is its
/// own namespace, the same salt does share, and the greedy output does not depend on the salt.
/// The salt is the same namespace as `/generate`'s `extra_key`.
#[test]
fn cache_salt_namespaces_the_prefix_cache() {
    let srv = start(&[]);
    let ids: Vec<u32> = (0..40u32).map(|i| 900 + i * 11).collect();
    let content = "Summarise the plot of a long novel about a lighthouse keeper who counts ships, \
                   storms and letters over forty years, in exactly three sentences please.";
    let run = |path: &str, salt: Option<&str>| {
        let mut body = match path {
            "/v1/completions" => json!({"prompt": ids, "max_tokens": 6}),
            _ => json!({"messages": [{"role": "user", "content": content}], "max_tokens": 6}),
        };
        body["temperature"] = json!(0);
        body["ignore_eos"] = json!(true);
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let (status, r) = post(srv.port, path, body);
        assert_eq!(status, 200, "{r}");
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let choice = &r["choices"][0];
        let text = match path {
            "/v1/completions" => choice["text"].clone(),
            _ => choice["message"]["content"].clone(),
        };
        (cached, text)
    };
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let (cached, first) = run(path, Some("salt-a"));
        assert_eq!(cached, 0, "{path}");
        let (cached, text) = run(path, Some("salt-b"));
        assert_eq!(cached, 0, "{path}: another salt shares nothing");
        assert_eq!(
            text, first,
            "{path}: the same greedy output under every salt"
        );
        let (cached, text) = run(path, None);
        assert_eq!(cached, 0, "{path}: no salt is a namespace of its own");
        assert_eq!(text, first);
        let (cached, text) = run(path, Some("salt-a"));
        assert!(
            cached >= 16,
            "{path}: the same salt shares the cached prefix"
        );
        assert_eq!(text, first);
    }
    // `cache_salt` and `extra_key` name the same namespaces.
    let (status, g) = post(
        srv.port,
        "/generate",
        json!({"input_ids": ids, "extra_key": "salt-b", "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(status, 200, "{g}");
    assert_eq!(g["meta_info"]["cached_tokens"], 32, "{g}");
    for bad in [json!(7), json!(null), json!(""), json!({"k": 1})] {
        let (status, r) = post(
            srv.port,
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": bad}),
        );
        if bad.is_null() {
            assert_eq!(status, 200, "a null salt is no salt: {r}");
            continue;
        }
        assert_eq!(status, 400, "{bad}: {r}");
        assert_eq!(r["error"]["param"], "cache_salt", "{r}");
    }
    assert_kv_freed(srv.port);
}
