//! `ModelRunner`: the engine's side of the device seam. It turns a `SchedulerOutput`
//! (logical: token ids, positions, block tables) into one flattened `ForwardBatch`
//! (physical: slot mapping) and hands it to the device's [`Executor`], CPU or GPU.

use std::collections::HashMap;

use novainfer_core::{slot_mapping, AdapterId, ChunkOutput, RequestId, SchedulerOutput};
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
        let block_size = self.executor.block_size();
        let mut batch = ForwardBatch::default();
        for s in &out.scheduled {
            let slots = slot_mapping(
                &s.block_table,
                s.start_position,
                s.token_ids.len(),
                block_size,
            );
            let table = s.block_table.iter().map(|b| b.0).collect();
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
            batch.push_adapted(
                &s.token_ids,
                s.start_position,
                slots,
                table,
                output,
                adapter,
            );
        }
        Ok(batch)
    }
}
