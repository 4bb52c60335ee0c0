//! Our own CPU matmuls for the GGUF quant types that dominate the demo models
//! (Q5_0, Q8_0, Q4_K, Q6_K): `y[m, n] = x[m, k] · Wᵀ` with `W` packed at load time.
//!
//! Shape of the computation:
//! * activations are quantized per row to int8 blocks exactly as ggml/candle do
//!   ([`activation`]), so results match candle's `QMatMul` up to f32 summation order;
//! * weights are repacked into groups of 16 output columns interleaved 4 bytes at
//!   a time, so one 512-bit register (or each half of the group in a 256-bit one)
//!   holds 4 k-values of every column and a broadcast of 4 activation bytes feeds
//!   one `vpdpbusd` (or `maddubs`+`madd` on AVX2) per (row, 4 k-values, columns);
//! * a kernel computes a tile of `R` rows × `LANES` columns over the whole of k,
//!   each weight block reused across the `R` rows (GEMM for prefill; `R = 1` is the
//!   decode GEMV, which only streams the weights once);
//! * on plain AVX2 a single row (decode) runs `Kernel::row_avx2` over all 16 columns of a
//!   group, with software prefetches ahead ([`prefetch`]): decode streams every
//!   matrix from memory, and that, not the arithmetic, bounds it;
//! * on plain AVX2, 2 to 8 rows (a speculative verification step) stream the weights the same
//!   way, each block going through every row's tile while it is in L1
//!   (`GroupJob::few_rows_avx2`); from 5 rows on they are bound by the arithmetic instead;
//! * on AVX-512 1 to 8 rows stream the same way, 16 columns a register
//!   (`GroupJob::few_rows_wide`);
//! * on AMX (chosen for prefill and batches where it wins), whole 16-row tiles of a work item run on tile
//!   products and the rows past them on AVX-512 ([`amx`]);
//! * work items are (row chunk, column group) pairs handed to candle's barrier pool: a few
//!   rows (decode) give each thread one contiguous share of them to stream, stealing at the
//!   end (`layers::parallel::execute_contiguous`); more rows take sixteenths.
//!
//! Batch invariance: every output element is produced by one thread, over all of
//! k, with the same sequence of f32 operations whatever `m`, the tile height, the
//! thread or the ISA (int sums are exact). So row r of an m-row product equals the
//! product of row r alone, bit for bit.

/// [`Kernel::amx_rows`] for a format whose AMX form is `amx::$driver` (`flat_rows` or
/// `scaled_rows`, which need the format's [`amx::FlatBlocks`] / [`amx::ScaledBlocks`]).
macro_rules! amx_rows_by {
    ($driver:ident) => {
        #[inline(always)]
        unsafe fn amx_rows(
            job: &super::GroupJob<'_>,
            group: *const u8,
            g: usize,
            rows: std::ops::Range<usize>,
        ) -> bool {
            // SAFETY: forwarded.
            unsafe { super::amx::$driver::<Self>(job, group, g, rows) };
            true
        }
    };
}

mod activation;
mod amx;
mod int4;
pub(crate) mod prefetch;
mod q4_k;
mod q5_0;
mod q6_k;
mod q8_0;
mod select;
mod simd;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};

use crate::error::Result;
use crate::large_buffer::LargeBuffer;
use crate::layers::parallel::SharedOut;
use activation::{ActKind, QuantizedActs};
use simd::{Avx2, Avx512, IsaChoice, Simd, Vnni256};

/// Output columns per packed group (one f32 lane each in a 512-bit register).
const GROUP: usize = 16;
/// Activation bytes per row chunk: one chunk's quantized rows should stay in L2
/// while every column group streams past them.
const ROW_CHUNK_BYTES: usize = 256 * 1024;
/// k-values per slab: a work item runs all its row tiles over one slab of blocks
/// before the next, so the slab of its group's weights (≤ 14 KiB for 16 columns in
/// every format) stays in L1 across the tiles instead of streaming from L2 once per
/// tile (measured on AVX2: Q6_K at k = 8960 was ~1.5x slower per MAC than at k = 1536).
const SLAB_K: usize = 1024;
/// One quant format's packing and micro-kernel.
trait Kernel {
    const ACT: ActKind;
    /// Weights per quant block along k.
    const BLOCK_K: usize;
    /// Bytes of one ggml block of one row.
    const RAW_BLOCK_BYTES: usize;
    /// Bytes of one packed block of one 16-column group.
    const GROUP_BLOCK_BYTES: usize;
    /// Rows per AVX-512 tile: more rows reuse each unpacked weight chunk more, but
    /// past this the accumulators spill (measured per format on Zen 5).
    const WIDE_TILE: usize;
    /// Rows per plain-AVX2 tile (4 or 6; 16 ymm registers bound it).
    const AVX2_TILE: usize = 4;

