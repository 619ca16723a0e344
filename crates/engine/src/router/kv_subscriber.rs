//! The `kv_events` policy's subscribers: one ZMQ SUB socket per worker (the pure-Rust
//! `zeromq` crate) on its `--worker-kv-events` endpoint, each batch (vLLM's three frames
//! `[topic, seq, payload]`) decoded and applied to the shared [`KvIndex`] under that worker's
//! id. A socket that cannot connect or breaks is reopened a second later; a batch that cannot
//! be decoded or applied is reported and skipped.
//!
//! A gap in the sequence numbers (the subscription came late, or batches were dropped) is
//! filled from the worker's replay socket when it has one (`--worker-kv-events-replay`,
//! vLLM's `replay_endpoint`): a DEALER sends the first missing sequence number and applies
//! the buffered `[b"", seq, payload]` batches before the one that showed the gap, up to the
//! `END_SEQ` marker ([`replay_missed`]). Without one, or when the worker's bounded buffer no
//! longer holds them, the gap is reported and pages whose parent was missed stay out of the
//! index. [`Subscribers`] keeps each worker's task, so a worker removed at run time stops
//! being followed (and one added is followed from then on).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::AbortHandle;

use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::config::EventSource;
use super::policies::{KvIndex, WorkerId};
use crate::kv_events::{decode_batch, END_SEQ};

/// How long a replay may take before the gap is left as it is.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// A message's `(seq, payload)`; a description of what is wrong with it.
fn parse(frames: &[Vec<u8>]) -> Result<(u64, &[u8]), String> {
    let [_topic, seq, payload] = frames else {
        return Err(format!("a message of {} frames, not 3", frames.len()));
    };
    let seq = <[u8; 8]>::try_from(seq.as_slice())
        .map(u64::from_be_bytes)
        .map_err(|_| "a sequence number that is not 8 bytes".to_string())?;
    Ok((seq, payload))
}

/// Applies one batch's payload to `index` under `worker`.
fn apply(payload: &[u8], worker: WorkerId, index: &Mutex<KvIndex>) -> Result<(), String> {
    let (_, events) = decode_batch(payload).map_err(|e| e.to_string())?;
    let mut ix = index.lock().unwrap_or_else(|e| e.into_inner());
    ix.apply(worker, &events).map_err(|e| e.to_string())
}

/// The batches `from..until` from the replay socket at `endpoint`, in order (those the
/// worker's buffer still holds).
pub async fn replay_missed(
    endpoint: &str,
    from: u64,
    until: u64,
) -> Result<Vec<(u64, Vec<u8>)>, String> {
    let ask = async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
        let mut req = ZmqMessage::from(Vec::new());
        req.push_back(from.to_be_bytes().to_vec().into());
        dealer.send(req).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        loop {
            let msg = dealer.recv().await.map_err(|e| e.to_string())?;
            let f: Vec<Vec<u8>> = msg.into_vec().iter().map(|b| b.to_vec()).collect();
            let [_, seq, payload] = f.as_slice() else {
                return Err(format!("a replay message of {} frames, not 3", f.len()));
            };
            if seq.as_slice() == END_SEQ {
                return Ok(out);
            }
            let seq = <[u8; 8]>::try_from(seq.as_slice())
                .map(u64::from_be_bytes)
                .map_err(|_| "a replayed sequence number that is not 8 bytes".to_string())?;
            if (from..until).contains(&seq) {
                out.push((seq, payload.clone()));
            }
        }
    };
    tokio::time::timeout(REPLAY_TIMEOUT, ask)
        .await
        .map_err(|_| format!("no end of replay within {REPLAY_TIMEOUT:?}"))?
}

/// Applies one message, first filling a gap before it from `replay`; what went wrong, if
/// anything (the message itself is applied whatever happened to the gap).
async fn receive(
    frames: &[Vec<u8>],
    worker: WorkerId,
    index: &Mutex<KvIndex>,
    next_seq: &mut Option<u64>,
    replay: Option<&str>,
) -> Result<(), String> {
    let (seq, payload) = parse(frames)?;
    let mut gap = None;
    if let Some(want) = next_seq.filter(|&want| seq > want) {
        let got = match replay {
            Some(endpoint) => replay_missed(endpoint, want, seq).await,
            None => Ok(Vec::new()),
        };
        gap = match got {
            Ok(got) => {
                for (_, p) in &got {
                    apply(p, worker, index)?;
                }
                let complete = got.iter().map(|b| b.0).eq(want..seq);
                (!complete)
                    .then(|| format!("batches {want}..{seq} missed (replayed {})", got.len()))
            }
            Err(e) => Some(format!("batches {want}..{seq} missed (replay: {e})")),
        };
    }
    *next_seq = Some(seq.wrapping_add(1));
    apply(payload, worker, index)?;
    gap.map_or(Ok(()), Err)
}

