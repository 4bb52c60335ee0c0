//! The grouped decode attention kernel (`paged_attention_decode_grouped_*`): the query heads
//! of one KV head in one block over a staged copy of each K/V row. It must give every row the
//! bits the per-head decode kernel and the prefill kernel give it (the contract in the header
//! of `kernels/paged_attention.cu`), match the CPU attention, and not depend on the batch.
//!
//! Needs a GPU: without one each test prints a skip line (a failure under
//! `NOVAINFER_REQUIRE_GPU=1`, as `scripts/gpu-test run` sets).

#![cfg(feature = "cuda")]

mod common;

use common::host::{assert_close, cast, down, up, zeros, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::cudarc::driver::CudaSlice;
use novainfer_cuda::ops::paged_attention::{
    decode_kernel_for, paged_attention_decode_with, paged_attention_prefill, AttentionConfig,
    DecodeKernel, DecodeScratch, PagedKv, ATTN_SPLIT,
};
use novainfer_cuda::GpuContext;
use novainfer_model::layers;

/// One KV-head geometry: Qwen2.5-0.5B's (14 heads over 2, head_dim 64: groups of 7) and
/// the 1.5B's (12 over 2, head_dim 128: groups of 6).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

const GEOMETRIES: [Geometry; 4] = [
    Geometry {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
    },
    Geometry {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 32,
    },
    Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
    },
    Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 32,
    },
];

/// History lengths: one position, a partial tile, several splits ending on a partial tile,
/// exactly two splits, a split plus one key (a last split of one position), a padding
/// sequence (0), a sequence with one block masked (its table names a block outside the pool)
/// and one whose every block is masked.
const SEQ_LENS: [usize; 8] = [1, 37, 1300, 2 * ATTN_SPLIT, 2 * ATTN_SPLIT + 1, 0, 700, 40];
const PARTLY_MASKED: usize = 6;
const ALL_MASKED: usize = 7;
/// The block of `PARTLY_MASKED` that is masked.
const MASKED_BLOCK: usize = 3;

/// A host copy of the pool and tables, and the CPU's view of one sequence in it.
struct Pool<T> {
    k: Vec<T>,
    v: Vec<T>,
    k32: Vec<f32>,
    v32: Vec<f32>,
    tables: Vec<i32>,
    num_blocks: usize,
    max_blocks: usize,
}

fn build_pool<T: TestDtype>(g: Geometry, rng: &mut Rng) -> Pool<T> {
    let bs = g.block_size;
    let max_len = *SEQ_LENS.iter().max().expect("lengths");
    let max_blocks = max_len.div_ceil(bs);
    let num_blocks = SEQ_LENS.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 2;
    let row = g.num_kv_heads * g.head_dim;
    let (k, k32) = cast::<T>(&rng.vec(num_blocks * bs * row, 1.0));
    // Values with an offset, so an attention result is not near zero everywhere.
    let v_raw: Vec<f32> = rng.vec(num_blocks * bs * row, 1.0);
    let (v, v32) = cast::<T>(&v_raw.iter().map(|x| x + 0.25).collect::<Vec<_>>());
    // Blocks handed out back to front, so tables are not the identity; unused entries -1.
    let mut next = num_blocks;
    let mut tables = vec![-1i32; SEQ_LENS.len() * max_blocks];
    for (s, &len) in SEQ_LENS.iter().enumerate() {
        for b in 0..len.div_ceil(bs) {
            next -= 1;
            tables[s * max_blocks + b] = next as i32;
        }
    }
    // A block id past the pool masks the keys it would hold (`slot_of`); -5 too.
    tables[PARTLY_MASKED * max_blocks + MASKED_BLOCK] = num_blocks as i32;
    for b in 0..SEQ_LENS[ALL_MASKED].div_ceil(bs) {
        tables[ALL_MASKED * max_blocks + b] = if b % 2 == 0 { -5 } else { i32::MAX };
    }
    Pool {
        k,
        v,
        k32,
        v32,
        tables,
        num_blocks,
        max_blocks,
    }
}

/// The CPU attention's view of a sequence: positions map to `blocks[pos / block_size]`.
struct HostView<'a> {
    k: &'a [f32],
    v: &'a [f32],
    blocks: Vec<usize>,
    block_size: usize,
    row: usize,
    head_dim: usize,
}

impl HostView<'_> {
    fn at(&self, pos: usize, kv_head: usize) -> usize {
        let slot = self.blocks[pos / self.block_size] * self.block_size + pos % self.block_size;
        slot * self.row + kv_head * self.head_dim
    }
}

