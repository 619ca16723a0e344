//! [`ImmediateController`]: a [`CacheController`] for tests of hierarchical caches and
//! schedulers. Every operation completes at the next [`poll_acks`](CacheController::poll_acks)
//! (in queue order), deterministically; optionally it models the bytes as one tag per slot, so
//! a test can check that a load-back put the right rows at the right device slots.

use std::collections::{HashMap, VecDeque};

use crate::ids::Slot;
use crate::tier::{Ack, AckOutcome, CacheController, OpId, PageKey, TierOpKind};

/// One queued operation, as the controller's log renders it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoggedOp {
    /// `write(device, host)`.
    Write {
        /// The device slots read.
        device: Vec<Slot>,
        /// The host slots written.
        host: Vec<Slot>,
    },
    /// `load(host, device)`.
    Load {
        /// The host slots read.
        host: Vec<Slot>,
        /// The device slots written.
        device: Vec<Slot>,
    },
    /// `backup(host, keys)`.
    Backup {
        /// The host slots read.
        host: Vec<Slot>,
        /// One key per page.
        keys: Vec<PageKey>,
    },
    /// `query(keys)`.
    Query {
        /// The keys asked about.
        keys: Vec<PageKey>,
    },
    /// `prefetch(keys, host)`.
    Prefetch {
        /// The keys fetched.
        keys: Vec<PageKey>,
        /// The host slots written.
        host: Vec<Slot>,
    },
}

/// A deterministic [`CacheController`]: each operation completes at the next poll. With
/// [`with_tags`](Self::with_tags) it moves one `u64` tag per slot between a device array, a
/// host array and an in-memory L3 map (keyed by page key, one tag vector per page), so tests
/// can check where rows went; `set_device_tag` plays the model writing a row.
#[derive(Debug, Default)]
pub struct ImmediateController {
    next: u64,
    pending: VecDeque<Ack>,
    /// Every operation queued, in order.
    pub log: Vec<(OpId, LoggedOp)>,
    /// Tags of device slots (empty unless `with_tags`).
    pub device: Vec<u64>,
    /// Tags of host slots (empty unless `with_tags`).
    pub host: Vec<u64>,
    /// The simulated L3 store (`None`: storage disabled).
    pub storage: Option<HashMap<PageKey, Vec<u64>>>,
    /// When set, every L3 operation fails (an unreachable store).
    pub storage_down: bool,
    /// When set, every load-back fails, leaving its device rows tagged [`Self::GARBAGE`] (a
    /// device that lost the copy half-way).
    pub loads_fail: bool,
    /// When set, every device → host write fails, leaving its host rows tagged
    /// [`Self::GARBAGE`].
    pub writes_fail: bool,
    page_size: usize,
}

impl ImmediateController {
    /// The tag a failed copy leaves in its destination rows.
    pub const GARBAGE: u64 = u64::MAX;

    /// A controller that only logs and acknowledges (no tags, no storage).
    pub fn new() -> Self {
        Self::default()
    }

    /// A controller modelling `device_slots` device rows and `host_slots` host rows as tags
    /// (all 0), at page size `page_size` (for L3 pages).
    pub fn with_tags(device_slots: usize, host_slots: usize, page_size: u32) -> Self {
        ImmediateController {
            device: vec![0; device_slots],
            host: vec![0; host_slots],
            page_size: page_size as usize,
            ..Self::default()
        }
    }

    /// Attaches an (empty) in-memory L3 store.
    pub fn with_storage(mut self) -> Self {
        self.storage = Some(HashMap::new());
        self
    }

    /// Plays the model writing a device row.
    pub fn set_device_tag(&mut self, slot: Slot, tag: u64) {
        if let Some(t) = self.device.get_mut(slot.index()) {
            *t = tag;
        }
    }

