//! Launcher of `kernels/rope.cu`: neox-style rotary embedding of q and k in place.
//!
//! The cos/sin table is built on the host by [`crate::rope_scaling`], the function the CPU's
//! `Rope` (`novainfer-model`) uses too: angle = pos · inv_freq[i] in f64 (θ^(−2i/head_dim)
//! unscaled; linear, dynamic NTK or YaRN frequencies for a scaled checkpoint), times YaRN's
//! attention factor, rounded to f32; so rotations match the CPU bit for bit in f32.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, launch, per_row, to_i32, Dtype};
use crate::context::{driver, GpuContext};
use crate::error::{CudaError, Result};
use crate::rope_scaling::{cos_sin_table, RopeScaling};

/// The `[max_positions, head_dim]` cos|sin table on the device.
pub struct RopeTable {
    cos_sin: CudaSlice<f32>,
    head_dim: usize,
    max_positions: usize,
}

impl RopeTable {
    /// Plain RoPE (no scaling).
    pub fn new(
        gpu: &GpuContext,
        head_dim: usize,
        theta: f64,
        max_positions: usize,
    ) -> Result<Self> {
        Self::with_scaling(gpu, head_dim, theta, &RopeScaling::None, max_positions)
    }

    /// RoPE with the checkpoint's `scaling` (linear, dynamic NTK, YaRN), the CPU's table.
    pub fn with_scaling(
        gpu: &GpuContext,
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        max_positions: usize,
    ) -> Result<Self> {
        let host = host_table_scaled(head_dim, theta, scaling, max_positions)?;
        let cos_sin = gpu
            .stream()
            .clone_htod(&host)
            .map_err(|e| driver("cuMemcpyHtoD", e))?;
        Ok(Self {
            cos_sin,
            head_dim,
            max_positions,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rows of the table: positions at or past it are the runner's to refuse
    /// (`validate::StepLimits::rope_positions`).
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    pub(crate) fn cos_sin(&self) -> &CudaSlice<f32> {
        &self.cos_sin
    }
}

/// Row `pos` holds `cos(pos·f_i)` for i < head_dim/2, then `sin(pos·f_i)` (plain RoPE).
pub fn host_table(head_dim: usize, theta: f64, max_positions: usize) -> Result<Vec<f32>> {
    host_table_scaled(head_dim, theta, &RopeScaling::None, max_positions)
}

/// [`host_table`] with `scaling`'s frequencies and attention factor.
pub fn host_table_scaled(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    max_positions: usize,
) -> Result<Vec<f32>> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(CudaError::invalid(
            "head_dim",
            format!("{head_dim} must be even and > 0"),
        ));
    }
    Ok(cos_sin_table(head_dim, theta, scaling, max_positions))
}

/// Head counts of q and k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeHeads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

/// Rotates every head of q and k; token t sits at `positions[t]`. The runner checks
/// positions against the table on the host (`validate::validate_step`); the kernel leaves a
/// row past the table unrotated rather than read out of bounds.
pub fn rope_neox<T: Dtype>(
    gpu: &GpuContext,
    table: &RopeTable,
    q: &mut CudaViewMut<'_, T>,    // [num_tokens, num_heads · head_dim]
    k: &mut CudaViewMut<'_, T>,    // [num_tokens, num_kv_heads · head_dim]
    positions: &CudaView<'_, i32>, // [num_tokens]
    heads: RopeHeads,
) -> Result<()> {
    let hd = table.head_dim;
    let num_tokens = positions.len();
    check_len("q", q.len(), num_tokens * heads.num_heads * hd)?;
    check_len("k", k.len(), num_tokens * heads.num_kv_heads * hd)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let f = gpu.kernels().rope.get::<T>();
    let (nh, nkv, hd_i, max_pos) = (
        to_i32("num_heads", heads.num_heads)?,
        to_i32("num_kv_heads", heads.num_kv_heads)?,
        to_i32("head_dim", hd)?,
        to_i32("max_positions", table.max_positions)?,
    );
    let mut args = gpu.stream().launch_builder(f);
    args.arg(q)
        .arg(k)
        .arg(positions)
        .arg(&table.cos_sin)
        .arg(&nh)
        .arg(&nkv)
        .arg(&hd_i)
        .arg(&max_pos);
    launch(args, per_row(num_tokens, 128)?)
}