impl layers::KvView for HostView<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.k[o..o + self.head_dim]
    }
    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.v[o..o + self.head_dim]
    }
}

/// The CPU oracle for every decode row of the batch: attention over the keys that are not
/// masked. A masked block drops out of the history, so the oracle's sequence is the table's
/// valid blocks in order (whole blocks, so the history stays a prefix of that sequence).
/// Rows with no unmasked key are zeros.
fn cpu_decode<T: TestDtype>(g: Geometry, pool: &Pool<T>, q32: &[f32]) -> Vec<f32> {
    let row_len = g.num_heads * g.head_dim;
    let mut out = vec![0f32; SEQ_LENS.len() * row_len];
    for (s, &len) in SEQ_LENS.iter().enumerate() {
        let entries = &pool.tables[s * pool.max_blocks..][..len.div_ceil(g.block_size)];
        let mut blocks = Vec::new();
        let mut kept = 0;
        for (b, &e) in entries.iter().enumerate() {
            if e >= 0 && (e as usize) < pool.num_blocks {
                blocks.push(e as usize);
                kept += g.block_size.min(len - b * g.block_size);
            }
        }
        if kept == 0 {
            continue;
        }
        let view = HostView {
            k: &pool.k32,
            v: &pool.v32,
            blocks,
            block_size: g.block_size,
            row: g.num_kv_heads * g.head_dim,
            head_dim: g.head_dim,
        };
        let expected = layers::attention(
            &q32[s * row_len..(s + 1) * row_len],
            &[layers::QueryRow {
                position: kept - 1,
                seq: 0,
            }],
            &[view],
            layers::AttentionShape {
                num_heads: g.num_heads,
                num_kv_heads: g.num_kv_heads,
                head_dim: g.head_dim,
            },
        );
        out[s * row_len..(s + 1) * row_len].copy_from_slice(&expected);
    }
    out
}

fn config(g: Geometry, max_blocks: usize) -> AttentionConfig {
    AttentionConfig {
        num_heads: g.num_heads,
        num_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        block_size: g.block_size,
        max_blocks_per_seq: max_blocks,
    }
}

/// Device copies of the pool.
struct DevicePool<T> {
    k: CudaSlice<T>,
    v: CudaSlice<T>,
}

fn kv<'a, T>(
    pool: &'a DevicePool<T>,
    tables: &'a CudaSlice<i32>,
    lens: &'a CudaSlice<i32>,
) -> PagedKv<'a, T> {
    PagedKv {
        k_cache: pool.k.as_view(),
        v_cache: pool.v.as_view(),
        block_tables: tables.as_view(),
        seq_lens: lens.as_view(),
    }
}

#[allow(clippy::too_many_arguments)]
fn decode<T: TestDtype>(
    gpu: &GpuContext,
    kernel: DecodeKernel,
    cfg: &AttentionConfig,
    pool: &DevicePool<T>,
    tables: &[i32],
    lens: &[usize],
    q: &[T],
    scratch: &mut DecodeScratch,
) -> Vec<T> {
    let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let (dt, dl) = (up(gpu, tables), up(gpu, &lens_i32));
    let mut out = zeros::<T>(gpu, q.len());
    paged_attention_decode_with(
        gpu,
        kernel,
        cfg,
        &up(gpu, q).as_view(),
        kv(pool, &dt, &dl),
        lens.iter().copied().max().unwrap_or(0),
        scratch,
        &mut out.as_view_mut(),
    )
    .expect("decode");
    down(gpu, &out)
}

fn same_bits<T: TestDtype>(what: &str, a: &[T], b: &[T]) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            x.to_f32().to_bits(),
            y.to_f32().to_bits(),
            "{what} [{}]: element {i}: {} vs {}",
            T::KIND.suffix(),
            x.to_f32(),
            y.to_f32()
        );
    }
}

