//! Launcher of `kernels/reshape_and_cache.cu`: the step's K/V rows into the paged pool.
//! (The model's forward uses the fused `qkv::qkv_bias_rope_cache`; this stays for K/V that
//! arrive separately.)

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;

/// Writes row `t` of `k`/`v` to slot `slot_mapping[t]` of the pools; negative slots
/// (graph padding) are skipped. `kv_row = num_kv_heads · head_dim`.
pub fn reshape_and_cache<T: Dtype>(
    gpu: &GpuContext,
    k: &CudaView<'_, T>,              // [num_tokens, kv_row]
    v: &CudaView<'_, T>,              // [num_tokens, kv_row]
    k_cache: &mut CudaViewMut<'_, T>, // [num_blocks · block_size, kv_row]
    v_cache: &mut CudaViewMut<'_, T>, // [num_blocks · block_size, kv_row]
    slot_mapping: &CudaView<'_, i64>, // [num_tokens]
    kv_row: usize,
) -> Result<()> {
    let num_tokens = slot_mapping.len();
    check_len("k", k.len(), num_tokens * kv_row)?;
    check_len("v", v.len(), num_tokens * kv_row)?;
    let num_slots = check_multiple("k_cache", k_cache.len(), kv_row)?;
    check_len("v_cache", v_cache.len(), k_cache.len())?;
    if num_tokens == 0 {
        return Ok(());
    }
    let (row, slots) = (to_i32("kv_row", kv_row)?, num_slots as i64);
    let f = gpu.kernels().reshape_and_cache.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(k)
        .arg(v)
        .arg(k_cache)
        .arg(v_cache)
        .arg(slot_mapping)
        .arg(&row)
        .arg(&slots);
    launch(args, per_row(num_tokens, 128)?)
}
