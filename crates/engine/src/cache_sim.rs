//! Trace replay through a prefix cache (`kvserve cache-sim`): how much of a workload's prompts a
//! [`RadixCache`] of a given capacity and eviction policy serves from cache, without a model.
//!
//! Per request `i`, in order, with one cache over a real allocator whose size is the capacity:
//! 1. `policy.advance_to(i)` (Belady reads the future from there);
//! 2. a prompt whose pages exceed the whole capacity is *skipped* (counted, never evicted for);
//! 3. match the prompt: the matched length (page-aligned) counts as cached tokens; lock the
//!    matched path;
//! 4. allocate slots for the missed tokens with `alloc_extend`, evicting first when the
//!    allocator is short (exactly the shortfall, which is a whole number of pages);
//! 5. insert the page-aligned prompt with its slots (matched + new), free any duplicates the
//!    insert reports and the unaligned tail (only whole pages enter the tree, as SGLang);
//! 6. unlock.
//!
//! The prompt is matched whole (SGLang's scheduler keeps at least one token to compute; a replay
//! measures reuse, so it does not) and only the prompt is inserted: a trace carries no output
//! tokens. No request is in flight while another is served, so capacity is the only limit.
//!
//! Counters: `prompt_tokens` counts every request (also skipped ones, so hit rates at different
//! capacities share a denominator); `cached_tokens` only served ones.
//!
//! ## With a host tier (`--enable-hierarchical-cache`)
//! The tree gets a simulated host tier (`crate::sim_tier`: SGLang's write policies, demotion
//! on eviction, no bytes moved) of `--hicache-ratio` × the capacity, and with
//! `--hicache-storage-backend` an unbounded L3 store. Per request, before step 3: with
//! storage, prefetch the prompt beyond its device + host match (`prefetch_from_storage`),
//! take the query's answer (`check_hicache_events`) and poll `check_prefetch_progress` until
//! the stop policy lets the request go (every copy lands at the next poll, so each policy
//! ends with everything that was found). Step 3 then loads a host hit back
//! (`init_load_back`, SGLang's threshold of 10 tokens) and locks the deepest device node;
//! after step 6 the copies' acknowledgements are taken (`check_hicache_events`). A request's
//! cached tokens split into the *device* hit (its match), the *storage* hit (tokens its
//! prefetch brought, then loaded back) and the *host* hit (the rest of the load-back).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kv_pool::{Allocator, ExtendRequest, OwnershipCheck, PagedAllocator, Slot, TokenAllocator};
use radix_cache::policy::{
    policy_from_name, Belady, BuiltinPolicy, CostAware, FutureIndex, LineageTtl,
};
use radix_cache::{
    AnyEvictionPolicy, EvictionPolicy, InsertOptions, NodeId, PrefixCache, RadixCache,
};
use serde::Serialize;

use crate::error::{EngineError, Result};
use scheduler::summary::ratio;

use crate::sim_tier::SimTier;
use crate::workload::Request;

/// Name of the oracle policy (needs the whole workload in advance).
pub const BELADY: &str = Belady::NAME;

/// Every name `--policy` accepts, besides `all`.
pub fn known_policies() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = BuiltinPolicy::ALL.iter().map(|p| p.as_str()).collect();
    names.push(CostAware::NAME);
    names.push(LineageTtl::NAME);
    names.push(BELADY);
    names
}

/// Parses a comma-separated policy list (case-insensitive): SGLang's seven (`lru`, `lfu`,
/// `fifo`, `mru`, `filo`, `priority`, `slru`), `cost-aware`, `lineage-ttl`, `belady`, or `all` for SGLang's
/// seven. Duplicates are dropped, order is kept.
pub fn parse_policies(list: &str) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |name: &str| {
        if !out.iter().any(|n| n == name) {
            out.push(name.to_string());
        }
    };
    for item in list.split(',').map(str::trim) {
        let lower = item.to_ascii_lowercase();
        if lower == "all" {
            BuiltinPolicy::ALL.iter().for_each(|p| push(p.as_str()));
        } else if known_policies().contains(&lower.as_str()) {
            push(&lower);
        } else {
            return Err(EngineError::arg(
                "--policy",
                format!(
                    "unknown eviction policy {item:?}; known: {}, all",
                    known_policies().join(", ")
                ),
            ));
        }
    }
    Ok(out)
}

