//! One eager step over the launchers, in the CPU forward's order (`qwen2.rs`):
//!
//! ```text
//! embed → per layer: [add_]rms_norm → QKV GEMM → bias+RoPE+KV write → paged attention
//!         → o_proj GEMM → add_rms_norm → gate|up GEMM → silu·mul → down GEMM
//!       → the sampled rows gathered → add_rms_norm (final) → lm_head GEMM (f32)
//!       → draw (tokens of the rows drawn on the device) → pinned host memory: the drawn
//!         ids and logprobs, and only the logits rows the engine samples itself
//! ```
//! The residual add of each sublayer is fused into the next norm (`add_rms_norm`: residual
//! += x, then norm), which is the CPU's `hidden += …; rms_norm(hidden)`; the last layer's
//! down_proj is added only to the rows that are sampled, as the CPU norms only those.

use half::bf16;
use novainfer_cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use novainfer_cuda::ops::dequant::dequantize;
use novainfer_cuda::ops::embedding::{embedding, embedding_quant, EmbeddingShape};
use novainfer_cuda::ops::flash_prefill::{prefill_attention, PrefillKernel};
use novainfer_cuda::ops::gather::{gather_columns, gather_rows};
use novainfer_cuda::ops::gemm::{gemm_bf16, gemm_bf16_f32out, GemmShape};
use novainfer_cuda::ops::gemv_quant::{
    gemm_packed, gemv, gemv_qkv, gemv_silu_mul, OutColumns, QkvHeads, QkvTokens,
    MAX_ROWS as GEMV_MAX_ROWS,
};
use novainfer_cuda::ops::kv::KvCacheMut;
use novainfer_cuda::ops::paged_attention::{
    decode_kernel_for, paged_attention_decode_with, AttentionConfig, DecodeScratch, PagedKv,
};
use novainfer_cuda::ops::qkv::{qkv_bias_rope_cache, QkvInput};
use novainfer_cuda::ops::rms_norm::{add_rms_norm, rms_norm};
use novainfer_cuda::ops::rope::{RopeHeads, RopeTable};
use novainfer_cuda::ops::sampling::{
    adjust_rows, draw, mask_rows, DrawMode, RowEdits, TopLogprobs, MAX_TOP_LOGPROBS,
};
use novainfer_cuda::ops::silu_mul::silu_mul_fused;
use novainfer_cuda::GpuContext;

use super::buffers::{
    head, head_mut, Activations, EditBuffers, KvPool, MaskBuffers, PackedScratch, Readback,
    StepBuffers, StepViews,
};
use super::lora::{LoraStep, Part};
use super::weights::{GpuLayer, GpuMatrix, GpuModel, MatrixData, PackedPart};
use super::{cuda_error, driver_error};
use crate::config::Qwen2Config;
use crate::device::Device;
use crate::error::Result;
use crate::forward_batch::DrawnToken;
use crate::lora::Target;
use crate::prepare::linear::DecodeLinear;
use crate::prepare::{MixedSteps, PackedStep, StepAttention};

/// What a step returns for its sampled rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Per the step's draw modes: drawn tokens for the rows drawn on the device, f32 logits
    /// for the others (the engine's steps and prompt logits).
    Logits,
    /// The final normed hidden state (bf16 widened to f32): embeddings.
    Hidden,
}

/// A step's results on the host.
#[derive(Debug, Default)]
pub(crate) struct TailOut {
    /// `Tail::Logits`: the logits rows not drawn (the step's `host_rows`, in order);
    /// `Tail::Hidden`: the hidden rows.
    pub rows: Vec<f32>,
    /// The drawn tokens, in sampled-row order.
    pub tokens: Vec<DrawnToken>,
}

/// Everything a step borrows.
pub(crate) struct Step<'a> {
    pub gpu: &'a GpuContext,
    pub device: Device,
    pub cfg: &'a Qwen2Config,
    pub model: &'a GpuModel,
    pub rope: &'a RopeTable,
    pub act: &'a mut Activations,
    pub meta: &'a mut StepBuffers,
    pub kv: &'a mut KvPool,
    pub scratch: &'a mut DecodeScratch,
    pub readback: &'a mut Readback,
    pub edits: &'a mut EditBuffers,
    pub masks: &'a mut MaskBuffers,
    /// The adapters' tables, in a step whose rows use adapters.
    pub lora: Option<LoraStep<'a>>,
    /// How steps of a few rows run their linear layers.
    pub linear: DecodeLinear,
    /// Which of the two staging buffers the step's metadata goes through (the readback is
    /// this slot's too): the executor alternates them so a step in flight keeps its own.
    pub slot: usize,
}

impl<'a> Step<'a> {
    /// Runs `step` (already validated against the buffers and the pool) and returns, for
    /// its sampled rows, the f32 logits `[rows, vocab]` or the final normed hidden states
    /// `[rows, hidden]`.
    pub fn run(self, step: &PackedStep, tail: Tail) -> Result<TailOut> {
        let (gpu, device) = (self.gpu, self.device);
        let result = self.run_inner(step, tail);
        // A failed step may leave work queued that reads the staging buffer or the
        // activations; wait for it so the next step starts from an idle stream.
        if result.is_err() {
            let _ = gpu.synchronize();
        }
        result.map_err(|e| e.into_model(device))
    }

