//! Device memory a step works in, allocated once: activations for the step limits, the
//! step's metadata (one device buffer and one pinned host staging buffer, one copy per
//! step), and the paged KV pool. Nothing is allocated per step, so a later CUDA graph can
//! capture these addresses.

use half::bf16;
use novainfer_cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PinnedHostSlice};
use novainfer_cuda::ops::gather::chain_tokens;
use novainfer_cuda::sample_params::{DrawMode, RowEdit, RowPenalties, SampleParams};
use novainfer_cuda::GpuContext;

use super::driver_error;
use crate::config::Qwen2Config;
use crate::draw::{MAX_DEVICE_EDITS, MAX_TOP_LOGPROBS};
use crate::error::{ModelError, Result};
use crate::prepare::linear::PackedGemm;
use crate::prepare::{write_edits, PackedStep, StepLayout};

/// Per-token activations for `max_num_batched_tokens` tokens and the sampling tail for
/// `max_num_seqs` rows; bf16 except the logits.
pub(crate) struct Activations {
    /// `[T, hidden]`: the residual stream.
    pub residual: CudaSlice<bf16>,
    /// `[T, hidden]`: the normed input of the next projection.
    pub normed: CudaSlice<bf16>,
    /// `[T, (H + 2·KVH)·D]`.
    pub qkv: CudaSlice<bf16>,
    /// `[T, H·D]`: rotated queries.
    pub q: CudaSlice<bf16>,
    /// `[T, H·D]`: attention output.
    pub attn: CudaSlice<bf16>,
    /// `[T, hidden]`: o_proj's output, then down_proj's (each consumed by the next add).
    pub proj: CudaSlice<bf16>,
    /// `[T, 2·F]`.
    pub gate_up: CudaSlice<bf16>,
    /// `[T, F]`.
    pub mlp: CudaSlice<bf16>,
    /// `[R, hidden]` ×3: the sampled rows' residual, last down_proj output, final norm.
    pub last_residual: CudaSlice<bf16>,
    pub last_proj: CudaSlice<bf16>,
    pub last_normed: CudaSlice<bf16>,
    /// `[R, vocab]`.
    pub logits: CudaSlice<f32>,
    /// `[R, vocab]`: the `draw` kernel's scaled logits of random rows, then (the draw done)
    /// the rows going back as logits, gathered to the front for one copy.
    pub row_scratch: CudaSlice<f32>,
    /// `[R, vocab]`: drawn rows with edits, after them (`adjust_rows`).
    pub adjusted: CudaSlice<f32>,
    /// `[R]` each: the drawn tokens and their raw logprobs.
    pub drawn_ids: CudaSlice<u32>,
    pub drawn_logprobs: CudaSlice<f32>,
    /// `[R · MAX_TOP_LOGPROBS]` each, and `[R]`: the logprobs drawn rows asked for.
    pub top_ids: CudaSlice<u32>,
    pub top_logprobs: CudaSlice<f32>,
    pub ranks: CudaSlice<u32>,
    /// What a step too large for the packed GEMV needs to multiply by a packed matrix.
    pub packed: PackedScratch,
    /// `[T, ordered_cols]`: a product's input permuted for a GPTQ act-order matrix (one value
    /// when no matrix has an order).
    pub ordered: CudaSlice<bf16>,
}

/// The scratch of steps of more rows than the GEMV takes over packed matrices, as
/// [`PackedGemm`] runs them: one or the other, never both.
pub enum PackedScratch {
    /// The matrix expanded to bf16 here for cuBLAS (as large as the largest packed matrix; one
    /// value when every matrix is bf16).
    Expand(CudaSlice<bf16>),
    /// The tiled GEMM's partial sums of a product split along k (`gemm_tile::PARTIALS` values).
    Tile(CudaSlice<f32>),
}

