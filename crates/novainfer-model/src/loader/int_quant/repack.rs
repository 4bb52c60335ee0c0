//! An [`IntMatrix`] as a tensor our CPU kernels run, bit-exact in every case.
//!
//! 4-bit layers whose groups are whole runs of 128 input channels (group size 128 or a
//! multiple, or one group per row: every AWQ checkpoint Qwen publishes, and GPTQ without
//! act-order) keep their integers and zero points as they are: [`GroupedInt4`], 4.3 bits per
//! weight, any scale dtype. The rest become GGML blocks where one holds them exactly:
//!
//! A GGML block is 32 consecutive input channels of one output row with one f16 scale `d`
//! and small signed integers `x`, `w = d · x`. When a block's 32 channels share one group
//! (the group size is a multiple of 32 and, under GPTQ act-order, `g_idx` is constant on
//! the block) and the scales are f16, `d = s` and `x = q − z` hold the weights exactly:
//! * 4-bit: `q ∈ [0, 15]`, `z ∈ [0, 16]`, so `q − z ∈ [−16, 15]`, Q5_0's range (stored
//!   `+16` in 5 bits): always exact, 5.5 bits per weight, run by our Q5_0 int8-activation
//!   kernels;
//! * 8-bit: `q − z ∈ [−256, 255]` in general; symmetric GPTQ (`z = 128`) stays in
//!   `[−128, 127]`, Q8_0's i8, 8.5 bits per weight. A layer that leaves that range anywhere
//!   cannot be Q8_0.
//!
//! Anything else (bf16/f32 scales, groups mixed within a block, `in` not a multiple of 32,
//! asymmetric 8-bit) is dequantized to dense f32: exact too (`s · (q − z)` has at most
//! 11 + 9 significant bits), at 32 bits per weight and the dense kernels' speed. For GPTQ
//! act-order that is the price of exactness without permuting activations at run time.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};

use super::{IntMatrix, Scales};
use crate::error::Result;
use crate::int4::{encode_nibbles, GroupedInt4, BLOCK_BYTES as INT4_BLOCK_BYTES, GROUP_K};
use crate::layers::parallel::SharedOut;
use crate::loader::quant_config::Bits;
use crate::loader::RawTensor;

/// Input channels per GGML block.
const QK: usize = 32;