fn grouped_body<T: TestDtype>(gpu: &GpuContext, g: Geometry) {
    let what = format!("{g:?}");
    let mut rng = Rng(11 + g.head_dim as u64 + g.block_size as u64);
    let pool = build_pool::<T>(g, &mut rng);
    let cfg = config(g, pool.max_blocks);
    let dpool = DevicePool {
        k: up(gpu, &pool.k),
        v: up(gpu, &pool.v),
    };
    let row_len = g.num_heads * g.head_dim;
    let (q, q32) = cast::<T>(&rng.vec(SEQ_LENS.len() * row_len, 1.0));
    let mut scratch = DecodeScratch::new(gpu, &cfg, 16, 4096).expect("scratch");
    let group = g.num_heads / g.num_kv_heads;
    {
        let (dt, dl) = (up(gpu, &pool.tables), up(gpu, &[0i32]));
        assert!(
            matches!(
                decode_kernel_for(gpu, &cfg, &kv(&dpool, &dt, &dl), 1300),
                DecodeKernel::Grouped { .. }
            ),
            "{what}: the runner's decode takes the grouped kernel"
        );
    }

    let grouped = decode(
        gpu,
        DecodeKernel::Grouped {
            heads_per_block: group,
        },
        &cfg,
        &dpool,
        &pool.tables,
        &SEQ_LENS,
        &q,
        &mut scratch,
    );
    // The group cut into parts (more, smaller blocks; with an idle warp where the part size
    // does not divide the group): the same bits.
    for heads_per_block in [group.div_ceil(2), 1] {
        let parts = decode(
            gpu,
            DecodeKernel::Grouped { heads_per_block },
            &cfg,
            &dpool,
            &pool.tables,
            &SEQ_LENS,
            &q,
            &mut scratch,
        );
        same_bits(
            &format!("{what}: {heads_per_block} heads per block vs the whole group"),
            &parts,
            &grouped,
        );
    }
    let per_head = decode(
        gpu,
        DecodeKernel::PerHead,
        &cfg,
        &dpool,
        &pool.tables,
        &SEQ_LENS,
        &q,
        &mut scratch,
    );
    same_bits(
        &format!("{what}: grouped vs per-head decode"),
        &grouped,
        &per_head,
    );

    // The prefill kernel over the same rows (one-token chunks at the last positions).
    let qsl: Vec<i32> = (0..=SEQ_LENS.len() as i32).collect();
    // A padding sequence has no position of its own; its row's history is empty either way.
    let positions: Vec<i32> = SEQ_LENS.iter().map(|&l| l as i32 - 1).collect();
    let lens_i32: Vec<i32> = SEQ_LENS.iter().map(|&l| l as i32).collect();
    let (dt, dl) = (up(gpu, &pool.tables), up(gpu, &lens_i32));
    let mut out_p = zeros::<T>(gpu, q.len());
    paged_attention_prefill(
        gpu,
        &cfg,
        &up(gpu, &q).as_view(),
        kv(&dpool, &dt, &dl),
        &up(gpu, &qsl).as_view(),
        &up(gpu, &positions).as_view(),
        &mut out_p.as_view_mut(),
    )
    .expect("prefill");
    same_bits(
        &format!("{what}: grouped decode vs prefill"),
        &grouped,
        &down(gpu, &out_p),
    );

    // The CPU oracle; padding and fully masked rows are zeros.
    let expected = cpu_decode(g, &pool, &q32);
    assert_close(&format!("{what}: grouped decode"), &grouped, &expected);
    for s in [5, ALL_MASKED] {
        assert!(
            grouped[s * row_len..(s + 1) * row_len]
                .iter()
                .all(|v| v.to_f32().to_bits() == 0),
            "{what}: row {s} has no unmasked key and must be +0"
        );
    }

    // Batch invariance: each sequence alone, with a scratch of another capacity (another
    // graph bucket: another split stride) and the kernel the launcher picks for one sequence,
    // gives its bits from the batch.
    let mut small = DecodeScratch::new(gpu, &cfg, 1, 2 * ATTN_SPLIT + 1).expect("scratch");
    for (s, &len) in SEQ_LENS.iter().enumerate() {
        let (dt, dl) = (up(gpu, &pool.tables[..pool.max_blocks]), up(gpu, &[0i32]));
        let chosen = decode_kernel_for(gpu, &cfg, &kv(&dpool, &dt, &dl), len);
        let alone = decode(
            gpu,
            chosen,
            &cfg,
            &dpool,
            &pool.tables[s * pool.max_blocks..(s + 1) * pool.max_blocks],
            &[len],
            &q[s * row_len..(s + 1) * row_len],
            &mut small,
        );
        same_bits(
            &format!("{what}: sequence {s} alone vs in the batch"),
            &alone,
            &grouped[s * row_len..(s + 1) * row_len],
        );
    }
}

