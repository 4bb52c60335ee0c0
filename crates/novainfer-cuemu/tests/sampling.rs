//! kernels/sampling.cu run by the emulator, every kernel launched as `ops::sampling` launches
//! it (a block of 1,024 threads per row), in f32 and bf16, against the CPU twins in
//! `novainfer_cuda::reference` and `draw_walk`:
//! - `argmax`: the first index of the maximum (ties, NaN, ±inf, all −inf rows);
//! - `sample`: the exact token of the twin (the reference's top-k / top-p / min-p survivors,
//!   drawn with the kernel's f32 sums at Philox's target for the row's seed and offset) for
//!   parameter mixes, ties, −inf, tiny and huge temperatures, vocabularies below the block,
//!   off multiples of 32 and at Qwen2's 151,936; a row alone draws what it drew in a batch;
//! - `mask_rows`: the reference mask, in place, bit for bit (a row left one token, short words);
//! - `adjust_rows`: the reference's penalties, bias and mask, bit for bit;
//! - `draw`: greedy / random / skipped rows with edits, the raw logprob, the chosen token's
//!   rank and the top logprobs (clamped at 20), and the same bits for a row alone.

mod common;

use common::{addr, Rng};
use half::bf16;
use novainfer_cuda::draw_walk::{DrawRow, Landing};
use novainfer_cuda::reference;
use novainfer_cuda::sample_params::{
    DrawMode, RowEdit, RowPenalties, SampleParams, MAX_TOP_LOGPROBS, MIN_SAMPLING_TEMPERATURE,
};
use novainfer_cuemu::kernels::sampling as k;
use novainfer_cuemu::{launch, Dim3};

/// `SAMPLE_THREADS` (kernel and `ops::sampling`): one block of this many threads per row.
const THREADS: u32 = 1024;
const QWEN2_VOCAB: usize = 151_936;

// The launcher passes the cudarc-side structs; the emulator's declarations take its copies.
const _: () =
    assert!(std::mem::size_of::<SampleParams>() == std::mem::size_of::<k::SampleParams>());
const _: () = assert!(std::mem::size_of::<RowEdit>() == std::mem::size_of::<k::RowEdit>());
const _: () =
    assert!(std::mem::size_of::<RowPenalties>() == std::mem::size_of::<k::RowPenalties>());

fn kernel_params(p: &[SampleParams]) -> Vec<k::SampleParams> {
    p.iter()
        .map(|p| k::SampleParams {
            seed: p.seed,
            offset: p.offset,
            inv_temperature: p.inv_temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            top_k: p.top_k,
        })
        .collect()
}

fn kernel_edits(e: &[RowEdit]) -> Vec<k::RowEdit> {
    e.iter()
        .map(|e| k::RowEdit {
            token_id: e.token_id,
            output_count: e.output_count,
            flags: e.flags,
            bias: e.bias,
        })
        .collect()
}

fn kernel_penalties(p: &[RowPenalties]) -> Vec<k::RowPenalties> {
    p.iter()
        .map(|p| k::RowPenalties {
            repetition: p.repetition,
            frequency: p.frequency,
            presence: p.presence,
            pad: p._pad,
        })
        .collect()
}

