//! The output thread: turns the tokens the engine samples into text deltas.
//!
//! Incremental detokenization and stop-string matching cost time for every
//! token of every request; here they run beside the step loop instead of inside
//! it. The engine thread registers each completion (its [`SequenceOutput`] and
//! where its deltas go) before sending any of its tokens, over one FIFO channel,
//! so events for a completion always arrive in order.
//!
//! A stop string is found here, a step or so after its token was sampled (as in
//! vLLM). The engine is told to finish the request *before* the final delta goes
//! out, so a caller who reads stats after the last delta sees its KV freed;
//! tokens the engine produced in between are dropped, since this side has
//! already forgotten the completion. The same happens when the caller is gone.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use novainfer_core::{FinishReason, RequestId};
use novainfer_model::sampler::SampledToken;

use crate::error::{EngineError, Result};
use crate::request::{Delta, Speculation};
use crate::sequence::SequenceOutput;

/// Where a request's deltas go: a std channel (the blocking [`crate::RequestStream`]) or any
/// callback, such as a send into an async runtime's channel, so an async caller needs no thread
/// parked on a blocking receive for the life of its request. The callback runs on the output
/// thread and must not block; it returns false once the caller is gone (the request is then
/// aborted). Dropped when the completion ends, which closes a channel behind it.
#[derive(Clone)]
pub struct DeltaSink(Arc<dyn Fn(Result<Delta>) -> bool + Send + Sync>);

impl DeltaSink {
    pub fn new(deliver: impl Fn(Result<Delta>) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(deliver))
    }

    /// Delivers one item; false when the caller is gone.
    pub fn send(&self, item: Result<Delta>) -> bool {
        (self.0)(item)
    }
}

impl From<mpsc::Sender<Result<Delta>>> for DeltaSink {
    fn from(tx: mpsc::Sender<Result<Delta>>) -> Self {
        Self::new(move |item| tx.send(item).is_ok())
    }
}

/// What the engine thread tells the output thread (in one batch per engine step).
pub enum OutputEvent {
    /// A completion exists; `index` is its place among the request's `n`.
    Register {
        id: RequestId,
        index: usize,
        output: Box<SequenceOutput>,
        sink: DeltaSink,
    },
    /// One sampled token with the scheduler's verdict on it (stop token, length).
    Token {
        id: RequestId,
        token: SampledToken,
        finish: Option<FinishReason>,
        /// The token completes the request's output constraint: its text is output (a `Stop`
        /// verdict otherwise means a hidden stop token) and the request ends with `stop`.
        completes_constraint: bool,
        num_cached_tokens: usize,
        /// When the request was first scheduled.
        scheduled_at: Option<Instant>,
        /// Set on the last token of a verified draft: what the verification confirmed.
        speculation: Speculation,
    },
    /// Ended without a token (abort): the stream gets a final empty delta.
    Finished { id: RequestId, reason: FinishReason },
    /// Ended by an error (prompt ignored, failed step): the stream gets the error.
    Failed { id: RequestId, error: EngineError },
}

struct Completion {
    index: usize,
    output: Box<SequenceOutput>,
    sink: DeltaSink,
}