impl Activations {
    /// `packed` with `expanded_len` (the largest packed matrix's values,
    /// [`super::weights::GpuModel::expanded_len`]) sizes [`Self::packed`]; `ordered_cols` (the
    /// widest act-order matrix's input, [`super::weights::GpuModel::ordered_cols`]) a row of
    /// [`Self::ordered`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &GpuContext,
        cfg: &Qwen2Config,
        max_tokens: usize,
        max_rows: usize,
        packed: PackedGemm,
        expanded_len: usize,
        ordered_cols: usize,
    ) -> Result<Self> {
        let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let q = cfg.num_attention_heads * cfg.head_dim();
        let qkv = q + 2 * cfg.num_key_value_heads * cfg.head_dim();
        let bf = |n: usize| -> Result<CudaSlice<bf16>> {
            gpu.stream()
                .alloc_zeros::<bf16>(n.max(1))
                .map_err(driver_error("cuMemAlloc"))
        };
        let f32s = |n: usize| -> Result<CudaSlice<f32>> {
            gpu.stream()
                .alloc_zeros::<f32>(n.max(1))
                .map_err(driver_error("cuMemAlloc"))
        };
        let u32s = |n: usize| -> Result<CudaSlice<u32>> {
            gpu.stream()
                .alloc_zeros::<u32>(n.max(1))
                .map_err(driver_error("cuMemAlloc"))
        };
        let t = max_tokens;
        Ok(Self {
            residual: bf(t * h)?,
            normed: bf(t * h)?,
            qkv: bf(t * qkv)?,
            q: bf(t * q)?,
            attn: bf(t * q)?,
            proj: bf(t * h)?,
            gate_up: bf(t * 2 * f)?,
            mlp: bf(t * f)?,
            last_residual: bf(max_rows * h)?,
            last_proj: bf(max_rows * h)?,
            last_normed: bf(max_rows * h)?,
            logits: f32s(max_rows * v)?,
            row_scratch: f32s(max_rows * v)?,
            adjusted: f32s(max_rows * v)?,
            drawn_ids: u32s(max_rows)?,
            drawn_logprobs: f32s(max_rows)?,
            top_ids: u32s(max_rows * MAX_TOP_LOGPROBS)?,
            top_logprobs: f32s(max_rows * MAX_TOP_LOGPROBS)?,
            ranks: u32s(max_rows)?,
            packed: match packed {
                PackedGemm::Expand => PackedScratch::Expand(bf(expanded_len)?),
                PackedGemm::Tile => PackedScratch::Tile(f32s(novainfer_cuda::gemm_tile::PARTIALS)?),
            },
            // The head's rows (max_rows) are among the tokens' (max_tokens) count too.
            ordered: bf(t.max(max_rows) * ordered_cols)?,
        })
    }
}

/// Pinned host memory every device-to-host copy of a step lands in: a copy from device to
/// pageable memory goes through a driver bounce buffer at a fraction of the bus's speed
/// (31 ms of a 56 ms step at batch 64 on the first GPU run). Allocated without
/// write-combining (cudarc's `alloc_pinned` default), which would make the host's reads of
/// it uncached.
pub(crate) struct Readback {
    /// `[R, vocab]`: logits rows the engine samples itself.
    pub logits: PinnedHostSlice<f32>,
    /// `[R, hidden]`: embeddings' final hidden rows.
    pub hidden: PinnedHostSlice<bf16>,
    /// `[R]` each: drawn tokens and their logprobs.
    pub ids: PinnedHostSlice<u32>,
    pub logprobs: PinnedHostSlice<f32>,
    /// `[R · MAX_TOP_LOGPROBS]` each, and `[R]`: the logprobs drawn rows asked for.
    pub top_ids: PinnedHostSlice<u32>,
    pub top_logprobs: PinnedHostSlice<f32>,
    pub ranks: PinnedHostSlice<u32>,
}

