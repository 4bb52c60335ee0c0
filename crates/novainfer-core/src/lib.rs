//! Pure bookkeeping for NovaInfer: request parameters and outcomes.
//!
//! Nothing here touches a tensor, a thread or a device, so every rule in this
//! crate is testable in microseconds. The paged KV block manager and the
//! scheduler will live here too (see DESIGN.md §2–§3).

pub mod finish;
pub mod sampling_params;

pub use finish::FinishReason;
pub use sampling_params::{ParamError, SamplingParams, SamplingParamsBuilder, StopCondition};
