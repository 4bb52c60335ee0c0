//! Launchers of `kernels/lora.cu`: each row's LoRA update, `y[r, off..off + out] +=
//! s · (x_r Aᵀ) Bᵀ` with the row's adapter (a slot of [`LoraPair`]s; −1: none). The geometry
//! and a CPU twin of the arithmetic are in [`crate::lora_plan`].

use cudarc::driver::{
    CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};

use super::{check_len, launch, to_i32, to_u32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
pub use crate::lora_plan::LoraPair;
use crate::lora_plan::{expand_grid, shrink_grid, EXPAND_THREADS, SHRINK_WARPS};

// SAFETY: `#[repr(C)]` plain old data with the kernel struct's field order and types (two
// pointers as u64, an i32, an f32; size asserted in lora_plan); all-zero bytes are a valid
// value (null pointers: "no update").
unsafe impl DeviceRepr for LoraPair {}
unsafe impl ValidAsZeroBits for LoraPair {}

/// Which adapter each row runs with, and the adapters' matrices for one projection.
pub struct LoraRows<'a> {
    /// `[rows]`: a slot of `pairs`, or −1.
    pub row_slot: CudaView<'a, i32>,
    /// `[num_slots]`.
    pub pairs: CudaView<'a, LoraPair>,
    /// At least every slot's rank: the row stride of `t`.
    pub max_rank: usize,
}

/// `t[r, j] = s · x_r · A[j]` (`x`: `[rows, in_features]`, `t`: `[rows, max_rank]`, zeros past
/// a row's rank and for rows without an adapter).
pub fn lora_shrink<T: Dtype>(
    gpu: &GpuContext,
    x: &CudaView<'_, T>,
    in_features: usize,
    lora: &LoraRows<'_>,
    t: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let rows = lora.row_slot.len();
    check_len("x", x.len(), rows * in_features)?;
    check_len("t", t.len(), rows * lora.max_rank)?;
    if rows == 0 || lora.max_rank == 0 {
        return Ok(());
    }
    let (gx, gy) = shrink_grid(rows, lora.max_rank);
    let (in_i, slots, rank) = (
        to_i32("in_features", in_features)?,
        to_i32("pairs", lora.pairs.len())?,
        to_i32("max_rank", lora.max_rank)?,
    );
    let f = gpu.kernels().lora_shrink.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x)
        .arg(&lora.row_slot)
        .arg(&lora.pairs)
        .arg(t)
        .arg(&in_i)
        .arg(&slots)
        .arg(&rank);
    launch(
        args,
        LaunchConfig {
            grid_dim: (to_u32("rows", gx)?, to_u32("max_rank", gy)?, 1),
            block_dim: ((SHRINK_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}

/// Where an expand writes: columns `offset..offset + out_features` of `y` (`[rows, stride]`),
/// a projection's part of a fused output.
#[derive(Debug, Clone, Copy)]
pub struct Columns {
    pub out_features: usize,
    pub stride: usize,
    pub offset: usize,
}

/// `y[r, offset + c] += Σ_j t[r, j] · Bᵀ[j, c]` for the rows with an adapter.
pub fn lora_expand<T: Dtype>(
    gpu: &GpuContext,
    t: &CudaView<'_, f32>,
    lora: &LoraRows<'_>,
    y: &mut CudaViewMut<'_, T>,
    cols: Columns,
) -> Result<()> {
    let rows = lora.row_slot.len();
    check_len("t", t.len(), rows * lora.max_rank)?;
    check_len("y", y.len(), rows * cols.stride)?;
    if cols.offset + cols.out_features > cols.stride {
        return Err(CudaError::invalid(
            "offset",
            format!(
                "columns {}..{} exceed the row of {}",
                cols.offset,
                cols.offset + cols.out_features,
                cols.stride
            ),
        ));
    }
    if rows == 0 || cols.out_features == 0 {
        return Ok(());
    }
    let (gx, gy) = expand_grid(cols.out_features, rows);
    let (out_i, stride, offset, slots, rank) = (
        to_i32("out_features", cols.out_features)?,
        to_i32("stride", cols.stride)?,
        to_i32("offset", cols.offset)?,
        to_i32("pairs", lora.pairs.len())?,
        to_i32("max_rank", lora.max_rank)?,
    );
    let f = gpu.kernels().lora_expand.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(t)
        .arg(&lora.row_slot)
        .arg(&lora.pairs)
        .arg(y)
        .arg(&out_i)
        .arg(&stride)
        .arg(&offset)
        .arg(&slots)
        .arg(&rank);
    launch(
        args,
        LaunchConfig {
            grid_dim: (to_u32("rows", gx)?, to_u32("out_features", gy)?, 1),
            block_dim: (EXPAND_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}
