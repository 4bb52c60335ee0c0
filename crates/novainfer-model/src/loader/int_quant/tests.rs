//! Unpacking and repacking against the formats as documented, not against our reader:
//! each test draws a layer's integers, packs them the way AutoAWQ's `WQLinear_GEMM` and
//! AutoGPTQ's `QuantLinear.pack` describe, and expects every weight, after unpacking and
//! repacking, to equal `s · (q − z)` computed from the drawn integers, bit for bit.

use std::num::NonZeroUsize;

use candle_core::{Device, Tensor};
use half::{bf16, f16};

use super::repack::DenseReason;
use super::{repack, unpack_awq, unpack_gptq, Repacked};
use crate::error::ModelError;
use crate::loader::quant_config::{Awq, Bits, Gptq, GroupSize, ZeroConvention};
use crate::loader::RawTensor;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        // xorshift64*: plenty for test data, and no dependency on rand's API.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % u64::from(n)) as u32
    }
}

/// A layer as a quantizer leaves it, before packing.
struct Layer {
    out: usize,
    inp: usize,
    bits: u32,
    /// `[out][in]`, in `[0, 2^bits)`.
    q: Vec<u32>,
    /// `[groups][out]`: the zero point the weights mean (not the stored field).
    z: Vec<u32>,
    /// `[groups][out]`.
    s: Vec<f16>,
    /// `[in]`.
    g_idx: Vec<u32>,
}

#[derive(Clone, Copy)]
enum Zeros {
    /// `2^(bits−1)` everywhere (GPTQ `sym=True`).
    Symmetric,
    /// Any value in `[lo, lo + 2^bits)`.
    From(u32),
}

impl Layer {
    fn random(
        seed: u64,
        (out, inp): (usize, usize),
        bits: u32,
        group: usize,
        zeros: Zeros,
    ) -> Self {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let levels = 1u32 << bits;
        let groups = inp.div_ceil(group);
        let q = (0..out * inp).map(|_| rng.below(levels)).collect();
        let z = (0..groups * out)
            .map(|_| match zeros {
                Zeros::Symmetric => levels / 2,
                Zeros::From(lo) => lo + rng.below(levels),
            })
            .collect();
        let s = (0..groups * out)
            .map(|_| f16::from_f32((1 + rng.below(1000)) as f32 * 1e-4))
            .collect();
        let g_idx = (0..inp).map(|i| (i / group) as u32).collect();
        Self {
            out,
            inp,
            bits,
            q,
            z,
            s,
            g_idx,
        }
    }

    /// GPTQ act-order: channels are quantized in a permuted order, group `k` holding the
    /// `k`-th run of `group` channels of that order.
    fn act_order(mut self, seed: u64, group: usize) -> Self {
        let mut rng = Rng(seed | 1);
        let mut perm: Vec<usize> = (0..self.inp).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i as u32 + 1) as usize);
        }
        for (rank, &channel) in perm.iter().enumerate() {
            self.g_idx[channel] = (rank / group) as u32;
        }
        self
    }

    /// The documented dequantization, `w[o][i] = s[g][o] · (q[o][i] − z[g][o])`, `g = g_idx[i]`.
    fn expected(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.inp);
        for o in 0..self.out {
            for i in 0..self.inp {
                let g = self.g_idx[i] as usize;
                let x = self.q[o * self.inp + i] as i32 - self.z[g * self.out + o] as i32;
                w.push(self.s[g * self.out + o].to_f32() * x as f32);
            }
        }
        w
    }

    fn groups(&self) -> usize {
        self.s.len() / self.out
    }

    fn scales(&self) -> Tensor {
        Tensor::from_vec(self.s.clone(), (self.groups(), self.out), &Device::Cpu).expect("scales")
    }

    /// AutoAWQ: `qweight[i][c]` bits `4k..` hold column `8c + ORDER[k]`; qzeros likewise.
    fn awq_tensors(&self) -> (Tensor, Tensor) {
        const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
        let words = self.out / 8;
        let mut qweight = vec![0u32; self.inp * words];
        for i in 0..self.inp {
            for c in 0..words {
                for (k, col) in ORDER.iter().enumerate() {
                    qweight[i * words + c] |= self.q[(8 * c + col) * self.inp + i] << (4 * k);
                }
            }
        }
        let mut qzeros = vec![0u32; self.groups() * words];
        for g in 0..self.groups() {
            for c in 0..words {
                for (k, col) in ORDER.iter().enumerate() {
                    qzeros[g * words + c] |= self.z[g * self.out + 8 * c + col] << (4 * k);
                }
            }
        }
        (
            int32(qweight, (self.inp, words)),
            int32(qzeros, (self.groups(), words)),
        )
    }

    /// AutoGPTQ: `qweight[r][o]` bits `bits·k..` hold input `p·r + k`; `qzeros[g][c]` bits
    /// `bits·k..` hold output `p·c + k`, stored minus `offset` (1 in the original format).
    fn gptq_tensors(&self, offset: u32) -> (Tensor, Tensor, Tensor) {
        let p = 32 / self.bits as usize;
        let mask = (1u32 << self.bits) - 1;
        let mut qweight = vec![0u32; self.inp / p * self.out];
        for r in 0..self.inp / p {
            for o in 0..self.out {
                for k in 0..p {
                    qweight[r * self.out + o] |=
                        self.q[o * self.inp + p * r + k] << (self.bits as usize * k);
                }
            }
        }
        let words = self.out / p;
        let mut qzeros = vec![0u32; self.groups() * words];
        for g in 0..self.groups() {
            for c in 0..words {
                for k in 0..p {
                    let stored = (self.z[g * self.out + p * c + k] - offset) & mask;
                    qzeros[g * words + c] |= stored << (self.bits as usize * k);
                }
            }
        }
        let g_idx: Vec<i32> = self.g_idx.iter().map(|&g| g as i32).collect();
        (
            int32(qweight, (self.inp / p, self.out)),
            int32(qzeros, (self.groups(), words)),
            Tensor::from_vec(g_idx, self.inp, &Device::Cpu).expect("g_idx"),
        )
    }
}

