//! Launchers of `kernels/gemv_quant.cu`: decode products (`y[r, col0 + o] = x_r · W[o]` for up
//! to [`MAX_ROWS`] rows) straight from packed GGUF blocks or bf16 rows ([`gemv`]), and the same
//! products with the layer's next kernel fused into their epilogue: gate/up with SiLU·mul
//! ([`gemv_silu_mul`], `silu_mul.cu`'s arithmetic) and the QKV projection with bias, RoPE and the
//! KV-cache write ([`gemv_qkv`], `qkv.cu`'s). A fused launch equals the GEMV followed by the
//! unfused kernel bit for bit. A matrix comes as [`WeightRun`]s, up to [`MAX_PARTS`] runs of rows
//! in one format each, so one launch covers a fused matrix whose tensors have different packed
//! types; bf16 runs take a kernel family of their own ([`GemvFamily`]).
//! Geometry and arithmetic: the CPU twin, [`crate::gemv_plan`].

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use half::bf16;

use super::kv::KvCacheMut;
use super::rope::RopeTable;
use super::{check_len, check_multiple, launch, to_i32, to_u32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
use crate::gemv_plan::{check_shape, grid, qkv_grid, silu_grid, WARPS};
pub use crate::gemv_plan::{GemvEpilogue, GemvFamily, GemvWeights, QkvHeads, MAX_PARTS, MAX_ROWS};
use crate::quant_type::QuantType;

/// Where the product lands: columns `col0 .. col0 + rows` of `y`'s `[n, ld]` rows (a part of a
/// wider output).
#[derive(Debug, Clone, Copy)]
pub struct OutColumns {
    pub ld: usize,
    pub col0: usize,
}

/// `rows` consecutive rows of a matrix in one format: `k / block_values` raw blocks each, or `k`
/// bf16 values ([`bf16_bytes`]).
pub struct WeightRun<'a> {
    pub weights: GemvWeights,
    pub bytes: CudaView<'a, u8>,
    pub rows: usize,
}

/// Mirror of the kernel's `GemvPart`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PartArg {
    w: u64,
    format: i32,
    end: i32,
}

/// Mirror of the kernel's `GemvParts`, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PartsArg {
    part: [PartArg; MAX_PARTS],
    count: i32,
}
const _: () = assert!(std::mem::size_of::<PartArg>() == 16);
const _: () = assert!(std::mem::size_of::<PartsArg>() == 16 * MAX_PARTS + 8);
// SAFETY: `#[repr(C)]` plain old data with the kernel structs' field order and types (a device
// pointer is 64 bits).
unsafe impl DeviceRepr for PartsArg {}

/// A bf16 matrix's memory as the GEMV takes weight rows: bytes.
pub fn bf16_bytes(m: &CudaSlice<bf16>) -> CudaView<'_, u8> {
    // SAFETY: every bit pattern is a valid u8, and the view covers exactly the slice's bytes.
    let bytes = unsafe { m.transmute::<u8>(2 * m.len()) };
    bytes.expect("a slice of len bf16 values holds 2·len bytes")
}

/// The kernels read 16 bytes at a time: activations always, bf16 weight rows too.
const VECTOR_BYTES: u64 = 16;
/// FP8 blocks are read a 4-byte word at a time (their 132 bytes keep every word aligned).
const WORD_BYTES: u64 = 4;

/// The alignment `weights`' rows need of their first byte (1: read byte by byte).
fn alignment(weights: GemvWeights) -> u64 {
    match weights {
        GemvWeights::Bf16 => VECTOR_BYTES,
        GemvWeights::Packed(QuantType::Fp8) => WORD_BYTES,
        GemvWeights::Packed(_) => 1,
    }
}

fn check_aligned<T>(
    gpu: &GpuContext,
    param: &'static str,
    v: &CudaView<'_, T>,
    bytes: u64,
) -> Result<()> {
    let (ptr, _sync) = v.device_ptr(gpu.stream());
    if ptr.is_multiple_of(bytes) {
        Ok(())
    } else {
        Err(CudaError::invalid(
            param,
            format!("starts at {ptr:#x}, not on a {bytes}-byte boundary"),
        ))
    }
}

