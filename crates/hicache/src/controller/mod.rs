//! The cache controller (SGLang's `HiCacheController`): see the crate docs.
