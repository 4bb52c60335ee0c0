//! Launcher of `kernels/dequant.cu`: GGUF blocks to bf16 (or f32), at load time.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, elementwise, launch, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};

/// The GGUF quant types of the demo models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4K,
    Q5_0,
    Q6K,
    Q8_0,
}

impl QuantType {
    /// In the order of the context's dequant table ([`Self::index`]).
    pub const ALL: [QuantType; 4] = [
        QuantType::Q4K,
        QuantType::Q5_0,
        QuantType::Q6K,
        QuantType::Q8_0,
    ];

    pub(crate) fn index(self) -> usize {
        match self {
            QuantType::Q4K => 0,
            QuantType::Q5_0 => 1,
            QuantType::Q6K => 2,
            QuantType::Q8_0 => 3,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4K => 144,
            QuantType::Q5_0 => 22,
            QuantType::Q6K => 210,
            QuantType::Q8_0 => 34,
        }
    }

    pub fn block_values(self) -> usize {
        match self {
            QuantType::Q4K | QuantType::Q6K => 256,
            QuantType::Q5_0 | QuantType::Q8_0 => 32,
        }
    }

    pub(crate) fn kernel_base(self) -> &'static str {
        match self {
            QuantType::Q4K => "dequant_q4_k",
            QuantType::Q5_0 => "dequant_q5_0",
            QuantType::Q6K => "dequant_q6_k",
            QuantType::Q8_0 => "dequant_q8_0",
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_each_type_at_its_table_index() {
        for (i, q) in QuantType::ALL.iter().enumerate() {
            assert_eq!(q.index(), i, "{q:?}");
        }
    }
}
