//! LoRA adapters on the GPU: device copies of the adapters steps use, and each projection's
//! update after its GEMM (`kernels/lora.cu`: a shrink `t = s·x·Aᵀ`, an expand `y += t·Bᵀ`
//! into the projection's columns of the fused output).
//!
//! Adapters stay in host memory (the engine's registry); a step's adapters are copied to the
//! device on first use into one of [`MAX_SLOTS`] slots, the least recently used other slot
//! evicted when all are taken (vLLM's `max_loras` bounds how many a step may name; the
//! engine's scheduler enforces it). A slot holds f32 copies of `A` and `Bᵀ` for every
//! (layer, projection) the adapter updates: the file's values exactly, as on the CPU. The
//! kernels find them through one table of [`LoraPair`]s per (layer, projection), indexed by
//! slot. Uploads happen on a miss only, synchronously, from pageable memory: an adapter's
//! first step pays its copy, later steps copy nothing.

use half::bf16;
use novainfer_cuda::cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use novainfer_cuda::ops::lora::{lora_expand, lora_shrink, Columns, LoraPair, LoraRows};
use novainfer_cuda::GpuContext;

use super::buffers::{head, head_mut};
use super::driver_error;
use super::forward::Failure;
use crate::error::{ModelError, Result};
use crate::lora::{AdapterId, AdapterRef, Target};
use crate::prepare::PackedStep;

/// Adapters resident on the device at once.
pub(crate) const MAX_SLOTS: usize = crate::capabilities::CUDA_ADAPTER_SLOTS;

struct Resident {
    id: AdapterId,
    /// The step count when a step last used it.
    last_used: u64,
    /// Per (layer, target): the device `A` and `Bᵀ`, kept alive while the table points at them.
    _mats: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    rank: usize,
}

/// The resident adapters and the tables the kernels read.
pub(crate) struct DeviceAdapters {
    num_layers: usize,
    max_tokens: usize,
    slots: Vec<Option<Resident>>,
    /// `[num_layers · 7, MAX_SLOTS]`, mirrored on the host.
    host_table: Vec<LoraPair>,
    table: Option<CudaSlice<LoraPair>>,
    /// Each row's `x Aᵀ` (`[max_tokens, rank]`), sized for the largest resident rank.
    t: Option<CudaSlice<f32>>,
    t_rank: usize,
    clock: u64,
}

impl DeviceAdapters {
    pub fn new(num_layers: usize, max_tokens: usize) -> Self {
        Self {
            num_layers,
            max_tokens,
            slots: (0..MAX_SLOTS).map(|_| None).collect(),
            host_table: vec![LoraPair::default(); num_layers * Target::ALL.len() * MAX_SLOTS],
            table: None,
            t: None,
            t_rank: 0,
            clock: 0,
        }
    }

    /// Makes every adapter of `step` resident and rewrites `step.lora_rows` from indices into
    /// `step.adapters` to slots. Nothing happens for a step without adapters.
    pub fn bind(&mut self, gpu: &GpuContext, step: &mut PackedStep) -> Result<()> {
        if step.adapters.is_empty() {
            return Ok(());
        }
        if step.adapters.len() > MAX_SLOTS {
            return Err(ModelError::config(
                "max_loras",
                format!(
                    "a step names {} adapters; the GPU holds {MAX_SLOTS} at once",
                    step.adapters.len()
                ),
            ));
        }
        self.clock += 1;
        let mut slot_of = Vec::with_capacity(step.adapters.len());
        let mut changed = false;
        for adapter in &step.adapters {
            let slot = match self.find(adapter.id()) {
                Some(slot) => slot,
                None => {
                    let slot = self.victim(&step.adapters);
                    changed = true;
                    if let Err(e) = self.upload(gpu, slot, adapter) {
                        // Slots are allocated after the KV pool took its share of the device: out of
                        // memory, every adapter this step does not name goes, then one more try.
                        let evicted = self.evict_all_but(&step.adapters);
                        if evicted == 0 {
                            return Err(e);
                        }
                        tracing::warn!(
                            adapter = adapter.name(),
                            evicted,
                            error = %e,
                            "LoRA upload failed; evicted the adapters this step does not use and retried"
                        );
                        self.upload(gpu, slot, adapter)?;
                    }
                    slot
                }
            };
            if let Some(r) = self.slots[slot].as_mut() {
                r.last_used = self.clock;
            }
            slot_of.push(slot as i32);
        }
        if changed || self.table.is_none() {
            let stream = gpu.stream();
            self.table = Some(
                stream
                    .clone_htod(&self.host_table)
                    .map_err(driver_error("cuMemcpyHtoD (LoRA table)"))?,
            );
            let rank = self
                .slots
                .iter()
                .flatten()
                .map(|r| r.rank)
                .max()
                .unwrap_or(1);
            if rank > self.t_rank {
                self.t = Some(
                    stream
                        .alloc_zeros::<f32>(self.max_tokens * rank)
                        .map_err(driver_error("cuMemAlloc (LoRA scratch)"))?,
                );
                self.t_rank = rank;
            }
        }
        for row in &mut step.lora_rows {
            if *row >= 0 {
                *row = slot_of[*row as usize];
            }
        }
        Ok(())
    }

