//! The engine's view of the GPU: [`CudaWeights`] (model and buffers loaded, pool not yet)
//! and [`CudaExecutor`] (with its pool).

use novainfer_cuda::cudarc::driver::sys::CUevent_flags;
use novainfer_cuda::cudarc::driver::CudaEvent;
use novainfer_cuda::kernels::DtypeKind;
use novainfer_cuda::ops::kv::{copy_block, BlockCopy, KvCacheMut, KvGeometry};
use novainfer_cuda::ops::paged_attention::{AttentionConfig, DecodeScratch};
use novainfer_cuda::ops::rope::RopeTable;
use novainfer_cuda::GpuContext;

use super::buffers::{Activations, EditBuffers, KvPool, MaskBuffers, Readback, StepBuffers};
use super::cuda_error;
use super::forward::{read_tail, Step, Tail, TailOut, TailPassed, TailReads};
use super::graphs::{DecodeGraphs, Runner};
use super::lora::DeviceAdapters;
use super::weights::GpuModel;
use crate::capabilities::{self, Capabilities};
use crate::config::{Qwen2Config, WeightDtype};
use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::executor::{DeviceMemory, DeviceWeights, Enqueued, Executor, PassTicket, StepLimits};
use crate::forward_batch::{ForwardBatch, ForwardOutput, SpanOutput};
use crate::layers::ops::normalize_l2;
use crate::loader::OpenedCheckpoint;
use crate::prepare::graph::{fits_bucket, replay_step, route, CudaGraphs, StepRoute};
use crate::prepare::linear::DecodeLinear;
use crate::prepare::{HostModelReader, PackedStep, StepCapacity, StepLayout};
use crate::qwen2::{DtypeChoice, LoadOptions};
use crate::weight_quantization::QuantizedAtLoad;

/// The model on the GPU with every buffer a step needs, before the KV pool exists.
pub struct CudaWeights {
    gpu: GpuContext,
    device: Device,
    cfg: Qwen2Config,
    model: GpuModel,
    rope: RopeTable,
    act: Activations,
    scratch: DecodeScratch,
    readback: [Readback; 2],
    edits: EditBuffers,
    masks: MaskBuffers,
    limits: StepLimits,
    graph_mode: CudaGraphs,
    decode_linear: DecodeLinear,
    /// The staging and readback slot the next step uses; a pass left in flight keeps the
    /// other one (`Step::slot`).
    slot: usize,
}

impl CudaWeights {
    pub fn load(
        ordinal: usize,
        opened: OpenedCheckpoint,
        opts: &LoadOptions,
        limits: StepLimits,
    ) -> Result<Self> {
        let device = Device::Cuda(ordinal);
        let cfg = opened.config;
        check_supported(&cfg, opts, device)?;
        if limits.max_num_batched_tokens == 0 || limits.max_num_seqs == 0 || limits.max_seq_len == 0
        {
            return Err(ModelError::config(
                "step limits",
                format!("max_num_batched_tokens, max_num_seqs and max_seq_len must be positive, got {limits:?}"),
            ));
        }
        let (decode_linear, packed_gemm) = (opts.decode_linear, opts.packed_gemm);
        let gpu = GpuContext::new(ordinal).map_err(|e| cuda_error(device, e))?;
        let err = |e| cuda_error(device, e);
        let model = GpuModel::load(
            &gpu,
            device,
            HostModelReader::new(
                cfg.clone(),
                QuantizedAtLoad::new(opened.checkpoint, opts.quantization),
            ),
            opts.gpu_weight_dtype,
        )?;
        let rope = RopeTable::with_scaling(
            &gpu,
            cfg.head_dim(),
            cfg.rope_theta,
            &opened.rope_scaling,
            limits.max_seq_len,
        )
        .map_err(err)?;
        let act = Activations::new(
            &gpu,
            &cfg,
            limits.max_num_batched_tokens,
            limits.max_num_seqs,
            packed_gemm,
            model.expanded_len(),
            model.ordered_cols(),
        )?;
        // The scratch depends on heads and history length only; block geometry is the
        // pool's and comes with each launch.
        let scratch = DecodeScratch::new(
            &gpu,
            &attention_config(&cfg, 1, 1),
            limits.max_num_seqs,
            limits.max_seq_len,
        )
        .map_err(err)?;
        // Two: a pass left on the device reads back into its own while the next one runs.
        let readback = [
            Readback::new(&gpu, &cfg, limits.max_num_seqs)?,
            Readback::new(&gpu, &cfg, limits.max_num_seqs)?,
        ];
        let edits = EditBuffers::new(&gpu, limits.max_num_seqs)?;
        let masks = MaskBuffers::new(&gpu, &cfg, limits.max_num_seqs)?;
        // Everything above is queued on the stream; finish it so errors surface here and
        // freed upload buffers are back with the driver before memory is measured.
        gpu.synchronize().map_err(err)?;
        if let Ok((free, total)) = gpu.mem_info() {
            tracing::info!(%device, free_mib = free >> 20, total_mib = total >> 20, ?decode_linear, ?packed_gemm, "weights and buffers on the GPU");
        }
        Ok(Self {
            gpu,
            device,
            cfg,
            model,
            rope,
            act,
            scratch,
            readback,
            edits,
            masks,
            limits,
            graph_mode: opts.cuda_graphs,
            decode_linear,
            slot: 0,
        })
    }
}