/// A `[rows, vocab]` logits buffer in the kernel's dtype.
enum Logits {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Logits {
    fn new(values: &[f32], bf16: bool) -> Self {
        if bf16 {
            Logits::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect())
        } else {
            Logits::F32(values.to_vec())
        }
    }
    fn is_bf16(&self) -> bool {
        matches!(self, Logits::Bf16(_))
    }
    /// The values the kernel reads, as f32 (what the references take).
    fn values(&self) -> Vec<f32> {
        match self {
            Logits::F32(v) => v.clone(),
            Logits::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    fn bits(&self) -> Vec<u32> {
        match self {
            Logits::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Logits::Bf16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        }
    }
    fn addr(&self) -> usize {
        match self {
            Logits::F32(v) => addr(v.as_ptr()),
            Logits::Bf16(v) => addr(v.as_ptr()),
        }
    }
    fn addr_mut(&mut self) -> usize {
        match self {
            Logits::F32(v) => v.as_mut_ptr() as usize,
            Logits::Bf16(v) => v.as_mut_ptr() as usize,
        }
    }
    fn rows(&self, vocab: usize) -> usize {
        let len = match self {
            Logits::F32(v) => v.len(),
            Logits::Bf16(v) => v.len(),
        };
        assert_eq!(len % vocab, 0, "whole rows");
        len / vocab
    }
}

fn grid(rows: usize) -> (Dim3, Dim3) {
    (Dim3::x(rows as u32), Dim3::x(THREADS))
}

fn run_argmax(x: &Logits, vocab: usize) -> Vec<u32> {
    let rows = x.rows(vocab);
    let mut out = vec![u32::MAX; rows];
    let p = (x.addr(), out.as_mut_ptr() as usize);
    let (g, b) = grid(rows);
    let bf = x.is_bf16();
    launch(g, b, || unsafe {
        if bf {
            k::argmax_bf16(p.0 as _, p.1 as _, vocab as i32)
        } else {
            k::argmax_f32(p.0 as _, p.1 as _, vocab as i32)
        }
    })
    .expect("the argmax launch");
    out
}

fn run_sample(x: &Logits, params: &[SampleParams], vocab: usize) -> Vec<u32> {
    let rows = x.rows(vocab);
    assert_eq!(params.len(), rows);
    let params = kernel_params(params);
    let mut scratch = vec![f32::NAN; rows * vocab];
    let mut out = vec![u32::MAX; rows];
    let p = (
        x.addr(),
        addr(params.as_ptr()),
        scratch.as_mut_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    let (g, b) = grid(rows);
    let bf = x.is_bf16();
    launch(g, b, || unsafe {
        if bf {
            k::sample_bf16(p.0 as _, p.1 as _, p.2 as _, p.3 as _, vocab as i32)
        } else {
            k::sample_f32(p.0 as _, p.1 as _, p.2 as _, p.3 as _, vocab as i32)
        }
    })
    .expect("the sample launch");
    out
}

fn run_mask(x: &mut Logits, masks_at: &[i32], masks: &[u32], words: usize, vocab: usize) {
    let rows = x.rows(vocab);
    assert_eq!(masks_at.len(), rows);
    let bf = x.is_bf16();
    let p = (x.addr_mut(), addr(masks_at.as_ptr()), addr(masks.as_ptr()));
    let (g, b) = grid(rows);
    launch(g, b, || unsafe {
        if bf {
            k::mask_rows_bf16(p.0 as _, p.1 as _, p.2 as _, words as i32, vocab as i32)
        } else {
            k::mask_rows_f32(p.0 as _, p.1 as _, p.2 as _, words as i32, vocab as i32)
        }
    })
    .expect("the mask_rows launch");
}

/// A step's edits in the launcher's CSR form (`RowEdits`).
struct Edits {
    offsets: Vec<i32>,
    flat: Vec<k::RowEdit>,
    penalties: Vec<k::RowPenalties>,
}

impl Edits {
    fn new(rows: &[Vec<RowEdit>], penalties: &[RowPenalties]) -> Self {
        let mut offsets = vec![0i32];
        let mut flat = Vec::new();
        for e in rows {
            flat.extend(kernel_edits(e));
            offsets.push(flat.len() as i32);
        }
        // A device buffer is never empty; the kernel reads none of it then.
        if flat.is_empty() {
            flat.extend(kernel_edits(&[edit(0, 0, 0, 0.0)]));
        }
        Edits {
            offsets,
            flat,
            penalties: kernel_penalties(penalties),
        }
    }
}

/// A sentinel the kernels must leave where they write nothing.
const UNTOUCHED: f32 = -12345.5;

fn run_adjust(x: &Logits, edits: &Edits, vocab: usize) -> Vec<f32> {
    let rows = x.rows(vocab);
    let mut adjusted = vec![UNTOUCHED; rows * vocab];
    let p = (
        x.addr(),
        adjusted.as_mut_ptr() as usize,
        addr(edits.offsets.as_ptr()),
        addr(edits.flat.as_ptr()),
        addr(edits.penalties.as_ptr()),
    );
    let (g, b) = grid(rows);
    let bf = x.is_bf16();
    launch(g, b, || unsafe {
        if bf {
            k::adjust_rows_bf16(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                vocab as i32,
            )
        } else {
            k::adjust_rows_f32(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                vocab as i32,
            )
        }
    })
    .expect("the adjust_rows launch");
    adjusted
}

/// What `draw` wrote (sentinels where it wrote nothing).
#[derive(Debug, PartialEq)]
struct Drawn {
    ids: Vec<u32>,
    logprobs: Vec<u32>, // bits
    top_ids: Vec<u32>,
    top_lps: Vec<u32>, // bits
    ranks: Vec<u32>,
}

/// `adjust_rows` then `draw`, as a step of the runner launches them.
fn run_step(
    x: &Logits,
    modes: &[DrawMode],
    params: &[SampleParams],
    row_edits: &[Vec<RowEdit>],
    penalties: &[RowPenalties],
    tops: &[i32],
    vocab: usize,
) -> Drawn {
    let rows = x.rows(vocab);
    assert!(modes.len() == rows && params.len() == rows && tops.len() == rows);
    let edits = Edits::new(row_edits, penalties);
    let adjusted = run_adjust(x, &edits, vocab);
    let params = kernel_params(params);
    let modes: Vec<i32> = modes.iter().map(|&m| m as i32).collect();
    let mut scratch = vec![f32::NAN; rows * vocab];
    let mut ids = vec![u32::MAX; rows];
    let mut lps = vec![f32::NAN; rows];
    let mut top_ids = vec![u32::MAX; rows * MAX_TOP_LOGPROBS];
    let mut top_lps = vec![f32::NAN; rows * MAX_TOP_LOGPROBS];
    let mut ranks = vec![u32::MAX; rows];
    let p = (
        x.addr(),
        addr(adjusted.as_ptr()),
        addr(edits.offsets.as_ptr()),
        addr(params.as_ptr()),
        addr(modes.as_ptr()),
        addr(tops.as_ptr()),
        scratch.as_mut_ptr() as usize,
        ids.as_mut_ptr() as usize,
        lps.as_mut_ptr() as usize,
        top_ids.as_mut_ptr() as usize,
        top_lps.as_mut_ptr() as usize,
        ranks.as_mut_ptr() as usize,
    );
    let (g, b) = grid(rows);
    let bf = x.is_bf16();
    launch(g, b, || unsafe {
        if bf {
            k::draw_bf16(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                p.5 as _,
                p.6 as _,
                p.7 as _,
                p.8 as _,
                p.9 as _,
                p.10 as _,
                p.11 as _,
                vocab as i32,
            )
        } else {
            k::draw_f32(
                p.0 as _,
                p.1 as _,
                p.2 as _,
                p.3 as _,
                p.4 as _,
                p.5 as _,
                p.6 as _,
                p.7 as _,
                p.8 as _,
                p.9 as _,
                p.10 as _,
                p.11 as _,
                vocab as i32,
            )
        }
    })
    .expect("the draw launch");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    Drawn {
        ids,
        logprobs: bits(&lps),
        top_ids,
        top_lps: bits(&top_lps),
        ranks,
    }
}

// ---- references -------------------------------------------------------------------------

const NEG_INF: f32 = f32::NEG_INFINITY;

fn sanitize(v: f32) -> f32 {
    if v.is_nan() {
        NEG_INF
    } else if v == f32::INFINITY {
        f32::MAX
    } else {
        v
    }
}

/// The token `sample_row` draws from `row`: the reference's survivors (its top-k, top-p and
/// min-p cut), drawn as the kernel draws (`draw_walk`: per-thread f32 sums in id order, at
/// Philox's uniform for (seed, offset) times their total).
fn twin_token(row: &[f32], p: &SampleParams) -> u32 {
    let want = reference::sample(row, p);
    let x: Vec<f32> = row.iter().map(|&v| sanitize(v)).collect();
    let max = x.iter().copied().fold(NEG_INF, f32::max);
    if max == NEG_INF {
        return 0;
    }
    let d = |i: u32| (x[i as usize] - max) * p.inv_temperature;
    let mut weights = vec![None; row.len()];
    for &i in &want.survivors {
        weights[i as usize] = Some(d(i).exp());
    }
    let walk = DrawRow::new(&weights, THREADS as usize);
    let target = reference::philox_uniform(p.seed, p.offset) * walk.total;
    match walk.land(target) {
        Landing::Id(i) => i,
        // u · total rounded up to the total: the kernel keeps its fallback, the last survivor
        // with a finite scaled logit.
        Landing::Fallback(_) => want
            .survivors
            .iter()
            .rev()
            .find(|&&i| d(i) > NEG_INF)
            .copied()
            .unwrap_or(0),
    }
}

/// Every row's token is the twin's (so a survivor of the reference, with a nonzero weight);
/// the f64 reference's own draw may differ only where f32 rounding moves a boundary (rarely).
fn check_sample(what: &str, x: &Logits, params: &[SampleParams], vocab: usize) -> Vec<u32> {
    let got = run_sample(x, params, vocab);
    let values = x.values();
    let mut disagree = 0;
    for (r, row) in values.chunks(vocab).enumerate() {
        let want = reference::sample(row, &params[r]);
        let twin = twin_token(row, &params[r]);
        assert_eq!(got[r], twin, "{what}: row {r} ({:?})", params[r]);
        if !want.survivors.is_empty() {
            assert!(
                want.survivors.contains(&got[r]),
                "{what}: row {r}: not a survivor"
            );
        }
        disagree += usize::from(got[r] != want.token);
    }
    assert!(
        disagree <= 1 + params.len() / 32,
        "{what}: {disagree} of {} rows differ from the f64 reference's draw",
        params.len()
    );
    got
}

fn params(
    seed: u64,
    offset: u64,
    t: f32,
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
) -> SampleParams {
    SampleParams::new(seed, offset, t, top_k, top_p, min_p).expect("valid sampling parameters")
}

/// Twelve rows' parameters: temperatures, top-k (1, 20, 40, the vocabulary, past it), top-p
/// and min-p alone and together. Top-p rows are the emulator's slow ones (31 block-wide
/// sums of the binary search), so they are few.
fn mixes(vocab: usize, seed: u64) -> Vec<SampleParams> {
    let v = Some(vocab);
    [
        (0.7, None, 1.0, 0.0),
        (1.0, Some(1), 1.0, 0.0),
        (1.5, Some(20), 1.0, 0.0),
        (0.3, v, 1.0, 0.05),
        (1.0, Some(vocab + 5), 1.0, 0.0),
        (0.7, None, 1.0, 0.05),
        (1.0, None, 0.9, 0.0),
        (0.7, Some(20), 0.5, 0.0),
        (1.5, v, 0.9, 0.05),
        (0.3, Some(40), 1.0, 0.2),
        (1.0, Some(1), 0.5, 0.05),
        (2.0, None, 0.95, 0.02),
    ]
    .iter()
    .enumerate()
    .map(|(r, &(t, top_k, top_p, min_p))| {
        params(seed + r as u64, 7 * r as u64, t, top_k, top_p, min_p)
    })
    .collect()
}

fn edit(token_id: u32, output_count: u32, flags: u32, bias: f32) -> RowEdit {
    RowEdit {
        token_id,
        output_count,
        flags,
        bias,
    }
}

/// Random edits of distinct ids (one past the vocabulary too, which the kernel skips), every
/// flag combination, with the row's best token among them.
fn random_edits(rng: &mut Rng, row: &[f32], n: usize) -> Vec<RowEdit> {
    let vocab = row.len() as u32;
    let flags = [
        0,
        RowEdit::PENALIZE,
        RowEdit::PENALIZE | RowEdit::IN_PROMPT,
        RowEdit::MASK,
        RowEdit::PENALIZE | RowEdit::MASK,
        RowEdit::IN_PROMPT,
    ];
    let mut ids: Vec<u32> = (0..n).map(|_| rng.below(vocab as usize) as u32).collect();
    ids.push(reference::argmax(row));
    ids.push(vocab + 3);
    ids.sort_unstable();
    ids.dedup();
    ids.iter()
        .map(|&id| {
            let bias = if rng.below(2) == 0 { 0.0 } else { rng.f32(3.0) };
            edit(id, rng.below(4) as u32, flags[rng.below(flags.len())], bias)
        })
        .collect()
}

fn penalties(r: usize) -> RowPenalties {
    RowPenalties {
        repetition: [1.0, 1.3, 0.8, 2.0][r % 4],
        frequency: [0.0, 0.5][r % 2],
        presence: [0.25, 0.0, 1.0][r % 3],
        _pad: 0.0,
    }
}

fn close(got: f32, want: f32) -> bool {
    if want == NEG_INF {
        return got == NEG_INF;
    }
    (got - want).abs() <= 1e-4 * want.abs().max(1.0)
}

/// `draw`'s outputs against the references, row by row (sentinels where nothing is written).
#[allow(clippy::too_many_arguments)]
fn check_step(
    what: &str,
    values: &[f32],
    modes: &[DrawMode],
    params: &[SampleParams],
    row_edits: &[Vec<RowEdit>],
    pens: &[RowPenalties],
    tops: &[i32],
    vocab: usize,
    got: &Drawn,
) {
    for (r, row) in values.chunks(vocab).enumerate() {
        let slots = r * MAX_TOP_LOGPROBS..(r + 1) * MAX_TOP_LOGPROBS;
        if modes[r] == DrawMode::Skip {
            assert_eq!(
                got.ids[r],
                u32::MAX,
                "{what}: row {r}: a skipped row is left alone"
            );
            assert!(
                f32::from_bits(got.logprobs[r]).is_nan(),
                "{what}: row {r}: logprob"
            );
            assert_eq!(got.ranks[r], u32::MAX, "{what}: row {r}: rank");
            assert!(
                got.top_ids[slots].iter().all(|&i| i == u32::MAX),
                "{what}: row {r}"
            );
            continue;
        }
        let source = if row_edits[r].is_empty() {
            row.to_vec()
        } else {
            reference::adjust(row, &pens[r], &row_edits[r])
        };
        let id = got.ids[r];
        match modes[r] {
            DrawMode::Greedy => {
                assert_eq!(id, reference::argmax(&source), "{what}: row {r}: greedy")
            }
            _ => assert_eq!(
                id,
                twin_token(&source, &params[r]),
                "{what}: row {r}: {:?}",
                params[r]
            ),
        }
        let lp = f32::from_bits(got.logprobs[r]);
        let want = reference::token_logprob(row, id);
        assert!(close(lp, want), "{what}: row {r}: logprob {lp} vs {want}");
        if tops[r] < 0 {
            assert_eq!(got.ranks[r], u32::MAX, "{what}: row {r}: no logprobs asked");
            continue;
        }
        let (rank, top) = reference::top_logprobs(row, id, tops[r] as usize);
        assert_eq!(got.ranks[r], rank, "{what}: row {r}: rank");
        let n = top.len();
        assert_eq!(n, (tops[r] as usize).min(MAX_TOP_LOGPROBS).min(vocab));
        let ids = &got.top_ids[slots.clone()];
        let lps = &got.top_lps[slots];
        assert_eq!(
            ids[..n],
            top.iter().map(|t| t.0).collect::<Vec<_>>()[..],
            "{what}: row {r}: top ids"
        );
        for (j, t) in top.iter().enumerate() {
            let g = f32::from_bits(lps[j]);
            assert!(close(g, t.1), "{what}: row {r}: top {j}: {g} vs {}", t.1);
        }
        assert!(
            ids[n..].iter().all(|&i| i == u32::MAX),
            "{what}: row {r}: slots past {n}"
        );
    }
}

// ---- argmax -----------------------------------------------------------------------------

#[test]
fn argmax_finds_the_first_maximum() {
    let vocab = QWEN2_VOCAB;
    let mut rng = Rng(8);
    let mut logits = rng.f32s(8 * vocab, 10.0);
    let row = |r: usize| r * vocab;
    logits[row(0) + 7] = 50.0; // a clear winner
    logits[row(1) + 10] = 40.0; // a tie: the lowest id wins
    logits[row(1) + 9000] = 40.0;
    logits[row(2) + 3] = f32::NAN; // NaN never wins
    logits[row(2) + vocab - 1] = 30.0; // the last id, in the last thread's tail
    logits[row(3)..row(4)].fill(-1.0); // all equal: id 0
    logits[row(4)..row(5)].fill(f32::NAN); // all NaN: id 0
    logits[row(5)..row(6)].fill(NEG_INF); // all −inf: id 0
    logits[row(5) + 4321] = -1e30; // ... but one finite
    logits[row(6) + 800] = f32::INFINITY; // +inf ties f32::MAX at a lower id
    logits[row(6) + 500] = f32::MAX;
    logits[row(6) + 100] = f32::INFINITY;
    logits[row(7)..row(8)].fill(NEG_INF);
    for bf in [false, true] {
        let x = Logits::new(&logits, bf);
        let want: Vec<u32> = x.values().chunks(vocab).map(reference::argmax).collect();
        assert_eq!(run_argmax(&x, vocab), want, "bf16 {bf}");
        assert_eq!(
            &want[..8],
            &[7, 10, vocab as u32 - 1, 0, 0, 4321, 100, 0][..]
        );
    }
    // Vocabularies below, at and just past a block and a warp; bf16 rows tie often.
    for vocab in [1, 33, 1000, 1024, 1025] {
        for bf in [false, true] {
            let x = Logits::new(&rng.f32s(3 * vocab, 4.0), bf);
            let want: Vec<u32> = x.values().chunks(vocab).map(reference::argmax).collect();
            assert_eq!(run_argmax(&x, vocab), want, "vocab {vocab}, bf16 {bf}");
        }
    }
}

// ---- sample -----------------------------------------------------------------------------

#[test]
fn sample_draws_the_twins_token_for_every_parameter_mix() {
    let vocab = 4096;
    let ps = mixes(vocab, 1000);
    let rows = ps.len();
    let mut rng = Rng(9);
    let logits = rng.f32s(rows * vocab, 8.0);
    let x = Logits::new(&logits, false);
    let got = check_sample("f32, vocab 4096", &x, &ps, vocab);
    // A row alone draws what it drew in the batch.
    let r = 2;
    let one = Logits::new(&logits[r * vocab..(r + 1) * vocab], false);
    assert_eq!(
        run_sample(&one, &ps[r..=r], vocab),
        [got[r]],
        "row {r} alone"
    );
    // bf16 rows tie often; 1000 is no multiple of 32 and leaves threads past 999 idle.
    let vocab = 1000;
    let ps: Vec<SampleParams> = mixes(vocab, 77)
        .into_iter()
        .enumerate()
        .filter(|(r, _)| [0, 2, 5, 7, 9].contains(r))
        .map(|(_, p)| p)
        .collect();
    let x = Logits::new(&rng.f32s(ps.len() * vocab, 6.0), true);
    check_sample("bf16, vocab 1000", &x, &ps, vocab);
}

#[test]
fn sample_at_qwen2s_vocabulary() {
    let vocab = QWEN2_VOCAB;
    let mut rng = Rng(21);
    let ps = [
        params(5, 0, 0.7, Some(40), 0.95, 0.0),
        params(6, 11, 1.0, None, 0.9, 0.0),
        params(7, 3, 1.0, None, 1.0, 0.05),
    ];
    check_sample(
        "f32",
        &Logits::new(&rng.f32s(3 * vocab, 12.0), false),
        &ps,
        vocab,
    );
    let ps = [
        params(8, 1, 1.2, None, 0.8, 0.0),
        params(9, 2, 0.8, Some(50), 1.0, 0.0),
    ];
    check_sample(
        "bf16",
        &Logits::new(&rng.f32s(2 * vocab, 12.0), true),
        &ps,
        vocab,
    );
}

#[test]
fn sample_handles_ties_infinities_and_extreme_parameters() {
    let vocab = 1000;
    let mut rng = Rng(33);
    let mut rows: Vec<(Vec<f32>, SampleParams)> = Vec::new();
    let random = |rng: &mut Rng| rng.f32s(vocab, 5.0);
    // A flat row: top-k keeps the lowest ids.
    rows.push((vec![0.0; vocab], params(1, 0, 1.0, Some(10), 1.0, 0.0)));
    // (Not top-p 0.3: its f32 target, 300 of the 1000 equal weights, keeps 300 ids where the f64
    // reference's, 300.00001, keeps 301; a boundary within f32 rounding, as documented.)
    rows.push((vec![0.0; vocab], params(1, 1, 1.0, None, 0.3004, 0.0)));
    // Four levels: top-k and top-p cut through a tie.
    let levels: Vec<f32> = (0..vocab).map(|_| rng.below(4) as f32).collect();
    rows.push((levels.clone(), params(2, 0, 1.0, Some(300), 1.0, 0.0)));
    rows.push((levels.clone(), params(2, 1, 1.0, None, 0.6, 0.0)));
    rows.push((levels.clone(), params(2, 2, 0.5, Some(600), 1.0, 0.1)));
    // Mostly −inf: three finite ids, then one.
    let mut sparse = vec![NEG_INF; vocab];
    sparse[5] = 1.0;
    sparse[500] = 1.5;
    sparse[999] = 0.5;
    rows.push((sparse.clone(), params(3, 0, 1.0, None, 1.0, 0.2)));
    rows.push((sparse.clone(), params(3, 9, 1.0, Some(2), 1.0, 0.0)));
    let mut single = vec![NEG_INF; vocab];
    single[731] = -3.0;
    rows.push((single.clone(), params(4, 0, 1.0, Some(20), 1.0, 0.3)));
    // All −inf or NaN: token 0.
    rows.push((vec![NEG_INF; vocab], params(5, 0, 1.0, Some(5), 0.9, 0.1)));
    rows.push((vec![f32::NAN; vocab], params(5, 1, 1.0, None, 1.0, 0.0)));
    // NaN sprinkled and a +inf (as f32::MAX, all the mass).
    let mut wild = random(&mut rng);
    for i in (0..vocab).step_by(7) {
        wild[i] = f32::NAN;
    }
    wild[640] = f32::INFINITY;
    rows.push((wild.clone(), params(6, 0, 1.0, None, 1.0, 0.0)));
    rows.push((wild, params(6, 1, 0.5, Some(3), 1.0, 0.0)));
    // Greedy in all but name: top-k 1, a tiny top-p, min-p 1 (the maxima only), a minimal
    // temperature.
    let r = random(&mut rng);
    rows.push((r.clone(), params(7, 0, 1.0, Some(1), 1.0, 0.0)));
    rows.push((r.clone(), params(7, 1, 1.0, None, 1e-6, 0.0)));
    let mut tied_max = r.clone();
    tied_max[100] = 9.0;
    tied_max[900] = 9.0;
    tied_max[450] = 9.0;
    rows.push((tied_max, params(7, 2, 1.0, None, 1.0, 1.0)));
    rows.push((
        r.clone(),
        params(7, 3, MIN_SAMPLING_TEMPERATURE, None, 1.0, 0.0),
    ));
    // A flat temperature, and cuts that keep all but a few.
    rows.push((r.clone(), params(8, 0, 100.0, None, 0.5, 0.0)));
    rows.push((r, params(8, 1, 1.0, Some(vocab - 1), 0.999, 0.001)));
    // f32 only: bf16 rows are no different here (their ties are the other tests' business).
    {
        let logits: Vec<f32> = rows.iter().flat_map(|(l, _)| l.iter().copied()).collect();
        let ps: Vec<SampleParams> = rows.iter().map(|(_, p)| *p).collect();
        let got = check_sample("edge rows", &Logits::new(&logits, false), &ps, vocab);
        assert!(got[0] < 10 && got[2] < vocab as u32, "{got:?}");
        assert!(
            [5, 500].contains(&got[6]),
            "top-2 of the sparse row: {}",
            got[6]
        );
        assert_eq!(got[7], 731);
        assert_eq!((got[8], got[9]), (0, 0));
        assert_eq!(got[10], 640);
        assert!([100, 450, 900].contains(&got[14]));
    }
    // Vocabularies of one token and of fewer ids than threads.
    let ps = [
        params(1, 0, 1.0, Some(1), 1.0, 0.5),
        params(2, 0, 1.0, None, 1.0, 0.0),
    ];
    assert_eq!(
        check_sample("vocab 1", &Logits::new(&[0.5, -2.0], false), &ps, 1),
        [0, 0]
    );
    let ps: Vec<SampleParams> = mixes(50, 500)
        .into_iter()
        .enumerate()
        .filter(|(r, _)| [0, 1, 2, 3, 4, 7, 9].contains(r))
        .map(|(_, p)| p)
        .collect();
    let x = Logits::new(&rng.f32s(ps.len() * 50, 3.0), false);
    check_sample("vocab 50", &x, &ps, 50);
}

/// One row drawn at many offsets of one seed: every draw is the twin's and the f64
/// reference's (Philox at (seed, offset), whatever row of the batch), and the same
/// (seed, offset) twice gives the same token.
#[test]
fn sample_follows_the_philox_stream_of_seed_and_offset() {
    let (rows, vocab) = (64, 8);
    let row = [0.0, -0.5, -1.0, 1.0, -2.0, 0.25, NEG_INF, 0.5];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let ps: Vec<SampleParams> = (0..rows)
        .map(|r| match r {
            // Two rows repeat another's (seed, offset); one has another seed.
            60 | 61 => params(42, 3, 1.0, None, 1.0, 0.0),
            62 => params(43, 3, 1.0, None, 1.0, 0.0),
            _ => params(42, r as u64, 1.0, None, 1.0, 0.0),
        })
        .collect();
    let got = check_sample("offsets", &Logits::new(&logits, false), &ps, vocab);
    for (r, p) in ps.iter().enumerate() {
        assert_eq!(
            got[r],
            reference::sample(&row, p).token,
            "offset {}",
            p.offset
        );
    }
    assert_eq!((got[60], got[61]), (got[3], got[3]));
    let mut seen = [0usize; 8];
    for &t in &got[..60] {
        seen[t as usize] += 1;
    }
    assert_eq!(seen[6], 0, "−inf is never drawn");
    assert!(
        seen.iter().filter(|&&c| c > 0).count() >= 6,
        "the stream moves: {seen:?}"
    );
}

// ---- mask_rows --------------------------------------------------------------------------

#[test]
fn mask_rows_matches_the_reference_in_place() {
    // 1001 ids: the last mask word is partial (its bits past the vocabulary are set and ignored).
    let vocab: usize = 1001;
    let words = vocab.div_ceil(32);
    let mut rng = Rng(5);
    let logits = rng.f32s(7 * vocab, 4.0);
    let masks_at = [-1, 0, 1, 2, 3, -1, 4];
    let one_word = |f: &dyn Fn(usize) -> bool| -> Vec<u32> {
        (0..words)
            .map(|w| {
                (0..32)
                    .filter(|&b| f(w * 32 + b))
                    .fold(0u32, |m, b| m | 1 << b)
            })
            .collect()
    };
    let mut masks = Vec::new();
    masks.extend(one_word(&|i| i % 2 == 0)); // every other id
    masks.extend(one_word(&|i| i < 100)); // a prefix
    masks.extend(one_word(&|i| i == 1000 || i >= vocab)); // one token: the last id
    masks.extend(one_word(&|i| i == 0)); // one token: the first id
    masks.extend(one_word(&|i| i % 3 == 1 && i < 960)); // the last two words clear
    for bf in [false, true] {
        let mut x = Logits::new(&logits, bf);
        run_mask(&mut x, &masks_at, &masks, words, vocab);
        let mut want = Logits::new(&logits, bf).values();
        for (r, row) in want.chunks_mut(vocab).enumerate() {
            if let Ok(at) = usize::try_from(masks_at[r]) {
                reference::mask_row(row, &masks[at * words..(at + 1) * words]);
            }
        }
        assert_eq!(x.bits(), Logits::new(&want, bf).bits(), "bf16 {bf}");
        if bf {
            continue; // the draws below once, in f32 (the emulator is slow)
        }

        // The rows left one token draw it whatever the mode and parameters; its logprob in
        // the masked row is 0, its rank 1, and the −inf ids follow it in id order.
        let modes = [
            DrawMode::Skip,
            DrawMode::Greedy,
            DrawMode::Random,
            DrawMode::Random,
            DrawMode::Greedy,
            DrawMode::Skip,
            DrawMode::Random,
        ];
        // Top-p (slow here) only on the one-token row.
        let ps: Vec<SampleParams> = (0..7)
            .map(|r| {
                params(
                    r as u64,
                    1,
                    0.8,
                    Some(5),
                    if r == 3 { 0.9 } else { 1.0 },
                    0.1,
                )
            })
            .collect();
        let tops = [-1, 3, 3, 20, 0, -1, 2];
        let no_edits = vec![Vec::new(); 7];
        let pens = vec![RowPenalties::NEUTRAL; 7];
        let got = run_step(&x, &modes, &ps, &no_edits, &pens, &tops, vocab);
        let values = x.values();
        check_step(
            "masked", &values, &modes, &ps, &no_edits, &pens, &tops, vocab, &got,
        );
        assert_eq!(got.ids[3], 1000);
        assert_eq!(f32::from_bits(got.logprobs[3]), 0.0);
        assert_eq!((got.ranks[3], &got.top_ids[60..63]), (1, &[1000, 0, 1][..]));
        assert_eq!(got.ids[4], 0);
    }
    // Fewer words than the vocabulary needs: ids past them are masked too.
    let short = 20;
    let mut x = Logits::new(&logits[..vocab], false);
    run_mask(&mut x, &[0], &masks[..short], short, vocab);
    let mut want = logits[..vocab].to_vec();
    reference::mask_row(&mut want, &masks[..short]);
    assert_eq!(x.bits(), Logits::new(&want, false).bits(), "short words");
    assert!(want[short * 32..].iter().all(|&v| v == NEG_INF));
    // Qwen2's vocabulary (4,748 words).
    let vocab = QWEN2_VOCAB;
    let words = vocab / 32;
    let masks: Vec<u32> = (0..words)
        .map(|_| rng.next() as u32 & rng.next() as u32)
        .collect();
    for bf in [false, true] {
        let raw = rng.f32s(2 * vocab, 4.0);
        let mut x = Logits::new(&raw, bf);
        run_mask(&mut x, &[-1, 0], &masks, words, vocab);
        let mut want = Logits::new(&raw, bf).values();
        reference::mask_row(&mut want[vocab..], &masks);
        assert_eq!(
            x.bits(),
            Logits::new(&want, bf).bits(),
            "Qwen2 vocab, bf16 {bf}"
        );
    }
}

// ---- adjust_rows ------------------------------------------------------------------------

#[test]
fn adjust_rows_applies_the_references_edits_bit_for_bit() {
    let (rows, vocab) = (6, 3001);
    let mut rng = Rng(12);
    let mut logits = rng.f32s(rows * vocab, 6.0);
    // Special values at the ids every edited row edits.
    for r in 0..rows {
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        row[10] = f32::NAN;
        row[11] = f32::INFINITY;
        row[12] = NEG_INF;
        row[13] = 0.0;
        row[14] = -0.0;
        row[15] = f32::MAX;
        row[16] = -f32::MAX;
    }
    let pens: Vec<RowPenalties> = (0..rows).map(penalties).collect();
    let row_edits: Vec<Vec<RowEdit>> = (0..rows)
        .map(|r| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            match r {
                1 | 4 => Vec::new(),
                // More edits than threads: the strided loop comes round again.
                5 => (0..1500u32)
                    .map(|i| {
                        edit(
                            2 * i,
                            i % 5,
                            [RowEdit::PENALIZE | RowEdit::IN_PROMPT, RowEdit::PENALIZE]
                                [i as usize % 2],
                            0.125 * (i % 7) as f32,
                        )
                    })
                    .collect(),
                _ => {
                    let mut e = random_edits(&mut rng, row, 200);
                    e.retain(|e| !(10..17).contains(&e.token_id));
                    for id in 10..17 {
                        let flags =
                            [RowEdit::PENALIZE, RowEdit::PENALIZE | RowEdit::IN_PROMPT, 0][r % 3];
                        e.push(edit(id, id % 3, flags, [0.0, 1.5][id as usize % 2]));
                    }
                    e
                }
            }
        })
        .collect();
    for bf in [false, true] {
        let x = Logits::new(&logits, bf);
        let got = run_adjust(&x, &Edits::new(&row_edits, &pens), vocab);
        for (r, row) in x.values().chunks(vocab).enumerate() {
            let got = &got[r * vocab..(r + 1) * vocab];
            if row_edits[r].is_empty() {
                assert!(
                    got.iter().all(|&v| v == UNTOUCHED),
                    "bf16 {bf}: row {r} is not touched"
                );
                continue;
            }
            let want = reference::adjust(row, &pens[r], &row_edits[r]);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "bf16 {bf}: row {r}, id {i}: {g} vs {w}"
                );
            }
        }
    }
}

