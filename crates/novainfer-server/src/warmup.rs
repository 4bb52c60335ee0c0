//! Warm-up: one short greedy generation per model after the port opens, before `/ready`
//! says 200. The first forward pass pays for page faults on the mapped weights and for
//! growing the step buffers; a replica that takes traffic only after that answers its first
//! real request in the time the ones after it take.

use std::sync::Arc;

use novainfer_core::SamplingParams;
use novainfer_engine::{EngineError, EngineHandle};

use crate::state::AppState;

/// Few tokens, well under one KV block: nothing of it is published to the prefix cache
/// (so no KV-cache event and no cache entry comes from the warm-up).
const PROMPT: &str = "Hello";

/// Warms every model in turn, then marks the server warm. A failing warm-up is logged and
/// does not keep the server unready forever: a dead engine makes `/health` fail anyway.
pub async fn warm_up(state: Arc<AppState>) {
    for m in &state.models.0 {
        let handle = m.handle.clone();
        let outcome = tokio::task::spawn_blocking(move || generate_one(&handle)).await;
        match outcome {
            Ok(Ok(())) => tracing::info!(model = %m.name, "warmed up"),
            Ok(Err(e)) => tracing::warn!(model = %m.name, error = %e, "warm-up failed"),
            Err(e) => tracing::warn!(model = %m.name, error = %e, "warm-up task failed"),
        }
    }
    state.lifecycle.set_warm();
}

fn generate_one(handle: &EngineHandle) -> Result<(), EngineError> {
    let mut ids = handle
        .frontend()
        .tokenizer()
        .encode(PROMPT, false)
        .unwrap_or_default();
    if ids.is_empty() {
        ids.push(0);
    }
    let params = SamplingParams::builder()
        .temperature(0.0)
        .max_tokens(Some(1))
        .build()
        .expect("greedy one-token params are valid: this is a bug");
    for delta in handle.submit(ids, params)? {
        delta?;
    }
    Ok(())
}
