//! The prefill server's PD queues (SGLang's `disaggregation/prefill.py`): a request waits in
//! the bootstrap queue until its decode server has said where its KV goes, runs through the
//! scheduler with `max_new_tokens = 1` (normal admission, chunked prefill), sends each page as
//! soon as its KV is computed, and, once finished, waits in the inflight queue with its KV held
//! until the transfer ends: then its KV is released into the prefix cache (success) or freed
//! (failure), and its client gets the response.

use std::collections::HashMap;

use kv_pool::Page;
use scheduler::{FinishReason, FinishedReq, ReqId, Scheduler};
use transfer::pd::{KvManager, KvPoll, KvSender, TransferAux};

use crate::disagg::TRANSFER_FAILED;
use crate::engine_loop::{limits_of, track, LiveMap, Submission};
use crate::engine_metrics::PdMetrics;
use crate::setup::ModelExecutor;

/// A request of the bootstrap queue: its sender, waiting for the decode side's handshake.
struct Bootstrapping {
    sender: KvSender,
    sub: Submission,
}

/// An admitted request's sending progress, in page indices of its prompt.
struct Sending {
    sender: KvSender,
    room: u64,
    /// Pages sent so far (the first one is `decode_prefix_len / P`).
    next_page: usize,
    /// One past the prompt's last page.
    end_page: usize,
    /// Finished, its last chunk sent: waiting for the transfer to end (SGLang's inflight
    /// queue). Holds what its client is told then.
    finished: Option<FinishedReq>,
}

/// A send queued for the end of this step: pages `next_page..end` of request `id` (with `aux`:
/// its last chunk).
struct Outgoing {
    id: ReqId,
    pages: Vec<Page>,
    end: usize,
    aux: Option<TransferAux>,
}

/// The prefill half of the loop.
pub struct PrefillSide {
    manager: KvManager,
    page_size: usize,
    /// Bytes of one page in the canonical format (all layers), for `/get_server_info`.
    page_bytes: usize,
    bootstrap: Vec<Bootstrapping>,
    sending: HashMap<ReqId, Sending>,
    /// This step's sends, staged together (one copy from a device store) and sent by
    /// [`Self::after_step`].
    outbox: Vec<Outgoing>,
    /// Kept for its lifetime: the manager's tasks run on it.
    _runtime: tokio::runtime::Runtime,
}

impl PrefillSide {
    /// The prefill half over a started manager.
    pub fn new(
        manager: KvManager,
        page_size: u32,
        page_bytes: usize,
        runtime: tokio::runtime::Runtime,
    ) -> Self {
        PrefillSide {
            manager,
            page_size: page_size as usize,
            page_bytes,
            bootstrap: Vec::new(),
            sending: HashMap::new(),
            outbox: Vec::new(),
            _runtime: runtime,
        }
    }

    /// Where decode servers handshake.
    pub fn bootstrap_addr(&self) -> Option<std::net::SocketAddr> {
        self.manager.bootstrap_addr()
    }

    pub(super) fn submit(&mut self, sub: Submission) {
        if let Err(e) = sub.request.sampling.validate() {
            sub.reject(e.to_string());
            return;
        }
        let room = sub.request.bootstrap.as_ref().map_or(0, |b| b.room);
        match self.manager.create_sender(room) {
            Ok(sender) => self.bootstrap.push(Bootstrapping { sender, sub }),
            Err(e) => sub.reject(format!("bootstrap room {room}: {e}")),
        }
    }

    pub(super) fn has_work(&self) -> bool {
        !self.bootstrap.is_empty() || !self.sending.is_empty()
    }

    /// The bootstrap queue: requests whose decode side answered enter the scheduler.
    pub(super) fn before_step(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
        live: &mut LiveMap,
    ) {
        let mut i = 0;
        while i < self.bootstrap.len() {
            let b = &self.bootstrap[i];
            if b.sub.abandoned() {
                let b = self.bootstrap.swap_remove(i);
                b.sender.abort("the client disconnected");
                continue;
            }
            match b.sender.poll() {
                KvPoll::Bootstrapping => {
                    i += 1;
                    continue;
                }
                KvPoll::Failed => {
                    let b = self.bootstrap.swap_remove(i);
                    let why = b.sender.failure().unwrap_or_else(|| "failed".into());
                    b.sub.reject(format!("{TRANSFER_FAILED}: {why}"));
                    continue;
                }
                _ => {}
            }
            let b = self.bootstrap.swap_remove(i);
            self.admit(s, exec, live, b);
        }
    }

