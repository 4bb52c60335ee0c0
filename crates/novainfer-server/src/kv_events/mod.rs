//! KV-cache events as vLLM publishes them (`--kv-events-config`), for prefix-aware routers
//! (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's production stack).
//!
//! - [`config`]: vLLM's `KVEventsConfig` JSON, field for field.
//! - [`encode`]: one step's events as vLLM's msgpack `KVEventBatch`.
//! - [`publisher`]: the sink the engine hands each step's events to (a bounded queue: the step
//!   loop never waits; a full queue drops the batch and counts it), and the task that sends
//!   them on a ZMQ PUB socket as `[topic, 8-byte big-endian sequence number, payload]` and
//!   answers replay requests on a ZMQ ROUTER socket from the last `buffer_steps` batches.
//!
//! The block hashes are the prefix index's own 64-bit hashes (`novainfer_core::BlockHash`,
//! xxh3 with a fixed seed over parent hash, token ids and extra keys), sent as msgpack
//! unsigned integers: a subscriber cannot recompute them without our hash function, but it
//! can match `BlockRemoved` to `BlockStored` and chain blocks through `parent_block_hash`.

pub mod config;
pub mod encode;
pub mod publisher;

pub use config::{KvEventsConfig, KvEventsConfigError};
pub use publisher::KvEventPublisher;
