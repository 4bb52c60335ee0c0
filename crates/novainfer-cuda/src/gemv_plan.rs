//! The GEMV's (`kernels/gemv_quant.cu`) launch geometry and a CPU twin of its arithmetic,
//! operation for operation: each weight row is one warp's, cut into chunks of [`CHUNK`] values
//! that lane `l` takes in the order `l, l + 32, …`; per chunk the dequantizer's integer weights and
//! scale(s) (a bf16 row: its values, scale 1), `s = Σ q·x` (and Q4_K's `t = Σ x`) by fused
//! multiply-adds in value order, then `acc = fma(a, s, acc)` (and `acc = fma(−b, t, acc)`), and the
//! lanes meet in common.cuh's xor butterfly. The fused kernels give a warp two rows (gate row `o`
//! with up row `o`; [`qkv_pair`]: the two values RoPE mixes) and run the next kernel's arithmetic on
//! the products rounded as the unfused store would round them ([`emulate_qkv`]).
//!
//! The GPU parity test compares the kernel with [`emulate`] bit for bit, and each fused kernel with
//! the GEMV followed by the unfused kernel; the tests here check, without a GPU, that the chunks'
//! weights are the dequantized values exactly (candle's, and `GroupedInt4::dequantize`'s), that
//! every value is used once, that the result is the product within f32 rounding, and that the
//! fused kernels' pairing reads and writes the places the unfused path does.

use half::bf16;

use crate::quant_type::{scale_min_k4, QuantType};

/// Warps (weight rows) per block: `GEMV_WARPS`.
pub const WARPS: usize = 4;
/// Most activation rows one launch takes: `GEMV_MAX_ROWS`.
pub const MAX_ROWS: usize = 8;
/// Values per chunk: `GEMV_CHUNK`.
pub const CHUNK: usize = 8;
/// Chunks a bf16 row's lane loads before it uses the first: `GEMV_UNROLL` (no effect on the
/// arithmetic; packed rows load one at a time).
pub const UNROLL: usize = 4;
const WARP: usize = 32;

/// How a GEMV's weight rows are stored: packed blocks of a quantized type, or bf16 values (walked
/// as blocks of one chunk, 16 bytes, with scale 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvWeights {
    Packed(QuantType),
    Bf16,
}

impl From<QuantType> for GemvWeights {
    fn from(q: QuantType) -> Self {
        GemvWeights::Packed(q)
    }
}

impl GemvWeights {
    /// In the order of [`Self::index`].
    pub const ALL: [GemvWeights; 7] = [
        GemvWeights::Packed(QuantType::Q4K),
        GemvWeights::Packed(QuantType::Q5_0),
        GemvWeights::Packed(QuantType::Q6K),
        GemvWeights::Packed(QuantType::Q8_0),
        GemvWeights::Packed(QuantType::Int4),
        GemvWeights::Packed(QuantType::Fp8),
        GemvWeights::Bf16,
    ];

    /// The kernel's code for the format (`GEMV_Q4_K` .. `GEMV_BF16W` in gemv_quant.cu).
    pub fn index(self) -> usize {
        match self {
            GemvWeights::Packed(q) => q.index(),
            GemvWeights::Bf16 => QuantType::ALL.len(),
        }
    }

    pub fn block_values(self) -> usize {
        match self {
            GemvWeights::Packed(q) => q.block_values(),
            GemvWeights::Bf16 => CHUNK,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            GemvWeights::Packed(q) => q.block_bytes(),
            GemvWeights::Bf16 => 2 * CHUNK,
        }
    }

    /// Bytes of one weight row of `k` values.
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }
}

/// The kernel family a launch's runs need: a matrix is packed throughout or bf16 (one run), and
/// each family is a kernel of its own (the bf16 path's unrolled loads need twice the registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvFamily {
    Packed,
    Bf16,
}

impl GemvFamily {
    pub const ALL: [GemvFamily; 2] = [GemvFamily::Packed, GemvFamily::Bf16];

    pub fn index(self) -> usize {
        match self {
            GemvFamily::Packed => 0,
            GemvFamily::Bf16 => 1,
        }
    }

    /// The family of runs in `formats`, or why they have none (bf16 mixed with packed runs).
    pub fn of(formats: impl IntoIterator<Item = GemvWeights>) -> Result<Self, String> {
        let (mut packed, mut dense) = (0, 0);
        for w in formats {
            match w {
                GemvWeights::Packed(_) => packed += 1,
                GemvWeights::Bf16 => dense += 1,
            }
        }
        match (packed, dense) {
            (_, 0) => Ok(GemvFamily::Packed),
            (0, _) => Ok(GemvFamily::Bf16),
            _ => Err(format!(
                "{packed} packed runs with {dense} bf16 ones: a launch takes one family"
            )),
        }
    }

