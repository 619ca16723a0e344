//! # transfer — moving KV pages between servers (PD disaggregation)
//!
//! A prefill server computes a prompt's KV; a decode server continues from it. This crate moves
//! the pages between them and runs the handshake that tells the prefill side where to write:
//!
//! - [`TransferEngine`] (`engine`): register local memory regions (described by kv-pool's
//!   [`MemoryRegion`](kv_pool::MemoryRegion), never by layouts this crate invents), open a
//!   peer's segment, submit a batch of writes `(src region + offset, dst region + offset, len)`,
//!   poll or await its completion. Backends, one Cargo feature each, all behind the same
//!   conformance suite (`transfer::testing`, feature `testing`): `tcp`, `shm`, `nixl`, `fake`.
//! - `coalesce`: (src page, dst page) pairs into runs contiguous on both sides, and one block per
//!   run per region (SGLang's `group_concurrent_contiguous`).
//! - `pd`: the protocol on top (SGLang's `KVManager` / `KVSender` / `KVReceiver`, the bootstrap
//!   server, timeouts and heartbeats): `KvManager`, `KvSender`, `KvReceiver`, `KvPoll`.
//! - `nixl` (feature `nixl`): the backend over NVIDIA NIXL (`nixl-sys`); built against the
//!   crate's stub API it compiles anywhere and refuses at run time unless a real NIXL is loaded.
//!   [`new_engine`] builds one from a [`TransferConfig`] (`backends`).
//! - `tcp`: framed, CRC32-checksummed writes over several streams per peer, straight from and
//!   into registered memory. `shm`: a [`SharedMemory`](shm::SharedMemory) (memfd) that the
//!   receiver's KV store lives in (`HostKvStore::with_memory`) and the sender maps and copies
//!   into. `fake`: validates and moves nothing.
//! - `bench`: Mooncake's `transfer_engine_bench` (engine against raw sockets or memcpy).
//! - Internals shared by the backends: `region` (registration and block validation, so every
//!   backend refuses the same inputs alike), `batch` (batch outcomes, poll / wait / reap),
//!   `segments` (the open-segment table).
//!
//! ## Invariants
//! - A batch is validated whole before any byte moves: an unknown region, an offset or length
//!   outside a region, or a segment that is not open is a typed [`TransferError`] and nothing
//!   is written.
//! - A batch ends `Done` only when every byte landed intact in the destination; a corrupted
//!   frame, a dead peer or a closed segment ends it `Failed`, never `Done` with wrong bytes, and
//!   never hangs (every wait is bounded by the peer's liveness).
//! - Registering memory is `unsafe`: the owner promises the memory outlives the registration and
//!   that it does not touch the bytes a batch names while that batch is in flight (RDMA's
//!   contract; the scheduler keeps it by owning a request's pages until its transfer ends).
//! - PD (`pd`): a room's status only rises and `Failed` overrides; no room waits forever
//!   (bootstrap and waiting timeouts, heartbeats, closed connections fail it); a prefill answers
//!   a room only once every batch it submitted for it settled.
//!
//! ## Where it sits
//! Above kv-pool (regions, pages), beside the scheduler; the engine composes it with the
//! scheduler into prefill and decode servers.

pub mod backends;
mod batch;
pub mod bench;
pub mod coalesce;
pub mod config;
pub mod engine;
pub mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod ids;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod pd;
mod region;
mod segments;
#[cfg(all(feature = "shm", target_os = "linux"))]
pub mod shm;
#[cfg(feature = "tcp")]
pub mod tcp;
#[cfg(feature = "testing")]
pub mod testing;

pub use backends::new_engine;
pub use config::TransferConfig;
pub use engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
pub use error::{Result, TransferError};