/// The kernel's view of `runs` (checked: 1 to [`MAX_PARTS`] runs of one family, each `rows` rows
/// of `k` in its format, aligned for the kernel's loads, and each a shape `fits` the kernel
/// takes), the guards that keep their pointers' stream order until the launch is queued, and
/// what they make.
fn parts_arg<'a>(
    gpu: &'a GpuContext,
    runs: &'a [WeightRun<'_>],
    k: usize,
    fits: impl Fn(GemvWeights, usize) -> std::result::Result<(), String>,
) -> Result<(PartsArg, Vec<SyncOnDrop<'a>>, Launched)> {
    if runs.is_empty() || runs.len() > MAX_PARTS {
        return Err(CudaError::invalid(
            "runs",
            format!("{} runs: a launch takes 1 to {MAX_PARTS}", runs.len()),
        ));
    }
    let family = GemvFamily::of(runs.iter().map(|r| r.weights))
        .map_err(|why| CudaError::invalid("runs", why))?;
    let mut arg = PartsArg {
        count: runs.len() as i32,
        ..PartsArg::default()
    };
    let mut guards = Vec::with_capacity(runs.len());
    let mut end = 0;
    for (slot, run) in arg.part.iter_mut().zip(runs) {
        fits(run.weights, run.rows).map_err(|why| CudaError::invalid("shape", why))?;
        let row_bytes = run.weights.row_bytes(k);
        if run.bytes.len() != run.rows * row_bytes {
            return Err(CudaError::invalid(
                "w",
                format!(
                    "{} bytes for {} rows of {row_bytes}",
                    run.bytes.len(),
                    run.rows
                ),
            ));
        }
        check_aligned(gpu, "w", &run.bytes, alignment(run.weights))?;
        end += run.rows;
        let (ptr, guard) = run.bytes.device_ptr(gpu.stream());
        *slot = PartArg {
            w: ptr,
            format: run.weights.index() as i32,
            end: to_i32("rows", end)?,
        };
        guards.push(guard);
    }
    Ok((arg, guards, Launched { family, rows: end }))
}

/// What a launch's runs make: the kernel family, and the rows they hold together.
struct Launched {
    family: GemvFamily,
    rows: usize,
}

/// `x` holds `[n, k]` and is aligned for the kernel's vector loads.
fn check_x(gpu: &GpuContext, x: &CudaView<'_, bf16>, n: usize, k: usize) -> Result<()> {
    if x.len() < n * k {
        return Err(CudaError::invalid(
            "x",
            format!("{} values for [{n}, {k}]", x.len()),
        ));
    }
    check_aligned(gpu, "x", x, VECTOR_BYTES)
}

