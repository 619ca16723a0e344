//! The engine loop: the scheduler and a model executor on their own thread, requests in and
//! token streams out through channels.
//!
//! [`EngineHandle::submit`] sends a request and returns a [`RequestStream`] of [`Event`]s:
//! `Tokens` (one or more new tokens as they are generated) then exactly one `Finished`. When
//! a client drops its stream, the loop notices at the next token it sends and aborts the
//! request, freeing its KV. [`RequestStream::cancel`] asks the loop to stop a request early
//! (e.g. when the HTTP layer matched a stop string) while keeping the stream: the loop aborts
//! it after the current step and the stream ends with `Finished` as usual.
//! [`EngineHandle::shutdown`] stops taking requests, aborts those still in flight (their
//! streams end with an abort), and joins the thread.
//!
//! Streams are tokio unbounded channels: the engine thread sends without blocking, async
//! consumers `await` [`RequestStream::next`], blocking ones call [`RequestStream::recv`] or
//! iterate. The loop keeps [`EngineMetrics`] up to date after every step and command.
//!
//! The loop blocks on its inbox when idle and drains it without blocking between steps, so an
//! idle engine costs nothing and a busy one admits new requests every step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use model::SamplingParams;
use scheduler::{Executor, FinishReason, FinishedReq, ReqId, SamplingLimits, Scheduler};

use crate::engine_metrics::EngineMetrics;
use crate::kv_events::ZmqEventPublisher;
use crate::setup::ModelExecutor;
use pd::PdSide;

pub mod pd;

type Sender<T> = tokio::sync::mpsc::UnboundedSender<T>;

/// A request to the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub input_ids: Vec<u32>,
    /// Sampling parameters (temperature, top-k/p, penalties, seed, stop ids).
    pub sampling: SamplingParams,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Keep generating past EOS (whose ids the caller then leaves out of the stop ids; the
    /// request's own stop ids still stop it).
    pub ignore_eos: bool,
    pub priority: i64,
    /// The prefix-cache namespace (SGLang's `extra_key`): requests share cached prefixes only
    /// with requests of the same key, and requests without one only with each other.
    pub extra_key: Option<String>,
    /// PD disaggregation: where the request's prefill server bootstraps and its room (SGLang's
    /// `bootstrap_host`, `bootstrap_port`, `bootstrap_room`); `None` on a `null`-mode server.
    pub bootstrap: Option<crate::disagg::Bootstrap>,
}

/// What a request's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly generated tokens.
    Tokens(Vec<u32>),
    /// The end of the stream.
    Finished(Finished),
    /// The engine refused the request (invalid, queue full, shutting down).
    Rejected(String),
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The scheduler's id of the request.
    pub id: u64,
    /// Why it ended.
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Seconds from submission to the end.
    pub e2e_latency_s: f64,
}

/// A request's event stream. Dropping it aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestStream {
    /// The next event (async); `None` once the stream has ended.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// The next event, blocking the thread (not for use inside an async runtime).
    pub fn recv(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// Asks the engine to stop generating for this request after the current step; the
    /// stream stays open and ends with `Finished` (reason: abort).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Iterator for RequestStream {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        self.recv()
    }
}

/// A request as it reaches the loop: what to run and where its events go.
pub(crate) struct Submission {
    pub(crate) request: GenerateRequest,
    pub(crate) events: Sender<Event>,
    pub(crate) cancel: Arc<AtomicBool>,
}

impl Submission {
    /// Whether the client went away or cancelled.
    pub(crate) fn abandoned(&self) -> bool {
        self.events.is_closed() || self.cancel.load(Ordering::Relaxed)
    }

    /// Refuses the request with `message`.
    pub(crate) fn reject(self, message: impl Into<String>) {
        let _ = self.events.send(Event::Rejected(message.into()));
    }
}

enum Command {
    Submit(Box<Submission>),
    Flush(SyncSender<Result<(), String>>),
    Info(SyncSender<EngineInfo>),
    Shutdown,
}

