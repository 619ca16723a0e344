//! The scheduler's side of the hierarchical cache (SGLang's HiCache calls in `scheduler.py`
//! and `schedule_policy.py`): acknowledging the cache controller's completed copies once per
//! step, loading a host-tier hit back into device slots at admission, L3 prefetch at arrival
//! and its stop check in the admission scan, stopping waiting requests' prefetches whose locks
//! hold memory a running request or a blocked queue head needs, and retraction to the host
//! tier.
//!
//! Every call is a no-op on a cache without a host tier (their `PrefixCache` defaults), so a
//! scheduler without HiCache decides exactly as before.

use kv_pool::{ceil_to_page, Allocator};
use radix_cache::{PrefixCache, PrefixState};

use super::Scheduler;
use crate::error::Result;
use crate::req::ReqId;
use crate::schedule_policy::PrefillAdder;

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Processes the cache controller's acknowledgements (SGLang's `check_hicache_events`):
    /// unlocks nodes whose device → host copy or load-back finished, hands backed-up pages to
    /// L3, takes in prefetch answers. Called at the start of every step; also by an idle engine
    /// so that copies in flight settle.
    pub fn poll_cache_events(&mut self) -> Result<()> {
        self.cache.check_hicache_events()?;
        Ok(())
    }

    /// Whether the cache has copies in flight (a scheduler with copies in flight is not idle:
    /// their nodes stay locked until [`poll_cache_events`](Self::poll_cache_events) takes
    /// their acks).
    pub fn has_cache_io(&self) -> bool {
        self.cache.tier_ops_in_flight() > 0
    }

    /// Sets the wall-clock time (seconds since any fixed origin) the prefetch timeout policy
    /// measures against; the engine calls it before every step. Without it the time is 0, so a
    /// `timeout` prefetch ends only when it completes.
    pub fn set_time(&mut self, now_s: f64) {
        self.now_s = now_s;
    }

    /// At arrival: starts an L3 prefetch of the prompt beyond its device + host hit, if the
    /// cache has storage (SGLang's `prefetch_from_storage`).
    pub(super) fn start_prefetch(&mut self, id: ReqId) -> Result<()> {
        let r = &self.reqs[&id];
        let key = &r.tokens[..r.tokens.len() - 1];
        self.cache
            .prefetch_from_storage(id.0, key, r.extra_key.as_deref())?;
        Ok(())
    }

    /// In the admission scan: whether a waiting request's prefetch lets it proceed (its stop
    /// policy); a stopped prefetch's pages join the host tier first.
    pub(super) fn prefetch_ready(&mut self, id: ReqId) -> Result<bool> {
        Ok(self.cache.check_prefetch_progress(id.0, self.now_s)?)
    }

    /// Admission is stuck: nothing runs and the queue's head is out of tokens. If the cache's
    /// protected tokens are then only prefetch anchors (no write or load-back in flight locks
    /// nodes), waiting requests' L3 prefetches hold memory the head needs and would hold it
    /// until each of them is scanned, which the head blocks: stop them (see
    /// [`release_waiting_prefetches`](Self::release_waiting_prefetches)).
    pub(super) fn release_blocking_prefetches(&mut self) -> Result<()> {
        let Some(t) = self.cache.tier_stats() else {
            return Ok(());
        };
        if t.writes_queued + t.writes_retried == t.writes_acked
            && t.loads_queued + t.loads_retried == t.loads_acked
        {
            self.release_waiting_prefetches()?;
        }
        Ok(())
    }

    /// Stops every waiting request's L3 prefetch (its request goes on without the storage
    /// hit), unlocking the cached prefixes their anchors hold: memory a running request or
    /// the queue's head needs (beyond SGLang, whose scheduler can stall or abort the last
    /// running request there). Returns whether that unlocked anything.
    pub(super) fn release_waiting_prefetches(&mut self) -> Result<bool> {
        let before = self.cache.protected_size();
        if before == 0 || self.cache.tier_stats().is_none() {
            return Ok(false);
        }
        let waiting: Vec<ReqId> = self.waiting.iter().copied().collect();
        for id in waiting {
            self.cache.release_prefetch(id.0)?;
        }
        Ok(self.cache.protected_size() < before)
    }

    /// After a request's match: loads its host-tier hit back into device slots (SGLang's
    /// `init_load_back` in `PrefillAdder.add_one_req`), when the chain is long enough and the
    /// pool can hold it and the request's own needs. The loaded tokens join its prefix.
    ///
    /// As SGLang, only when `adder` would admit the request (its budget checks come before the
    /// load-back there, with the matched prefix locked): a chain loaded for a request that is
    /// then rejected stays locked until the load's ack, and memory it holds could cost a
    /// running request its decode step. The chain then takes only the budget's
    /// `rem_total_tokens` (free + evictable tokens not promised to requests admitted earlier in
    /// the pass) less the request's own extend, reserved output and a page.
    pub(super) fn load_back(&mut self, id: ReqId, adder: &PrefillAdder) -> Result<()> {
        let r = &self.reqs[&id];
        if r.host_hit_len == 0 {
            return Ok(());
        }
        let p = self.cfg.page_size as usize;
        let reserve = r.remaining_new_tokens().min(self.cfg.clip_max_new_tokens);
        // SGLang: `total_tokens >= rem_total_tokens` → NO_TOKEN (the host hit counted as input);
        // `real_input_tokens >= rem_input_tokens` with others admitted → OTHER.
        // Checked with the device prefix locked (SGLang's `_lock_node(req.last_node)`), so its
        // tokens no longer count as free.
        let total = (r.extend_input_len() + reserve + p) as f64;
        let real_input = ceil_to_page(r.extend_input_len() - r.host_hit_len, p) as i64;
        let prefix_node = r.prefix.last_node;
        self.cache.inc_lock_ref(prefix_node)?;
        if total >= adder.rem_total_tokens(&self.cache, &self.alloc)
            || (adder.rem_chunk_tokens.is_none()
                && adder.admitted > 0
                && real_input >= adder.rem_input_tokens)
        {
            self.cache.dec_lock_ref(prefix_node)?;
            return Ok(());
        }
        let room = adder.rem_total_tokens(&self.cache, &self.alloc);
        let loaded = self.load_back_locked(id, reserve, room);
        self.cache.dec_lock_ref(prefix_node)?;
        loaded
    }

    /// [`load_back`](Self::load_back) once the budget allows it (the prefix locked), within
    /// `room` (the budget's `rem_total_tokens`).
    pub(super) fn load_back_locked(&mut self, id: ReqId, reserve: usize, room: f64) -> Result<()> {
        let r = &self.reqs[&id];
        let need = r.extend_input_len() - r.host_hit_len + reserve + self.cfg.page_size as usize;
        let quota = (room.max(0.0) as usize).saturating_sub(need);
        let r = self.reqs.get_mut(&id).expect("request");
        let mut slots = std::mem::take(&mut r.prefix.prefix_slots);
        let last_host_node = r.last_host_node;
        let loaded = self
            .cache
            .init_load_back(last_host_node, &mut slots, &mut self.alloc, quota);
        let r = self.reqs.get_mut(&id).expect("request");
        match loaded {
            Ok(lb) => {
                r.prefix = PrefixState {
                    cache_protected_len: r.prefix.cache_protected_len + lb.loaded,
                    last_node: lb.last_node,
                    prefix_slots: slots,
                };
                r.committed_len += lb.loaded;
                r.host_hit_len = 0;
                self.stats.host_hit_tokens += lb.loaded;
                Ok(())
            }
            Err(e) => {
                r.prefix.prefix_slots = slots;
                Err(e.into())
            }
        }
    }

    /// A PD decode server's load-back at preallocation (beyond SGLang, whose decode side has
    /// no host tier to hit): a matched request's host hit is loaded back when the pass's
    /// `allocatable` budget holds it besides the rest of the request's need (its delta and the
    /// decode reserve), so only the tokens after it are transferred. Returns the tokens loaded.
    pub(super) fn prealloc_load_back(&mut self, id: ReqId, allocatable: i64) -> Result<usize> {
        let r = &self.reqs[&id];
        if r.host_hit_len == 0 || allocatable <= 0 {
            return Ok(0);
        }
        let before = r.committed_len;
        let prefix_node = r.prefix.last_node;
        self.cache.inc_lock_ref(prefix_node)?;
        let reserve = self.cfg.num_reserved_decode_tokens;
        let loaded = self.load_back_locked(id, reserve, allocatable as f64);
        self.cache.dec_lock_ref(prefix_node)?;
        loaded?;
        Ok(self.reqs[&id].committed_len - before)
    }

    /// Retraction to the host tier (beyond SGLang, which recomputes): a retracted request's
    /// committed tokens enter the cache and are backed up to host now, so eviction demotes
    /// them instead of dropping them and the request resumes with a load-back. Returns whether
    /// the cache has a host tier (otherwise the caller releases as SGLang does).
    pub(super) fn retract_to_host(&mut self, id: ReqId) -> Result<bool> {
        if self.cache.tier_stats().is_none() {
            return Ok(false);
        }
        self.release_kv(id, true)?;
        let r = &self.reqs[&id];
        let peek = self
            .cache
            .peek_prefix(&r.tokens[..r.committed_len], r.extra_key.as_deref());
        if let Some(node) = peek.deepest {
            self.cache.write_back_path(node)?;
            // Its KV must still be in host memory when it resumes.
            if self.cache.pin_host(node)? {
                self.reqs.get_mut(&id).expect("request").host_pin = Some(node);
            }
        }
        Ok(true)
    }

    /// Drops the pin a retraction to host took on a request's KV (it was admitted again, or it
    /// ended).
    pub(super) fn release_host_pin(&mut self, id: ReqId) -> radix_cache::Result<()> {
        match self.reqs.get_mut(&id).and_then(|r| r.host_pin.take()) {
            Some(node) => self.cache.unpin_host(node),
            None => Ok(()),
        }
    }
}