/// Refuses, before any upload, what the GPU path cannot run.
fn check_supported(cfg: &Qwen2Config, opts: &LoadOptions, device: Device) -> Result<()> {
    if let DtypeChoice::Fixed(d @ (WeightDtype::F32 | WeightDtype::F16)) = opts.dtype {
        return Err(ModelError::Unsupported {
            what: format!("dtype {d:?} (the CUDA executor keeps weights and activations in bf16; use auto or bf16)"),
            device: device.to_string(),
        });
    }
    let dims = DtypeKind::Bf16.attention_head_dims();
    if !dims.contains(&cfg.head_dim()) {
        return Err(ModelError::Unsupported {
            what: format!(
                "head_dim {} (the attention kernels are built for {dims:?})",
                cfg.head_dim()
            ),
            device: device.to_string(),
        });
    }
    Ok(())
}

fn attention_config(
    cfg: &Qwen2Config,
    block_size: usize,
    max_blocks_per_seq: usize,
) -> AttentionConfig {
    AttentionConfig {
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim(),
        block_size,
        max_blocks_per_seq,
    }
}

impl DeviceWeights for CudaWeights {
    fn device(&self) -> Device {
        self.device
    }

    fn capabilities(&self) -> Capabilities {
        capabilities::CUDA
    }

    fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        KvPool::bytes_per_block(&self.cfg, block_size)
    }

    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        let (free, total) = self
            .gpu
            .mem_info()
            .map_err(|e| cuda_error(self.device, e))?;
        Ok(Some(DeviceMemory { free, total }))
    }

    fn into_executor(
        self: Box<Self>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Box<dyn Executor>> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::config(
                "kv cache",
                format!("a pool needs blocks and slots, got {num_blocks} blocks of {block_size}"),
            ));
        }
        let me = *self;
        let kv = KvPool::new(&me.gpu, &me.cfg, num_blocks, block_size)?;
        let capacity = StepCapacity {
            vocab_size: me.cfg.vocab_size,
            rope_positions: me.rope.max_positions(),
            num_blocks,
            block_size,
            max_blocks_per_seq: me.limits.max_seq_len.div_ceil(block_size),
            max_tokens: me.limits.max_num_batched_tokens,
            max_seqs: me.limits.max_num_seqs,
        };
        // Small (a few bytes per token and per table entry), so sized here with the block
        // size rather than counted in `device_memory`.
        let meta = StepBuffers::new(&me.gpu, StepLayout::new(&capacity))?;
        me.gpu.synchronize().map_err(|e| cuda_error(me.device, e))?;
        let cfg_layers = me.cfg.num_hidden_layers;
        let mut executor = CudaExecutor {
            w: me,
            kv,
            meta,
            capacity,
            graphs: None,
            lora: DeviceAdapters::new(cfg_layers, capacity.max_tokens),
            in_flight: [None, None],
            last_draws: None,
            next_ticket: 0,
        };
        if executor.w.graph_mode == CudaGraphs::Captured {
            // Over the engine's pool: the graphs capture its addresses (padding rows write
            // no K/V, so capturing and warming them up leaves the pool as it was).
            let max_rows = capacity.max_seqs.min(capacity.max_tokens);
            let max_seq_len = executor
                .w
                .scratch
                .max_seq_len()
                .min(capacity.max_blocks_per_seq * block_size);
            let step = executor.w.step(&mut executor.meta, &mut executor.kv);
            match DecodeGraphs::capture(step, max_rows, max_seq_len) {
                Ok(graphs) => executor.graphs = Some(graphs),
                // Graphs are a speed-up: without them every step runs eagerly, as with
                // `enforce_eager`. The capture drained the stream; an executor whose stream
                // cannot even synchronise is broken, and says so.
                Err(e) => {
                    executor
                        .w
                        .gpu
                        .synchronize()
                        .map_err(|sync| cuda_error(executor.w.device, sync))?;
                    tracing::warn!(
                        device = %executor.w.device,
                        error = %e,
                        "CUDA graph capture failed; decode steps run eagerly"
                    );
                }
            }
        }
        Ok(Box::new(executor))
    }
}