    /// Enqueues `step` with a logits tail and returns without waiting: what is left to read
    /// back once the stream has passed its copies ([`read_tail`], into this step's readback).
    pub fn enqueue(self, step: &PackedStep) -> Result<TailReads> {
        let (gpu, device) = (self.gpu, self.device);
        let result = self.launch(step, Tail::Logits);
        if result.is_err() {
            let _ = gpu.synchronize();
        }
        match result.map_err(|e| e.into_model(device))?.0 {
            TailPassed::Reads(reads) => Ok(reads),
            TailPassed::Done(_) => Err(crate::error::ModelError::Cuda(
                "a logits step read back while enqueued: this is a bug".into(),
            )),
        }
    }

    fn run_inner(self, step: &PackedStep, tail: Tail) -> Result<TailOut, Failure> {
        let (gpu, cfg) = (self.gpu, self.cfg);
        match self.launch(step, tail)? {
            (TailPassed::Done(out), _) => Ok(out),
            (TailPassed::Reads(reads), readback) => {
                // Every copy of the tail was recorded on the stream; waiting for the stream
                // covers them and surfaces the kernels' own errors as this step's.
                gpu.synchronize()?;
                read_tail(cfg, readback, step, reads)
            }
        }
    }

    /// Everything of `step` up to its tail's copies, enqueued: a logits tail's reads (none for
    /// an empty step or one that samples nothing), or a hidden tail's finished output; and the
    /// readback the reads are in.
    fn launch(self, step: &PackedStep, tail: Tail) -> Result<(TailPassed, &'a Readback), Failure> {
        let Step {
            gpu,
            cfg,
            model,
            rope,
            act,
            meta,
            kv,
            scratch,
            readback,
            edits,
            masks,
            lora,
            linear,
            slot,
            ..
        } = self;
        let n = step.num_tokens();
        if n == 0 {
            return Ok((TailPassed::Reads(TailReads::default()), readback));
        }
        meta.write_and_copy(gpu, step, slot)?;
        meta.chain(gpu, step, &act.drawn_ids)?;
        let views = meta.views(step)?;
        let attention = match step.attention(MixedSteps::from_env()?) {
            StepAttention::Decode { max_seq_len } => Attention::Decode {
                max_seq_len,
                choose_for: max_seq_len,
            },
            StepAttention::Prefill => Attention::Prefill,
            StepAttention::Mixed {
                prefill_seqs,
                prefill_tokens,
                decode_max_seq_len,
            } => Attention::Mixed {
                prefill_seqs,
                prefill_tokens,
                max_seq_len: decode_max_seq_len,
            },
        };
        let rows = step.sample_rows.len();
        let mut body = Body {
            gpu,
            cfg,
            model,
            rope,
            act,
            kv,
            scratch,
            lora,
            linear,
        };
        body.layers(&views, n, attention)?;
        if rows == 0 {
            // Nothing to sample (prefill chunks only): the step's work is its KV writes.
            return Ok((TailPassed::Reads(TailReads::default()), readback));
        }
        body.final_rows(&views, n, rows)?;
        if tail == Tail::Hidden {
            let staging = TailStaging { edits, masks, slot };
            let out = sample_tail(gpu, cfg, act, readback, staging, &views, step, tail)?;
            return Ok((TailPassed::Done(out), readback));
        }
        body.lm_head(rows)?;
        let staging = TailStaging { edits, masks, slot };
        let reads = enqueue_tail(gpu, cfg, act, readback, staging, &views, step)?;
        Ok((TailPassed::Reads(reads), readback))
    }
}

/// What a step's launch left: its finished output (a hidden tail, an empty step, or a
/// caller that waited), or a logits tail's reads still on their way back.
pub(crate) enum TailPassed {
    Done(TailOut),
    Reads(TailReads),
}

/// How a step's attention runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Attention {
    /// Any number of query tokens per sequence.
    Prefill,
    /// One query token per sequence, histories up to `max_seq_len`, the first phase chosen
    /// for histories of `choose_for` (the step's own when eager; a graph fixes it at capture,
    /// and the choice never changes a bit of the result).
    Decode {
        max_seq_len: usize,
        choose_for: usize,
    },
    /// The first `prefill_seqs` sequences (rows `0..prefill_tokens`) through the prefill
    /// kernel, the rest (one row each, histories up to `max_seq_len`) through the decode
    /// kernel ([`crate::prepare::PackedStep::prefill_seqs`] orders them so).
    Mixed {
        prefill_seqs: usize,
        prefill_tokens: usize,
        max_seq_len: usize,
    },
}

/// What the forward up to the logits borrows: the part of a step a decode graph captures.
pub(crate) struct Body<'b> {
    pub gpu: &'b GpuContext,
    pub cfg: &'b Qwen2Config,
    pub model: &'b GpuModel,
    pub rope: &'b RopeTable,
    pub act: &'b mut Activations,
    pub kv: &'b mut KvPool,
    pub scratch: &'b mut DecodeScratch,
    /// Each row's LoRA update after each projection (`None`: no row has an adapter; a
    /// captured graph never has one).
    pub lora: Option<LoraStep<'b>>,
    pub linear: DecodeLinear,
}

