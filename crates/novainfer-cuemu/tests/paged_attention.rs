//! kernels/paged_attention.cu run by the emulator, every kernel launched as
//! `ops::paged_attention` launches it (split-K decode: the per-head or the grouped first phase,
//! then the merge; the legacy prefill kernel), f32 and bf16 pools, against a float64 attention
//! within the GPU tests' tolerances (`TestDtype::TOL`):
//! - the grouped decode at Qwen2 0.5B (14 heads over 2, head_dim 64: groups of 7) and 1.5B
//!   (12 over 2, head_dim 128: groups of 6) geometries, block sizes 16 and 32, histories around
//!   the block, stage and split boundaries (1, 15, 16, 17, 255, 256, 257, 1000; 31, 32, 33),
//!   padding sequences and masked blocks (+0 rows, never NaN), partials over a NaN scratch;
//! - the kernel header's contract, bit for bit: the grouped kernel (whole group, parts with an
//!   idle warp, one head per block), the per-head kernel and the prefill kernel give a row the
//!   same bits; a sequence alone (another split stride, the launcher's one-sequence part size)
//!   gives its bits from the batch; a chunked prefill row gives the decode row's bits.

mod common;

use common::{addr, Aligned, Dtype, Rng};
use novainfer_cuemu::kernels::paged_attention::*;
use novainfer_cuemu::{launch, Dim3};

/// `ATTN_SPLIT` and `ATTN_WARPS` of the kernel and the launcher.
const ATTN_SPLIT: usize = 512;
const ATTN_WARPS: usize = 4;

type Phase1<E> = unsafe extern "C-unwind" fn(
    *const E,
    *const E,
    *const E,
    *const i32,
    *const i32,
    *mut f32,
    *mut f32,
    AttnShape,
);
type Merge<E> = unsafe extern "C-unwind" fn(*const i32, *const f32, *const f32, *mut E, AttnShape);
type Prefill<E> = unsafe extern "C-unwind" fn(
    *const E,
    *const E,
    *const E,
    *const i32,
    *const i32,
    *const i32,
    *const i32,
    *mut E,
    i32,
    i32,
    AttnShape,
);

/// The four kernels of one dtype and head dim.
struct Kernels<E> {
    decode: Phase1<E>,
    grouped: Phase1<E>,
    merge: Merge<E>,
    prefill: Prefill<E>,
}

/// A pool element as the kernels take it: f32, or bf16 as its bits.
trait Elem: Dtype {
    fn kernels(head_dim: usize) -> Kernels<Self>;
}

impl Elem for f32 {
    fn kernels(head_dim: usize) -> Kernels<Self> {
        match head_dim {
            64 => Kernels {
                decode: paged_attention_decode_f32_hd64,
                grouped: paged_attention_decode_grouped_f32_hd64,
                merge: paged_attention_merge_f32_hd64,
                prefill: paged_attention_prefill_f32_hd64,
            },
            128 => Kernels {
                decode: paged_attention_decode_f32_hd128,
                grouped: paged_attention_decode_grouped_f32_hd128,
                merge: paged_attention_merge_f32_hd128,
                prefill: paged_attention_prefill_f32_hd128,
            },
            other => panic!("no f32 attention kernel for head_dim {other}"),
        }
    }
}

