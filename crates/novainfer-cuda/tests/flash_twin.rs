//! The CPU twin of `kernels/flash_prefill.cu` (`novainfer_cuda::flash_plan`), no GPU needed:
//! its tile walk visits every (query, key) pair the causal mask allows exactly once and lets
//! no other pair count; its emulation of the whole kernel matches the plain CPU attention
//! (`novainfer_model::layers::attention`) within bf16 rounding at the Qwen2 geometries, with
//! prefix-cached starts and several sequences per launch; and a prompt run in one chunk or
//! in several gives the same bits (tiles sit at absolute positions; rows are independent).

use half::bf16;
use novainfer_cuda::flash_plan::{
    self, counts, cta_plan, emulate, grid_tiles, key_tiles, packed_row, tile_kind, tile_slots,
    PoolRef, QueryRef, BLOCK_M, BLOCK_N,
};
use novainfer_model::layers;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.f32() * scale)).collect()
    }
}

#[derive(Clone, Copy, Debug)]
struct Geometry {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

/// Qwen2.5-0.5B, 1.5B and 7B heads, and plain multi-head attention.
const GEOMETRIES: [Geometry; 4] = [
    Geometry {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
    },
    Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 32,
    },
    Geometry {
        num_heads: 28,
        num_kv_heads: 4,
        head_dim: 128,
        block_size: 16,
    },
    Geometry {
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
    },
];

/// A pool holding whole sequences (blocks handed out in a scrambled order) and one launch's
/// queries: sequence s has `starts[s]` cached positions and `chunks[s]` new tokens.
struct Case {
    g: Geometry,
    k: Vec<bf16>,
    v: Vec<bf16>,
    tables: Vec<i32>,
    max_blocks: usize,
    /// Every position's query of every sequence: [seq][pos][num_heads · head_dim].
    q_all: Vec<Vec<Vec<bf16>>>,
}

impl Case {
    fn new(g: Geometry, lens: &[usize], seed: u64) -> Self {
        let mut rng = Rng(seed);
        let max_blocks = lens
            .iter()
            .map(|l| l.div_ceil(g.block_size))
            .max()
            .unwrap_or(0)
            + 1;
        let total: usize = lens.iter().map(|l| l.div_ceil(g.block_size)).sum::<usize>() + 3;
        let row = g.num_kv_heads * g.head_dim;
        let k = rng.bf16s(total * g.block_size * row, 1.0);
        let v = rng.bf16s(total * g.block_size * row, 1.0);
        // Block ids in a scrambled order: slot arithmetic must follow the table.
        let mut ids: Vec<i32> = (0..total as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.next() as usize % (i + 1));
        }
        let mut tables = vec![-1i32; lens.len() * max_blocks];
        let mut next = 0;
        for (s, l) in lens.iter().enumerate() {
            for b in 0..l.div_ceil(g.block_size) {
                tables[s * max_blocks + b] = ids[next];
                next += 1;
            }
        }
        let q_all = lens
            .iter()
            .map(|&l| {
                (0..l)
                    .map(|_| rng.bf16s(g.num_heads * g.head_dim, 2.0))
                    .collect()
            })
            .collect();
        Self {
            g,
            k,
            v,
            tables,
            max_blocks,
            q_all,
        }
    }

    fn pool<'a>(&'a self, seq_lens: &'a [i32]) -> PoolRef<'a> {
        PoolRef {
            k: &self.k,
            v: &self.v,
            block_tables: &self.tables,
            seq_lens,
            block_size: self.g.block_size,
            max_blocks_per_seq: self.max_blocks,
            num_kv_heads: self.g.num_kv_heads,
            head_dim: self.g.head_dim,
        }
    }

    /// One launch: positions `starts[s] .. ends[s]` of each sequence as its query tokens.
    fn launch(&self, starts: &[usize], ends: &[usize]) -> Launch {
        let mut q = Vec::new();
        let mut qsl = vec![0i32];
        let mut positions = Vec::new();
        for (s, (&a, &b)) in starts.iter().zip(ends).enumerate() {
            for p in a..b {
                q.extend_from_slice(&self.q_all[s][p]);
                positions.push(p as i32);
            }
            qsl.push(positions.len() as i32);
        }
        Launch {
            q,
            qsl,
            positions,
            seq_lens: ends.iter().map(|&e| e as i32).collect(),
        }
    }

    fn emulate(&self, l: &Launch) -> Vec<f32> {
        emulate(&l.query(self.g), &self.pool(&l.seq_lens))
    }

    /// The plain CPU attention of the same rows.
    fn reference(&self, l: &Launch) -> Vec<f32> {
        let g = self.g;
        let k32: Vec<f32> = self.k.iter().map(|x| x.to_f32()).collect();
        let v32: Vec<f32> = self.v.iter().map(|x| x.to_f32()).collect();
        let views: Vec<View> = (0..l.seq_lens.len())
            .map(|s| View {
                k: &k32,
                v: &v32,
                table: &self.tables[s * self.max_blocks..(s + 1) * self.max_blocks],
                g,
            })
            .collect();
        let rows: Vec<layers::QueryRow> = (0..l.positions.len())
            .map(|t| layers::QueryRow {
                position: l.positions[t] as usize,
                seq: (0..l.seq_lens.len())
                    .rfind(|&s| l.qsl[s] as usize <= t)
                    .unwrap_or(0),
            })
            .collect();
        let q32: Vec<f32> = l.q.iter().map(|x| x.to_f32()).collect();
        layers::attention(
            &q32,
            &rows,
            &views,
            layers::AttentionShape {
                num_heads: g.num_heads,
                num_kv_heads: g.num_kv_heads,
                head_dim: g.head_dim,
            },
        )
    }
}

