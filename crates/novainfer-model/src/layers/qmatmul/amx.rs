//! Prefill products on AMX tiles (Intel Sapphire Rapids and later): `tdpbsud`/`tdpbssd`
//! multiply a 16-row tile of activations (`[16][64]` i8, straight from the quantized rows)
//! by a tile of weights in the VNNI layout our groups already use (a row: 4 k-values of each
//! of 16 columns), 16 × 16 × 64 products an instruction, where AVX-512 VNNI does 16 × 4.
//!
//! The integer sums are exact either way, so each format keeps its f32 operations and their
//! order (one accumulator per output, blocks in order from zero) and the results are the
//! other ISAs' bits:
//! * Q8_0 and Q5_0 (a scale per 32 values): one instruction per block, `C = Σ w·a`
//!   (Q5_0: `Σ (w + 16)·a`, less `16·Σa` as the other ISAs do), then the block's f32 update,
//!   four blocks' tiles in flight ([`flat_rows`]);
//! * Q4_K and Q6_K (a scale per 32 or 16 values inside a 256-value block): a tile sums 64
//!   values across sub-blocks, so the sub-block scales go into the weights first: each
//!   group's `v = sc·q` (Q6_K: `sc·(q - 32)`) is unpacked once per work item as two byte
//!   planes, `lo = v & 255` (unsigned) and `hi = v >> 8`, and `Σ v·a = Σ lo·a + 256·Σ hi·a`
//!   exactly (|v| ≤ 945 for Q4_K, 4096 for Q6_K): two instructions per 64 values and no
//!   per-sub-block work at all ([`scaled_rows`]).
//!
//! Tiles are configured per work item and released after it. Linux hands AMX state to a
//! process only on request ([`available`] asks once); every instruction here is emitted by
//! `asm!` (Rust's AMX intrinsics are unstable), and the compiler never allocates tile
//! registers, so they are ours between the blocks.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use super::activation::QuantizedActs;
use super::simd::{Avx512, Simd};
use super::{GroupJob, Kernel, GROUP};

/// Rows of every tile (and of the row tiles a product is cut into).
pub(super) const TILE_ROWS: usize = 16;
/// Bytes of a tile row: 16 columns × 4 bytes (weights, results) or 64 k-values (activations).
pub(super) const ROW_BYTES: usize = 64;
/// Activation bytes per row chunk on AMX. Every AMX CPU so far has 2 MiB of L2 a core, and
/// an item unpacks its group's weights once per chunk (the Q6_K unpack costs about as much
/// as 32 rows of products), so chunks are 4x the AVX paths' [`super::ROW_CHUNK_BYTES`].
pub(super) const CHUNK_BYTES: usize = 1 << 20;
/// Bytes of one 16 × 64 tile.
const TILE_BYTES: usize = TILE_ROWS * ROW_BYTES;

/// Whether this CPU and OS run AMX-INT8 (CPUID leaf 7: AMX-TILE and AMX-INT8) and let this
/// process use it: Linux 5.16+ grants the tile data state on `arch_prctl(ARCH_REQ_XCOMP_PERM)`
/// and raises SIGILL on a tile instruction without it. Asked once per process (the grant is
/// process-wide).
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU this crate runs on (AVX2 is leaf 7).
        #[allow(unused_unsafe)]
        let leaf7 = unsafe { __cpuid_count(7, 0) };
        let (tile, int8) = ((leaf7.edx >> 24) & 1 == 1, (leaf7.edx >> 25) & 1 == 1);
        tile && int8 && request_tile_state()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with integer arguments; it changes only which register state
    // this process may use.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// `ldtilecfg`'s 64-byte operand: palette 1, then each tile register's row count and bytes
/// per row.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tiles 0-3 (results) and 6-7 (weights) of `result_rows`/`weight_rows` × 64 bytes, tiles
    /// 4-5 (activations) of 16 × `act_bytes`.
    const fn new(act_bytes: u16, weight_rows: u8) -> Self {
        let mut colsb = [0u16; 16];
        let mut rows = [0u8; 16];
        let mut t = 0;
        while t < 8 {
            colsb[t] = if t == 4 || t == 5 {
                act_bytes
            } else {
                ROW_BYTES as u16
            };
            rows[t] = if t >= 6 { weight_rows } else { TILE_ROWS as u8 };
            t += 1;
        }
        Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb,
            rows,
        }
    }
}