/// A snapshot of the engine's state (for `/get_server_info`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineInfo {
    pub waiting: usize,
    pub running: usize,
    /// KV pool size in tokens.
    pub total_tokens: usize,
    /// Free KV slots.
    pub available_tokens: usize,
    /// Tokens held by the prefix cache, unlocked.
    pub evictable_tokens: usize,
    /// Tokens held by the prefix cache, locked by requests.
    pub protected_tokens: usize,
    /// Whether the ownership checker passes (checked when idle; `None` when busy).
    pub ownership_ok: Option<bool>,
    /// Prompt tokens admitted since start.
    pub prompt_tokens: usize,
    /// Of those, served from the cache.
    pub cached_tokens: usize,
    /// Tokens generated since start.
    pub output_tokens: usize,
    /// Tokens computed by prefill passes since start.
    pub prefill_tokens: usize,
    /// Requests retracted (or preempted) and re-queued since start.
    pub retractions: usize,
    /// A prefill or decode server's PD queues and transfer counters.
    pub disaggregation: Option<serde_json::Value>,
    /// The hierarchical cache: hit tokens per tier, the host pool, the tiers' counters.
    pub hicache: Option<serde_json::Value>,
    /// The KV event publisher (`--kv-events-config`): bound endpoints, batches published,
    /// sent and dropped.
    pub kv_events: Option<serde_json::Value>,
}

/// A handle to a running engine loop.
#[derive(Debug)]
pub struct EngineHandle {
    inbox: mpsc::Sender<Command>,
    thread: Option<JoinHandle<()>>,
    metrics: Arc<EngineMetrics>,
}

/// A request the scheduler knows, and its client.
pub(crate) struct Live {
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
    sent: usize,
    start: Instant,
}

/// The live requests, by id.
pub(crate) type LiveMap = HashMap<ReqId, Live>;

impl EngineHandle {
    /// Starts the loop on its own thread, owning `scheduler` and `exec`.
    pub fn start(scheduler: Scheduler, exec: ModelExecutor) -> Self {
        Self::start_with(scheduler, exec, None, None)
    }

    /// Starts the loop of a server: with `pd` (a prefill or decode server) the requests that
    /// carry bootstrap fields go through SGLang's PD queues; with `kv_events` the cache's KV
    /// events (the scheduler's cache must record them) are handed to the publisher after every
    /// step.
    pub fn start_with(
        scheduler: Scheduler,
        exec: ModelExecutor,
        pd: Option<PdSide>,
        kv_events: Option<ZmqEventPublisher>,
    ) -> Self {
        let (inbox, commands) = mpsc::channel();
        let metrics = Arc::new(EngineMetrics::default());
        metrics.publish(&scheduler);
        let m = metrics.clone();
        let thread = std::thread::Builder::new()
            .name("kvserve-engine".into())
            .spawn(move || run(scheduler, exec, commands, &m, pd, kv_events))
            .expect("spawn the engine thread");
        EngineHandle {
            inbox,
            thread: Some(thread),
            metrics,
        }
    }

    /// Submits a request; its events arrive on the returned stream.
    pub fn submit(&self, request: GenerateRequest) -> RequestStream {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let sub = Submission {
            request,
            events: tx,
            cancel: cancel.clone(),
        };
        if let Err(mpsc::SendError(Command::Submit(sub))) =
            self.inbox.send(Command::Submit(Box::new(sub)))
        {
            let _ = sub
                .events
                .send(Event::Rejected("the engine is shutting down".into()));
        }
        RequestStream { events: rx, cancel }
    }

    /// The gauges and counters the loop publishes.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Empties the prefix cache (refused while requests run).
    pub fn flush_cache(&self) -> Result<(), String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.inbox
            .send(Command::Flush(tx))
            .map_err(|_| "the engine is stopped".to_string())?;
        rx.recv().map_err(|_| "the engine is stopped".to_string())?
    }

    pub fn info(&self) -> Option<EngineInfo> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.inbox.send(Command::Info(tx)).ok()?;
        rx.recv().ok()
    }

    /// Whether the loop still runs (it stops on shutdown, or after a failed step).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Asks the loop to stop without waiting for it: in-flight requests are aborted and their
    /// streams closed, so a server's graceful shutdown does not wait on long generations.
    pub fn begin_shutdown(&self) {
        let _ = self.inbox.send(Command::Shutdown);
    }

    /// Stops the loop: in-flight requests are aborted and their streams closed.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.inbox.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