    /// Packs the same block index of up to 16 rows of `W` (`None`: padding column,
    /// left zero) into `out` (`GROUP_BLOCK_BYTES`, zero-initialised).
    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]);

    /// Rows `row0..row0+R` of `acts` times columns `col_off..col_off+S::LANES` of
    /// the group at `group`, over k-blocks `blocks`, accumulated onto `facc` one block
    /// at a time in order; lane l of result r is output (row0 + r, col_off + l).
    ///
    /// # Safety
    /// `group` must point at `acts.k / BLOCK_K` packed blocks; `blocks` must lie in
    /// `0..acts.k / BLOCK_K` (`acts.nb` counts activation blocks, which may be smaller);
    /// `col_off + S::LANES ≤ GROUP`; the rows must exist in `acts`; the CPU must support `S`.
    unsafe fn tile<S: Simd, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        facc: [S::F; R],
    ) -> [S::F; R];

    /// [`Kernel::tile`] over block `b` of all 16 columns (`S::LANES == GROUP`) while the
    /// weights stream from memory (a few-row product), asking for the lines
    /// ahead ([`prefetch`]) as it goes. The default asks for the block's lines
    /// first, which suits blocks of up to 16 lines; a format with larger blocks spreads its
    /// requests over the block's work: Q4_K's 38 lines asked at once left its 1-row AVX-512
    /// stream 1.4-1.6x slower than AVX2's on Zen 5 (AVX2's `row16_avx2` spreads them), and
    /// spread the same way, within about 1.1x of it.
    ///
    /// # Safety
    /// As [`Kernel::tile`] for columns `0..GROUP` and blocks `b..b + 1`.
    #[inline(always)]
    unsafe fn stream_tile<S: Simd, const R: usize>(
        group: *const u8,
        acts: &QuantizedActs,
        row0: usize,
        b: usize,
        facc: [S::F; R],
    ) -> [S::F; R] {
        debug_assert_eq!(S::LANES, GROUP);
        // SAFETY: forwarded.
        unsafe {
            let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
            prefetch::ahead(blk, 0, Self::GROUP_BLOCK_BYTES.div_ceil(64));
            Self::tile::<S, R>(group, 0, acts, row0, b..b + 1, facc)
        }
    }

    /// [`Kernel::tile`] on plain AVX2. A format overrides it where a hand-written AVX2
    /// kernel beats the generic one; the override must compute the same exact integer
    /// sums and the same f32 operations, so its bits equal every other path's.
    ///
    /// # Safety
    /// As [`Kernel::tile`] with `S = Avx2`.
    #[inline(always)]
    unsafe fn tile_avx2<const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        facc: [std::arch::x86_64::__m256; R],
    ) -> [std::arch::x86_64::__m256; R] {
        // SAFETY: forwarded.
        unsafe { Self::tile::<Avx2, R>(group, col_off, acts, row0, blocks, facc) }
    }

    /// Row `row` of `acts` times the whole group (both 8-column halves; the second only
    /// when `both`) on plain AVX2: a decode GEMV. The default walks both halves block by
    /// block through [`Kernel::tile_avx2`], so each weight line is used completely while it
    /// is in L1; a format overrides it where a 16-column kernel streams better. Same
    /// per-element sequence of operations as [`Kernel::tile_avx2`].
    ///
    /// # Safety
    /// As [`Kernel::tile_avx2`] with `R = 1`, for columns `0..16` (`0..8` when not `both`).
    #[inline(always)]
    unsafe fn row_avx2(
        group: *const u8,
        acts: &QuantizedActs,
        row: usize,
        both: bool,
    ) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::_mm256_setzero_ps;
        // SAFETY: forwarded; the caller runs with AVX2/FMA enabled.
        unsafe {
            let mut facc = [[_mm256_setzero_ps()]; 2];
            let halves = if both { 2 } else { 1 };
            let lines = Self::GROUP_BLOCK_BYTES.div_ceil(64);
            for b in 0..acts.k / Self::BLOCK_K {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                prefetch::ahead(blk, 0, lines);
                for (h, f) in facc.iter_mut().enumerate().take(halves) {
                    *f = Self::tile_avx2::<1>(group, h * Avx2::LANES, acts, row, b..b + 1, *f);
                }
            }
            [facc[0][0], facc[1][0]]
        }
    }

    /// Rows `rows` (a multiple of [`amx::TILE_ROWS`]) against the whole group on AMX tiles
    /// ([`amx`]); false for a format without an AMX form (its rows then run on AVX-512).
    /// Same per-element sequence of f32 operations as [`Kernel::tile`].
    ///
    /// # Safety
    /// As [`GroupJob::rows`] for these rows; [`amx::available`] and AVX-512 F/BW/VNNI.
    #[inline(always)]
    unsafe fn amx_rows(
        _job: &GroupJob<'_>,
        _group: *const u8,
        _g: usize,
        _rows: Range<usize>,
    ) -> bool {
        false
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Format {
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
    /// [`crate::int4::GroupedInt4`] (AWQ, GPTQ).
    Int4,
}

impl Format {
    /// Whether the format's products have an AMX form ([`Kernel::amx_rows`]).
    fn has_amx(self) -> bool {
        !matches!(self, Self::Int4)
    }
}

/// Work items of 2 to this many rows run [`Isas::few`]'s code: the few-row streaming paths
/// (AVX2's and AVX-512's) cover exactly 2 to 8 rows (and their GEMVs one).
const FEW_ROWS: usize = 8;

/// Products of up to this many rows (and more than [`FEW_ROWS`]) run [`Isas::batch`]'s code: a
/// decode step of a batch of sequences. On a Xeon with AMX (2 threads, the demo models'
/// shapes) AVX-512 beat AMX by ~10% at 16-32 rows on Q4_K, Q5_0 and Q8_0 (AMX unpacks a
/// group's weights for only one or two row tiles), where at 64 rows AMX tied or won, as it
/// does for prefill; which wins on a CPU is timed ([`select`]).
const BATCH_ROWS: usize = 48;

/// The ISAs a matrix's products run on, each chosen by speed ([`select`]) for its regime:
/// `one` for single-row work items (decode: bound by streaming the weights), `few` for 2 to
/// [`FEW_ROWS`] rows (speculative verification, a few sequences), `batch` for the larger
/// items of products of up to [`BATCH_ROWS`] rows (a batch's decode step), `many` for the rest
/// (prefill tiles, bound by the arithmetic). Every ISA gives the same bits, so mixing them
/// keeps batch invariance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Isas {
    one: IsaChoice,
    few: IsaChoice,
    batch: IsaChoice,
    many: IsaChoice,
}

