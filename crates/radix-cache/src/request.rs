//! The request-side state that `cache_unfinished_req` / `cache_finished_req` read and update,
//! so a scheduler can use the caches without this crate knowing the scheduler.

use kv_pool::{ReqRow, Slot};

use crate::error::{RadixCacheError, Result};
use crate::NodeId;

/// What the prefix cache keeps on a request (SGLang's `req.cache_protected_len`,
/// `req.last_node`, `req.prefix_indices`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixState {
    /// Positions `0..cache_protected_len` are owned by the tree (locked through `last_node`);
    /// the request must never free them.
    pub cache_protected_len: usize,
    /// The deepest tree node the request holds a lock on.
    pub last_node: NodeId,
    /// The slots of the request's cached prefix plus its private unaligned tail.
    pub prefix_slots: Vec<Slot>,
}

impl PrefixState {
    /// The state of a request that has matched nothing: protected length 0, at `root`.
    pub fn new(root: NodeId) -> Self {
        PrefixState {
            cache_protected_len: 0,
            last_node: root,
            prefix_slots: Vec::new(),
        }
    }
}

/// A request as the caches see it: borrowed fields of whatever type the scheduler uses.
#[derive(Debug)]
pub struct ReqView<'a> {
    /// Token ids whose KV exists or is being computed (prompt + outputs); at least
    /// `committed_len` long.
    pub tokens: &'a [u32],
    /// Namespace (LoRA id, cache salt): keys of different namespaces never share nodes.
    pub extra_key: Option<&'a str>,
    /// The request's row in the request-to-token table.
    pub row: ReqRow,
    /// Positions whose KV is valid (SGLang's `kv_committed_len`).
    pub committed_len: usize,
    /// Request priority (max-propagated into inserted nodes).
    pub priority: i64,
    /// The cache's state on the request.
    pub state: &'a mut PrefixState,
}

impl ReqView<'_> {
    /// Checks the lengths every cache relies on: at least `committed_len` tokens, and a
    /// protected length within them and on a page boundary (the tree holds whole pages).
    pub fn check_lengths(&self, page_size: u32) -> Result<()> {
        if self.tokens.len() < self.committed_len {
            return Err(RadixCacheError::LengthMismatch {
                what: "request tokens (at least committed_len)",
                expected: self.committed_len,
                got: self.tokens.len(),
            });
        }
        let protected = self.state.cache_protected_len;
        if protected > self.committed_len || protected % page_size.max(1) as usize != 0 {
            return Err(RadixCacheError::InvalidRequest(format!(
                "cache_protected_len {protected} must be page-aligned and at most committed_len {}",
                self.committed_len
            )));
        }
        Ok(())
    }
}
