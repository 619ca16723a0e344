//! KV events for cache-aware routers, as SGLang and vLLM publish them (`--kv-events-config`):
//! the radix cache's `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events, one batch per
//! engine-loop step, as vLLM's msgpack `KVEventBatch` on a ZMQ PUB socket, with sequence
//! numbers and a replay socket, so existing consumers (Dynamo's KV router, vLLM's tooling) read
//! them unchanged.
//!
//! One job per module, no module uses one that uses it back:
//! - `config`: [`KvEventsConfig`] (vLLM's keys and defaults), checked;
//! - `encode`: [`encode_batch`], msgspec's array-like msgpack of a batch;
//! - `decode`: [`decode_batch`], its inverse, for subscribers (the router's `kv_events`);
//! - `publisher`: [`ZmqEventPublisher`], the sockets on their own thread behind a bounded queue.

pub mod config;
pub mod decode;
pub mod encode;
pub mod publisher;

pub use config::{KvEventsConfig, PublisherKind};
pub use decode::decode_batch;
pub use encode::encode_batch;
pub use publisher::{ZmqEventPublisher, END_SEQ};

/// What can go wrong with KV events.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    /// A bad `--kv-events-config` (the message names the key).
    #[error("{0}")]
    Config(String),
    /// A socket could not bind.
    #[error("cannot bind {endpoint}: {message}")]
    Bind { endpoint: String, message: String },
    /// The publisher thread or its runtime could not start.
    #[error("cannot start the KV event publisher: {0}")]
    Start(String),
    /// A batch could not be encoded.
    #[error("cannot encode a KV event batch: {0}")]
    Encode(String),
    /// A received payload is not a batch.
    #[error("cannot decode a KV event batch: {0}")]
    Decode(String),
}