impl Isas {
    fn all(isa: IsaChoice) -> Self {
        Self {
            one: isa,
            few: isa,
            batch: isa,
            many: isa,
        }
    }

    /// The ISA of a work item of `rows` rows in an `m`-row product.
    fn for_item(&self, m: usize, rows: usize) -> IsaChoice {
        match rows {
            1 => self.one,
            2..=FEW_ROWS => self.few,
            _ => self.tiled(m),
        }
    }

    /// The ISA of an `m`-row product's items of more than [`FEW_ROWS`] rows.
    fn tiled(&self, m: usize) -> IsaChoice {
        if m <= BATCH_ROWS {
            self.batch
        } else {
            self.many
        }
    }
}

/// A quantized `[n, k]` weight in our packed layout.
pub struct PackedMatrix {
    format: Format,
    isas: Isas,
    n: usize,
    k: usize,
    group_bytes: usize,
    data: Packed,
}

/// Packed weights: cache-line aligned (a plain `Vec<u8>` of this size comes from `mmap` + 16
/// bytes, which splits every other 32-byte load of a 64-byte plane row across two lines), on
/// huge pages where the OS has them ([`LargeBuffer`]: decode streams them from memory).
struct Packed(LargeBuffer);

impl Packed {
    fn zeroed(len: usize) -> Self {
        Self(LargeBuffer::zeroed(len))
    }

    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl PackedMatrix {
    /// Packs `t` (`[n, k]`) when its type has a kernel here and the CPU has AVX2+FMA;
    /// `None` means "use candle's QMatMul".
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let format = match t.dtype() {
            GgmlDType::Q5_0 => Format::Q5_0,
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q6K => Format::Q6K,
            _ => return Ok(None),
        };
        let Some(isas) = select::isas_for(format) else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        Ok(Some(Self::from_raw(format, &t.data()?, n, k, isas)))
    }

    /// Packs `w` when the CPU has AVX2+FMA; `None` means "dequantize it".
    pub fn from_int4(w: &crate::int4::GroupedInt4) -> Option<Self> {
        let isas = select::isas_for(Format::Int4)?;
        Some(Self::from_raw(
            Format::Int4,
            w.blocks(),
            w.rows(),
            w.cols(),
            isas,
        ))
    }

    /// Packs `raw`, `n` rows of `k` values in ggml's `format` blocks.
    fn from_raw(format: Format, raw: &[u8], n: usize, k: usize, isas: Isas) -> Self {
        let (group_bytes, data) = match format {
            Format::Q5_0 => pack::<q5_0::Q5_0>(raw, n, k),
            Format::Q8_0 => pack::<q8_0::Q8_0>(raw, n, k),
            Format::Q4K => pack::<q4_k::Q4K>(raw, n, k),
            Format::Q6K => pack::<q6_k::Q6K>(raw, n, k),
            Format::Int4 => pack::<int4::Int4>(raw, n, k),
        };
        Self {
            format,
            isas,
            n,
            k,
            group_bytes,
            data,
        }
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// This matrix stacked `times` times (`n` a multiple of [`GROUP`]): the layout is group by
    /// group, so that is the packed bytes repeated, without packing the rows again (the
    /// kernel-timing problems are tens of MiB of 16 repeated rows).
    fn repeat_groups(&self, times: usize) -> Self {
        assert_eq!(self.n % GROUP, 0, "whole groups only");
        let one = self.data.bytes();
        let mut data = Packed::zeroed(one.len() * times);
        for copy in data.bytes_mut().chunks_exact_mut(one.len()) {
            copy.copy_from_slice(one);
        }
        Self {
            format: self.format,
            isas: self.isas,
            n: self.n * times,
            k: self.k,
            group_bytes: self.group_bytes,
            data,
        }
    }

    /// Runs later products on `isas` (the same bits: only the timing problem switches).
    fn set_isas(&mut self, isas: Isas) {
        self.isas = isas;
    }

    /// Bytes of the packed weights (padding columns of a last partial group included: they
    /// are read too).
    pub fn storage_bytes(&self) -> usize {
        self.data.bytes().len()
    }

    /// `x`: `[m, k]` → `[m, n]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = Vec::new();
        self.matmul_into(x, m, &mut out);
        out
    }

