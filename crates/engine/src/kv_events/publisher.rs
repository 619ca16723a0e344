//! [`ZmqEventPublisher`]: vLLM's ZMQ publisher (`vllm/distributed/kv_events.py`) on its own
//! thread, with the pure-Rust `zeromq` crate on that thread's current-thread tokio runtime.
//!
//! The engine loop hands each step's events to [`ZmqEventPublisher::publish`], which numbers
//! the batch and puts it on a bounded queue without ever blocking: a batch that finds the queue
//! full is dropped with a warning, and subscribers see the gap in the sequence numbers. The
//! thread encodes each batch ([`super::encode::encode_batch`]) and sends it on a PUB socket as
//! three frames, `[topic, seq as 8-byte big-endian, payload]`, keeping the last `buffer_steps`
//! batches for replay. With a replay endpoint, a ROUTER socket answers a request
//! `[identity, b"", start_seq]` with every buffered batch from `start_seq` on,
//! `[identity, b"", seq, payload]` each, then `[identity, b"", END_SEQ, b""]` (END_SEQ is -1 as
//! an 8-byte big-endian signed integer).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use radix_cache::KvEvent;
use serde_json::{json, Value};
use tokio::sync::mpsc::{self, error::TrySendError};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::config::{KvEventsConfig, TcpEndpoint};
use super::encode::encode_batch;
use super::KvEventsError;

/// The sequence number that ends a replay (vLLM's `END_SEQ`).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// One step's events on their way to the publisher thread.
struct Batch {
    seq: u64,
    ts: f64,
    events: Vec<KvEvent>,
}

/// What the publisher counts (read by `/get_server_info`).
#[derive(Debug, Default)]
struct Stats {
    sent: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    replay_requests: AtomicU64,
}

