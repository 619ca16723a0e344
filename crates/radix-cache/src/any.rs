//! [`AnyPrefixCache`]: the prefix-cache component as one value with static dispatch over this
//! crate's implementations (the engine's `--disable-radix-cache` picks the variant).

use crate::{ChunkCache, RadixCache};

/// Every prefix cache this crate implements, as one value (the engine's prefix-cache
/// component): static dispatch, so no call goes through a vtable.
// One per engine, so the size of the chunk-cache variant does not matter, and boxing the radix
// variant would add an indirection to every call.
#[allow(clippy::large_enum_variant)]
#[enum_dispatch::enum_dispatch(PrefixCache)]
#[derive(Debug)]
pub enum AnyPrefixCache {
    /// [`RadixCache`]: RadixAttention's shared prefix tree.
    Radix(RadixCache),
    /// [`ChunkCache`]: no sharing (SGLang's cache with `--disable-radix-cache`).
    Chunk(ChunkCache),
}

impl AnyPrefixCache {
    /// The names [`AnyPrefixCache::name`] returns, for listings.
    pub const NAMES: [&'static str; 2] = ["radix", "chunk"];

    /// The implementation's name (one of [`AnyPrefixCache::NAMES`]).
    pub fn name(&self) -> &'static str {
        match self {
            AnyPrefixCache::Radix(_) => Self::NAMES[0],
            AnyPrefixCache::Chunk(_) => Self::NAMES[1],
        }
    }
}
