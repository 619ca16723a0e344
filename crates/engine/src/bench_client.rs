//! `kvserve bench --url`: the same workloads driven over HTTP against any OpenAI-compatible
//! server (kvserve, SGLang, vLLM, …), as SGLang's `bench_serving --backend sglang-oai` does.
//!
//! Each request is a streamed `POST {url}/v1/completions` whose `prompt` is the workload's
//! token ids (so every engine sees exactly the same tokens), with `max_tokens` the request's
//! output length, `ignore_eos` (an SGLang and vLLM extension), greedy sampling and
//! `stream_options.include_usage`. Requests are sent at their arrival times (real time, unlike
//! the in-process replay, which skips idle gaps), at most `--max-concurrency` at once. TTFT is
//! measured to the first streamed chunk that carries text, inter-token latency between chunks
//! that carry text (a chunk holding several tokens counts as one gap, as bench_serving does);
//! token counts and cached tokens come from the final `usage` (`prompt_tokens_details.
//! cached_tokens`; a server that omits it reports a hit rate of 0). The warmup requests go
//! first, all at once and untimed; if every one fails the bench stops with the first error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use scheduler::summary::{RunSummary, RunTotals};
use scheduler::{SimReport, SimRequest};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::error::{EngineError, Result};

/// Where to send the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteTarget {
    /// Base URL (`http://host:port`, without `/v1`).
    pub url: String,
    /// The `model` field of each request (`None`: the first of `GET /v1/models`).
    pub model: Option<String>,
    /// `Authorization: Bearer` key, if the server wants one.
    pub api_key: Option<String>,
}

/// What one request measured.
#[derive(Debug, Clone, Default, PartialEq)]
struct RequestResult {
    ok: bool,
    error: Option<String>,
    ttft_s: Option<f64>,
    itl_s: Vec<f64>,
    prompt_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
}

/// Runs `warmup` (untimed), then `requests` against `target`, and summarizes `requests` as a
/// [`SimReport`] (with `prefill_tokens = prompt − cached` and no scheduler figures).
/// `progress` gets (done, total).
pub fn run_remote(
    requests: &[SimRequest],
    warmup: &[SimRequest],
    target: &RemoteTarget,
    max_concurrency: Option<usize>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<SimReport> {
    crate::runtime::async_runtime()?.block_on(drive(
        requests,
        warmup,
        target,
        max_concurrency,
        progress,
    ))
}

fn url_err(url: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::arg("--url", format!("{url}: {e}"))
}

/// The streamed completion request of `r`.
fn completion_body(model: &str, r: &SimRequest) -> Value {
    json!({
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.output_len.max(1),
        "ignore_eos": true,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

async fn drive(
    requests: &[SimRequest],
    warmup: &[SimRequest],
    target: &RemoteTarget,
    max_concurrency: Option<usize>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<SimReport> {
    let base = target.url.trim_end_matches('/').to_string();
    if !base.starts_with("http://") {
        return Err(url_err(
            &base,
            "expected an http:// URL (this build's client speaks plain HTTP only)",
        ));
    }
    // A server that accepts but never answers must not hang the bench: bound the connect and
    // every wait for the next bytes (a long generation streams, so it keeps reading).
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(300))
        .build()
        .map_err(|e| url_err(&base, e))?;
    let auth = target.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let model = match &target.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base, auth.as_deref()).await?,
    };
    let endpoint = format!("{base}/v1/completions");
    if !warmup.is_empty() {
        let sent: Vec<_> = warmup
            .iter()
            .map(|r| {
                let (client, endpoint, auth) = (client.clone(), endpoint.clone(), auth.clone());
                let body = completion_body(&model, r);
                tokio::spawn(
                    async move { one_request(&client, &endpoint, auth.as_deref(), body).await },
                )
            })
            .collect();
        let mut first_error = None;
        let mut any_ok = false;
        for t in sent {
            let r = t.await.map_err(|e| url_err(&base, e))?;
            any_ok |= r.ok;
            first_error = first_error.or(r.error);
        }
        if !any_ok {
            return Err(url_err(
                &endpoint,
                format!(
                    "every warmup request failed; the first: {}",
                    first_error.unwrap_or_else(|| "no [DONE]".into())
                ),
            ));
        }
    }
    let gate = Arc::new(Semaphore::new(
        max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let mut order: Vec<&SimRequest> = requests.iter().collect();
    order.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    let t0 = order.first().map_or(0.0, |r| r.arrival_s);
    let start = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let total = requests.len();
    let mut tasks = Vec::with_capacity(total);
    for r in order {
        let due = Duration::from_secs_f64((r.arrival_s - t0).max(0.0));
        tokio::time::sleep_until((start + due).into()).await;
        let permit = gate
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| url_err(&base, e))?;
        let body = completion_body(&model, r);
        let (client, endpoint, auth, counter) =
            (client.clone(), endpoint.clone(), auth.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let result = one_request(&client, &endpoint, auth.as_deref(), body).await;
            drop(permit);
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            result
        }));
        progress(done.load(std::sync::atomic::Ordering::Relaxed), total);
    }
    let mut results = Vec::with_capacity(total);
    for t in tasks {
        let r = t.await.map_err(|e| url_err(&base, e))?;
        results.push(r);
        progress(done.load(std::sync::atomic::Ordering::Relaxed), total);
    }
    let duration_s = start.elapsed().as_secs_f64();
    if let Some(e) = results.iter().find_map(|r| r.error.as_ref()) {
        if results.iter().all(|r| !r.ok) {
            return Err(url_err(
                &endpoint,
                format!("every request failed; the first: {e}"),
            ));
        }
    }
    Ok(summarize(&results, duration_s))
}

/// The first model id of `GET {base}/v1/models`.
async fn first_model(client: &reqwest::Client, base: &str, auth: Option<&str>) -> Result<String> {
    let url = format!("{base}/v1/models");
    let mut req = client.get(&url);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = req.send().await.map_err(|e| url_err(&url, e))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| url_err(&url, e))?;
    if !status.is_success() {
        return Err(url_err(&url, format!("HTTP {status}: {text}")));
    }
    let v: Value = serde_json::from_str(&text).map_err(|e| url_err(&url, e))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| url_err(&url, "no model listed; give --model"))
}