struct Launch {
    q: Vec<bf16>,
    qsl: Vec<i32>,
    positions: Vec<i32>,
    seq_lens: Vec<i32>,
}

impl Launch {
    fn query(&self, g: Geometry) -> QueryRef<'_> {
        QueryRef {
            q: &self.q,
            query_start_loc: &self.qsl,
            positions: &self.positions,
            num_heads: g.num_heads,
        }
    }
}

struct View<'a> {
    k: &'a [f32],
    v: &'a [f32],
    table: &'a [i32],
    g: Geometry,
}

impl View<'_> {
    fn at(&self, pos: usize, kv_head: usize) -> usize {
        let g = self.g;
        let slot = self.table[pos / g.block_size] as usize * g.block_size + pos % g.block_size;
        (slot * g.num_kv_heads + kv_head) * g.head_dim
    }
}

impl layers::KvView for View<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.k[o..o + self.g.head_dim]
    }
    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.v[o..o + self.g.head_dim]
    }
}

/// The documented tolerance of the flash kernel against the f32 oracle, for values V in
/// [-1, 1): the output's bf16 rounding (2^-9 relative, 1.6e-2 leaves room for the inputs'),
/// plus P's rounding to bf16 for the tensor cores: each weight moves by up to 2^-9 of itself,
/// which moves the weighted average by up to 2^-9 · max|V − out|, at worst 2^-8 for V in
/// [-1, 1); 2^-7 leaves a factor of two for the GPU's ex2.approx and summation order. Short
/// histories show it most (no averaging over many keys).
pub const FLASH_RTOL: f32 = 1.6e-2;
pub const FLASH_ATOL: f32 = 1.0 / 128.0;

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        worst = worst.max(err);
        assert!(
            err <= FLASH_RTOL * w.abs() + FLASH_ATOL,
            "{what}: element {i}: twin {g} vs reference {w}"
        );
    }
    println!("{what}: max abs error {worst:.2e}");
}

/// Lengths and cached prefixes of the batch: one token, a partial tile, exactly one tile, a
/// tile plus one, and long ones behind cached prefixes that start mid-tile and mid-block.
const LENS: [usize; 6] = [1, 15, 64, 65, 300, 257];
const STARTS: [usize; 6] = [0, 0, 0, 0, 37, 128];

#[test]
fn the_twin_matches_the_cpu_attention() {
    for (i, g) in GEOMETRIES.into_iter().enumerate() {
        let case = Case::new(g, &LENS, 100 + i as u64);
        let launch = case.launch(&STARTS, &LENS);
        assert_close(
            &format!("{g:?}"),
            &case.emulate(&launch),
            &case.reference(&launch),
        );
    }
}