/// The tile registers while one work item runs: configured on creation, released on drop.
struct Tiles;

impl Tiles {
    /// # Safety
    /// [`available`] must have returned true.
    #[inline(always)]
    unsafe fn configure(config: &TileConfig) -> Self {
        // SAFETY: the caller's contract; `config` is a valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config as *const TileConfig, options(nostack)) };
        Self
    }
}

impl Drop for Tiles {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: tiles are configured (a `Tiles` exists only after `configure`).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `tilezero tmm{T}`.
macro_rules! tile_zero {
    ($t:literal) => {
        asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
}
/// `tileloadd tmm{T}, [p + stride]`: the tile's rows from `p`, `stride` bytes apart.
macro_rules! tile_load {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $stride,
            options(nostack, readonly))
    };
}
/// `tilestored [p + stride], tmm{T}`.
macro_rules! tile_store {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $p, s = in(reg) $stride,
            options(nostack))
    };
}
/// `C += A·B` with signed activations `A` and unsigned (`bsud`) or signed (`bssd`) weights.
macro_rules! tile_dp {
    (su, $c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
    (ss, $c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
    // Signed weights where `$signed` (a constant) is true.
    ($signed:expr, $c:literal, $a:literal, $b:literal) => {
        if $signed {
            tile_dp!(ss, $c, $a, $b)
        } else {
            tile_dp!(su, $c, $a, $b)
        }
    };
}

/// Result tiles stored for the f32 work: 4 tiles of 16 rows × 16 i32.
#[repr(C, align(64))]
struct Results([[i32; GROUP]; 4 * TILE_ROWS]);

thread_local! {
    /// One work item's unpacked weights (a K-quant slab of blocks, or a Q5_0 group's whole k),
    /// reused across items.
    static UNPACKED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with [`UNPACKED`] grown to `bytes` (a nested call, which nothing makes, gets a
/// buffer of its own).
fn with_unpacked<R>(bytes: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    UNPACKED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < bytes {
                buf.resize(bytes, 0);
            }
            f(&mut buf[..bytes])
        }
        Err(_) => f(&mut vec![0; bytes]),
    })
}

/// Where row `row`'s activations for k-value `k0` start, and the tile stride (one row).
#[inline(always)]
fn act_at(acts: &QuantizedActs, row: usize, k0: usize) -> *const i8 {
    acts.qs[row * acts.k + k0..].as_ptr()
}

/// A 32-value-block format (Q8_0, Q5_0) on AMX.
pub(super) trait FlatBlocks: Kernel {
    /// The weights are signed (`tdpbssd`) rather than unsigned (`tdpbsud`).
    const SIGNED: bool;
    /// Byte offset of the weights' 8 × 64 bytes (row c: chunk c of every column) inside a
    /// packed block, when the block holds them that way; `None`: [`Self::unpack`] makes them.
    const WEIGHTS: Option<usize>;
    /// Unpacks block `blk`'s weights into `out` (8 rows × 64 bytes: chunk c of every column)
    /// for a format without [`Self::WEIGHTS`].
    ///
    /// # Safety
    /// `blk` points at one packed block; AVX-512 is enabled.
    unsafe fn unpack(_blk: *const u8, _out: &mut [u8; 8 * ROW_BYTES]) {}
    /// `C` (the exact integer sum of a tile row) less the format's offset for row `i`
    /// (`(row, block)` index into `acts`).
    ///
    /// # Safety
    /// AVX-512 is enabled; `i` indexes `acts.sums`.
    unsafe fn exact(c: __m512i, acts: &QuantizedActs, i: usize) -> __m512i;
}

/// Rows `rows` (a multiple of [`TILE_ROWS`]) of a Q8_0/Q5_0 product against group `g`: per
/// 16-row tile, four blocks' products in flight (tiles 0-3), then each block's f32 update
/// `acc = fma(f32(isum), dw·da, acc)` in block order on accumulators kept in registers.
///
/// # Safety
/// [`super::Kernel::tile`]'s contract for the whole group and rows; [`available`] and
/// AVX-512 F/BW.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn flat_rows<F: FlatBlocks>(
    job: &GroupJob<'_>,
    group: *const u8,
    g: usize,
    rows: Range<usize>,
) {
    debug_assert_eq!(rows.len() % TILE_ROWS, 0);
    const CONFIG: TileConfig = TileConfig::new(32, 8);
    let acts = job.acts;
    let nb = acts.k / F::BLOCK_K;
    let weights_bytes = 8 * ROW_BYTES;
    let unpacked_bytes = if F::WEIGHTS.is_some() {
        0
    } else {
        nb * weights_bytes
    };
    with_unpacked(unpacked_bytes, |unpacked| {
        // SAFETY: the caller's contract: `group` holds `nb` packed blocks, the rows exist,
        // AMX and AVX-512 are usable; every tile load reads 16 activation rows of 32 bytes
        // inside `acts.qs` or 8 rows of 64 bytes of one block's weights.
        unsafe {
            if F::WEIGHTS.is_none() {
                for b in 0..nb {
                    let out = &mut *(unpacked.as_mut_ptr().add(b * weights_bytes)
                        as *mut [u8; 8 * ROW_BYTES]);
                    F::unpack(group.add(b * F::GROUP_BLOCK_BYTES), out);
                }
            }
            let unpacked: &[u8] = unpacked;
            let weights_of = |b: usize| -> *const u8 {
                match F::WEIGHTS {
                    Some(at) => group.add(b * F::GROUP_BLOCK_BYTES + at),
                    None => unpacked.as_ptr().add(b * weights_bytes),
                }
            };
            let _tiles = Tiles::configure(&CONFIG);
            let mut results = Results([[0; GROUP]; 4 * TILE_ROWS]);
            let res = results.0.as_mut_ptr() as *mut u8;
            let stride = acts.k;
            for row0 in rows.step_by(TILE_ROWS) {
                let mut facc = [Avx512::zerof(); TILE_ROWS];
                for b0 in (0..nb).step_by(4) {
                    let blocks = 4.min(nb - b0);
                    let a = |t: usize| act_at(acts, row0, (b0 + t) * F::BLOCK_K);
                    // Four blocks' products: result tile t for block b0 + t, activations and
                    // weights alternating between two tiles each so loads overlap products.
                    tile_zero!("0");
                    tile_load!("4", a(0), stride);
                    tile_load!("6", weights_of(b0), ROW_BYTES);
                    tile_dp!(F::SIGNED, "0", "4", "6");
                    if blocks > 1 {
                        tile_zero!("1");
                        tile_load!("5", a(1), stride);
                        tile_load!("7", weights_of(b0 + 1), ROW_BYTES);
                        tile_dp!(F::SIGNED, "1", "5", "7");
                    }
                    if blocks > 2 {
                        tile_zero!("2");
                        tile_load!("4", a(2), stride);
                        tile_load!("6", weights_of(b0 + 2), ROW_BYTES);
                        tile_dp!(F::SIGNED, "2", "4", "6");
                    }
                    if blocks > 3 {
                        tile_zero!("3");
                        tile_load!("5", a(3), stride);
                        tile_load!("7", weights_of(b0 + 3), ROW_BYTES);
                        tile_dp!(F::SIGNED, "3", "5", "7");
                    }
                    tile_store!("0", res, ROW_BYTES);
                    if blocks > 1 {
                        tile_store!("1", res.add(TILE_BYTES), ROW_BYTES);
                    }
                    if blocks > 2 {
                        tile_store!("2", res.add(2 * TILE_BYTES), ROW_BYTES);
                    }
                    if blocks > 3 {
                        tile_store!("3", res.add(3 * TILE_BYTES), ROW_BYTES);
                    }
                    for t in 0..blocks {
                        let b = b0 + t;
                        let dw = Avx512::loadf(group.add(b * F::GROUP_BLOCK_BYTES));
                        for (r, f) in facc.iter_mut().enumerate() {
                            let i = (row0 + r) * acts.nb + b;
                            let c =
                                Avx512::load(results.0[t * TILE_ROWS + r].as_ptr() as *const u8);
                            let sumi = F::exact(c, acts, i);
                            let scale = Avx512::mul(dw, Avx512::splatf(acts.d[i]));
                            *f = Avx512::fma(Avx512::cvt(sumi), scale, *f);
                        }
                    }
                }
                job.store::<Avx512, TILE_ROWS>(facc, row0, g * GROUP);
            }
        }
    })
}