fn info(s: &Scheduler, pd: Option<&PdSide>, kv: Option<&ZmqEventPublisher>) -> EngineInfo {
    let idle = s.is_idle() && pd.is_none_or(|p| !p.has_work());
    EngineInfo {
        waiting: s.num_waiting(),
        running: s.num_running(),
        total_tokens: s.allocator().size(),
        available_tokens: s.allocator().available_size(),
        evictable_tokens: s.cache().evictable_size(),
        protected_tokens: s.cache().protected_size(),
        ownership_ok: idle.then(|| s.check_invariants().is_ok()),
        prompt_tokens: s.stats.prompt_tokens,
        cached_tokens: s.stats.cached_tokens,
        output_tokens: s.stats.output_tokens,
        prefill_tokens: s.stats.prefill_tokens,
        retractions: s.stats.retractions,
        disaggregation: pd.map(|p| p.info(s)),
        hicache: crate::engine_metrics::HiCacheMetrics::of(s).map(|h| h.to_json()),
        kv_events: kv.map(ZmqEventPublisher::info),
    }
}

/// How long the loop sleeps between polls of PD work (handshakes, transfers) when the
/// scheduler has nothing to run.
const PD_POLL_INTERVAL: Duration = Duration::from_millis(1);

fn run(
    mut s: Scheduler,
    mut exec: ModelExecutor,
    commands: Receiver<Command>,
    metrics: &EngineMetrics,
    mut pd: Option<PdSide>,
    mut kv: Option<ZmqEventPublisher>,
) {
    let mut live: LiveMap = HashMap::new();
    let started = Instant::now();
    loop {
        // What the last step (or command) changed in the cache, as one batch.
        publish_kv_events(&mut s, kv.as_mut());
        metrics.publish(&s);
        if let Some(p) = &pd {
            metrics.publish_pd(p.metrics(&s));
        }
        // Idle: block for work. Waiting on PD peers: wake often to poll them. Busy: take what
        // is there and go on stepping.
        let pd_work = pd.as_ref().is_some_and(PdSide::has_work);
        // HiCache copies in flight with no request to run: poll their acks now and then.
        let io_only = !s.has_requests() && s.has_cache_io();
        let mut next = if !s.has_requests() {
            let wait = if pd_work || io_only {
                PD_POLL_INTERVAL
            } else {
                Duration::from_secs(3600)
            };
            match commands.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            commands.try_recv().ok()
        };
        while let Some(cmd) = next.take() {
            match cmd {
                Command::Submit(sub) => match &mut pd {
                    Some(p) if sub.request.bootstrap.is_some() => p.submit(&mut s, *sub),
                    _ => submit(&mut s, &mut exec, &mut live, *sub),
                },
                Command::Flush(reply) => {
                    settle_cache_io(&mut s);
                    let r = if s.is_idle() && !pd_work {
                        s.flush_cache().map_err(|e| e.to_string())
                    } else {
                        Err("requests are running; flush when idle".into())
                    };
                    let _ = reply.send(r);
                }
                Command::Info(reply) => {
                    settle_cache_io(&mut s);
                    // So the published count covers every change before this answer.
                    publish_kv_events(&mut s, kv.as_mut());
                    let _ = reply.send(info(&s, pd.as_ref(), kv.as_ref()));
                }
                Command::Shutdown => {
                    if let Some(p) = &mut pd {
                        p.shutdown(&mut s);
                    }
                    let ids: Vec<ReqId> = live.keys().copied().collect();
                    for id in ids {
                        let _ = s.abort(id, "the server is shutting down");
                    }
                    deliver(&mut s, &mut exec, &mut live, None);
                    publish_kv_events(&mut s, kv.as_mut());
                    return;
                }
            }
            next = commands.try_recv().ok();
        }
        if let Some(p) = &mut pd {
            p.before_step(&mut s, &mut exec, &mut live);
        }
        if !s.is_idle() {
            metrics.publish(&s);
            s.set_time(started.elapsed().as_secs_f64());
            if let Err(e) = step(&mut s, &mut exec) {
                // A failed step is a bug; fail every request rather than hang them.
                for (_, l) in live.drain() {
                    let _ = l.events.send(Event::Rejected(format!("engine error: {e}")));
                }
                return;
            }
        }
        deliver(&mut s, &mut exec, &mut live, pd.as_mut());
    }
}