    /// The entry point's name for `epilogue`, without its dtype suffix.
    pub fn entry_base(self, epilogue: GemvEpilogue) -> String {
        let family = match self {
            GemvFamily::Packed => "packed",
            GemvFamily::Bf16 => "bf16w",
        };
        format!("{}_{family}", epilogue.entry_base())
    }
}

/// What a GEMV launch does with its products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvEpilogue {
    /// Store them (`gemv_<family>_<dtype>`).
    Store,
    /// `silu(gate) · up` of two rows (`gemv_silu_…`), silu_mul.cu's arithmetic.
    SiluMul,
    /// Bias, RoPE and the KV-cache write of the QKV projection (`gemv_qkv_…`), qkv.cu's.
    Qkv,
}

impl GemvEpilogue {
    pub const ALL: [GemvEpilogue; 3] = [
        GemvEpilogue::Store,
        GemvEpilogue::SiluMul,
        GemvEpilogue::Qkv,
    ];

    /// Its place in [`Self::ALL`] (the context's GEMV table).
    pub fn index(self) -> usize {
        match self {
            GemvEpilogue::Store => 0,
            GemvEpilogue::SiluMul => 1,
            GemvEpilogue::Qkv => 2,
        }
    }

    /// The entry points' name without family and dtype.
    pub fn entry_base(self) -> &'static str {
        match self {
            GemvEpilogue::Store => "gemv",
            GemvEpilogue::SiluMul => "gemv_silu",
            GemvEpilogue::Qkv => "gemv_qkv",
        }
    }
}

/// Most runs of rows (of one format each) one launch takes: `GEMV_MAX_PARTS`.
pub const MAX_PARTS: usize = 4;

/// A matrix's rows `row0 .. row0 + rows` in one format, as the twin takes them.
#[derive(Debug, Clone, Copy)]
pub struct HostRun<'a> {
    pub weights: GemvWeights,
    pub bytes: &'a [u8],
    pub rows: usize,
}

/// `gemv_any`'s lookup: the run holding row `o` of a matrix whose runs end (exclusive, counted
/// over the matrix) at `ends`, and the run's first row. Rows past the last run land in it.
pub fn part_of(ends: &[usize], o: usize) -> (usize, usize) {
    let mut p = 0;
    while p + 1 < ends.len() && o >= ends[p] {
        p += 1;
    }
    (p, if p == 0 { 0 } else { ends[p - 1] })
}

