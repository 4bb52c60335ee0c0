//! `EngineHandle`: the engine on its own thread, requests in through a channel,
//! each request's deltas out through its own stream.
//!
//! The handle is the only way other threads (Python, the server) reach the
//! engine: nothing is shared but channels and the immutable [`Frontend`]. The
//! engine thread blocks when idle and otherwise steps continuously, taking new
//! requests between steps. Dropping a [`RequestStream`] before it ends aborts
//! the request and frees its KV blocks at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::thread::JoinHandle;

use novainfer_core::{RequestId, SamplingParams};

use crate::engine::{EngineConfig, Frontend, LoadedEngine};
use crate::engine_core::{EngineCore, EngineStats};
use crate::error::{EngineError, Result};
use crate::request::Delta;

enum Command {
    Generate {
        id: RequestId,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        deltas: mpsc::Sender<Result<Delta>>,
    },
    Abort(RequestId),
    PromptLogits {
        prompt_ids: Vec<u32>,
        step_by_step: bool,
        reply: mpsc::Sender<Result<Vec<f32>>>,
    },
    Embed {
        prompt_ids: Vec<u32>,
        reply: mpsc::Sender<Result<Vec<f32>>>,
    },
    Stats(mpsc::Sender<EngineStats>),
    ResetPrefixCache(mpsc::Sender<bool>),
}

pub struct EngineHandle {
    commands: Option<mpsc::Sender<Command>>,
    frontend: Frontend,
    next_id: AtomicU64,
    worker: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Loads the model on the calling thread (so load errors return here), then
    /// starts the engine thread.
    pub fn spawn(cfg: &EngineConfig) -> Result<Self> {
        let core = EngineCore::new(LoadedEngine::load(cfg)?);
        let frontend = core.frontend().clone();
        let (commands, inbox) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("novainfer-engine".into())
            .spawn(move || run(core, inbox))
            .map_err(|_| EngineError::EngineStopped)?;
        Ok(Self {
            commands: Some(commands),
            frontend,
            next_id: AtomicU64::new(0),
            worker: Some(worker),
        })
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    fn sender(&self) -> Result<&mpsc::Sender<Command>> {
        self.commands.as_ref().ok_or(EngineError::EngineStopped)
    }

    fn send(&self, command: Command) -> Result<()> {
        self.sender()?
            .send(command)
            .map_err(|_| EngineError::EngineStopped)
    }

    /// Queues a request after checking it fits; its deltas arrive on the returned stream.
    pub fn submit(&self, prompt_ids: Vec<u32>, params: SamplingParams) -> Result<RequestStream> {
        self.frontend.max_new_tokens(prompt_ids.len(), &params)?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (deltas, rx) = mpsc::channel();
        self.send(Command::Generate {
            id,
            prompt_ids,
            params,
            deltas,
        })?;
        Ok(RequestStream {
            id,
            rx,
            finished: false,
            commands: self.sender()?.clone(),
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

    /// The prompt's embedding: see [`EngineCore::embed`].
    pub fn embed(&self, prompt_ids: Vec<u32>) -> Result<Vec<f32>> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::Embed { prompt_ids, reply })?;
        rx.recv().map_err(|_| EngineError::EngineStopped)?
    }

    pub fn stats(&self) -> Result<EngineStats> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::Stats(reply))?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Drops every cached prefix block; false (and nothing changes) while requests run.
    pub fn reset_prefix_cache(&self) -> Result<bool> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::ResetPrefixCache(reply))?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        // Closing the channel ends the engine loop (running requests are dropped).
        self.commands.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn run(mut core: EngineCore, inbox: mpsc::Receiver<Command>) {
    loop {
        if !core.has_work() {
            // Idle: sleep until something arrives.
            match inbox.recv() {
                Ok(command) => handle(&mut core, command),
                Err(_) => return,
            }
        }
        loop {
            match inbox.try_recv() {
                Ok(command) => handle(&mut core, command),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        core.step();
    }
}

fn handle(core: &mut EngineCore, command: Command) {
    match command {
        Command::Generate {
            id,
            prompt_ids,
            params,
            deltas,
        } => {
            if let Err(e) = core.add_request(id, prompt_ids, params, deltas.clone()) {
                let _ = deltas.send(Err(e));
            }
        }
        Command::Abort(id) => core.abort(id),
        Command::PromptLogits {
            prompt_ids,
            step_by_step,
            reply,
        } => {
            let _ = reply.send(core.prompt_logits(&prompt_ids, step_by_step));
        }
        Command::Embed { prompt_ids, reply } => {
            let _ = reply.send(core.embed(&prompt_ids));
        }
        Command::Stats(reply) => {
            let _ = reply.send(core.stats());
        }
        Command::ResetPrefixCache(reply) => {
            let _ = reply.send(core.reset_prefix_cache());
        }
    }
}

/// The deltas of one request, ending after the one with a `finish_reason`.
pub struct RequestStream {
    id: RequestId,
    rx: mpsc::Receiver<Result<Delta>>,
    finished: bool,
    commands: mpsc::Sender<Command>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// A handle that aborts this request from another thread, e.g. while this
    /// stream's owner is blocked waiting for a delta of a request still queued.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            id: self.id,
            commands: self.commands.clone(),
        }
    }
}

/// Aborts one request; cheap to clone and send between threads.
#[derive(Clone)]
pub struct AbortHandle {
    id: RequestId,
    commands: mpsc::Sender<Command>,
}

impl AbortHandle {
    /// Finishes the request with `abort` and frees its KV blocks at the next step;
    /// a no-op once it has finished.
    pub fn abort(&self) {
        let _ = self.commands.send(Command::Abort(self.id));
    }
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

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}
