//! AutoAWQ's GEMM layout (`WQLinear_GEMM`, `version: gemm`), 4-bit.
//!
//! Tensors of a layer with `in` inputs, `out` outputs and `G = in / group` groups:
//! * `qweight`: int32 `[in, out / 8]`, the transposed weight (input-major);
//! * `qzeros`: int32 `[G, out / 8]`;
//! * `scales`: f16 `[G, out]`.
//!
//! Eight 4-bit values share a word, but not in column order: AutoAWQ's packer puts output
//! column `8c + ORDER[k]` into bits `4k..4k + 4` of word `c` (an interleave its CUDA kernel
//! undoes with one shift pattern), for `qweight` and `qzeros` alike. Groups are contiguous
//! runs of `group` input channels; AutoAWQ requires `in` to be a multiple of the group.

use candle_core::Tensor;

use super::{dims2, expect_shape, field, scales, words, IntMatrix};
use crate::error::{ModelError, Result};
use crate::layers::parallel::SharedOut;
use crate::loader::quant_config::{Awq, Bits};

/// Output column (within a word's 8) held by nibble `k`.
const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
const PER_WORD: usize = 8;

/// Unpacks layer `prefix`'s `qweight`, `qzeros` and `scales`.
pub fn unpack(
    prefix: &str,
    cfg: Awq,
    qweight: &Tensor,
    qzeros: &Tensor,
    scale: &Tensor,
) -> Result<IntMatrix> {
    let (qw_name, qz_name, s_name) = (
        format!("{prefix}.qweight"),
        format!("{prefix}.qzeros"),
        format!("{prefix}.scales"),
    );
    let (inputs, words_per_row) = dims2(&qw_name, qweight)?;
    let outputs = words_per_row * PER_WORD;
    let group = cfg.group.len(inputs);
    if group == 0 || !inputs.is_multiple_of(group) {
        return Err(ModelError::InvalidQuantTensor {
            name: qw_name,
            reason: format!("{inputs} input channels are not a whole number of groups of {group}"),
        });
    }
    let groups = inputs / group;
    expect_shape(&qz_name, qzeros, [groups, words_per_row])?;
    expect_shape(&s_name, scale, [groups, outputs])?;

    let qw = words(&qw_name, qweight)?;
    let mut q = vec![0u8; outputs * inputs];
    // Word column c fills output rows 8c..8c + 8, one value of each per input: items own whole
    // rows, and each writes its rows front to back (the input-major words are read with a
    // stride, which the next column's pass finds still in cache).
    let out = SharedOut::new(&mut q);
    candle_core::utils::barrier_pool().execute_chunked(words_per_row, |cols| {
        for c in cols {
            // SAFETY: rows 8c..8c + 8 of `q` belong to word column c alone.
            let rows = unsafe { out.range(PER_WORD * c * inputs, PER_WORD * inputs) };
            for i in 0..inputs {
                let word = qw[i * words_per_row + c];
                for (k, &col) in ORDER.iter().enumerate() {
                    rows[col * inputs + i] = field(word, k, Bits::Four) as u8;
                }
            }
        }
    });
    let qz = words(&qz_name, qzeros)?;
    let mut zeros = vec![0u16; groups * outputs];
    for g in 0..groups {
        for c in 0..words_per_row {
            let word = qz[g * words_per_row + c];
            for (k, &col) in ORDER.iter().enumerate() {
                zeros[g * outputs + PER_WORD * c + col] = field(word, k, Bits::Four) as u16;
            }
        }
    }
    let group_of = (0..inputs).map(|i| (i / group) as u32).collect();
    IntMatrix::new(
        prefix,
        (outputs, inputs),
        Bits::Four,
        q,
        group_of,
        zeros,
        scales(&s_name, scale)?,
    )
}