// ---- draw -------------------------------------------------------------------------------

/// Row r's entry of a list, cycled.
fn pick<T: Copy>(v: &[T], r: usize) -> T {
    v[r % v.len()]
}

/// One step at `vocab`: row r's mode, parameters, edits and logprobs from the lists, cycled.
#[allow(clippy::type_complexity)]
fn step_rows(
    rng: &mut Rng,
    logits: &[f32],
    vocab: usize,
    modes: &[DrawMode],
    ps: &[SampleParams],
    edited: &[bool],
    tops: &[i32],
) -> (
    Vec<DrawMode>,
    Vec<SampleParams>,
    Vec<Vec<RowEdit>>,
    Vec<RowPenalties>,
    Vec<i32>,
) {
    let rows = logits.len() / vocab;
    let modes: Vec<DrawMode> = (0..rows).map(|r| pick(modes, r)).collect();
    let ps: Vec<SampleParams> = (0..rows).map(|r| pick(ps, r)).collect();
    let edits = (0..rows)
        .map(|r| {
            if pick(edited, r) {
                random_edits(rng, &logits[r * vocab..(r + 1) * vocab], 30)
            } else {
                Vec::new()
            }
        })
        .collect();
    let pens = (0..rows).map(penalties).collect();
    let tops = (0..rows).map(|r| pick(tops, r)).collect();
    (modes, ps, edits, pens, tops)
}