    /// Adds a handshaken request to the scheduler with its KV held at finish.
    fn admit(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
        live: &mut LiveMap,
        b: Bootstrapping,
    ) {
        let Bootstrapping { sender, sub } = b;
        let p = self.page_size;
        let input_len = sub.request.input_ids.len();
        let room = sub.request.bootstrap.as_ref().map_or(0, |b| b.room);
        let Some(info) = sender.transfer_info() else {
            sender.abort("no transfer info after the handshake");
            sub.reject(format!(
                "{TRANSFER_FAILED}: no transfer info after the handshake"
            ));
            return;
        };
        let first_page = info.decode_prefix_len / p;
        let end_page = input_len.div_ceil(p);
        if info.decode_prefix_len % p != 0
            || info.decode_prefix_len >= input_len
            || info.num_pages != end_page - first_page
        {
            let why = format!(
                "the decode side's transfer info does not fit this prompt of {input_len} tokens (page size {p}): decode_prefix_len {}, {} pages",
                info.decode_prefix_len, info.num_pages
            );
            sender.abort(&why);
            sub.reject(format!("{TRANSFER_FAILED}: {why}"));
            return;
        }
        // SGLang forces max_new_tokens to 1 on the prefill side: the decode side generates.
        let mut limits = limits_of(&sub.request);
        limits.max_new_tokens = 1;
        let req = &sub.request;
        let id = match s.add_request(
            req.input_ids.clone(),
            limits,
            req.priority,
            req.extra_key.clone(),
        ) {
            Ok(id) => id,
            Err(e) => {
                sender.abort(&e.to_string());
                sub.reject(e.to_string());
                return;
            }
        };
        if let Err(e) = s.hold_kv_at_finish(id) {
            let _ = s.abort(id, "cannot hold its KV");
            s.take_finished();
            sender.abort(&e.to_string());
            sub.reject(e.to_string());
            return;
        }
        track(s, exec, live, id, sub);
        if !live.contains_key(&id) {
            sender.abort("the request was refused");
            return;
        }
        self.sending.insert(
            id,
            Sending {
                sender,
                room,
                next_page: first_page,
                end_page,
                finished: None,
            },
        );
    }

    pub(super) fn abort(&mut self, s: &mut Scheduler, id: ReqId, why: &str) -> bool {
        let Some(snd) = self.sending.remove(&id) else {
            return false;
        };
        snd.sender.abort(why);
        // Pages an in-flight batch still reads may be reused now: their bytes go to a room
        // that is Failed, which the decode side never uses.
        let _ = s.abort(id, why);
        true
    }

    /// A finished request whose KV is held: queues its last pages with the first token (sent
    /// by [`Self::after_step`]), and keeps it until the transfer ends.
    pub(super) fn hold(&mut self, s: &mut Scheduler, f: &FinishedReq) -> bool {
        if !f.kv_held {
            return false;
        }
        let Some(snd) = self.sending.get_mut(&f.id) else {
            // Held but not ours cannot happen; release rather than leak.
            let _ = s.release_held(f.id);
            return false;
        };
        let aux = TransferAux {
            first_token_ids: f.output_ids.clone(),
            cached_tokens: f.cached_tokens,
            bootstrap_room: snd.room,
        };
        snd.finished = Some(f.clone());
        match pages_to_send(s, self.page_size, f.id, snd, snd.end_page) {
            Ok(pages) => self.outbox.push(Outgoing {
                id: f.id,
                pages,
                end: snd.end_page,
                aux: Some(aux),
            }),
            Err(e) => snd.sender.abort(&e),
        }
        true
    }

