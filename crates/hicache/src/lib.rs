//! # hicache — the data side of SGLang's hierarchical KV cache
//!
//! radix-cache's tree decides what lives on which tier (device, host, L3) and calls a
//! [`kv_pool::CacheController`] whenever bytes must move. This crate is that controller and
//! what it moves bytes to:
//!
//! - [`controller`]: `HiCacheController`, SGLang's `HiCacheController`, for stores whose
//!   memory the host can address (the CPU backend: raw copies) and for stores reached through a
//!   [`kv_pool::DeviceKvRows`] handle (wgpu: copies on the device's queue, ordered with the
//!   forward passes): device ↔ host copies on an IO thread, each
//!   step's writes merged into one operation, load-backs copied layer by layer while the
//!   forward pass waits per layer on the `LoadGate` ([`kv_pool::LayerWait`]) that the engine's
//!   `ControllerHandle::start_loads` returns; host → L3 backups and L3 → host prefetches on a
//!   storage thread. The host tier's bytes are a [`kv_pool::HostKvPool`] the controller owns.
//! - [`storage`]: SGLang's `HiCacheStorage` as the [`storage::HiCacheStorage`] trait (batch
//!   exists → longest hit prefix, batch get / set by page keys, clear, stats) and its backends:
//!   `file` (a directory; the default) and `redis` (feature `redis`: one server or a Redis
//!   Cluster). Keys are the chained SHA-256 page hashes radix-cache computes, prefixed with a
//!   namespace naming the model and the KV layout, so two models never share a key.
//!
//! ## Invariants
//! - A controller never allocates or frees pages: the tree owns both allocators and keeps the
//!   pages an operation names allocated until its acknowledgement.
//! - Every queued operation is acknowledged exactly once; operations of one kind complete in
//!   queue order.
//! - An L3 store that fails or cannot be reached is a miss (logged once per failure streak),
//!   never a failed request.
//!
//! ## Where it sits
//! Above kv-pool (slots, the host pool, the store's memory regions or its `DeviceKvRows`
//! handle, the controller trait); the
//! engine builds it and hands it to radix-cache's tree, which knows only the trait.

#![warn(missing_docs)]

pub mod controller;
pub mod storage;