impl Body<'_> {
    /// Embedding and every layer over the step's `n` tokens.
    pub fn layers(
        &mut self,
        views: &StepViews<'_>,
        n: usize,
        attention: Attention,
    ) -> Result<(), Failure> {
        let Body {
            gpu,
            cfg,
            model,
            rope,
            act,
            kv,
            scratch,
            lora,
            linear,
        } = self;
        let gpu: &GpuContext = gpu;
        let (h, f, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (hd, nh, nkv) = (
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let (q_dim, qkv_dim) = (nh * hd, (nh + 2 * nkv) * hd);
        let eps = cfg.rms_norm_eps as f32;
        let heads = RopeHeads {
            num_heads: nh,
            num_kv_heads: nkv,
        };
        let attn_cfg = AttentionConfig {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: kv.block_size,
            max_blocks_per_seq: views.max_blocks_per_seq,
        };
        // The legacy prefill kernel unless NOVAINFER_CUDA_PREFILL=flash: the tensor-core one
        // has not yet run on a GPU (novainfer_cuda::ops::flash_prefill).
        let prefill_kernel = PrefillKernel::from_env()?;
        // Steps of a few rows (decode) may run every linear layer through the GEMV, with the
        // next kernel fused into it (NOVAINFER_CUDA_DECODE_LINEAR=fused).
        let fused = linear.fuses(n, lora.is_some());
        let qkv_heads = QkvHeads {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        };

        let shape = EmbeddingShape {
            vocab_size: vocab,
            hidden: h,
        };
        let mut residual = head_mut(&mut act.residual, n * h, "residual")?;
        match &model.embed_tokens.data {
            MatrixData::Bf16(table) => embedding::<bf16>(
                gpu,
                &views.token_ids,
                &table.as_view(),
                shape,
                &mut residual,
            )?,
            MatrixData::Packed(parts) => {
                // The table is one checkpoint tensor: one part.
                let [p] = parts.as_slice() else {
                    let why = format!("a packed embedding table of {} parts", parts.len());
                    return Err(crate::error::ModelError::Cuda(why).into());
                };
                let (ids, blocks) = (&views.token_ids, p.blocks.as_view());
                embedding_quant::<bf16>(gpu, p.qtype, ids, &blocks, shape, &mut residual)?;
            }
        }
        for (index, layer) in model.layers.iter().enumerate() {
            // Layer 0 norms the embedding; later layers first add the previous down_proj.
            let mut residual = head_mut(&mut act.residual, n * h, "residual")?;
            let mut normed = head_mut(&mut act.normed, n * h, "normed")?;
            let weight = layer.input_layernorm.as_view();
            if index == 0 {
                rms_norm::<bf16>(gpu, &residual.as_view(), &weight, eps, &mut normed)?;
            } else {
                let x = head(&act.proj, n * h, "proj")?;
                add_rms_norm::<bf16>(gpu, &x, &mut residual, &weight, eps, &mut normed)?;
            }
            let pool = &mut kv.layers[index];
            if fused {
                let q = &mut act.q;
                let ordered = &mut act.ordered;
                qkv_fused(
                    gpu,
                    rope,
                    qkv_heads,
                    layer,
                    views,
                    n,
                    &act.normed,
                    ordered,
                    q,
                    pool,
                )?;
            } else {
                let x = &act.normed;
                gemm(
                    gpu,
                    x,
                    &layer.qkv,
                    n,
                    &mut act.qkv,
                    &mut act.packed,
                    &mut act.ordered,
                    "qkv",
                    false,
                )?;
            }
            if let Some(l) = lora.as_mut() {
                let kv_dim = nkv * hd;
                let parts = [
                    Part::new(Target::Q, 0, q_dim),
                    Part::new(Target::K, q_dim, kv_dim),
                    Part::new(Target::V, q_dim + kv_dim, kv_dim),
                ];
                let rows = &views.lora_rows;
                l.apply(
                    gpu,
                    index,
                    rows,
                    &act.normed,
                    h,
                    &mut act.qkv,
                    qkv_dim,
                    &parts,
                )?;
            }
            if !fused {
                qkv_bias_rope_cache::<bf16>(
                    gpu,
                    rope,
                    heads,
                    QkvInput {
                        qkv: head(&act.qkv, n * qkv_dim, "qkv")?,
                        bias: Some(layer.qkv_bias.as_view()),
                        positions: again(&views.positions),
                        slot_mapping: again(&views.slot_mapping),
                    },
                    &mut head_mut(&mut act.q, n * q_dim, "q")?,
                    KvCacheMut {
                        k: pool.k.as_view_mut(),
                        v: pool.v.as_view_mut(),
                    },
                )?;
            }
            let paged = PagedKv {
                k_cache: pool.k.as_view(),
                v_cache: pool.v.as_view(),
                block_tables: again(&views.block_tables),
                seq_lens: again(&views.seq_lens),
            };
            let q = head(&act.q, n * q_dim, "q")?;
            let mut out = head_mut(&mut act.attn, n * q_dim, "attn")?;
            match attention {
                Attention::Decode {
                    max_seq_len,
                    choose_for,
                } => {
                    let kernel = decode_kernel_for(gpu, &attn_cfg, &paged, choose_for);
                    paged_attention_decode_with::<bf16>(
                        gpu,
                        kernel,
                        &attn_cfg,
                        &q,
                        paged,
                        max_seq_len,
                        scratch,
                        &mut out,
                    )?;
                }
                Attention::Prefill => {
                    prefill_attention(
                        gpu,
                        prefill_kernel,
                        &attn_cfg,
                        &q,
                        paged,
                        &views.query_start_loc,
                        &views.positions,
                        &mut out,
                    )?;
                }
                Attention::Mixed {
                    prefill_seqs: sp,
                    prefill_tokens: p,
                    max_seq_len,
                } => {
                    // Contiguous runs of the same arrays: the chunks' sequences and rows
                    // first, the decodes' after (query_start_loc[..=sp] starts at 0).
                    let width = views.max_blocks_per_seq;
                    let part = |seqs: std::ops::Range<usize>| PagedKv {
                        k_cache: paged.k_cache.slice(..),
                        v_cache: paged.v_cache.slice(..),
                        block_tables: paged
                            .block_tables
                            .slice(seqs.start * width..seqs.end * width),
                        seq_lens: paged.seq_lens.slice(seqs),
                    };
                    let s = paged.seq_lens.len();
                    let (chunks, decodes) = (part(0..sp), part(sp..s));
                    prefill_attention(
                        gpu,
                        prefill_kernel,
                        &attn_cfg,
                        &q.slice(..p * q_dim),
                        chunks,
                        &views.query_start_loc.slice(..=sp),
                        &views.positions.slice(..p),
                        &mut out.slice_mut(..p * q_dim),
                    )?;
                    let kernel = decode_kernel_for(gpu, &attn_cfg, &decodes, max_seq_len);
                    paged_attention_decode_with::<bf16>(
                        gpu,
                        kernel,
                        &attn_cfg,
                        &q.slice(p * q_dim..),
                        decodes,
                        max_seq_len,
                        scratch,
                        &mut out.slice_mut(p * q_dim..),
                    )?;
                }
            }
            let x = &act.attn;
            gemm(
                gpu,
                x,
                &layer.o_proj,
                n,
                &mut act.proj,
                &mut act.packed,
                &mut act.ordered,
                "proj",
                fused,
            )?;
            if let Some(l) = lora.as_mut() {
                let parts = [Part::new(Target::O, 0, h)];
                let rows = &views.lora_rows;
                l.apply(gpu, index, rows, &act.attn, q_dim, &mut act.proj, h, &parts)?;
            }
            add_rms_norm::<bf16>(
                gpu,
                &head(&act.proj, n * h, "proj")?,
                &mut head_mut(&mut act.residual, n * h, "residual")?,
                &layer.post_attention_layernorm.as_view(),
                eps,
                &mut head_mut(&mut act.normed, n * h, "normed")?,
            )?;
            if fused {
                gate_up_fused(gpu, layer, n, &act.normed, &mut act.ordered, &mut act.mlp)?;
            } else {
                gemm(
                    gpu,
                    &act.normed,
                    &layer.gate_up,
                    n,
                    &mut act.gate_up,
                    &mut act.packed,
                    &mut act.ordered,
                    "gate_up",
                    false,
                )?;
                if let Some(l) = lora.as_mut() {
                    let parts = [Part::new(Target::Gate, 0, f), Part::new(Target::Up, f, f)];
                    let rows = &views.lora_rows;
                    l.apply(
                        gpu,
                        index,
                        rows,
                        &act.normed,
                        h,
                        &mut act.gate_up,
                        2 * f,
                        &parts,
                    )?;
                }
                silu_mul_fused::<bf16>(
                    gpu,
                    &head(&act.gate_up, n * 2 * f, "gate_up")?,
                    f,
                    &mut head_mut(&mut act.mlp, n * f, "mlp")?,
                )?;
            }
            let x = &act.mlp;
            gemm(
                gpu,
                x,
                &layer.down_proj,
                n,
                &mut act.proj,
                &mut act.packed,
                &mut act.ordered,
                "proj",
                fused,
            )?;
            if let Some(l) = lora.as_mut() {
                let parts = [Part::new(Target::Down, 0, h)];
                let rows = &views.lora_rows;
                l.apply(gpu, index, rows, &act.mlp, f, &mut act.proj, h, &parts)?;
            }
        }
        Ok(())
    }

    /// The sampled `rows` gathered from the `n` token rows, the last down_proj added and the
    /// final norm applied: `last_normed`.
    pub fn final_rows(
        &mut self,
        views: &StepViews<'_>,
        n: usize,
        rows: usize,
    ) -> Result<(), Failure> {
        let (gpu, act, h) = (self.gpu, &mut *self.act, self.cfg.hidden_size);
        let eps = self.cfg.rms_norm_eps as f32;
        let mut last_residual = head_mut(&mut act.last_residual, rows * h, "last_residual")?;
        gather_rows::<bf16>(
            gpu,
            &head(&act.residual, n * h, "residual")?,
            &views.sample_rows,
            h,
            &mut last_residual,
        )?;
        gather_rows::<bf16>(
            gpu,
            &head(&act.proj, n * h, "proj")?,
            &views.sample_rows,
            h,
            &mut head_mut(&mut act.last_proj, rows * h, "last_proj")?,
        )?;
        add_rms_norm::<bf16>(
            gpu,
            &head(&act.last_proj, rows * h, "last_proj")?,
            &mut last_residual,
            &self.model.norm.as_view(),
            eps,
            &mut head_mut(&mut act.last_normed, rows * h, "last_normed")?,
        )?;
        Ok(())
    }

    /// f32 logits of the first `rows` normed rows.
    pub fn lm_head(&mut self, rows: usize) -> Result<(), Failure> {
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let act = &mut *self.act;
        let lm_head = self.model.lm_head();
        let x = head(&act.last_normed, rows * h, "last_normed")?;
        let x = ordered_input(self.gpu, lm_head, x, &mut act.ordered)?;
        let mut y = head_mut(&mut act.logits, rows * vocab, "logits")?;
        let shape = GemmShape {
            m: rows,
            n: lm_head.rows,
            k: lm_head.cols,
        };
        // The fused decode path takes a bf16 head through the GEMV too (no adapter targets it).
        let gemv_bf16 = self.linear.fuses(rows, false);
        match &lm_head.data {
            MatrixData::Bf16(w) if !gemv_bf16 => {
                gemm_bf16_f32out(self.gpu, &x, &w.as_view(), shape, &mut y)?
            }
            _ if rows <= GEMV_MAX_ROWS => gemv_runs(self.gpu, lm_head, &x, rows, &mut y)?,
            MatrixData::Bf16(w) => gemm_bf16_f32out(self.gpu, &x, &w.as_view(), shape, &mut y)?,
            MatrixData::Packed(parts) => match &mut act.packed {
                PackedScratch::Tile(partials) => {
                    gemm_packed_runs(self.gpu, lm_head, &x, rows, &mut y, partials)?
                }
                PackedScratch::Expand(expanded) => {
                    let w = expand(self.gpu, parts, lm_head, expanded)?;
                    gemm_bf16_f32out(self.gpu, &x, &w, shape, &mut y)?
                }
            },
        }
        Ok(())
    }
}

/// After the forward: the step's own sampled rows (`step.sample_rows.len()`, the first rows
/// of `last_normed` and `logits`) masked, adjusted and drawn, and what goes back to the host
/// copied to pinned memory; waits for the stream and reads it. Runs eagerly after a replay
/// as after an eager forward: its launches depend on the step's sampling parameters.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sample_tail(
    gpu: &GpuContext,
    cfg: &Qwen2Config,
    act: &mut Activations,
    readback: &mut Readback,
    staging: TailStaging<'_>,
    views: &StepViews<'_>,
    step: &PackedStep,
    tail: Tail,
) -> Result<TailOut, Failure> {
    let h = cfg.hidden_size;
    let rows = step.sample_rows.len();
    if rows == 0 {
        gpu.synchronize()?;
        return Ok(TailOut::default());
    }
    if tail == Tail::Hidden {
        let hidden = &mut readback.hidden;
        gpu.stream()
            .memcpy_dtoh(&head(&act.last_normed, rows * h, "last_normed")?, hidden)
            .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        // The stream's end is the copy's and the step's (pinned reads do not wait by
        // themselves: cudarc's event tracking is off); kernels' own errors surface here.
        gpu.synchronize()?;
        let values = hidden
            .as_slice()
            .map_err(driver_error("cuEventSynchronize"))?;
        return Ok(TailOut {
            rows: values[..rows * h].iter().map(|&x| f32::from(x)).collect(),
            tokens: Vec::new(),
        });
    }
    let reads = enqueue_tail(gpu, cfg, act, readback, staging, views, step)?;
    // Every copy of the tail was recorded on the stream; waiting for the stream covers them
    // and surfaces the kernels' own errors as this step's.
    gpu.synchronize()?;
    read_tail(cfg, readback, step, reads)
}

