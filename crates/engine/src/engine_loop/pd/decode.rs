//! The decode server's PD queues (SGLang's `disaggregation/decode.py`): a request's receiver
//! first handshakes with its prefill server; then the request waits in the scheduler's
//! preallocation queue until the budget admits it (a row, its decode-side cached prefix locked,
//! slots for the rest), tells the prefill side where to write, and waits in the transfer queue;
//! when its KV and first token have arrived it joins the running batch with no prefill forward.
//!
//! A request aborted while its KV may still be arriving keeps its slots until its receiver
//! has failed (the prefill side acknowledged the abort, or is gone), so no late write can land
//! in slots another request already uses.

use std::collections::HashMap;

use kv_pool::Page;
use scheduler::{FinishedReq, ReqId, Scheduler};
use transfer::pd::{KvManager, KvPoll, KvReceiver};

use crate::disagg::TRANSFER_FAILED;
use crate::engine_loop::{limits_of, track, LiveMap, Submission};
use crate::engine_metrics::PdMetrics;
use crate::setup::ModelExecutor;

/// A request whose receiver is still handshaking (no scheduler id yet).
struct Handshaking {
    receiver: KvReceiver,
    sub: Submission,
}

/// A request in the scheduler's preallocation or transfer queue.
struct Receiving {
    receiver: KvReceiver,
    /// The pages its KV lands in, once preallocated (empty before).
    pages: Vec<Page>,
}

/// The decode half of the loop.
pub struct DecodeSide {
    manager: KvManager,
    handshaking: Vec<Handshaking>,
    /// Requests in the scheduler's preallocation or transfer queue, by id.
    receiving: HashMap<ReqId, Receiving>,
    /// Aborted while KV may still arrive: freed once their receiver has failed.
    draining: HashMap<ReqId, (KvReceiver, String)>,
    /// Kept for its lifetime: the manager's tasks run on it.
    _runtime: tokio::runtime::Runtime,
}

impl DecodeSide {
    /// The decode half over a started manager.
    pub fn new(manager: KvManager, runtime: tokio::runtime::Runtime) -> Self {
        DecodeSide {
            manager,
            handshaking: Vec::new(),
            receiving: HashMap::new(),
            draining: HashMap::new(),
            _runtime: runtime,
        }
    }

    pub(super) fn submit(&mut self, _s: &mut Scheduler, sub: Submission) {
        if let Err(e) = sub.request.sampling.validate() {
            sub.reject(e.to_string());
            return;
        }
        let Some(b) = sub.request.bootstrap.clone() else {
            sub.reject("a decode server needs bootstrap fields");
            return;
        };
        match self.manager.create_receiver(b.room, &b.addr()) {
            Ok(receiver) => self.handshaking.push(Handshaking { receiver, sub }),
            Err(e) => sub.reject(format!("bootstrap room {}: {e}", b.room)),
        }
    }

    pub(super) fn has_work(&self) -> bool {
        !self.handshaking.is_empty() || !self.receiving.is_empty() || !self.draining.is_empty()
    }

    pub(super) fn before_step(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
        live: &mut LiveMap,
    ) {
        self.handshakes(s, exec, live);
        let admitted = match s.pop_preallocated() {
            Ok(a) => a,
            Err(e) => {
                // A pool or cache error is a bug: fail what waits rather than hang it.
                let ids: Vec<ReqId> = self.receiving.keys().copied().collect();
                for id in ids {
                    self.abort(s, id, &format!("preallocation failed: {e}"));
                }
                Vec::new()
            }
        };
        for p in admitted {
            let Some(r) = self.receiving.get_mut(&p.id) else {
                continue;
            };
            r.pages = p.pages.clone();
            if let Err(e) = r.receiver.send_metadata(p.pages, p.prefix_len) {
                self.abort(s, p.id, &format!("{TRANSFER_FAILED}: {e}"));
            }
        }
        let ids: Vec<ReqId> = self.receiving.keys().copied().collect();
        let mut arrived = Vec::new();
        for id in ids {
            if s.request(id).is_none() {
                // The scheduler ended it before preallocating (a request its pool can never
                // hold): no pages of it exist, so only the prefill side needs telling.
                let r = self.receiving.remove(&id).expect("listed");
                r.receiver
                    .abort("the decode server cannot hold this request");
                continue;
            }
            match self.receiving[&id].receiver.poll() {
                KvPoll::Success => {
                    let Receiving { receiver: r, pages } =
                        self.receiving.remove(&id).expect("listed");
                    let first = r.aux().map(|a| a.first_token_ids).unwrap_or_default();
                    arrived.push((id, pages, first));
                }
                KvPoll::Failed => {
                    let r = self.receiving.remove(&id).expect("listed").receiver;
                    let why = format!(
                        "{TRANSFER_FAILED}: {}",
                        r.failure().unwrap_or_else(|| "failed".into())
                    );
                    self.free_when_quiescent(s, id, r, why);
                }
                _ => {}
            }
        }
        // The arrived requests' KV, on a device store still in the host mirror, is copied to
        // the device in one go; then they join the running batch.
        let pages: Vec<Page> = arrived.iter().flat_map(|a| a.1.iter().copied()).collect();
        let landed = exec.land_received(&pages);
        for (id, _, first) in arrived {
            let committed = landed
                .clone()
                .and_then(|()| s.commit_transferred(id, &first).map_err(|e| e.to_string()));
            if let Err(e) = committed {
                let _ = s.abort(id, &format!("{TRANSFER_FAILED}: {e}"));
            }
        }
        self.draining.retain(|&id, (r, why)| {
            if r.poll() == KvPoll::Failed && r.quiescent() {
                let _ = s.abort(id, why);
                false
            } else {
                true
            }
        });
    }