/// Runs until the engine drops its end of `events`. `finish` tells the engine
/// to finish a request it still thinks is running.
// Long: one arm per event kind of the output thread's loop over the live completions it owns.
pub fn run(events: mpsc::Receiver<Vec<OutputEvent>>, finish: impl Fn(RequestId, FinishReason)) {
    let mut live: HashMap<RequestId, Completion> = HashMap::new();
    for event in events.into_iter().flatten() {
        match event {
            OutputEvent::Register {
                id,
                index,
                output,
                sink,
            } => {
                live.insert(
                    id,
                    Completion {
                        index,
                        output,
                        sink,
                    },
                );
            }
            OutputEvent::Token {
                id,
                token,
                finish: verdict,
                completes_constraint,
                num_cached_tokens,
                scheduled_at,
                speculation,
            } => {
                // Absent: already ended here; the engine has not caught up yet.
                let Some(c) = live.get_mut(&id) else {
                    continue;
                };
                let delta = if completes_constraint {
                    c.output.push_completing(token)
                } else {
                    c.output.push(token, verdict)
                };
                let delta = delta.map(|mut d| {
                    d.index = c.index;
                    d.num_cached_tokens = num_cached_tokens;
                    d.scheduled_at = scheduled_at;
                    d.speculation = speculation;
                    d
                });
                let ended = match &delta {
                    Ok(d) => d.finish_reason.is_some(),
                    Err(_) => true,
                };
                if ended && verdict.is_none() {
                    // A stop string (or a detokenizer error): news to the scheduler.
                    let reason = match &delta {
                        Ok(_) => FinishReason::Stop,
                        Err(_) => FinishReason::Abort,
                    };
                    finish(id, reason);
                }
                let delivered = c.sink.send(delta);
                if !delivered && !ended {
                    finish(id, FinishReason::Abort);
                }
                if ended || !delivered {
                    live.remove(&id);
                }
            }
            OutputEvent::Finished { id, reason } => {
                if let Some(c) = live.remove(&id) {
                    let _ = c.sink.send(Ok(Delta {
                        index: c.index,
                        finish_reason: Some(reason),
                        ..Delta::default()
                    }));
                }
            }
            OutputEvent::Failed { id, error } => {
                if let Some(c) = live.remove(&id) {
                    let _ = c.sink.send(Err(error));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;
    use novainfer_core::SamplingParams;
    use std::sync::{Arc, Mutex};

    fn token(id: u8) -> SampledToken {
        SampledToken {
            token_id: u32::from(id),
            logprob: 0.0,
            top_logprobs: vec![],
            rank: 0,
        }
    }

    fn register(
        events: &mpsc::Sender<Vec<OutputEvent>>,
        id: u64,
        index: usize,
        stop: &str,
    ) -> mpsc::Receiver<Result<Delta>> {
        let params = SamplingParams::builder()
            .stop(vec![stop.to_owned()])
            .build()
            .expect("valid");
        let output = SequenceOutput::new(Arc::new(tiny_byte_level_tokenizer()), &params);
        let (sink, rx) = mpsc::channel();
        events
            .send(vec![OutputEvent::Register {
                id: RequestId(id),
                index,
                output: Box::new(output),
                sink: sink.into(),
            }])
            .expect("output thread alive");
        rx
    }

    fn send_token(events: &mpsc::Sender<Vec<OutputEvent>>, id: u64, byte: u8) {
        events
            .send(vec![OutputEvent::Token {
                id: RequestId(id),
                token: token(byte),
                finish: None,
                completes_constraint: false,
                num_cached_tokens: 3,
                scheduled_at: None,
                speculation: Speculation::default(),
            }])
            .expect("output thread alive");
    }

    #[test]
    fn a_stop_string_tells_the_engine_first_and_later_tokens_are_dropped() {
        let (events, rx) = mpsc::channel();
        let told: Arc<Mutex<Vec<(RequestId, FinishReason)>>> = Arc::default();
        let seen = told.clone();
        let worker = std::thread::spawn(move || {
            run(rx, |id, reason| {
                seen.lock().expect("lock").push((id, reason))
            })
        });
        let deltas = register(&events, 7, 2, "c");
        for b in [b'a', b'b', b'c', b'd'] {
            send_token(&events, 7, b);
        }
        drop(events);
        worker.join().expect("output thread");
        let got: Vec<Delta> = deltas.iter().map(|d| d.expect("delta")).collect();
        let text: String = got.iter().map(|d| d.text.as_str()).collect();
        assert_eq!(text, "ab");
        assert_eq!(got.len(), 3, "the token after the stop string is dropped");
        assert!(got.iter().all(|d| d.index == 2 && d.num_cached_tokens == 3));
        assert_eq!(got[2].finish_reason, Some(FinishReason::Stop));
        assert_eq!(
            *told.lock().expect("lock"),
            vec![(RequestId(7), FinishReason::Stop)]
        );
    }

    #[test]
    fn a_vanished_caller_aborts_and_errors_end_the_stream() {
        let (events, rx) = mpsc::channel();
        let told: Arc<Mutex<Vec<(RequestId, FinishReason)>>> = Arc::default();
        let seen = told.clone();
        let worker = std::thread::spawn(move || {
            run(rx, |id, reason| {
                seen.lock().expect("lock").push((id, reason))
            })
        });
        drop(register(&events, 1, 0, "zz"));
        send_token(&events, 1, b'a');
        send_token(&events, 1, b'b');
        let failed = register(&events, 2, 0, "zz");
        events
            .send(vec![OutputEvent::Failed {
                id: RequestId(2),
                error: EngineError::EngineStopped,
            }])
            .expect("alive");
        drop(events);
        worker.join().expect("output thread");
        assert_eq!(
            *told.lock().expect("lock"),
            vec![(RequestId(1), FinishReason::Abort)]
        );
        assert!(matches!(failed.recv(), Ok(Err(EngineError::EngineStopped))));
        assert!(failed.recv().is_err(), "nothing after the error");
    }
}
