//! `ModelRunner`: the engine's side of the device seam. It turns a `SchedulerOutput`
//! (logical: token ids, positions, block tables) into one flattened `ForwardBatch`
//! (physical: slot mapping) and hands it to the device's [`Executor`], CPU or GPU, which runs
//! on a thread of its own ([`DeviceThread`]): [`ModelRunner::launch`] returns at once, so the
//! engine can schedule the next step while this one runs. A draft model runs its own passes
//! over the same blocks through a runner of its own ([`Span`]).

use std::collections::HashMap;

use novainfer_core::{slot_mapping, AdapterId, BlockId, ChunkOutput, RequestId, SchedulerOutput};
use novainfer_model::{
    AdapterRef, Capabilities, Device, Draw, Executor, ForwardBatch, ForwardOutput, Qwen2Config,
    SpanOutput,
};

use crate::device_thread::{DeviceThread, Pending};
use crate::error::{EngineError, Result};

/// A forward pass handed to the device thread: its output once it has run.
pub struct PendingForward(Pending<novainfer_model::Result<ForwardOutput>>);

impl PendingForward {
    /// Blocks until the pass has run.
    pub fn wait(self) -> Result<ForwardOutput> {
        Ok(self.0.wait()??)
    }
}

/// The rows of a step the backend draws itself: sampled requests' next tokens, and verified
/// requests' rows (one rule per token: the sampler's after the draft's first i tokens).
#[derive(Debug, Default)]
pub struct DeviceDraws {
    pub samples: HashMap<RequestId, Draw>,
    pub verifies: HashMap<RequestId, Vec<Draw>>,
}

/// One request's chunk of a forward pass in the scheduler's terms: its tokens at positions
/// `start_position..`, whose KV is written to (and read from) the blocks of `block_table`.
pub struct Span<'a> {
    pub token_ids: &'a [u32],
    pub start_position: usize,
    pub block_table: &'a [BlockId],
    pub output: SpanOutput,
    pub adapter: Option<AdapterRef>,
}

/// What an executor says about itself, read once: it never changes while it runs.
struct Facts {
    config: Qwen2Config,
    device: Device,
    capabilities: Capabilities,
    block_size: usize,
    num_blocks: usize,
    kv_bytes_per_block: usize,
    weight_bytes_per_token: Option<usize>,
}

pub struct ModelRunner {
    executor: DeviceThread,
    facts: Facts,
}

impl ModelRunner {
    pub fn new(executor: Box<dyn Executor>) -> Self {
        let facts = Facts {
            config: executor.config().clone(),
            device: executor.device(),
            capabilities: executor.capabilities(),
            block_size: executor.block_size(),
            num_blocks: executor.num_blocks(),
            kv_bytes_per_block: executor.kv_bytes_per_block(),
            weight_bytes_per_token: executor.weight_bytes_per_token(),
        };
        Self {
            executor: DeviceThread::spawn(executor),
            facts,
        }
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.facts.config
    }

    pub fn device(&self) -> Device {
        self.facts.device
    }

    /// What the backend can do; the engine asks this rather than the device kind.
    pub fn capabilities(&self) -> Capabilities {
        self.facts.capabilities
    }

    /// Bytes of one pool entry (a block, or a cell in the SLOT layout).
    pub fn kv_bytes_per_block(&self) -> usize {
        self.facts.kv_bytes_per_block
    }

    /// Weight bytes a decode step reads, where the executor knows them.
    pub fn weight_bytes_per_token(&self) -> Option<usize> {
        self.facts.weight_bytes_per_token
    }

    /// Bytes of the whole KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.facts.num_blocks * self.facts.kv_bytes_per_block
    }

    /// Starts the step's block copies, then every scheduled chunk in one forward pass, on the
    /// device thread; its output holds what the chunks ask for (logits rows, drawn tokens and
    /// hidden rows, in `out.scheduled` order). `adapters` holds every adapter a scheduled
    /// request names; `draws` the sampled requests the device draws itself (only for a backend
    /// whose capabilities say it can).
    pub fn launch(
        &mut self,
        out: &SchedulerOutput,
        adapters: &HashMap<AdapterId, AdapterRef>,
        draws: &DeviceDraws,
    ) -> Result<PendingForward> {
        let batch = self.build_batch(out, adapters, draws)?;
        let copies: Vec<(usize, usize, usize)> = out
            .block_copies
            .iter()
            .map(|c| (c.src.index(), c.dst.index(), c.num_tokens))
            .collect();
        Ok(PendingForward(self.executor.submit(move |executor| {
            for (src, dst, num_tokens) in copies {
                executor.copy_block(src, dst, num_tokens)?;
            }
            executor.forward(&batch)
        })))
    }

    /// Runs `spans` in one forward pass: a proposer's own passes over the scheduler's blocks.
    pub fn forward<'a>(
        &mut self,
        spans: impl IntoIterator<Item = Span<'a>>,
    ) -> Result<ForwardOutput> {
        let mut batch = ForwardBatch::default();
        for span in spans {
            self.push(&mut batch, span);
        }
        Ok(self
            .executor
            .call(move |executor| executor.forward(&batch))??)
    }

    /// Appends `span` to `batch`, its block table turned into the slots its KV goes to.
    fn push(&self, batch: &mut ForwardBatch, span: Span<'_>) {
        let slots = slot_mapping(
            span.block_table,
            span.start_position,
            span.token_ids.len(),
            self.facts.block_size,
        );
        let table = span.block_table.iter().map(|b| b.0).collect();
        batch.push_adapted(
            span.token_ids,
            span.start_position,
            slots,
            table,
            span.output,
            span.adapter,
        );
    }

    /// Logits at every prompt position, token by token apart from the pool (a reference).
    pub fn stepwise_prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let tokens = tokens.to_vec();
        Ok(self
            .executor
            .call(move |executor| executor.prompt_logits(&tokens, true))??)
    }

    fn build_batch(
        &self,
        out: &SchedulerOutput,
        adapters: &HashMap<AdapterId, AdapterRef>,
        draws: &DeviceDraws,
    ) -> Result<ForwardBatch> {
        let mut batch = ForwardBatch::default();
        for s in &out.scheduled {
            let output = match s.output {
                ChunkOutput::Nothing => SpanOutput::None,
                ChunkOutput::Sample => match draws.samples.get(&s.request_id) {
                    Some(draw) => SpanOutput::Draw(draw.clone()),
                    None => SpanOutput::LastLogits,
                },
                ChunkOutput::Verify => match draws.verifies.get(&s.request_id) {
                    Some(each) => SpanOutput::DrawEach(each.clone()),
                    None => SpanOutput::AllLogits,
                },
                ChunkOutput::Hidden => SpanOutput::LastHidden,
                ChunkOutput::PromptLogits => SpanOutput::AllLogits,
            };
            let adapter = match s.adapter {
                None => None,
                Some(id) => {
                    Some(
                        adapters
                            .get(&id)
                            .cloned()
                            .ok_or_else(|| EngineError::StepFailed {
                                message: format!(
                                    "{} of {} is not held: this is a bug",
                                    id, s.request_id
                                ),
                            })?,
                    )
                }
            };
            let span = Span {
                token_ids: &s.token_ids,
                start_position: s.start_position,
                block_table: &s.block_table,
                output,
                adapter,
            };
            self.push(&mut batch, span);
        }
        Ok(batch)
    }
}