/// Follows `source`'s batches for `worker` forever.
pub async fn subscribe(
    source: EventSource,
    topic: String,
    worker: WorkerId,
    index: Arc<Mutex<KvIndex>>,
) {
    let endpoint = &source.endpoint;
    let warn = |m: &str| eprintln!("kvserve: router: KV events of {endpoint}: {m}");
    loop {
        let mut sock = SubSocket::new();
        let opened = async {
            sock.connect(endpoint).await?;
            sock.subscribe(&topic).await
        };
        if let Err(e) = opened.await {
            warn(&format!("cannot subscribe ({e}); retrying"));
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        // With a replay socket, whatever the worker published before this subscription is
        // asked for when the first batch arrives (a router that joins a running worker).
        let mut next_seq = source.replay.as_ref().map(|_| 0);
        loop {
            match sock.recv().await {
                Ok(msg) => {
                    let frames: Vec<Vec<u8>> = msg.into_vec().iter().map(|b| b.to_vec()).collect();
                    let replay = source.replay.as_deref();
                    if let Err(m) = receive(&frames, worker, &index, &mut next_seq, replay).await {
                        warn(&m);
                    }
                }
                Err(e) => {
                    warn(&format!("the socket broke ({e}); reconnecting"));
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The running subscriber of each worker; every one is stopped on drop.
#[derive(Debug, Default)]
pub struct Subscribers(Mutex<HashMap<WorkerId, AbortHandle>>);

impl Subscribers {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, AbortHandle>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Follows `source` for `worker` on the current tokio runtime (replacing any subscriber
    /// it had).
    pub fn start(
        &self,
        source: EventSource,
        topic: String,
        worker: WorkerId,
        index: Arc<Mutex<KvIndex>>,
    ) {
        let task = tokio::spawn(subscribe(source, topic, worker, index));
        if let Some(old) = self.map().insert(worker, task.abort_handle()) {
            old.abort();
        }
    }

    /// Stops following `worker`.
    pub fn stop(&self, worker: WorkerId) {
        if let Some(h) = self.map().remove(&worker) {
            h.abort();
        }
    }

    /// Stops every subscriber.
    pub fn stop_all(&self) {
        for (_, h) in self.map().drain() {
            h.abort();
        }
    }
}

impl Drop for Subscribers {
    fn drop(&mut self) {
        self.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::{KvEventsConfig, PublisherKind, ZmqEventPublisher};

    const P: usize = 4;

    fn ids(tokens: &[u32]) -> Vec<i64> {
        crate::router::policies::block_ids(tokens, P)
    }

    fn stored(tokens: &[u32], from: usize, to: usize) -> radix_cache::KvEvent {
        crate::router::policies::stored_pages(tokens, from, to, P)
    }

    /// A worker publishes a 4-page chain in two batches before the router subscribes, then
    /// unrelated pages until the subscription is live. With the replay socket the router
    /// places the whole chain (the second batch only because the first was replayed); without
    /// it, the chain is missed.
    fn late_subscription(with_replay: bool) -> (usize, u64) {
        let cfg = KvEventsConfig {
            publisher: Some(PublisherKind::Zmq),
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            topic: "kv".into(),
            buffer_steps: 100,
            ..KvEventsConfig::default()
        };
        let mut p = ZmqEventPublisher::start(&cfg).unwrap();
        let chain: Vec<u32> = (0..16).collect();
        p.publish(vec![stored(&chain, 0, 2)]);
        p.publish(vec![stored(&chain, 2, 4)]);
        // Both sent (to nobody) before the router subscribes.
        for _ in 0..200 {
            if p.info()["batches_sent"] == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(p.info()["batches_sent"], 2);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let index = Arc::new(Mutex::new(KvIndex::default()));
        let source = EventSource {
            endpoint: p.endpoint().into(),
            replay: with_replay.then(|| p.replay_endpoint().unwrap().into()),
        };
        rt.spawn(subscribe(source, "kv".into(), WorkerId(0), index.clone()));
        // Until the subscription reaches the PUB socket its batches go nowhere: publish
        // one-page chains of their own until one arrives (and, with replay, what came before).
        for i in 0..200u32 {
            let other: Vec<u32> = (0..P as u32).map(|t| 1000 + i * 10 + t).collect();
            p.publish(vec![stored(&other, 0, 1)]);
            std::thread::sleep(Duration::from_millis(50));
            let ix = index.lock().unwrap();
            let live = ix.held_pages(WorkerId(0)) > 0;
            if live && (!with_replay || ix.matched_pages(WorkerId(0), &ids(&chain)) == 4) {
                break;
            }
        }
        let ix = index.lock().unwrap();
        ix.check().unwrap();
        (ix.matched_pages(WorkerId(0), &ids(&chain)), ix.unplaced())
    }

    #[test]
    fn a_late_router_fills_the_gap_from_the_replay_socket() {
        assert_eq!(late_subscription(true), (4, 0));
        assert_eq!(late_subscription(false).0, 0);
    }
}
