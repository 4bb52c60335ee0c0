//! `EngineHandle`: the engine on its own thread, requests in through a channel,
//! each request's deltas out through its own stream.
//!
//! The handle is the only way other threads (Python, the server) reach the
//! engine: nothing is shared but channels and the immutable [`Frontend`].
//! Dropping a [`RequestStream`] aborts its request at the next token.

use std::sync::mpsc;
use std::thread::JoinHandle;

use novainfer_core::SamplingParams;

use crate::engine::{Engine, EngineConfig, Frontend};
use crate::error::{EngineError, Result};
use crate::request::Delta;

enum Command {
    Generate {
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        deltas: mpsc::Sender<Result<Delta>>,
    },
    PromptLogits {
        prompt_ids: Vec<u32>,
        step_by_step: bool,
        reply: mpsc::Sender<Result<Vec<f32>>>,
    },
}

pub struct EngineHandle {
    commands: Option<mpsc::Sender<Command>>,
    frontend: Frontend,
    worker: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Loads the model on the calling thread (so load errors return here), then
    /// starts the engine thread.
    pub fn spawn(cfg: &EngineConfig) -> Result<Self> {
        let engine = Engine::load(cfg)?;
        let frontend = engine.frontend().clone();
        let (commands, inbox) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("novainfer-engine".into())
            .spawn(move || run(engine, inbox))
            .map_err(|_| EngineError::EngineStopped)?;
        Ok(Self {
            commands: Some(commands),
            frontend,
            worker: Some(worker),
        })
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands
            .as_ref()
            .and_then(|c| c.send(command).ok())
            .ok_or(EngineError::EngineStopped)
    }

    /// Queues a request after checking it fits; its deltas arrive on the returned stream.
    pub fn submit(&self, prompt_ids: Vec<u32>, params: SamplingParams) -> Result<RequestStream> {
        self.frontend.max_new_tokens(prompt_ids.len(), &params)?;
        let (deltas, rx) = mpsc::channel();
        self.send(Command::Generate {
            prompt_ids,
            params,
            deltas,
        })?;
        Ok(RequestStream {
            rx,
            finished: false,
        })
    }

    pub fn prompt_logits(&self, prompt_ids: Vec<u32>, step_by_step: bool) -> Result<Vec<f32>> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::PromptLogits {
            prompt_ids,
            step_by_step,
            reply,
        })?;
        rx.recv().map_err(|_| EngineError::EngineStopped)?
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        // Closing the channel ends the engine loop once the current request is done.
        self.commands.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn run(mut engine: Engine, inbox: mpsc::Receiver<Command>) {
    for command in inbox {
        match command {
            Command::Generate {
                prompt_ids,
                params,
                deltas,
            } => {
                let result =
                    engine.generate(&prompt_ids, &params, |delta| deltas.send(Ok(delta)).is_ok());
                if let Err(e) = result {
                    let _ = deltas.send(Err(e));
                }
            }
            Command::PromptLogits {
                prompt_ids,
                step_by_step,
                reply,
            } => {
                let _ = reply.send(engine.prompt_logits(&prompt_ids, step_by_step));
            }
        }
    }
}

/// The deltas of one request, ending after the one with a `finish_reason`.
pub struct RequestStream {
    rx: mpsc::Receiver<Result<Delta>>,
    finished: bool,
}

impl Iterator for RequestStream {
    type Item = Result<Delta>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        let item = self.rx.recv().unwrap_or(Err(EngineError::EngineStopped));
        self.finished = !matches!(&item, Ok(d) if d.finish_reason.is_none());
        Some(item)
    }
}
