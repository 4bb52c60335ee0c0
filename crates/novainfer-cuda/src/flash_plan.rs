//! CPU twin of `kernels/flash_prefill.cu`, the tensor-core prefill attention: the same index
//! arithmetic (which CTA takes which packed query rows, which key tiles it visits and masks,
//! where each key's slot is, which lane owns which element of an `mma.m16n8k16` fragment
//! after which `ldmatrix`) and [`emulate`], the kernel's whole algorithm in the same order
//! (64-key tiles from position 0, online softmax with exp2, P rounded to bf16, per-lane
//! partial sums) in f32. The kernel ran on no GPU when it was written; these functions are
//! what CI can check about it (`tests/flash_twin.rs`, and the unit tests below), and the
//! comments in the kernel name the function here each index expression mirrors.
//!
//! Packed rows: the query rows of one KV head's group, token-major: packed row `p` of a
//! sequence is its token `p / group`, query head `kv_head · group + p % group`.

use half::bf16;

/// Packed query rows per CTA (16 per warp: one `m16` row block each); `FLASH_BLOCK_M`.
pub const BLOCK_M: usize = 64;
/// Keys per tile; `FLASH_BLOCK_N`. Tiles start at absolute multiples of it.
pub const BLOCK_N: usize = 64;
/// Warps per CTA; `FLASH_WARPS`.
pub const WARPS: usize = 4;
/// bf16 of padding after each shared-memory row; `FLASH_PAD`.
pub const PAD: usize = 8;
/// Head dims the kernel is instantiated for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Packed-row tiles of one sequence of `n` query tokens (`seq_tiles`).
pub fn seq_tiles(n: i64, group: usize) -> usize {
    if n > 0 {
        (n as usize * group).div_ceil(BLOCK_M)
    } else {
        0
    }
}

/// The grid's x extent: an upper bound on Σ seq_tiles (each sequence wastes < 1 tile).
pub fn grid_tiles(num_tokens: usize, num_seqs: usize, group: usize) -> usize {
    (num_tokens * group).div_ceil(BLOCK_M) + num_seqs
}

/// A CTA's place: its sequence and its first packed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileAt {
    pub seq: usize,
    pub first_row: usize,
}

/// `locate_tile`: the kernel's warp scan, 32 sequences per step, spelled as it runs (lane
/// `l` of step `base` counts sequence `base + l`; the first lane whose inclusive total
/// passes `cta` wins). `None` past the last tile.
pub fn locate_tile(qsl: &[i32], group: usize, cta: usize) -> Option<TileAt> {
    let num_seqs = qsl.len().saturating_sub(1);
    let mut before = 0;
    for base in (0..num_seqs).step_by(32) {
        let tiles: Vec<usize> = (0..32)
            .map(|lane| {
                let s = base + lane;
                if s < num_seqs {
                    seq_tiles(i64::from(qsl[s + 1]) - i64::from(qsl[s]), group)
                } else {
                    0
                }
            })
            .collect();
        let incl: Vec<usize> = tiles
            .iter()
            .scan(0, |acc, &t| {
                *acc += t;
                Some(*acc)
            })
            .collect();
        let total = incl[31];
        if cta < before + total {
            let lane = (0..32).find(|&l| before + incl[l] > cta)?;
            let excl = incl[lane] - tiles[lane];
            return Some(TileAt {
                seq: base + lane,
                first_row: (cta - before - excl) * BLOCK_M,
            });
        }
        before += total;
    }
    None
}

/// Token (index into the batch) and query head of packed row `p` of a sequence whose first
/// token is `token0`.
pub fn packed_row(token0: usize, p: usize, group: usize, kv_head: usize) -> (usize, usize) {
    (token0 + p / group, kv_head * group + p % group)
}