/// What a layer became, and for dense layers why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repacked {
    Int4,
    /// GPTQ act-order: int4 with the columns sorted by group and an input order.
    Int4ActOrder,
    Q5_0,
    Q8_0,
    Dense(DenseReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseReason {
    /// Scales in bf16 or f32: a block's f16 scale cannot hold them.
    WideScales,
    /// `in` is not a multiple of 32.
    UnalignedInputs,
    /// A block of 32 input channels spans several groups (act-order `g_idx`, or a group
    /// size that is not a multiple of 32).
    MixedGroups,
    /// 8-bit weights with some `q − z` outside i8.
    WideRange,
}

/// Re-encodes `m` exactly (see the module doc) and says how.
pub fn repack(m: &IntMatrix) -> Result<(RawTensor, Repacked)> {
    let (plan, order) = plan(m);
    let tensor = match (plan, &m.scales) {
        (Repacked::Int4 | Repacked::Int4ActOrder, _) => RawTensor::Int4(int4(m, order)?),
        (Repacked::Q5_0, Scales::F16(s)) => quantized(m, GgmlDType::Q5_0, q5_0(m, s))?,
        (Repacked::Q8_0, Scales::F16(s)) => quantized(m, GgmlDType::Q8_0, q8_0(m, s))?,
        _ => RawTensor::Dense(Tensor::from_vec(
            m.dequantize(),
            (m.rows, m.cols),
            &Device::Cpu,
        )?),
    };
    Ok((tensor, plan))
}

/// How `m` is held, and for act-order int4 the input order that sorts its columns by group.
fn plan(m: &IntMatrix) -> (Repacked, Option<Vec<u32>>) {
    let one_group_per = |channels: usize| {
        m.cols.is_multiple_of(channels)
            && m.group_of
                .chunks_exact(channels)
                .all(|b| b.iter().all(|&g| g == b[0]))
    };
    if m.bits == Bits::Four {
        if one_group_per(GROUP_K) {
            return (Repacked::Int4, None);
        }
        if let Some(order) = act_order(m) {
            return (Repacked::Int4ActOrder, Some(order));
        }
    }
    let how = if !matches!(m.scales, Scales::F16(_)) {
        Repacked::Dense(DenseReason::WideScales)
    } else if !m.cols.is_multiple_of(QK) {
        Repacked::Dense(DenseReason::UnalignedInputs)
    } else if !one_group_per(QK) {
        Repacked::Dense(DenseReason::MixedGroups)
    } else if m.bits == Bits::Four {
        Repacked::Q5_0
    } else if (0..m.rows).all(|o| (0..m.cols).all(|i| i8::try_from(m.centered(o, i)).is_ok())) {
        Repacked::Q8_0
    } else {
        Repacked::Dense(DenseReason::WideRange)
    };
    (how, None)
}

/// The input channels sorted by group (stable), when every 128-channel run of that order lies in
/// one group: GPTQ act-order with groups of 128 (or a multiple), whose `g_idx` scatters each
/// group's channels over the input.
fn act_order(m: &IntMatrix) -> Option<Vec<u32>> {
    if !m.cols.is_multiple_of(GROUP_K) {
        return None;
    }
    let mut order: Vec<u32> = (0..m.cols as u32).collect();
    order.sort_by_key(|&i| m.group_of[i as usize]);
    let group = |j: usize| m.group_of[order[j] as usize];
    let runs_whole = (0..m.cols)
        .step_by(GROUP_K)
        .all(|start| (start..start + GROUP_K).all(|j| group(j) == group(start)));
    runs_whole.then_some(order)
}

/// `m` as [`GroupedInt4`] blocks, rows in parallel, stored column `j` being input channel
/// `order[j]` (the identity when `None`); the plan checked that each 128-column run lies in
/// one group.
fn int4(m: &IntMatrix, order: Option<Vec<u32>>) -> Result<GroupedInt4> {
    let channel = |j: usize| order.as_ref().map_or(j, |o| o[j] as usize);
    let per_row = m.cols / GROUP_K;
    let mut out = vec![0u8; m.rows * per_row * INT4_BLOCK_BYTES];
    let shared = SharedOut::new(&mut out);
    candle_core::utils::barrier_pool().execute_chunked(m.rows, |rows| {
        for o in rows {
            let len = per_row * INT4_BLOCK_BYTES;
            // SAFETY: row o's blocks belong to this item alone.
            let dst = unsafe { shared.range(o * len, len) };
            let q = &m.q[o * m.cols..(o + 1) * m.cols];
            let mut run = [0u8; GROUP_K];
            for (g, block) in dst.chunks_exact_mut(INT4_BLOCK_BYTES).enumerate() {
                let i = channel(g * GROUP_K);
                block[0..4].copy_from_slice(&m.scale(o, i).to_le_bytes());
                // IntMatrix bounds the zero point by 2^4, GroupedInt4's maximum.
                block[4] = m.zeros[m.group_of[i] as usize * m.rows + o] as u8;
                for (t, v) in run.iter_mut().enumerate() {
                    *v = q[channel(g * GROUP_K + t)];
                }
                block[5..].copy_from_slice(&encode_nibbles(&run));
            }
        }
    });
    let w = GroupedInt4::from_blocks("int4 repack", m.rows, m.cols, out)?;
    match order {
        Some(order) => w.with_input_order("int4 repack", order),
        None => Ok(w),
    }
}

fn quantized(m: &IntMatrix, dtype: GgmlDType, blocks: Vec<u8>) -> Result<RawTensor> {
    let storage = QStorage::from_data(Cow::Owned(blocks), &Device::Cpu, dtype)?;
    Ok(RawTensor::Quantized(QTensor::new(
        storage,
        (m.rows, m.cols),
    )?))
}

/// Writes each row's blocks (`block_bytes` each, in GGML's row-major order) with `encode(d,
/// x)` from the row's (scale, `q − z`) of each 32-channel block, rows in parallel. The caller
/// checked that each block lies in one group.
fn blocks(
    m: &IntMatrix,
    s: &[half::f16],
    block_bytes: usize,
    encode: impl Fn(half::f16, &[i32; QK], &mut [u8]) + Sync,
) -> Vec<u8> {
    let per_row = m.cols / QK;
    let mut out = vec![0u8; m.rows * per_row * block_bytes];
    let shared = SharedOut::new(&mut out);
    candle_core::utils::barrier_pool().execute_chunked(m.rows, |rows| {
        for o in rows {
            // SAFETY: row o's blocks belong to this item alone.
            let dst = unsafe { shared.range(o * per_row * block_bytes, per_row * block_bytes) };
            let q = &m.q[o * m.cols..(o + 1) * m.cols];
            for (b, block) in dst.chunks_exact_mut(block_bytes).enumerate() {
                let g = m.group_of[b * QK] as usize * m.rows + o;
                let z = i32::from(m.zeros[g]);
                let x: [i32; QK] = std::array::from_fn(|j| i32::from(q[b * QK + j]) - z);
                encode(s[g], &x, block);
            }
        }
    });
    out
}

/// ggml's `block_q5_0`: `d: f16`, `qh: u32` (bit j = bit 4 of value j), `qs: [u8; 16]`
/// (value j in the low nibble of byte j, value j + 16 in its high nibble); stored `x + 16`.
fn q5_0(m: &IntMatrix, s: &[half::f16]) -> Vec<u8> {
    blocks(m, s, 22, |d, x, out| {
        // x ∈ [−16, 15] for 4-bit weights (IntMatrix bounds q < 16 and z ≤ 16).
        let v: [u8; QK] = std::array::from_fn(|j| (x[j] + 16) as u8);
        let qh = (0..QK).fold(0u32, |acc, j| acc | (u32::from(v[j] >> 4) << j));
        out[0..2].copy_from_slice(&d.to_le_bytes());
        out[2..6].copy_from_slice(&qh.to_le_bytes());
        for j in 0..QK / 2 {
            out[6 + j] = (v[j] & 0x0F) | ((v[j + QK / 2] & 0x0F) << 4);
        }
    })
}

/// ggml's `block_q8_0`: `d: f16`, `qs: [i8; 32]`.
fn q8_0(m: &IntMatrix, s: &[half::f16]) -> Vec<u8> {
    blocks(m, s, 34, |d, x, out| {
        out[0..2].copy_from_slice(&d.to_le_bytes());
        // The plan checked every x fits an i8.
        for (o, &v) in out[2..].iter_mut().zip(x) {
            *o = v as i8 as u8;
        }
    })
}
