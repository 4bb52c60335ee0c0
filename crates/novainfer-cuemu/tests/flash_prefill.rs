//! kernels/flash_prefill.cu run by the emulator (ldmatrix, mma.sync and cp.async as the PTX
//! ISA defines them) against a float64 attention and the kernel's Rust twin
//! (`flash_plan::emulate`): Qwen2's head geometries, lengths around the 64-row tiles,
//! prefix-cached starts, and one prompt in one chunk or two (the same bits).

mod common;

use common::{addr, Aligned, Rng};
use half::bf16;
use novainfer_cuda::flash_plan::{self, emulate, PoolRef, QueryRef};
use novainfer_cuemu::kernels::flash_prefill::{
    flash_prefill_bf16_hd128, flash_prefill_bf16_hd64, FlashShape,
};
use novainfer_cuemu::{launch, Dim3};

#[derive(Clone, Copy, Debug)]
struct Geometry {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

/// A pool holding whole sequences in scrambled blocks, and every position's query.
struct Case {
    g: Geometry,
    k: Vec<bf16>,
    v: Vec<bf16>,
    tables: Vec<i32>,
    max_blocks: usize,
    q_all: Vec<Vec<bf16>>,
}

/// One launch's query tokens: positions `starts[s] .. ends[s]` of each sequence.
struct Step {
    q: Vec<bf16>,
    qsl: Vec<i32>,
    positions: Vec<i32>,
    seq_lens: Vec<i32>,
}

impl Case {
    fn new(g: Geometry, lens: &[usize], seed: u64) -> Self {
        let mut rng = Rng(seed);
        let blocks = |l: usize| l.div_ceil(g.block_size);
        let max_blocks = lens.iter().map(|&l| blocks(l)).max().unwrap_or(0) + 1;
        let total = lens.iter().map(|&l| blocks(l)).sum::<usize>() + 2;
        let n = total * g.block_size * g.num_kv_heads * g.head_dim;
        let (k, v) = (rng.bf16s(n, 1.0), rng.bf16s(n, 1.0));
        let mut ids: Vec<i32> = (0..total as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut tables = vec![-1i32; lens.len() * max_blocks];
        let mut next = 0;
        for (s, &l) in lens.iter().enumerate() {
            for b in 0..blocks(l) {
                tables[s * max_blocks + b] = ids[next];
                next += 1;
            }
        }
        let q_all = lens
            .iter()
            .map(|&l| rng.bf16s(l * g.num_heads * g.head_dim, 2.0))
            .collect();
        Case {
            g,
            k,
            v,
            tables,
            max_blocks,
            q_all,
        }
    }

    fn step(&self, starts: &[usize], ends: &[usize]) -> Step {
        let row = self.g.num_heads * self.g.head_dim;
        let (mut q, mut qsl, mut positions) = (Vec::new(), vec![0i32], Vec::new());
        for (s, (&a, &b)) in starts.iter().zip(ends).enumerate() {
            q.extend_from_slice(&self.q_all[s][a * row..b * row]);
            positions.extend(a as i32..b as i32);
            qsl.push(positions.len() as i32);
        }
        Step {
            q,
            qsl,
            positions,
            seq_lens: ends.iter().map(|&e| e as i32).collect(),
        }
    }

    /// The kernel, launched as `ops::flash_prefill` launches it.
    fn run(&self, s: &Step) -> Vec<bf16> {
        let g = self.g;
        let num_tokens = s.positions.len();
        let num_seqs = s.seq_lens.len();
        let group = g.num_heads / g.num_kv_heads;
        let slot_len = g.block_size * g.num_kv_heads * g.head_dim;
        let shape = FlashShape {
            num_heads: g.num_heads as i32,
            num_kv_heads: g.num_kv_heads as i32,
            block_size: g.block_size as i32,
            num_blocks: (self.k.len() / slot_len) as i32,
            max_blocks_per_seq: self.max_blocks as i32,
            scale_log2: flash_plan::scale_log2(g.head_dim),
        };
        let (q, k, v) = (
            Aligned::new(&s.q),
            Aligned::new(&self.k),
            Aligned::new(&self.v),
        );
        let mut out = Aligned::new(&vec![bf16::ZERO; s.q.len()]);
        let kernel = match g.head_dim {
            64 => flash_prefill_bf16_hd64,
            128 => flash_prefill_bf16_hd128,
            other => panic!("no flash kernel for head_dim {other}"),
        };
        let p = (
            addr(q.ptr()),
            addr(k.ptr()),
            addr(v.ptr()),
            addr(self.tables.as_ptr()),
            addr(s.seq_lens.as_ptr()),
            addr(s.qsl.as_ptr()),
            addr(s.positions.as_ptr()),
            addr(out.mut_ptr()),
        );
        let grid = Dim3::xy(
            flash_plan::grid_tiles(num_tokens, num_seqs, group) as u32,
            g.num_kv_heads as u32,
        );
        launch(grid, Dim3::x((flash_plan::WARPS * 32) as u32), || unsafe {
            kernel(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                p.5 as _,
                p.6 as _,
                p.7 as _,
                num_tokens as i32,
                num_seqs as i32,
                shape,
            )
        })
        .expect("the flash prefill launch");
        out.to_vec()
    }

    fn twin(&self, s: &Step) -> Vec<f32> {
        let qr = QueryRef {
            q: &s.q,
            query_start_loc: &s.qsl,
            positions: &s.positions,
            num_heads: self.g.num_heads,
        };
        let pool = PoolRef {
            k: &self.k,
            v: &self.v,
            block_tables: &self.tables,
            seq_lens: &s.seq_lens,
            block_size: self.g.block_size,
            max_blocks_per_seq: self.max_blocks,
            num_kv_heads: self.g.num_kv_heads,
            head_dim: self.g.head_dim,
        };
        emulate(&qr, &pool)
    }

    /// Causal attention in float64: each token sees its sequence's positions up to its own.
    fn reference(&self, s: &Step) -> Vec<f32> {
        let g = self.g;
        let hd = g.head_dim;
        let group = g.num_heads / g.num_kv_heads;
        let mut out = vec![0f32; s.q.len()];
        for seq in 0..s.seq_lens.len() {
            let table = &self.tables[seq * self.max_blocks..(seq + 1) * self.max_blocks];
            let at = |pos: usize, kvh: usize| {
                let slot = table[pos / g.block_size] as usize * g.block_size + pos % g.block_size;
                (slot * g.num_kv_heads + kvh) * hd
            };
            for t in s.qsl[seq] as usize..s.qsl[seq + 1] as usize {
                let pos = s.positions[t] as usize;
                for h in 0..g.num_heads {
                    let q = &s.q[(t * g.num_heads + h) * hd..][..hd];
                    let kvh = h / group;
                    let scores: Vec<f64> = (0..=pos)
                        .map(|j| {
                            let k = &self.k[at(j, kvh)..][..hd];
                            q.iter()
                                .zip(k)
                                .map(|(a, b)| a.to_f64() * b.to_f64())
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for d in 0..hd {
                        let acc: f64 = (0..=pos)
                            .map(|j| w[j] * self.v[at(j, kvh) + d].to_f64())
                            .sum();
                        out[(t * g.num_heads + h) * hd + d] = (acc / sum) as f32;
                    }
                }
            }
        }
        out
    }
}

/// The kernel's documented tolerance (tests/flash_prefill.rs in novainfer-cuda): the output's
/// bf16 rounding plus P's rounding to bf16 for the tensor cores.
fn assert_close(what: &str, got: &[bf16], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        assert!(
            (g - w).abs() <= 1.6e-2 * w.abs() + 1.0 / 128.0,
            "{what}: element {i}: kernel {g} vs {w}"
        );
    }
}

const QWEN_05B: Geometry = Geometry {
    num_heads: 14,
    num_kv_heads: 2,
    head_dim: 64,
    block_size: 16,
};
const QWEN_15B: Geometry = Geometry {
    num_heads: 12,
    num_kv_heads: 2,
    head_dim: 128,
    block_size: 16,
};

#[test]
fn the_flash_prefill_kernel_computes_causal_attention_at_both_head_dims() {
    let lens = [1, 15, 64, 70];
    for (i, g) in [QWEN_05B, QWEN_15B].into_iter().enumerate() {
        let case = Case::new(g, &lens, 7 + i as u64);
        for starts in [[0, 0, 0, 0], [0, 3, 37, 64]] {
            let s = case.step(&starts, &lens);
            let got = case.run(&s);
            let what = format!("{g:?} starts {starts:?}");
            assert_close(&format!("{what}: vs float64"), &got, &case.reference(&s));
            assert_close(&format!("{what}: vs the twin"), &got, &case.twin(&s));
        }
    }
}

#[test]
fn the_flash_prefill_kernel_gives_the_same_bits_in_one_chunk_or_two() {
    let lens = [40, 77];
    let case = Case::new(QWEN_05B, &lens, 99);
    let whole = case.run(&case.step(&[0, 0], &lens));
    let first = case.run(&case.step(&[0, 0], &[17, 50]));
    let second = case.run(&case.step(&[17, 50], &lens));
    let row = QWEN_05B.num_heads * QWEN_05B.head_dim;
    // Reassemble the chunks in the whole launch's token order.
    let mut chunked = Vec::new();
    chunked.extend_from_slice(&first[..17 * row]);
    chunked.extend_from_slice(&second[..23 * row]);
    chunked.extend_from_slice(&first[17 * row..]);
    chunked.extend_from_slice(&second[23 * row..]);
    let differ = whole
        .iter()
        .zip(&chunked)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "chunked prefill changed {differ} values");
}
