//! The seam between the engine and a device: one executor per engine, the CPU's or a
//! GPU's, each owning its weights and its paged KV pool.
//!
//! The engine never sees a tensor. It asks an [`Executor`] three things in the step loop (run
//! this [`ForwardBatch`] and give me the rows to sample; how many bytes is a KV block; copy
//! block a to b) and, off the hot path, for embeddings and prompt logits. The cut is at the
//! runner, not at each op, so a device is free to fuse, preallocate and (later) replay CUDA
//! graphs without the engine knowing.
//!
//! Loading is two-phase because the KV pool is sized from what the weights leave free:
//! [`DeviceWeights`] is a model whose weights are on the device and whose pool does not exist
//! yet; [`DeviceWeights::into_executor`] allocates the pool and gives the [`Executor`].

use crate::config::Qwen2Config;
use crate::device::Device;
#[cfg(not(feature = "cuda"))]
use crate::error::ModelError;
use crate::error::Result;
use crate::forward_batch::{ForwardBatch, ForwardOutput};
use crate::loader::OpenedCheckpoint;
use crate::paged_kv::PagedKvCache;
use crate::qwen2::{LoadOptions, LogitsFor, Qwen2Model};

/// Sizes the engine fixes before loading, which a device may preallocate for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Most tokens in one step (the scheduler's token budget).
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Longest sequence the pool may be asked to hold (an upper bound: the engine may
    /// lower `max_model_len` to what the pool holds once it is sized).
    pub max_seq_len: usize,
}

/// Free and total memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: usize,
    pub total: usize,
}

/// A model whose weights are loaded on a device, before its KV pool exists.
pub trait DeviceWeights: Send {
    fn device(&self) -> Device;
    fn config(&self) -> &Qwen2Config;
    /// Bytes one KV block of `block_size` tokens takes on this device (all layers, K and V).
    fn kv_bytes_per_block(&self, block_size: usize) -> usize;
    /// The device's memory now (after the weights and any preallocated buffers), for
    /// sizing the KV pool by a fraction; `None` for host memory, which the engine reads itself.
    fn device_memory(&self) -> Result<Option<DeviceMemory>>;
    /// Allocates a pool of `num_blocks` blocks of `block_size` tokens.
    fn into_executor(
        self: Box<Self>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Box<dyn Executor>>;
}

/// A model and its KV pool on one device: what the engine's step loop runs.
pub trait Executor: Send {
    fn device(&self) -> Device;
    fn config(&self) -> &Qwen2Config;
    fn block_size(&self) -> usize;
    fn num_blocks(&self) -> usize;
    /// Bytes of one pool block (all layers, K and V).
    fn kv_bytes_per_block(&self) -> usize;
    /// Weight bytes a decode step reads from the device's memory, where the executor knows
    /// them (see [`Qwen2Model::weight_bytes_per_token`]); benchmarks set decode speed against it.
    fn weight_bytes_per_token(&self) -> Option<usize> {
        None
    }
    /// Whether [`Self::forward`] runs spans with a LoRA adapter ([`SeqSpan::adapter`](crate::SeqSpan)).
    /// A device without it answers such a batch with [`ModelError::Unsupported`](crate::ModelError).
    fn supports_adapters(&self) -> bool {
        false
    }
    /// Copies the first `num_tokens` slots of block `src` into block `dst`, every layer.
    fn copy_block(&mut self, src: usize, dst: usize, num_tokens: usize) -> Result<()>;
    /// Writes the batch's K/V at its slots and returns what each span asks for (logits
    /// rows and final hidden rows, in `batch.seqs` order; see [`SpanOutput`](crate::SpanOutput)).
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput>;
    /// Unit-length embedding of a whole prompt (its last token's final hidden state),
    /// computed apart from the pool in one call: a reference to check devices against each
    /// other (the engine embeds through `forward`, in chunks).
    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Next-token logits at every prompt position, computed apart from the pool: in one
    /// prefill, or token by token (a reference, like `embed`).
    fn prompt_logits(&mut self, tokens: &[u32], step_by_step: bool) -> Result<Vec<f32>>;
}

/// Loads `opened` onto `device`.
pub fn load_weights(
    device: Device,
    opened: OpenedCheckpoint,
    opts: &LoadOptions,
    limits: StepLimits,
) -> Result<Box<dyn DeviceWeights>> {
    match device {
        Device::Cpu => {
            let _ = limits; // The CPU allocates per step.
            Ok(Box::new(CpuWeights(Qwen2Model::build(
                opened.config,
                opened.checkpoint,
                opts,
            )?)))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => crate::cuda::load_weights(ordinal, opened, opts, limits),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(ModelError::DeviceUnavailable {
            device: device.to_string(),
            reason: "this build of novainfer has no CUDA support (feature `cuda` off)".into(),
        }),
    }
}

/// The CPU model before its pool exists.
pub struct CpuWeights(pub Qwen2Model);

impl DeviceWeights for CpuWeights {
    fn device(&self) -> Device {
        Device::Cpu
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

    fn supports_adapters(&self) -> bool {
        true
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
