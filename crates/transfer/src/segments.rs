//! The table of opened peer segments, shared by the backends (each stores its own per-segment
//! state `T`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::SegmentId;
use crate::error::{Result, TransferError};

/// Open segments by id; ids start at 1 and are never reused.
#[derive(Debug)]
pub(crate) struct SegmentTable<T> {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<T>>>,
}

impl<T> Default for SegmentTable<T> {
    fn default() -> Self {
        SegmentTable {
            next: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> SegmentTable<T> {
    /// Adds an opened segment.
    pub fn insert(&self, seg: T) -> SegmentId {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.open.lock().unwrap().insert(id, Arc::new(seg));
        SegmentId(id)
    }

    /// An open segment, or [`TransferError::UnknownSegment`].
    pub fn get(&self, id: SegmentId) -> Result<Arc<T>> {
        self.open
            .lock()
            .unwrap()
            .get(&id.0)
            .cloned()
            .ok_or(TransferError::UnknownSegment(id))
    }

    /// Closes a segment: removes and returns it, or [`TransferError::UnknownSegment`].
    pub fn remove(&self, id: SegmentId) -> Result<Arc<T>> {
        self.open
            .lock()
            .unwrap()
            .remove(&id.0)
            .ok_or(TransferError::UnknownSegment(id))
    }

    /// Removes every segment (the engine is dropping).
    pub fn drain(&self) -> Vec<Arc<T>> {
        self.open.lock().unwrap().drain().map(|(_, s)| s).collect()
    }
}
