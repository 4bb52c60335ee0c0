//! Launcher of `kernels/reshape_and_cache.cu`: the step's K/V rows into the paged pool.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{check_len, check_multiple, entry, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;
use crate::kernels::RESHAPE_AND_CACHE;

/// Writes row `t` of `k`/`v` to slot `slot_mapping[t]` of the pools; negative slots
/// (graph padding) are skipped. `kv_row = num_kv_heads · head_dim`.
pub fn reshape_and_cache<T: Dtype>(
    gpu: &GpuContext,
    k: &CudaSlice<T>,              // [num_tokens, kv_row]
    v: &CudaSlice<T>,              // [num_tokens, kv_row]
    k_cache: &mut CudaSlice<T>,    // [num_blocks · block_size, kv_row]
    v_cache: &mut CudaSlice<T>,    // [num_blocks · block_size, kv_row]
    slot_mapping: &CudaSlice<i64>, // [num_tokens]
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
    let f = gpu.function(&RESHAPE_AND_CACHE, &entry::<T>("reshape_and_cache"))?;
    let mut args = gpu.stream().launch_builder(&f);
    args.arg(k)
        .arg(v)
        .arg(k_cache)
        .arg(v_cache)
        .arg(slot_mapping)
        .arg(&row)
        .arg(&slots);
    launch(args, per_row(num_tokens, 128)?)
}