    /// [`Self::matmul`] into `out` (resized to `m · n`, its capacity reused).
    pub fn matmul_into(&self, x: &[f32], m: usize, out: &mut Vec<f32>) {
        matmul_many_into(&[self], x, m, &mut [out]);
    }

    /// `[m, n]` from the input already quantized for this matrix's format (the timing
    /// problems: the quantization is the same code whatever the ISA, so it is left out).
    fn product(&self, acts: &QuantizedActs, m: usize) -> Vec<f32> {
        let mut out = Vec::new();
        products_into(&[self], &[acts], m, &mut [&mut out]);
        out
    }

    fn act_kind(&self) -> ActKind {
        match self.format {
            Format::Q5_0 => q5_0::Q5_0::ACT,
            Format::Q8_0 => q8_0::Q8_0::ACT,
            Format::Q4K => q4_k::Q4K::ACT,
            Format::Q6K => q6_k::Q6K::ACT,
            Format::Int4 => int4::Int4::ACT,
        }
    }

    /// A multiple of every tile height (4, 6, 8) where it can be, so that only the last
    /// chunk of a product ends in short tiles (at k = 8960 the old 29-row chunks ran 5 of
    /// every 29 rows as single-row tiles).
    fn rows_per_chunk(&self, m: usize) -> usize {
        if self.isas.tiled(m) == IsaChoice::Amx {
            // Whole pairs of AMX row tiles (rows past the last whole tile run on AVX-512), as
            // many as [`amx::CHUNK_BYTES`] of activations hold: each item unpacks its group's
            // weights once for all of them.
            let pair = 2 * amx::TILE_ROWS;
            return (amx::CHUNK_BYTES / self.k / pair).max(1) * pair;
        }
        let rows = ROW_CHUNK_BYTES / self.k;
        if rows >= 24 {
            rows / 24 * 24
        } else {
            rows.max(8)
        }
    }

    /// Work items of an `m`-row product: (row chunk, column group) pairs.
    fn items(&self, m: usize) -> usize {
        m.div_ceil(self.rows_per_chunk(m)) * self.n.div_ceil(GROUP)
    }

    /// Runs work item `item` of the `m`-row product whose quantized input is `acts` into `dst`.
    ///
    /// # Safety
    /// `acts` must be the input quantized for `F` (this matrix's format), and `dst` an output
    /// of `m · n` floats that no one else writes at this item's (rows, columns).
    unsafe fn item<F: Kernel>(&self, acts: &QuantizedActs, m: usize, dst: SharedOut, item: usize) {
        let groups = self.n.div_ceil(GROUP);
        let rows_per_chunk = self.rows_per_chunk(m);
        let job = GroupJob {
            acts,
            n: self.n,
            dst,
        };
        let (chunk, g) = (item / groups, item % groups);
        let rows = chunk * rows_per_chunk..m.min((chunk + 1) * rows_per_chunk);
        let group = self.data.bytes()[g * self.group_bytes..].as_ptr();
        let isa = self.isas.for_item(m, rows.len());
        // SAFETY: `group` starts a packed group of `k / BLOCK_K` blocks (see `pack`), `rows` lie
        // inside `acts`, `isa` was detected on this CPU, and each (row, column) of the output
        // is written by exactly one work item.
        unsafe {
            match isa {
                IsaChoice::Amx => job.rows_amx::<F>(group, g, rows),
                IsaChoice::Avx512 => job.rows_avx512::<F>(group, g, rows),
                IsaChoice::Vnni256 => job.rows_vnni256::<F>(group, g, rows),
                IsaChoice::Avx2 => job.rows_avx2::<F>(group, g, rows),
            }
        }
    }

    /// # Safety
    /// As [`Self::item`], with `acts` quantized for this matrix's format.
    unsafe fn item_any(&self, acts: &QuantizedActs, m: usize, dst: SharedOut, item: usize) {
        // SAFETY: forwarded.
        unsafe {
            match self.format {
                Format::Q5_0 => self.item::<q5_0::Q5_0>(acts, m, dst, item),
                Format::Q8_0 => self.item::<q8_0::Q8_0>(acts, m, dst, item),
                Format::Q4K => self.item::<q4_k::Q4K>(acts, m, dst, item),
                Format::Q6K => self.item::<q6_k::Q6K>(acts, m, dst, item),
                Format::Int4 => self.item::<int4::Int4>(acts, m, dst, item),
            }
        }
    }
}

/// Most matrices one [`matmul_many_into`] takes (Q, K and V).
pub const MAX_MANY: usize = 4;

thread_local! {
    /// Quantized activations of the calling thread, one per [`ActKind`], reused across
    /// products so that a decode step allocates nothing once they have grown.
    static ACTS: RefCell<[QuantizedActs; 2]> = RefCell::new(Default::default());
}

