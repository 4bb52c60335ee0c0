//! A kernel against the portable one, bit for bit, on a small fixed problem: how an ISA that
//! no test machine has run (AVX-512, written on a machine without it) proves itself on the
//! CPU that is about to use it.
//!
//! The problem touches every path of the ops where an ISA's order of operations could go
//! wrong: a GQA group, K and V read in place and through decoded copies, full and partial
//! tiles (a partial tile with a 16-wide pair and an odd group of 8, and one with a single
//! group), rows that end mid-tile at different places, register blocks of uneven rows, both
//! 2-chunk and 1-chunk value blocks (`head_dim` 48), a decode row split over two partitions
//! and merged, and the KV dtypes f16, q8_0 (one block a row) and bf16. Its tests check that
//! it catches plausible mistakes. It costs about a millisecond, once per process.

use super::*;
use crate::forward_batch::SpanOutput;
use crate::kv_dtype::KvStorage;
use crate::paged_kv::KvGeometry;

/// A group of 3 query heads; 48 = 3 chunks of 16 (a 2-chunk and a 1-chunk value block).
/// One KV head: a second would only double the cost (its offset is the driver's, not the
/// ops').
const SHAPE: AttentionShape = AttentionShape {
    num_heads: 3,
    num_kv_heads: 1,
    head_dim: 48,
};
const BLOCK_SIZE: usize = 16;
/// Per sequence: its length and the positions of its query tokens. Seven prompt tokens
/// ending in the second tile, which holds 23 positions (3 groups of 8: a pair and an odd
/// one), each row ending at a different place in it (21 rows: more than two register blocks
/// at either width, so K and V are read through decoded copies, in blocks of 7, or 5, 5, 5
/// and 6 for AVX2); one decode token at 260 (3 rows, K and V read in place): two partitions
/// stored as partials and merged, the second a tile of 5 positions (one group).
const SEQS: [(usize, std::ops::Range<usize>); 2] = [(55, 48..55), (261, 260..261)];
/// Every dtype whose decoding is the ISA's own code (f32 rows are copied).
const DTYPES: [KvStorage; 3] = [KvStorage::F16, KvStorage::Q8_0, KvStorage::Bf16];

/// `len` numbers in `-scale..scale`, a fixed sequence (splitmix64) per `seed`.
fn numbers(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            // 24 random bits → [0, 1).
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * unit - 1.0) * scale
        })
        .collect()
}

/// An attention problem: a pool (one layer), queries and batch, in one KV dtype. The
/// self-check's is [`Problem::new`]; the ISA selector times one of the model's own geometry
/// ([`Problem::with`]).
pub(super) struct Problem {
    shape: AttentionShape,
    k: Vec<u8>,
    v: Vec<u8>,
    dtype: KvStorage,
    q: Vec<f32>,
    positions: Vec<usize>,
    seqs: Vec<SeqSpan>,
}

impl Problem {
    /// The self-check's problem.
    fn new(dtype: KvStorage) -> Self {
        // The pool's blocks in a scrambled order (5 is prime to the 21 blocks).
        debug_assert_eq!(
            SEQS.iter()
                .map(|(len, _)| len.div_ceil(BLOCK_SIZE))
                .sum::<usize>(),
            21
        );
        Self::with(SHAPE, &SEQS, dtype)
    }