/// The pool and tables of one layer, as the kernel reads them.
#[derive(Debug, Clone, Copy)]
pub struct PoolRef<'a> {
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`
    pub k: &'a [bf16],
    pub v: &'a [bf16],
    /// `[num_seqs, max_blocks_per_seq]`
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl PoolRef<'_> {
    pub fn num_blocks(&self) -> usize {
        self.k.len() / (self.block_size * self.num_kv_heads * self.head_dim).max(1)
    }

    /// `flash_slot`: the slot of position `pos` of sequence `seq`, `None` past its table row
    /// or for a block outside the pool (the kernel then zero-fills and masks the key).
    pub fn slot(&self, seq: usize, pos: i64) -> Option<usize> {
        if pos < 0 {
            return None;
        }
        let index = pos as usize / self.block_size;
        if index >= self.max_blocks_per_seq {
            return None;
        }
        let block = self.block_tables[seq * self.max_blocks_per_seq + index];
        if block < 0 || block as usize >= self.num_blocks() {
            return None;
        }
        Some(block as usize * self.block_size + pos as usize % self.block_size)
    }

    /// Element offset of `kv_head`'s row at `slot` in K or V.
    pub fn row_offset(&self, slot: usize, kv_head: usize) -> usize {
        slot * self.num_kv_heads * self.head_dim + kv_head * self.head_dim
    }
}

/// The query side of a launch.
#[derive(Debug, Clone, Copy)]
pub struct QueryRef<'a> {
    /// `[num_tokens, num_heads, head_dim]`
    pub q: &'a [bf16],
    /// `[num_seqs + 1]`
    pub query_start_loc: &'a [i32],
    /// `[num_tokens]`
    pub positions: &'a [i32],
    pub num_heads: usize,
}

/// What one CTA knows before its key loop: its rows' limits and the visited key range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtaPlan {
    pub at: TileAt,
    pub kv_head: usize,
    pub token0: usize,
    /// Per packed row of the tile: keys `0..limit` are visible; −1 past the sequence.
    pub limits: [i32; BLOCK_M],
    /// Max limit: tiles from here on are skipped.
    pub kv_end: usize,
    /// Min limit over real rows: tiles ending at or before it need no causal mask.
    pub full_end: usize,
}

/// The plan of CTA `(cta, kv_head)`, `None` for a CTA past the last tile.
pub fn cta_plan(
    qr: &QueryRef<'_>,
    pool: &PoolRef<'_>,
    cta: usize,
    kv_head: usize,
) -> Option<CtaPlan> {
    let group = qr.num_heads / pool.num_kv_heads;
    let at = locate_tile(qr.query_start_loc, group, cta)?;
    let token0 = qr.query_start_loc[at.seq] as usize;
    let packed_rows = (qr.query_start_loc[at.seq + 1] as usize - token0) * group;
    let num_tokens = qr.positions.len();
    let mut limits = [-1i32; BLOCK_M];
    for (r, lim) in limits.iter_mut().enumerate() {
        let p = at.first_row + r;
        if p < packed_rows {
            let (token, _) = packed_row(token0, p, group, kv_head);
            *lim = if token < num_tokens {
                (qr.positions[token].saturating_add(1))
                    .min(pool.seq_lens[at.seq])
                    .max(0)
            } else {
                -1
            };
        }
    }
    let kv_end = limits.iter().copied().max().unwrap_or(-1).max(0) as usize;
    let full_end = limits
        .iter()
        .copied()
        .filter(|&l| l >= 0)
        .min()
        .unwrap_or(i32::MAX) as usize;
    Some(CtaPlan {
        at,
        kv_head,
        token0,
        limits,
        kv_end,
        full_end,
    })
}

/// How the kernel treats a visited key tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKind {
    /// Every row sees every key: no mask evaluated.
    Full,
    /// Diagonal (some row's limit inside or before it) or a key missing from the pool.
    Masked,
}

/// The key tiles a CTA visits, in order: `k0 = 0, 64, …` below `kv_end`.
pub fn key_tiles(plan: &CtaPlan) -> impl Iterator<Item = usize> {
    (0..plan.kv_end.div_ceil(BLOCK_N)).map(|j| j * BLOCK_N)
}

/// The kernel's test `!(k0 + 64 <= full_end && all_present)`.
pub fn tile_kind(plan: &CtaPlan, k0: usize, all_present: bool) -> TileKind {
    if k0 + BLOCK_N <= plan.full_end && all_present {
        TileKind::Full
    } else {
        TileKind::Masked
    }
}

/// Slots of the tile's 64 keys as `load_kv_tile` computes them (`None`: zero-filled, not
/// present — past `kv_end` or without a slot).
pub fn tile_slots(plan: &CtaPlan, pool: &PoolRef<'_>, k0: usize) -> [Option<usize>; BLOCK_N] {
    std::array::from_fn(|key| {
        let pos = k0 + key;
        if pos < plan.kv_end {
            pool.slot(plan.at.seq, pos as i64)
        } else {
            None
        }
    })
}

/// Whether row `r` counts key `k0 + key` on a tile of `kind` (`present`: the key has a slot).
/// On a full tile the kernel evaluates nothing: every key counts.
pub fn counts(
    plan: &CtaPlan,
    kind: TileKind,
    r: usize,
    k0: usize,
    key: usize,
    present: bool,
) -> bool {
    match kind {
        TileKind::Full => true,
        TileKind::Masked => present && ((k0 + key) as i64) < i64::from(plan.limits[r]),
    }
}

// ---- mma.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", .bf16) ------

/// (row, column) of the A element (16×16, row-major) in register `reg` (0..4), half `half`
/// (0: low 16 bits) of `lane`.
pub fn a_frag(lane: usize, reg: usize, half: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (reg % 2), 2 * t + half + 8 * (reg / 2))
}

/// (k, n) of the B element (16×8) in register `reg` (0..2), half `half` of `lane`.
pub fn b_frag(lane: usize, reg: usize, half: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (2 * t + half + 8 * reg, g)
}

/// (row, column) of the C/D element (16×8, f32) in register `reg` (0..4) of `lane`.
pub fn c_frag(lane: usize, reg: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (reg / 2), 2 * t + reg % 2)
}

/// `ldmatrix.x4` (`trans` for `.trans`): the (row, column) of shared memory that lands in
/// register `reg`, half `half` of `lane`, when lane `i` supplies the address `addr(i)` (a row
/// start) — lanes 8m .. 8m + 7 give the 8 rows of matrix m.
pub fn ldmatrix_x4(
    addr: impl Fn(usize) -> (usize, usize),
    trans: bool,
    lane: usize,
    reg: usize,
    half: usize,
) -> (usize, usize) {
    let (row_in, col_in) = if trans {
        (2 * (lane % 4) + half, lane / 4)
    } else {
        (lane / 4, 2 * (lane % 4) + half)
    };
    let (r, c) = addr(8 * reg + row_in);
    (r, c + col_in)
}

/// The kernel's ldmatrix address of `lane` for the Q (A) operand: (row, dim) within the
/// warp's 16 rows and the k-step's 16 dims.
pub fn q_addr(lane: usize) -> (usize, usize) {
    ((lane % 8) + ((lane / 8) % 2) * 8, (lane / 16) * 8)
}

/// The kernel's ldmatrix address of `lane` for the K (B of Q·Kᵀ) operand: (key, dim) within a
/// 16-key pair of n-tiles and the k-step's 16 dims.
pub fn k_addr(lane: usize) -> (usize, usize) {
    ((lane % 8) + (lane / 16) * 8, ((lane / 8) % 2) * 8)
}

/// The kernel's `.trans` ldmatrix address of `lane` for the V (B of P·V) operand: (key, dim)
/// within the k-step's 16 keys and a 16-dim pair of n-tiles.
pub fn v_addr(lane: usize) -> (usize, usize) {
    ((lane % 8) + ((lane / 8) % 2) * 8, (lane / 16) * 8)
}

// ---- The algorithm -------------------------------------------------------------------------

/// `ex2.approx` stands in as `f32::exp2` (the hardware's is within 2 ulp).
fn ex2(x: f32) -> f32 {
    x.exp2()
}

/// `log2(e) / sqrt(head_dim)`: the kernel's `scale_log2`.
pub fn scale_log2(head_dim: usize) -> f32 {
    std::f32::consts::LOG2_E / (head_dim as f32).sqrt()
}

/// The kernel on the CPU: `[num_tokens, num_heads, head_dim]` as f32 (each value a bf16).
/// Every CTA of the grid is run (CTAs past the last tile do nothing); each writes its rows.
pub fn emulate(qr: &QueryRef<'_>, pool: &PoolRef<'_>) -> Vec<f32> {
    let hd = pool.head_dim;
    let num_tokens = qr.positions.len();
    let group = qr.num_heads / pool.num_kv_heads;
    let num_seqs = qr.query_start_loc.len().saturating_sub(1);
    let mut out = vec![0f32; num_tokens * qr.num_heads * hd];
    for kv_head in 0..pool.num_kv_heads {
        for cta in 0..grid_tiles(num_tokens, num_seqs, group) {
            if let Some(plan) = cta_plan(qr, pool, cta, kv_head) {
                run_cta(qr, pool, &plan, &mut out);
            }
        }
    }
    out
}

/// One CTA: per row the state (m, 4 per-lane partial l's, o), updated tile by tile.
fn run_cta(qr: &QueryRef<'_>, pool: &PoolRef<'_>, plan: &CtaPlan, out: &mut [f32]) {
    let hd = pool.head_dim;
    let group = qr.num_heads / pool.num_kv_heads;
    let c = scale_log2(hd);
    let q_row = |r: usize| -> Option<Vec<f32>> {
        if plan.limits[r] < 0 {
            return None;
        }
        let (token, head) = packed_row(plan.token0, plan.at.first_row + r, group, plan.kv_head);
        let at = (token * qr.num_heads + head) * hd;
        Some(qr.q[at..at + hd].iter().map(|x| x.to_f32()).collect())
    };
    let qs: Vec<Option<Vec<f32>>> = (0..BLOCK_M).map(q_row).collect();
    let mut m = [f32::NEG_INFINITY; BLOCK_M];
    let mut l = [[0f32; 4]; BLOCK_M];
    let mut o = vec![vec![0f32; hd]; BLOCK_M];
    for k0 in key_tiles(plan) {
        let slots = tile_slots(plan, pool, k0);
        let all_present = slots.iter().all(Option::is_some);
        let kind = tile_kind(plan, k0, all_present);
        let load = |cache: &[bf16], key: usize| -> Vec<f32> {
            match slots[key] {
                Some(slot) => {
                    let at = pool.row_offset(slot, plan.kv_head);
                    cache[at..at + hd].iter().map(|x| x.to_f32()).collect()
                }
                None => vec![0.0; hd],
            }
        };
        let ks: Vec<Vec<f32>> = (0..BLOCK_N).map(|j| load(pool.k, j)).collect();
        let vs: Vec<Vec<f32>> = (0..BLOCK_N).map(|j| load(pool.v, j)).collect();
        for r in 0..BLOCK_M {
            // Rows past the sequence run on zeros in the kernel and store nothing.
            let Some(q) = &qs[r] else { continue };
            let s: Vec<f32> = (0..BLOCK_N)
                .map(|j| {
                    if counts(plan, kind, r, k0, j, slots[j].is_some()) {
                        q.iter().zip(&ks[j]).map(|(a, b)| a * b).sum()
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mn = m[r].max(mx);
            let reference = if mn == f32::NEG_INFINITY { 0.0 } else { mn };
            let alpha = ex2((m[r] - reference) * c);
            let neg = -(reference * c);
            m[r] = mn;
            let p: Vec<f32> = s
                .iter()
                .map(|&x| bf16::from_f32(ex2(x.mul_add(c, neg))).to_f32())
                .collect();
            // Lane t of the row's quad owns columns 8n + 2t, 8n + 2t + 1 of n-tile n.
            for (t, lt) in l[r].iter_mut().enumerate() {
                let mut sum = 0f32;
                for n in 0..BLOCK_N / 8 {
                    sum = (sum + p[8 * n + 2 * t]) + p[8 * n + 2 * t + 1];
                }
                *lt = lt.mul_add(alpha, sum);
            }
            for (d, od) in o[r].iter_mut().enumerate() {
                let pv: f32 = (0..BLOCK_N).map(|j| p[j] * vs[j][d]).sum();
                *od = *od * alpha + pv;
            }
        }
    }
    for r in 0..BLOCK_M {
        if plan.limits[r] < 0 {
            continue;
        }
        let lsum = (l[r][0] + l[r][1]) + (l[r][2] + l[r][3]);
        let empty = plan.limits[r] == 0 || lsum == 0.0;
        let (token, head) = packed_row(plan.token0, plan.at.first_row + r, group, plan.kv_head);
        let at = (token * qr.num_heads + head) * hd;
        for d in 0..hd {
            let x = if empty { 0.0 } else { o[r][d] / lsum };
            out[at + d] = bf16::from_f32(x).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = include_str!("../../../kernels/flash_prefill.cu");

    #[test]
    fn constants_and_address_expressions_are_the_kernels() {
        for line in [
            format!("#define FLASH_BLOCK_M {BLOCK_M}\n"),
            format!("#define FLASH_BLOCK_N {BLOCK_N}\n"),
            format!("#define FLASH_WARPS {WARPS}\n"),
            format!("#define FLASH_PAD {PAD}\n"),
            // q_addr, k_addr, v_addr as the kernel spells them.
            "const int row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;".to_owned(),
            "const int col = kk * 16 + (lane / 16) * 8;".to_owned(),
            "const int key = np * 16 + (lane % 8) + (lane / 16) * 8;".to_owned(),
            "const int dim = kk * 16 + ((lane / 8) % 2) * 8;".to_owned(),
            "const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;".to_owned(),
            "const int dim = dp * 16 + (lane / 16) * 8;".to_owned(),
            "ldmatrix_x4_trans(b, vs + key * ROW + dim);".to_owned(),
            "pa[n / 2][(n % 2) * 2] = top;".to_owned(),
            "pa[n / 2][(n % 2) * 2 + 1] = bot;".to_owned(),
        ] {
            assert!(KERNEL.contains(&line), "kernel lacks `{line}`");
        }
    }

    /// ldmatrix with the kernel's Q addresses gives every lane the A fragment PTX documents.
    #[test]
    fn q_ldmatrix_yields_the_a_fragment() {
        for lane in 0..32 {
            for reg in 0..4 {
                for half in 0..2 {
                    assert_eq!(
                        ldmatrix_x4(q_addr, false, lane, reg, half),
                        a_frag(lane, reg, half),
                        "lane {lane} reg {reg} half {half}"
                    );
                }
            }
        }
    }

    /// ldmatrix of K rows (key, dim) with the kernel's addresses: registers 0, 1 are B of the
    /// first 8 keys, 2, 3 of the next 8 (B's k is the dim, its n the key).
    #[test]
    fn k_ldmatrix_yields_the_b_fragments_of_two_n_tiles() {
        for lane in 0..32 {
            for reg in 0..4 {
                for half in 0..2 {
                    let (key, dim) = ldmatrix_x4(k_addr, false, lane, reg, half);
                    let (k, n) = b_frag(lane, reg % 2, half);
                    assert_eq!((key, dim), (n + 8 * (reg / 2), k), "lane {lane} reg {reg}");
                }
            }
        }
    }

    /// `.trans` ldmatrix of V rows (key, dim): registers 0, 1 are B (k = key, n = dim) of the
    /// first 8 dims, 2, 3 of the next 8.
    #[test]
    fn v_ldmatrix_trans_yields_the_b_fragments_of_two_n_tiles() {
        for lane in 0..32 {
            for reg in 0..4 {
                for half in 0..2 {
                    let (key, dim) = ldmatrix_x4(v_addr, true, lane, reg, half);
                    let (k, n) = b_frag(lane, reg % 2, half);
                    assert_eq!((key, dim), (k, n + 8 * (reg / 2)), "lane {lane} reg {reg}");
                }
            }
        }
    }

    /// P goes from S's accumulators to the A operand without a shuffle: A register `reg` of
    /// k-step kk is S n-tile 2kk + reg / 2, rows g (c0, c1) or g + 8 (c2, c3) — what
    /// `pa[n / 2][(n % 2) * 2 + (bottom)] = pack(c[2·bottom], c[2·bottom + 1])` does.
    #[test]
    fn s_accumulators_are_the_p_operand() {
        for lane in 0..32 {
            for reg in 0..4 {
                for half in 0..2 {
                    let n_tile = reg / 2; // within the k-step's two n-tiles
                    let bottom = reg % 2;
                    let (row, col) = c_frag(lane, 2 * bottom + half);
                    assert_eq!(a_frag(lane, reg, half), (row, col + 8 * n_tile));
                }
            }
        }
    }

    /// Each C element has exactly one owner, and the store's (row r0 + 8·half, dims
    /// 8d + 2·tig + e) is c_frag.
    #[test]
    fn c_fragment_is_a_bijection_and_the_store_follows_it() {
        let mut seen = [[0u8; 8]; 16];
        for lane in 0..32 {
            for reg in 0..4 {
                let (r, c) = c_frag(lane, reg);
                seen[r][c] += 1;
                assert_eq!((r, c), (lane / 4 + 8 * (reg / 2), 2 * (lane % 4) + reg % 2));
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1));
    }

    #[test]
    fn locate_tile_walks_sequences_in_order() {
        // Sequences of 3, 0, 40 and 1 tokens, group 7: 21 → 1 tile, 0, 280 → 5, 7 → 1.
        let qsl = [0, 3, 3, 43, 44];
        let found: Vec<Option<TileAt>> = (0..8).map(|c| locate_tile(&qsl, 7, c)).collect();
        let at = |seq, first_row| Some(TileAt { seq, first_row });
        assert_eq!(
            found,
            vec![
                at(0, 0),
                at(2, 0),
                at(2, 64),
                at(2, 128),
                at(2, 192),
                at(2, 256),
                at(3, 0),
                None
            ]
        );
        assert!(grid_tiles(44, 4, 7) >= 7);
        // More than 32 sequences: the scan carries its total across steps.
        let qsl: Vec<i32> = (0..=70).map(|i| i * 10).collect();
        for cta in 0..70 {
            assert_eq!(locate_tile(&qsl, 1, cta), at(cta, 0));
        }
        assert_eq!(locate_tile(&qsl, 1, 70), None);
    }
}