/// A 256-value-block format with sub-block scales (Q4_K, Q6_K) on AMX.
pub(super) trait ScaledBlocks: Kernel {
    /// `hi = v >> 8` is signed (Q6_K) rather than unsigned (Q4_K).
    const HI_SIGNED: bool;
    /// Block `blk`'s `v` (the sub-block scale times the quant, see the module docs) as two
    /// byte planes: `out[..4 tiles]` the low bytes, `out[4 tiles..]` the high bytes; tile j's
    /// row r holds chunk `16j + r` (k-values `64j + 4r ..+ 4`) of every column.
    ///
    /// # Safety
    /// `blk` points at one packed block; AVX-512 is enabled.
    unsafe fn unpack_scaled(blk: *const u8, out: &mut [u8; 8 * TILE_BYTES]);
    /// What a block's f32 update reads from the weights, loaded once for all its rows.
    type Block: Copy;
    /// # Safety
    /// `blk` points at one packed block; AVX-512 is enabled.
    unsafe fn block(blk: *const u8) -> Self::Block;
    /// Block `b`'s f32 update of row `row`'s accumulator from its exact `isum = Σ v·a`
    /// (what [`Kernel::tile`] does after its integer sums).
    ///
    /// # Safety
    /// `w` is [`Self::block`] of packed block `b`; the row exists in `acts`; AVX-512 is enabled.
    unsafe fn finish(
        w: Self::Block,
        acts: &QuantizedActs,
        row: usize,
        b: usize,
        isum: __m512i,
        f: __m512,
    ) -> __m512;
}