    /// Sequences `spec` (length, positions of the query tokens) of `shape` in `dtype`, with
    /// fixed pseudo-random keys, values and queries; blocks in a scrambled order when their
    /// number is prime to 5.
    pub(super) fn with(
        shape: AttentionShape,
        spec: &[(usize, std::ops::Range<usize>)],
        dtype: KvStorage,
    ) -> Self {
        let hd = shape.head_dim;
        let geo = KvGeometry::new(dtype, BLOCK_SIZE, hd, shape.num_kv_heads);
        let blocks: usize = spec.iter().map(|(len, _)| len.div_ceil(BLOCK_SIZE)).sum();
        let mut ids = (0..blocks as u32).map(|i| (i * 5 + 3) % blocks as u32);
        let (mut k, mut v) = (
            vec![0u8; blocks * BLOCK_SIZE * geo.slot_bytes],
            vec![0u8; blocks * BLOCK_SIZE * geo.slot_bytes],
        );
        let (mut q, mut positions, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (len, tokens)) in spec.iter().cloned().enumerate() {
            let table: Vec<u32> = ids.by_ref().take(len.div_ceil(BLOCK_SIZE)).collect();
            let seed = 10 * i as u64;
            // Keys large enough that the softmax is far from uniform.
            let rows = len * shape.num_kv_heads;
            let (kf, vf) = (
                numbers(rows * hd, seed, 4.0),
                numbers(rows * hd, seed + 1, 1.0),
            );
            for pos in 0..len {
                let slot = table[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE;
                for h in 0..shape.num_kv_heads {
                    let row = (pos * shape.num_kv_heads + h) * hd;
                    geo.write_key(&mut k, slot, h, &kf[row..row + hd]);
                    geo.write_value(&mut v, slot, h, &vf[row..row + hd]);
                }
            }
            seqs.push(SeqSpan {
                query_start: positions.len(),
                query_len: tokens.len(),
                block_table: table,
                output: SpanOutput::LastLogits,
                adapter: None,
            });
            q.extend(numbers(tokens.len() * shape.num_heads * hd, seed + 2, 1.0));
            positions.extend(tokens);
        }
        Self {
            shape,
            k,
            v,
            dtype,
            q,
            positions,
            seqs,
        }
    }

    /// # Safety
    /// The CPU has `k`'s ISA.
    pub(super) unsafe fn run<K: Kernel>(&self, k: K) -> Vec<f32> {
        let shape = self.shape;
        let layer = PoolLayer {
            k: &self.k,
            v: &self.v,
            geo: KvGeometry::new(self.dtype, BLOCK_SIZE, shape.head_dim, shape.num_kv_heads),
        };
        let (mut plan, mut out) = (Plan::default(), Vec::new());
        // SAFETY: forwarded.
        unsafe {
            attend(
                k,
                &self.q,
                &self.positions,
                &self.seqs,
                layer,
                shape,
                &mut plan,
                &mut out,
            )
        };
        out
    }
}

/// Whether `k` gives the portable kernel's output, bit for bit, on the problem in every KV
/// dtype.
///
/// # Safety
/// The CPU has `k`'s ISA.
pub(super) unsafe fn agrees<K: Kernel>(k: K) -> bool {
    DTYPES.into_iter().all(|dtype| {
        let problem = Problem::new(dtype);
        // SAFETY: forwarded; the portable kernel runs anywhere.
        let (got, want) = unsafe { (problem.run(k), problem.run(Scalar)) };
        got.len() == want.len()
            && got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::paged_attention::ops::{Avx2, Avx512, Keys, Rows, Trickle, GROUP, TILES};

    /// A mistake an ISA's ops could make; each must make the check fail.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Fault {
        /// The wrapper itself changes nothing.
        Nothing,
        /// The tile's sum with the documented vectors paired 0+2, 1+3 (what adding a tile's two
        /// 16-lane vectors first would give).
        SumPairing,
        /// One position past a row's end counted live.
        LiveLane,
        /// A merge rounded twice (multiply, then add).
        UnfusedMerge,
        /// The last number of every decoded row of this dtype off by one ulp.
        Decode(KvStorage),
    }

    /// The AVX2 ops with one [`Fault`] (inlined into the AVX2 entry points, like the ops).
    #[derive(Clone, Copy)]
    struct Faulty(Fault);

    impl AttnOps for Faulty {
        #[inline(always)]
        unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
            // SAFETY (every method): the tests run these only where AVX2 was detected.
            unsafe { Avx2.decode_row(dtype, src, dst) };
            if self.0 == Fault::Decode(dtype) {
                let last = dst.len() - 1;
                dst[last] = f32::from_bits(dst[last].to_bits() ^ 1);
            }
        }

        #[inline(always)]
        unsafe fn transpose(self, k: Rows, hd: usize, groups: usize, kt: &mut [f32]) {
            // SAFETY: as above.
            unsafe { Avx2.transpose(k, hd, groups, kt) };
            // A key's last number, decoded wrong (AVX2 keeps the portable layout).
            if self.0 == Fault::Decode(k.dtype) {
                for g in 0..groups {
                    for x in &mut kt[g * GROUP * hd + (hd - 1) * GROUP..][..GROUP] {
                        *x = f32::from_bits(x.to_bits() ^ 1);
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn scores(
            self,
            q: &[f32],
            hd: usize,
            rows: usize,
            keys: Keys,
            groups: usize,
            s: &mut [f32],
            ahead: &mut Trickle,
        ) {
            let Keys::Tiled { at, dtype } = keys else {
                // SAFETY: as above (transposed keys took their fault in `transpose`).
                return unsafe { Avx2.scores(q, hd, rows, keys, groups, s, ahead) };
            };
            if self.0 != Fault::Decode(dtype.storage()) {
                // SAFETY: as above.
                return unsafe { Avx2.scores(q, hd, rows, keys, groups, s, ahead) };
            }
            // Tiled keys decoded wrong, through `decode_row`'s fault: every key's last number.
            let numbers = KEY_TILE * hd;
            let mut copy = vec![0f32; TILES * numbers];
            let mut ptrs = [std::ptr::null(); TILES];
            for ((tile, src), dst) in copy.chunks_exact_mut(numbers).zip(at).zip(&mut ptrs) {
                // SAFETY: as above; a tile holds `numbers` numbers (`Keys`).
                unsafe {
                    let bytes = std::slice::from_raw_parts(*src, numbers * dtype.size());
                    Avx2.decode_row(dtype.storage(), bytes, tile);
                }
                for x in &mut tile[(hd - 1) * KEY_TILE..] {
                    *x = f32::from_bits(x.to_bits() ^ 1);
                }
                *dst = tile.as_ptr().cast();
            }
            let keys = Keys::Tiled {
                at: &ptrs,
                dtype: crate::paged_kv::TiledDtype::F32,
            };
            // SAFETY: as above.
            unsafe { Avx2.scores(q, hd, rows, keys, groups, s, ahead) }
        }

        #[inline(always)]
        unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
            // SAFETY (arms): as above.
            match self.0 {
                Fault::LiveLane => unsafe { Avx2.softmax(s, m, (n + 1).min(TILE)) },
                Fault::SumPairing => {
                    let (m, _) = unsafe { Avx2.softmax(s, m, n) };
                    let l: [f32; GROUP] = std::array::from_fn(|i| {
                        (s[i] + s[2 * GROUP + i]) + (s[GROUP + i] + s[3 * GROUP + i])
                    });
                    let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
                    (m, (h[0] + h[2]) + (h[1] + h[3]))
                }
                _ => unsafe { Avx2.softmax(s, m, n) },
            }
        }

        #[inline(always)]
        unsafe fn accumulate(
            self,
            acc: &mut [f32],
            hd: usize,
            alpha: &[f32],
            e: &[f32],
            v: Rows,
            n: usize,
            ahead: &mut Trickle,
        ) {
            if self.0 != Fault::Decode(v.dtype) {
                // SAFETY: as above.
                return unsafe { Avx2.accumulate(acc, hd, alpha, e, v, n, ahead) };
            }
            // The values decoded wrong, through `decode_row`'s fault.
            let mut copy = vec![0f32; TILE * hd];
            let mut at = [std::ptr::null(); TILE];
            for (j, (row, dst)) in copy.chunks_exact_mut(hd).zip(&mut at).enumerate().take(n) {
                // SAFETY: as above; `Rows` promises `row_bytes(hd)` at each of the first n.
                unsafe {
                    let src = std::slice::from_raw_parts(v.at[j], v.dtype.row_bytes(hd));
                    self.decode_row(v.dtype, src, row);
                }
                *dst = row.as_ptr().cast();
            }
            let copy = Rows {
                at: &at,
                dtype: KvStorage::F32,
            };
            // SAFETY: as above.
            unsafe { Avx2.accumulate(acc, hd, alpha, e, copy, n, ahead) }
        }

        fn in_place(self, rows: usize) -> bool {
            Avx2.in_place(rows)
        }

        #[inline(always)]
        unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
            if self.0 == Fault::UnfusedMerge {
                for (a, b) in acc.iter_mut().zip(b) {
                    *a = *a * ca + b * cb;
                }
            } else {
                // SAFETY: as above.
                unsafe { Avx2.merge(acc, ca, b, cb) }
            }
        }

        #[inline(always)]
        unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { Avx2.finish(acc, l, out) }
        }
    }

    impl Kernel for Faulty {
        unsafe fn item(
            self,
            ctx: &Ctx,
            item: &Item,
            next: Option<&Item>,
            out: SharedOut,
            partials: SharedOut,
        ) {
            // SAFETY: forwarded; AVX2 was detected (the tests).
            unsafe { run_item_avx2(self, ctx, item, next, out, partials) }
        }

        unsafe fn merge_group(self, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
            // SAFETY: as above.
            unsafe { run_merge_avx2(self, ctx, m, partials, out) }
        }
    }

    #[test]
    fn the_avx2_kernel_passes_the_check() {
        if !Avx2::detect() {
            return;
        }
        let start = std::time::Instant::now();
        // SAFETY: detected just above.
        assert!(unsafe { agrees(Avx2) });
        println!("self-check of AVX2: {:?}", start.elapsed());
        // SAFETY: as above.
        assert!(unsafe { agrees(Faulty(Fault::Nothing)) });
    }

    #[test]
    fn the_check_catches_plausible_mistakes() {
        if !Avx2::detect() {
            return;
        }
        let faults = [
            Fault::SumPairing,
            Fault::LiveLane,
            Fault::UnfusedMerge,
            Fault::Decode(KvStorage::F16),
            Fault::Decode(KvStorage::Q8_0),
            Fault::Decode(KvStorage::Bf16),
        ];
        for fault in faults {
            // SAFETY: detected just above.
            assert!(
                !unsafe { agrees(Faulty(fault)) },
                "{fault:?} went unnoticed"
            );
        }
    }

    #[test]
    fn the_problem_has_the_shape_its_docs_promise() {
        let p = Problem::new(KvStorage::F16);
        let mut plan = Plan::default();
        plan.build(&p.positions, &p.seqs, SHAPE);
        // A prompt item per KV head, a decode row split in two per KV head, merged.
        assert_eq!(plan.items.len(), SHAPE.num_kv_heads * 3);
        assert_eq!(plan.merges.len(), SHAPE.num_kv_heads);
        assert!(plan.merges.iter().all(|m| m.parts == 2));
        // The prompt's second tile: 23 positions, 3 groups of 8.
        let last = SEQS[0].1.end - 1;
        assert_eq!((last + 1 - TILE).div_ceil(GROUP), 3);
        assert_eq!(crate::kv_dtype::q8_block(SHAPE.head_dim), SHAPE.head_dim);
        // The prompt's rows read K and V through decoded copies, the decode row's in place,
        // at either width.
        let prompt_rows = SEQS[0].1.len() * SHAPE.num_heads;
        assert!(!Avx2.in_place(prompt_rows) && !Avx512.in_place(prompt_rows));
        assert!(Avx2.in_place(SHAPE.num_heads) && Avx512.in_place(SHAPE.num_heads));
    }
}