/// Hands the cache's KV events since the last call to the publisher, as one batch (nothing for
/// none; without a publisher the cache records none).
fn publish_kv_events(s: &mut Scheduler, kv: Option<&mut ZmqEventPublisher>) {
    if let Some(p) = kv {
        p.publish(s.take_cache_events());
    }
}

/// How long a flush waits for HiCache copies in flight to be acknowledged.
const SETTLE_CACHE_IO: Duration = Duration::from_secs(10);

/// With no request running: takes the acks of HiCache copies in flight until there are none
/// (or [`SETTLE_CACHE_IO`] passed), so an idle server's cache is unlocked and can be flushed.
fn settle_cache_io(s: &mut Scheduler) {
    let deadline = Instant::now() + SETTLE_CACHE_IO;
    while !s.has_requests() && s.has_cache_io() && Instant::now() < deadline {
        if s.poll_cache_events().is_err() {
            return;
        }
        std::thread::sleep(PD_POLL_INTERVAL);
    }
}

fn step(s: &mut Scheduler, exec: &mut ModelExecutor) -> Result<(), String> {
    let exec: &mut dyn Executor = exec;
    s.step(exec).map(|_| ()).map_err(|e| e.to_string())
}

/// The scheduler's limits for `req` (`ignore_eos`, SGLang's meaning, ignores only EOS: the
/// server leaves EOS out of the stop ids of such a request, so the scheduler stops on exactly
/// the ids it is given).
pub(crate) fn limits_of(req: &GenerateRequest) -> SamplingLimits {
    SamplingLimits {
        max_new_tokens: req.max_new_tokens,
        ignore_eos: false,
        stop_token_ids: req.sampling.stop_token_ids.clone(),
    }
}

fn submit(s: &mut Scheduler, exec: &mut ModelExecutor, live: &mut LiveMap, sub: Submission) {
    if let Err(e) = sub.request.sampling.validate() {
        sub.reject(e.to_string());
        return;
    }
    let req = &sub.request;
    match s.add_request(
        req.input_ids.clone(),
        limits_of(req),
        req.priority,
        req.extra_key.clone(),
    ) {
        Ok(id) => track(s, exec, live, id, sub),
        Err(e) => sub.reject(e.to_string()),
    }
}

/// Gives the scheduler's new request `id` its sampling and its client; a request whose
/// sampling the executor refuses is aborted and rejected.
pub(crate) fn track(
    s: &mut Scheduler,
    exec: &mut ModelExecutor,
    live: &mut LiveMap,
    id: ReqId,
    sub: Submission,
) {
    let Submission {
        request: req,
        events,
        cancel,
    } = sub;
    if let Err(e) = exec.register(id, req.input_ids, req.sampling) {
        let _ = s.abort(id, "invalid sampling parameters");
        s.take_finished();
        let _ = events.send(Event::Rejected(e.to_string()));
        return;
    }
    live.insert(
        id,
        Live {
            events,
            cancel,
            sent: 0,
            start: Instant::now(),
        },
    );
}

