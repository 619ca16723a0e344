//! The `kv_events` policy's subscribers: one ZMQ SUB socket per worker (the pure-Rust
//! `zeromq` crate) on its `--worker-kv-events` endpoint, each batch (vLLM's three frames
//! `[topic, seq, payload]`) decoded and applied to the shared [`KvIndex`] under that worker's
//! id. A socket that cannot connect or breaks is reopened a second later; a batch that cannot
//! be decoded or applied is reported and skipped, as is a gap in the sequence numbers (the
//! replay socket is not asked: pages whose parent was missed stay out of the index).
//! [`Subscribers`] keeps each worker's task, so a worker removed at run time stops being
//! followed (and one added is followed from then on).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::AbortHandle;

use zeromq::{Socket, SocketRecv, SubSocket};

use super::policies::{KvIndex, WorkerId};
use crate::kv_events::decode_batch;

/// Applies one message's frames to `index`; a description of what is wrong with it.
fn apply(
    frames: &[Vec<u8>],
    worker: WorkerId,
    index: &Mutex<KvIndex>,
    next_seq: &mut Option<u64>,
) -> Result<(), String> {
    let [_topic, seq, payload] = frames else {
        return Err(format!("a message of {} frames, not 3", frames.len()));
    };
    let seq = <[u8; 8]>::try_from(seq.as_slice())
        .map(u64::from_be_bytes)
        .map_err(|_| "a sequence number that is not 8 bytes".to_string())?;
    let gap = next_seq.is_some_and(|want| seq != want);
    *next_seq = Some(seq.wrapping_add(1));
    let (_, events) = decode_batch(payload).map_err(|e| e.to_string())?;
    let mut ix = index.lock().unwrap_or_else(|e| e.into_inner());
    ix.apply(worker, &events).map_err(|e| e.to_string())?;
    if gap {
        return Err(format!("batches missed before {seq}"));
    }
    Ok(())
}

/// Follows `endpoint`'s batches for `worker` forever.
pub async fn subscribe(
    endpoint: String,
    topic: String,
    worker: WorkerId,
    index: Arc<Mutex<KvIndex>>,
) {
    let warn = |m: &str| eprintln!("kvserve: router: KV events of {endpoint}: {m}");
    loop {
        let mut sock = SubSocket::new();
        let opened = async {
            sock.connect(&endpoint).await?;
            sock.subscribe(&topic).await
        };
        if let Err(e) = opened.await {
            warn(&format!("cannot subscribe ({e}); retrying"));
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let mut next_seq = None;
        loop {
            match sock.recv().await {
                Ok(msg) => {
                    let frames: Vec<Vec<u8>> = msg.into_vec().iter().map(|b| b.to_vec()).collect();
                    if let Err(m) = apply(&frames, worker, &index, &mut next_seq) {
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

    /// Follows `endpoint` for `worker` on the current tokio runtime (replacing any subscriber
    /// it had).
    pub fn start(
        &self,
        endpoint: String,
        topic: String,
        worker: WorkerId,
        index: Arc<Mutex<KvIndex>>,
    ) {
        let task = tokio::spawn(subscribe(endpoint, topic, worker, index));
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