    fn find(&self, id: AdapterId) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|r| r.id == id))
    }

    /// A free slot, else the least recently used one whose adapter `keep` does not name.
    fn victim(&self, keep: &[AdapterRef]) -> usize {
        if let Some(free) = self.slots.iter().position(Option::is_none) {
            return free;
        }
        (0..MAX_SLOTS)
            .filter(|&s| {
                let id = self.slots[s].as_ref().map(|r| r.id);
                !keep.iter().any(|a| Some(a.id()) == id)
            })
            .min_by_key(|&s| self.slots[s].as_ref().map_or(0, |r| r.last_used))
            .unwrap_or(0)
    }

    /// Frees every resident adapter `keep` does not name and clears its table entries; how many.
    fn evict_all_but(&mut self, keep: &[AdapterRef]) -> usize {
        let mut evicted = 0;
        for slot in 0..MAX_SLOTS {
            let named = self.slots[slot]
                .as_ref()
                .is_some_and(|r| keep.iter().any(|a| a.id() == r.id));
            if self.slots[slot].is_some() && !named {
                self.clear_slot(slot);
                evicted += 1;
            }
        }
        evicted
    }

    /// Empties `slot`: its buffers freed (in stream order, behind the work that reads them) and
    /// its table entries pointing nowhere.
    fn clear_slot(&mut self, slot: usize) {
        self.slots[slot] = None;
        for entry in self.host_table.iter_mut().skip(slot).step_by(MAX_SLOTS) {
            *entry = LoraPair::default();
        }
    }

    /// Copies `adapter` into `slot` and points its table entries at it. On failure the slot is
    /// left empty, its entries pointing nowhere (never at buffers freed with the failure).
    fn upload(&mut self, gpu: &GpuContext, slot: usize, adapter: &AdapterRef) -> Result<()> {
        // The old adapter goes first: its memory is free for the new one, and no entry can
        // outlive its buffers.
        self.clear_slot(slot);
        let result = self.upload_into(gpu, slot, adapter);
        if result.is_err() {
            self.clear_slot(slot);
        }
        result
    }

    fn upload_into(&mut self, gpu: &GpuContext, slot: usize, adapter: &AdapterRef) -> Result<()> {
        let stream = gpu.stream();
        let mut mats = Vec::new();
        let mut rank = 1;
        for layer in 0..self.num_layers {
            for (ti, &target) in Target::ALL.iter().enumerate() {
                // Cleared by `upload`: entries of projections the adapter leaves alone stay empty.
                let entry =
                    &mut self.host_table[(layer * Target::ALL.len() + ti) * MAX_SLOTS + slot];
                let Some(pair) = adapter.layer(layer).get(target) else {
                    continue;
                };
                let a = stream
                    .clone_htod(&pair.a_f32())
                    .map_err(driver_error("cuMemcpyHtoD (LoRA A)"))?;
                let bt = stream
                    .clone_htod(&pair.bt_f32())
                    .map_err(driver_error("cuMemcpyHtoD (LoRA B)"))?;
                *entry = LoraPair {
                    a: a.device_ptr(stream).0,
                    bt: bt.device_ptr(stream).0,
                    rank: pair.rank() as i32,
                    scale: pair.scale(),
                };
                rank = rank.max(pair.rank());
                mats.push((a, bt));
            }
        }
        // The copies are queued on the stream ahead of every later launch; the old slot's
        // buffers (dropped here) are freed by cudarc in stream order too.
        self.slots[slot] = Some(Resident {
            id: adapter.id(),
            last_used: self.clock,
            _mats: mats,
            rank,
        });
        tracing::debug!(
            adapter = adapter.name(),
            slot,
            "LoRA adapter copied to the GPU"
        );
        Ok(())
    }

    /// What a step's forward needs, once [`Self::bind`] ran for it.
    pub fn step(&mut self) -> Option<LoraStep<'_>> {
        Some(LoraStep {
            table: self.table.as_ref()?,
            t: self.t.as_mut()?,
            max_rank: self.t_rank,
        })
    }
}

/// The adapters' tables and scratch, borrowed by one step.
pub(crate) struct LoraStep<'a> {
    table: &'a CudaSlice<LoraPair>,
    t: &'a mut CudaSlice<f32>,
    max_rank: usize,
}

/// One projection of a fused GEMM output: its target and its columns.
pub(crate) struct Part {
    target: Target,
    offset: usize,
    out_features: usize,
}

impl Part {
    pub fn new(target: Target, offset: usize, out_features: usize) -> Self {
        Self {
            target,
            offset,
            out_features,
        }
    }
}

impl LoraStep<'_> {
    /// Adds each row's update of `parts` (projections of layer `layer` sharing the input `x`,
    /// `[n, in_features]`) to their columns of `y` (`[n, stride]`).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &mut self,
        gpu: &GpuContext,
        layer: usize,
        row_slot: &CudaView<'_, i32>,
        x: &CudaSlice<bf16>,
        in_features: usize,
        y: &mut CudaSlice<bf16>,
        stride: usize,
        parts: &[Part],
    ) -> std::result::Result<(), Failure> {
        let n = row_slot.len();
        for part in parts {
            let at = (layer * Target::ALL.len() + part.target as usize) * MAX_SLOTS;
            let pairs = self
                .table
                .try_slice(at..at + MAX_SLOTS)
                .ok_or_else(|| ModelError::config("lora", "table too small: a bug"))?;
            let rows = LoraRows {
                row_slot: row_slot.slice(..),
                pairs,
                max_rank: self.max_rank,
            };
            lora_shrink::<bf16>(
                gpu,
                &head(x, n * in_features, "lora input")?,
                in_features,
                &rows,
                &mut head_mut(self.t, n * self.max_rank, "lora t")?,
            )?;
            lora_expand::<bf16>(
                gpu,
                &head(self.t, n * self.max_rank, "lora t")?,
                &rows,
                &mut head_mut(y, n * stride, "lora output")?,
                Columns {
                    out_features: part.out_features,
                    stride,
                    offset: part.offset,
                },
            )?;
        }
        Ok(())
    }
}