    /// Sends the whole pages that the last step computed (and what [`Self::hold`] queued);
    /// finishes the held requests whose transfer ended.
    pub(super) fn after_step(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
    ) -> Vec<FinishedReq> {
        let p = self.page_size;
        let mut done = Vec::new();
        let mut held_failed = Vec::new();
        let ids: Vec<ReqId> = self.sending.keys().copied().collect();
        for id in ids {
            let snd = self.sending.get_mut(&id).expect("listed");
            if snd.finished.is_none() {
                let Some(r) = s.request(id) else {
                    // It ended outside the PD path (the scheduler aborted it): the decode side
                    // must not wait for pages that will never come.
                    let snd = self.sending.remove(&id).expect("listed");
                    snd.sender
                        .abort("the prefill request ended before its KV was sent");
                    continue;
                };
                let ready = (r.committed_len / p).min(snd.end_page);
                if ready > snd.next_page {
                    match pages_to_send(s, p, id, snd, ready) {
                        Ok(pages) => self.outbox.push(Outgoing {
                            id,
                            pages,
                            end: ready,
                            aux: None,
                        }),
                        Err(e) => snd.sender.abort(&e),
                    }
                }
                if snd.sender.poll() == KvPoll::Failed {
                    // Failed mid-prefill (the decode side died or aborted): stop computing.
                    let why = snd.sender.failure().unwrap_or_else(|| "failed".into());
                    self.sending.remove(&id);
                    let _ = s.abort(id, &format!("{TRANSFER_FAILED}: {why}"));
                }
                continue;
            }
            match snd.sender.poll() {
                KvPoll::Success => {
                    let snd = self.sending.remove(&id).expect("listed");
                    let _ = s.release_held(id);
                    done.extend(snd.finished);
                }
                KvPoll::Failed => {
                    let snd = self.sending.remove(&id).expect("listed");
                    let why = format!(
                        "{TRANSFER_FAILED}: {}",
                        snd.sender.failure().unwrap_or_else(|| "failed".into())
                    );
                    let _ = s.abort(id, &why);
                    if let Some(mut f) = snd.finished {
                        f.reason = FinishReason::Abort { message: why };
                        held_failed.push(f);
                    }
                }
                _ => {}
            }
        }
        self.send_outbox(exec);
        // Requests aborted here: the scheduler reports them (a held one may already have
        // been reported when it finished; then its kept report, with the failure, goes out).
        done.extend(s.take_finished());
        for f in held_failed {
            if !done.iter().any(|d| d.id == f.id) {
                done.push(f);
            }
        }
        done
    }

    /// Sends this step's queued pages, of the requests still sending: all their pages
    /// staged from a device store in one copy (nothing to do on the `cpu` backend), then each
    /// request's send. A failure fails those transfers.
    fn send_outbox(&mut self, exec: &mut ModelExecutor) {
        let sending = &mut self.sending;
        self.outbox.retain(|o| sending.contains_key(&o.id));
        if self.outbox.is_empty() {
            return;
        }
        let mut pages: Vec<Page> = self
            .outbox
            .iter()
            .flat_map(|o| o.pages.iter().copied())
            .collect();
        pages.sort_unstable();
        pages.dedup();
        let staged = exec.stage_for_send(&pages);
        for o in self.outbox.drain(..) {
            let snd = sending.get_mut(&o.id).expect("kept above");
            let sent = staged
                .clone()
                .and_then(|()| snd.sender.send(&o.pages, o.aux).map_err(|e| e.to_string()));
            match sent {
                Ok(()) => snd.next_page = o.end,
                Err(e) => snd.sender.abort(&e),
            }
        }
    }

    pub(super) fn shutdown(&mut self, s: &mut Scheduler) {
        self.outbox.clear();
        for b in self.bootstrap.drain(..) {
            b.sender.abort("the server is shutting down");
            b.sub.reject("the server is shutting down");
        }
        for (id, snd) in self.sending.drain() {
            snd.sender.abort("the server is shutting down");
            let _ = s.abort(id, "the server is shutting down");
        }
    }

    pub(super) fn metrics(&self) -> PdMetrics {
        let inflight = self
            .sending
            .values()
            .filter(|x| x.finished.is_some())
            .count();
        PdMetrics {
            queues: vec![
                (
                    "num_prefill_prealloc_queue_reqs",
                    self.bootstrap.len() as u64,
                ),
                ("num_prefill_inflight_queue_reqs", inflight as u64),
            ],
            stats: self.manager.stats(),
        }
    }

    pub(super) fn info(&self, _s: &Scheduler) -> serde_json::Value {
        let inflight = self
            .sending
            .values()
            .filter(|x| x.finished.is_some())
            .count();
        serde_json::json!({
            "mode": "prefill",
            "bootstrap_addr": self.manager.bootstrap_addr().map(|a| a.to_string()),
            "page_bytes": self.page_bytes,
            "bootstrap_queue": self.bootstrap.len(),
            "sending": self.sending.len() - inflight,
            "inflight_queue": inflight,
            "transfer": self.manager.stats(),
        })
    }
}

/// Pages `snd.next_page..end` of request `id`, in position order.
fn pages_to_send(
    s: &Scheduler,
    page_size: usize,
    id: ReqId,
    snd: &Sending,
    end: usize,
) -> Result<Vec<Page>, String> {
    let input_len = s.request(id).ok_or("the request is gone")?.input_len;
    let slots = s.committed_slots(id).map_err(|e| e.to_string())?;
    let start = snd.next_page * page_size;
    let stop = (end * page_size).min(input_len);
    let slots = slots
        .get(start..stop)
        .ok_or("the pages to send are not computed yet")?;
    let pages: Vec<Page> = slots
        .iter()
        .step_by(page_size)
        .map(|slot| slot.page(page_size as u32))
        .collect();
    Ok(pages)
}