#[test]
fn a_prompt_in_chunks_gives_the_bits_of_one_chunk() {
    for (i, g) in GEOMETRIES.into_iter().enumerate() {
        let case = Case::new(g, &[300, 130], 200 + i as u64);
        let whole = case.emulate(&case.launch(&[0, 0], &[300, 130]));
        let row = g.num_heads * g.head_dim;
        // Chunk boundaries inside tiles, on tile boundaries, and of one token.
        for cuts in [
            vec![0, 100, 300],
            vec![0, 64, 128, 129, 300],
            vec![0, 1, 2, 299, 300],
        ] {
            let mut pieces = vec![Vec::new(); 2];
            for w in cuts.windows(2) {
                // Sequence 1 (130 tokens) is chunked at the same cuts, clipped.
                let (a1, b1) = (w[0].min(130), w[1].min(130));
                let out = case.emulate(&case.launch(&[w[0], a1], &[w[1], b1]));
                let n0 = (w[1] - w[0]) * row;
                pieces[0].extend_from_slice(&out[..n0]);
                pieces[1].extend_from_slice(&out[n0..]);
            }
            let chunked: Vec<f32> = pieces.concat();
            let same = chunked
                .iter()
                .zip(&whole)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{g:?}: cuts {cuts:?} change the result");
        }
    }
}

/// Every (token, head, key) the causal mask and the pool allow is counted exactly once, no
/// other pair is, and every output row is written by exactly one CTA row.
#[test]
fn the_tile_walk_covers_the_causal_mask_exactly_once() {
    for (i, g) in GEOMETRIES.into_iter().enumerate() {
        let case = Case::new(g, &LENS, 300 + i as u64);
        let mut tables_damaged = case.tables.clone();
        // A block outside the pool in sequence 4's table: its keys must not count.
        tables_damaged[4 * case.max_blocks + 1] = 1_000_000;
        let launch = case.launch(&STARTS, &LENS);
        let qr = launch.query(g);
        let mut pool = case.pool(&launch.seq_lens);
        pool.block_tables = &tables_damaged;
        let group = g.num_heads / g.num_kv_heads;
        let num_tokens = launch.positions.len();
        let mut seen = std::collections::HashMap::<(usize, usize, usize), u32>::new();
        let mut written = vec![0u32; num_tokens * g.num_heads];
        let (mut full, mut masked) = (0, 0);
        for kv_head in 0..g.num_kv_heads {
            for cta in 0..grid_tiles(num_tokens, LENS.len(), group) {
                let Some(plan) = cta_plan(&qr, &pool, cta, kv_head) else {
                    continue;
                };
                for r in 0..BLOCK_M {
                    if plan.limits[r] >= 0 {
                        let (t, h) = packed_row(plan.token0, plan.at.first_row + r, group, kv_head);
                        written[t * g.num_heads + h] += 1;
                    }
                }
                for k0 in key_tiles(&plan) {
                    let slots = tile_slots(&plan, &pool, k0);
                    let kind = tile_kind(&plan, k0, slots.iter().all(Option::is_some));
                    match kind {
                        flash_plan::TileKind::Full => full += 1,
                        flash_plan::TileKind::Masked => masked += 1,
                    }
                    for r in (0..BLOCK_M).filter(|&r| plan.limits[r] >= 0) {
                        let (t, h) = packed_row(plan.token0, plan.at.first_row + r, group, kv_head);
                        for (key, slot) in slots.iter().enumerate() {
                            if counts(&plan, kind, r, k0, key, slot.is_some()) {
                                *seen.entry((t, h, k0 + key)).or_default() += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(
            written.iter().all(|&n| n == 1),
            "{g:?}: a row written other than once"
        );
        assert!(
            full > 0 && masked > 0,
            "{g:?}: both tile kinds occur ({full} full, {masked} masked)"
        );
        let mut allowed_pairs = 0;
        for t in 0..num_tokens {
            let s = (0..LENS.len())
                .rfind(|&s| launch.qsl[s] as usize <= t)
                .unwrap_or(0);
            for h in 0..g.num_heads {
                for pos in 0..=LENS[s] + BLOCK_N {
                    let allowed =
                        pos <= launch.positions[t] as usize && pool.slot(s, pos as i64).is_some();
                    let n = seen.get(&(t, h, pos)).copied().unwrap_or(0);
                    assert_eq!(n, u32::from(allowed), "{g:?}: token {t} head {h} key {pos}");
                    allowed_pairs += usize::from(allowed);
                }
            }
        }
        // Nothing counted beyond the positions checked above.
        assert_eq!(
            seen.len(),
            allowed_pairs,
            "{g:?}: a pair past the history counted"
        );
    }
}
