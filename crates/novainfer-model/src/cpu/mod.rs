//! The Qwen2 forward on the CPU: our SIMD kernels over the model in host memory, and a paged
//! KV pool in any of the storage formats. The oracle every other backend is checked against.
//!
//! Mirrors [`crate::cuda`]: [`CpuWeights`] is the model before its pool exists,
//! [`CpuExecutor`] the model and its pool, what the engine's step loop runs.

use crate::capabilities::{self, Capabilities};
use crate::config::Qwen2Config;
use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::executor::{DeviceMemory, DeviceWeights, Executor};
use crate::forward_batch::{ForwardBatch, ForwardOutput};
use crate::paged_kv::PagedKvCache;
use crate::qwen2::{LogitsFor, Qwen2Model};

/// The CPU model before its pool exists.
pub struct CpuWeights(pub Qwen2Model);

impl DeviceWeights for CpuWeights {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        capabilities::CPU
    }

    fn config(&self) -> &Qwen2Config {
        self.0.config()
    }

    fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        PagedKvCache::bytes_per_block(self.0.config(), block_size, self.0.kv_dtype())
    }

    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        Ok(None)
    }

    fn into_executor(
        self: Box<Self>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Box<dyn Executor>> {
        let kv = PagedKvCache::new(self.0.config(), num_blocks, block_size, self.0.kv_dtype());
        Ok(Box::new(CpuExecutor { model: self.0, kv }))
    }
}

/// The CPU model and its pool (in the model's KV dtype): the oracle every other device is checked against.
pub struct CpuExecutor {
    model: Qwen2Model,
    kv: PagedKvCache,
}

impl CpuExecutor {
    pub fn new(model: Qwen2Model, kv: PagedKvCache) -> Self {
        Self { model, kv }
    }

    pub fn model(&self) -> &Qwen2Model {
        &self.model
    }
}

impl Executor for CpuExecutor {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn capabilities(&self) -> Capabilities {
        capabilities::CPU
    }

    fn config(&self) -> &Qwen2Config {
        self.model.config()
    }

    fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn kv_bytes_per_block(&self) -> usize {
        PagedKvCache::bytes_per_block(self.model.config(), self.kv.block_size(), self.kv.dtype())
    }

    fn weight_bytes_per_token(&self) -> Option<usize> {
        Some(self.model.weight_bytes_per_token())
    }

    fn copy_block(&mut self, src: usize, dst: usize, num_tokens: usize) -> Result<()> {
        self.kv.copy_block(src, dst, num_tokens)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput> {
        // The engine's sampler runs in the same memory as the logits: the CPU draws nothing
        // itself (`capabilities::CPU.sampling`), and a batch asking it to is an engine bug.
        if batch.has_draws() {
            return Err(ModelError::Unsupported {
                what: "sampling on the device (SpanOutput::Draw)".into(),
                device: Device::Cpu.to_string(),
            });
        }
        self.model.forward_outputs(batch, &mut self.kv)
    }

    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.model.embed(tokens)
    }

    fn prompt_logits(&mut self, tokens: &[u32], step_by_step: bool) -> Result<Vec<f32>> {
        let model = &self.model;
        let mut cache = model.new_cache(tokens.len());
        if !step_by_step {
            return model.forward(tokens, &mut cache, LogitsFor::AllTokens);
        }
        let mut logits = Vec::with_capacity(tokens.len() * model.config().vocab_size);
        for &id in tokens {
            logits.extend(model.forward(&[id], &mut cache, LogitsFor::LastToken)?);
        }
        Ok(logits)
    }
}
