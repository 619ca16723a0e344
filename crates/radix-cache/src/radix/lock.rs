//! Lock counts (SGLang's `inc_lock_ref` / `dec_lock_ref`): a lock covers the path from a node
//! to its root (the root excluded); a node going 0 → 1 moves its tokens from evictable to
//! protected and leaves the eviction index, and back (host-only nodes move no tokens: a lock
//! keeps them from host eviction). Builds on `arena` and `index`.

use crate::error::{RadixCacheError, Result};
use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};

/// Which way a lock count moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LockDelta {
    Inc,
    Dec,
}

impl<P: EvictionPolicy> RadixCache<P> {
    /// Moves the lock count of every node from `i` up to its root by one; returns the tokens
    /// that changed side (evictable → protected for `Inc`, back for `Dec`). The caller has
    /// checked that a `Dec` does not underflow.
    pub(super) fn lock_path(&mut self, mut i: u32, delta: LockDelta) -> usize {
        let mut moved = 0;
        while self.nodes[i as usize].parent != NONE {
            let n = &mut self.nodes[i as usize];
            // A host-only node holds no device tokens: its lock only keeps it from host
            // eviction.
            let len = if n.on_device { n.len } else { 0 };
            match delta {
                LockDelta::Inc => {
                    n.lock_ref += 1;
                    if n.lock_ref == 1 {
                        self.evictable -= len;
                        self.protected += len;
                        moved += len;
                        self.refresh(i);
                    }
                }
                LockDelta::Dec => {
                    n.lock_ref -= 1;
                    if n.lock_ref == 0 {
                        self.protected -= len;
                        self.evictable += len;
                        moved += len;
                        self.refresh(i);
                    }
                }
            }
            i = self.nodes[i as usize].parent;
        }
        moved
    }

    /// Refuses (changing nothing) a `Dec` on a path with a node whose count is already zero.
    pub(super) fn check_unlock(&self, i: u32) -> Result<()> {
        let mut j = i;
        while self.nodes[j as usize].parent != NONE {
            if self.nodes[j as usize].lock_ref == 0 {
                return Err(RadixCacheError::LockUnderflow(self.id(i)));
            }
            j = self.nodes[j as usize].parent;
        }
        Ok(())
    }
}