/// What a logits tail left for the host to read once the stream has passed its copies.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TailReads {
    /// Logits rows copied back (the engine samples them).
    host: usize,
    /// Tokens drawn on the device.
    draws: usize,
}

/// Where a logits tail's edits and grammar masks go up: the step's staging slot of each.
pub(crate) struct TailStaging<'a> {
    pub edits: &'a mut EditBuffers,
    pub masks: &'a mut MaskBuffers,
    pub slot: usize,
}

/// [`sample_tail`]'s launches and copies for a logits tail, without waiting for them.
pub(crate) fn enqueue_tail(
    gpu: &GpuContext,
    cfg: &Qwen2Config,
    act: &mut Activations,
    readback: &mut Readback,
    staging: TailStaging<'_>,
    views: &StepViews<'_>,
    step: &PackedStep,
) -> Result<TailReads, Failure> {
    let TailStaging { edits, masks, slot } = staging;
    let vocab = cfg.vocab_size;
    let rows = step.sample_rows.len();
    if step.masks_at.iter().any(|&m| m >= 0) {
        // A grammar's rows are masked in place first: everything after (logprobs, edits,
        // the draw) reads the masked row, as the host sampler does.
        let words = masks.upload(gpu, step, slot)?;
        mask_rows::<f32>(
            gpu,
            &mut head_mut(&mut act.logits, rows * vocab, "logits")?,
            &views.masks_at,
            &words,
            step.mask_words,
            vocab,
        )?;
    }
    let draws = step.num_draws();
    if draws > 0 {
        if !step.edits.is_empty() {
            let edits = edits.upload(gpu, step, slot)?;
            adjust_rows::<f32>(
                gpu,
                &head(&act.logits, rows * vocab, "logits")?,
                &RowEdits {
                    offsets: again(&views.edit_offsets),
                    edits,
                    penalties: again(&views.row_penalties),
                },
                vocab,
                &mut head_mut(&mut act.adjusted, rows * vocab, "adjusted")?,
            )?;
        }
        draw::<f32>(
            gpu,
            &head(&act.logits, rows * vocab, "logits")?,
            &head(&act.adjusted, rows * vocab, "adjusted")?,
            &views.edit_offsets,
            &views.draw_params,
            &views.draw_modes,
            vocab,
            &mut head_mut(&mut act.row_scratch, rows * vocab, "row_scratch")?,
            &mut head_mut(&mut act.drawn_ids, rows, "drawn_ids")?,
            &mut head_mut(&mut act.drawn_logprobs, rows, "drawn_logprobs")?,
            TopLogprobs {
                tops: &views.tops,
                ids: &mut head_mut(&mut act.top_ids, rows * MAX_TOP_LOGPROBS, "top_ids")?,
                logprobs: &mut head_mut(
                    &mut act.top_logprobs,
                    rows * MAX_TOP_LOGPROBS,
                    "top_logprobs",
                )?,
                ranks: &mut head_mut(&mut act.ranks, rows, "ranks")?,
            },
        )?;
        gpu.stream()
            .memcpy_dtoh(&head(&act.drawn_ids, rows, "drawn_ids")?, &mut readback.ids)
            .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        gpu.stream()
            .memcpy_dtoh(
                &head(&act.drawn_logprobs, rows, "drawn_logprobs")?,
                &mut readback.logprobs,
            )
            .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        if step.tops.iter().any(|&t| t >= 0) {
            let slots = rows * MAX_TOP_LOGPROBS;
            gpu.stream()
                .memcpy_dtoh(
                    &head(&act.top_ids, slots, "top_ids")?,
                    &mut readback.top_ids,
                )
                .map_err(driver_error("cuMemcpyDtoHAsync"))?;
            gpu.stream()
                .memcpy_dtoh(
                    &head(&act.top_logprobs, slots, "top_logprobs")?,
                    &mut readback.top_logprobs,
                )
                .map_err(driver_error("cuMemcpyDtoHAsync"))?;
            gpu.stream()
                .memcpy_dtoh(&head(&act.ranks, rows, "ranks")?, &mut readback.ranks)
                .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        }
    }
    let host = step.host_rows.len();
    if host > 0 {
        // Only the rows the engine samples itself cross the bus: all of them as they are,
        // or gathered to the front of the scratch (the draw is done with it: same stream).
        let source = if host == rows {
            head(&act.logits, rows * vocab, "logits")?
        } else {
            gather_rows::<f32>(
                gpu,
                &head(&act.logits, rows * vocab, "logits")?,
                &views.host_rows,
                vocab,
                &mut head_mut(&mut act.row_scratch, host * vocab, "row_scratch")?,
            )?;
            head(&act.row_scratch, host * vocab, "row_scratch")?
        };
        gpu.stream()
            .memcpy_dtoh(&source, &mut readback.logits)
            .map_err(driver_error("cuMemcpyDtoHAsync"))?;
    }
    Ok(TailReads { host, draws })
}

