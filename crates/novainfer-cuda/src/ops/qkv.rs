//! Launcher of `kernels/qkv.cu`: bias, RoPE and the KV-cache write after the fused QKV GEMM.
//!
//! Equal, in f32, to the CPU's `Linear` bias add, then `Rope::apply` on q and k, then the
//! cache write (whole rows: the GPU pool does not tile keys as the CPU's does). The rotation
//! is `rope_rotate`, shared with `rope.cu`, and the table is `RopeTable`'s. In bf16 each
//! value is rounded once, when stored.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::kv::KvCacheMut;
use super::rope::{RopeHeads, RopeTable};
use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};

/// What the step feeds the kernel; `T = num_tokens = positions.len()`.
pub struct QkvInput<'a, T> {
    /// `[T, (num_heads + 2·num_kv_heads) · head_dim]`: q heads, then k heads, then v heads.
    pub qkv: CudaView<'a, T>,
    /// `[(num_heads + 2·num_kv_heads) · head_dim]`, or `None` for a model without QKV bias.
    pub bias: Option<CudaView<'a, f32>>,
    /// `[T]`, each below `table.max_positions()` (the runner checks on the host).
    pub positions: CudaView<'a, i32>,
    /// `[T]`; negative = padding (nothing is written to the cache).
    pub slot_mapping: CudaView<'a, i64>,
}

/// `q_out = rope(q + bias_q)`; `k_cache[slot] = rope(k + bias_k)`; `v_cache[slot] = v + bias_v`.
/// `cache` is one layer's pool, `[num_blocks · block_size, num_kv_heads · head_dim]` each.
pub fn qkv_bias_rope_cache<T: Dtype>(
    gpu: &GpuContext,
    table: &RopeTable,
    heads: RopeHeads,
    input: QkvInput<'_, T>,
    q_out: &mut CudaViewMut<'_, T>, // [T, num_heads · head_dim]
    cache: KvCacheMut<'_, T>,
) -> Result<()> {
    let hd = table.head_dim();
    let num_tokens = input.positions.len();
    let (q_len, kv_len) = (heads.num_heads * hd, heads.num_kv_heads * hd);
    let row = q_len + 2 * kv_len;
    check_len("qkv", input.qkv.len(), num_tokens * row)?;
    if let Some(bias) = &input.bias {
        check_len("bias", bias.len(), row)?;
    }
    check_len("slot_mapping", input.slot_mapping.len(), num_tokens)?;
    check_len("q_out", q_out.len(), num_tokens * q_len)?;
    let KvCacheMut {
        k: mut k_cache,
        v: mut v_cache,
    } = cache;
    if kv_len == 0 {
        return Err(CudaError::invalid("heads", "num_kv_heads must be > 0"));
    }
    let num_slots = check_multiple("cache.k", k_cache.len(), kv_len)?;
    check_len("cache.v", v_cache.len(), k_cache.len())?;
    if num_tokens == 0 {
        return Ok(());
    }
    let (nh, nkv, hd_i, max_pos, slots) = (
        to_i32("num_heads", heads.num_heads)?,
        to_i32("num_kv_heads", heads.num_kv_heads)?,
        to_i32("head_dim", hd)?,
        to_i32("max_positions", table.max_positions())?,
        num_slots as i64,
    );
    to_i32("qkv row", row)?;
    // The kernel reads no bias when handed a null pointer.
    let no_bias: u64 = 0;
    let f = gpu.kernels().qkv.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&input.qkv);
    match &input.bias {
        Some(bias) => args.arg(bias),
        None => args.arg(&no_bias),
    };
    args.arg(&input.positions)
        .arg(&input.slot_mapping)
        .arg(table.cos_sin())
        .arg(q_out)
        .arg(&mut k_cache)
        .arg(&mut v_cache)
        .arg(&nh)
        .arg(&nkv)
        .arg(&hd_i)
        .arg(&max_pos)
        .arg(&slots);
    launch(args, per_row(num_tokens, 128)?)
}
