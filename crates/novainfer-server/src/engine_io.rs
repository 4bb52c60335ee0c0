//! The engine's one-off calls (embeddings, prompt logits, stats) awaited from async handlers.
//!
//! The engine thread answers through a callback; here that callback completes a tokio
//! oneshot, so no handler parks a blocking-pool thread on a std channel while the engine
//! works. If the engine dies first the callback is dropped unrun, and the caller gets the
//! engine's own account of why ([`EngineHandle::stopped_error`]).

use novainfer_engine::{EngineError, EngineHandle, EngineStats};
use tokio::sync::oneshot;

/// Sends a request through `ask` (which hands the engine its reply callback) and awaits it.
async fn call<T: Send + 'static>(
    handle: &EngineHandle,
    ask: impl FnOnce(Box<dyn FnOnce(Result<T, EngineError>) + Send>) -> Result<(), EngineError>,
) -> Result<T, EngineError> {
    let (tx, rx) = oneshot::channel();
    ask(Box::new(move |answer| {
        // The caller may be gone (client disconnected): nothing to tell it.
        let _ = tx.send(answer);
    }))?;
    rx.await.map_err(|_| handle.stopped_error())?
}

/// The unit-length embedding of one input: one engine command, run between two steps.
pub async fn embed(handle: &EngineHandle, prompt_ids: Vec<u32>) -> Result<Vec<f32>, EngineError> {
    call(handle, |reply| handle.embed_with(prompt_ids, reply)).await
}

/// Next-token logits at every prompt position (one forward over the prompt).
pub async fn prompt_logits(
    handle: &EngineHandle,
    prompt_ids: Vec<u32>,
) -> Result<Vec<f32>, EngineError> {
    call(handle, |reply| {
        handle.prompt_logits_with(prompt_ids, false, reply)
    })
    .await
}

pub async fn stats(handle: &EngineHandle) -> Result<EngineStats, EngineError> {
    call(handle, |reply| handle.stats_with(reply)).await
}
