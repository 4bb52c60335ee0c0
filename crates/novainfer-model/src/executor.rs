//! The seam between the engine and a device: one executor per engine, the CPU's or a
//! GPU's, each owning its weights and its paged KV pool.
//!
//! The engine never sees a tensor. It asks an [`Executor`] three things in the step loop (run
//! this [`ForwardBatch`] and give me its tokens or the rows to sample; how many bytes is a KV
//! block; copy block a to b) and, off the hot path, for embeddings and prompt logits. The cut
//! is at the runner, not at each op, so a device is free to fuse, preallocate and (later)
//! replay CUDA graphs without the engine knowing. What a backend can do beyond that (KV
//! formats, adapters, sampling on the device) it states in its [`Capabilities`].
//!
//! The backends: [`crate::cpu`] (the oracle, always built) and [`crate::cuda`] (feature `cuda`).
//!
//! Loading is two-phase because the KV pool is sized from what the weights leave free:
//! [`DeviceWeights`] is a model whose weights are on the device and whose pool does not exist
//! yet; [`DeviceWeights::into_executor`] allocates the pool and gives the [`Executor`].

use crate::capabilities::Capabilities;
use crate::config::Qwen2Config;
use crate::cpu::CpuWeights;
use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::forward_batch::{ForwardBatch, ForwardOutput};
use crate::loader::OpenedCheckpoint;
use crate::qwen2::{LoadOptions, Qwen2Model};

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
    /// What the executor this becomes can do (the same table as its [`Executor::capabilities`]).
    fn capabilities(&self) -> Capabilities;
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

/// An executor's handle on a pass it enqueued and has not read back ([`Executor::enqueue`]).
/// Only that executor can finish it; what the number means is the executor's.
#[derive(Debug, PartialEq, Eq)]
pub struct PassTicket(pub u64);

/// What [`Executor::enqueue`] did with a pass.
#[derive(Debug)]
pub enum Enqueued {
    /// It ran: its output.
    Done(ForwardOutput),
    /// It is on the device; [`Executor::finish`] reads it back.
    InFlight(PassTicket),
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
    /// Bytes the weights occupy in the device's memory, where the executor knows them: the
    /// CUDA executor's every matrix as it holds it (packed or bf16, the embedding table
    /// included) and vectors; what `gpu_weight_dtype` changes.
    fn weight_bytes(&self) -> Option<usize> {
        None
    }
    /// What this backend can do ([`Capabilities`]): the engine asks, never the device kind.
    /// A batch asking for more (an adapter span without `adapters`, a draw without
    /// `sampling.draws`) is answered with [`ModelError::Unsupported`](crate::ModelError).
    fn capabilities(&self) -> Capabilities;
    /// Copies the first `num_tokens` slots of block `src` into block `dst`, every layer.
    fn copy_block(&mut self, src: usize, dst: usize, num_tokens: usize) -> Result<()>;
    /// Writes the batch's K/V at its slots and returns what each span asks for (logits
    /// rows, drawn tokens and final hidden rows, each in `batch.seqs` order; see
    /// [`SpanOutput`](crate::SpanOutput)).
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput>;
    /// Whether [`Self::enqueue`] takes `batch`'s chained inputs from the device (the draws of
    /// the pass enqueued before it, still in device memory); otherwise the caller fills them
    /// in itself once that pass has been read back.
    fn chains_on_device(&self, _batch: &ForwardBatch) -> bool {
        false
    }
    /// Enqueues `batch`'s forward pass and returns before the device has run it where the
    /// backend can ([`Enqueued::InFlight`]: the CUDA executor's plain sampled steps), so the
    /// caller can enqueue the next pass before reading this one back; [`Self::finish`] waits
    /// for it. `chained` (only where [`Self::chains_on_device`]) are `(flat token, k)` pairs:
    /// that token of `batch` is the `k`-th token drawn by the pass enqueued just before. The
    /// default runs the pass now.
    fn enqueue(&mut self, batch: &ForwardBatch, chained: &[(usize, usize)]) -> Result<Enqueued> {
        if !chained.is_empty() {
            return Err(ModelError::Unsupported {
                what: "inputs chained to the previous pass on the device".into(),
                device: self.device().to_string(),
            });
        }
        Ok(Enqueued::Done(self.forward(batch)?))
    }
    /// Whether an in-flight pass has run (so [`Self::finish`] would not wait).
    fn is_done(&mut self, _pass: &PassTicket) -> Result<bool> {
        Ok(true)
    }
    /// Waits for an in-flight pass and returns what [`Self::forward`] would have. Passes are
    /// finished in the order they were enqueued.
    fn finish(&mut self, pass: PassTicket) -> Result<ForwardOutput> {
        Err(ModelError::config(
            "finish",
            format!("{pass:?}: this executor enqueues no pass it does not finish at once"),
        ))
    }
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
            Ok(Box::new(CpuWeights(Qwen2Model::build_scaled(
                opened.config,
                opened.rope_scaling,
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