impl Elem for u16 {
    fn kernels(head_dim: usize) -> Kernels<Self> {
        match head_dim {
            64 => Kernels {
                decode: paged_attention_decode_bf16_hd64,
                grouped: paged_attention_decode_grouped_bf16_hd64,
                merge: paged_attention_merge_bf16_hd64,
                prefill: paged_attention_prefill_bf16_hd64,
            },
            128 => Kernels {
                decode: paged_attention_decode_bf16_hd128,
                grouped: paged_attention_decode_grouped_bf16_hd128,
                merge: paged_attention_merge_bf16_hd128,
                prefill: paged_attention_prefill_bf16_hd128,
            },
            256 => Kernels {
                decode: paged_attention_decode_bf16_hd256,
                grouped: paged_attention_decode_grouped_bf16_hd256,
                merge: paged_attention_merge_bf16_hd256,
                prefill: paged_attention_prefill_bf16_hd256,
            },
            other => panic!("no bf16 attention kernel for head_dim {other}"),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Geometry {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

impl Geometry {
    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
    fn row(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

const fn qwen_05b(block_size: usize) -> Geometry {
    Geometry {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        block_size,
    }
}

const fn qwen_15b(block_size: usize) -> Geometry {
    Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size,
    }
}

/// Which first phase a decode launch runs (`ops::paged_attention::DecodeKernel`).
#[derive(Clone, Copy, Debug)]
enum Phase {
    PerHead,
    Grouped { heads_per_block: usize },
}

/// A batch's sequences: history lengths, and which table entries name no valid block.
struct Spec<'a> {
    lens: &'a [usize],
    /// (sequence, block index): the entry names the block past the pool (masked keys).
    masked_blocks: &'a [(usize, usize)],
    /// Sequences whose every entry is invalid (−5 and i32::MAX, alternately).
    all_masked: &'a [usize],
}

/// A pool holding the batch's sequences in scrambled blocks, and their block tables.
struct Batch<E: Elem> {
    g: Geometry,
    k: Aligned<E>,
    v: Aligned<E>,
    /// The pool as stored, widened (exactly) for the reference.
    k32: Vec<f32>,
    v32: Vec<f32>,
    num_blocks: usize,
    tables: Vec<i32>,
    max_blocks: usize,
    lens: Vec<i32>,
}

impl<E: Elem> Batch<E> {
    fn new(g: Geometry, spec: &Spec, rng: &mut Rng) -> Self {
        let bs = g.block_size;
        let blocks = |l: usize| l.div_ceil(bs);
        // One spare table entry per row (−1, never read).
        let max_blocks = spec.lens.iter().map(|&l| blocks(l)).max().unwrap_or(0) + 1;
        let num_blocks = spec.lens.iter().map(|&l| blocks(l)).sum::<usize>() + 2;
        let n = num_blocks * bs * g.num_kv_heads * g.head_dim;
        let k: Vec<E> = (0..n).map(|_| E::from_f32(rng.f32(1.0))).collect();
        // Values with an offset, so that an attention result is not near zero everywhere.
        let v: Vec<E> = (0..n).map(|_| E::from_f32(rng.f32(1.0) + 0.25)).collect();
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut tables = vec![-1i32; spec.lens.len() * max_blocks];
        let mut next = 0;
        for (s, &l) in spec.lens.iter().enumerate() {
            for b in 0..blocks(l) {
                tables[s * max_blocks + b] = if spec.all_masked.contains(&s) {
                    if b % 2 == 0 {
                        -5
                    } else {
                        i32::MAX
                    }
                } else {
                    ids[next]
                };
                next += 1;
            }
        }
        for &(s, b) in spec.masked_blocks {
            tables[s * max_blocks + b] = num_blocks as i32;
        }
        Batch {
            g,
            k32: k.iter().map(|x| x.to_f32()).collect(),
            v32: v.iter().map(|x| x.to_f32()).collect(),
            k: Aligned::new(&k),
            v: Aligned::new(&v),
            num_blocks,
            tables,
            max_blocks,
            lens: spec.lens.iter().map(|&l| l as i32).collect(),
        }
    }

    fn table(&self, s: usize) -> &[i32] {
        &self.tables[s * self.max_blocks..(s + 1) * self.max_blocks]
    }

    fn shape(&self, max_splits: usize) -> AttnShape {
        let g = self.g;
        AttnShape {
            num_heads: g.num_heads as i32,
            num_kv_heads: g.num_kv_heads as i32,
            block_size: g.block_size as i32,
            num_blocks: self.num_blocks as i32,
            max_blocks_per_seq: self.max_blocks as i32,
            max_splits: max_splits as i32,
            scale: 1.0 / (g.head_dim as f32).sqrt(),
        }
    }

    /// `paged_attention_decode_with`: the first phase, then the merge, over `tables`/`lens`
    /// (whole rows of `max_blocks` entries) with a scratch of `max_splits` splits. The scratch
    /// starts as NaN, so a partial the merge reads but no split wrote shows.
    fn decode(
        &self,
        phase: Phase,
        tables: &[i32],
        lens: &[i32],
        q: &[E],
        max_splits: usize,
    ) -> Vec<E> {
        let g = self.g;
        let seqs = lens.len();
        assert_eq!(tables.len(), seqs * self.max_blocks);
        assert_eq!(q.len(), seqs * g.row());
        let max_len = lens.iter().copied().max().unwrap_or(0) as usize;
        assert!(
            max_len <= max_splits * ATTN_SPLIT,
            "the launcher refuses this batch"
        );
        let shape = self.shape(max_splits);
        let kernels = E::kernels(g.head_dim);
        let parts = seqs * g.num_heads * max_splits;
        let mut part_acc = vec![f32::NAN; parts * g.head_dim];
        let mut part_ml = vec![f32::NAN; parts * 2];
        // A value no row can take (|out| ≤ max |v| < 2), so an unwritten row shows.
        let mut out = vec![E::from_f32(-77.0); q.len()];
        let p = (
            addr(q.as_ptr()),
            addr(self.k.ptr()),
            addr(self.v.ptr()),
            addr(tables.as_ptr()),
            addr(lens.as_ptr()),
            addr(part_acc.as_mut_ptr()),
            addr(part_ml.as_mut_ptr()),
            addr(out.as_mut_ptr()),
        );
        let (function, grid, block) = match phase {
            Phase::PerHead => (
                kernels.decode,
                Dim3 {
                    x: g.num_heads.div_ceil(ATTN_WARPS) as u32,
                    y: seqs as u32,
                    z: max_splits as u32,
                },
                Dim3::x((ATTN_WARPS * 32) as u32),
            ),
            Phase::Grouped { heads_per_block } => (
                kernels.grouped,
                Dim3 {
                    x: (g.num_kv_heads * g.group().div_ceil(heads_per_block)) as u32,
                    y: seqs as u32,
                    z: max_splits as u32,
                },
                Dim3::x((heads_per_block * 32) as u32),
            ),
        };
        launch(grid, block, || unsafe {
            function(
                p.0 as _, p.1 as _, p.2 as _, p.3 as _, p.4 as _, p.5 as _, p.6 as _, shape,
            )
        })
        .expect("the decode first phase");
        launch(
            Dim3::xy(g.num_heads as u32, seqs as u32),
            Dim3::x(32),
            || unsafe { (kernels.merge)(p.4 as _, p.5 as _, p.6 as _, p.7 as _, shape) },
        )
        .expect("the decode merge");
        out
    }

    /// `paged_attention_prefill`: sequence s owns tokens `qsl[s]..qsl[s + 1]`; token t
    /// attends to `0..=positions[t]` (within `lens[s]`).
    fn prefill(&self, qsl: &[i32], positions: &[i32], q: &[E]) -> Vec<E> {
        let g = self.g;
        let (tokens, seqs) = (positions.len(), self.lens.len());
        assert_eq!(qsl.len(), seqs + 1);
        assert_eq!(q.len(), tokens * g.row());
        // The launcher's `check_config` leaves max_splits at 0: the prefill has no scratch.
        let shape = self.shape(0);
        let kernels = E::kernels(g.head_dim);
        let mut out = vec![E::from_f32(-77.0); q.len()];
        let p = (
            addr(q.as_ptr()),
            addr(self.k.ptr()),
            addr(self.v.ptr()),
            addr(self.tables.as_ptr()),
            addr(self.lens.as_ptr()),
            addr(qsl.as_ptr()),
            addr(positions.as_ptr()),
            addr(out.as_mut_ptr()),
        );
        let grid = Dim3::x((tokens * g.num_heads).div_ceil(ATTN_WARPS) as u32);
        launch(grid, Dim3::x((ATTN_WARPS * 32) as u32), || unsafe {
            (kernels.prefill)(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                p.5 as _,
                p.6 as _,
                p.7 as _,
                tokens as i32,
                seqs as i32,
                shape,
            )
        })
        .expect("the prefill launch");
        out
    }

    /// Float64 attention of one query row (all heads) over positions `0..ctx` of the sequence
    /// with block table `table`; masked keys (entries outside the pool) drop out, and a row
    /// with no key left is zeros.
    fn reference(&self, table: &[i32], ctx: usize, q: &[E]) -> Vec<f32> {
        let g = self.g;
        let hd = g.head_dim;
        let kv_row = g.num_kv_heads * hd;
        let keys: Vec<usize> = (0..ctx)
            .filter_map(|pos| {
                let b = table[pos / g.block_size];
                (0..self.num_blocks as i32)
                    .contains(&b)
                    .then(|| (b as usize * g.block_size + pos % g.block_size) * kv_row)
            })
            .collect();
        let mut out = vec![0f32; g.row()];
        if keys.is_empty() {
            return out;
        }
        for h in 0..g.num_heads {
            let q = &q[h * hd..(h + 1) * hd];
            let at = (h / g.group()) * hd;
            let scores: Vec<f64> = keys
                .iter()
                .map(|&o| {
                    let k = &self.k32[o + at..o + at + hd];
                    q.iter()
                        .zip(k)
                        .map(|(a, b)| f64::from(a.to_f32()) * f64::from(*b))
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for d in 0..hd {
                let acc: f64 = keys
                    .iter()
                    .zip(&w)
                    .map(|(&o, &w)| w * f64::from(self.v32[o + at + d]))
                    .sum();
                out[h * hd + d] = (acc / sum) as f32;
            }
        }
        out
    }
}

fn random_q<E: Elem>(rng: &mut Rng, n: usize) -> Vec<E> {
    (0..n).map(|_| E::from_f32(rng.f32(1.0))).collect()
}

/// novainfer-cuda's `assert_close`: relative to the value, with a floor of 5% of the largest.
fn assert_close<E: Elem>(what: &str, got: &[E], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        assert!(
            (g - w).abs() <= E::TOL * w.abs().max(scale * 0.05),
            "{what} [{}]: element {i}: kernel {g} vs float64 {w}",
            E::NAME
        );
    }
}

fn assert_same_bits<E: Elem>(what: &str, got: &[E], want: &[E]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_f32().to_bits(),
            w.to_f32().to_bits(),
            "{what} [{}]: element {i}: {} vs {}",
            E::NAME,
            g.to_f32(),
            w.to_f32()
        );
    }
}

/// Every decode row of the batch against float64 (rows with no key: +0).
fn check_decode_rows<E: Elem>(what: &str, batch: &Batch<E>, q: &[E], out: &[E]) {
    let row = batch.g.row();
    let mut want = Vec::with_capacity(out.len());
    for (s, &len) in batch.lens.iter().enumerate() {
        want.extend(batch.reference(batch.table(s), len as usize, &q[s * row..(s + 1) * row]));
    }
    assert_close(what, out, &want);
    for (i, (g, w)) in out.iter().zip(&want).enumerate() {
        if *w == 0.0 {
            assert_eq!(
                g.to_f32().to_bits(),
                0,
                "{what}: element {i} of an empty row is not +0"
            );
        }
    }
}

/// Block size 16: one position, a block ±1, a stage (32, 64 or 128 keys) ±1, two splits
/// ending on a partial tile, a padding sequence, one block masked, every block masked.
const LENS_16: Spec = Spec {
    lens: &[1, 15, 16, 17, 255, 256, 257, 1000, 0, 40, 20],
    masked_blocks: &[(9, 1)],
    all_masked: &[10],
};
/// Block size 32: the block boundaries, a few stages, the same padding and masks.
const LENS_32: Spec = Spec {
    lens: &[1, 31, 32, 33, 257, 0, 70, 20],
    masked_blocks: &[(6, 1)],
    all_masked: &[7],
};

/// The grouped decode (whole groups: the launcher's choice for a full batch) against
/// float64, over a scratch one split larger than the batch needs; with `alone`, every
/// sequence by itself (a scratch of its own splits, one head per block: the launcher's
/// choice for one sequence on a large GPU) gives its bits from the batch.
fn grouped_body<E: Elem>(g: Geometry, spec: &Spec, alone: bool, seed: u64) {
    let what = format!("{g:?} {}", E::NAME);
    let mut rng = Rng(seed);
    let batch = Batch::<E>::new(g, spec, &mut rng);
    let q = random_q::<E>(&mut rng, spec.lens.len() * g.row());
    let max_len = spec.lens.iter().copied().max().unwrap_or(0);
    let splits = max_len.div_ceil(ATTN_SPLIT) + 1;
    let whole = Phase::Grouped {
        heads_per_block: g.group(),
    };
    let out = batch.decode(whole, &batch.tables, &batch.lens, &q, splits);
    check_decode_rows(&format!("{what}: grouped decode"), &batch, &q, &out);
    if !alone {
        return;
    }
    let row = g.row();
    for (s, &len) in spec.lens.iter().enumerate() {
        let one = batch.decode(
            Phase::Grouped { heads_per_block: 1 },
            batch.table(s),
            &batch.lens[s..s + 1],
            &q[s * row..(s + 1) * row],
            len.div_ceil(ATTN_SPLIT).max(1),
        );
        assert_same_bits(
            &format!("{what}: sequence {s} (length {len}) alone vs in the batch"),
            &one,
            &out[s * row..(s + 1) * row],
        );
    }
}

#[test]
fn grouped_decode_matches_float64_at_qwen2_geometries_with_block_size_16() {
    grouped_body::<f32>(qwen_05b(16), &LENS_16, true, 1);
    grouped_body::<u16>(qwen_05b(16), &LENS_16, false, 2);
    grouped_body::<f32>(qwen_15b(16), &LENS_16, false, 3);
    grouped_body::<u16>(qwen_15b(16), &LENS_16, true, 4);
}

#[test]
fn grouped_decode_matches_float64_at_qwen2_geometries_with_block_size_32() {
    grouped_body::<f32>(qwen_05b(32), &LENS_32, false, 5);
    grouped_body::<u16>(qwen_05b(32), &LENS_32, true, 6);
    grouped_body::<f32>(qwen_15b(32), &LENS_32, true, 7);
    grouped_body::<u16>(qwen_15b(32), &LENS_32, false, 8);
}

/// One batch through every first phase (whole groups, parts of about half a group, with an
/// idle warp where that does not divide the group, one head per block, the per-head kernel)
/// and through the prefill kernel as one-token chunks at the last positions: the same bits,
/// and float64's values.
fn every_kernel_body<E: Elem>(g: Geometry, spec: &Spec, seed: u64) {
    let what = format!("{g:?} {}", E::NAME);
    let mut rng = Rng(seed);
    let batch = Batch::<E>::new(g, spec, &mut rng);
    let q = random_q::<E>(&mut rng, spec.lens.len() * g.row());
    let max_len = spec.lens.iter().copied().max().unwrap_or(0);
    let splits = max_len.div_ceil(ATTN_SPLIT).max(1);
    let group = g.group();
    let run = |phase| batch.decode(phase, &batch.tables, &batch.lens, &q, splits);
    let reference = run(Phase::Grouped {
        heads_per_block: group,
    });
    check_decode_rows(&format!("{what}: grouped decode"), &batch, &q, &reference);
    let mut phases = vec![Phase::PerHead, Phase::Grouped { heads_per_block: 1 }];
    if group > 2 {
        phases.push(Phase::Grouped {
            heads_per_block: group.div_ceil(2),
        });
    }
    for phase in phases {
        assert_same_bits(
            &format!("{what}: {phase:?} vs whole groups"),
            &run(phase),
            &reference,
        );
    }
    // A padding sequence has no position; its row's history is empty either way.
    let qsl: Vec<i32> = (0..=spec.lens.len() as i32).collect();
    let positions: Vec<i32> = batch.lens.iter().map(|&l| l - 1).collect();
    assert_same_bits(
        &format!("{what}: prefill vs decode"),
        &batch.prefill(&qsl, &positions, &q),
        &reference,
    );
}

/// Groups of 7 and 6 over one KV head (half of Qwen2's heads: the per-head and prefill
/// kernels cost a warp-wide reduction per key under the emulator).
#[test]
fn every_decode_kernel_and_the_prefill_give_the_same_bits() {
    let g7 = |bs| Geometry {
        num_heads: 7,
        num_kv_heads: 1,
        head_dim: 64,
        block_size: bs,
    };
    let g6 = |bs| Geometry {
        num_heads: 6,
        num_kv_heads: 1,
        head_dim: 128,
        block_size: bs,
    };
    let short = Spec {
        lens: &[1, 17, 0, 40, 20, 300],
        masked_blocks: &[(3, 1)],
        all_masked: &[4],
    };
    // A second split of one position.
    let split = Spec {
        lens: &[513, 33, 0],
        masked_blocks: &[],
        all_masked: &[],
    };
    every_kernel_body::<f32>(g7(16), &split, 11);
    every_kernel_body::<u16>(g6(16), &short, 12);
    every_kernel_body::<f32>(g6(32), &short, 13);
    every_kernel_body::<u16>(g7(32), &short, 14);
    // The bf16-only head dim 256 (no Qwen2 model; compiled all the same).
    let g256 = Geometry {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 256,
        block_size: 16,
    };
    every_kernel_body::<u16>(g256, &short, 15);
}

/// A mixed prefill batch: a whole prompt, a chunk in the middle of a history, one decode
/// token, and sequences with no token in the step. Every row against float64, and with the bits the grouped decode gives the same query
/// at the same position (the header's "not on how its prompt was chunked").
fn chunked_body<E: Elem>(g: Geometry, seed: u64) {
    let what = format!("{g:?} {}", E::NAME);
    let mut rng = Rng(seed);
    // Sequence 1 has no token in this step (between prompts of a mixed batch); so has the
    // last (the prefill kernel's search must land every token on its own sequence).
    let spec = Spec {
        lens: &[12, 50, 36, 101, 7],
        masked_blocks: &[],
        all_masked: &[],
    };
    let batch = Batch::<E>::new(g, &spec, &mut rng);
    let chunks = [(0, 12), (0, 0), (29, 36), (100, 101), (0, 0)];
    let (mut qsl, mut positions, mut owner) = (vec![0i32], Vec::new(), Vec::new());
    for (s, &(a, b)) in chunks.iter().enumerate() {
        positions.extend(a..b);
        owner.extend(std::iter::repeat_n(s, (b - a) as usize));
        qsl.push(positions.len() as i32);
    }
    let row = g.row();
    let q = random_q::<E>(&mut rng, positions.len() * row);
    let out = batch.prefill(&qsl, &positions, &q);
    let mut want = Vec::new();
    for (t, &p) in positions.iter().enumerate() {
        let table = batch.table(owner[t]);
        want.extend(batch.reference(table, p as usize + 1, &q[t * row..(t + 1) * row]));
    }
    assert_close(&format!("{what}: chunked prefill"), &out, &want);
    // Token t as a decode sequence of its own: its table, history p + 1.
    let tables: Vec<i32> = owner
        .iter()
        .flat_map(|&s| batch.table(s).to_vec())
        .collect();
    let lens: Vec<i32> = positions.iter().map(|&p| p + 1).collect();
    let decode = batch.decode(
        Phase::Grouped {
            heads_per_block: g.group(),
        },
        &tables,
        &lens,
        &q,
        1,
    );
    assert_same_bits(&format!("{what}: chunked prefill vs decode"), &out, &decode);
}

#[test]
fn chunked_prefill_rows_match_float64_and_the_decode_bits() {
    chunked_body::<u16>(
        Geometry {
            num_heads: 7,
            num_kv_heads: 1,
            head_dim: 64,
            block_size: 16,
        },
        21,
    );
    chunked_body::<f32>(
        Geometry {
            num_heads: 6,
            num_kv_heads: 1,
            head_dim: 128,
            block_size: 32,
        },
        22,
    );
}
