//! Launcher of `kernels/dequant.cu`: GGUF blocks to bf16 (or f32), at load time.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, elementwise, launch, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};

pub use crate::quant_type::QuantType;

/// `blocks` (raw GGUF bytes, whole blocks) → `out`, `block_values` values per block.
pub fn dequantize<T: Dtype>(
    gpu: &GpuContext,
    qtype: QuantType,
    blocks: &CudaView<'_, u8>,    // [num_blocks · block_bytes]
    out: &mut CudaViewMut<'_, T>, // [num_blocks · block_values]
) -> Result<()> {
    if !blocks.len().is_multiple_of(qtype.block_bytes()) {
        return Err(CudaError::invalid(
            "blocks",
            format!(
                "{} bytes is not a whole number of {qtype:?} blocks of {} bytes",
                blocks.len(),
                qtype.block_bytes()
            ),
        ));
    }
    let num_blocks = blocks.len() / qtype.block_bytes();
    check_len("out", out.len(), num_blocks * qtype.block_values())?;
    if num_blocks == 0 {
        return Ok(());
    }
    let f = gpu.kernels().dequant[qtype.index()].get::<T>();
    let (n, cfg) = (num_blocks as i64, elementwise(out.len()));
    let mut args = gpu.stream().launch_builder(f);
    args.arg(blocks).arg(out).arg(&n);
    launch(args, cfg)
}