/// Bytes of one block's unpacked planes.
const SCALED_BLOCK_BYTES: usize = 8 * TILE_BYTES;
/// Blocks unpacked at a time (16 KiB of planes, a third of an L1).
const SLAB_BLOCKS: usize = 2;

/// Rows `rows` (a multiple of [`TILE_ROWS`]) of a Q4_K/Q6_K product against group `g`: the
/// group's `v` planes are unpacked once, [`SLAB_BLOCKS`] blocks at a time, and for each slab,
/// each pair of 16-row tiles and each of the slab's blocks,
/// `Σ lo·a` and `Σ hi·a` over the block's four 64-value steps (tiles 0-3: low and high for
/// each row tile), `isum = lo + 256·hi`, and the block's f32 update onto the output, which
/// carries the accumulators between blocks.
///
/// # Safety
/// As [`flat_rows`].
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn scaled_rows<F: ScaledBlocks>(
    job: &GroupJob<'_>,
    group: *const u8,
    g: usize,
    rows: Range<usize>,
) {
    debug_assert_eq!(rows.len() % TILE_ROWS, 0);
    const CONFIG: TileConfig = TileConfig::new(64, 16);
    let acts = job.acts;
    let nb = acts.k / F::BLOCK_K;
    with_unpacked(SLAB_BLOCKS * SCALED_BLOCK_BYTES, |unpacked| {
        // SAFETY: as in `flat_rows`; every weight tile load reads 16 rows of 64 bytes inside
        // one block's unpacked planes, every activation load 16 rows of 64 bytes of `acts.qs`.
        unsafe {
            let _tiles = Tiles::configure(&CONFIG);
            let mut results = Results([[0; GROUP]; 4 * TILE_ROWS]);
            let res = results.0.as_mut_ptr() as *mut u8;
            let stride = acts.k;
            let col0 = g * GROUP;
            // A slab of blocks unpacked, then every row tile over it: the planes stay in L1
            // (the whole k's, 280 KiB at k = 8960, were tile-loaded from L2 and lost to AVX-512).
            // Each output's blocks still meet its accumulator in order.
            for slab in (0..nb).step_by(SLAB_BLOCKS) {
                let slab = slab..nb.min(slab + SLAB_BLOCKS);
                for b in slab.clone() {
                    let at = (b - slab.start) * SCALED_BLOCK_BYTES;
                    let out =
                        &mut *(unpacked.as_mut_ptr().add(at) as *mut [u8; SCALED_BLOCK_BYTES]);
                    F::unpack_scaled(group.add(b * F::GROUP_BLOCK_BYTES), out);
                }
                let mut row0 = rows.start;
                while row0 < rows.end {
                    let two = row0 + 2 * TILE_ROWS <= rows.end;
                    for b in slab.clone() {
                        let planes = unpacked.as_ptr().add((b - slab.start) * SCALED_BLOCK_BYTES);
                        tile_zero!("0");
                        tile_zero!("1");
                        if two {
                            tile_zero!("2");
                            tile_zero!("3");
                        }
                        for j in 0..4 {
                            let k0 = b * F::BLOCK_K + 64 * j;
                            tile_load!("6", planes.add(j * TILE_BYTES), ROW_BYTES);
                            tile_load!("7", planes.add((4 + j) * TILE_BYTES), ROW_BYTES);
                            tile_load!("4", act_at(acts, row0, k0), stride);
                            tile_dp!(su, "0", "4", "6");
                            tile_dp!(F::HI_SIGNED, "1", "4", "7");
                            if two {
                                tile_load!("5", act_at(acts, row0 + TILE_ROWS, k0), stride);
                                tile_dp!(su, "2", "5", "6");
                                tile_dp!(F::HI_SIGNED, "3", "5", "7");
                            }
                        }
                        tile_store!("0", res, ROW_BYTES);
                        tile_store!("1", res.add(TILE_BYTES), ROW_BYTES);
                        if two {
                            tile_store!("2", res.add(2 * TILE_BYTES), ROW_BYTES);
                            tile_store!("3", res.add(3 * TILE_BYTES), ROW_BYTES);
                        }
                        let w = F::block(group.add(b * F::GROUP_BLOCK_BYTES));
                        let row_tiles = if two { 2 } else { 1 };
                        for t in 0..row_tiles {
                            for r in 0..TILE_ROWS {
                                let row = row0 + t * TILE_ROWS + r;
                                let lo = Avx512::load(
                                    results.0[2 * t * TILE_ROWS + r].as_ptr() as *const u8
                                );
                                let hi =
                                    Avx512::load(results.0[(2 * t + 1) * TILE_ROWS + r].as_ptr()
                                        as *const u8);
                                let isum = _mm512_add_epi32(lo, _mm512_slli_epi32::<8>(hi));
                                let f = job.carried::<Avx512, 1>(b, row, col0);
                                let f = F::finish(w, acts, row, b, isum, f[0]);
                                job.store::<Avx512, 1>([f], row, col0);
                            }
                        }
                    }
                    row0 += if two { 2 * TILE_ROWS } else { TILE_ROWS };
                }
            }
        }
    })
}