/// Builds the policy `name` (one of [`known_policies`]); `belady` needs `future`.
pub fn build_policy(name: &str, future: Option<&FutureIndex>) -> Result<AnyEvictionPolicy> {
    if name.eq_ignore_ascii_case(BELADY) {
        let future = future.ok_or_else(|| {
            EngineError::arg(
                "--policy",
                "belady needs the workload's future (a FutureIndex)",
            )
        })?;
        return Ok(Belady::new(future.clone()).into());
    }
    policy_from_name(name).map_err(|e| EngineError::arg("--policy", e.to_string()))
}

/// Rounds a capacity up to a whole number of pages. Zero is an error; so is a capacity the
/// allocator cannot address (more than `u32::MAX` slots). Returns the rounded capacity.
pub fn page_align_capacity(tokens: usize, page_size: u32) -> Result<usize> {
    if page_size == 0 {
        return Err(EngineError::arg("--page-size", "must be at least 1"));
    }
    if tokens == 0 {
        return Err(EngineError::arg(
            "--capacity-tokens",
            "a capacity of 0 tokens holds nothing; give a positive number",
        ));
    }
    let p = page_size as usize;
    let aligned = tokens.div_ceil(p) * p;
    if aligned + p > u32::MAX as usize {
        return Err(EngineError::arg(
            "--capacity-tokens",
            format!("{tokens} tokens is more than the 32-bit slot ids of the pool can address"),
        ));
    }
    Ok(aligned)
}

/// The outcome of one replay (one policy at one capacity): a line of `--format json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    pub policy: String,
    /// Pool size in tokens (a multiple of the page size).
    pub capacity_tokens: usize,
    pub page_size: u32,
    /// Requests replayed, including skipped ones.
    pub requests: usize,
    /// Requests whose prompt does not fit in the whole pool (not served).
    pub skipped_requests: usize,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Tokens evicted from the cache.
    pub evicted_tokens: u64,
    /// Wall time of the replay (workload generation excluded).
    pub seconds: f64,
    /// `prompt_tokens / seconds`.
    pub tokens_per_s: f64,
    /// With a host tier: the hits per tier (their fields join the JSON line; absent without).
    #[serde(flatten)]
    pub tiers: Option<TierHits>,
    /// The fraction of the LRU → Belady gap this replay closes at its capacity,
    /// `(hit_rate − lru) / (belady − lru)`: 0 for LRU, 1 for Belady, negative when behind LRU.
    /// Set by [`fill_gap_closed`] when the sweep replayed both `lru` and `belady` at this
    /// capacity and Belady is ahead; absent (and left out of the JSON line) otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap_closed: Option<f64>,
}

/// Sets every result's [`ReplayResult::gap_closed`] from the `lru` and `belady` results at its
/// capacity in `results` (one sweep: one page size, one tier setup); `None` where either is missing
/// or Belady is not ahead of LRU (nothing to close).
pub fn fill_gap_closed(results: &mut [ReplayResult]) {
    let find = |all: &[ReplayResult], name: &str, r: &ReplayResult| {
        all.iter()
            .find(|o| o.policy == name && o.capacity_tokens == r.capacity_tokens)
            .map(|o| o.hit_rate)
    };
    let gaps: Vec<Option<f64>> = results
        .iter()
        .map(|r| {
            let lru = find(results, BuiltinPolicy::Lru.as_str(), r)?;
            let belady = find(results, BELADY, r)?;
            (belady > lru).then(|| (r.hit_rate - lru) / (belady - lru))
        })
        .collect();
    for (r, g) in results.iter_mut().zip(gaps) {
        r.gap_closed = g;
    }
}