impl Readback {
    pub fn new(gpu: &GpuContext, cfg: &Qwen2Config, max_rows: usize) -> Result<Self> {
        fn pinned<T: novainfer_cuda::cudarc::driver::DeviceRepr>(
            gpu: &GpuContext,
            len: usize,
        ) -> Result<PinnedHostSlice<T>> {
            // SAFETY: the memory is uninitialised until a device copy writes it; the tail
            // reads back only the values the step's copies wrote (see `forward::Step`).
            unsafe { gpu.context().alloc_pinned_with_flags::<T>(len.max(1), 0) }
                .map_err(driver_error("cuMemHostAlloc"))
        }
        Ok(Self {
            logits: pinned(gpu, max_rows * cfg.vocab_size)?,
            hidden: pinned(gpu, max_rows * cfg.hidden_size)?,
            ids: pinned(gpu, max_rows)?,
            logprobs: pinned(gpu, max_rows)?,
            top_ids: pinned(gpu, max_rows * MAX_TOP_LOGPROBS)?,
            top_logprobs: pinned(gpu, max_rows * MAX_TOP_LOGPROBS)?,
            ranks: pinned(gpu, max_rows)?,
        })
    }
}

/// The first `len` values of `s`, or an error naming the buffer (a runner bug: the step
/// was checked against the capacity these buffers were sized for).
pub(crate) fn head<'a, T>(s: &'a CudaSlice<T>, len: usize, what: &str) -> Result<CudaView<'a, T>> {
    s.try_slice(0..len)
        .ok_or_else(|| too_small(what, len, s.len()))
}

pub(crate) fn head_mut<'a, T>(
    s: &'a mut CudaSlice<T>,
    len: usize,
    what: &str,
) -> Result<CudaViewMut<'a, T>> {
    let cap = s.len();
    s.try_slice_mut(0..len)
        .ok_or_else(|| too_small(what, len, cap))
}

/// `len` bytes of zeroed pinned host memory.
fn zeroed_pinned(gpu: &GpuContext, len: usize) -> Result<PinnedHostSlice<u8>> {
    // SAFETY: the memory is uninitialised until `write_bytes` zeroes all of it below, before
    // any reference to it is made.
    let mut staging =
        unsafe { gpu.context().alloc_pinned::<u8>(len) }.map_err(driver_error("cuMemHostAlloc"))?;
    let ptr = staging
        .as_mut_ptr()
        .map_err(driver_error("cuEventSynchronize"))?;
    // SAFETY: `ptr` addresses `len` bytes of host memory owned by `staging`.
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(staging)
}

fn too_small(what: &str, len: usize, cap: usize) -> ModelError {
    ModelError::Cuda(format!(
        "buffer `{what}` holds {cap} values, the step needs {len}"
    ))
}

/// The step's metadata: packed on the host into pinned memory, uploaded with one copy.
pub(crate) struct StepBuffers {
    pub layout: StepLayout,
    /// Two, so a step can be packed while the one before it, still in flight, has not yet
    /// copied its own (`slot` in the calls below: the executor alternates them).
    staging: [PinnedHostSlice<u8>; 2],
    device: CudaSlice<u8>,
}

/// Typed views of one uploaded step (lengths for this step).
pub(crate) struct StepViews<'a> {
    pub token_ids: CudaView<'a, u32>,
    pub positions: CudaView<'a, i32>,
    pub slot_mapping: CudaView<'a, i64>,
    pub block_tables: CudaView<'a, i32>,
    pub seq_lens: CudaView<'a, i32>,
    pub query_start_loc: CudaView<'a, i32>,
    pub sample_rows: CudaView<'a, i32>,
    pub draw_params: CudaView<'a, SampleParams>,
    pub draw_modes: CudaView<'a, DrawMode>,
    pub host_rows: CudaView<'a, i32>,
    pub row_penalties: CudaView<'a, RowPenalties>,
    pub edit_offsets: CudaView<'a, i32>,
    pub tops: CudaView<'a, i32>,
    pub masks_at: CudaView<'a, i32>,
    /// Per token row, its adapter's slot or −1; empty in a step without adapters.
    pub lora_rows: CudaView<'a, i32>,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: usize,
}