#[test]
fn grouped_decode_matches_per_head_prefill_and_cpu() {
    let Some(gpu) = common::gpu_or_skip("grouped decode attention") else {
        return;
    };
    for g in GEOMETRIES {
        grouped_body::<f32>(&gpu, g);
        grouped_body::<bf16>(&gpu, g);
    }
}

/// Groups of one (multi-head attention) and of the kernel's maximum run the grouped kernel;
/// larger groups and a pool that does not start on 16 bytes fall back to the per-head one,
/// and asking for the grouped kernel there is refused.
#[test]
fn grouped_decode_covers_its_shapes_and_refuses_others() {
    let Some(gpu) = common::gpu_or_skip("grouped decode shapes") else {
        return;
    };
    let mut rng = Rng(21);
    for (num_heads, num_kv_heads, grouped) in [(4, 4, true), (32, 2, true), (34, 2, false)] {
        let g = Geometry {
            num_heads,
            num_kv_heads,
            head_dim: 64,
            block_size: 16,
        };
        let cfg = config(g, 4);
        let row = num_kv_heads * 64;
        let slots = 4 * 16;
        let (k, _) = cast::<bf16>(&rng.vec(slots * row + 8, 1.0));
        let (v, _) = cast::<bf16>(&rng.vec(slots * row + 8, 1.0));
        let dpool = DevicePool {
            k: up(&gpu, &k[..slots * row]),
            v: up(&gpu, &v[..slots * row]),
        };
        let tables = [3i32, 2, 1, 0];
        let lens = [61usize];
        let (q, _) = cast::<bf16>(&rng.vec(num_heads * 64, 1.0));
        let mut scratch = DecodeScratch::new(&gpu, &cfg, 1, 64).expect("scratch");
        let per_head = decode(
            &gpu,
            DecodeKernel::PerHead,
            &cfg,
            &dpool,
            &tables,
            &lens,
            &q,
            &mut scratch,
        );
        let (dt, dl) = (up(&gpu, &tables), up(&gpu, &[61i32]));
        let chosen = decode_kernel_for(&gpu, &cfg, &kv(&dpool, &dt, &dl), 61);
        let group = num_heads / num_kv_heads;
        if grouped {
            assert!(
                matches!(chosen, DecodeKernel::Grouped { .. }),
                "{g:?}: {chosen:?}"
            );
            for heads_per_block in [group, group.div_ceil(3), 1] {
                let got = decode(
                    &gpu,
                    DecodeKernel::Grouped { heads_per_block },
                    &cfg,
                    &dpool,
                    &tables,
                    &lens,
                    &q,
                    &mut scratch,
                );
                same_bits(
                    &format!("{g:?}, {heads_per_block} per block"),
                    &got,
                    &per_head,
                );
            }
            // Parts of no head, or of more than the group, are refused.
            for heads_per_block in [0, group + 1] {
                let mut out = zeros::<bf16>(&gpu, q.len());
                let err = paged_attention_decode_with(
                    &gpu,
                    DecodeKernel::Grouped { heads_per_block },
                    &cfg,
                    &up(&gpu, &q).as_view(),
                    kv(&dpool, &dt, &dl),
                    61,
                    &mut scratch,
                    &mut out.as_view_mut(),
                )
                .expect_err("heads per block outside 1..=group");
                assert!(err.to_string().contains("per block"), "{err}");
            }
        } else {
            assert_eq!(chosen, DecodeKernel::PerHead, "{g:?}");
        }
        // The same pool one element into a larger allocation: 2-byte aligned only.
        let k_off = up(&gpu, &k[..slots * row + 1]);
        let v_off = up(&gpu, &v[..slots * row + 1]);
        let misaligned = PagedKv {
            k_cache: k_off.slice(1..),
            v_cache: v_off.slice(1..),
            block_tables: dt.as_view(),
            seq_lens: dl.as_view(),
        };
        assert_eq!(
            decode_kernel_for(&gpu, &cfg, &misaligned, 61),
            DecodeKernel::PerHead,
            "{g:?}: a misaligned pool takes the per-head kernel"
        );
        let mut out = zeros::<bf16>(&gpu, q.len());
        let err = paged_attention_decode_with(
            &gpu,
            DecodeKernel::Grouped { heads_per_block: 1 },
            &cfg,
            &up(&gpu, &q).as_view(),
            misaligned,
            61,
            &mut scratch,
            &mut out.as_view_mut(),
        )
        .expect_err("the grouped kernel needs an aligned pool");
        assert!(err.to_string().contains("grouped"), "{err}");
    }
}