/// The host rows and drawn tokens a logits tail copied into `readback` (its copies complete).
pub(crate) fn read_tail(
    cfg: &Qwen2Config,
    readback: &Readback,
    step: &PackedStep,
    reads: TailReads,
) -> Result<TailOut, Failure> {
    let TailReads { host, draws } = reads;
    let vocab = cfg.vocab_size;
    let mut out = TailOut::default();
    if host > 0 {
        let values = readback
            .logits
            .as_slice()
            .map_err(driver_error("cuEventSynchronize"))?;
        out.rows = values[..host * vocab].to_vec();
    }
    if draws > 0 {
        out.tokens = drawn_tokens(step, readback, vocab)?;
    }
    Ok(out)
}

/// The drawn rows' tokens from the pinned readback (the step's copies are complete), with
/// the logprobs each asked for, in sampled-row order.
fn drawn_tokens(step: &PackedStep, readback: &Readback, vocab: usize) -> Result<Vec<DrawnToken>> {
    let sync = driver_error("cuEventSynchronize");
    let ids = readback.ids.as_slice().map_err(&sync)?;
    let logprobs = readback.logprobs.as_slice().map_err(&sync)?;
    let asked = step.tops.iter().any(|&t| t >= 0);
    let (top_ids, top_lps, ranks): (&[u32], &[f32], &[u32]) = if asked {
        (
            readback.top_ids.as_slice().map_err(&sync)?,
            readback.top_logprobs.as_slice().map_err(&sync)?,
            readback.ranks.as_slice().map_err(&sync)?,
        )
    } else {
        (&[], &[], &[])
    };
    let mut tokens = Vec::with_capacity(step.num_draws());
    for (r, &mode) in step.draw_modes.iter().enumerate() {
        if mode == DrawMode::Skip {
            continue;
        }
        let mut token = DrawnToken {
            token_id: ids[r],
            logprob: logprobs[r],
            ..DrawnToken::default()
        };
        if let Ok(n) = usize::try_from(step.tops[r]) {
            // The kernel writes min(n, MAX_TOP_LOGPROBS, vocab) entries; the rest of the slot is stale.
            let n = n.min(MAX_TOP_LOGPROBS).min(vocab);
            let at = r * MAX_TOP_LOGPROBS;
            token.rank = ranks[r];
            token.top_logprobs = (0..n).map(|k| (top_ids[at + k], top_lps[at + k])).collect();
        }
        tokens.push(token);
    }
    Ok(tokens)
}