/// Sends every live request its new tokens, finishes what finished, and aborts requests whose
/// client went away or that were cancelled. With `pd`, requests in PD queues are aborted
/// through it (their KV may still be moving) and it keeps finished requests whose KV is still
/// being sent, finishing them when their transfer ends.
fn deliver(
    s: &mut Scheduler,
    exec: &mut ModelExecutor,
    live: &mut LiveMap,
    mut pd: Option<&mut PdSide>,
) {
    let mut gone = Vec::new();
    let mut cancelled = Vec::new();
    let stream_tokens = !pd.as_deref().is_some_and(PdSide::answers_at_the_end);
    for (&id, l) in live.iter_mut() {
        if l.cancel.load(Ordering::Relaxed) {
            cancelled.push(id);
            continue;
        }
        // A client that went away while its request waits or prefills is noticed here, not
        // only when its next token fails to send.
        if l.events.is_closed() {
            gone.push(id);
            continue;
        }
        let Some(r) = s.request(id).filter(|_| stream_tokens) else {
            continue;
        };
        let out = r.output_ids();
        if out.len() > l.sent {
            if l.events
                .send(Event::Tokens(out[l.sent..].to_vec()))
                .is_err()
            {
                gone.push(id);
            }
            l.sent = out.len();
        }
    }
    let aborts = gone
        .into_iter()
        .map(|id| (id, "the client disconnected"))
        .chain(cancelled.into_iter().map(|id| (id, "cancelled")));
    for (id, why) in aborts {
        let taken = pd.as_deref_mut().is_some_and(|p| p.abort(s, id, why));
        if !taken {
            let _ = s.abort(id, why);
        }
    }
    let mut finished = s.take_finished();
    if let Some(p) = pd {
        finished.retain(|f| !p.hold(s, f));
        finished.extend(p.after_step(s, exec));
    }
    for f in finished {
        finish(exec, live, f);
    }
}