#[test]
fn draw_matches_the_references_at_qwen2s_vocabulary() {
    let vocab = QWEN2_VOCAB;
    let mut rng = Rng(31);
    let mut logits = rng.f32s(6 * vocab, 12.0);
    logits[11] = f32::NAN; // sanitized as −inf, never drawn
    use DrawMode::{Greedy, Random, Skip};
    let (modes, ps, edits, pens, tops) = step_rows(
        &mut rng,
        &logits,
        vocab,
        &[Greedy, Random, Skip, Random, Greedy, Random],
        &[
            SampleParams::UNUSED,
            params(77, 1, 0.6, Some(40), 0.95, 0.0),
            SampleParams::UNUSED,
            params(78, 3, 1.0, None, 0.9, 0.0),
            SampleParams::UNUSED,
            params(79, 5, 1.3, None, 1.0, 0.1),
        ],
        &[true, true, true, false, false, false],
        &[20, 5, 3, 0, -1, 25],
    );
    let x = Logits::new(&logits, false);
    let got = run_step(&x, &modes, &ps, &edits, &pens, &tops, vocab);
    check_step(
        "f32", &logits, &modes, &ps, &edits, &pens, &tops, vocab, &got,
    );
    // A row alone gives its bits in the batch.
    let r = 1;
    let one = Logits::new(&logits[r * vocab..(r + 1) * vocab], false);
    let alone = run_step(
        &one,
        &modes[r..=r],
        &ps[r..=r],
        &edits[r..=r],
        &pens[r..=r],
        &tops[r..=r],
        vocab,
    );
    let slots = r * MAX_TOP_LOGPROBS..(r + 1) * MAX_TOP_LOGPROBS;
    assert_eq!(
        (
            alone.ids[0],
            alone.logprobs[0],
            alone.ranks[0],
            &alone.top_ids[..],
            &alone.top_lps[..]
        ),
        (
            got.ids[r],
            got.logprobs[r],
            got.ranks[r],
            &got.top_ids[slots.clone()],
            &got.top_lps[slots]
        ),
        "row {r} alone"
    );
}