/// `x · Wᵢᵀ` for several matrices of the same input (Q, K and V; gate and up): `x` is
/// quantized once per activation format among them, and every product's work items run in
/// one fork/join of the pool. Each output equals `mats[i].matmul(x, m)` bit for bit.
pub fn matmul_many(mats: &[&PackedMatrix], x: &[f32], m: usize) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|_| Vec::new()).collect();
    let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
    matmul_many_into(mats, x, m, &mut refs);
    outs
}

/// [`matmul_many`] into `outs[i]` (each resized to `m · nᵢ`, its capacity reused); at most
/// [`MAX_MANY`] matrices. Allocates nothing once the buffers have grown.
pub fn matmul_many_into(mats: &[&PackedMatrix], x: &[f32], m: usize, outs: &mut [&mut Vec<f32>]) {
    let k = mats.first().map_or(0, |w| w.k);
    assert!(
        mats.len() <= MAX_MANY
            && outs.len() == mats.len()
            && mats.iter().all(|w| w.k == k)
            && x.len() == m * k,
        "packed matmul shapes: this is a bug"
    );
    let slot = |kind: ActKind| match kind {
        ActKind::Q8_0 => 0,
        ActKind::Q8K => 1,
    };
    ACTS.with(|cell| {
        // A nested call (none today) would find the buffers taken: it gets its own.
        let mut own: [QuantizedActs; 2] = Default::default();
        let mut borrowed = cell.try_borrow_mut();
        let acts: &mut [QuantizedActs; 2] = match borrowed.as_deref_mut() {
            Ok(acts) => acts,
            Err(_) => &mut own,
        };
        let mut filled = [false; 2];
        for w in mats {
            let kind = w.act_kind();
            if !filled[slot(kind)] {
                acts[slot(kind)].fill(kind, x, m, k);
                filled[slot(kind)] = true;
            }
        }
        let acts: &[QuantizedActs; 2] = acts;
        let mut per_mat = [&acts[0]; MAX_MANY];
        for (a, w) in per_mat.iter_mut().zip(mats) {
            *a = &acts[slot(w.act_kind())];
        }
        products_into(mats, &per_mat[..mats.len()], m, outs);
    });
}

/// The products of [`matmul_many_into`] from inputs already quantized (`acts[i]` for
/// `mats[i]`'s format): every product's work items in one fork/join of the pool.
fn products_into(
    mats: &[&PackedMatrix],
    acts: &[&QuantizedActs],
    m: usize,
    outs: &mut [&mut Vec<f32>],
) {
    let mut dsts = [None; MAX_MANY];
    for ((w, out), dst) in mats.iter().zip(outs.iter_mut()).zip(&mut dsts) {
        // Not zeroed: every work item writes all of its outputs (the first block starts
        // from zero, not from what the buffer held), and zeroing was 3.5% of a prefill.
        out.resize(m * w.n, 0.0);
        *dst = Some(SharedOut::new(out));
    }
    // Item ranges of each product in one flat numbering.
    let mut starts = [0usize; MAX_MANY + 1];
    for (i, w) in mats.iter().enumerate() {
        starts[i + 1] = starts[i] + w.items(m);
    }
    let starts = &starts[..=mats.len()];
    let total = starts[mats.len()];
    let run = |range: Range<usize>| {
        for item in range {
            let i = starts.partition_point(|&s| s <= item) - 1;
            let dst = dsts[i].expect("one output per matrix");
            // SAFETY: `acts[i]` is the input quantized for `mats[i]`'s format; `dst` is its
            // own output, each item of which one work item writes.
            unsafe { mats[i].item_any(acts[i], m, dst, item - starts[i]) };
        }
    };
    // A few rows stream the weights: each thread takes one contiguous share. More rows
    // are bound by the arithmetic, where sixteenths of the work balance best.
    if m <= FEW_ROWS {
        crate::layers::parallel::execute_contiguous(total, run);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(total, run);
    }
}

/// Reorders ggml rows into 16-column groups, `[group][block][GROUP_BLOCK_BYTES]`.
fn pack<F: Kernel>(raw: &[u8], n: usize, k: usize) -> (usize, Packed) {
    let nb = k / F::BLOCK_K;
    let row_bytes = nb * F::RAW_BLOCK_BYTES;
    let group_bytes = nb * F::GROUP_BLOCK_BYTES;
    let groups = n.div_ceil(GROUP);
    let mut data = Packed::zeroed(groups * group_bytes);
    for (g, dst) in data.bytes_mut().chunks_exact_mut(group_bytes).enumerate() {
        for (b, out) in dst.chunks_exact_mut(F::GROUP_BLOCK_BYTES).enumerate() {
            let cols: [Option<&[u8]>; GROUP] = std::array::from_fn(|j| {
                let row = g * GROUP + j;
                (row < n).then(|| {
                    let start = row * row_bytes + b * F::RAW_BLOCK_BYTES;
                    &raw[start..start + F::RAW_BLOCK_BYTES]
                })
            });
            F::pack_block(&cols, out);
        }
    }
    (group_bytes, data)
}

/// What every work item shares: the quantized rows and where results go.
struct GroupJob<'a> {
    acts: &'a QuantizedActs,
    n: usize,
    dst: SharedOut,
}

