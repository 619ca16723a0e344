//! Typed indices into the pools: [`Slot`], [`Page`] and [`ReqRow`].
//!
//! Each is a `#[repr(transparent)]` newtype over `u32`, so a `&[Slot]` has the same memory layout
//! as a `&[u32]` and can be handed to a device without a copy ([`slots_as_u32`]), while a token
//! id can never be passed where a slot is expected. Slot 0, page 0 and row 0 are padding targets
//! that are never handed out (as SGLang).

use std::fmt;

/// One token's row in the KV pool (SGLang's `out_cache_loc` entries, `req_to_token` values).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, bytemuck::Pod, bytemuck::Zeroable,
)]
#[repr(transparent)]
pub struct Slot(pub u32);

/// `P` consecutive slots starting at a multiple of the page size `P`.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, bytemuck::Pod, bytemuck::Zeroable,
)]
#[repr(transparent)]
pub struct Page(pub u32);

/// One request's row in the [`ReqToTokenPool`](crate::ReqToTokenPool) (SGLang's `req_pool_idx`).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, bytemuck::Pod, bytemuck::Zeroable,
)]
#[repr(transparent)]
pub struct ReqRow(pub u32);

impl Slot {
    /// The padding slot: dummy writes of padded batch entries land here; never allocated.
    pub const PADDING: Slot = Slot(0);

    /// The slot as a `usize` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The page holding this slot, for page size `page_size` (`slot / P`).
    #[inline]
    pub fn page(self, page_size: u32) -> Page {
        Page(self.0 / page_size)
    }

    /// Offset of this slot inside its page (`slot mod P`).
    #[inline]
    pub fn offset_in_page(self, page_size: u32) -> u32 {
        self.0 % page_size
    }
}

impl Page {
    /// The padding page (slots `0..P`); never allocated.
    pub const PADDING: Page = Page(0);

    /// The page as a `usize` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The first slot of this page (`page × P`).
    #[inline]
    pub fn first_slot(self, page_size: u32) -> Slot {
        Slot(self.0 * page_size)
    }

    /// The `P` slots of this page, in order.
    #[inline]
    pub fn slots(self, page_size: u32) -> impl ExactSizeIterator<Item = Slot> {
        let first = self.0 * page_size;
        (first..first + page_size).map(Slot)
    }
}

impl ReqRow {
    /// The padding row; never allocated.
    pub const PADDING: ReqRow = ReqRow(0);

    /// The row as a `usize` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

macro_rules! display_id {
    ($t:ident, $name:literal) => {
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($name, "{}"), self.0)
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($name, "{}"), self.0)
            }
        }
    };
}
display_id!(Slot, "slot ");
display_id!(Page, "page ");
display_id!(ReqRow, "row ");

/// Views slots as plain `u32`s, for upload to a device or for hashing, without copying.
#[inline]
pub fn slots_as_u32(slots: &[Slot]) -> &[u32] {
    bytemuck::cast_slice(slots)
}

/// Views plain `u32`s as slots, without copying.
#[inline]
pub fn u32_as_slots(raw: &[u32]) -> &[Slot] {
    bytemuck::cast_slice(raw)
}

/// `ceil(n / p) × p`.
#[inline]
pub fn ceil_to_page(n: usize, page_size: usize) -> usize {
    n.div_ceil(page_size) * page_size
}

/// `floor(n / p) × p`.
#[inline]
pub fn floor_to_page(n: usize, page_size: usize) -> usize {
    n / page_size * page_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_math() {
        assert_eq!(Slot(13).page(4), Page(3));
        assert_eq!(Slot(13).offset_in_page(4), 1);
        assert_eq!(Page(3).first_slot(4), Slot(12));
        assert_eq!(
            Page(2).slots(4).collect::<Vec<_>>(),
            [Slot(8), Slot(9), Slot(10), Slot(11)]
        );
        assert_eq!(ceil_to_page(9, 4), 12);
        assert_eq!(ceil_to_page(8, 4), 8);
        assert_eq!(floor_to_page(9, 4), 8);
        assert_eq!(
            format!("{} {} {}", Slot(1), Page(2), ReqRow(3)),
            "slot 1 page 2 row 3"
        );
    }

    #[test]
    fn zero_copy_views_round_trip() {
        let slots = [Slot(4), Slot(5), Slot(9)];
        let raw = slots_as_u32(&slots);
        assert_eq!(raw, &[4, 5, 9]);
        assert_eq!(u32_as_slots(raw), &slots);
    }
}
