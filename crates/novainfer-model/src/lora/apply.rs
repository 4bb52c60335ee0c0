//! The segmented low-rank product: each adapter's update on the rows of its requests.
//!
//! ```text
//!   rows:      [ a a a | - | b | a | - - ]      a, b: adapters, -: base model
//!   groups:    a → rows {0,1,2, 5}, b → {4}
//!   per group: xg = x[rows]             gathered (skipped when the rows are contiguous)
//!              t  = xg · Aᵀ             [m, r]
//!              y[rows] += t · Bᵀ        [m, out]  (B carries the scale)
//! ```
//! Every element is one [`dot`] over a fixed length in a fixed order, the same kernel
//! [`matmul_f32_into`] uses, so a row's update never depends on which other rows (or
//! adapters) share its batch: batch invariance holds with adapters as without.

use std::ops::Range;

use super::{AdapterRef, Target};
use crate::forward_batch::SeqSpan;
use crate::layers::dense::matmul_f32_into;
use crate::layers::ops::dot;

/// Products smaller than this many multiply-adds run on the calling thread: handing them
/// to the pool costs more (a fork and a join) than the arithmetic.
const INLINE_MACS: usize = 1 << 16;

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
    gathered: Vec<f32>,
    low: Vec<f32>,
    update: Vec<f32>,
}

/// Adds every group's update of `targets` in layer `layer` to `outs` (one per target, each
/// `[rows, out]`); the targets share the input `x: [rows, in_features]`.
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
        low,
        update,
    } = scratch;
    for g in &groups.groups {
        let lora = g.adapter.layer(layer);
        if targets.iter().all(|&t| lora.get(t).is_none()) {
            continue;
        }
        let input: &[f32] = match g.ranges.as_slice() {
            [one] => &x[one.start * in_features..one.end * in_features],
            many => {
                gathered.clear();
                for r in many {
                    gathered.extend_from_slice(&x[r.start * in_features..r.end * in_features]);
                }
                gathered
            }
        };
        for (&target, y) in targets.iter().zip(outs.iter_mut()) {
            let Some(pair) = lora.get(target) else {
                continue;
            };
            let out_features = pair.b.len() / pair.rank;
            // update = (input Aᵀ) Bᵀ
            matmul(input, g.num_rows, &pair.a, pair.rank, in_features, low);
            matmul(low, g.num_rows, &pair.b, out_features, pair.rank, update);
            let mut i = 0;
            for r in &g.ranges {
                let dst = &mut y[r.start * out_features..r.end * out_features];
                let src = &update[i * out_features..(i + r.len()) * out_features];
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                i += r.len();
            }
        }
    }
}

/// `y = x Wᵀ` (`x: [rows, k]`, `w: [n, k]`): [`matmul_f32_into`], or the same dots on this
/// thread when the product is small.
fn matmul(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize, y: &mut Vec<f32>) {
    if rows * n * k >= INLINE_MACS {
        return matmul_f32_into(x, rows, w, n, k, y);
    }
    y.clear();
    for xi in x.chunks_exact(k).take(rows) {
        y.extend(w.chunks_exact(k).take(n).map(|wj| dot(xi, wj)));
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::lora::{AdapterId, LayerLora, LoraAdapter, LoraPair};

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
        let mut layer = LayerLora::default();
        layer.0[target.index()] = Some(LoraPair {
            rank: r,
            a: data(r * inp, id * 2),
            b: data(out * r, id * 2 + 1),
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
                        .map(|i| f64::from(p.a[j * inp + i]) * f64::from(x[row * inp + i]))
                        .sum()
                })
                .collect();
            for o in 0..n {
                out[row * n + o] += (0..p.rank)
                    .map(|j| f64::from(p.b[o * p.rank + j]) * low[j])
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
    fn inline_and_pooled_products_agree_bit_for_bit() {
        let (rows, n, k) = (3, 70, 400); // above INLINE_MACS
        assert!(rows * n * k >= INLINE_MACS);
        let x = data(rows * k, 1);
        let w = data(n * k, 2);
        let mut pooled = Vec::new();
        matmul(&x, rows, &w, n, k, &mut pooled);
        let mut inline = Vec::new();
        for xi in x.chunks_exact(k) {
            inline.extend(w.chunks_exact(k).map(|wj| dot(xi, wj)));
        }
        assert_eq!(pooled, inline);
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