/// [`emulate`] over a matrix given as runs: `[n, Σ rows]`, each row by its run's format.
///
/// # Panics
/// On inconsistent test inputs.
pub fn emulate_runs(runs: &[HostRun<'_>], k: usize, x: &[bf16], n: usize) -> Vec<f32> {
    let ends: Vec<usize> = runs
        .iter()
        .scan(0, |end, r| {
            *end += r.rows;
            Some(*end)
        })
        .collect();
    let total = ends.last().copied().unwrap_or(0);
    let mut out = vec![0f32; n * total];
    for o in 0..total {
        let (p, row0) = part_of(&ends, o);
        let run = runs[p];
        let row_bytes = run.weights.row_bytes(k);
        let row = &run.bytes[(o - row0) * row_bytes..][..row_bytes];
        for (r, v) in emulate(run.weights, row, 1, k, x, n)
            .into_iter()
            .enumerate()
        {
            out[r * total + o] = v;
        }
    }
    out
}

/// Blocks of the launch for `rows` weight rows.
pub fn grid(rows: usize) -> usize {
    rows.div_ceil(WARPS)
}

/// Why a launch's shape is refused (the launcher returns these as errors).
pub fn check_shape(weights: GemvWeights, rows: usize, k: usize, n: usize) -> Result<(), String> {
    if k == 0 || !k.is_multiple_of(weights.block_values()) {
        return Err(format!(
            "k = {k} is not a positive multiple of {weights:?}'s {} values a block",
            weights.block_values()
        ));
    }
    if n == 0 || n > MAX_ROWS {
        return Err(format!(
            "{n} activation rows: the GEMV takes 1 to {MAX_ROWS}"
        ));
    }
    if rows == 0 {
        return Err("no weight rows".to_owned());
    }
    Ok(())
}

/// One chunk's integer weights and factors: `w_e = a · q_e − b` (`b` is Q4_K's min, else 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chunk {
    pub q: [f32; CHUNK],
    pub a: f32,
    pub b: f32,
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// Chunk `c` of `block`, as the kernel's `chunk_*` functions decode it.
pub fn chunk(weights: GemvWeights, block: &[u8], c: usize) -> Chunk {
    let mut q = [0f32; CHUNK];
    let qtype = match weights {
        GemvWeights::Packed(qtype) => qtype,
        GemvWeights::Bf16 => {
            for (v, b) in q.iter_mut().zip(block.chunks_exact(2)) {
                *v = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
            return Chunk { q, a: 1.0, b: 0.0 };
        }
    };
    match qtype {
        QuantType::Q8_0 => {
            for (e, v) in q.iter_mut().enumerate() {
                *v = f32::from(block[2 + CHUNK * c + e] as i8);
            }
            Chunk {
                q,
                a: f16_at(block, 0),
                b: 0.0,
            }
        }
        QuantType::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..22];
            for (e, v) in q.iter_mut().enumerate() {
                let j = CHUNK * c + e;
                let low = if j < 16 {
                    qs[j] & 0x0F
                } else {
                    qs[j - 16] >> 4
                };
                let high = (((qh >> j) & 1) << 4) as u8;
                *v = (i32::from(low | high) - 16) as f32;
            }
            Chunk {
                q,
                a: f16_at(block, 0),
                b: 0.0,
            }
        }
        QuantType::Q4K => {
            let e0 = CHUNK * c;
            let (part, idx0) = (e0 / 64, e0 % 64);
            let sub = 2 * part + usize::from(idx0 >= 32);
            let (sc, m) = scale_min_k4(sub, &block[4..16]);
            let qs = &block[16 + 32 * part..16 + 32 * part + 32];
            for (e, v) in q.iter_mut().enumerate() {
                let idx = idx0 + e;
                let byte = qs[idx % 32];
                *v = f32::from(if idx < 32 { byte & 0x0F } else { byte >> 4 });
            }
            Chunk {
                q,
                a: f16_at(block, 0) * f32::from(sc),
                b: f16_at(block, 2) * f32::from(m),
            }
        }
        QuantType::Int4 => {
            let (e0, z) = (CHUNK * c, i32::from(block[4]));
            let (t, c0) = (e0 / 32, e0 % 32);
            let qs = &block[5 + 16 * t..5 + 16 * t + 16];
            for (e, v) in q.iter_mut().enumerate() {
                let j = c0 + e;
                let nibble = if j < 16 {
                    qs[j] & 0x0F
                } else {
                    qs[j - 16] >> 4
                };
                *v = (i32::from(nibble) - z) as f32;
            }
            Chunk {
                q,
                a: f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
                b: 0.0,
            }
        }
        QuantType::Fp8 => {
            let codes = &block[4 + CHUNK * c..4 + CHUNK * (c + 1)];
            for (v, &code) in q.iter_mut().zip(codes) {
                *v = crate::quant_type::e4m3_by_bits(code);
            }
            Chunk {
                q,
                a: f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
                b: 0.0,
            }
        }
        QuantType::Q6K => {
            let e0 = CHUNK * c;
            let (h, g, l0) = (e0 / 128, (e0 % 128) / 32, e0 % 32);
            let ql = &block[64 * h + if g & 1 == 1 { 32 } else { 0 }..];
            let qh = &block[128 + 32 * h..];
            for (e, v) in q.iter_mut().enumerate() {
                let l = l0 + e;
                let low = if g < 2 { ql[l] & 0x0F } else { ql[l] >> 4 };
                let high = (qh[l] >> (2 * g)) & 3;
                *v = (i32::from(low | (high << 4)) - 32) as f32;
            }
            let sc = block[192 + 8 * h + l0 / 16 + 2 * g] as i8;
            Chunk {
                q,
                a: f16_at(block, 208) * f32::from(sc),
                b: 0.0,
            }
        }
    }
}

