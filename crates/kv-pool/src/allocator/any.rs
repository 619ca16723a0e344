//! [`AnyAllocator`]: the allocator component as one enum with static dispatch.

// enum_dispatch expands the trait's methods here, so their signatures' types must be in scope.
use super::api::{Allocator, DecodeRequest, ExtendRequest};
use super::slot::{PagedAllocator, TokenAllocator};
use super::state::AllocatorState;
use crate::error::Result;
use crate::ids::{Page, Slot};

/// Every allocator this crate implements, as one value with static dispatch (the engine's
/// allocator component). [`AnyAllocator::for_page_size`] picks as SGLang does: the token
/// allocator for `P = 1`, the paged one otherwise.
#[enum_dispatch::enum_dispatch(Allocator)]
#[derive(Debug)]
pub enum AnyAllocator {
    /// [`TokenAllocator`] (FIFO reuse, `P = 1`).
    Token(TokenAllocator),
    /// [`PagedAllocator`] (LIFO page reuse).
    Paged(PagedAllocator),
}

impl AnyAllocator {
    /// The names [`AnyAllocator::name`] returns, for listings.
    pub const NAMES: [&'static str; 2] = ["token", "paged"];

    /// SGLang's choice for `size` slots of page size `page_size`: [`TokenAllocator`] when
    /// `page_size == 1` (`TokenToKVPoolAllocator`), [`PagedAllocator`] otherwise
    /// (`PagedTokenToKVPoolAllocator`).
    pub fn for_page_size(size: usize, page_size: u32) -> Result<Self> {
        Ok(if page_size == 1 {
            AnyAllocator::Token(TokenAllocator::new(size)?)
        } else {
            AnyAllocator::Paged(PagedAllocator::new(size, page_size)?)
        })
    }

    /// The implementation's name (one of [`AnyAllocator::NAMES`]).
    pub fn name(&self) -> &'static str {
        match self {
            AnyAllocator::Token(_) => Self::NAMES[0],
            AnyAllocator::Paged(_) => Self::NAMES[1],
        }
    }
}