/// The model, its buffers and its bf16 KV pool on one GPU.
pub struct CudaExecutor {
    w: CudaWeights,
    kv: KvPool,
    meta: StepBuffers,
    capacity: StepCapacity,
    /// Decode graphs, when on ([`CudaGraphs::Captured`]); only for steps over `kv`.
    graphs: Option<DecodeGraphs>,
    /// The LoRA adapters steps have used, on the device.
    lora: DeviceAdapters,
    /// Passes enqueued and not yet read back, by slot (at most one per slot).
    in_flight: [Option<InFlight>; 2],
    /// The sampled row of each token the last enqueued pass drew (its draws still in
    /// `act.drawn_ids`): where a chained input of the next pass comes from. `None` once
    /// another forward may have drawn over them.
    last_draws: Option<Vec<usize>>,
    next_ticket: u64,
}

impl Drop for CudaExecutor {
    /// Waits for the stream before anything is freed: a pass in flight (an error path, a
    /// dropped engine) may still be copying into the pinned readback, and the graphs' kernel
    /// nodes reference the modules `w` owns, which fields drop first.
    fn drop(&mut self) {
        let _ = self.w.gpu.synchronize();
        self.in_flight = [None, None];
        self.graphs = None;
    }
}

/// A pass on the device: what reading it back needs.
struct InFlight {
    ticket: u64,
    step: PackedStep,
    reads: TailReads,
    /// Recorded after the pass's last copy back.
    done: CudaEvent,
}

impl CudaWeights {
    /// A step over this model's buffers, writing K/V into `kv` (the engine's pool, or a
    /// scratch pool for work apart from it).
    fn step<'a>(&'a mut self, meta: &'a mut StepBuffers, kv: &'a mut KvPool) -> Step<'a> {
        Step {
            gpu: &self.gpu,
            device: self.device,
            cfg: &self.cfg,
            model: &self.model,
            rope: &self.rope,
            act: &mut self.act,
            meta,
            kv,
            scratch: &mut self.scratch,
            readback: &mut self.readback[self.slot],
            edits: &mut self.edits,
            masks: &mut self.masks,
            lora: None,
            linear: self.decode_linear,
            slot: self.slot,
        }
    }
}

impl CudaExecutor {
    /// The bucket whose graph replays `step` (packed from `batch`): where `route` sends it and
    /// the padding takes it; `None` runs it eagerly.
    fn graph_bucket(&self, batch: &ForwardBatch, step: &PackedStep) -> Option<usize> {
        let graphs = self.graphs.as_ref()?;
        match route(batch, Some(&graphs.buckets)) {
            StepRoute::Graph { bucket } => {
                fits_bucket(step, bucket, self.meta.layout.max_blocks_per_seq).then_some(bucket)
            }
            StepRoute::Eager(_) => None,
        }
    }

    /// A step run now goes through staging slot `w.slot` (metadata, edits, masks, readback):
    /// it must not be a pass's still in flight, whose inputs may not have been copied yet and
    /// whose results are not read yet. The engine finishes a pass before a synchronous step.
    fn slot_is_free(&self, what: &str) -> Result<()> {
        match &self.in_flight[self.w.slot] {
            Some(f) => Err(ModelError::config(
                "enqueue",
                format!(
                    "{what} while both staging slots hold passes in flight (pass {}): finish one first",
                    f.ticket
                ),
            )),
            None => Ok(()),
        }
    }

