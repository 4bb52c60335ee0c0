//! Launcher of `kernels/gemv_quant.cu`: decode products straight from packed GGUF blocks
//! (`y[r, col0 + o] = x_r · W[o]` for up to [`MAX_ROWS`] rows). Geometry and arithmetic: the
//! CPU twin, [`crate::gemv_plan`].

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{launch, to_i32, to_u32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
pub use crate::gemv_plan::MAX_ROWS;
use crate::gemv_plan::{check_shape, grid, WARPS};
use crate::quant_type::QuantType;

/// Where the product lands: columns `col0 .. col0 + rows` of `y`'s `[n, ld]` rows (a part of a
/// fused matrix's output).
#[derive(Debug, Clone, Copy)]
pub struct OutColumns {
    pub ld: usize,
    pub col0: usize,
}

/// `y[r, col0 + o] = Σ_k x[r, k] · W[o, k]` for `r < n`, `o < rows`; `w` holds `rows` rows of
/// `k / block_values` raw blocks of `qtype`; `x` is `[n, k]`, `y` `[n, ld]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_quant<T: Dtype>(
    gpu: &GpuContext,
    qtype: QuantType,
    w: &CudaView<'_, u8>,
    rows: usize,
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
    y: &mut CudaViewMut<'_, T>,
    out: OutColumns,
) -> Result<()> {
    check_shape(qtype, rows, k, n).map_err(|why| CudaError::invalid("shape", why))?;
    let row_bytes = k / qtype.block_values() * qtype.block_bytes();
    if w.len() != rows * row_bytes {
        return Err(CudaError::invalid(
            "w",
            format!("{} bytes for {rows} rows of {row_bytes}", w.len()),
        ));
    }
    if x.len() < n * k {
        return Err(CudaError::invalid(
            "x",
            format!("{} values for [{n}, {k}]", x.len()),
        ));
    }
    if out.col0 + rows > out.ld || y.len() < (n - 1) * out.ld + out.col0 + rows {
        return Err(CudaError::invalid(
            "y",
            format!(
                "{} values cannot take columns {}..{} of {n} rows of {}",
                y.len(),
                out.col0,
                out.col0 + rows,
                out.ld
            ),
        ));
    }
    let (rows_i, k_i, n_i, ld_i, col0_i) = (
        to_i32("rows", rows)?,
        to_i32("k", k)?,
        to_i32("n", n)?,
        to_i32("ld", out.ld)?,
        to_i32("col0", out.col0)?,
    );
    let f = gpu.kernels().gemv[qtype.index()].get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(w)
        .arg(x)
        .arg(y)
        .arg(&rows_i)
        .arg(&k_i)
        .arg(&n_i)
        .arg(&ld_i)
        .arg(&col0_i);
    launch(
        args,
        LaunchConfig {
            grid_dim: (to_u32("rows", grid(rows))?, 1, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}