fn int32(words: Vec<u32>, shape: (usize, usize)) -> Tensor {
    let words: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
    Tensor::from_vec(words, shape, &Device::Cpu).expect("int32 tensor")
}

fn group(n: usize) -> GroupSize {
    GroupSize::Channels(NonZeroUsize::new(n).expect("non-zero"))
}

fn values(raw: &RawTensor) -> Vec<f32> {
    raw.to_f32_vec().expect("values")
}

fn assert_bits_equal(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let first_bad = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(
        first_bad.is_none(),
        "{what}: weight {first_bad:?} differs: {:?} vs {:?}",
        first_bad.map(|i| got[i]),
        first_bad.map(|i| want[i])
    );
}

fn check_awq(layer: &Layer, cfg: Awq, how: Repacked) {
    let (qweight, qzeros) = layer.awq_tensors();
    let m = unpack_awq("l", cfg, &qweight, &qzeros, &layer.scales()).expect("unpack");
    assert_eq!(m.shape(), (layer.out, layer.inp));
    assert_bits_equal(&m.dequantize(), &layer.expected(), "dequantized");
    let (raw, got) = repack(&m).expect("repack");
    assert_eq!(got, how);
    assert_bits_equal(&values(&raw), &layer.expected(), "repacked");
}

fn check_gptq(layer: &Layer, cfg: Gptq, how: Repacked) {
    let (qweight, qzeros, g_idx) = layer.gptq_tensors(cfg.zeros.offset());
    let m =
        unpack_gptq("l", cfg, &qweight, &qzeros, &layer.scales(), Some(&g_idx)).expect("unpack");
    assert_eq!(m.shape(), (layer.out, layer.inp));
    assert_bits_equal(&m.dequantize(), &layer.expected(), "dequantized");
    let (raw, got) = repack(&m).expect("repack");
    assert_eq!(got, how);
    assert_bits_equal(&values(&raw), &layer.expected(), "repacked");
}

fn gptq(bits: Bits, group: GroupSize, zeros: ZeroConvention) -> Gptq {
    Gptq {
        bits,
        group,
        zeros,
        desc_act: false,
    }
}

#[test]
fn awq_gemm_layers_repack_exactly() {
    // Groups of 128 (or multiples, or one per row) keep their integers; smaller ones become
    // Q5_0 blocks.
    for (seed, g, how) in [
        (1, 32, Repacked::Q5_0),
        (2, 64, Repacked::Q5_0),
        (3, 128, Repacked::Int4),
        (5, 256, Repacked::Int4),
    ] {
        let layer = Layer::random(seed, (48, 512), 4, g, Zeros::From(0));
        check_awq(&layer, Awq { group: group(g) }, how);
    }
    let per_channel = Layer::random(4, (16, 384), 4, 384, Zeros::From(0));
    check_awq(
        &per_channel,
        Awq {
            group: GroupSize::PerChannel,
        },
        Repacked::Int4,
    );
}