/// `y[..n] = x[..n] · Wᵀ` over the first `n` rows of the activation buffers. A packed matrix
/// is multiplied in place by steps of up to [`GEMV_MAX_ROWS`] rows, and by larger ones with
/// the tiled GEMM or expanded for cuBLAS, whichever `scratch` is for; a bf16 one goes to
/// cuBLAS, or with `gemv_bf16` (the fused decode path) to the GEMV too for steps it takes.
/// An act-order matrix takes its input permuted into `ordered` first.
#[allow(clippy::too_many_arguments)]
fn gemm(
    gpu: &GpuContext,
    x: &CudaSlice<bf16>,
    w: &GpuMatrix,
    n: usize,
    y: &mut CudaSlice<bf16>,
    scratch: &mut PackedScratch,
    ordered: &mut CudaSlice<bf16>,
    what: &str,
    gemv_bf16: bool,
) -> Result<(), Failure> {
    let x = head(x, n * w.cols, "gemm input")?;
    let x = ordered_input(gpu, w, x, ordered)?;
    let mut y = head_mut(y, n * w.rows, what)?;
    let shape = GemmShape {
        m: n,
        n: w.rows,
        k: w.cols,
    };
    match &w.data {
        MatrixData::Bf16(data) if !gemv_bf16 || n > GEMV_MAX_ROWS => {
            gemm_bf16(gpu, &x, &data.as_view(), shape, &mut y)?
        }
        _ if n <= GEMV_MAX_ROWS => gemv_runs(gpu, w, &x, n, &mut y)?,
        MatrixData::Bf16(data) => gemm_bf16(gpu, &x, &data.as_view(), shape, &mut y)?,
        MatrixData::Packed(parts) => match scratch {
            PackedScratch::Tile(partials) => gemm_packed_runs(gpu, w, &x, n, &mut y, partials)?,
            PackedScratch::Expand(expanded) => {
                let data = expand(gpu, parts, w, expanded)?;
                gemm_bf16(gpu, &x, &data, shape, &mut y)?
            }
        },
    }
    Ok(())
}