/// Ends a finished request's stream (its last tokens, then `Finished`).
fn finish(exec: &mut ModelExecutor, live: &mut LiveMap, f: FinishedReq) {
    exec.release(f.id);
    let Some(l) = live.remove(&f.id) else {
        return;
    };
    // A PD request whose KV never arrived (or could not be sent) is an error for its client,
    // not an empty completion.
    if let FinishReason::Abort { message } = &f.reason {
        if l.sent == 0 && message.starts_with(crate::disagg::TRANSFER_FAILED) {
            let _ = l.events.send(Event::Rejected(message.clone()));
            return;
        }
    }
    if f.output_ids.len() > l.sent {
        let _ = l
            .events
            .send(Event::Tokens(f.output_ids[l.sent..].to_vec()));
    }
    let _ = l.events.send(Event::Finished(Finished {
        id: f.id.0,
        reason: f.reason,
        prompt_tokens: f.prompt_tokens,
        cached_tokens: f.cached_tokens,
        completion_tokens: f.output_ids.len(),
        e2e_latency_s: l.start.elapsed().as_secs_f64(),
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::{build, default_setup, EngineSetup, ModelSource};

    fn engine() -> EngineHandle {
        let setup = EngineSetup {
            model: ModelSource::Tiny,
            capacity_tokens: 4096,
            ..default_setup(1024)
        };
        let (sched, exec) = build(&setup, true).unwrap();
        EngineHandle::start(sched, exec)
    }

    fn collect(stream: RequestStream) -> (Vec<u32>, Option<Finished>, Option<String>) {
        let (mut tokens, mut fin, mut rej) = (Vec::new(), None, None);
        for ev in stream {
            match ev {
                Event::Tokens(t) => tokens.extend(t),
                Event::Finished(f) => fin = Some(f),
                Event::Rejected(m) => rej = Some(m),
            }
        }
        (tokens, fin, rej)
    }

    fn greedy(prompt: Vec<u32>, n: usize) -> GenerateRequest {
        GenerateRequest {
            input_ids: prompt,
            sampling: SamplingParams::greedy(),
            max_new_tokens: n,
            ignore_eos: true,
            priority: 0,
            extra_key: None,
            bootstrap: None,
        }
    }

    #[test]
    fn concurrent_requests_stream_and_finish_and_the_cache_is_shared() {
        let e = engine();
        let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
        let first = collect(e.submit(greedy(prompt.clone(), 6)));
        assert_eq!(first.0.len(), 6);
        let streams: Vec<_> = (0..4)
            .map(|_| e.submit(greedy(prompt.clone(), 6)))
            .collect();
        for s in streams {
            let (tokens, fin, rej) = collect(s);
            assert_eq!(rej, None);
            assert_eq!(
                tokens, first.0,
                "greedy output does not depend on the cache or the batch"
            );
            let f = fin.unwrap();
            assert_eq!((f.prompt_tokens, f.completion_tokens), (100, 6));
            assert!(f.cached_tokens >= 96, "{f:?}");
        }
        let info = e.info().unwrap();
        assert_eq!(
            (info.waiting, info.running, info.protected_tokens),
            (0, 0, 0)
        );
        assert_eq!(info.ownership_ok, Some(true));
        assert_eq!(
            info.available_tokens + info.evictable_tokens,
            info.total_tokens
        );
        e.flush_cache().unwrap();
        assert_eq!(e.info().unwrap().available_tokens, info.total_tokens);
        e.shutdown();
    }

    /// `begin_shutdown` (what `serve` does on Ctrl-C) ends a long generation at once: its
    /// stream closes without running to its length, and the loop stops.
    #[test]
    fn begin_shutdown_ends_in_flight_streams() {
        let e = engine();
        assert!(e.is_running());
        let mut stream = e.submit(greedy((0..50).collect(), 900));
        // Wait for the first tokens, so the request is running.
        assert!(matches!(stream.recv(), Some(Event::Tokens(_))));
        e.begin_shutdown();
        let (tokens, fin, _) = collect(stream);
        assert!(tokens.len() < 899, "stopped early: {}", tokens.len());
        assert!(fin.is_none_or(|f| matches!(f.reason, FinishReason::Abort { .. })));
        for _ in 0..200 {
            if !e.is_running() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!e.is_running());
        let (_, _, rej) = collect(e.submit(greedy(vec![1, 2, 3], 2)));
        assert!(rej.is_some(), "a stopped engine rejects new requests");
    }

    #[test]
    fn bad_requests_are_rejected_and_disconnects_free_the_kv() {
        let e = engine();
        let (_, _, rej) = collect(e.submit(greedy(vec![], 4)));
        assert!(rej.unwrap().contains("empty"));
        let bad = GenerateRequest {
            sampling: SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            ..greedy(vec![1, 2], 4)
        };
        assert!(collect(e.submit(bad)).2.unwrap().contains("temperature"));
        // A client that goes away: its request is aborted and its KV freed.
        drop(e.submit(greedy((0..50).collect(), 500)));
        let mut info = e.info().unwrap();
        for _ in 0..200 {
            if info.running == 0 && info.waiting == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
            info = e.info().unwrap();
        }
        assert_eq!((info.running, info.protected_tokens), (0, 0));
        assert_eq!(info.ownership_ok, Some(true));
        assert_eq!(
            info.available_tokens + info.evictable_tokens,
            info.total_tokens
        );
        e.shutdown();
    }

    #[test]
    fn a_cancelled_request_stops_and_its_stream_ends_with_finished() {
        let e = engine();
        let mut s = e.submit(greedy((0..40).collect(), 100_000));
        assert!(matches!(s.recv(), Some(Event::Tokens(_))));
        s.cancel();
        let (tokens, fin, rej) = collect(s);
        assert_eq!(rej, None);
        let f = fin.unwrap();
        assert!(matches!(f.reason, FinishReason::Abort { .. }), "{f:?}");
        assert!(tokens.len() < 1000);
        let info = e.info().unwrap();
        assert_eq!((info.running, info.protected_tokens), (0, 0));
        assert_eq!(info.ownership_ok, Some(true));
        let m = e.metrics().snapshot();
        assert_eq!((m.num_running_reqs, m.num_queue_reqs), (0, 0));
        assert_eq!(m.prompt_tokens_total, 40);
        assert!(m.generation_tokens_total >= 1);
        e.shutdown();
    }

    #[test]
    fn shutdown_aborts_in_flight_requests() {
        let e = engine();
        let mut s = e.submit(greedy((0..40).collect(), 100_000));
        // Wait for the first tokens, then shut down.
        let first = s.recv().unwrap();
        assert!(matches!(first, Event::Tokens(_)));
        e.shutdown();
        let (_, fin, _) = collect(s);
        assert!(matches!(fin.unwrap().reason, FinishReason::Abort { .. }));
    }
}