#[test]
fn gptq_4_bit_layers_repack_exactly() {
    use ZeroConvention::{Exact, MinusOne};
    // Original format: z = stored + 1 reaches 16, so q − z reaches −16, Q5_0's lowest value
    // (and GroupedInt4's largest zero point).
    let cases = [
        (32, Zeros::Symmetric, MinusOne, Repacked::Q5_0),
        (64, Zeros::From(1), MinusOne, Repacked::Q5_0),
        (128, Zeros::From(0), Exact, Repacked::Int4),
        (128, Zeros::From(1), MinusOne, Repacked::Int4),
        (128, Zeros::Symmetric, MinusOne, Repacked::Int4),
    ];
    for (seed, (g, zeros, conv, how)) in cases.into_iter().enumerate() {
        let layer = Layer::random(seed as u64, (32, 256), 4, g, zeros);
        check_gptq(&layer, gptq(Bits::Four, group(g), conv), how);
    }
    let per_channel = Layer::random(7, (32, 96), 4, 96, Zeros::From(1));
    check_gptq(
        &per_channel,
        gptq(Bits::Four, GroupSize::PerChannel, MinusOne),
        Repacked::Q5_0,
    );
    // A group of 128 on 96 inputs: one group (AutoGPTQ sizes scales ceil(in / group)).
    let short = Layer::random(8, (16, 96), 4, 128, Zeros::From(0));
    check_gptq(&short, gptq(Bits::Four, group(128), Exact), Repacked::Q5_0);
}

#[test]
fn gptq_8_bit_symmetric_repacks_into_q8_0_and_asymmetric_dequantizes() {
    let mut sym = Layer::random(11, (32, 128), 8, 64, Zeros::Symmetric);
    // The extremes: q − z = −128 and 127.
    sym.q[0] = 0;
    sym.q[1] = 255;
    check_gptq(
        &sym,
        gptq(Bits::Eight, group(64), ZeroConvention::MinusOne),
        Repacked::Q8_0,
    );
    let mut asym = Layer::random(12, (32, 128), 8, 32, Zeros::From(0));
    asym.q[0] = 255;
    asym.z[0] = 0;
    check_gptq(
        &asym,
        gptq(Bits::Eight, group(32), ZeroConvention::Exact),
        Repacked::Dense(DenseReason::WideRange),
    );
}

#[test]
fn act_order_groups_mixing_within_a_block_dequantize_exactly() {
    let g = 32;
    let layer = Layer::random(21, (32, 256), 4, g, Zeros::From(1)).act_order(5, g);
    let cfg = Gptq {
        desc_act: true,
        ..gptq(Bits::Four, group(g), ZeroConvention::MinusOne)
    };
    check_gptq(&layer, cfg, Repacked::Dense(DenseReason::MixedGroups));
    // Groups of 128 (or more): the columns sorted by group, the input permuted to match.
    for g in [128, 256] {
        let layer = Layer::random(23, (32, 512), 4, g, Zeros::From(1)).act_order(6, g);
        let cfg = Gptq {
            desc_act: true,
            ..gptq(Bits::Four, group(g), ZeroConvention::MinusOne)
        };
        check_gptq(&layer, cfg, Repacked::Int4ActOrder);
    }
    // Act-order with static groups: g_idx is contiguous again, and so is the repacking.
    let layer = Layer::random(22, (32, 256), 4, g, Zeros::From(1));
    check_gptq(&layer, cfg, Repacked::Q5_0);
}

#[test]
fn layers_no_block_can_hold_dequantize_exactly() {
    // A group of 16 splits every block.
    let small = Layer::random(31, (16, 128), 4, 16, Zeros::From(0));
    check_gptq(
        &small,
        gptq(Bits::Four, group(16), ZeroConvention::Exact),
        Repacked::Dense(DenseReason::MixedGroups),
    );
    // 40 inputs are not whole blocks.
    let ragged = Layer::random(32, (16, 40), 4, 40, Zeros::From(0));
    check_gptq(
        &ragged,
        gptq(Bits::Four, group(40), ZeroConvention::Exact),
        Repacked::Dense(DenseReason::UnalignedInputs),
    );
    // bf16 scales: an f16 block scale cannot hold them.
    let layer = Layer::random(33, (16, 64), 4, 32, Zeros::From(0));
    let (qweight, qzeros) = layer.awq_tensors();
    let wide: Vec<bf16> = layer.s.iter().map(|s| bf16::from_f32(s.to_f32())).collect();
    let scales =
        Tensor::from_vec(wide.clone(), (layer.groups(), layer.out), &Device::Cpu).expect("scales");
    let m = unpack_awq("l", Awq { group: group(32) }, &qweight, &qzeros, &scales).expect("m");
    let (raw, how) = repack(&m).expect("repack");
    assert_eq!(how, Repacked::Dense(DenseReason::WideScales));
    let want: Vec<f32> = (0..layer.out * layer.inp)
        .map(|at| {
            let (o, i) = (at / layer.inp, at % layer.inp);
            let g = i / 32;
            let x = layer.q[at] as i32 - layer.z[g * layer.out + o] as i32;
            wide[g * layer.out + o].to_f32() * x as f32
        })
        .collect();
    assert_bits_equal(&values(&raw), &want, "bf16 scales");
}

