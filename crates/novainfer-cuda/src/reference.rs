//! CPU twins of the device-side algorithms that have no CPU counterpart in
//! `novainfer-model`: the Philox4x32-10 generator and the sampling kernel's semantics.
//! The parity tests compare the GPU against these; norms, RoPE, SwiGLU, attention and
//! dequantization are compared against `novainfer-model` and candle themselves.

use crate::sample_params::{DrawMode, RowEdit, RowPenalties, SampleParams};

/// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as
/// 1, 2, 3", SC'11), the same rounds as `philox4x32_10` in `kernels/sampling.cu`.
pub fn philox4x32_10(mut ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(0x9E37_79B9);
            k1 = k1.wrapping_add(0xBB67_AE85);
        }
        let p0 = M0 * u64::from(ctr[0]);
        let p1 = M1 * u64::from(ctr[2]);
        ctr = [
            (p1 >> 32) as u32 ^ ctr[1] ^ k0,
            p1 as u32,
            (p0 >> 32) as u32 ^ ctr[3] ^ k1,
            p0 as u32,
        ];
    }
    ctr
}

/// The uniform in `[0, 1)` the kernel draws for `(seed, offset)`: 24 bits of word 0.
pub fn philox_uniform(seed: u64, offset: u64) -> f32 {
    let out = philox4x32_10(
        [offset as u32, (offset >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (out[0] >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// What the sampling kernel should do with one row: the surviving ids (ascending) and the
/// drawn token. Sums are in f64 here, so a GPU row may differ only where a boundary is
/// within f32 rounding of a survivor's cumulative mass.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutcome {
    pub survivors: Vec<u32>,
    pub token: u32,
}

pub fn sample(logits: &[f32], p: &SampleParams) -> SampleOutcome {
    let x: Vec<f32> = logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f32::NEG_INFINITY
            } else if v == f32::INFINITY {
                f32::MAX
            } else {
                v
            }
        })
        .collect();
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return SampleOutcome {
            survivors: Vec::new(),
            token: 0,
        };
    }
    let d: Vec<f32> = x.iter().map(|&v| (v - max) * p.inv_temperature).collect();
    // Rank: d descending (|d| ascending), then id ascending.
    let mut ranked: Vec<u32> = (0..x.len() as u32).collect();
    ranked.sort_by(|&a, &b| {
        let (ka, kb) = (d[a as usize].abs().to_bits(), d[b as usize].abs().to_bits());
        ka.cmp(&kb).then(a.cmp(&b))
    });
    if p.top_k > 0 && (p.top_k as usize) < x.len() {
        ranked.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let w = |id: u32| f64::from(d[id as usize]).exp();
        let total: f64 = ranked.iter().map(|&i| w(i)).sum();
        let target = f64::from(p.top_p) * total;
        let mut cum = 0.0;
        let keep = ranked
            .iter()
            .position(|&i| {
                cum += w(i);
                cum >= target
            })
            .map_or(ranked.len(), |pos| pos + 1);
        ranked.truncate(keep);
    }
    let log_min_p = if p.min_p > 0.0 {
        p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    ranked.retain(|&i| d[i as usize] >= log_min_p);
    ranked.sort_unstable();
    let weights: Vec<f64> = ranked
        .iter()
        .map(|&i| f64::from(d[i as usize]).exp())
        .collect();
    let target = f64::from(philox_uniform(p.seed, p.offset)) * weights.iter().sum::<f64>();
    let mut cum = 0.0;
    let token = ranked
        .iter()
        .zip(&weights)
        .find(|(_, &w)| {
            cum += w;
            cum > target
        })
        .map_or_else(|| *ranked.last().unwrap_or(&0), |(&i, _)| i);
    SampleOutcome {
        survivors: ranked,
        token,
    }
}

/// The sampler's sanitizing: NaN counts as −inf, +inf as `f32::MAX`.
fn sanitize(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else if v == f32::INFINITY {
        f32::MAX
    } else {
        v
    }
}

/// The first index of the row's maximum, NaN as −inf (0 for an all −inf row): `argmax_row`.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        let v = sanitize(v);
        if v > best.1 {
            best = (i as u32, v);
        }
    }
    best.0
}

/// `log_softmax(row)[id]` over the sanitized row, in f64 (`token_logprob_row` sums in f32:
/// they agree to f32 rounding of the sum); −inf for an all −inf row or an id past the row.
pub fn token_logprob(row: &[f32], id: u32) -> f32 {
    let max = row
        .iter()
        .map(|&v| sanitize(v))
        .fold(f32::NEG_INFINITY, f32::max);
    let Some(&x) = row.get(id as usize) else {
        return f32::NEG_INFINITY;
    };
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let total: f64 = row
        .iter()
        .map(|&v| (f64::from(sanitize(v)) - f64::from(max)).exp())
        .sum();
    (f64::from(sanitize(x)) - f64::from(max) - total.ln()) as f32
}

