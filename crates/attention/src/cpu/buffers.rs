//! Recycled f32 buffers for the CPU backend's op outputs.
//!
//! A forward pass makes and drops the same large activations layer after layer (a 512-token
//! prefill's gate/up output alone is 6 MiB). A fresh `vec!` of that size is a fresh mapping:
//! every page faults in, is zeroed by the kernel and is unmapped again on drop, which cost some
//! 5% of a prefill and, with two threads faulting pages of one mapping, part of its scaling. So
//! a dropped [`super::CpuTensor`]'s buffer goes back to a small free list of the thread that
//! drops it, and the next op on that thread takes the smallest buffer that fits.
//!
//! Values never leak into results: [`take`] hands a buffer whose elements are unspecified
//! (old values) only to ops that write every element, and [`take_zeroed`] zeroes.

use std::cell::RefCell;

/// Buffers below this many elements are not kept (`malloc` serves them well).
const MIN_KEPT: usize = 1 << 14;

/// Buffers above this many elements (256 MiB) are not kept, so a dropped weight or a huge
/// one-off batch does not stay allocated.
const MAX_KEPT: usize = 1 << 26;

/// Buffers kept per thread (a layer has fewer activations alive at once).
const KEPT: usize = 16;

thread_local! {
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `len` elements whose values are unspecified: for an output the op overwrites
/// entirely.
pub(crate) fn take(len: usize) -> Vec<f32> {
    if len < MIN_KEPT {
        return vec![0.0; len];
    }
    let reused = FREE.with(|f| {
        let mut f = f.borrow_mut();
        let best = f
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        best.map(|i| f.swap_remove(i))
    });
    match reused {
        Some(mut v) => {
            // Only the elements past the old length are written here.
            v.resize(len, 0.0);
            v.truncate(len);
            v
        }
        None => vec![0.0; len],
    }
}

/// A buffer of `len` zeros.
pub(crate) fn take_zeroed(len: usize) -> Vec<f32> {
    let mut v = take(len);
    v.fill(0.0);
    v
}

/// Keeps `v` for a later [`take`] on this thread when it is worth keeping: the free list holds
/// the [`KEPT`] largest buffers offered.
pub(crate) fn give(v: Vec<f32>) {
    let cap = v.capacity();
    if !(MIN_KEPT..=MAX_KEPT).contains(&cap) {
        return;
    }
    // `try_with`: a tensor dropped while the thread's locals are torn down is simply freed.
    let _ = FREE.try_with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEPT {
            f.push(v);
        } else if let Some((i, _)) = f
            .iter()
            .enumerate()
            .min_by_key(|(_, v)| v.capacity())
            .filter(|(_, s)| s.capacity() < cap)
        {
            f[i] = v;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_with_the_asked_length() {
        let mut v = take(MIN_KEPT * 2);
        v[0] = 7.0;
        let p = v.as_ptr();
        give(v);
        let w = take(MIN_KEPT + 5);
        assert_eq!(w.len(), MIN_KEPT + 5);
        assert_eq!(w.as_ptr(), p, "the kept buffer is reused");
        give(w);
        let z = take_zeroed(MIN_KEPT * 2);
        assert_eq!(z.len(), MIN_KEPT * 2);
        assert!(
            z.iter().all(|&x| x == 0.0),
            "take_zeroed zeroes a reused buffer"
        );
    }

    #[test]
    fn small_buffers_are_not_kept_and_the_list_is_bounded() {
        let small = take(10);
        assert_eq!(small.len(), 10);
        give(small);
        FREE.with(|f| assert!(f.borrow().is_empty()));
        for i in 0..KEPT + 4 {
            give(vec![0.0; MIN_KEPT + i]);
        }
        FREE.with(|f| {
            let f = f.borrow();
            assert_eq!(f.len(), KEPT);
            // The largest are kept.
            assert!(f.iter().all(|v| v.capacity() >= MIN_KEPT + 4));
        });
    }
}
