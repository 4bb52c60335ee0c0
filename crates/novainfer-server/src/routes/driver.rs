//! The one request driver of the generation endpoints (chat, completions, `/infill`, the
//! Responses and Anthropic Messages APIs): a request checked, admitted and tokenized (see
//! [`super::run`]) runs here to its end, streamed or collected, and the endpoint only renders:
//! a [`Renderer`] turns each delta into its own events and the finished request into its own
//! response. Usage, metrics and the log line
//! are written once by [`Running`]'s drop, however the request ends.

use std::time::Duration;

use axum::body::Bytes;
use axum::response::Response;
use novainfer_engine::tokenizer::Tokenizer;
use novainfer_engine::Delta;

use super::run::{stream_after_start, Event, Pending, Running};
use super::LoggedByHandler;
use crate::accounting::ChoiceState;
use crate::error::ApiError;
use crate::sse;

/// Whether a generation goes on after a delta.
pub enum Flow {
    Continue,
    /// The endpoint ends the output here (an `/infill` limit), logged with this finish reason.
    Stop(&'static str),
}

/// What an endpoint makes of a generation. A renderer knows whether it streams; when it
/// does not, the events it returns are dropped (it had better make none) and
/// [`Renderer::whole`] makes the response.
pub trait Renderer: Send + 'static {
    /// Stream: whether it ends with `data: [DONE]` (OpenAI's endpoints; llama.cpp's send none).
    const DONE: bool = true;

    /// The generation has started: events before the first delta.
    fn opening(&mut self, _running: &Running) -> Vec<Bytes> {
        Vec::new()
    }

    /// A delta of choice `index`, already recorded in `running.run`: the events it makes, and
    /// whether the output goes on.
    fn delta(&mut self, running: &Running, index: usize, delta: &Delta) -> (Vec<Bytes>, Flow);

    /// Stream: events after the last delta (every choice ended, or the renderer stopped).
    fn closing(&mut self, running: &Running) -> Vec<Bytes>;

    /// Not streamed: the response once the generation has ended.
    fn whole(self, running: &Running) -> Response;

    /// Stream: the events reporting `error`, which ended the generation midway (the stream
    /// ends after them). OpenAI's endpoints send the error object as data.
    fn failed(&mut self, _running: &Running, error: &ApiError) -> Vec<Bytes> {
        let mut events = vec![sse::data(&error.body())];
        if Self::DONE {
            events.push(sse::done());
        }
        events
    }

    /// Stream: the events reporting `error`, which kept the request from starting (its
    /// deadline passed while it queued).
    fn refused(error: &ApiError) -> Vec<Bytes> {
        vec![sse::data(&error.body()), sse::done()]
    }
}

/// Runs `pending` to its end with `renderer`: an SSE stream (keep-alives every `keep_alive`
/// of silence, queueing included), or one response once every choice has ended.
pub async fn respond<R: Renderer>(
    pending: Pending,
    mut renderer: R,
    stream: bool,
    keep_alive: Duration,
) -> Result<Response, ApiError> {
    let mut response = if stream {
        let body = stream_after_start(
            pending,
            keep_alive,
            move |running| events(running, renderer, keep_alive),
            R::refused,
        );
        sse::response(body)
    } else {
        let mut running = pending.start().await?;
        renderer.opening(&running);
        collect(&mut running, &mut renderer).await?;
        renderer.whole(&running)
    };
    response.extensions_mut().insert(LoggedByHandler);
    Ok(response)
}

/// One response entry per choice, in order (for [`Renderer::whole`]).
pub fn each_choice<T>(
    running: &Running,
    mut entry: impl FnMut(&Tokenizer, usize, &ChoiceState) -> T,
) -> Vec<T> {
    let tokenizer = running.model.frontend.tokenizer();
    running
        .run
        .choices
        .iter()
        .enumerate()
        .map(|(index, choice)| entry(tokenizer, index, choice))
        .collect()
}

/// Ends a generation the renderer stopped before the engine did.
fn stop(running: &mut Running, delta: &Delta, reason: &'static str) {
    if delta.finish_reason.is_none() {
        running.gen.abort();
    }
    running.outcome = Some(reason);
}

/// Runs to the end without streaming: every delta recorded and shown to the renderer, or
/// the error that stopped it.
async fn collect<R: Renderer>(running: &mut Running, renderer: &mut R) -> Result<(), ApiError> {
    loop {
        match running.next_event(None).await {
            Event::Delta(prompt, delta) => {
                let index = running.record(prompt, &delta);
                if let (_, Flow::Stop(reason)) = renderer.delta(running, index, &delta) {
                    stop(running, &delta, reason);
                    return Ok(());
                }
            }
            Event::Failed(e) => return Err(e.into()),
            Event::TimedOut => return Err(running.timeout_error()),
            Event::KeepAlive => {}
            Event::Ended => return Ok(()),
        }
    }
}

fn events<R: Renderer>(
    mut running: Running,
    mut renderer: R,
    keep_alive: Duration,
) -> impl futures_util::Stream<Item = Bytes> {
    async_stream::stream! {
        for event in renderer.opening(&running) {
            yield event;
        }
        loop {
            match running.next_event(Some(keep_alive)).await {
                Event::Delta(prompt, delta) => {
                    let index = running.record(prompt, &delta);
                    let (events, flow) = renderer.delta(&running, index, &delta);
                    for event in events {
                        yield event;
                    }
                    if let Flow::Stop(reason) = flow {
                        stop(&mut running, &delta, reason);
                        break;
                    }
                }
                Event::KeepAlive => yield sse::keep_alive(),
                Event::Failed(e) => {
                    for event in renderer.failed(&running, &ApiError::from(e)) {
                        yield event;
                    }
                    return;
                }
                Event::TimedOut => {
                    let error = running.timeout_error();
                    for event in renderer.failed(&running, &error) {
                        yield event;
                    }
                    return;
                }
                Event::Ended => break,
            }
        }
        for event in renderer.closing(&running) {
            yield event;
        }
        if R::DONE {
            yield sse::done();
        }
    }
}