#[test]
fn draw_matches_the_references_in_bf16_with_ties() {
    // bf16 logits tie often: greedy, the rank cut and the top logprobs break ties by id.
    let (rows, vocab) = (8, 4099);
    let mut rng = Rng(32);
    let logits = Logits::new(&rng.f32s(rows * vocab, 8.0), true).values();
    use DrawMode::{Greedy, Random, Skip};
    let (modes, ps, edits, pens, tops) = step_rows(
        &mut rng,
        &logits,
        vocab,
        &[Greedy, Random, Skip, Random],
        &[
            params(1, 4, 0.7, Some(30), 0.9, 0.0),
            params(2, 5, 1.0, None, 0.8, 0.05),
            params(3, 6, 1.5, Some(200), 1.0, 0.0),
        ],
        &[true, false, true, true, false],
        &[20, 5, -1, 0, 1, 21, 7],
    );
    let x = Logits::new(&logits, true);
    let got = run_step(&x, &modes, &ps, &edits, &pens, &tops, vocab);
    check_step(
        "bf16", &logits, &modes, &ps, &edits, &pens, &tops, vocab, &got,
    );
    for r in [0, 5] {
        let one = Logits::new(&logits[r * vocab..(r + 1) * vocab], true);
        let alone = run_step(
            &one,
            &modes[r..=r],
            &ps[r..=r],
            &edits[r..=r],
            &pens[r..=r],
            &tops[r..=r],
            vocab,
        );
        let slots = r * MAX_TOP_LOGPROBS..(r + 1) * MAX_TOP_LOGPROBS;
        assert_eq!(
            (
                alone.ids[0],
                alone.logprobs[0],
                alone.ranks[0],
                &alone.top_ids[..],
                &alone.top_lps[..]
            ),
            (
                got.ids[r],
                got.logprobs[r],
                got.ranks[r],
                &got.top_ids[slots.clone()],
                &got.top_lps[slots]
            ),
            "row {r} alone"
        );
    }
}

