//! AutoGPTQ's layout (GPTQModel's `gptq` and `gptq_v2` checkpoint formats), 4 or 8 bits.
//!
//! Tensors of a layer with `in` inputs, `out` outputs, `p = 32 / bits` values per word and
//! `G = ceil(in / group)` groups:
//! * `qweight`: int32 `[in / p, out]`, packed along the input dimension: input channel
//!   `p·r + k` of column `o` is bits `bits·k..` of `qweight[r][o]`;
//! * `qzeros`: int32 `[G, out / p]`, packed along the output dimension the same way;
//! * `scales`: f16 `[G, out]`;
//! * `g_idx`: int32 `[in]`, the group of each input channel: `i / group` without act-order,
//!   a permutation-derived order with it (`desc_act`). Absent in some exports: then `i / group`.
//!
//! Zero points: see [`ZeroConvention`]; in the original format the stored field is `z − 1`.

use candle_core::{DType, Tensor};

use super::{dims2, expect_shape, field, scales, words, IntMatrix};
use crate::error::{ModelError, Result};
use crate::layers::parallel::SharedOut;
use crate::loader::quant_config::Gptq;

/// Unpacks layer `prefix`'s `qweight`, `qzeros`, `scales` and optional `g_idx`.
pub fn unpack(
    prefix: &str,
    cfg: Gptq,
    qweight: &Tensor,
    qzeros: &Tensor,
    scale: &Tensor,
    g_idx: Option<&Tensor>,
) -> Result<IntMatrix> {
    let (qw_name, qz_name, s_name, g_name) = (
        format!("{prefix}.qweight"),
        format!("{prefix}.qzeros"),
        format!("{prefix}.scales"),
        format!("{prefix}.g_idx"),
    );
    let per_word = cfg.bits.per_word();
    let (packed_rows, outputs) = dims2(&qw_name, qweight)?;
    let inputs = packed_rows * per_word;
    if !outputs.is_multiple_of(per_word) {
        return Err(ModelError::InvalidQuantTensor {
            name: qz_name,
            reason: format!("{outputs} output channels do not pack into words of {per_word}"),
        });
    }
    let group = cfg.group.len(inputs).max(1);
    let groups = inputs.div_ceil(group);
    expect_shape(&qz_name, qzeros, [groups, outputs / per_word])?;
    expect_shape(&s_name, scale, [groups, outputs])?;

    let qw = words(&qw_name, qweight)?;
    let mut q = vec![0u8; outputs * inputs];
    // Items own output rows and write each front to back (the words of a row are read with a
    // stride of one packed row).
    let out = SharedOut::new(&mut q);
    candle_core::utils::barrier_pool().execute_chunked(outputs, |rows| {
        for o in rows {
            // SAFETY: row o of `q` belongs to this item alone.
            let row = unsafe { out.range(o * inputs, inputs) };
            for r in 0..packed_rows {
                let word = qw[r * outputs + o];
                for k in 0..per_word {
                    row[per_word * r + k] = field(word, k, cfg.bits) as u8;
                }
            }
        }
    });
    let qz = words(&qz_name, qzeros)?;
    let offset = cfg.zeros.offset();
    let zeros = (0..groups * outputs)
        .map(|at| {
            let (g, o) = (at / outputs, at % outputs);
            let word = qz[g * (outputs / per_word) + o / per_word];
            (field(word, o % per_word, cfg.bits) + offset) as u16
        })
        .collect();
    let group_of = match g_idx {
        Some(t) => group_indices(&g_name, t, inputs)?,
        None => (0..inputs).map(|i| (i / group) as u32).collect(),
    };
    IntMatrix::new(
        prefix,
        (outputs, inputs),
        cfg.bits,
        q,
        group_of,
        zeros,
        scales(&s_name, scale)?,
    )
}

/// `g_idx` as u32s (its range is checked by [`IntMatrix::new`]).
fn group_indices(name: &str, t: &Tensor, inputs: usize) -> Result<Vec<u32>> {
    if t.dims() != [inputs] {
        return Err(ModelError::ShapeMismatch {
            name: name.to_owned(),
            expected: vec![inputs],
            found: t.dims().to_vec(),
        });
    }
    let out_of_range = |g: i64| ModelError::InvalidQuantTensor {
        name: name.to_owned(),
        reason: format!("group index {g} is out of range"),
    };
    match t.dtype() {
        DType::I32 => t
            .to_vec1::<i32>()?
            .into_iter()
            .map(|g| u32::try_from(g).map_err(|_| out_of_range(g.into())))
            .collect(),
        DType::I64 => t
            .to_vec1::<i64>()?
            .into_iter()
            .map(|g| u32::try_from(g).map_err(|_| out_of_range(g)))
            .collect(),
        DType::U32 => Ok(t.to_vec1::<u32>()?),
        other => Err(ModelError::UnsupportedDtype {
            name: name.to_owned(),
            dtype: format!("{other:?} (g_idx must be int32)"),
        }),
    }
}
