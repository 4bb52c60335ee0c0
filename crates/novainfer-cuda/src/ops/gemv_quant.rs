//! Launchers of `kernels/gemv_quant.cu`: decode products (`y[r, col0 + o] = x_r · W[o]` for up
//! to [`MAX_ROWS`] rows) straight from packed GGUF blocks or bf16 rows ([`gemv`]), and the same
//! products with the layer's next kernel fused into their epilogue: gate/up with SiLU·mul
//! ([`gemv_silu_mul`], `silu_mul.cu`'s arithmetic) and a QKV part with bias, RoPE and the
//! KV-cache write ([`gemv_qkv`], `qkv.cu`'s). A fused launch equals the GEMV followed by the
//! unfused kernel bit for bit. Geometry and arithmetic: the CPU twin, [`crate::gemv_plan`].

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::kv::KvCacheMut;
use super::rope::RopeTable;
use super::{check_len, check_multiple, launch, to_i32, to_u32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
use crate::gemv_plan::{check_shape, grid, qkv_grid, silu_grid, WARPS};
pub use crate::gemv_plan::{GemvEpilogue, GemvWeights, QkvHeads, MAX_ROWS};

/// Where the product lands: columns `col0 .. col0 + rows` of `y`'s `[n, ld]` rows (a part of a
/// fused matrix's output).
#[derive(Debug, Clone, Copy)]
pub struct OutColumns {
    pub ld: usize,
    pub col0: usize,
}

/// A bf16 matrix's memory as the GEMV takes weight rows: bytes.
pub fn bf16_bytes(m: &CudaSlice<bf16>) -> CudaView<'_, u8> {
    // SAFETY: every bit pattern is a valid u8, and the view covers exactly the slice's bytes.
    let bytes = unsafe { m.transmute::<u8>(2 * m.len()) };
    bytes.expect("a slice of len bf16 values holds 2·len bytes")
}

/// The kernels read 16 bytes at a time: activations always, bf16 weight rows too.
const VECTOR_BYTES: u64 = 16;

fn check_aligned<T>(gpu: &GpuContext, param: &'static str, v: &CudaView<'_, T>) -> Result<()> {
    let (ptr, _sync) = v.device_ptr(gpu.stream());
    if ptr.is_multiple_of(VECTOR_BYTES) {
        Ok(())
    } else {
        Err(CudaError::invalid(
            param,
            format!("starts at {ptr:#x}, not on a {VECTOR_BYTES}-byte boundary"),
        ))
    }
}

/// The checks every GEMV launch shares: the shape, `w` holding `rows` rows of `k`, `x` holding
/// `[n, k]`, both aligned for the kernel's vector loads.
fn check_operands(
    gpu: &GpuContext,
    weights: GemvWeights,
    w: &CudaView<'_, u8>,
    rows: usize,
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
) -> Result<()> {
    check_shape(weights, rows, k, n).map_err(|why| CudaError::invalid("shape", why))?;
    let row_bytes = weights.row_bytes(k);
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
    check_aligned(gpu, "x", x)?;
    if weights == GemvWeights::Bf16 {
        check_aligned(gpu, "w", w)?;
    }
    Ok(())
}

fn warps_of(blocks: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (to_u32("rows", blocks)?, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `y[r, col0 + o] = Σ_k x[r, k] · W[o, k]` for `r < n`, `o < rows`; `w` holds `rows` rows of
/// `weights` (`k / block_values` raw blocks each, or `k` bf16 values); `x` is `[n, k]`, `y`
/// `[n, ld]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv<T: Dtype>(
    gpu: &GpuContext,
    weights: GemvWeights,
    w: &CudaView<'_, u8>,
    rows: usize,
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
    y: &mut CudaViewMut<'_, T>,
    out: OutColumns,
) -> Result<()> {
    check_operands(gpu, weights, w, rows, k, x, n)?;
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
    let f = gpu.kernels().gemv(GemvEpilogue::Store, weights).get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(w)
        .arg(x)
        .arg(y)
        .arg(&rows_i)
        .arg(&k_i)
        .arg(&n_i)
        .arg(&ld_i)
        .arg(&col0_i);
    launch(args, warps_of(grid(rows))?)
}

/// The gate and up projections of an MLP, `f` rows of `k` each in `weights`' format.
pub struct GateUp<'a> {
    pub weights: GemvWeights,
    pub gate: CudaView<'a, u8>,
    pub up: CudaView<'a, u8>,
    pub f: usize,
}