/// A replay's hits per tier (`cached_tokens` = device + host + storage).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierHits {
    /// `--hicache-write-policy`.
    pub write_policy: String,
    /// Host tier size in tokens (`--hicache-ratio` × capacity, SGLang's rounding).
    pub host_capacity_tokens: usize,
    /// Whether an L3 store was behind the host tier.
    pub storage: bool,
    /// Prompt tokens matched on the device.
    pub device_hit_tokens: u64,
    /// Prompt tokens loaded back from the host tier (not counting storage hits).
    pub host_hit_tokens: u64,
    /// Prompt tokens prefetched from L3 storage and loaded back.
    pub storage_hit_tokens: u64,
    /// `device_hit_tokens / prompt_tokens`.
    pub device_hit_rate: f64,
    /// `host_hit_tokens / prompt_tokens`.
    pub host_hit_rate: f64,
    /// `storage_hit_tokens / prompt_tokens`.
    pub storage_hit_rate: f64,
}

/// What a replay checks when asked (`--check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplayOptions {
    /// After every request: nothing stays locked, and `evictable + protected = capacity −
    /// available`; after the run: the tree's invariants and the kv-pool ownership partition
    /// (free pages and tree pages are exactly the pool).
    pub check: bool,
}

/// Replays `requests` in order through a [`RadixCache`] with `policy` over an allocator of
/// `capacity_tokens` slots (a positive multiple of `page_size`; see [`page_align_capacity`]).
/// `progress` is called with the number of requests done since its last call. The cache alone,
/// no scheduler: for a replay through the whole scheduler with a cost model, see
/// `scheduler::replay`.
pub fn replay_through_cache(
    requests: &[Request],
    policy: AnyEvictionPolicy,
    capacity_tokens: usize,
    page_size: u32,
    opts: ReplayOptions,
    progress: &dyn Fn(u64),
) -> Result<ReplayResult> {
    replay_through_tiers(
        requests,
        policy,
        capacity_tokens,
        page_size,
        None,
        opts,
        progress,
    )
}

/// [`replay_through_cache`] with an optional host tier (and L3 store) behind the cache: see
/// the module documentation.
pub fn replay_through_tiers(
    requests: &[Request],
    policy: AnyEvictionPolicy,
    capacity_tokens: usize,
    page_size: u32,
    tier: Option<&SimTier>,
    opts: ReplayOptions,
    progress: &dyn Fn(u64),
) -> Result<ReplayResult> {
    let aligned = page_align_capacity(capacity_tokens, page_size)?;
    if aligned != capacity_tokens {
        return Err(EngineError::arg(
            "--capacity-tokens",
            format!("{capacity_tokens} is not a multiple of the page size {page_size}"),
        ));
    }
    let mut cache = RadixCache::new(page_size, policy);
    let mut hits = None;
    if let Some(t) = tier {
        let host = t.host_slots(capacity_tokens, page_size, None)?;
        cache = t.attach(cache, host)?;
        hits = Some(TierHits {
            write_policy: t.setup.write_policy.to_string(),
            host_capacity_tokens: host,
            storage: t.has_storage(),
            device_hit_tokens: 0,
            host_hit_tokens: 0,
            storage_hit_tokens: 0,
            device_hit_rate: 0.0,
            host_hit_rate: 0.0,
            storage_hit_rate: 0.0,
        });
    }
    if page_size == 1 {
        let alloc = TokenAllocator::new(capacity_tokens)?;
        Replay::new(alloc, cache, hits, opts).run(requests, progress)
    } else {
        let alloc = PagedAllocator::new(capacity_tokens, page_size)?;
        Replay::new(alloc, cache, hits, opts).run(requests, progress)
    }
}

struct Replay<A: Allocator> {
    alloc: A,
    cache: RadixCache,
    capacity: usize,
    page: usize,
    opts: ReplayOptions,
    slots: Vec<Slot>,
    skipped: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    evicted_tokens: u64,
    /// With a host tier: the hits per tier so far.
    tiers: Option<TierHits>,
}

impl<A: Allocator> Replay<A> {
    fn new(alloc: A, cache: RadixCache, tiers: Option<TierHits>, opts: ReplayOptions) -> Self {
        Replay {
            capacity: alloc.size(),
            alloc,
            page: cache.page_size() as usize,
            cache,
            tiers,
            opts,
            slots: Vec::new(),
            skipped: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            evicted_tokens: 0,
        }
    }

