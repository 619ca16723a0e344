//! [`AnyAllocator`]: the allocator component as one enum with static dispatch.

// enum_dispatch expands the trait's methods here, so their signatures' types must be in scope.
use super::api::{Allocator, DecodeRequest, ExtendRequest};
use super::slot::{BestFitAllocator, PagedAllocator, TokenAllocator};
use super::state::AllocatorState;
use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};

/// Every allocator this crate implements, as one value with static dispatch (the engine's
/// allocator component). [`AnyAllocator::for_page_size`] picks as SGLang does: the token
/// allocator for `P = 1`, the paged one otherwise.
#[enum_dispatch::enum_dispatch(Allocator)]
#[derive(Debug)]
pub enum AnyAllocator {
    /// [`TokenAllocator`] (FIFO reuse; `P = 1` as SGLang, any `P` through [`AnyAllocator::by_name`]).
    Token(TokenAllocator),
    /// [`PagedAllocator`] (LIFO page reuse).
    Paged(PagedAllocator),
    /// [`BestFitAllocator`] (per-request best-fit placement; a research policy).
    BestFit(BestFitAllocator),
}

impl AnyAllocator {
    /// The names [`AnyAllocator::name`] returns, for listings.
    pub const NAMES: [&'static str; 3] = ["token", "paged", "best_fit"];

    /// SGLang's choice for `size` slots of page size `page_size`: [`TokenAllocator`] when
    /// `page_size == 1` (`TokenToKVPoolAllocator`), [`PagedAllocator`] otherwise
    /// (`PagedTokenToKVPoolAllocator`).
    pub fn for_page_size(size: usize, page_size: u32) -> Result<Self> {
        Self::by_name(Self::name_for_page_size(page_size), size, page_size)
    }

    /// The name of the implementation [`AnyAllocator::for_page_size`] picks for `page_size`.
    pub fn name_for_page_size(page_size: u32) -> &'static str {
        if page_size == 1 {
            Self::NAMES[0]
        } else {
            Self::NAMES[1]
        }
    }

    /// The implementation named `name` (one of [`AnyAllocator::NAMES`]; `-` and `_` alike) at
    /// any page size: `token` is FIFO reuse at page size `page_size` (SGLang's token allocator
    /// when it is 1). An unknown name is [`KvPoolError::UnknownAllocator`].
    pub fn by_name(name: &str, size: usize, page_size: u32) -> Result<Self> {
        Ok(match name.trim().replace('-', "_").as_str() {
            "token" => AnyAllocator::Token(TokenAllocator::with_page_size(size, page_size)?),
            "paged" => AnyAllocator::Paged(PagedAllocator::new(size, page_size)?),
            "best_fit" => AnyAllocator::BestFit(BestFitAllocator::new(size, page_size)?),
            _ => {
                return Err(KvPoolError::UnknownAllocator {
                    name: name.to_string(),
                    expected: Self::NAMES.join(", "),
                })
            }
        })
    }

    /// The implementation's name (one of [`AnyAllocator::NAMES`]).
    pub fn name(&self) -> &'static str {
        match self {
            AnyAllocator::Token(_) => Self::NAMES[0],
            AnyAllocator::Paged(_) => Self::NAMES[1],
            AnyAllocator::BestFit(_) => Self::NAMES[2],
        }
    }
}