impl StepBuffers {
    pub fn new(gpu: &GpuContext, layout: StepLayout) -> Result<Self> {
        let staging = [
            zeroed_pinned(gpu, layout.total)?,
            zeroed_pinned(gpu, layout.total)?,
        ];
        let device = gpu
            .stream()
            .alloc_zeros::<u8>(layout.total)
            .map_err(driver_error("cuMemAlloc"))?;
        Ok(Self {
            layout,
            staging,
            device,
        })
    }

    /// Writes `step` to staging buffer `slot` and enqueues its upload ([`Self::views`] are
    /// the step's arrays in the device buffer; a graph replay reads them at the addresses it
    /// captured).
    ///
    /// The copy is asynchronous: a staging buffer must not be written again before its copy
    /// completes. A pass left in flight has used the other slot; every other step ends by
    /// synchronising the stream (a failed one before returning).
    pub fn write_and_copy(
        &mut self,
        gpu: &GpuContext,
        step: &PackedStep,
        slot: usize,
    ) -> Result<()> {
        let staging = self.staging[slot % 2]
            .as_mut_slice()
            .map_err(driver_error("cuEventSynchronize"))?;
        let used = self.layout.write(step, staging);
        let mut dst = self
            .device
            .try_slice_mut(0..used)
            .ok_or_else(|| too_small("step metadata", used, self.layout.total))?;
        gpu.stream()
            .memcpy_htod(&staging[..used], &mut dst)
            .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        Ok(())
    }

    /// After the upload: the step's chained tokens written into its uploaded token ids from
    /// `drawn`, the drawn ids of the step enqueued before it (nothing without chained tokens).
    pub fn chain(
        &mut self,
        gpu: &GpuContext,
        step: &PackedStep,
        drawn: &CudaSlice<u32>,
    ) -> Result<()> {
        if step.chain.is_empty() {
            return Ok(());
        }
        let l = &self.layout;
        let n = step.num_tokens();
        let (mut head, tail) = self
            .device
            .try_split_at_mut(l.chain)
            .ok_or_else(|| too_small("step metadata", l.chain, self.layout.total))?;
        let mut ids = head
            .try_slice_mut(l.token_ids..l.token_ids + 4 * n)
            .ok_or_else(|| too_small("step metadata", l.token_ids + 4 * n, l.chain))?;
        let pairs = tail
            .try_slice(0..4 * step.chain.len())
            .ok_or_else(|| too_small("chained tokens", step.chain.len(), tail.len() / 4))?;
        // SAFETY: u32 and i32 sections the layout wrote (`typed`'s argument), at 256-byte
        // aligned offsets; every bit pattern is a valid u32 or i32.
        let (mut ids, pairs) = unsafe {
            (
                ids.transmute_mut::<u32>(n)
                    .ok_or_else(|| too_small("token ids", n, 0))?,
                pairs
                    .transmute::<i32>(step.chain.len())
                    .ok_or_else(|| too_small("chained tokens", step.chain.len(), 0))?,
            )
        };
        chain_tokens(gpu, &drawn.as_view(), &pairs, &mut ids)
            .map_err(|e| ModelError::Cuda(e.to_string()))?;
        Ok(())
    }

    /// Typed views of `step`'s arrays in the device buffer (uploaded or being uploaded):
    /// always at the layout's offsets, with `step`'s lengths.
    pub fn views(&self, step: &PackedStep) -> Result<StepViews<'_>> {
        let l = &self.layout;
        let (n, s) = (step.num_tokens(), step.num_seqs());
        Ok(StepViews {
            token_ids: typed(&self.device, l.token_ids, n)?,
            positions: typed(&self.device, l.positions, n)?,
            slot_mapping: typed(&self.device, l.slot_mapping, n)?,
            block_tables: typed(&self.device, l.block_tables, s * l.max_blocks_per_seq)?,
            seq_lens: typed(&self.device, l.seq_lens, s)?,
            query_start_loc: typed(&self.device, l.query_start_loc, s + 1)?,
            sample_rows: typed(&self.device, l.sample_rows, step.sample_rows.len())?,
            draw_params: typed(&self.device, l.draw_params, step.draw_params.len())?,
            draw_modes: typed(&self.device, l.draw_modes, step.draw_modes.len())?,
            host_rows: typed(&self.device, l.host_rows, step.host_rows.len())?,
            row_penalties: typed(&self.device, l.row_penalties, step.row_penalties.len())?,
            edit_offsets: typed(&self.device, l.edit_offsets, step.edit_offsets.len())?,
            tops: typed(&self.device, l.tops, step.tops.len())?,
            masks_at: typed(&self.device, l.masks_at, step.masks_at.len())?,
            lora_rows: typed(&self.device, l.lora_rows, step.lora_rows.len())?,
            max_blocks_per_seq: l.max_blocks_per_seq,
        })
    }
}