    /// Operations queued and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn queue(&mut self, kind: TierOpKind, outcome: AckOutcome, op: LoggedOp) -> OpId {
        let id = OpId(self.next);
        self.next += 1;
        self.log.push((id, op));
        self.pending.push_back(Ack {
            op: id,
            kind,
            outcome,
        });
        id
    }

    fn copy(from: &[u64], to: &mut [u64], src: &[Slot], dst: &[Slot]) {
        if from.is_empty() || to.is_empty() {
            return;
        }
        for (s, d) in src.iter().zip(dst) {
            if let (Some(&v), Some(t)) = (from.get(s.index()), to.get_mut(d.index())) {
                *t = v;
            }
        }
    }
}

impl CacheController for ImmediateController {
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId {
        let outcome = if self.writes_fail {
            for h in host {
                if let Some(t) = self.host.get_mut(h.index()) {
                    *t = Self::GARBAGE;
                }
            }
            AckOutcome::Failed("the device lost the copy".into())
        } else {
            Self::copy(&self.device, &mut self.host, device, host);
            AckOutcome::Done
        };
        let op = LoggedOp::Write {
            device: device.to_vec(),
            host: host.to_vec(),
        };
        self.queue(TierOpKind::Write, outcome, op)
    }

    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId {
        let outcome = if self.loads_fail {
            for d in device {
                self.set_device_tag(*d, Self::GARBAGE);
            }
            AckOutcome::Failed("the device lost the copy".into())
        } else {
            Self::copy(&self.host, &mut self.device, host, device);
            AckOutcome::Done
        };
        let op = LoggedOp::Load {
            host: host.to_vec(),
            device: device.to_vec(),
        };
        self.queue(TierOpKind::Load, outcome, op)
    }

    fn wait(&mut self, _op: OpId) {}

    fn poll_acks(&mut self) -> Vec<Ack> {
        self.pending.drain(..).collect()
    }

    fn storage_enabled(&self) -> bool {
        self.storage.is_some()
    }

    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId {
        let outcome = if self.storage_down {
            AckOutcome::Failed("storage unreachable".into())
        } else {
            let p = self.page_size.max(1);
            if let Some(store) = self.storage.as_mut() {
                for (i, key) in keys.iter().enumerate() {
                    let rows = host
                        .iter()
                        .skip(i * p)
                        .take(p)
                        .map(|s| self.host.get(s.index()).copied().unwrap_or(0))
                        .collect();
                    store.insert(*key, rows);
                }
            }
            AckOutcome::Done
        };
        let op = LoggedOp::Backup {
            host: host.to_vec(),
            keys: keys.to_vec(),
        };
        self.queue(TierOpKind::Backup, outcome, op)
    }

    fn query(&mut self, keys: &[PageKey]) -> OpId {
        let found = match (&self.storage, self.storage_down) {
            (Some(store), false) => keys.iter().take_while(|k| store.contains_key(*k)).count(),
            _ => 0,
        };
        let op = LoggedOp::Query {
            keys: keys.to_vec(),
        };
        self.queue(TierOpKind::Query, AckOutcome::Found(found), op)
    }

    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId {
        let p = self.page_size.max(1);
        let mut fetched = 0;
        if let (Some(store), false) = (&self.storage, self.storage_down) {
            for (i, key) in keys.iter().enumerate() {
                let Some(rows) = store.get(key) else { break };
                for (j, &tag) in rows.iter().enumerate() {
                    if let Some(s) = host.get(i * p + j) {
                        if let Some(t) = self.host.get_mut(s.index()) {
                            *t = tag;
                        }
                    }
                }
                fetched += 1;
            }
        }
        let op = LoggedOp::Prefetch {
            keys: keys.to_vec(),
            host: host.to_vec(),
        };
        self.queue(TierOpKind::Prefetch, AckOutcome::Fetched(fetched), op)
    }

    fn prefetch_progress(&self, op: OpId) -> usize {
        self.pending
            .iter()
            .find(|a| a.op == op)
            .map_or(0, |a| match a.outcome {
                AckOutcome::Fetched(n) => n,
                _ => 0,
            })
    }

    fn cancel_prefetch(&mut self, _op: OpId) {}
}
