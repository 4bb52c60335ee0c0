//! The plain reference of causal grouped-query attention: one (token, head) at a time over
//! f32 history read through a [`KvView`], softmax in two passes. The model runs the paged
//! kernel ([`super::paged_attention`]); this stays as the simple oracle the GPU parity
//! tests compare their kernels with.
//!
//! Each (token, head) output is computed independently with a fixed summation
//! order, so a row's result never depends on which other rows are in the batch.
//! Work runs on candle's barrier pool: a second thread pool (rayon) would spin
//! against candle's on a 2-core machine and cost more than attention itself.

use super::ops::dot;
use super::parallel::SharedOut;

#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Read access to one layer's cached keys and values of one sequence.
pub trait KvView: Sync {
    /// Key of the token at `pos` for `kv_head`, `head_dim` long.
    fn key(&self, pos: usize, kv_head: usize) -> &[f32];
    fn value(&self, pos: usize, kv_head: usize) -> &[f32];
}

/// Where a query row sits: its absolute position and the sequence whose history it reads.
#[derive(Debug, Clone, Copy)]
pub struct QueryRow {
    pub position: usize,
    pub seq: usize,
}

/// `q`: `[rows, num_heads·head_dim]` (already rotated); row `r` attends to positions
/// `0..=rows[r].position` of sequence `rows[r].seq`, read through `views[seq]`.
/// Returns `[rows, num_heads·head_dim]`.
pub fn attention<V: KvView>(
    q: &[f32],
    rows: &[QueryRow],
    views: &[V],
    shape: AttentionShape,
) -> Vec<f32> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
    } = shape;
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    let out_ptr = SharedOut::new(&mut out);
    candle_core::utils::barrier_pool().execute_chunked(q.len() / head_dim, |items| {
        for i in items {
            // SAFETY: `execute_chunked` hands out disjoint ranges of items, and item `i`
            // owns exactly `out[i·head_dim..(i+1)·head_dim]`, which lies inside `out`.
            let out_head = unsafe { out_ptr.range(i * head_dim, head_dim) };
            let (row, head) = (rows[i / num_heads], i % num_heads);
            let q_head = &q[i * head_dim..(i + 1) * head_dim];
            attend(
                q_head,
                row.position + 1,
                &views[row.seq],
                head / group,
                scale,
                out_head,
            );
        }
    });
    out
}

/// One query head over `context` cached positions of one KV head.
fn attend(
    q_head: &[f32],
    context: usize,
    kv: &impl KvView,
    kv_head: usize,
    scale: f32,
    out_head: &mut [f32],
) {
    let mut scores: Vec<f32> = (0..context)
        .map(|p| dot(q_head, kv.key(p, kv_head)) * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in &mut scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    for (p, &w) in scores.iter().enumerate() {
        let w = w / sum;
        out_head
            .iter_mut()
            .zip(kv.value(p, kv_head))
            .for_each(|(o, v)| *o += w * v);
    }
}
