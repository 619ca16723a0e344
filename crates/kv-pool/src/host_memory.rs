//! Where a [`HostKvStore`](crate::HostKvStore)'s bytes live: its own heap buffers (the
//! default), or memory someone else owns ([`HostMemory`]: a shared mapping that a peer process
//! writes KV into, as the PD decode server's store does).
//!
//! [`Buffers`] hides the difference from the store: buffer `i` (layer-major, buffers in
//! canonical order) is one slice either way. Over foreign memory the buffers lie back to back
//! from the memory's first byte, in that order, `layout.total_bytes()` in all.

use crate::error::{KvPoolError, Result};
use crate::layout::KvLayout;

/// Memory a [`HostKvStore`](crate::HostKvStore) can live in instead of its own heap buffers
/// (`HostKvStore::with_memory`): a shared-memory mapping, pinned host memory.
///
/// # Safety
/// Implementors promise that `as_ptr()..as_ptr() + len()` is valid for reads and writes, does
/// not move and is not handed to other safe Rust code for as long as the value lives, and that
/// `as_ptr()` and `len()` always return the same values. (Another process writing the bytes, as
/// a transfer peer does, is the transfer engine's contract, not this one's.)
pub unsafe trait HostMemory: Send + Sync {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Bytes of memory from [`as_ptr`](HostMemory::as_ptr).
    fn len(&self) -> usize;
    /// `len() == 0`.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A store's buffers, by index `layer × nbuf + b`.
pub(crate) enum Buffers {
    /// One zeroed `Vec` per buffer.
    Heap(Vec<Vec<u8>>),
    /// Slices of foreign memory: `spans[i] = (offset, len)`.
    Foreign {
        mem: Box<dyn HostMemory>,
        spans: Vec<(usize, usize)>,
    },
}

impl Buffers {
    /// The buffer lengths of `layout`, in store order (layer-major, canonical buffer order).
    fn lengths(layout: &KvLayout) -> impl Iterator<Item = usize> + '_ {
        (0..layout.shape.layers).flat_map(move |_| {
            layout
                .shape
                .buffers()
                .iter()
                .map(move |&b| layout.buffer_bytes(b))
        })
    }

    /// Zeroed heap buffers; [`KvPoolError::HostOutOfMemory`] when they cannot be reserved.
    pub(crate) fn heap(layout: &KvLayout) -> Result<Self> {
        let oom = || KvPoolError::HostOutOfMemory {
            bytes: layout.total_bytes(),
        };
        let mut data = Vec::new();
        data.try_reserve_exact(layout.shape.layers as usize * layout.shape.buffers().len())
            .map_err(|_| oom())?;
        for len in Self::lengths(layout) {
            let mut v: Vec<u8> = Vec::new();
            v.try_reserve_exact(len).map_err(|_| oom())?;
            v.resize(len, 0);
            data.push(v);
        }
        Ok(Buffers::Heap(data))
    }

    /// The buffers of `layout` carved from `mem`, zeroed; memory shorter than
    /// `layout.total_bytes()` is [`KvPoolError::MemoryTooSmall`].
    pub(crate) fn foreign(layout: &KvLayout, mem: Box<dyn HostMemory>) -> Result<Self> {
        let needed = layout.total_bytes();
        if mem.len() < needed {
            return Err(KvPoolError::MemoryTooSmall {
                needed,
                got: mem.len(),
            });
        }
        // SAFETY: `needed <= mem.len()`, and `HostMemory`'s contract makes the whole range
        // valid for writes and not aliased by safe code.
        unsafe { std::ptr::write_bytes(mem.as_ptr(), 0, needed) };
        let mut spans = Vec::new();
        let mut off = 0;
        for len in Self::lengths(layout) {
            spans.push((off, len));
            off += len;
        }
        Ok(Buffers::Foreign { mem, spans })
    }

    /// Number of buffers.
    pub(crate) fn count(&self) -> usize {
        match self {
            Buffers::Heap(d) => d.len(),
            Buffers::Foreign { spans, .. } => spans.len(),
        }
    }

    /// Buffer `i`.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> &[u8] {
        match self {
            Buffers::Heap(d) => &d[i],
            Buffers::Foreign { mem, spans } => {
                let (off, len) = spans[i];
                // SAFETY: spans are disjoint and lie within `mem` (checked in `foreign`); the
                // memory is valid and unaliased by `HostMemory`'s contract, and `&self` keeps
                // `&mut` borrows of it (through `get_mut`) out for the slice's life.
                unsafe { std::slice::from_raw_parts(mem.as_ptr().add(off), len) }
            }
        }
    }

    /// Buffer `i`, writable.
    #[inline]
    pub(crate) fn get_mut(&mut self, i: usize) -> &mut [u8] {
        match self {
            Buffers::Heap(d) => &mut d[i],
            Buffers::Foreign { mem, spans } => {
                let (off, len) = spans[i];
                // SAFETY: as in `get`; `&mut self` makes this the only borrow of the span.
                unsafe { std::slice::from_raw_parts_mut(mem.as_ptr().add(off), len) }
            }
        }
    }

    /// Whether the bytes live in foreign memory.
    pub(crate) fn is_foreign(&self) -> bool {
        matches!(self, Buffers::Foreign { .. })
    }
}

impl Clone for Buffers {
    /// A copy on the heap, whatever the original lives in (foreign memory cannot be cloned).
    fn clone(&self) -> Self {
        Buffers::Heap((0..self.count()).map(|i| self.get(i).to_vec()).collect())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A [`HostMemory`] over a leaked-free heap allocation, for tests.
    pub(crate) struct TestMemory(pub(crate) Box<[std::cell::UnsafeCell<u8>]>);

    // SAFETY: the cells are only reached through the raw pointer, under the store's borrows.
    unsafe impl Sync for TestMemory {}

    impl TestMemory {
        /// `len` bytes filled with `fill` (the store must zero them).
        pub(crate) fn new(len: usize, fill: u8) -> Self {
            TestMemory((0..len).map(|_| std::cell::UnsafeCell::new(fill)).collect())
        }
    }

    // SAFETY: the boxed slice is neither moved nor freed while the value lives, and its cells
    // allow writes through a shared pointer.
    unsafe impl HostMemory for TestMemory {
        fn as_ptr(&self) -> *mut u8 {
            self.0.as_ptr() as *mut u8
        }
        fn len(&self) -> usize {
            self.0.len()
        }
    }
}