    /// Runs one sequence apart from the engine's pool, in a scratch pool of its own
    /// allocated for the call (these requests are off the hot path; a prompt too long for
    /// the free memory is an allocation error, not a fault). `chunk` tokens per step;
    /// `sample_every` asks for every token's row (each token its own one-token span over
    /// the shared table: the same attention as one prefill, with a row per token).
    fn apart(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        sample_every: bool,
        tail: Tail,
    ) -> Result<Vec<f32>> {
        self.slot_is_free("a request apart from the pool")?;
        let block_size = self.kv.block_size;
        let num_blocks = tokens.len().div_ceil(block_size).max(1);
        let mut scratch_pool = KvPool::new(&self.w.gpu, &self.w.cfg, num_blocks, block_size)?;
        let capacity = StepCapacity {
            num_blocks,
            ..self.capacity
        };
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let mut out = Vec::new();
        for (c, part) in tokens.chunks(chunk.max(1)).enumerate() {
            let start = c * chunk;
            let last = start + part.len() == tokens.len();
            let mut batch = ForwardBatch::default();
            if sample_every {
                for (i, &t) in part.iter().enumerate() {
                    batch.push(&[t], start + i, vec![start + i], table.clone(), true);
                }
            } else {
                batch.push(
                    part,
                    start,
                    (start..start + part.len()).collect(),
                    table.clone(),
                    last,
                );
            }
            let step = PackedStep::pack(&batch, &capacity)?;
            let rows = self
                .w
                .step(&mut self.meta, &mut scratch_pool)
                .run(&step, tail)?;
            out.extend(rows.rows);
        }
        Ok(out)
    }
}

impl CudaExecutor {
    /// A step over the engine's pool: replayed from a decode graph where
    /// [`Self::graph_bucket`] finds one (graphs on, `may_replay`, a plain sampled decode step
    /// within the largest bucket), else eager.
    fn run_in_pool(
        &mut self,
        batch: &ForwardBatch,
        tail: Tail,
        may_replay: bool,
    ) -> Result<TailOut> {
        if batch.seqs.is_empty() {
            return Ok(TailOut::default());
        }
        let mut step = PackedStep::pack(batch, &self.capacity)?;
        // Adapters run eagerly: a graph captures the base model's launches only.
        let with_lora = !step.adapters.is_empty();
        self.lora.bind(&self.w.gpu, &mut step)?;
        let may_replay = may_replay && !with_lora;
        let bucket = match (tail, may_replay) {
            (Tail::Logits, true) => self.graph_bucket(batch, &step),
            _ => None,
        };
        if let (Some(graphs), Some(bucket)) = (self.graphs.as_mut(), bucket) {
            let step_buffers = self.w.step(&mut self.meta, &mut self.kv);
            let mut runner = Runner {
                step: step_buffers,
                graphs,
                wait: true,
            };
            return match replay_step(&mut runner, &step, bucket)? {
                TailPassed::Done(out) => Ok(out),
                TailPassed::Reads(_) => Err(ModelError::Cuda(
                    "a replay left in flight by a waiting runner: this is a bug".into(),
                )),
            };
        }
        let mut forward = self.w.step(&mut self.meta, &mut self.kv);
        if with_lora {
            forward.lora = self.lora.step();
        }
        forward.run(&step, tail)
    }