/// `x` (`[n, w.cols]`) as `w`'s products take it: itself, or for a matrix with an input order
/// (GPTQ act-order) its columns in that order, gathered into the first `n · w.cols` values of
/// `scratch`.
fn ordered_input<'a>(
    gpu: &GpuContext,
    w: &GpuMatrix,
    x: CudaView<'a, bf16>,
    scratch: &'a mut CudaSlice<bf16>,
) -> Result<CudaView<'a, bf16>, Failure> {
    let Some(order) = &w.input_order else {
        return Ok(x);
    };
    let len = x.len();
    let mut permuted = head_mut(scratch, len, "ordered input")?;
    gather_columns::<bf16>(gpu, &x, &order.as_view(), &mut permuted)?;
    Ok(head(scratch, len, "ordered input")?)
}

/// `x · Wᵀ` by the tiled GEMM over the packed matrix's runs into `y` (`[n, w.rows]`), k split
/// into as many ranges as fill the device and fit `partials`.
fn gemm_packed_runs<T: novainfer_cuda::ops::Dtype>(
    gpu: &GpuContext,
    w: &GpuMatrix,
    x: &CudaView<'_, bf16>,
    n: usize,
    y: &mut CudaViewMut<'_, T>,
    partials: &mut CudaSlice<f32>,
) -> Result<(), Failure> {
    let out = OutColumns {
        ld: w.rows,
        col0: 0,
    };
    let splits = novainfer_cuda::gemm_tile::splits(
        w.rows,
        n,
        w.cols,
        gpu.multiprocessor_count(),
        partials.len(),
    );
    let mut partial = partials.as_view_mut();
    gemm_packed(gpu, &w.runs()?, w.cols, x, n, y, out, splits, &mut partial)?;
    Ok(())
}