    fn run(mut self, requests: &[Request], progress: &dyn Fn(u64)) -> Result<ReplayResult> {
        const PROGRESS_EVERY: usize = 256;
        let start = Instant::now();
        for (i, req) in requests.iter().enumerate() {
            self.cache.policy_mut().advance_to(i as u64);
            self.serve(i as u64, &req.tokens)?;
            // The copies this request started are acknowledged (SGLang's per-step
            // `check_hicache_events`): written nodes unlock, loads finish.
            self.cache.check_hicache_events()?;
            if self.opts.check {
                self.check_accounting(&format!("request {i}"))?;
            }
            if (i + 1) % PROGRESS_EVERY == 0 {
                progress(PROGRESS_EVERY as u64);
            }
        }
        progress((requests.len() % PROGRESS_EVERY) as u64);
        let seconds = start.elapsed().as_secs_f64();
        self.settle()?;
        if self.opts.check {
            self.check_ownership()?;
        }
        Ok(ReplayResult {
            policy: self.cache.policy_name().to_string(),
            capacity_tokens: self.capacity,
            page_size: self.page as u32,
            requests: requests.len(),
            skipped_requests: self.skipped,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            hit_rate: ratio(self.cached_tokens as f64, self.prompt_tokens as f64),
            evicted_tokens: self.evicted_tokens,
            seconds,
            tokens_per_s: if seconds > 0.0 {
                self.prompt_tokens as f64 / seconds
            } else {
                0.0
            },
            tiers: self.tiers.map(|mut t| {
                let prompt = self.prompt_tokens as f64;
                t.device_hit_rate = ratio(t.device_hit_tokens as f64, prompt);
                t.host_hit_rate = ratio(t.host_hit_tokens as f64, prompt);
                t.storage_hit_rate = ratio(t.storage_hit_tokens as f64, prompt);
                t
            }),
            gap_closed: None,
        })
    }

    /// With a host tier: takes acknowledgements until no copy is in flight (backups to L3
    /// queued by the last request's acks), so the final checks see a settled tree.
    fn settle(&mut self) -> Result<()> {
        for _ in 0..4 {
            match self.cache.tier_stats() {
                Some(t) if t.in_flight() > 0 => self.cache.check_hicache_events()?,
                _ => break,
            }
        }
        Ok(())
    }

    /// With storage: the L3 prefetch of request `rid` at its arrival, polled until its stop
    /// policy lets it go. Returns the tokens it brought into the host tier.
    fn prefetch(&mut self, rid: u64, tokens: &[u32]) -> Result<u64> {
        const MAX_POLLS: usize = 8;
        if !self.tiers.as_ref().is_some_and(|t| t.storage) {
            return Ok(0);
        }
        let Some(before) = self.cache.tier_stats() else {
            return Ok(0);
        };
        self.cache.prefetch_from_storage(rid, tokens, None)?;
        // The query's answer starts the prefetch of the pages found.
        self.cache.check_hicache_events()?;
        let mut polls = 0;
        while !self.cache.check_prefetch_progress(rid, 0.0)? {
            polls += 1;
            if polls > MAX_POLLS {
                return Err(EngineError::CheckFailed {
                    after: format!("request {rid}'s prefetch"),
                    message: format!("still waiting after {MAX_POLLS} polls"),
                });
            }
            self.cache.check_hicache_events()?;
        }
        let after = self.cache.tier_stats().unwrap_or(before);
        Ok(after.storage_hit_tokens - before.storage_hit_tokens)
    }