// ---- the kernel's index arithmetic, walked on the CPU (no GPU needed) --------------------

/// A constant of `kernels/paged_attention.cu`, read from its `#define`.
fn kernel_define(name: &str) -> usize {
    let source = novainfer_cuda::kernels::PAGED_ATTENTION.source;
    let prefix = format!("#define {name} ");
    source
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("kernels/paged_attention.cu defines {name}"))
}

/// `stage_keys<T, HD>()` of the kernel.
fn stage_keys(elem: usize, hd: usize, stage_bytes: usize, tile: usize) -> usize {
    let keys = stage_bytes / (2 * hd * elem);
    if keys < tile {
        tile
    } else {
        keys / tile * tile
    }
}

/// Walks `StagedKv::begin_tile`'s staging loop and the staged source's reads for one split,
/// as the kernel's threads would, and checks that every staged piece is written once, inside
/// the shared arrays, and that every piece a lane reads in `tile_score` (key rows, one lane
/// per key) and every element `attend_split` reads through `row`/`value` is the one of the
/// position it means (tile + j, piece or dim) of the current stage.
fn walk_split(elem: usize, hd: usize, threads: usize, begin: usize, end: usize) {
    let (split, tile_len) = (kernel_define("ATTN_SPLIT"), 32);
    let stage_bytes = kernel_define("ATTN_STAGE_BYTES");
    let unroll = kernel_define("STAGE_UNROLL");
    let keys = stage_keys(elem, hd, stage_bytes, tile_len);
    assert!(
        keys.is_multiple_of(tile_len) && split.is_multiple_of(keys),
        "stages tile the split"
    );
    let pieces = hd * elem / 16;
    assert_eq!(pieces * 16, hd * elem);
    let (row_pieces, per_piece) = (pieces + 1, 16 / elem);
    let row = row_pieces * per_piece;
    // Static shared memory: K and V stages, the group's queries, the mask.
    let shared = 2 * keys * row * elem + kernel_define("ATTN_MAX_GROUP") * hd * elem + 4 * keys;
    assert!(
        shared <= 48 * 1024,
        "{shared} bytes of static shared memory"
    );
    // Shared memory as the kernel lays it out: which (position, piece) each Pack16 holds.
    let mut smem: Vec<Option<(usize, usize)>> = vec![None; keys * row_pieces];
    let mut present: Vec<Option<usize>> = vec![None; keys];
    let mut tile = begin;
    while tile < end {
        let offset = (tile - begin) % keys;
        if offset == 0 {
            smem.iter_mut().for_each(|p| *p = None);
            present.iter_mut().for_each(|p| *p = None);
            let count = keys.min(end - tile);
            let total = count * pieces;
            for thread in 0..threads {
                let mut first = thread;
                while first < total {
                    for u in 0..unroll {
                        let c = first + u * threads;
                        if c < total {
                            let i = c / pieces;
                            let at = i * row_pieces + (c - i * pieces);
                            assert!(at < smem.len(), "piece {c} past the stage");
                            assert!(smem[at].is_none(), "piece {c} written twice");
                            smem[at] = Some((tile + i, c - i * pieces));
                            if c - i * pieces == 0 {
                                present[i] = Some(tile + i);
                            }
                        }
                    }
                    first += unroll * threads;
                }
            }
            let written = smem.iter().filter(|p| p.is_some()).count();
            assert_eq!(written, total, "a piece is missing");
        }
        let n = tile_len.min(end - tile);
        // Quarter-warp 16-byte reads of `tile_score`: 8 lanes on 8 different bank groups.
        for quarter in 0..4 {
            let groups: std::collections::HashSet<usize> = (quarter * 8..quarter * 8 + 8)
                .map(|j| ((offset + j) * row_pieces) % 8)
                .collect();
            assert_eq!(groups.len(), 8, "bank conflict in tile_score's reads");
        }
        for j in 0..n {
            let i = offset + j;
            assert_eq!(
                present[i],
                Some(tile + j),
                "present[{i}] of position {}",
                tile + j
            );
            for c in 0..pieces {
                assert_eq!(
                    smem[i * row_pieces + c],
                    Some((tile + j, c)),
                    "key {}",
                    tile + j
                );
            }
            for d in 0..hd {
                // `value(row(j), d)`: element i·ROW + d lies in piece (i·ROW + d)·elem / 16.
                let piece = (i * row + d) * elem / 16;
                assert_eq!(
                    smem[piece],
                    Some((tile + j, d * elem / 16)),
                    "value {} dim {d}",
                    tile + j
                );
            }
        }
        tile += tile_len;
    }
}