/// `len` values of type `T` at byte `offset` of the metadata buffer.
fn typed<T>(buf: &CudaSlice<u8>, offset: usize, len: usize) -> Result<CudaView<'_, T>> {
    let bytes = len * std::mem::size_of::<T>();
    let section = buf
        .try_slice(offset..offset + bytes)
        .ok_or_else(|| too_small("step metadata", offset + bytes, buf.len()))?;
    // SAFETY: `T` is one of u32, i32, i64, `SampleParams` (plain old data) or `DrawMode`,
    // whose bytes `StepLayout::write` wrote as one of its values (a device read of another
    // i32 is no Rust value; the kernel treats unknown modes as skips). The section starts at
    // a multiple of 256 bytes from an allocation's base (StepLayout's alignment), so it is
    // aligned for `T`, and it holds exactly `len` values.
    unsafe { section.transmute::<T>(len) }
        .ok_or_else(|| too_small("step metadata", offset + bytes, buf.len()))
}

/// The drawn rows' edits of a step (penalties, bias, mask), uploaded apart from the step's
/// metadata because their count varies from none to [`MAX_DEVICE_EDITS`] a row: pinned
/// staging buffers, one per slot as [`StepBuffers`]' (a pass in flight may not have copied its
/// own yet), and one device copy (stream order keeps the passes' uploads apart), for
/// `max_rows` rows.
pub(crate) struct EditBuffers {
    staging: [PinnedHostSlice<u8>; 2],
    device: CudaSlice<RowEdit>,
}

impl EditBuffers {
    pub fn new(gpu: &GpuContext, max_rows: usize) -> Result<Self> {
        let capacity = max_rows.max(1) * MAX_DEVICE_EDITS;
        // SAFETY: written by `write_edits` before each upload, which copies only what it wrote.
        let pinned = || unsafe { gpu.context().alloc_pinned::<u8>(16 * capacity) };
        let staging = [pinned(), pinned()].map(|s| s.map_err(driver_error("cuMemHostAlloc")));
        let [a, b] = staging;
        let staging = [a?, b?];
        let device = gpu
            .stream()
            .alloc_zeros::<RowEdit>(capacity)
            .map_err(driver_error("cuMemAlloc"))?;
        Ok(Self { staging, device })
    }

    /// Uploads `step`'s edits through staging buffer `slot` and returns them; with none, one
    /// stale entry that no offset reaches (the kernels take a non-empty view). Like
    /// [`StepBuffers::write_and_copy`], the copy is only queued (cudarc does not wait on pinned
    /// memory: event tracking is off), so `slot` must not be a pass's in flight.
    pub fn upload(
        &mut self,
        gpu: &GpuContext,
        step: &PackedStep,
        slot: usize,
    ) -> Result<CudaView<'_, RowEdit>> {
        let n = step.edits.len();
        if n > 0 {
            let staging = self.staging[slot % 2]
                .as_mut_slice()
                .map_err(driver_error("cuEventSynchronize"))?;
            if staging.len() < 16 * n {
                return Err(too_small("row edits", n, staging.len() / 16));
            }
            let used = write_edits(&step.edits, staging);
            // SAFETY: `RowEdit` is `#[repr(C)]` plain old data of 16 bytes (alignment 4; the
            // pinned allocation is page-aligned) and `write_edits` just wrote `n` of them.
            let edits: &[RowEdit] = unsafe {
                std::slice::from_raw_parts(staging[..used].as_ptr().cast::<RowEdit>(), n)
            };
            let capacity = self.device.len();
            let mut dst = self
                .device
                .try_slice_mut(0..n)
                .ok_or_else(|| too_small("row edits", n, capacity))?;
            gpu.stream()
                .memcpy_htod(edits, &mut dst)
                .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        }
        let len = self.device.len();
        self.device
            .try_slice(0..n.max(1))
            .ok_or_else(|| too_small("row edits", n, len))
    }
}