/// What the kernel computes before its store (f32; a bf16 output rounds each once):
/// `[n, rows]`, row-major, for `w` (`rows` rows of `k / block_values` blocks) and `x` (`[n, k]`).
///
/// # Panics
/// On a shape [`check_shape`] refuses or buffers of the wrong length (test inputs).
pub fn emulate(
    weights: GemvWeights,
    w: &[u8],
    rows: usize,
    k: usize,
    x: &[bf16],
    n: usize,
) -> Vec<f32> {
    check_shape(weights, rows, k, n).expect("a valid GEMV shape");
    let (bv, bb) = (weights.block_values(), weights.block_bytes());
    let row_bytes = k / bv * bb;
    assert_eq!(w.len(), rows * row_bytes, "weight bytes");
    assert_eq!(x.len(), n * k, "activations");
    let chunks_per_block = bv / CHUNK;
    let chunks = k / CHUNK;
    let mut out = vec![0f32; n * rows];
    for o in 0..rows {
        let row = &w[o * row_bytes..(o + 1) * row_bytes];
        let mut lanes = vec![[0f32; MAX_ROWS]; WARP];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            for c in (lane..chunks).step_by(WARP) {
                let block = &row[(c / chunks_per_block) * bb..][..bb];
                let ch = chunk(weights, block, c % chunks_per_block);
                for (r, a) in acc.iter_mut().enumerate().take(n) {
                    let xr = &x[r * k + c * CHUNK..][..CHUNK];
                    let (mut s, mut t) = (0f32, 0f32);
                    for (q, xe) in ch.q.iter().zip(xr) {
                        let xe = xe.to_f32();
                        s = q.mul_add(xe, s);
                        t += xe;
                    }
                    *a = ch.a.mul_add(s, *a);
                    if weights == GemvWeights::Packed(QuantType::Q4K) {
                        *a = (-ch.b).mul_add(t, *a);
                    }
                }
            }
        }
        for r in 0..n {
            let partials: Vec<f32> = lanes.iter().map(|acc| acc[r]).collect();
            out[r * rows + o] = warp_sum(&partials);
        }
    }
    out
}

/// Blocks of a fused gate/up launch for `f` output columns (one warp each).
pub fn silu_grid(f: usize) -> usize {
    grid(f)
}

/// The q | k | v head list of a fused QKV projection (its weight's rows, head by head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvHeads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl QkvHeads {
    pub fn total(self) -> usize {
        self.num_heads + 2 * self.num_kv_heads
    }
}

/// What a head of the list is, and so where its values go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadRole {
    /// Rotated, to the token's row of `q_out`.
    Q,
    /// Rotated, to the token's slot of the K cache.
    K,
    /// To the token's slot of the V cache.
    V,
}

/// What warp `p` of a fused-QKV launch reads and writes: weight rows `lo_row` and
/// `lo_row + head_dim / 2` (which are also its bias entries), columns `col` and
/// `col + head_dim / 2` of its role's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvPair {
    pub lo_row: usize,
    pub role: HeadRole,
    pub col: usize,
}

/// `gemv_qkv`'s index arithmetic for warp `p`.
pub fn qkv_pair(heads: QkvHeads, p: usize) -> QkvPair {
    let (d, half) = (heads.head_dim, heads.head_dim / 2);
    let (g, j) = (p / half, p % half);
    let (role, head) = if g < heads.num_heads {
        (HeadRole::Q, g)
    } else if g < heads.num_heads + heads.num_kv_heads {
        (HeadRole::K, g - heads.num_heads)
    } else {
        (HeadRole::V, g - heads.num_heads - heads.num_kv_heads)
    };
    QkvPair {
        lo_row: g * d + j,
        role,
        col: head * d + j,
    }
}

/// Warps of a fused-QKV launch: one per rotation pair of every head.
pub fn qkv_pairs(heads: QkvHeads) -> usize {
    heads.total() * (heads.head_dim / 2)
}

/// Blocks of a fused-QKV launch.
pub fn qkv_grid(heads: QkvHeads) -> usize {
    grid(qkv_pairs(heads))
}

/// A step's per-token inputs to the fused QKV epilogue, as the kernel reads them.
#[derive(Debug, Clone, Copy)]
pub struct QkvTokens<'a> {
    /// `[(num_heads + 2·num_kv_heads)·head_dim]`, or none.
    pub bias: Option<&'a [f32]>,
    /// `[n]`; outside `0..max_positions` leaves q and k unrotated.
    pub positions: &'a [i32],
    /// `[n]`; negative or past the pool writes nothing to the cache.
    pub slots: &'a [i64],
    /// `[max_positions, head_dim]`: cos (half) | sin (half).
    pub cos_sin: &'a [f32],
}