impl GroupJob<'_> {
    /// Whole 16-row tiles on AMX where the format has an AMX form, the rest on AVX-512.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
    unsafe fn rows_amx<F: Kernel>(&self, group: *const u8, g: usize, rows: Range<usize>) {
        let tiled = rows.len() / amx::TILE_ROWS * amx::TILE_ROWS;
        // SAFETY: forwarded contract of `run`; `IsaChoice::Amx` is offered only where
        // `amx::available()` and AVX-512 are.
        unsafe {
            let done = tiled > 0 && F::amx_rows(self, group, g, rows.start..rows.start + tiled);
            let rest = if done { rows.start + tiled } else { rows.start };
            if rest < rows.end {
                self.rows_avx512::<F>(group, g, rest..rows.end);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
    unsafe fn rows_avx512<F: Kernel>(&self, group: *const u8, g: usize, rows: Range<usize>) {
        // SAFETY: forwarded contract of `run`; these features were detected.
        unsafe {
            let r = rows.start;
            // Up to FEW_ROWS rows stream the weights, as AVX2's decode and few-row paths do;
            // tiles of at most 4 rows keep every format's accumulators in registers.
            match rows.len() {
                1 => return self.few_rows_wide::<F, Avx512, 1, 0>(group, g, r),
                2 => return self.few_rows_wide::<F, Avx512, 2, 0>(group, g, r),
                3 => return self.few_rows_wide::<F, Avx512, 3, 0>(group, g, r),
                4 => return self.few_rows_wide::<F, Avx512, 4, 0>(group, g, r),
                5 => return self.few_rows_wide::<F, Avx512, 3, 2>(group, g, r),
                6 => return self.few_rows_wide::<F, Avx512, 3, 3>(group, g, r),
                7 => return self.few_rows_wide::<F, Avx512, 4, 3>(group, g, r),
                8 => return self.few_rows_wide::<F, Avx512, 4, 4>(group, g, r),
                _ => {}
            }
            match F::WIDE_TILE {
                4 => self.rows::<F, Avx512, 4>(group, g, rows),
                6 => self.rows::<F, Avx512, 6>(group, g, rows),
                _ => self.rows::<F, Avx512, 8>(group, g, rows),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,avxvnni")]
    unsafe fn rows_vnni256<F: Kernel>(&self, group: *const u8, g: usize, rows: Range<usize>) {
        // SAFETY: forwarded contract of `run`; these features were detected.
        unsafe { self.rows::<F, Vnni256, 4>(group, g, rows) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<F: Kernel>(&self, group: *const u8, g: usize, rows: Range<usize>) {
        // SAFETY: forwarded contract of `run`; these features were detected.
        unsafe {
            if rows.len() == 1 {
                let both = g * GROUP + Avx2::LANES < self.n;
                let [f0, f1] = F::row_avx2(group, self.acts, rows.start, both);
                self.store::<Avx2, 1>([f0], rows.start, g * GROUP);
                if both {
                    self.store::<Avx2, 1>([f1], rows.start, g * GROUP + Avx2::LANES);
                }
                return;
            }
            let r = rows.start;
            // A few rows: one streaming pass.
            match rows.len() {
                2 => self.few_rows_avx2::<F, 2, 0>(group, g, r),
                3 => self.few_rows_avx2::<F, 3, 0>(group, g, r),
                4 => self.few_rows_avx2::<F, 4, 0>(group, g, r),
                5 => self.few_rows_avx2::<F, 5, 0>(group, g, r),
                6 => self.few_rows_avx2::<F, 6, 0>(group, g, r),
                7 => self.few_rows_avx2::<F, 4, 3>(group, g, r),
                8 => self.few_rows_avx2::<F, 4, 4>(group, g, r),
                _ => match F::AVX2_TILE {
                    6 => self.rows::<F, Avx2, 6>(group, g, rows),
                    _ => self.rows::<F, Avx2, 4>(group, g, rows),
                },
            }
        }
    }

    /// `A + B` rows (2 to 8: a speculative verification step, or a few
    /// sequences decoding together) against the whole group on plain AVX2, block by block
    /// over all of k with software prefetches ahead ([`prefetch`]), like the
    /// decode GEMV: the weights stream from memory once and each block, while it is in L1,
    /// goes through every row (a tile of `A` rows, then one of `B`) and both column halves.
    /// Before this, such products ran the prefill driver's 2- and 1-row tiles, each a pass of
    /// its own without prefetches (m = 5 cost 3.8–4.7× one row). Same per-element sequence as
    /// [`Self::rows`].
    ///
    /// # Safety
    /// As [`Self::rows`], for rows `row0..row0 + A + B`; AVX2/FMA enabled.
    #[inline(always)]
    unsafe fn few_rows_avx2<F: Kernel, const A: usize, const B: usize>(
        &self,
        group: *const u8,
        g: usize,
        row0: usize,
    ) {
        use std::arch::x86_64::_mm256_setzero_ps;
        const HALVES: usize = 2;
        let halves = if g * GROUP + Avx2::LANES < self.n {
            2
        } else {
            1
        };
        let lines = F::GROUP_BLOCK_BYTES.div_ceil(64);
        // SAFETY: forwarded contract of `run`; `col_off + LANES ≤ GROUP`.
        unsafe {
            let mut fa = [[_mm256_setzero_ps(); A]; HALVES];
            let mut fb = [[_mm256_setzero_ps(); B]; HALVES];
            // The block's prefetches spread over its tile calls: a large block's lines all
            // requested at once made Q6_K's m = 5 stream 1.6x slower; a small block's (≤ 16
            // lines: Q5_0, Q8_0) go at once (splitting them made Q8_0's 1.6x slower).
            let steps = if lines > 16 {
                halves * if B > 0 { 2 } else { 1 }
            } else {
                1
            };
            let per_step = lines.div_ceil(steps);
            for b in 0..self.acts.k / F::BLOCK_K {
                let blk = group.add(b * F::GROUP_BLOCK_BYTES);
                let mut step = 0;
                let mut ask_ahead = || {
                    if step < steps {
                        let from = per_step * step;
                        prefetch::ahead(blk, 64 * from, per_step.min(lines.saturating_sub(from)));
                        step += 1;
                    }
                };
                for h in 0..halves {
                    let col_off = h * Avx2::LANES;
                    ask_ahead();
                    fa[h] = F::tile_avx2::<A>(group, col_off, self.acts, row0, b..b + 1, fa[h]);
                    if B > 0 {
                        ask_ahead();
                        let r = row0 + A;
                        fb[h] = F::tile_avx2::<B>(group, col_off, self.acts, r, b..b + 1, fb[h]);
                    }
                }
            }
            for h in 0..halves {
                let col0 = g * GROUP + h * Avx2::LANES;
                self.store::<Avx2, A>(fa[h], row0, col0);
                if B > 0 {
                    self.store::<Avx2, B>(fb[h], row0 + A, col0);
                }
            }
        }
    }

    /// `A + B` rows (1 to [`FEW_ROWS`]: decode, verification, a few sequences) against the
    /// whole group on an ISA whose register holds all of it (AVX-512), block by block over all
    /// of k with software prefetches ahead ([`prefetch`]): the AVX2 paths' stream
    /// ([`Kernel::row_avx2`], [`Self::few_rows_avx2`]) at 16 columns a register. Before it these
    /// rows went through [`Self::rows`]' slabs without prefetches: on Zen 5 (2 threads, a
    /// 63 MiB matrix) a 4-row Q5_0 product took 5.1 ms, 1.3-1.7 ms with it (AVX2: 3.2-3.4).
    /// Same per-element sequence as [`Self::rows`].
    ///
    /// # Safety
    /// As [`Self::rows`], for rows `row0..row0 + A + B`; `S` enabled on this CPU.
    #[inline(always)]
    unsafe fn few_rows_wide<F: Kernel, S: Simd, const A: usize, const B: usize>(
        &self,
        group: *const u8,
        g: usize,
        row0: usize,
    ) {
        debug_assert_eq!(S::LANES, GROUP);
        // SAFETY: forwarded contract of `run`; column offset 0 covers the whole group.
        unsafe {
            let mut fa = [S::zerof(); A];
            let mut fb = [S::zerof(); B];
            for b in 0..self.acts.k / F::BLOCK_K {
                // The first tile asks for the lines ahead; the second reads the block from L1.
                fa = F::stream_tile::<S, A>(group, self.acts, row0, b, fa);
                if B > 0 {
                    fb = S::kernel_tile::<F, B>(group, 0, self.acts, row0 + A, b..b + 1, fb);
                }
            }
            let col0 = g * GROUP;
            self.store::<S, A>(fa, row0, col0);
            if B > 0 {
                self.store::<S, B>(fb, row0 + A, col0);
            }
        }
    }

    /// Full tiles of `TILE` rows, then tiles of 2 and 1, each over every `S::LANES`-wide
    /// slice of the group in turn (so the rows' activations come from L2 once per slab, not
    /// once per slice: 3–5% on Q4_K prefill on AVX2), one k-slab of [`SLAB_K`] values at a
    /// time; every path runs the same per-element sequence (blocks in order onto one f32
    /// accumulator, carried between slabs in the output), so where a row falls does not
    /// change its bits.
    #[inline(always)]
    unsafe fn rows<F: Kernel, S: Simd, const TILE: usize>(
        &self,
        group: *const u8,
        g: usize,
        rows: Range<usize>,
    ) {
        let nb = self.acts.k / F::BLOCK_K;
        if rows.len() == 1 && S::LANES < GROUP {
            // SAFETY: forwarded contract of `run`.
            unsafe { self.single_row::<F, S>(group, g, rows.start) };
            return;
        }
        let slab = (SLAB_K / F::BLOCK_K).max(1);
        for b0 in (0..nb).step_by(slab) {
            let blocks = b0..nb.min(b0 + slab);
            let mut r = rows.start;
            // SAFETY (the three loops): forwarded contract of `run`.
            unsafe {
                while r + TILE <= rows.end {
                    self.tile_all_halves::<F, S, TILE>(group, g, r, blocks.clone());
                    r += TILE;
                }
                while TILE > 2 && r + 2 <= rows.end {
                    self.tile_all_halves::<F, S, 2>(group, g, r, blocks.clone());
                    r += 2;
                }
                while r < rows.end {
                    self.tile_all_halves::<F, S, 1>(group, g, r, blocks.clone());
                    r += 1;
                }
            }
        }
    }

    /// Rows `r..r+R` against every `S::LANES`-wide slice of the group over one slab of blocks:
    /// the slices one after the other while the rows' activations are still in L1 (the slab of
    /// the whole group's weights stays there across the tiles).
    ///
    /// # Safety
    /// As [`Self::rows`], for rows `r..r+R` and blocks `blocks`.
    #[inline(always)]
    unsafe fn tile_all_halves<F: Kernel, S: Simd, const R: usize>(
        &self,
        group: *const u8,
        g: usize,
        r: usize,
        blocks: Range<usize>,
    ) {
        for col_off in (0..GROUP).step_by(S::LANES) {
            let col0 = g * GROUP + col_off;
            if col0 >= self.n {
                break;
            }
            // SAFETY: forwarded contract of `run`; `col_off + LANES ≤ GROUP`.
            unsafe {
                let facc = self.carried::<S, R>(blocks.start, r, col0);
                let tile =
                    S::kernel_tile::<F, R>(group, col_off, self.acts, r, blocks.clone(), facc);
                self.store::<S, R>(tile, r, col0);
            }
        }
    }

    /// One row (a decode GEMV) against the whole group on AVX-VNNI (plain AVX2 has
    /// [`Kernel::row_avx2`]): both column halves block by block, so each weight line is used
    /// completely while it is in L1 (measured ~10% faster than half by half for Q4_K/Q6_K at
    /// m = 1 on AVX2, before the prefetching 16-column kernels). Same per-element sequence
    /// as [`Self::rows`].
    #[inline(always)]
    unsafe fn single_row<F: Kernel, S: Simd>(&self, group: *const u8, g: usize, row: usize) {
        const HALVES: usize = 2;
        debug_assert_eq!(S::LANES * HALVES, GROUP);
        let halves = if g * GROUP + S::LANES < self.n { 2 } else { 1 };
        // SAFETY: forwarded contract of `run`; `col_off + LANES ≤ GROUP`.
        unsafe {
            let mut facc = [[S::zerof(); 1]; HALVES];
            for b in 0..self.acts.k / F::BLOCK_K {
                for (h, f) in facc.iter_mut().enumerate().take(halves) {
                    *f = S::kernel_tile::<F, 1>(group, h * S::LANES, self.acts, row, b..b + 1, *f);
                }
            }
            for (h, f) in facc.into_iter().enumerate().take(halves) {
                self.store::<S, 1>(f, row, g * GROUP + h * S::LANES);
            }
        }
    }

    /// The accumulators a slab starting at block `b0` continues from: zero for the
    /// first slab, else what the previous slab stored (the real columns; padding
    /// lanes are zero and never stored).
    #[inline(always)]
    unsafe fn carried<S: Simd, const R: usize>(
        &self,
        b0: usize,
        row0: usize,
        col0: usize,
    ) -> [S::F; R] {
        // SAFETY: the CPU supports `S` (the caller's contract).
        let mut facc = [unsafe { S::zerof() }; R];
        if b0 == 0 {
            return facc;
        }
        let cols = S::LANES.min(self.n - col0);
        for (r, f) in facc.iter_mut().enumerate() {
            if cols == S::LANES {
                // SAFETY: as below; a full slice is `LANES` f32 of the row segment, read
                // directly (the copy below is a `memcpy` call per row, tile and slab).
                unsafe {
                    let at = self.dst.range((row0 + r) * self.n + col0, cols);
                    *f = S::loadf(at.as_ptr() as *const u8);
                }
                continue;
            }
            let mut lanes = [0f32; GROUP];
            // SAFETY: the row segment `(row0 + r)·n + col0 .. + cols` lies in `out` and
            // belongs to this item only; `lanes` holds ≥ LANES f32.
            unsafe {
                lanes[..cols].copy_from_slice(self.dst.range((row0 + r) * self.n + col0, cols));
                *f = S::loadf(lanes.as_ptr() as *const u8);
            }
        }
        facc
    }

    /// Writes the lanes that are real columns (`col0 + l < n`).
    #[inline(always)]
    unsafe fn store<S: Simd, const R: usize>(&self, tile: [S::F; R], row0: usize, col0: usize) {
        let cols = S::LANES.min(self.n - col0);
        for (r, v) in tile.into_iter().enumerate() {
            if cols == S::LANES {
                // SAFETY: as below, straight into the `LANES` f32 of the row segment.
                unsafe {
                    let dst = self.dst.range((row0 + r) * self.n + col0, cols);
                    S::store(dst.as_mut_ptr(), v);
                }
                continue;
            }
            let mut lanes = [0f32; GROUP];
            // SAFETY: `lanes` holds ≥ LANES f32; the destination row segment
            // `(row0 + r)·n + col0 .. + cols` lies in `out` and belongs to this item only.
            unsafe {
                S::store(lanes.as_mut_ptr(), v);
                let dst = self.dst.range((row0 + r) * self.n + col0, cols);
                dst.copy_from_slice(&lanes[..cols]);
            }
        }
    }
}
