//! `ModelRunner`: the model and its paged KV pool. It turns a `SchedulerOutput`
//! (logical: token ids, positions, block tables) into one flattened
//! `ForwardBatch` (physical: slot mapping) and runs the forward pass.

use novainfer_core::{slot_mapping, SchedulerOutput};
use novainfer_model::{ForwardBatch, LogitsFor, PagedKvCache, Qwen2Model};

use crate::error::Result;

pub struct ModelRunner {
    model: Qwen2Model,
    kv: PagedKvCache,
}

impl ModelRunner {
    pub fn new(model: Qwen2Model, kv: PagedKvCache) -> Self {
        Self { model, kv }
    }

    pub fn model(&self) -> &Qwen2Model {
        &self.model
    }

    /// Bytes of one pool entry (a block, or a cell in the SLOT layout).
    pub fn kv_bytes_per_block(&self) -> usize {
        PagedKvCache::bytes_per_block(self.model.config(), self.kv.block_size())
    }

    /// Bytes of the whole KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.kv.num_blocks() * self.kv_bytes_per_block()
    }

    /// Runs the step's block copies, then every scheduled chunk in one forward pass; returns logits `[rows, vocab]`,
    /// one row per request with `sample`, in `out.scheduled` order.
    pub fn execute(&mut self, out: &SchedulerOutput) -> Result<Vec<f32>> {
        for c in &out.block_copies {
            self.kv
                .copy_block(c.src.index(), c.dst.index(), c.num_tokens)?;
        }
        let batch = self.build_batch(out);
        Ok(self
            .model
            .forward_batch(&batch, &mut self.kv, LogitsFor::LastToken)?)
    }

    fn build_batch(&self, out: &SchedulerOutput) -> ForwardBatch {
        let block_size = self.kv.block_size();
        let mut batch = ForwardBatch::default();
        for s in &out.scheduled {
            let slots = slot_mapping(
                &s.block_table,
                s.start_position,
                s.token_ids.len(),
                block_size,
            );
            let table = s.block_table.iter().map(|b| b.0).collect();
            batch.push(&s.token_ids, s.start_position, slots, table, s.sample);
        }
        batch
    }
}