    /// The match of step 3 with a host tier: a host hit is loaded back into device slots
    /// (appended to `self.slots`) when it is long enough and the pool can hold it beside the
    /// rest of the prompt. Returns the tokens now on device and the node to lock.
    fn match_and_load_back(&mut self, tokens: &[u32], pages_needed: usize) -> Result<Hit> {
        let m = self.cache.match_prefix(tokens, None, &mut self.slots);
        let mut hit = Hit {
            device: m.len,
            loaded: 0,
            node: m.last_node,
        };
        if m.host_hit_len > 0 {
            // Room for the load-back first, evicting as step 4 does (so `evicted_tokens` counts
            // it), with the matched path locked so the eviction cannot take it.
            let available = self.alloc.available_size();
            if m.host_hit_len > available {
                self.cache.inc_lock_ref(m.last_node)?;
                let freed = self
                    .cache
                    .evict(m.host_hit_len - available, &mut self.alloc);
                self.cache.dec_lock_ref(m.last_node)?;
                self.evicted_tokens += freed? as u64;
            }
            let rest = pages_needed.saturating_sub(m.len + m.host_hit_len);
            let quota =
                (self.alloc.available_size() + self.cache.evictable_size()).saturating_sub(rest);
            let lb = self.cache.init_load_back(
                m.last_host_node,
                &mut self.slots,
                &mut self.alloc,
                quota,
            )?;
            hit.loaded = lb.loaded;
            hit.node = lb.last_node;
        }
        Ok(hit)
    }

    /// Serves one prompt (steps 2–6 of the module documentation).
    fn serve(&mut self, rid: u64, tokens: &[u32]) -> Result<()> {
        let p = self.page;
        let len = tokens.len();
        self.prompt_tokens += len as u64;
        let pages_needed = len.div_ceil(p) * p;
        if pages_needed > self.capacity {
            self.skipped += 1;
            return Ok(());
        }
        let fetched = self.prefetch(rid, tokens)?;
        self.slots.clear();
        let hit = self.match_and_load_back(tokens, pages_needed)?;
        let cached = hit.device + hit.loaded;
        self.cached_tokens += cached as u64;
        if let Some(t) = self.tiers.as_mut() {
            let from_storage = fetched.min(hit.loaded as u64);
            t.device_hit_tokens += hit.device as u64;
            t.storage_hit_tokens += from_storage;
            t.host_hit_tokens += hit.loaded as u64 - from_storage;
        }
        self.cache.inc_lock_ref(hit.node)?;
        // New slots: the missed pages (the match is page-aligned).
        let need = pages_needed - cached;
        let available = self.alloc.available_size();
        if need > available {
            self.evicted_tokens += self.cache.evict(need - available, &mut self.alloc)? as u64;
            if need > self.alloc.available_size() {
                return Err(EngineError::CheckFailed {
                    after: format!("evicting for a {len}-token prompt"),
                    message: format!(
                        "{} tokens free after eviction, {need} needed; capacity {}, \
                         evictable {}, protected {}",
                        self.alloc.available_size(),
                        self.capacity,
                        self.cache.evictable_size(),
                        self.cache.protected_size()
                    ),
                });
            }
        }
        if len > cached {
            let extend = ExtendRequest {
                prefix_len: cached,
                seq_len: len,
                last_loc: self.slots.last().copied(),
            };
            self.alloc
                .alloc_extend(std::slice::from_ref(&extend), &mut self.slots)?;
        }
        let aligned = len / p * p;
        let ins = self.cache.insert(
            &tokens[..aligned],
            None,
            &self.slots[..aligned],
            InsertOptions::default(),
        )?;
        if ins.prefix_len > cached {
            self.alloc.free(&self.slots[cached..ins.prefix_len])?;
        }
        let owned_to = ins.prefix_len + ins.inserted;
        if len > owned_to {
            self.alloc.free(&self.slots[owned_to..len])?;
        }
        self.cache.dec_lock_ref(hit.node)?;
        Ok(())
    }

    fn check_accounting(&self, after: &str) -> Result<()> {
        let (evictable, protected) = (self.cache.evictable_size(), self.cache.protected_size());
        let used = self.capacity - self.alloc.available_size();
        if protected != 0 || evictable + protected != used {
            return Err(EngineError::CheckFailed {
                after: after.to_string(),
                message: format!(
                    "evictable {evictable} + protected {protected} != capacity {} − available {} \
                     (or something stayed locked)",
                    self.capacity,
                    self.alloc.available_size()
                ),
            });
        }
        Ok(())
    }