/// The batches kept for replay: `(seq, payload)`, oldest first.
type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// vLLM's `ZmqEventPublisher`: owned by the engine loop, its sockets on their own thread.
#[derive(Debug)]
pub struct ZmqEventPublisher {
    queue: Option<mpsc::Sender<Batch>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Stats>,
    next_seq: u64,
    max_queue_size: usize,
    buffer_steps: usize,
    topic: String,
    /// The bound addresses (a port 0 resolved).
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl ZmqEventPublisher {
    /// Binds the sockets of `cfg` on a new thread; returns once they are bound (or failed to).
    pub fn start(cfg: &KvEventsConfig) -> Result<Self, KvEventsError> {
        let endpoint = TcpEndpoint::parse("endpoint", &cfg.endpoint)?;
        let replay = cfg
            .replay_endpoint
            .as_deref()
            .map(|r| TcpEndpoint::parse("replay_endpoint", r))
            .transpose()?;
        let (tx, rx) = mpsc::channel(cfg.max_queue_size);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let stats = Arc::new(Stats::default());
        let worker = Worker {
            rx,
            stats: stats.clone(),
            topic: cfg.topic.as_bytes().to_vec(),
            buffer_steps: cfg.buffer_steps,
        };
        let thread = std::thread::Builder::new()
            .name("kvserve-kv-events".into())
            .spawn(move || worker.run(endpoint, replay, ready_tx))
            .map_err(|e| KvEventsError::Start(e.to_string()))?;
        let bound = ready_rx.recv().unwrap_or_else(|_| {
            Err(KvEventsError::Start(
                "the publisher thread ended before binding".into(),
            ))
        });
        let (endpoint, replay_endpoint) = match bound {
            Ok(b) => b,
            Err(e) => {
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(ZmqEventPublisher {
            queue: Some(tx),
            thread: Some(thread),
            stats,
            next_seq: 0,
            max_queue_size: cfg.max_queue_size,
            buffer_steps: cfg.buffer_steps,
            topic: cfg.topic.clone(),
            endpoint,
            replay_endpoint,
        })
    }

    /// The bound PUB endpoint (`tcp://HOST:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Hands one step's events to the publisher thread without blocking; nothing for an empty
    /// step. The batch takes the next sequence number even if the queue is full and it is
    /// dropped, so subscribers see the loss.
    pub fn publish(&mut self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let Some(queue) = &self.queue else {
            return;
        };
        let why = match queue.try_send(Batch { seq, ts, events }) {
            Ok(()) => return,
            Err(TrySendError::Full(_)) => "the queue is full (max_queue_size)",
            Err(TrySendError::Closed(_)) => "the publisher thread has stopped",
        };
        let dropped = self.stats.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        // The first drop and then every power of two: a stalled publisher does not flood the log.
        if dropped.is_power_of_two() {
            eprintln!(
                "kvserve: warning: KV event batch {seq} dropped: {why}; {dropped} dropped so far"
            );
        }
    }

    /// The publisher's state for `/get_server_info`.
    pub fn info(&self) -> Value {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "buffer_steps": self.buffer_steps,
            "max_queue_size": self.max_queue_size,
            "batches_published": self.next_seq,
            "batches_sent": n(&self.stats.sent),
            "batches_dropped": n(&self.stats.dropped),
            "batches_failed": n(&self.stats.failed),
            "replay_requests": n(&self.stats.replay_requests),
        })
    }
}

impl Drop for ZmqEventPublisher {
    /// Sends what is queued, then stops the thread and closes the sockets.
    fn drop(&mut self) {
        self.queue = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The publisher thread's side.
struct Worker {
    rx: mpsc::Receiver<Batch>,
    stats: Arc<Stats>,
    topic: Vec<u8>,
    buffer_steps: usize,
}

type Bound = Result<(String, Option<String>), KvEventsError>;

impl Worker {
    fn run(
        self,
        endpoint: TcpEndpoint,
        replay: Option<TcpEndpoint>,
        ready: std::sync::mpsc::SyncSender<Bound>,
    ) {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(self.serve(endpoint, replay, ready)),
            Err(e) => {
                let _ = ready.send(Err(KvEventsError::Start(e.to_string())));
            }
        }
    }

    async fn serve(
        mut self,
        endpoint: TcpEndpoint,
        replay: Option<TcpEndpoint>,
        ready: std::sync::mpsc::SyncSender<Bound>,
    ) {
        let bind_err = |ep: &TcpEndpoint, e: zeromq::ZmqError| KvEventsError::Bind {
            endpoint: ep.to_string(),
            message: e.to_string(),
        };
        let mut socket = PubSocket::new();
        let bound = match socket.bind(&endpoint.to_string()).await {
            Ok(b) => b.to_string(),
            Err(e) => {
                let _ = ready.send(Err(bind_err(&endpoint, e)));
                return;
            }
        };
        let buffer = ReplayBuffer::default();
        let replay_bound = match replay {
            None => None,
            Some(ep) => {
                let mut router = RouterSocket::new();
                match router.bind(&ep.to_string()).await {
                    Ok(b) => {
                        tokio::spawn(serve_replay(router, buffer.clone(), self.stats.clone()));
                        Some(b.to_string())
                    }
                    Err(e) => {
                        let _ = ready.send(Err(bind_err(&ep, e)));
                        return;
                    }
                }
            }
        };
        let _ = ready.send(Ok((bound, replay_bound)));
        while let Some(batch) = self.rx.recv().await {
            let payload = match encode_batch(batch.ts, &batch.events, None) {
                Ok(p) => p,
                Err(e) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "kvserve: warning: KV event batch {} dropped: {e}",
                        batch.seq
                    );
                    continue;
                }
            };
            // Kept for replay before it is sent (a subscriber that sees it may ask for it at
            // once), and even if the send fails.
            if self.buffer_steps > 0 {
                let mut buf = buffer.lock().unwrap_or_else(|p| p.into_inner());
                if buf.len() == self.buffer_steps {
                    buf.pop_front();
                }
                buf.push_back((batch.seq, payload.clone()));
            }
            let mut msg = ZmqMessage::from(self.topic.clone());
            msg.push_back(batch.seq.to_be_bytes().to_vec().into());
            msg.push_back(payload.into());
            match socket.send(msg).await {
                Ok(()) => self.stats.sent.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    eprintln!(
                        "kvserve: warning: KV event batch {} not sent: {e}",
                        batch.seq
                    );
                    self.stats.failed.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
    }
}

/// Answers replay requests until the runtime stops.
async fn serve_replay(mut router: RouterSocket, buffer: ReplayBuffer, stats: Arc<Stats>) {
    loop {
        let frames = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // [identity, b"", start_seq]; start_seq is big-endian and unsigned, as vLLM reads it.
        let start = match frames.as_slice() {
            [_, empty, start] if empty.is_empty() && start.len() <= 8 => {
                start.iter().fold(0u64, |v, &b| v << 8 | u64::from(b))
            }
            _ => {
                eprintln!(
                    "kvserve: warning: invalid KV event replay request ({} frames)",
                    frames.len()
                );
                continue;
            }
        };
        stats.replay_requests.fetch_add(1, Ordering::Relaxed);
        let identity = frames[0].clone();
        let batches: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| (seq.to_be_bytes(), payload))
            .chain(std::iter::once((END_SEQ, Vec::new())));
        for (seq, payload) in replies {
            let mut msg = ZmqMessage::from(identity.clone());
            msg.push_back(Vec::new().into());
            msg.push_back(seq.to_vec().into());
            msg.push_back(payload.into());
            if router.send(msg).await.is_err() {
                // The requester went away: the rest of its replay has nowhere to go.
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publisher whose queue nobody drains: what a stalled publisher thread looks like.
    fn stalled(max_queue_size: usize) -> (ZmqEventPublisher, mpsc::Receiver<Batch>) {
        let (tx, rx) = mpsc::channel(max_queue_size);
        let p = ZmqEventPublisher {
            queue: Some(tx),
            thread: None,
            stats: Arc::default(),
            next_seq: 0,
            max_queue_size,
            buffer_steps: 0,
            topic: String::new(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
        };
        (p, rx)
    }

    #[test]
    fn a_full_queue_drops_the_batch_and_skips_its_sequence_number() {
        let (mut p, mut rx) = stalled(2);
        p.publish(Vec::new()); // an empty step: no batch, no number
        for _ in 0..5 {
            p.publish(vec![KvEvent::AllBlocksCleared]);
        }
        let info = p.info();
        assert_eq!(
            (
                info["batches_published"].as_u64(),
                info["batches_dropped"].as_u64()
            ),
            (Some(5), Some(3))
        );
        let queued: Vec<u64> = std::iter::from_fn(|| rx.try_recv().ok().map(|b| b.seq)).collect();
        assert_eq!(queued, [0, 1]);
        // Room again: the next batch goes through with the next number (subscribers see 2..4
        // missing).
        p.publish(vec![KvEvent::AllBlocksCleared]);
        assert_eq!(rx.try_recv().map(|b| b.seq).ok(), Some(5));
        assert_eq!(p.info()["batches_dropped"], 3);
    }

    /// The wire protocol, spoken by the `zeromq` crate's own SUB and DEALER sockets: the
    /// three-frame PUB messages and a replay from a sequence number, ended by `END_SEQ`.
    #[test]
    fn pub_and_replay_frames_are_vllms() {
        use zeromq::{DealerSocket, SubSocket};
        let cfg = KvEventsConfig {
            publisher: Some(super::super::PublisherKind::Zmq),
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            topic: "kv".into(),
            ..KvEventsConfig::default()
        };
        let mut p = ZmqEventPublisher::start(&cfg).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let frames =
            |m: ZmqMessage| -> Vec<Vec<u8>> { m.into_vec().iter().map(|b| b.to_vec()).collect() };
        let mut sub = SubSocket::new();
        rt.block_on(async {
            sub.connect(p.endpoint()).await.unwrap();
            sub.subscribe("kv").await.unwrap();
        });
        // Until the subscription reaches the PUB socket, what it sends goes nowhere: publish
        // until a message arrives.
        let stored = KvEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: None,
            token_ids: vec![1],
            block_size: 1,
        };
        let first = rt.block_on(async {
            loop {
                p.publish(vec![stored.clone()]);
                let got = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await;
                if let Ok(m) = got {
                    break frames(m.unwrap());
                }
            }
        });
        let seq = u64::from_be_bytes(first[1].clone().try_into().unwrap());
        assert_eq!(first[0], b"kv");
        assert_eq!(first[2], one_stored_batch_with_ts_of(&first[2]));
        p.publish(vec![KvEvent::AllBlocksCleared]);
        let next = rt.block_on(sub.recv()).map(frames).unwrap();
        assert_eq!(next[1], (seq + 1).to_be_bytes());

        let mut dealer = DealerSocket::new();
        let replies = rt.block_on(async {
            dealer.connect(p.replay_endpoint().unwrap()).await.unwrap();
            let mut req = ZmqMessage::from(Vec::new());
            req.push_back(seq.to_be_bytes().to_vec().into());
            dealer.send(req).await.unwrap();
            let mut out = Vec::new();
            loop {
                let f = frames(dealer.recv().await.unwrap());
                let end = f[1] == END_SEQ;
                out.push(f);
                if end {
                    break out;
                }
            }
        });
        assert_eq!(replies.len(), 3, "two batches and the end");
        assert_eq!(replies[0][..2], [Vec::new(), seq.to_be_bytes().to_vec()]);
        assert_eq!(replies[0][2], first[2]);
        assert_eq!(
            replies[1][1..],
            [(seq + 1).to_be_bytes().to_vec(), next[2].clone()]
        );
        assert_eq!(replies[2], [Vec::new(), END_SEQ.to_vec(), Vec::new()]);
        assert_eq!(p.info()["replay_requests"], 1);
    }

    /// The payload of a one-`BlockStored` batch: `[ts, [event]]` with that event's bytes.
    fn one_stored_batch_with_ts_of(payload: &[u8]) -> Vec<u8> {
        let ts = f64::from_be_bytes(payload[2..10].try_into().unwrap());
        let stored = KvEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: None,
            token_ids: vec![1],
            block_size: 1,
        };
        encode_batch(ts, &[stored], None).unwrap()
    }
}