/// `out[r, o] = silu(x_r · W_gate[o]) · (x_r · W_up[o])` for `r < n`, `o < f`: the gate_up GEMV
/// (output `T`) followed by `silu_mul`, in one launch. `x` is `[n, k]`, `out` `[n, f]`.
pub fn gemv_silu_mul<T: Dtype>(
    gpu: &GpuContext,
    w: &GateUp<'_>,
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    check_operands(gpu, w.weights, &w.gate, w.f, k, x, n)?;
    check_operands(gpu, w.weights, &w.up, w.f, k, x, n)?;
    check_len("out", out.len(), n * w.f)?;
    let (f_i, k_i, n_i) = (to_i32("f", w.f)?, to_i32("k", k)?, to_i32("n", n)?);
    let func = gpu
        .kernels()
        .gemv(GemvEpilogue::SiluMul, w.weights)
        .get::<T>();
    let mut args = gpu.stream().launch_builder(func);
    args.arg(&w.gate)
        .arg(&w.up)
        .arg(x)
        .arg(out)
        .arg(&f_i)
        .arg(&k_i)
        .arg(&n_i);
    launch(args, warps_of(silu_grid(w.f))?)
}

/// One part of a fused QKV projection: heads `head0 .. head0 + heads` of the q | k | v head list,
/// their `heads · head_dim` weight rows in `weights`' format (a bf16 checkpoint: one part of
/// every head; a packed one: its q, k and v tensors).
pub struct QkvPart<'a> {
    pub weights: GemvWeights,
    pub w: CudaView<'a, u8>,
    pub head0: usize,
    pub heads: usize,
}

/// The step's per-token inputs: `n = positions.len()` tokens.
pub struct QkvTokens<'a> {
    /// `[(num_heads + 2·num_kv_heads) · head_dim]`, or `None` for a model without QKV bias.
    pub bias: Option<CudaView<'a, f32>>,
    /// `[n]`; outside the table leaves q and k unrotated.
    pub positions: CudaView<'a, i32>,
    /// `[n]`; negative = padding (nothing is written to the cache).
    pub slot_mapping: CudaView<'a, i64>,
}

/// The part's rows of `x · W_qkvᵀ`, then `qkv_bias_rope_cache`'s epilogue for them: q heads
/// `rope(q + bias)` into `q_out` (`[n, num_heads · head_dim]`), k heads `rope(k + bias)` and v
/// heads `v + bias` into the cache at the token's slot. Each product is rounded to `T` first,
/// as the unfused GEMV's store rounds it. `x` is `[n, k]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv<T: Dtype>(
    gpu: &GpuContext,
    table: &RopeTable,
    heads: QkvHeads,
    part: &QkvPart<'_>,
    k: usize,
    x: &CudaView<'_, bf16>,
    tokens: &QkvTokens<'_>,
    q_out: &mut CudaViewMut<'_, T>,
    cache: KvCacheMut<'_, T>,
) -> Result<()> {
    let hd = heads.head_dim;
    if hd != table.head_dim() || !hd.is_multiple_of(2) {
        return Err(CudaError::invalid(
            "head_dim",
            format!(
                "{hd}: an even head dim, the RoPE table's {}",
                table.head_dim()
            ),
        ));
    }
    if part.heads == 0 || part.head0 + part.heads > heads.total() {
        return Err(CudaError::invalid(
            "part",
            format!(
                "heads {}..{} of {}",
                part.head0,
                part.head0 + part.heads,
                heads.total()
            ),
        ));
    }
    let n = tokens.positions.len();
    check_operands(gpu, part.weights, &part.w, part.heads * hd, k, x, n)?;
    if let Some(bias) = &tokens.bias {
        check_len("bias", bias.len(), heads.total() * hd)?;
    }
    check_len("slot_mapping", tokens.slot_mapping.len(), n)?;
    check_len("q_out", q_out.len(), n * heads.num_heads * hd)?;
    let KvCacheMut {
        k: mut k_cache,
        v: mut v_cache,
    } = cache;
    let kv_row = heads.num_kv_heads * hd;
    let num_slots = check_multiple("cache.k", k_cache.len(), kv_row)?;
    check_len("cache.v", v_cache.len(), k_cache.len())?;
    let ints = [
        to_i32("head0", part.head0)?,
        to_i32("heads", part.heads)?,
        to_i32("num_heads", heads.num_heads)?,
        to_i32("num_kv_heads", heads.num_kv_heads)?,
        to_i32("head_dim", hd)?,
        to_i32("k", k)?,
        to_i32("n", n)?,
        to_i32("max_positions", table.max_positions())?,
    ];
    let slots = num_slots as i64;
    // The kernel reads no bias when handed a null pointer.
    let no_bias: u64 = 0;
    let f = gpu
        .kernels()
        .gemv(GemvEpilogue::Qkv, part.weights)
        .get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&part.w).arg(x);
    match &tokens.bias {
        Some(bias) => args.arg(bias),
        None => args.arg(&no_bias),
    };
    args.arg(&tokens.positions)
        .arg(&tokens.slot_mapping)
        .arg(table.cos_sin())
        .arg(q_out)
        .arg(&mut k_cache)
        .arg(&mut v_cache);
    for i in &ints {
        args.arg(i);
    }
    args.arg(&slots);
    launch(args, warps_of(qkv_grid(part.heads, hd))?)
}