/// Sends one streamed completion and times its chunks.
async fn one_request(
    client: &reqwest::Client,
    endpoint: &str,
    auth: Option<&str>,
    body: Value,
) -> RequestResult {
    let sent = Instant::now();
    let mut out = RequestResult {
        prompt_tokens: body["prompt"].as_array().map_or(0, Vec::len),
        ..RequestResult::default()
    };
    let mut req = client
        .post(endpoint)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let mut resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        out.error = Some(format!("HTTP {status}: {text}"));
        return out;
    }
    let mut events = SseBuffer::default();
    let mut last: Option<Instant> = None;
    let mut chunks_with_text = 0;
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                out.error = Some(e.to_string());
                return out;
            }
        };
        for data in events.push(&chunk) {
            if data == "[DONE]" {
                out.ok = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(&data) else {
                out.error = Some(format!("not JSON: {data}"));
                return out;
            };
            if let Some(e) = v.get("error") {
                out.error = Some(e.to_string());
                return out;
            }
            let text = v["choices"][0]["text"].as_str().unwrap_or("");
            if !text.is_empty() {
                let now = Instant::now();
                match last {
                    None => out.ttft_s = Some(now.duration_since(sent).as_secs_f64()),
                    Some(t) => out.itl_s.push(now.duration_since(t).as_secs_f64()),
                }
                last = Some(now);
                chunks_with_text += 1;
            }
            let usage = &v["usage"];
            if let Some(n) = usage["prompt_tokens"].as_u64() {
                out.prompt_tokens = n as usize;
            }
            if let Some(n) = usage["completion_tokens"].as_u64() {
                out.output_tokens = n as usize;
            }
            if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
                out.cached_tokens = n as usize;
            }
        }
    }
    if out.output_tokens == 0 {
        out.output_tokens = chunks_with_text;
    }
    // Tokens that decode to no text yet (part of a UTF-8 character) stream as empty chunks;
    // a request whose whole output was such tokens got its first "token" at the end.
    if out.ok && out.ttft_s.is_none() {
        out.ttft_s = Some(sent.elapsed().as_secs_f64());
    }
    if !out.ok && out.error.is_none() {
        out.error = Some("the stream ended without [DONE]".into());
    }
    out
}

/// Splits a server-sent-event byte stream into the `data:` payloads of complete events.
#[derive(Debug, Default)]
struct SseBuffer {
    pending: Vec<u8>,
}

impl SseBuffer {
    /// Adds bytes; returns the data of every event completed by them.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let text = &self.pending;
            let end = text
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
                .or_else(|| {
                    text.windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map(|i| (i, 4))
                });
            let Some((at, sep)) = end else { break };
            let event = String::from_utf8_lossy(&self.pending[..at]).into_owned();
            self.pending.drain(..at + sep);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// The run's figures from every request's measurements.
fn summarize(results: &[RequestResult], duration_s: f64) -> SimReport {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
    let totals = RunTotals {
        requests: ok.len(),
        aborted: results.len() - ok.len(),
        prompt_tokens: ok.iter().map(|r| r.prompt_tokens).sum(),
        cached_tokens: ok.iter().map(|r| r.cached_tokens).sum(),
        output_tokens: ok.iter().map(|r| r.output_tokens).sum(),
        duration_s,
    };
    let mut report = SimReport {
        prefill_tokens: totals.prompt_tokens - totals.cached_tokens.min(totals.prompt_tokens),
        ..SimReport::default()
    };
    report.set_summary(RunSummary::new(totals, ttft, itl));
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut b = SseBuffer::default();
        assert!(b.push(b"data: {\"a\":").is_empty());
        assert_eq!(b.push(b"1}\n\ndata: [DONE]\n"), vec!["{\"a\":1}"]);
        assert_eq!(b.push(b"\n: comment\n\n"), vec!["[DONE]"]);
        assert_eq!(b.push(b"data: x\r\n\r\n"), vec!["x"]);
    }

    #[test]
    fn summary_counts_only_finished_requests() {
        let ok = RequestResult {
            ok: true,
            ttft_s: Some(0.1),
            itl_s: vec![0.01, 0.03],
            prompt_tokens: 100,
            cached_tokens: 40,
            output_tokens: 3,
            ..RequestResult::default()
        };
        let failed = RequestResult {
            error: Some("HTTP 503".into()),
            prompt_tokens: 50,
            ..RequestResult::default()
        };
        let r = summarize(&[ok.clone(), ok, failed], 2.0);
        assert_eq!((r.requests, r.aborted), (2, 1));
        assert_eq!(
            (r.prompt_tokens, r.cached_tokens, r.prefill_tokens),
            (200, 80, 120)
        );
        assert!((r.hit_rate - 0.4).abs() < 1e-12);
        assert_eq!(r.output_tokens, 6);
        assert!((r.output_tokens_per_s - 3.0).abs() < 1e-12);
        assert_eq!((r.ttft_p50_s, r.itl_p50_s, r.itl_p99_s), (0.1, 0.01, 0.03));
    }
}
