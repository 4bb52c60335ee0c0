//! The segmented low-rank product: each adapter's update on the rows of its requests.
//!
//! ```text
//!   rows:      [ a a a | - | b | a | - - ]      a, b: adapters, -: base model
//!   groups:    a → rows {0,1,2, 5}, b → {4}
//!   per group: xg = x[rows]             gathered (skipped when the rows are contiguous)
//!              t  = xg · Aᵀ             [m, r]   one dot per element
//!              y[rows] += t · Bᵀ        y_row[c] += Σ_j t[j] · Bᵀ[j, c], j in order (t carries the scale)
//! ```
//! Each element of `t` is one [`dot`] over a fixed length (the kernel of the dense matmul);
//! each element of `y` adds its `r` terms in order `j = 0..r`. Neither depends on how
//! the work is split or on which other rows (or adapters) share the batch, so batch
//! invariance holds with adapters as without.

use std::ops::Range;

use super::{AdapterRef, Target, Weights};
use crate::forward_batch::SeqSpan;
use crate::layers::ops::{dot_with, DotElem};
use crate::layers::parallel::SharedOut;

/// Phases smaller than this many multiply-adds run on the calling thread: handing them to
/// the pool costs more (a fork and a join) than the arithmetic.
const INLINE_MACS: usize = 1 << 14;
/// Most projections sharing one input (q, k and v).
const MAX_TARGETS: usize = 3;
/// Output columns per work item of a pooled `Bᵀ` update.
const UPDATE_COLS: usize = 256;

/// The rows of one forward pass that run with each adapter, in first-appearance order.
#[derive(Default)]
pub struct AdapterGroups {
    groups: Vec<Group>,
}

struct Group {
    adapter: AdapterRef,
    /// The group's spans' rows, in batch order, adjacent spans merged.
    ranges: Vec<Range<usize>>,
    num_rows: usize,
}