/// `y` (`len` values) takes columns `out.col0 .. out.col0 + rows` of `n` rows of `out.ld`.
fn check_out(len: usize, n: usize, rows: usize, out: OutColumns) -> Result<()> {
    if out.col0 + rows > out.ld || len < (n - 1) * out.ld + out.col0 + rows {
        return Err(CudaError::invalid(
            "y",
            format!(
                "{len} values cannot take columns {}..{} of {n} rows of {}",
                out.col0,
                out.col0 + rows,
                out.ld
            ),
        ));
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

/// `y[r, col0 + o] = Σ_k x[r, k] · W[o, k]` for `r < n` and every row `o` of the matrix `w`
/// (its runs in order); `x` is `[n, k]`, `y` `[n, ld]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv<T: Dtype>(
    gpu: &GpuContext,
    w: &[WeightRun<'_>],
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
    y: &mut CudaViewMut<'_, T>,
    out: OutColumns,
) -> Result<()> {
    let (parts, _guards, Launched { family, rows }) =
        parts_arg(gpu, w, k, |weights, rows| check_shape(weights, rows, k, n))?;
    check_x(gpu, x, n, k)?;
    check_out(y.len(), n, rows, out)?;
    let (rows_i, k_i, n_i, ld_i, col0_i) = (
        to_i32("rows", rows)?,
        to_i32("k", k)?,
        to_i32("n", n)?,
        to_i32("ld", out.ld)?,
        to_i32("col0", out.col0)?,
    );
    let f = gpu.kernels().gemv(GemvEpilogue::Store, family).get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&parts)
        .arg(x)
        .arg(y)
        .arg(&rows_i)
        .arg(&k_i)
        .arg(&n_i)
        .arg(&ld_i)
        .arg(&col0_i);
    launch(args, warps_of(grid(rows))?)
}

/// `y[r, col0 + o] = Σ_k x[r, k] · W[o, k]` for `r < m` and every row `o` of the packed matrix `w`
/// (its runs in order) by the tiled tensor-core GEMM (`gemm_packed_*`): for steps of more rows
/// than the GEMV takes, each block decoding its weight tile into shared memory. `x` is `[m, k]`,
/// `y` `[m, ld]`. With `splits > 1` (see [`crate::gemm_tile::splits`]) k is cut into that many
/// ranges whose sums go to `partial` (`[splits, m, rows]`) and a second launch adds them in
/// order; with 1, `partial` is not touched. Equals the expanded matrix's product within f32
/// rounding (`gemm_tile.rs`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_packed<T: Dtype>(
    gpu: &GpuContext,
    w: &[WeightRun<'_>],
    k: usize,
    x: &CudaView<'_, bf16>,
    m: usize,
    y: &mut CudaViewMut<'_, T>,
    out: OutColumns,
    splits: usize,
    partial: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (parts, _guards, Launched { rows, .. }) = parts_arg(gpu, w, k, |weights, rows| {
        crate::gemm_tile::check_shape(weights, rows, k, m)
    })?;
    check_x(gpu, x, m, k)?;
    check_out(y.len(), m, rows, out)?;
    let step = crate::gemm_tile::k_split(k, splits);
    if splits == 0 || splits > crate::gemm_tile::MAX_SPLITS || (splits - 1) * step >= k {
        return Err(CudaError::invalid(
            "splits",
            format!(
                "{splits} ranges of k = {k}: 1 to {} non-empty ones",
                crate::gemm_tile::MAX_SPLITS
            ),
        ));
    }
    if splits > 1 && partial.len() < splits * m * rows {
        return Err(CudaError::invalid(
            "partial",
            format!(
                "{} values cannot hold {splits} ranges of [{m}, {rows}]",
                partial.len()
            ),
        ));
    }
    let (rows_i, k_i, m_i, ld_i, col0_i, step_i, splits_i) = (
        to_i32("rows", rows)?,
        to_i32("k", k)?,
        to_i32("m", m)?,
        to_i32("ld", out.ld)?,
        to_i32("col0", out.col0)?,
        to_i32("k_split", step)?,
        to_i32("splits", splits)?,
    );
    let (gx, gy) = crate::gemm_tile::grid(rows, m);
    let cfg = LaunchConfig {
        grid_dim: (to_u32("rows", gx)?, to_u32("m", gy)?, splits as u32),
        block_dim: (crate::gemm_tile::THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let kernels = gpu.kernels();
    let mut args = gpu.stream().launch_builder(kernels.gemm_packed.get::<T>());
    args.arg(&parts)
        .arg(x)
        .arg(&mut *y)
        .arg(&mut *partial)
        .arg(&rows_i)
        .arg(&k_i)
        .arg(&m_i)
        .arg(&ld_i)
        .arg(&col0_i)
        .arg(&step_i);
    launch(args, cfg)?;
    if splits == 1 {
        return Ok(());
    }
    let mut args = gpu
        .stream()
        .launch_builder(kernels.gemm_packed_reduce.get::<T>());
    let partial = partial.as_view();
    args.arg(&partial)
        .arg(y)
        .arg(&rows_i)
        .arg(&m_i)
        .arg(&splits_i)
        .arg(&ld_i)
        .arg(&col0_i);
    launch(args, super::elementwise(m * rows))
}

/// `out[r, o] = silu(x_r · W[o]) · (x_r · W[f + o])` for `r < n`, `o < f`, over a gate_up matrix
/// `w` of `2f` rows (gate, then up): the GEMV (output `T`) followed by `silu_mul_fused`, in one
/// launch. `x` is `[n, k]`, `out` `[n, f]`.
pub fn gemv_silu_mul<T: Dtype>(
    gpu: &GpuContext,
    w: &[WeightRun<'_>],
    k: usize,
    x: &CudaView<'_, bf16>,
    n: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let (parts, _guards, Launched { family, rows }) =
        parts_arg(gpu, w, k, |weights, rows| check_shape(weights, rows, k, n))?;
    check_x(gpu, x, n, k)?;
    if !rows.is_multiple_of(2) {
        return Err(CudaError::invalid(
            "w",
            format!("{rows} rows: gate and up halves need an even count"),
        ));
    }
    let f = rows / 2;
    check_len("out", out.len(), n * f)?;
    let (f_i, k_i, n_i) = (to_i32("f", f)?, to_i32("k", k)?, to_i32("n", n)?);
    let func = gpu.kernels().gemv(GemvEpilogue::SiluMul, family).get::<T>();
    let mut args = gpu.stream().launch_builder(func);
    args.arg(&parts)
        .arg(x)
        .arg(out)
        .arg(&f_i)
        .arg(&k_i)
        .arg(&n_i);
    launch(args, warps_of(silu_grid(f))?)
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

/// `x · W_qkvᵀ` (the matrix `w`: the q | k | v head list, `head_dim` rows a head), then
/// `qkv_bias_rope_cache`'s epilogue: q heads `rope(q + bias)` into `q_out`
/// (`[n, num_heads · head_dim]`), k heads `rope(k + bias)` and v heads `v + bias` into the cache
/// at the token's slot. Each product is rounded to `T` first, as the unfused GEMV's store rounds
/// it. `x` is `[n, k]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv<T: Dtype>(
    gpu: &GpuContext,
    table: &RopeTable,
    heads: QkvHeads,
    w: &[WeightRun<'_>],
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
    let n = tokens.positions.len();
    let (parts, _guards, Launched { family, rows }) =
        parts_arg(gpu, w, k, |weights, rows| check_shape(weights, rows, k, n))?;
    check_len("w rows", rows, heads.total() * hd)?;
    check_x(gpu, x, n, k)?;
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
    let f = gpu.kernels().gemv(GemvEpilogue::Qkv, family).get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&parts).arg(x);
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
    launch(args, warps_of(qkv_grid(heads))?)
}
