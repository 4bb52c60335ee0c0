//! `ModelRunner`: the engine's side of the device seam. It turns a `SchedulerOutput`
//! (logical: token ids, positions, block tables) into one flattened `ForwardBatch`
//! (physical: slot mapping) and hands it to the device's [`Executor`], CPU or GPU. A draft
//! model runs its own passes over the same blocks through a runner of its own ([`Span`]).

use std::collections::HashMap;

use novainfer_core::{slot_mapping, AdapterId, BlockId, ChunkOutput, RequestId, SchedulerOutput};
use novainfer_model::{
    AdapterRef, Capabilities, Device, Draw, Executor, ForwardBatch, ForwardOutput, Qwen2Config,
    SpanOutput,
};

use crate::error::{EngineError, Result};

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

pub struct ModelRunner {
    executor: Box<dyn Executor>,
}

impl ModelRunner {
    pub fn new(executor: Box<dyn Executor>) -> Self {
        Self { executor }
    }

    pub fn config(&self) -> &Qwen2Config {
        self.executor.config()
    }

    pub fn device(&self) -> Device {
        self.executor.device()
    }

    /// What the backend can do; the engine asks this rather than the device kind.
    pub fn capabilities(&self) -> Capabilities {
        self.executor.capabilities()
    }

    /// Bytes of one pool entry (a block, or a cell in the SLOT layout).
    pub fn kv_bytes_per_block(&self) -> usize {
        self.executor.kv_bytes_per_block()
    }

    /// Weight bytes a decode step reads, where the executor knows them.
    pub fn weight_bytes_per_token(&self) -> Option<usize> {
        self.executor.weight_bytes_per_token()
    }

    /// Bytes of the whole KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.executor.num_blocks() * self.executor.kv_bytes_per_block()
    }

    /// Runs the step's block copies, then every scheduled chunk in one forward pass; returns
    /// what the chunks ask for (logits rows, drawn tokens and hidden rows, in `out.scheduled`
    /// order). `adapters` holds every adapter a scheduled request names; `draws` the sampled
    /// requests the device draws itself (only for a backend whose capabilities say it can).
    pub fn execute(
        &mut self,
        out: &SchedulerOutput,
        adapters: &HashMap<AdapterId, AdapterRef>,
        draws: &DeviceDraws,
    ) -> Result<ForwardOutput> {
        for c in &out.block_copies {
            self.executor
                .copy_block(c.src.index(), c.dst.index(), c.num_tokens)?;
        }
        let batch = self.build_batch(out, adapters, draws)?;
        Ok(self.executor.forward(&batch)?)
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
        Ok(self.executor.forward(&batch)?)
    }

    /// Appends `span` to `batch`, its block table turned into the slots its KV goes to.
    fn push(&self, batch: &mut ForwardBatch, span: Span<'_>) {
        let slots = slot_mapping(
            span.block_table,
            span.start_position,
            span.token_ids.len(),
            self.executor.block_size(),
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
        Ok(self.executor.prompt_logits(tokens, true)?)
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