#[test]
fn draw_handles_empty_rows_and_vocabularies_under_twenty() {
    use DrawMode::{Greedy, Random};
    let vocab = 1000;
    let mut rng = Rng(40);
    let mut logits = Vec::new();
    logits.extend(vec![NEG_INF; vocab]); // all −inf: id 0, logprob −inf, rank = vocab
    logits.extend(vec![f32::NAN; vocab]);
    logits.extend((0..vocab).map(|_| rng.below(3) as f32)); // three levels: ties in the top 20
    logits.extend((0..vocab).map(|i| if i % 2 == 0 { NEG_INF } else { rng.f32(2.0) }));
    let modes = [Greedy, Random, Random, Greedy];
    let ps = vec![params(9, 9, 1.0, Some(3), 0.9, 0.0); 4];
    let tops = [5, 20, 20, 20];
    let edits = vec![Vec::new(); 4];
    let pens = vec![RowPenalties::NEUTRAL; 4];
    for bf in [false, true] {
        let x = Logits::new(&logits, bf);
        let got = run_step(&x, &modes, &ps, &edits, &pens, &tops, vocab);
        check_step(
            &format!("bf16 {bf}"),
            &x.values(),
            &modes,
            &ps,
            &edits,
            &pens,
            &tops,
            vocab,
            &got,
        );
        assert_eq!((got.ids[0], got.ranks[0]), (0, vocab as u32));
        assert_eq!(f32::from_bits(got.logprobs[1]), NEG_INF);
    }
    // Fewer ids than top logprobs asked (and than warps' lanes).
    for vocab in [1, 10] {
        let logits = rng.f32s(2 * vocab, 3.0);
        let modes = [Greedy, Random];
        let ps = vec![params(3, 1, 1.0, None, 0.7, 0.0); 2];
        let tops = [20, 15];
        let edits = vec![vec![edit(0, 1, RowEdit::PENALIZE, 0.5)], Vec::new()];
        let pens = vec![penalties(1); 2];
        let x = Logits::new(&logits, false);
        let got = run_step(&x, &modes, &ps, &edits, &pens, &tops, vocab);
        check_step(
            &format!("vocab {vocab}"),
            &logits,
            &modes,
            &ps,
            &edits,
            &pens,
            &tops,
            vocab,
            &got,
        );
    }
}