/// The logprobs a row asked for, as `top_logprobs_row` computes them: the rank of `id` in
/// the sanitized raw row (how many ids have a logit at least its own) and the `n` (at most
/// [`crate::sample_params::MAX_TOP_LOGPROBS`]) most likely ids, value descending then id
/// ascending, with their raw logprobs (sums in f64 here).
pub fn top_logprobs(row: &[f32], id: u32, n: usize) -> (u32, Vec<(u32, f32)>) {
    let x: Vec<f32> = row.iter().map(|&v| sanitize(v)).collect();
    let chosen = x.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let rank = x.iter().filter(|&&v| v >= chosen).count() as u32;
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.sort_by(|&a, &b| x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b)));
    order.truncate(n.min(crate::sample_params::MAX_TOP_LOGPROBS));
    let top = order
        .into_iter()
        .map(|i| (i, token_logprob(row, i)))
        .collect();
    (rank, top)
}

/// The `mask_rows` kernel on one row (the engine's `apply_mask`): −inf for every id whose bit
/// in `words` is clear and every id past them.
pub fn mask_row(row: &mut [f32], words: &[u32]) {
    for (i, x) in row.iter_mut().enumerate() {
        let allowed = words.get(i / 32).is_some_and(|w| (w >> (i % 32)) & 1 == 1);
        if !allowed {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// The `adjust_rows` kernel on one row: the sanitized row with `edits` applied (each edited
/// id penalised, biased, then masked: [`RowEdit`]).
pub fn adjust(row: &[f32], penalties: &RowPenalties, edits: &[RowEdit]) -> Vec<f32> {
    let mut out: Vec<f32> = row.iter().map(|&v| sanitize(v)).collect();
    for e in edits {
        let Some(x) = out.get_mut(e.token_id as usize) else {
            continue;
        };
        if e.flags & RowEdit::PENALIZE != 0 {
            *x = penalties.penalize(*x, e.flags & RowEdit::IN_PROMPT != 0, e.output_count);
        }
        *x += e.bias;
        if e.flags & RowEdit::MASK != 0 {
            *x = f32::NEG_INFINITY;
        }
    }
    out
}

/// The `draw` kernel on one row: `None` for a skipped row, else the token (greedy or drawn
/// from the row after `edits`, when there are any) and its logprob in the raw row.
pub fn draw(
    row: &[f32],
    mode: DrawMode,
    params: &SampleParams,
    edits: Option<(&RowPenalties, &[RowEdit])>,
) -> Option<(u32, f32)> {
    let adjusted = edits.map(|(p, e)| adjust(row, p, e));
    let source = adjusted.as_deref().unwrap_or(row);
    let token = match mode {
        DrawMode::Skip => return None,
        DrawMode::Greedy => argmax(source),
        DrawMode::Random => sample(source, params).token,
    };
    Some((token, token_logprob(row, token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123's `kat_vectors` for philox4x32_10.
    #[test]
    fn philox_matches_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    fn params(top_k: Option<usize>, top_p: f32, min_p: f32, offset: u64) -> SampleParams {
        SampleParams::new(42, offset, 1.0, top_k, top_p, min_p).expect("valid")
    }

    #[test]
    fn top_k_keeps_the_k_best_with_lowest_ids_on_ties() {
        let logits = [1.0, 3.0, 3.0, 2.0, 3.0];
        let out = sample(&logits, &params(Some(2), 1.0, 0.0, 0));
        assert_eq!(out.survivors, vec![1, 2]);
        assert!(out.survivors.contains(&out.token));
    }

    #[test]
    fn top_p_keeps_the_shortest_prefix_holding_the_mass() {
        // Weights relative to the best: 1, e^-1, e^-2, e^-10.
        let logits = [10.0, 9.0, 8.0, 0.0];
        let z = 1.0 + (-1f64).exp() + (-2f64).exp() + (-10f64).exp();
        let just_two = ((1.0 + (-1f64).exp()) / z) as f32;
        assert_eq!(
            sample(&logits, &params(None, just_two - 1e-4, 0.0, 0)).survivors,
            vec![0, 1]
        );
        assert_eq!(
            sample(&logits, &params(None, just_two + 1e-4, 0.0, 0)).survivors,
            vec![0, 1, 2]
        );
    }

    #[test]
    fn min_p_drops_tokens_below_the_fraction_of_the_best() {
        let logits = [0.0, -1.0, -3.0];
        // e^-1 ≈ 0.37 ≥ 0.2, e^-3 ≈ 0.05 < 0.2.
        assert_eq!(
            sample(&logits, &params(None, 1.0, 0.2, 0)).survivors,
            vec![0, 1]
        );
    }

    #[test]
    fn draw_is_argmax_or_sample_with_the_raw_logprob() {
        let row = [1.0, 3.0, f32::NAN, 3.0, 2.0];
        assert_eq!(
            draw(&row, DrawMode::Skip, &SampleParams::UNUSED, None),
            None
        );
        let (id, lp) = draw(&row, DrawMode::Greedy, &SampleParams::UNUSED, None).expect("greedy");
        assert_eq!(id, 1, "the first of the tied maxima");
        let z: f64 = [1.0f64, 3.0, 3.0, 2.0]
            .iter()
            .map(|x| (x - 3.0).exp())
            .sum();
        assert!((f64::from(lp) + z.ln()).abs() < 1e-6, "{lp}");
        let p = params(Some(2), 1.0, 0.0, 5);
        let (id, lp) = draw(&row, DrawMode::Random, &p, None).expect("random");
        assert_eq!(id, sample(&row, &p).token);
        assert!([1, 3].contains(&id));
        assert_eq!(lp, token_logprob(&row, id));
        assert_eq!(token_logprob(&row, 9), f32::NEG_INFINITY);
        assert_eq!(token_logprob(&[f32::NAN; 3], 0), f32::NEG_INFINITY);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);

        // Edits: a penalty and a mask move the greedy choice; the logprob stays the raw row's.
        let pen = RowPenalties {
            repetition: 2.0,
            frequency: 0.5,
            presence: 0.25,
            _pad: 0.0,
        };
        let edits = [
            RowEdit {
                token_id: 1,
                output_count: 2,
                flags: RowEdit::PENALIZE,
                bias: 0.0,
            },
            RowEdit {
                token_id: 3,
                output_count: 0,
                flags: RowEdit::MASK,
                bias: 0.0,
            },
            RowEdit {
                token_id: 0,
                output_count: 0,
                flags: 0,
                bias: 0.75,
            },
        ];
        let adjusted = adjust(&row, &pen, &edits);
        // id 1: 3 / 2 − 0.5·2 − 0.25 = 0.25; id 3 masked; id 0: 1 + 0.75.
        assert_eq!(
            adjusted,
            [1.75, 0.25, f32::NEG_INFINITY, f32::NEG_INFINITY, 2.0]
        );
        let (id, lp) = draw(
            &row,
            DrawMode::Greedy,
            &SampleParams::UNUSED,
            Some((&pen, &edits)),
        )
        .expect("greedy");
        assert_eq!(id, 4);
        assert_eq!(lp, token_logprob(&row, 4));

        // Logprobs: rank counts ids at least as likely (ties included), the top list is
        // value descending then id ascending.
        let (rank, top) = top_logprobs(&row, 4, 3);
        assert_eq!(rank, 3, "ids 1, 3 (3.0) and 4 (2.0) are at least 2.0");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 4]);
        assert_eq!(top[0].1, token_logprob(&row, 1));
        assert_eq!(top_logprobs(&row, 1, 0), (2, vec![]));

        // A mask keeps the ids whose bits are set; ids past the words are masked too.
        let mut long = vec![1.0f32; 40];
        mask_row(&mut long, &[0b1010]);
        let kept: Vec<usize> = (0..40).filter(|&i| long[i] == 1.0).collect();
        assert_eq!(kept, [1, 3]);
    }

    #[test]
    fn draws_follow_the_weights_and_the_stream_is_reproducible() {
        let logits = [0.0, (0.25f32).ln(), f32::NAN, f32::NEG_INFINITY];
        let mut counts = [0usize; 4];
        for offset in 0..4000 {
            let out = sample(&logits, &params(None, 1.0, 0.0, offset));
            assert_eq!(out, sample(&logits, &params(None, 1.0, 0.0, offset)));
            counts[out.token as usize] += 1;
        }
        assert_eq!(
            (counts[2], counts[3]),
            (0, 0),
            "NaN and -inf are never drawn"
        );
        // p(1) = 0.25 / 1.25 = 0.2; 4000 draws put it within ±0.03 with overwhelming odds.
        let share = counts[1] as f64 / 4000.0;
        assert!((share - 0.2).abs() < 0.03, "share of token 1: {share}");
    }
}