/// `x · Wᵀ` by the GEMV (one launch over the matrix's runs) into `y` (`[n, w.rows]`).
fn gemv_runs<T: novainfer_cuda::ops::Dtype>(
    gpu: &GpuContext,
    w: &GpuMatrix,
    x: &CudaView<'_, bf16>,
    n: usize,
    y: &mut CudaViewMut<'_, T>,
) -> Result<(), Failure> {
    let out = OutColumns {
        ld: w.rows,
        col0: 0,
    };
    gemv(gpu, &w.runs()?, w.cols, x, n, y, out)?;
    Ok(())
}

/// The layer's QKV projection with bias, RoPE and the cache write in the GEMV's epilogue: one
/// launch whatever the q, k and v tensors' formats.
#[allow(clippy::too_many_arguments)]
fn qkv_fused(
    gpu: &GpuContext,
    rope: &RopeTable,
    heads: QkvHeads,
    layer: &GpuLayer,
    views: &StepViews<'_>,
    n: usize,
    x: &CudaSlice<bf16>,
    ordered: &mut CudaSlice<bf16>,
    q: &mut CudaSlice<bf16>,
    pool: &mut super::buffers::LayerKv,
) -> Result<(), Failure> {
    let w = &layer.qkv;
    let x = head(x, n * w.cols, "qkv input")?;
    let x = ordered_input(gpu, w, x, ordered)?;
    let tokens = QkvTokens {
        bias: Some(layer.qkv_bias.as_view()),
        positions: again(&views.positions),
        slot_mapping: again(&views.slot_mapping),
    };
    let mut q = head_mut(q, n * heads.num_heads * heads.head_dim, "q")?;
    let cache = KvCacheMut {
        k: pool.k.as_view_mut(),
        v: pool.v.as_view_mut(),
    };
    gemv_qkv::<bf16>(
        gpu,
        rope,
        heads,
        &w.runs()?,
        w.cols,
        &x,
        &tokens,
        &mut q,
        cache,
    )?;
    Ok(())
}

/// `mlp = silu(x · W_gateᵀ) · (x · W_upᵀ)` in one launch.
fn gate_up_fused(
    gpu: &GpuContext,
    layer: &GpuLayer,
    n: usize,
    x: &CudaSlice<bf16>,
    ordered: &mut CudaSlice<bf16>,
    mlp: &mut CudaSlice<bf16>,
) -> Result<(), Failure> {
    let w = &layer.gate_up;
    let x = head(x, n * w.cols, "gate_up input")?;
    let x = ordered_input(gpu, w, x, ordered)?;
    let mut out = head_mut(mlp, n * (w.rows / 2), "mlp")?;
    gemv_silu_mul::<bf16>(gpu, &w.runs()?, w.cols, &x, n, &mut out)?;
    Ok(())
}

/// `w` expanded to bf16 in the first `rows · cols` values of `scratch` (each part by the load
/// time dequantizer, so the values are the bf16 path's).
fn expand<'a>(
    gpu: &GpuContext,
    parts: &[PackedPart],
    w: &GpuMatrix,
    scratch: &'a mut CudaSlice<bf16>,
) -> Result<CudaView<'a, bf16>, Failure> {
    for p in parts {
        let (at, len) = (p.row0 * w.cols, p.rows * w.cols);
        let cap = scratch.len();
        let mut rows = scratch.try_slice_mut(at..at + len).ok_or_else(|| {
            crate::error::ModelError::Cuda(format!(
                "expanded: {cap} values cannot hold rows {}..{} of {} values",
                p.row0,
                p.row0 + p.rows,
                w.cols
            ))
        })?;
        dequantize::<bf16>(gpu, p.qtype, &p.blocks.as_view(), &mut rows)?;
    }
    Ok(head(scratch, w.rows * w.cols, "expanded")?)
}

/// Another handle on the same device memory (launch structs take views by value).
fn again<'a, T>(v: &CudaView<'a, T>) -> CudaView<'a, T> {
    v.slice(..)
}

/// Launcher errors keep their type until the step maps them with its device.
pub(crate) enum Failure {
    Cuda(novainfer_cuda::CudaError),
    Model(crate::error::ModelError),
}

impl Failure {
    pub fn into_model(self, device: Device) -> crate::error::ModelError {
        match self {
            Failure::Cuda(e) => cuda_error(device, e),
            Failure::Model(e) => e,
        }
    }
}

impl From<novainfer_cuda::CudaError> for Failure {
    fn from(e: novainfer_cuda::CudaError) -> Self {
        Failure::Cuda(e)
    }
}

impl From<crate::error::ModelError> for Failure {
    fn from(e: crate::error::ModelError) -> Self {
        Failure::Model(e)
    }
}