/// `v = q·sc` for the 64 bytes `q` (16 columns × 4 quants, signed or unsigned bytes as
/// `signed_q` says, |q| < 128) and the i16 scale of each column in `sc16` (both halves of its
/// 32-bit lane), as (low bytes, high bytes) in the same places.
///
/// # Safety
/// AVX-512 F/BW enabled.
#[inline(always)]
pub(super) unsafe fn split_scaled(q: __m512i, sc16: __m512i, signed_q: bool) -> (__m512i, __m512i) {
    // SAFETY: register operations; the caller's ISA contract holds.
    unsafe {
        let (even, odd) = if signed_q {
            (
                _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(q)),
                _mm512_srai_epi16::<8>(q),
            )
        } else {
            (
                _mm512_and_si512(q, _mm512_set1_epi16(0xFF)),
                _mm512_srli_epi16::<8>(q),
            )
        };
        let pe = _mm512_mullo_epi16(even, sc16);
        let po = _mm512_mullo_epi16(odd, sc16);
        let low = _mm512_set1_epi16(0xFF);
        let lo = _mm512_or_si512(_mm512_and_si512(pe, low), _mm512_slli_epi16::<8>(po));
        let hi = _mm512_or_si512(_mm512_srli_epi16::<8>(pe), _mm512_andnot_si512(low, po));
        (lo, hi)
    }
}

/// Each column's scale (16 i32 lanes) in both i16 halves of its lane.
///
/// # Safety
/// AVX-512 F enabled.
#[inline(always)]
pub(super) unsafe fn scale16(sc32: __m512i) -> __m512i {
    // SAFETY: register operations.
    unsafe {
        _mm512_or_si512(
            _mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF)),
            _mm512_slli_epi32::<16>(sc32),
        )
    }
}

/// Stores `v` at row `row` of tile `tile` of `out`.
///
/// # Safety
/// AVX-512 F enabled; `out` holds that tile.
#[inline(always)]
pub(super) unsafe fn put(out: &mut [u8], tile: usize, row: usize, v: __m512i) {
    let at = &mut out[tile * TILE_BYTES + row * ROW_BYTES..][..ROW_BYTES];
    // SAFETY: `at` is 64 writable bytes.
    unsafe { _mm512_storeu_si512(at.as_mut_ptr() as *mut __m512i, v) }
}