#[test]
fn gptq_without_g_idx_uses_contiguous_groups() {
    let layer = Layer::random(41, (16, 128), 4, 64, Zeros::From(1));
    let cfg = gptq(Bits::Four, group(64), ZeroConvention::MinusOne);
    let (qweight, qzeros, _) = layer.gptq_tensors(1);
    let m = unpack_gptq("l", cfg, &qweight, &qzeros, &layer.scales(), None).expect("unpack");
    assert_bits_equal(&m.dequantize(), &layer.expected(), "no g_idx");
}

#[test]
fn malformed_layers_are_errors_naming_the_tensor() {
    let layer = Layer::random(51, (16, 128), 4, 64, Zeros::From(0));
    let awq = Awq { group: group(64) };
    let (qweight, qzeros) = layer.awq_tensors();
    let message = |e: ModelError| e.to_string();

    let short_zeros = qzeros.narrow(0, 0, 1).expect("narrow");
    let e = unpack_awq("l", awq, &qweight, &short_zeros, &layer.scales()).expect_err("zeros");
    assert!(message(e).contains("l.qzeros"));
    let flat = layer.scales().flatten_all().expect("flat");
    let e = unpack_awq("l", awq, &qweight, &qzeros, &flat).expect_err("1-D scales");
    assert!(message(e).contains("l.scales"));
    let e = unpack_awq(
        "l",
        Awq { group: group(48) },
        &qweight,
        &qzeros,
        &layer.scales(),
    )
    .expect_err("group");
    assert!(message(e).contains("group"));
    let floats = qweight.to_dtype(candle_core::DType::F32).expect("f32");
    let e = unpack_awq("l", awq, &floats, &qzeros, &layer.scales()).expect_err("dtype");
    assert!(message(e).contains("l.qweight"));

    let cfg = gptq(Bits::Four, group(64), ZeroConvention::Exact);
    let (qweight, qzeros, _) = layer.gptq_tensors(0);
    let bad_idx = Tensor::from_vec(vec![7i32; 128], 128, &Device::Cpu).expect("g_idx");
    let e = unpack_gptq("l", cfg, &qweight, &qzeros, &layer.scales(), Some(&bad_idx))
        .expect_err("g_idx range");
    assert!(message(e).contains("group 7"));
    let negative = Tensor::from_vec(vec![-1i32; 128], 128, &Device::Cpu).expect("g_idx");
    let e = unpack_gptq(
        "l",
        cfg,
        &qweight,
        &qzeros,
        &layer.scales(),
        Some(&negative),
    )
    .expect_err("negative g_idx");
    assert!(message(e).contains("l.g_idx"));
    let short_idx = Tensor::from_vec(vec![0i32; 64], 64, &Device::Cpu).expect("g_idx");
    let e = unpack_gptq(
        "l",
        cfg,
        &qweight,
        &qzeros,
        &layer.scales(),
        Some(&short_idx),
    )
    .expect_err("g_idx length");
    assert!(message(e).contains("l.g_idx"));
    // 8-bit reading of 4-bit tensors: the zero and scale shapes no longer agree.
    let eight = gptq(Bits::Eight, group(64), ZeroConvention::Exact);
    assert!(unpack_gptq("l", eight, &qweight, &qzeros, &layer.scales(), None).is_err());
}

#[test]
fn int4_layers_keep_wide_scales_exactly() {
    // bf16 and f32 scales have no f16 block scale, but GroupedInt4 holds them in f32.
    let layer = Layer::random(61, (16, 256), 4, 128, Zeros::From(0));
    let (qweight, qzeros) = layer.awq_tensors();
    let wide: Vec<bf16> = layer
        .s
        .iter()
        .map(|s| bf16::from_f32(s.to_f32() * 3.7))
        .collect();
    let scales =
        Tensor::from_vec(wide.clone(), (layer.groups(), layer.out), &Device::Cpu).expect("scales");
    let m = unpack_awq("l", Awq { group: group(128) }, &qweight, &qzeros, &scales).expect("m");
    let (raw, how) = repack(&m).expect("repack");
    assert_eq!(how, Repacked::Int4);
    assert!(matches!(raw, RawTensor::Int4(_)));
    assert_bits_equal(&values(&raw), &m.dequantize(), "bf16 scales");
}