    fn check_ownership(&self) -> Result<()> {
        let failed = |message: String| EngineError::CheckFailed {
            after: "the replay".into(),
            message,
        };
        self.cache.check_invariants().map_err(failed)?;
        let mut check = OwnershipCheck::new(&self.alloc);
        self.cache.claim_ownership(&mut check);
        check.finish().map_err(|v| failed(v.to_string()))?;
        self.check_accounting("the replay")
    }
}

/// What step 3 found: tokens matched on device, tokens loaded back from host after them, and
/// the deepest device node (to lock).
struct Hit {
    device: usize,
    loaded: usize,
    node: NodeId,
}

/// A sweep: every policy at every capacity, over one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepConfig {
    /// Policy names (see [`parse_policies`]).
    pub policies: Vec<String>,
    /// Capacities in tokens, each a positive multiple of the page size.
    pub capacities: Vec<usize>,
    pub page_size: u32,
    /// Checks (see [`ReplayOptions`]).
    pub check: bool,
    /// Replays run at once on threads (at least 1).
    pub jobs: usize,
    /// A host tier (and L3 store) behind every replay's cache (`--enable-hierarchical-cache`).
    pub tier: Option<SimTier>,
}

/// Runs every (policy, capacity) replay of `cfg`, `cfg.jobs` at a time on scoped threads.
/// Results come policy-major in the order given, with [`fill_gap_closed`] applied. `progress`
/// is called with requests done.
pub fn run_sweep(
    requests: &[Request],
    cfg: &SweepConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<ReplayResult>> {
    for &c in &cfg.capacities {
        page_align_capacity(c, cfg.page_size)?;
    }
    let future = cfg
        .policies
        .iter()
        .any(|p| p.eq_ignore_ascii_case(BELADY))
        .then(|| FutureIndex::new(cfg.page_size, requests.iter().map(|r| r.tokens.as_slice())));
    // Build every policy first, so a bad name fails before any replay runs.
    let mut jobs = Vec::new();
    for name in &cfg.policies {
        for &capacity in &cfg.capacities {
            jobs.push(Mutex::new(Some((
                build_policy(name, future.as_ref())?,
                capacity,
            ))));
        }
    }
    let opts = ReplayOptions { check: cfg.check };
    let results: Vec<Mutex<Option<Result<ReplayResult>>>> =
        jobs.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let worker = || loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(job) = jobs.get(k) else { break };
        let (policy, capacity) = lock(job).take().expect("each job is taken once");
        let r = replay_through_tiers(
            requests,
            policy,
            capacity,
            cfg.page_size,
            cfg.tier.as_ref(),
            opts,
            progress,
        );
        *lock(&results[k]) = Some(r);
    };
    let threads = cfg.jobs.clamp(1, jobs.len().max(1));
    if threads == 1 {
        worker();
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(worker);
            }
        });
    }
    let mut results = results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every job ran")
        })
        .collect::<Result<Vec<_>>>()?;
    fill_gap_closed(&mut results);
    Ok(results)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_lists() {
        assert_eq!(parse_policies("lru").unwrap(), ["lru"]);
        assert_eq!(
            parse_policies("all").unwrap(),
            ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]
        );
        assert_eq!(
            parse_policies("Belady, lru,cost-aware,LRU").unwrap(),
            ["belady", "lru", "cost-aware"]
        );
        let err = parse_policies("lru,nope").unwrap_err().to_string();
        assert!(
            err.starts_with("--policy: unknown eviction policy \"nope\""),
            "{err}"
        );
        assert!(build_policy("belady", None).is_err());
    }

    #[test]
    fn capacities_round_up_to_pages() {
        assert_eq!(page_align_capacity(1000, 512).unwrap(), 1024);
        assert_eq!(page_align_capacity(1024, 512).unwrap(), 1024);
        assert!(page_align_capacity(0, 16).is_err());
        assert!(page_align_capacity(usize::MAX / 2, 16).is_err());
        let err = replay_through_cache(
            &[],
            policy_from_name("lru").unwrap(),
            1000,
            512,
            ReplayOptions::default(),
            &|_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a multiple"), "{err}");
    }
}
