//! Word-at-a-time helpers for the allocation bitmap: the hot paths (`free`, taking pages) walk
//! consecutive pages, which share a 64-bit word.

use crate::ids::Slot;

/// Length of the run of consecutive slot ids at the start of `slots` (at least 1 if non-empty).
pub(super) fn consecutive_run(slots: &[Slot]) -> usize {
    let Some(base) = slots.first().map(|s| s.0) else {
        return 0;
    };
    // Chunks of 64, then of 8, then slot by slot: a run of n slots costs about n / 4 + 8
    // compares. The vector compares are set up only when there is a chunk to compare.
    let mut len = 1;
    if slots.len() > 8 {
        len = whole_chunks::<64>(slots, base, len);
        len = whole_chunks::<8>(slots, base, len);
    }
    while len < slots.len() && slots[len].0 == base.wrapping_add(len as u32) {
        len += 1;
    }
    len
}

/// Extends a run of consecutive ids from `base` that covers `slots[..len]` by whole chunks of
/// `C` slots, each checked branch-free (vector compares); stops before the first chunk that
/// breaks the run.
#[inline(always)]
fn whole_chunks<const C: usize>(slots: &[Slot], base: u32, mut len: usize) -> usize {
    while let Some(chunk) = slots.get(len..len + C) {
        let mut consecutive = true;
        for (k, s) in chunk.iter().enumerate() {
            consecutive &= s.0 == base.wrapping_add((len + k) as u32);
        }
        if !consecutive {
            break;
        }
        len += C;
    }
    len
}

/// One word of the allocation and mark bitmaps, cached while `free` walks consecutive pages.
pub(super) struct BitmapWord {
    pub(super) index: usize,
    pub(super) allocated: u64,
    pub(super) marks: u64,
}

impl BitmapWord {
    pub(super) fn load(index: usize, allocated: &[u64], marks: &[u64]) -> Self {
        BitmapWord {
            index,
            allocated: allocated[index],
            marks: marks[index],
        }
    }

    pub(super) fn flush(&self, allocated: &mut [u64], marks: &mut [u64]) {
        if self.index != usize::MAX {
            allocated[self.index] = self.allocated;
            marks[self.index] = self.marks;
        }
    }

    pub(super) fn flush_allocated(&self, allocated: &mut [u64]) {
        if self.index != usize::MAX {
            allocated[self.index] = self.allocated;
        }
    }
}
