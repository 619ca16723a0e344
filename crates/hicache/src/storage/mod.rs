//! L3 storage (SGLang's `HiCacheStorage`): see the crate docs.