    /// A step with embeddings, scored prompts or verifies in it. The forward returns at most
    /// its spans' last rows, of one kind (logits and draws, or hidden states), and at most
    /// `max_seqs` of them; so the embeddings run one by one with the hidden tail, and the rest
    /// as [`ForwardBatch::row_passes`]: a scored prompt's or a verify's tokens become one-token
    /// spans over their table (the same attention as one chunk, with a row per token), packed
    /// with the step's other spans `max_seqs` to a pass and in order, so a verify step of many
    /// requests is one pass (a decode graph's replay where one fits), not one per request.
    fn forward_split(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput> {
        let mut out = ForwardOutput::default();
        for pass in batch.row_passes(self.capacity.max_seqs)? {
            let TailOut { rows, tokens } = self.run_in_pool(&pass, Tail::Logits, true)?;
            out.logits.extend(rows);
            out.tokens.extend(tokens);
        }
        for (i, span) in batch.seqs.iter().enumerate() {
            if span.output == SpanOutput::LastHidden {
                let mut one = batch.select(&[i]);
                // The eager forward's sampled rows are its hidden tail's rows.
                one.seqs[0].output = SpanOutput::LastLogits;
                out.hidden
                    .extend(self.run_in_pool(&one, Tail::Hidden, false)?.rows);
            }
        }
        Ok(out)
    }
}

impl CudaExecutor {
    /// [`Executor::enqueue`] for a step of sampled rows only: uploaded through the free slot,
    /// its chained tokens taken from the last pass's draws on the device, run (replayed or
    /// eager) and its tail's copies queued, an event recorded behind them; not waited for.
    fn enqueue_pass(
        &mut self,
        batch: &ForwardBatch,
        chained: &[(usize, usize)],
    ) -> Result<Enqueued> {
        let slot = self.w.slot;
        if self.in_flight[slot].is_some() {
            return Err(ModelError::config(
                "enqueue",
                "both staging slots hold passes in flight: finish one first",
            ));
        }
        let chain = match (chained.is_empty(), &self.last_draws) {
            (true, _) => Vec::new(),
            (false, None) => {
                return Err(ModelError::config(
                    "chained",
                    "no pass enqueued just before this one has draws on the device",
                ))
            }
            (false, Some(rows)) => chained
                .iter()
                .map(|&(flat, k)| {
                    rows.get(k).map(|&row| (flat, row)).ok_or_else(|| {
                        ModelError::config(
                            "chained",
                            format!("the pass before drew {} tokens, none at {k}", rows.len()),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        self.last_draws = None;
        let mut step = PackedStep::pack_chained(batch, &self.capacity, &chain)?;
        let with_lora = !step.adapters.is_empty();
        self.lora.bind(&self.w.gpu, &mut step)?;
        let replay = match with_lora {
            false => self.graph_bucket(batch, &step),
            true => None,
        };
        let reads = match (replay, self.graphs.as_mut()) {
            (Some(bucket), Some(graphs)) => {
                let mut runner = Runner {
                    step: self.w.step(&mut self.meta, &mut self.kv),
                    graphs,
                    wait: false,
                };
                match replay_step(&mut runner, &step, bucket)? {
                    TailPassed::Reads(reads) => reads,
                    TailPassed::Done(_) => {
                        return Err(ModelError::Cuda(
                            "a replay waited for by a runner told not to: this is a bug".into(),
                        ))
                    }
                }
            }
            _ => {
                let mut forward = self.w.step(&mut self.meta, &mut self.kv);
                if with_lora {
                    forward.lora = self.lora.step();
                }
                forward.enqueue(&step)?
            }
        };
        let device = self.w.device;
        let done = self
            .w
            .gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| ModelError::Cuda(format!("cuEventRecord failed on {device}: {e:?}")))?;
        self.last_draws = Some(step.drawn_rows());
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.in_flight[slot] = Some(InFlight {
            ticket,
            step,
            reads,
            done,
        });
        self.w.slot = 1 - slot;
        Ok(Enqueued::InFlight(PassTicket(ticket)))
    }
}

impl Executor for CudaExecutor {
    fn device(&self) -> Device {
        self.w.device
    }

    fn capabilities(&self) -> Capabilities {
        capabilities::CUDA
    }

    fn weight_bytes_per_token(&self) -> Option<usize> {
        Some(self.w.model.weight_bytes_per_token())
    }
    fn weight_bytes(&self) -> Option<usize> {
        Some(self.w.model.weight_bytes())
    }

    fn config(&self) -> &Qwen2Config {
        &self.w.cfg
    }

    fn block_size(&self) -> usize {
        self.kv.block_size
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    fn kv_bytes_per_block(&self) -> usize {
        KvPool::bytes_per_block(&self.w.cfg, self.kv.block_size)
    }

    fn copy_block(&mut self, src: usize, dst: usize, num_tokens: usize) -> Result<()> {
        let (num_blocks, block_size) = (self.kv.num_blocks, self.kv.block_size);
        if src.max(dst) >= num_blocks || num_tokens > block_size {
            return Err(ModelError::config(
                "block_copies",
                format!(
                    "copy of {num_tokens} slots from block {src} to {dst} outside a pool of \
                     {num_blocks} blocks of {block_size}"
                ),
            ));
        }
        let geometry = KvGeometry {
            block_size,
            kv_row: self.kv.kv_row,
        };
        let copy = BlockCopy {
            src,
            dst,
            num_tokens,
        };
        for layer in &mut self.kv.layers {
            let cache = KvCacheMut {
                k: layer.k.as_view_mut(),
                v: layer.v.as_view_mut(),
            };
            copy_block(&self.w.gpu, cache, geometry, copy)
                .map_err(|e| cuda_error(self.w.device, e))?;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput> {
        self.slot_is_free("forward")?;
        // Whatever this draws lands over the last enqueued pass's draws.
        self.last_draws = None;
        if batch.only_samples() {
            let TailOut { rows, tokens } = self.run_in_pool(batch, Tail::Logits, true)?;
            return Ok(ForwardOutput {
                logits: rows,
                tokens,
                hidden: Vec::new(),
            });
        }
        self.forward_split(batch)
    }

    fn chains_on_device(&self, batch: &ForwardBatch) -> bool {
        // Only while the last pass's draws are still in `act.drawn_ids`: a step run at once in
        // between (an embedding's or a scored prompt's) may have drawn over them, and the
        // caller then fills the tokens in from that pass's read-back draws.
        batch.only_samples() && self.last_draws.is_some()
    }

    fn enqueue(&mut self, batch: &ForwardBatch, chained: &[(usize, usize)]) -> Result<Enqueued> {
        if !batch.only_samples() || batch.seqs.is_empty() {
            if !chained.is_empty() {
                return Err(ModelError::config(
                    "chained",
                    "inputs chained on the device need a step of sampled rows only",
                ));
            }
            return Ok(Enqueued::Done(self.forward(batch)?));
        }
        self.enqueue_pass(batch, chained)
    }

    fn is_done(&mut self, pass: &PassTicket) -> Result<bool> {
        let device = self.w.device;
        match self.in_flight.iter().flatten().find(|f| f.ticket == pass.0) {
            Some(f) => f
                .done
                .try_is_complete()
                .map_err(|e| ModelError::Cuda(format!("cuEventQuery failed on {device}: {e:?}"))),
            None => Ok(true),
        }
    }

    fn finish(&mut self, pass: PassTicket) -> Result<ForwardOutput> {
        let Some(slot) = (0..2).find(|&s| {
            self.in_flight[s]
                .as_ref()
                .is_some_and(|f| f.ticket == pass.0)
        }) else {
            return Err(ModelError::config(
                "finish",
                format!("{pass:?} is not in flight"),
            ));
        };
        let Some(f) = self.in_flight[slot].take() else {
            return Err(ModelError::config(
                "finish",
                format!("{pass:?} is not in flight"),
            ));
        };
        let device = self.w.device;
        // Waits for the pass's copies back; the kernels' own errors surface here.
        f.done
            .synchronize()
            .map_err(|e| ModelError::Cuda(format!("a pass on {device} failed: {e:?}")))?;
        let TailOut { rows, tokens } =
            read_tail(&self.w.cfg, &self.w.readback[slot], &f.step, f.reads)
                .map_err(|e| e.into_model(device))?;
        Ok(ForwardOutput {
            logits: rows,
            tokens,
            hidden: Vec::new(),
        })
    }

    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let chunk = self.capacity.max_tokens;
        let mut v = self.apart(tokens, chunk, false, Tail::Hidden)?;
        // Unit length in f64, as the CPU's `Qwen2Model::embed`.
        normalize_l2(&mut v);
        Ok(v)
    }

    fn prompt_logits(&mut self, tokens: &[u32], step_by_step: bool) -> Result<Vec<f32>> {
        // Every token's row is sampled, and a step returns at most max_num_seqs rows.
        let chunk = if step_by_step {
            1
        } else {
            self.capacity.max_tokens.min(self.capacity.max_seqs)
        };
        self.apart(tokens, chunk, true, Tail::Logits)
    }
}