    /// Ends a failed request: at once when no prefill write into its pages can still land,
    /// else once none can.
    fn free_when_quiescent(&mut self, s: &mut Scheduler, id: ReqId, r: KvReceiver, why: String) {
        if r.quiescent() {
            let _ = s.abort(id, &why);
        } else {
            self.draining.insert(id, (r, why));
        }
    }

    /// Receivers that finished their handshake enter the preallocation queue.
    fn handshakes(&mut self, s: &mut Scheduler, exec: &mut ModelExecutor, live: &mut LiveMap) {
        let mut i = 0;
        while i < self.handshaking.len() {
            let h = &self.handshaking[i];
            if h.sub.abandoned() {
                let h = self.handshaking.swap_remove(i);
                h.receiver.abort("the client disconnected");
                continue;
            }
            match h.receiver.poll() {
                KvPoll::Bootstrapping => {
                    i += 1;
                    continue;
                }
                KvPoll::Failed => {
                    let h = self.handshaking.swap_remove(i);
                    let why = h.receiver.failure().unwrap_or_else(|| "failed".into());
                    h.sub.reject(format!("{TRANSFER_FAILED}: {why}"));
                    continue;
                }
                _ => {}
            }
            let Handshaking { receiver, sub } = self.handshaking.swap_remove(i);
            let req = &sub.request;
            match s.add_prealloc_request(
                req.input_ids.clone(),
                limits_of(req),
                req.priority,
                req.extra_key.clone(),
            ) {
                Ok(id) => {
                    track(s, exec, live, id, sub);
                    if live.contains_key(&id) {
                        let pages = Vec::new();
                        self.receiving.insert(id, Receiving { receiver, pages });
                    } else {
                        receiver.abort("the request was refused");
                    }
                }
                Err(e) => {
                    receiver.abort(&e.to_string());
                    sub.reject(e.to_string());
                }
            }
        }
    }

    pub(super) fn abort(&mut self, s: &mut Scheduler, id: ReqId, why: &str) -> bool {
        let Some(Receiving { receiver: r, .. }) = self.receiving.remove(&id) else {
            return self.draining.contains_key(&id);
        };
        r.abort(why);
        self.free_when_quiescent(s, id, r, why.to_string());
        true
    }

    pub(super) fn after_step(&mut self, s: &mut Scheduler) -> Vec<FinishedReq> {
        // Aborts of this pass (failed transfers, drained receivers) are reported here.
        s.take_finished()
    }

    pub(super) fn shutdown(&mut self, s: &mut Scheduler) {
        for h in self.handshaking.drain(..) {
            h.receiver.abort("the server is shutting down");
            h.sub.reject("the server is shutting down");
        }
        for (id, r) in self.receiving.drain() {
            r.receiver.abort("the server is shutting down");
            let _ = s.abort(id, "the server is shutting down");
        }
        for (id, (_, why)) in self.draining.drain() {
            let _ = s.abort(id, &why);
        }
    }

    pub(super) fn metrics(&self, s: &Scheduler) -> PdMetrics {
        PdMetrics {
            queues: vec![
                (
                    "num_decode_prealloc_queue_reqs",
                    (self.handshaking.len() + s.num_prealloc_queued()) as u64,
                ),
                (
                    "num_decode_transfer_queue_reqs",
                    s.num_transferring() as u64,
                ),
            ],
            stats: self.manager.stats(),
        }
    }

    pub(super) fn info(&self, s: &Scheduler) -> serde_json::Value {
        serde_json::json!({
            "mode": "decode",
            "handshake_queue": self.handshaking.len(),
            "prealloc_queue": s.num_prealloc_queued(),
            "transfer_queue": s.num_transferring(),
            "draining": self.draining.len(),
            "transfer": self.manager.stats(),
        })
    }
}