impl AdapterGroups {
    /// Groups `seqs`' rows by adapter (spans without one run the base model only).
    pub fn build(&mut self, seqs: &[SeqSpan]) {
        self.groups.clear();
        for s in seqs.iter().filter(|s| s.query_len > 0) {
            let Some(adapter) = &s.adapter else { continue };
            let rows = s.query_start..s.query_start + s.query_len;
            let group = match self.groups.iter().position(|g| g.adapter == *adapter) {
                Some(i) => &mut self.groups[i],
                None => {
                    self.groups.push(Group {
                        adapter: adapter.clone(),
                        ranges: Vec::new(),
                        num_rows: 0,
                    });
                    self.groups.last_mut().expect("just pushed")
                }
            };
            group.num_rows += rows.len();
            match group.ranges.last_mut() {
                Some(last) if last.end == rows.start => last.end = rows.end,
                _ => group.ranges.push(rows),
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Drops the adapter handles (kept between passes, they would keep unloaded adapters alive).
    pub fn clear(&mut self) {
        self.groups.clear();
    }
}

/// Buffers of [`add_updates`], kept between calls.
#[derive(Default)]
pub struct LoraScratch {
    /// The rows of groups whose rows are not contiguous in the batch, gathered.
    gathered: Vec<f32>,
    /// Per group: where its input rows start (in `x`, or in `gathered`).
    inputs: Vec<Input>,
    /// `x Aᵀ` of every job, one after another (`[rows, rank]` each).
    low: Vec<f32>,
    jobs: Vec<Job>,
}

#[derive(Clone, Copy)]
enum Input {
    /// Row `r` of the batch onwards (the group's rows are contiguous).
    Batch(usize),
    /// Row `r` of `gathered` onwards.
    Gathered(usize),
}

/// One (group, target) product of an [`add_updates`] call.
#[derive(Clone, Copy)]
struct Job {
    group: usize,
    /// Index into the call's `targets`.
    target: usize,
    /// Where its `x Aᵀ` starts in `low`.
    low_at: usize,
}

/// Activation rows, and rows of `A`, per work item of the `x Aᵀ` phase.
const ROW_TILE: usize = 32;
const RANK_CHUNK: usize = 4;

/// Adds every group's update of `targets` in layer `layer` to `outs` (one per target, each
/// `[rows, out]`); the targets share the input `x: [rows, in_features]`.
///
/// Two phases, each one hand-off to the pool at most (small ones stay on this thread): every
/// group's `t = x Aᵀ` for every target, then every `y += t Bᵀ`, split by output columns so
/// that each slice of a `Bᵀ` is streamed once by one thread whatever the number of groups.
pub fn add_updates(
    groups: &AdapterGroups,
    layer: usize,
    targets: &[Target],
    x: &[f32],
    in_features: usize,
    outs: &mut [&mut Vec<f32>],
    scratch: &mut LoraScratch,
) {
    let LoraScratch {
        gathered,
        inputs,
        low,
        jobs,
    } = scratch;
    let pair = |job: &Job| {
        groups.groups[job.group]
            .adapter
            .layer(layer)
            .get(targets[job.target])
            .expect("jobs are made for present targets")
    };
    gathered.clear();
    inputs.clear();
    jobs.clear();
    let mut low_len = 0;
    for (gi, g) in groups.groups.iter().enumerate() {
        let lora = g.adapter.layer(layer);
        inputs.push(match g.ranges.as_slice() {
            [one] => Input::Batch(one.start),
            many => {
                let at = gathered.len() / in_features;
                for r in many {
                    gathered.extend_from_slice(&x[r.start * in_features..r.end * in_features]);
                }
                Input::Gathered(at)
            }
        });
        for (ti, &t) in targets.iter().enumerate() {
            if let Some(p) = lora.get(t) {
                jobs.push(Job {
                    group: gi,
                    target: ti,
                    low_at: low_len,
                });
                low_len += g.num_rows * p.rank;
            }
        }
    }
    if jobs.is_empty() {
        return;
    }
    low.clear();
    low.resize(low_len, 0.0);

    // Phase 1: t = x Aᵀ, items are (job, tile of rows, chunk of A's rows): a decode row's
    // product is split too, so both threads stream A.
    let a_items = |job: &Job| {
        groups.groups[job.group].num_rows.div_ceil(ROW_TILE) * pair(job).rank.div_ceil(RANK_CHUNK)
    };
    let a_macs: usize = jobs
        .iter()
        .map(|j| groups.groups[j.group].num_rows * pair(j).rank * in_features)
        .sum();
    let low_out = SharedOut::new(low);
    let (gathered, inputs, jobs) = (&*gathered, &*inputs, &*jobs);
    let a_item = |job: &Job, item: usize| {
        let p = pair(job);
        let chunks = p.rank.div_ceil(RANK_CHUNK);
        let (tile, chunk) = (item / chunks, item % chunks);
        let rows = tile * ROW_TILE..((tile + 1) * ROW_TILE).min(groups.groups[job.group].num_rows);
        let ranks = chunk * RANK_CHUNK..((chunk + 1) * RANK_CHUNK).min(p.rank);
        let src = match inputs[job.group] {
            Input::Batch(r) => &x[r * in_features..],
            Input::Gathered(r) => &gathered[r * in_features..],
        };
        for i in rows {
            // SAFETY: each item owns its (rows × ranks) cells of its job's section of `low`.
            let d = unsafe { low_out.range(job.low_at + i * p.rank + ranks.start, ranks.len()) };
            let xi = &src[i * in_features..(i + 1) * in_features];
            for (v, j) in d.iter_mut().zip(ranks.clone()) {
                let row = j * in_features..(j + 1) * in_features;
                *v = p.scale
                    * match &p.a {
                        Weights::F32(a) => dot(xi, &a[row]),
                        Weights::Bf16(a) => dot(xi, &a[row]),
                    };
            }
        }
    };
    if a_macs < INLINE_MACS {
        for job in jobs {
            (0..a_items(job)).for_each(|t| a_item(job, t));
        }
    } else {
        let items: usize = jobs.iter().map(a_items).sum();
        candle_core::utils::barrier_pool().execute_chunked(items, |range| {
            for item in range {
                let (mut job, mut tile) = (0, item);
                while tile >= a_items(&jobs[job]) {
                    tile -= a_items(&jobs[job]);
                    job += 1;
                }
                a_item(&jobs[job], tile);
            }
        });
    }

    // Phase 2: y += t Bᵀ, items are (target, chunk of output columns) over every group.
    let low: &[f32] = low;
    let out_of = |ti: usize| {
        jobs.iter()
            .find(|j| j.target == ti)
            .map(|j| pair(j).out_features())
    };
    let b_macs: usize = jobs
        .iter()
        .map(|j| groups.groups[j.group].num_rows * pair(j).bt.len())
        .sum();
    assert!(
        outs.len() <= MAX_TARGETS,
        "at most {MAX_TARGETS} targets share an input"
    );
    let mut ys: [Option<SharedOut>; MAX_TARGETS] = [None; MAX_TARGETS];
    for (slot, y) in ys.iter_mut().zip(outs.iter_mut()) {
        *slot = Some(SharedOut::new(y));
    }
    let b_item = |ti: usize, cols: Range<usize>| {
        for job in jobs.iter().filter(|j| j.target == ti) {
            let p = pair(job);
            let g = &groups.groups[job.group];
            let out = p.out_features();
            let y = ys[ti].expect("one output per target");
            let rows = g.ranges.iter().flat_map(|r| r.clone());
            for (i, row) in rows.enumerate() {
                // SAFETY: `row` lies in the target's output (its ranges come from the batch's
                // spans) and `cols` in `0..out`; items own disjoint columns of a target, and a
                // row belongs to one group.
                let dst = unsafe { y.range(row * out + cols.start, cols.len()) };
                let t = &low[job.low_at + i * p.rank..job.low_at + (i + 1) * p.rank];
                match &p.bt {
                    Weights::F32(bt) => add_rank_update(dst, t, bt, out, cols.start),
                    Weights::Bf16(bt) => add_rank_update(dst, t, bt, out, cols.start),
                }
            }
        }
    };
    if b_macs < INLINE_MACS {
        for ti in 0..targets.len() {
            if let Some(out) = out_of(ti) {
                b_item(ti, 0..out);
            }
        }
        return;
    }
    let chunks: Vec<usize> = (0..targets.len())
        .map(|ti| out_of(ti).map_or(0, |out| out.div_ceil(UPDATE_COLS)))
        .collect();
    let items: usize = chunks.iter().sum();
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for item in range {
            let (mut ti, mut chunk) = (0, item);
            while chunk >= chunks[ti] {
                chunk -= chunks[ti];
                ti += 1;
            }
            let out = out_of(ti).expect("chunks exist for present targets");
            b_item(
                ti,
                chunk * UPDATE_COLS..((chunk + 1) * UPDATE_COLS).min(out),
            );
        }
    });
}

/// `Σ a[i] · w[i]`: the dense matmul's kernel, over either weight type; not inlined, so
/// every caller runs the same code.
#[inline(never)]
fn dot<W: DotElem>(a: &[f32], w: &[W]) -> f32 {
    dot_with(a, w)
}

/// `dst[c] += Σ_j t[j] · Bᵀ[j, col0 + c]`, `Bᵀ` rows `out` apart. Each element takes its `r`
/// terms as fused multiply-adds in order `j = 0..r`, whichever lanes or tail it falls in (the
/// tail uses `mul_add`, the same single rounding), so the result does not depend on how the
/// columns were split. Blocks of 32 columns stay in registers across all `j`: per term one
/// weight load, not a load and a store of `dst` too.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(never)]
fn add_rank_update<W: DotElem>(dst: &mut [f32], t: &[f32], bt: &[W], out: usize, col0: usize) {
    use std::arch::x86_64::*;
    let n = dst.len();
    let main = n / 32 * 32;
    assert!(
        t.is_empty() || (t.len() - 1) * out + col0 + n <= bt.len(),
        "rank update beyond Bᵀ: this is a bug"
    );
    let mut c = 0;
    while c < main {
        // SAFETY: AVX2/FMA are enabled at compile time; `dst[c..c + 32]` is in bounds
        // (`c + 32 <= main <= n`) and every weight read `j * out + col0 + c + 8k .. + 8` lies
        // within row j's `col0..col0 + n` part of `Bᵀ` (asserted above).
        unsafe {
            let d = dst.as_mut_ptr().add(c);
            let mut acc = [
                _mm256_loadu_ps(d),
                _mm256_loadu_ps(d.add(8)),
                _mm256_loadu_ps(d.add(16)),
                _mm256_loadu_ps(d.add(24)),
            ];
            for (j, &tj) in t.iter().enumerate() {
                let tv = _mm256_set1_ps(tj);
                let w = bt.as_ptr().add(j * out + col0 + c);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(tv, W::load8(w.add(8 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(d.add(8 * k), *a);
            }
        }
        c += 32;
    }
    for (c, d) in dst.iter_mut().enumerate().skip(main) {
        for (j, &tj) in t.iter().enumerate() {
            *d = tj.mul_add(bt[j * out + col0 + c].to_f32(), *d);
        }
    }
}

/// The portable [`add_rank_update`] (targets without AVX2/FMA), in the same order.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline(never)]
fn add_rank_update<W: DotElem>(dst: &mut [f32], t: &[f32], bt: &[W], out: usize, col0: usize) {
    for (c, d) in dst.iter_mut().enumerate() {
        for (j, &tj) in t.iter().enumerate() {
            *d = tj.mul_add(bt[j * out + col0 + c].to_f32(), *d);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::lora::{AdapterId, LayerLora, LoraAdapter, LoraPair, Weights};

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// An adapter of one layer with `target` of shape `[out, in]` at rank `r`.
    fn adapter(id: u64, target: Target, out: usize, inp: usize, r: usize) -> AdapterRef {
        let a = Weights::F32(data(r * inp, id * 2));
        let bt = Weights::F32(data(r * out, id * 2 + 1));
        one_pair(id, target, r, a, bt)
    }

    /// Adapter `id` of one layer whose only update is `target`'s `(a, bt)` at rank `r`.
    fn one_pair(id: u64, target: Target, r: usize, a: Weights, bt: Weights) -> AdapterRef {
        let mut layer = LayerLora::default();
        layer.0[target.index()] = Some(LoraPair {
            rank: r,
            scale: 0.5,
            a,
            bt,
        });
        AdapterRef(Arc::new(LoraAdapter {
            id: AdapterId(id),
            name: format!("a{id}"),
            source: Path::new("mem").to_owned(),
            rank: r,
            layers: vec![layer],
        }))
    }

    fn span(start: usize, len: usize, adapter: Option<&AdapterRef>) -> SeqSpan {
        SeqSpan {
            query_start: start,
            query_len: len,
            block_table: vec![0],
            output: Default::default(),
            adapter: adapter.cloned(),
        }
    }

    /// `y[row] += Σ_j B[o, j] · Σ_i A[j, i] x[row, i]`, in f64.
    fn reference(a: &AdapterRef, target: Target, x: &[f32], inp: usize, out: &mut [f64]) {
        let p = a.layer(0).get(target).expect("target present");
        let rows = x.len() / inp;
        let n = out.len() / rows;
        for row in 0..rows {
            let low: Vec<f64> = (0..p.rank)
                .map(|j| {
                    (0..inp)
                        .map(|i| f64::from(p.a.get(j * inp + i)) * f64::from(x[row * inp + i]))
                        .sum()
                })
                .collect();
            for o in 0..n {
                out[row * n + o] += (0..p.rank)
                    .map(|j| f64::from(p.scale) * f64::from(p.bt.get(j * n + o)) * low[j])
                    .sum::<f64>();
            }
        }
    }

    #[test]
    fn mixed_batch_matches_the_definition_and_each_row_alone() {
        let (inp, out, rows) = (40, 24, 9);
        let a = adapter(1, Target::Up, out, inp, 4);
        let b = adapter(2, Target::Up, out, inp, 8);
        let x = data(rows * inp, 7);
        let base = data(rows * out, 8);
        // rows: a a | base | b b b | a | base base
        let seqs = [
            span(0, 2, Some(&a)),
            span(2, 1, None),
            span(3, 3, Some(&b)),
            span(6, 1, Some(&a)),
            span(7, 2, None),
        ];
        let mut groups = AdapterGroups::default();
        groups.build(&seqs);
        let mut y = base.clone();
        let mut scratch = LoraScratch::default();
        add_updates(
            &groups,
            0,
            &[Target::Up],
            &x,
            inp,
            &mut [&mut y],
            &mut scratch,
        );

        let mut want: Vec<f64> = base.iter().map(|&v| f64::from(v)).collect();
        for s in &seqs {
            if let Some(ad) = &s.adapter {
                let r = s.query_start..s.query_start + s.query_len;
                reference(
                    ad,
                    Target::Up,
                    &x[r.start * inp..r.end * inp],
                    inp,
                    &mut want[r.start * out..r.end * out],
                );
            }
        }
        for (i, (got, want)) in y.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*got) - want).abs() < 1e-4,
                "element {i}: {got} vs {want}"
            );
        }

        // Each span run alone gives the same bits.
        for s in &seqs {
            let r = s.query_start..s.query_start + s.query_len;
            let mut alone = base[r.start * out..r.end * out].to_vec();
            let mut g = AdapterGroups::default();
            g.build(&[span(0, s.query_len, s.adapter.as_ref())]);
            add_updates(
                &g,
                0,
                &[Target::Up],
                &x[r.start * inp..r.end * inp],
                inp,
                &mut [&mut alone],
                &mut scratch,
            );
            assert_eq!(
                alone,
                y[r.start * out..r.end * out],
                "span at {}",
                s.query_start
            );
        }
    }

    #[test]
    fn inline_and_pooled_updates_agree_bit_for_bit() {
        // Prefill-sized (pooled) and one row at a time (inline) give the same bits.
        let (inp, out, rows, r) = (64, 1000, 40, 4);
        assert!(rows * r * out >= INLINE_MACS && r * out < INLINE_MACS && r * inp < INLINE_MACS);
        let a = adapter(5, Target::Gate, out, inp, r);
        let x = data(rows * inp, 3);
        let mut groups = AdapterGroups::default();
        groups.build(&[span(0, rows, Some(&a))]);
        let mut all = vec![0.5; rows * out];
        let mut scratch = LoraScratch::default();
        add_updates(
            &groups,
            0,
            &[Target::Gate],
            &x,
            inp,
            &mut [&mut all],
            &mut scratch,
        );
        for row in 0..rows {
            let mut one = vec![0.5; out];
            groups.build(&[span(0, 1, Some(&a))]);
            let xr = &x[row * inp..(row + 1) * inp];
            add_updates(
                &groups,
                0,
                &[Target::Gate],
                xr,
                inp,
                &mut [&mut one],
                &mut scratch,
            );
            assert_eq!(one, all[row * out..(row + 1) * out], "row {row}");
        }
    }

    #[test]
    fn bf16_weights_give_the_bits_of_the_same_values_in_f32() {
        let (inp, out, rows) = (40, 300, 3);
        let round = |w: &Weights| match w {
            Weights::F32(v) => v
                .iter()
                .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
                .collect(),
            Weights::Bf16(_) => unreachable!(),
        };
        let f = adapter(9, Target::Up, out, inp, 8);
        let p = f.layer(0).get(Target::Up).expect("present");
        let (a, bt): (Vec<f32>, Vec<f32>) = (round(&p.a), round(&p.bt));
        let make = |bf16: bool| {
            let (a, bt) = (
                Weights::new(a.clone(), bf16),
                Weights::new(bt.clone(), bf16),
            );
            one_pair(10 + u64::from(bf16), Target::Up, 8, a, bt)
        };
        let (wide, narrow) = (make(false), make(true));
        assert!(matches!(
            narrow.layer(0).get(Target::Up).map(|p| &p.a),
            Some(Weights::Bf16(_))
        ));
        let x = data(rows * inp, 4);
        let run = |ad: &AdapterRef| {
            let mut groups = AdapterGroups::default();
            groups.build(&[span(0, rows, Some(ad))]);
            let mut y = vec![1.0; rows * out];
            let mut s = LoraScratch::default();
            add_updates(&groups, 0, &[Target::Up], &x, inp, &mut [&mut y], &mut s);
            y
        };
        assert_eq!(run(&wide), run(&narrow));
        assert!(wide.weight_bytes() == 2 * narrow.weight_bytes());
    }

    #[test]
    fn targets_an_adapter_lacks_are_left_alone() {
        let a = adapter(1, Target::Q, 8, 8, 2);
        let mut groups = AdapterGroups::default();
        groups.build(&[span(0, 1, Some(&a))]);
        let mut y = vec![1.0; 8];
        add_updates(
            &groups,
            0,
            &[Target::K],
            &[0.5; 8],
            8,
            &mut [&mut y],
            &mut LoraScratch::default(),
        );
        assert_eq!(y, vec![1.0; 8]);
    }
}
