//! `EngineCore`: continuous batching over one model. `step()` is
//! schedule → execute → update; requests join and leave between steps.
//!
//! Each request keeps its own sampler (own seeded RNG, own penalty state) and
//! its own text state for the whole of its life, across preemptions, so what
//! it produces never depends on the other requests in the batch.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Instant;

use novainfer_core::{
    FinishReason, KvCacheStats, Request, RequestId, SamplingParams, Scheduler, SchedulerOutput,
};
use novainfer_model::sampler::{SampledToken, Sampler};
use novainfer_model::LogitsFor;

use crate::engine::{Frontend, LoadedEngine};
use crate::error::{EngineError, Result};
use crate::model_runner::ModelRunner;
use crate::request::Delta;
use crate::sequence::SequenceOutput;

/// Where a request's deltas go; a failed send means the caller is gone.
pub type DeltaSink = mpsc::Sender<Result<Delta>>;

struct ActiveRequest {
    sampler: Sampler,
    output: SequenceOutput,
    sink: DeltaSink,
}

/// Counters a user can read (`llm.stats()`).
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_preemptions: u64,
    pub kv: KvCacheStats,
    /// Bytes of the KV pool, and of one of its blocks (cells in the SLOT layout).
    pub kv_pool_bytes: usize,
    pub kv_bytes_per_block: usize,
    pub num_prompt_tokens_computed: u64,
    pub num_generated_tokens: u64,
    pub num_steps: u64,
    /// Time spent inside `step()`.
    pub busy_seconds: f64,
}

pub struct EngineCore {
    runner: ModelRunner,
    scheduler: Scheduler,
    frontend: Frontend,
    active: HashMap<RequestId, ActiveRequest>,
    seed: u64,
    stats: EngineStats,
}

impl EngineCore {
    pub fn new(loaded: LoadedEngine) -> Self {
        let runner = ModelRunner::new(loaded.model, loaded.kv);
        let stats = EngineStats {
            kv_pool_bytes: runner.kv_pool_bytes(),
            kv_bytes_per_block: runner.kv_bytes_per_block(),
            ..EngineStats::default()
        };
        Self {
            runner,
            scheduler: Scheduler::new(loaded.scheduler),
            frontend: loaded.frontend,
            active: HashMap::new(),
            seed: loaded.seed,
            stats,
        }
    }

    pub fn frontend(&self) -> &Frontend {
        &self.frontend
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work() || !self.active.is_empty()
    }