/// The grammar masks of a step's drawn rows (`⌈vocab / 32⌉` words a row, up to `max_rows`
/// rows), uploaded apart from the step's metadata like the edits.
pub(crate) struct MaskBuffers {
    staging: [PinnedHostSlice<u32>; 2],
    device: CudaSlice<u32>,
}

impl MaskBuffers {
    pub fn new(gpu: &GpuContext, cfg: &Qwen2Config, max_rows: usize) -> Result<Self> {
        let capacity = max_rows.max(1) * cfg.vocab_size.div_ceil(32);
        // SAFETY: written before each upload, which copies only what was written.
        let pinned = || unsafe { gpu.context().alloc_pinned::<u32>(capacity) };
        let staging = [pinned(), pinned()].map(|s| s.map_err(driver_error("cuMemHostAlloc")));
        let [a, b] = staging;
        let staging = [a?, b?];
        let device = gpu
            .stream()
            .alloc_zeros::<u32>(capacity)
            .map_err(driver_error("cuMemAlloc"))?;
        Ok(Self { staging, device })
    }

    /// Uploads `step`'s masks through staging buffer `slot` and returns them (a stale word
    /// when there are none: no row's `masks_at` reaches it). The copy is only queued, as for
    /// the edits: `slot` must not be a pass's in flight.
    pub fn upload(
        &mut self,
        gpu: &GpuContext,
        step: &PackedStep,
        slot: usize,
    ) -> Result<CudaView<'_, u32>> {
        let n = step.masks.len();
        let capacity = self.device.len();
        if n > 0 {
            let staging = self.staging[slot % 2]
                .as_mut_slice()
                .map_err(driver_error("cuEventSynchronize"))?;
            let words = staging
                .get_mut(..n)
                .ok_or_else(|| too_small("grammar masks", n, capacity))?;
            words.copy_from_slice(&step.masks);
            let mut dst = self
                .device
                .try_slice_mut(0..n)
                .ok_or_else(|| too_small("grammar masks", n, capacity))?;
            gpu.stream()
                .memcpy_htod(&*words, &mut dst)
                .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        }
        self.device
            .try_slice(0..n.max(1))
            .ok_or_else(|| too_small("grammar masks", n, capacity))
    }
}

/// One layer's K and V, each `[num_blocks, block_size, KVH, D]` bf16.
pub(crate) struct LayerKv {
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
}

pub(crate) struct KvPool {
    pub layers: Vec<LayerKv>,
    pub num_blocks: usize,
    pub block_size: usize,
    /// `KVH · D`: values per slot.
    pub kv_row: usize,
}

impl KvPool {
    pub fn new(
        gpu: &GpuContext,
        cfg: &Qwen2Config,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let kv_row = cfg.num_key_value_heads * cfg.head_dim();
        let len = num_blocks * block_size * kv_row;
        let zeros = || {
            gpu.stream()
                .alloc_zeros::<bf16>(len.max(1))
                .map_err(driver_error("cuMemAlloc (KV pool)"))
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| {
                Ok(LayerKv {
                    k: zeros()?,
                    v: zeros()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            num_blocks,
            block_size,
            kv_row,
        })
    }

    /// Bytes of one block over all layers, K and V, in bf16.
    pub fn bytes_per_block(cfg: &Qwen2Config, block_size: usize) -> usize {
        2 * cfg.num_hidden_layers
            * block_size
            * cfg.num_key_value_heads
            * cfg.head_dim()
            * std::mem::size_of::<bf16>()
    }
}
