//! The engine's one-off calls (embeddings, prompt scores, stats) awaited from async handlers.
//!
//! The engine thread answers through a callback; here that callback completes a tokio
//! oneshot, so no handler parks a blocking-pool thread on a std channel while the engine
//! works. If the engine dies first the callback is dropped unrun, and the caller gets the
//! engine's own account of why ([`EngineHandle::stopped_error`]). Embeddings and scored
//! prompts are engine requests: dropping the future (the client went away) aborts them.

use futures_util::future::try_join_all;
use novainfer_engine::{AbortHandle, EngineError, EngineHandle, EngineStats, TokenLogprob};
use novainfer_model::AdapterRef;
use tokio::sync::oneshot;

/// A callback the engine thread runs once with the answer.
type Reply<T> = Box<dyn FnOnce(Result<T, EngineError>) + Send>;

/// How many inputs of one embeddings request are in the engine at once: enough to batch
/// them, few enough that one large request does not fill the waiting queue ahead of others.
const EMBED_WINDOW: usize = 16;

/// Sends a request through `ask` (which hands the engine its reply callback) and awaits it.
async fn call<T: Send + 'static>(
    handle: &EngineHandle,
    ask: impl FnOnce(Reply<T>) -> Result<(), EngineError>,
) -> Result<T, EngineError> {
    let (tx, rx) = oneshot::channel();
    ask(Box::new(move |answer| {
        // The caller may be gone (client disconnected): nothing to tell it.
        let _ = tx.send(answer);
    }))?;
    rx.await.map_err(|_| handle.stopped_error())?
}

/// Aborts an engine request when dropped before [`Self::disarm`].
struct AbortOnDrop(Option<AbortHandle>);

impl AbortOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(abort) = self.0.take() {
            abort.abort();
        }
    }
}

/// [`call`] for a request the engine schedules: aborted if this future is dropped first.
async fn request<T: Send + 'static>(
    handle: &EngineHandle,
    ask: impl FnOnce(Reply<T>) -> Result<AbortHandle, EngineError>,
) -> Result<T, EngineError> {
    let (tx, rx) = oneshot::channel();
    let guard = AbortOnDrop(Some(ask(Box::new(move |answer| {
        let _ = tx.send(answer);
    }))?));
    let answer = rx.await.map_err(|_| handle.stopped_error())?;
    guard.disarm();
    answer
}

/// The unit-length embedding of each input, in order. The engine computes them as
/// prefill-only requests, in chunks beside the running streams, [`EMBED_WINDOW`] at a time.
pub async fn embed_all(
    handle: &EngineHandle,
    inputs: Vec<Vec<u32>>,
    adapter: Option<AdapterRef>,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut vectors = Vec::with_capacity(inputs.len());
    let mut inputs = inputs.into_iter().peekable();
    while inputs.peek().is_some() {
        let window = inputs.by_ref().take(EMBED_WINDOW).map(|ids| {
            let adapter = adapter.clone();
            request(handle, move |reply| handle.embed_with(ids, adapter, reply))
        });
        vectors.extend(try_join_all(window).await?);
    }
    Ok(vectors)
}

/// The logprob of each prompt token given the ones before it, with `top_k` alternatives
/// (`None` for the first token): a prefill-only request, scored in chunks.
pub async fn score_prompt(
    handle: &EngineHandle,
    prompt_ids: Vec<u32>,
    top_k: usize,
    adapter: Option<AdapterRef>,
) -> Result<Vec<Option<TokenLogprob>>, EngineError> {
    request(handle, |reply| {
        handle.score_prompt_with(prompt_ids, top_k, adapter, reply)
    })
    .await
}

pub async fn stats(handle: &EngineHandle) -> Result<EngineStats, EngineError> {
    call(handle, |reply| handle.stats_with(reply)).await
}