    /// Queues request `id` (unique, chosen by the caller); its deltas go to `sink`. The
    /// prompt must already be checked (`Frontend::prompt_token_ids`).
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        sink: DeltaSink,
    ) -> Result<()> {
        let max_tokens = self.frontend.max_new_tokens(prompt_ids.len(), &params)?;
        let fallback_seed = self.seed.wrapping_add(id.0);
        let stop = params.stop();
        let request = Request::new(id, prompt_ids.clone(), max_tokens)
            .with_eos_token_ids(self.frontend.tokenizer().eos_token_ids().to_vec())
            .with_stop_token_ids(stop.stop_token_ids.clone())
            .with_ignore_eos(stop.ignore_eos);
        let active = ActiveRequest {
            sampler: Sampler::new(&params, &prompt_ids, fallback_seed),
            output: SequenceOutput::new(self.frontend.tokenizer().clone(), &params),
            sink,
        };
        self.active.insert(id, active);
        self.scheduler.add_request(request);
        Ok(())
    }

    /// Finishes a request now and frees its blocks; its stream ends with `abort`.
    pub fn abort(&mut self, id: RequestId) {
        self.scheduler.abort_request(id);
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            num_preemptions: self.scheduler.num_preemptions(),
            kv: self.scheduler.kv_stats(),
            ..self.stats.clone()
        }
    }

    /// Frees cached blocks no request uses; false while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.scheduler.reset_prefix_cache()
    }

    /// One engine step. A model error fails every request of the step (their
    /// streams get the error) and leaves the engine usable for the next ones.
    pub fn step(&mut self) {
        let started = Instant::now();
        let out = self.scheduler.schedule();
        self.report_finished(&out);
        if !out.scheduled.is_empty() {
            match self.execute(&out) {
                Ok(sampled) => self.update(&out, sampled),
                Err(e) => self.fail(&out, e),
            }
            self.stats.num_steps += 1;
        }
        self.stats.busy_seconds += started.elapsed().as_secs_f64();
    }

    /// Ends the streams of requests the scheduler finished on its own (ignored, aborted).
    fn report_finished(&mut self, out: &SchedulerOutput) {
        for f in &out.finished {
            if let Some(active) = self.active.remove(&f.request_id) {
                let delta = Delta {
                    finish_reason: Some(f.reason),
                    ..Delta::default()
                };
                let _ = match &f.detail {
                    Some(detail) if f.reason == FinishReason::Ignored => {
                        active.sink.send(Err(EngineError::Ignored {
                            detail: detail.clone(),
                        }))
                    }
                    _ => active.sink.send(Ok(delta)),
                };
            }
        }
    }

    /// Runs the model over the scheduled chunks and samples each request that needs it.
    fn execute(&mut self, out: &SchedulerOutput) -> Result<Vec<(RequestId, SampledToken)>> {
        for s in &out.scheduled {
            if s.start_position < self.prompt_len(s.request_id) {
                self.stats.num_prompt_tokens_computed += s.token_ids.len() as u64;
            }
        }
        let mut logits = self.runner.execute(out)?;
        let vocab = self.runner.model().config().vocab_size;
        let mut rows = logits.chunks_exact_mut(vocab);
        let mut sampled = Vec::new();
        for s in out.scheduled.iter().filter(|s| s.sample) {
            let row = rows
                .next()
                .expect("one logits row per sampled request: this is a bug");
            let active = self
                .active
                .get_mut(&s.request_id)
                .expect("scheduled request is active: this is a bug");
            sampled.push((s.request_id, active.sampler.sample(row)));
        }
        Ok(sampled)
    }

    fn prompt_len(&self, id: RequestId) -> usize {
        self.scheduler
            .request(id)
            .map_or(0, |r| r.num_prompt_tokens())
    }

    fn update(&mut self, out: &SchedulerOutput, sampled: Vec<(RequestId, SampledToken)>) {
        let tokens: Vec<(RequestId, Vec<u32>)> = sampled
            .iter()
            .map(|(id, t)| (*id, vec![t.token_id]))
            .collect();
        let updates = self.scheduler.update(out, &tokens);
        let mut sampled: HashMap<RequestId, SampledToken> = sampled.into_iter().collect();
        for u in updates {
            let Some(token) = sampled.remove(&u.request_id) else {
                continue;
            };
            self.stats.num_generated_tokens += 1;
            let active = self
                .active
                .get_mut(&u.request_id)
                .expect("updated request is active: this is a bug");
            let delta = active.output.push(token, u.finish_reason).map(|mut d| {
                d.num_cached_tokens = u.num_cached_tokens;
                d
            });
            let finished = match &delta {
                Ok(d) => d.finish_reason.is_some(),
                Err(_) => true,
            };
            let delivered = active.sink.send(delta).is_ok();
            if finished || !delivered {
                // A stop string or a vanished caller ends the request here; a token-id or
                // length stop was already finished by the scheduler (then this is a no-op).
                // Either way the next `schedule()` lists it as finished, with no stream left.
                let reason = if delivered {
                    FinishReason::Stop
                } else {
                    FinishReason::Abort
                };
                self.scheduler.finish_request(u.request_id, reason);
                self.active.remove(&u.request_id);
            }
        }
    }

    fn fail(&mut self, out: &SchedulerOutput, error: EngineError) {
        let message = error.to_string();
        for s in &out.scheduled {
            if let Some(active) = self.active.remove(&s.request_id) {
                let _ = active.sink.send(Err(EngineError::StepFailed {
                    message: message.clone(),
                }));
            }
            self.scheduler.abort_request(s.request_id);
        }
    }

    /// Unit-length embedding of a prompt (last token's final hidden state), computed
    /// apart from the paged pool. The prompt must fit `max_model_len`.
    pub fn embed(&self, prompt_ids: &[u32]) -> Result<Vec<f32>> {
        let max_model_len = self.frontend.max_model_len();
        if prompt_ids.len() > max_model_len {
            return Err(EngineError::InputTooLong {
                input_tokens: prompt_ids.len(),
                max_model_len,
            });
        }
        Ok(self.runner.model().embed(prompt_ids)?)
    }

    /// Next-token logits at every prompt position, computed apart from the paged pool
    /// (for checking the model against a reference): one prefill, or token by token.
    pub fn prompt_logits(&self, prompt_ids: &[u32], step_by_step: bool) -> Result<Vec<f32>> {
        let model = self.runner.model();
        let mut cache = model.new_cache(prompt_ids.len());
        if !step_by_step {
            return Ok(model.forward(prompt_ids, &mut cache, LogitsFor::AllTokens)?);
        }
        let mut logits = Vec::with_capacity(prompt_ids.len() * model.config().vocab_size);
        for &id in prompt_ids {
            logits.extend(model.forward(&[id], &mut cache, LogitsFor::LastToken)?);
        }
        Ok(logits)
    }
}