/// `warp_sum`: the xor butterfly over 32 lanes; returns every lane's result.
fn warp_sum(mut v: [f32; 32]) -> [f32; 32] {
    for offset in [16, 8, 4, 2, 1] {
        let prev = v;
        for (lane, x) in v.iter_mut().enumerate() {
            *x = prev[lane] + prev[lane ^ offset];
        }
    }
    v
}

/// `butterfly_sum` of the kernel: the same sums, in one thread.
fn butterfly_sum(mut p: [f32; 32]) -> f32 {
    for half in [16, 8, 4, 2] {
        for i in 0..half {
            p[i] += p[i + half];
        }
    }
    p[0] + p[1]
}

/// The canonical score (`PoolKv::tile_score`: lane partials, then the butterfly) and the
/// staged kernel's (`StagedKv::tile_score`: one thread, partials by dim, then
/// `butterfly_sum`) are the same IEEE operations: equal bits, in every lane, for every key.
#[test]
fn one_lane_scores_equal_the_warp_butterfly_bit_for_bit() {
    let mut rng = Rng(5);
    for hd in [64, 128, 256] {
        for _ in 0..2000 {
            let scale = 1.0 / (hd as f32).sqrt();
            // Wide exponents, so that rounding differences would show.
            let q: Vec<f32> = (0..hd)
                .map(|_| rng.f32() * 2f32.powi((rng.f32() * 8.0) as i32))
                .collect();
            let k: Vec<f32> = (0..hd)
                .map(|_| rng.f32() * 2f32.powi((rng.f32() * 8.0) as i32))
                .collect();
            let mut lanes = [0f32; 32];
            for (lane, partial) in lanes.iter_mut().enumerate() {
                for r in 0..hd / 32 {
                    *partial = q[lane + 32 * r].mul_add(k[lane + 32 * r], *partial);
                }
            }
            let summed = warp_sum(lanes);
            assert!(summed.iter().all(|v| v.to_bits() == summed[0].to_bits()));
            let warp = summed[0] * scale;
            let mut p = [0f32; 32];
            for d in 0..hd {
                p[d % 32] = q[d].mul_add(k[d], p[d % 32]);
            }
            let one_lane = butterfly_sum(p) * scale;
            assert_eq!(one_lane.to_bits(), warp.to_bits(), "head_dim {hd}");
        }
    }
}

#[test]
fn staged_index_arithmetic_reads_what_it_staged() {
    let split = kernel_define("ATTN_SPLIT");
    let max_group = kernel_define("ATTN_MAX_GROUP");
    for (elem, hd) in [(4, 64), (4, 128), (2, 64), (2, 128), (2, 256)] {
        for group in [1, 6, 7, max_group] {
            for (begin, end) in [
                (0, 1),
                (0, 37),
                (0, split),
                (split, split + 1),
                (2 * split, 2 * split + 300),
                (split, 2 * split - 5),
            ] {
                walk_split(elem, hd, group * 32, begin, end);
            }
        }
    }
}

/// `decode_grouped`'s head mapping for every group and part size: over the launcher's grid
/// (num_kv_heads · ⌈group / W⌉ blocks of W warps), each query head is stored by exactly one
/// warp, reading its own KV head, and every warp's head (stored or not) is a real one.
#[test]
fn grouped_head_mapping_stores_every_head_once() {
    let max_group = kernel_define("ATTN_MAX_GROUP");
    for num_kv_heads in [1, 2, 4] {
        for group in 1..=max_group {
            let num_heads = group * num_kv_heads;
            for per_block in 1..=group {
                let parts = group.div_ceil(per_block);
                let mut stored = vec![0; num_heads];
                for x in 0..num_kv_heads * parts {
                    let kv_head = x / parts;
                    assert!(kv_head < num_kv_heads);
                    for warp in 0..per_block {
                        let in_group = (x % parts) * per_block + warp;
                        let head = kv_head * group + in_group.min(group - 1);
                        assert!(head < num_heads);
                        assert_eq!(head / group, kv_head, "a head of another KV head");
                        if in_group < group {
                            stored[head] += 1;
                        }
                    }
                }
                assert!(
                    stored.iter().all(|&n| n == 1),
                    "group {group}, {per_block} per block: {stored:?}"
                );
            }
        }
    }
}