/// Where the fused QKV epilogue stores: `q` `[n, num_heads·head_dim]`, each cache
/// `[num_slots, num_kv_heads·head_dim]`, values as the store type holds them (in f32).
#[derive(Debug, Clone, PartialEq)]
pub struct QkvOut {
    pub q: Vec<f32>,
    pub k_cache: Vec<f32>,
    pub v_cache: Vec<f32>,
}

/// What `gemv_qkv` does: the products ([`emulate_runs`]) rounded by `round` (the store type's
/// rounding), plus the bias, the neox rotation of q and k heads (each product and sum rounded on
/// its own, as `rope_rotate`), stored rounded into `out`.
///
/// # Panics
/// On inconsistent test inputs.
#[allow(clippy::too_many_arguments)]
pub fn emulate_qkv(
    runs: &[HostRun<'_>],
    heads: QkvHeads,
    k: usize,
    x: &[bf16],
    n: usize,
    tokens: QkvTokens<'_>,
    round: fn(f32) -> f32,
    out: &mut QkvOut,
) {
    let (d, half) = (heads.head_dim, heads.head_dim / 2);
    let total = heads.total() * d;
    let products = emulate_runs(runs, k, x, n);
    assert_eq!(products.len(), n * total, "the runs cover every head");
    let max_positions = tokens.cos_sin.len() / d;
    let kv_row = heads.num_kv_heads * d;
    let num_slots = out.k_cache.len() / kv_row;
    for p in 0..qkv_pairs(heads) {
        let pair = qkv_pair(heads, p);
        let j = pair.col % d;
        for r in 0..n {
            let at = |row: usize| round(products[r * total + row]);
            let (mut lo, mut hi) = (at(pair.lo_row), at(pair.lo_row + half));
            if let Some(bias) = tokens.bias {
                lo += bias[pair.lo_row];
                hi += bias[pair.lo_row + half];
            }
            let pos = tokens.positions[r];
            if pair.role != HeadRole::V && pos >= 0 && (pos as usize) < max_positions {
                let row = &tokens.cos_sin[pos as usize * d..][..d];
                let (c, s) = (row[j], row[half + j]);
                (lo, hi) = (lo * c - hi * s, hi * c + lo * s);
            }
            let (dst, at) = match pair.role {
                HeadRole::Q => (&mut out.q, r * heads.num_heads * d),
                role => {
                    let slot = tokens.slots[r];
                    if slot < 0 || slot as usize >= num_slots {
                        continue;
                    }
                    let cache = if role == HeadRole::K {
                        &mut out.k_cache
                    } else {
                        &mut out.v_cache
                    };
                    (cache, slot as usize * kv_row)
                }
            };
            dst[at + pair.col] = round(lo);
            dst[at + pair.col + half] = round(hi);
        }
    }
}

/// common.cuh's `warp_sum`: an xor butterfly over offsets 16, 8, 4, 2, 1 (lane 0's value).
fn warp_sum(partials: &[f32]) -> f32 {
    let mut v = partials.to_vec();
    let mut offset = WARP / 2;
    while offset > 0 {
        v = (0..WARP).map(|l| v[l] + v[l ^ offset]).collect();
        offset /= 2;
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn ggml(q: QuantType) -> GgmlDType {
        match q {
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q6K => GgmlDType::Q6K,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Int4 | QuantType::Fp8 => unreachable!("quantized by GroupedInt4, Fp8Blocks"),
        }
    }

    fn wave(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.5 - 1.0)
            .collect()
    }

    /// `rows` rows of `k` values quantized by candle (int4: by `GroupedInt4`, FP8 by `Fp8Blocks`;
    /// bf16: rounded),
    /// with their dequantized values.
    fn matrix(weights: GemvWeights, rows: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<f32>) {
        let q = match weights {
            GemvWeights::Packed(q) => q,
            GemvWeights::Bf16 => {
                let values: Vec<bf16> = wave(rows * k, seed)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                return (raw, values.iter().map(|v| v.to_f32()).collect());
            }
        };
        if q == QuantType::Int4 {
            let w = novainfer_model::int4::GroupedInt4::quantize(rows, k, &wave(rows * k, seed))
                .expect("quantize");
            return (w.blocks().to_vec(), w.dequantize());
        }
        if q == QuantType::Fp8 {
            let w = novainfer_model::fp8_blocks::Fp8Blocks::quantize_rows(
                "fp8",
                rows,
                k,
                &wave(rows * k, seed),
            )
            .expect("quantize");
            return (w.blocks().to_vec(), w.dequantize());
        }
        let t = Tensor::from_vec(wave(rows * k, seed), (rows, k), &Device::Cpu).expect("t");
        let qt = QTensor::quantize(&t, ggml(q)).expect("quantize");
        let values = qt
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("dequantize");
        (qt.data().expect("raw").into_owned(), values)
    }

    #[test]
    fn all_lists_each_format_and_epilogue_at_its_table_index() {
        for (i, w) in GemvWeights::ALL.iter().enumerate() {
            assert_eq!(w.index(), i, "{w:?}");
        }
        for (i, e) in GemvEpilogue::ALL.iter().enumerate() {
            assert_eq!(e.index(), i, "{e:?}");
        }
        for (i, f) in GemvFamily::ALL.iter().enumerate() {
            assert_eq!(f.index(), i, "{f:?}");
        }
    }

    #[test]
    fn a_launch_is_packed_or_bf16_throughout() {
        let (q4, q6) = (QuantType::Q4K.into(), QuantType::Q6K.into());
        assert_eq!(GemvFamily::of([q4, q6, q4]), Ok(GemvFamily::Packed));
        assert_eq!(GemvFamily::of([GemvWeights::Bf16]), Ok(GemvFamily::Bf16));
        assert!(GemvFamily::of([q4, GemvWeights::Bf16]).is_err());
        let name = GemvFamily::Packed.entry_base(GemvEpilogue::Qkv);
        assert_eq!(name, "gemv_qkv_packed");
    }

    #[test]
    fn each_chunk_holds_the_dequantizers_values_exactly() {
        for q in GemvWeights::ALL {
            let k = 512;
            let (raw, values) = matrix(q, 3, k, 1);
            let (bv, bb) = (q.block_values(), q.block_bytes());
            for (b, block) in raw.chunks_exact(bb).enumerate() {
                for c in 0..bv / CHUNK {
                    let ch = chunk(q, block, c);
                    for e in 0..CHUNK {
                        // The dequantizer's own operations: a·q, then − b (Q4_K).
                        let w = ch.a * ch.q[e] - ch.b;
                        let want = values[b * bv + c * CHUNK + e];
                        assert_eq!(
                            w.to_bits(),
                            want.to_bits(),
                            "{q:?} block {b} chunk {c} value {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_emulated_kernel_is_the_product_within_f32_rounding_and_batch_invariant() {
        for q in GemvWeights::ALL {
            // k = 1536 (the 1.5B hidden size): chunks do not divide evenly among the lanes.
            let (rows, k, n) = (9, 1536, MAX_ROWS);
            let (raw, w) = matrix(q, rows, k, 2);
            let x: Vec<bf16> = wave(n * k, 3).into_iter().map(bf16::from_f32).collect();
            let got = emulate(q, &raw, rows, k, &x, n);
            for r in 0..n {
                let xr: Vec<f64> = x[r * k..(r + 1) * k]
                    .iter()
                    .map(|v| f64::from(v.to_f32()))
                    .collect();
                let alone = emulate(q, &raw, rows, k, &x[r * k..(r + 1) * k], 1);
                for o in 0..rows {
                    let wr = &w[o * k..(o + 1) * k];
                    let exact: f64 = wr.iter().zip(&xr).map(|(&w, x)| f64::from(w) * x).sum();
                    let scale: f64 = wr
                        .iter()
                        .zip(&xr)
                        .map(|(&w, x)| (f64::from(w) * x).abs())
                        .sum();
                    let v = got[r * rows + o];
                    assert!(
                        (f64::from(v) - exact).abs() <= 1e-5 * scale,
                        "{q:?} ({r}, {o}): {v} vs {exact}"
                    );
                    assert_eq!(
                        v.to_bits(),
                        alone[o].to_bits(),
                        "{q:?}: row {r} alone differs"
                    );
                }
            }
        }
    }

    #[test]
    fn the_lanes_take_every_chunk_once_and_the_grid_covers_every_row() {
        for k in [256, 1536, 8960] {
            let chunks = k / CHUNK;
            let mut seen = vec![0u8; chunks];
            for lane in 0..WARP {
                for c in (lane..chunks).step_by(WARP) {
                    seen[c] += 1;
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "k = {k}");
        }
        for rows in [1, 4, 5, 17920, 151_936] {
            assert!(grid(rows) * WARPS >= rows && (grid(rows) - 1) * WARPS < rows);
        }
        assert!(check_shape(QuantType::Q4K.into(), 8, 1000, 1).is_err());
        assert!(check_shape(QuantType::Q8_0.into(), 8, 64, MAX_ROWS + 1).is_err());
        assert!(check_shape(QuantType::Q8_0.into(), 8, 64, 0).is_err());
        assert!(check_shape(QuantType::Q6K.into(), 8, 512, MAX_ROWS).is_ok());
        assert!(check_shape(GemvWeights::Bf16, 8, 12, 1).is_err());
        assert!(check_shape(GemvWeights::Bf16, 8, 24, 1).is_ok());
    }

    // Qwen2-0.5B's geometry, shrunk: 14 q heads and 2 kv heads would be too slow to emulate
    // whole, so 6 and 2 heads of 16 values keep GQA and several heads per role.
    const HEADS: QkvHeads = QkvHeads {
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 16,
    };

    #[test]
    fn the_qkv_pairs_cover_every_row_once_and_land_where_the_layout_puts_them() {
        let d = HEADS.head_dim;
        let half = d / 2;
        let mut seen = vec![0u8; HEADS.total() * d];
        assert!(qkv_grid(HEADS) * WARPS >= qkv_pairs(HEADS));
        for p in 0..qkv_pairs(HEADS) {
            let pair = qkv_pair(HEADS, p);
            // The pair is the two values RoPE mixes: j and j + half of one head.
            assert!(pair.lo_row % d < half);
            for (row, at) in [(pair.lo_row, 0), (pair.lo_row + half, half)] {
                seen[row] += 1;
                let (q_len, kv_len) = (HEADS.num_heads * d, HEADS.num_kv_heads * d);
                let (role, col) = if row < q_len {
                    (HeadRole::Q, row)
                } else if row < q_len + kv_len {
                    (HeadRole::K, row - q_len)
                } else {
                    (HeadRole::V, row - q_len - kv_len)
                };
                assert_eq!((pair.role, pair.col + at), (role, col), "pair {p}");
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
    }

    #[test]
    fn a_row_is_found_in_the_run_that_holds_it() {
        // q | k | v runs of 6, 2 and 2 heads of 16 rows.
        let ends = [96, 128, 160];
        for o in 0..160 {
            let (p, row0) = part_of(&ends, o);
            let start = if p == 0 { 0 } else { ends[p - 1] };
            assert!(start <= o && o < ends[p], "row {o} in run {p}");
            assert_eq!(row0, start);
        }
        assert_eq!(part_of(&[40], 39), (0, 0));
    }

    #[test]
    fn runs_of_different_formats_are_each_multiplied_in_their_own() {
        let (k, n) = (256, 3);
        let x: Vec<bf16> = wave(n * k, 8).into_iter().map(bf16::from_f32).collect();
        let formats = [
            QuantType::Q4K.into(),
            QuantType::Q8_0.into(),
            GemvWeights::Bf16,
        ];
        let rows = [5, 2, 4];
        let raws: Vec<Vec<u8>> = formats
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(i, (&w, r))| matrix(w, r, k, 9 + i).0)
            .collect();
        let runs: Vec<HostRun<'_>> = formats
            .iter()
            .zip(rows)
            .zip(&raws)
            .map(|((&weights, rows), raw)| HostRun {
                weights,
                bytes: raw,
                rows,
            })
            .collect();
        let got = emulate_runs(&runs, k, &x, n);
        let total: usize = rows.iter().sum();
        let mut col0 = 0;
        for run in &runs {
            let alone = emulate(run.weights, run.bytes, run.rows, k, &x, n);
            for r in 0..n {
                for o in 0..run.rows {
                    assert_eq!(got[r * total + col0 + o], alone[r * run.rows + o]);
                }
            }
            col0 += run.rows;
        }
    }

    /// qkv.cu's loops, over the whole rounded product `[n, total·d]`.
    fn unfused_qkv(
        qkv: &[f32],
        n: usize,
        tokens: QkvTokens<'_>,
        round: fn(f32) -> f32,
        out: &mut QkvOut,
    ) {
        let d = HEADS.head_dim;
        let half = d / 2;
        let (q_len, kv_len) = (HEADS.num_heads * d, HEADS.num_kv_heads * d);
        let row_len = q_len + 2 * kv_len;
        let max_positions = tokens.cos_sin.len() / d;
        let num_slots = out.k_cache.len() / kv_len;
        for t in 0..n {
            let row = &qkv[t * row_len..][..row_len];
            let biased = |i: usize| row[i] + tokens.bias.map_or(0.0, |b| b[i]);
            let pos = tokens.positions[t];
            let rotate = pos >= 0 && (pos as usize) < max_positions;
            let rot = |i: usize, lo: f32, hi: f32| {
                if !rotate {
                    return (lo, hi);
                }
                let cs = &tokens.cos_sin[pos as usize * d..][..d];
                let (c, s) = (cs[i % d], cs[half + i % d]);
                (lo * c - hi * s, hi * c + lo * s)
            };
            for h in 0..HEADS.num_heads {
                for j in 0..half {
                    let i = h * d + j;
                    let (lo, hi) = rot(i, biased(i), biased(i + half));
                    out.q[t * q_len + i] = round(lo);
                    out.q[t * q_len + i + half] = round(hi);
                }
            }
            let slot = tokens.slots[t];
            if slot < 0 || slot as usize >= num_slots {
                continue;
            }
            let at = slot as usize * kv_len;
            for h in 0..HEADS.num_kv_heads {
                for j in 0..half {
                    let i = h * d + j;
                    let (lo, hi) = rot(i, biased(q_len + i), biased(q_len + i + half));
                    out.k_cache[at + i] = round(lo);
                    out.k_cache[at + i + half] = round(hi);
                }
            }
            for i in 0..kv_len {
                out.v_cache[at + i] = round(biased(q_len + kv_len + i));
            }
        }
    }

    #[test]
    fn the_emulated_fused_qkv_is_the_gemv_then_qkv_cu() {
        let d = HEADS.head_dim;
        let (k, n, max_positions, num_slots) = (256, 5, 40, 9);
        let rows = HEADS.total() * d;
        let bias = wave(rows, 4);
        let cos_sin = wave(max_positions * d, 5);
        // A padding token (slot −1), one past the pool, one outside the RoPE table.
        let positions = [3, 0, 39, 40, 17];
        let slots = [4, 0, -1, 8, 9];
        let round_bf16: fn(f32) -> f32 = |v| bf16::from_f32(v).to_f32();
        let round_f32: fn(f32) -> f32 = |v| v;
        let x: Vec<bf16> = wave(n * k, 6).into_iter().map(bf16::from_f32).collect();
        for weights in [
            GemvWeights::Bf16,
            QuantType::Q8_0.into(),
            QuantType::Q4K.into(),
        ] {
            for round in [round_bf16, round_f32] {
                for with_bias in [true, false] {
                    let tokens = QkvTokens {
                        bias: with_bias.then_some(&bias[..]),
                        positions: &positions,
                        slots: &slots,
                        cos_sin: &cos_sin,
                    };
                    let (raw, _) = matrix(weights, rows, k, 7);
                    let empty = QkvOut {
                        q: vec![-7.0; n * HEADS.num_heads * d],
                        k_cache: vec![-7.0; num_slots * HEADS.num_kv_heads * d],
                        v_cache: vec![-7.0; num_slots * HEADS.num_kv_heads * d],
                    };
                    let mut want = empty.clone();
                    let product: Vec<f32> = emulate(weights, &raw, rows, k, &x, n)
                        .into_iter()
                        .map(round)
                        .collect();
                    unfused_qkv(&product, n, tokens, round, &mut want);
                    // One run of every head, and the q | k | v runs of a packed checkpoint's three
                    // tensors: the same rows, the same result.
                    let row_bytes = weights.row_bytes(k);
                    let run = |heads: std::ops::Range<usize>| HostRun {
                        weights,
                        bytes: &raw[heads.start * d * row_bytes..heads.end * d * row_bytes],
                        rows: heads.len() * d,
                    };
                    for runs in [vec![run(0..10)], vec![run(0..6), run(6..8), run(8..10)]] {
                        let mut got = empty.clone();
                        emulate_qkv(&runs, HEADS, k, &x, n, tokens, round, &mut got);
                        assert_eq!(
                            got,
                            want,
                            "{weights:?} bias {with_bias}, {} runs",
                            runs.len()
                        );
                        // Only the slots of real tokens are written (not −1, not 9 past the pool).
                        let kv_row = HEADS.num_kv_heads * d;
                        for slot in 0..num_slots {
                            let written = got.v_cache[slot * kv_row..][..kv_row]
                                .iter()
                                .all(|&v| v != -7.0);
                            assert_eq!(written, [4, 0, 8].contains(&slot), "slot {slot}");
                        }
                    }
                }
            }
        }
    }
}
