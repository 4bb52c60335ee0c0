//! Pure bookkeeping for NovaInfer: request parameters and outcomes, the paged
//! KV block pool with its prefix cache, the SLOT layout's cells, and the
//! continuous-batching scheduler over either layout.
//!
//! Nothing here touches a tensor, a thread or a device, so every rule in this
//! crate is testable in microseconds (see DESIGN.md §2–§3).

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod block_pool;
mod builder;
pub mod finish;
pub mod ids;
pub mod kv_cache_manager;
pub mod kv_events;
pub mod kv_manager;
pub mod ngram;
pub mod prefix_hash;
pub mod request;
pub mod sampling_params;
pub mod scheduler;
pub mod slot_cells;
pub mod slot_kv_manager;
pub mod slot_mapping;
pub mod structured;

pub use block_pool::BlockPool;
pub use finish::FinishReason;
pub use ids::{AdapterId, BlockId, RequestId};
pub use kv_cache_manager::{BlockCopy, KvCacheManager, KvCacheStats, NewBlocks, PrefixHit};
pub use kv_events::{KvEvent, KvEventLog, KvEventSink};
pub use kv_manager::{AnyKv, KvLayout, KvManager};
pub use ngram::{NgramIndex, NgramRange};
pub use prefix_hash::{BlockHash, BlockKey, PrefixIndex};
pub use request::{Request, RequestKind, RequestStatus, Tenant};
pub use sampling_params::{
    ParamError, SamplingParams, SamplingParamsBuilder, StopCondition, TextOptions, MAX_LOGIT_BIAS,
    MAX_LOGPROBS, MAX_N,
};
pub use scheduler::{
    ChunkOutput, FinishedRequest, Fork, RequestUpdate, ScheduledAhead, ScheduledRequest, Scheduler,
    SchedulerConfig, SchedulerConfigBuilder, SchedulerOutput, SchedulingPolicy, PENDING_TOKEN,
};
pub use slot_cells::{CellShift, SeqId, SlotCells, SlotError, SlotStats};
pub use slot_kv_manager::SlotKvManager;
pub use slot_mapping::slot_mapping;
pub use structured::StructuredOutput;
