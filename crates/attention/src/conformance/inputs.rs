//! Random inputs of the suite: values that are never zero, and slots scattered the way a
//! long-running server's pool scatters them.

use kv_pool::rng::SplitMix64;
use kv_pool::{Allocator, ExtendRequest, PagedAllocator, Slot, TokenAllocator};

use crate::error::Result;

/// A value never zero: magnitude uniform in `[0.05, 1)`, random sign (so no product in a check
/// vanishes and hides a wrong index).
pub fn nonzero(rng: &mut SplitMix64) -> f32 {
    let mag = 0.05 + 0.95 * rng.next_f64();
    (if rng.next_u64() & 1 == 0 { mag } else { -mag }) as f32
}

/// `n` values from [`nonzero`].
pub fn nonzero_vec(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| nonzero(rng)).collect()
}

/// Allocates slots for a batch the way the scheduler does, on a shuffled pool: every page is
/// allocated, then freed one at a time in random order; then all prefixes are allocated in one
/// `alloc_extend`, then all extends in a second one (continuing partial prefix pages). Returns
/// each request's slots for positions `0..prefix + extend`. `size` must be a multiple of
/// `page_size` and large enough.
pub fn scattered_slots(
    page_size: u32,
    size: usize,
    requests: &[(usize, usize)],
    rng: &mut SplitMix64,
) -> Result<Vec<Vec<Slot>>> {
    let mut alloc: Box<dyn Allocator> = if page_size == 1 {
        Box::new(TokenAllocator::new(size)?)
    } else {
        Box::new(PagedAllocator::new(size, page_size)?)
    };
    let mut all = Vec::new();
    alloc.alloc(size, &mut all)?;
    let mut pages: Vec<Slot> = all.into_iter().step_by(page_size as usize).collect();
    rng.shuffle(&mut pages);
    for s in pages {
        alloc.free(&[s])?;
    }
    let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); requests.len()];
    let with_prefix: Vec<usize> = (0..requests.len()).filter(|&r| requests[r].0 > 0).collect();
    let batch: Vec<ExtendRequest> = with_prefix
        .iter()
        .map(|&r| ExtendRequest {
            prefix_len: 0,
            seq_len: requests[r].0,
            last_loc: None,
        })
        .collect();
    let mut out = Vec::new();
    alloc.alloc_extend(&batch, &mut out)?;
    let mut it = out.into_iter();
    for &r in &with_prefix {
        slots[r].extend(it.by_ref().take(requests[r].0));
    }
    let batch: Vec<ExtendRequest> = requests
        .iter()
        .zip(&slots)
        .map(|(&(prefix, ext), s)| ExtendRequest {
            prefix_len: prefix,
            seq_len: prefix + ext,
            last_loc: s.last().copied(),
        })
        .collect();
    let mut out = Vec::new();
    alloc.alloc_extend(&batch, &mut out)?;
    let mut it = out.into_iter();
    for (s, &(_, ext)) in slots.iter_mut().zip(requests) {
        s.extend(it.by_ref().take(ext));
    }
    Ok(slots)
}
