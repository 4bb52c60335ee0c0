//! Causal grouped-query attention straight over the paged KV pool (flash-attention style).
//!
//! Shape of the computation, per (sequence, KV head):
//! * the query rows are every query head of the group (Qwen2.5-0.5B: 7) of a few tokens,
//!   so each K/V row is read and decoded once for all of them;
//! * history is walked a tile of [`TILE`] positions at a time, looking the block table up
//!   once per block the tile touches; the scores want keys of 8 or 16 positions side by
//!   side, which the pool keeps that way for f32/f16/bf16 ([`KeyLayout::Tiled`]; for q8_0,
//!   and blocks of other than whole tiles, the tile's keys are decoded and transposed into
//!   reused per-thread scratch), so that the scores and the value pass run register blocks
//!   of up to 6 (8 on AVX-512) query rows × 16 positions/dimensions, each loaded K/V vector
//!   feeding every row of the block;
//!   K and V are read and decoded where they lie in the pool when the rows are few (decode),
//!   through a decoded copy of the tile when they are many (prefill: each register block of
//!   rows would decode the values again); meanwhile the rows of the tile two ahead are
//!   prefetched ([`Ahead`]), as a decode step's cache comes from memory;
//! * softmax is online: per tile, new running max, rescale, exponentials, weighted values;
//! * positions are grouped in partitions of [`PART`]; each partition's (max, sum, values)
//!   is computed from scratch and the partitions are merged in order. Decode rows with a
//!   long history split their partitions over threads and merge afterwards; prefill rows
//!   run their partitions one after another; both perform the same operations.
//!
//! Invariance: tiles and partitions are fixed in absolute positions and a row only ever
//! reads positions `0..=its own`, so every output number is the same sequence of IEEE
//! operations whatever the batch, the block size, the chunking of the prompt, the work
//! split or the ISA ([`ops`]).
//!
//! ISA: among the bit-identical implementations this CPU can run (AVX2/FMA/F16C where
//! `head_dim % 8 == 0`, AVX-512F too where `head_dim % 16 == 0`; the portable code
//! without AVX2), the one that runs a problem of the model's geometry fastest
//! ([`AttnIsa::select`], [`crate::kernel_select`]): the widest is not always the fastest
//! (AMD's Zen 4 splits 512-bit operations in two). `NOVAINFER_ATTN_ISA=avx512|avx2|scalar`
//! forces one (a value the CPU cannot honour is ignored). AVX-512 is a candidate only after
//! a small fixed problem run through it and through the portable code ([`self_check`])
//! agreed in every output bit on this CPU.

mod ops;
#[cfg(target_arch = "x86_64")]
mod self_check;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

use super::parallel::SharedOut;
use super::AttentionShape;
use crate::forward_batch::SeqSpan;
use crate::kernel_select;
use crate::kv_dtype::KvStorage;
use crate::paged_kv::{KeyLayout, PoolLayer, KEY_TILE};
use ops::{exp_scalar, AttnOps, Keys, Rows, Scalar, Trickle, GROUP, TILE, TILES};

/// Positions per partition (a multiple of [`TILE`]).
const PART: usize = 256;
/// How far ahead of the tile being computed its rows are prefetched ([`Ahead`]): two
/// tiles measured best on Zen 4 (four and eight were slower: the early rows leave L2).
const AHEAD: usize = 2 * TILE;
const _: () = assert!(
    AHEAD.is_multiple_of(TILE),
    "prefetching works a tile at a time"
);
/// Tokens per prefill work item: their query rows (32 × the group) share every decoded and
/// transposed K/V tile. Measured (0.5B shape, f16 cache, 1 thread): 8 → 32 tokens made a
/// 512-token chunk at depth 16k ~15% faster, 64 gained little more at 16k and lost at 4k.
const QUERY_TILE: usize = 32;

/// Which implementation of [`ops`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum AttnIsa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The variable that forces an ISA: `avx512`, `avx2` or `scalar`.
const ISA_VAR: &str = "NOVAINFER_ATTN_ISA";

impl AttnIsa {
    /// The name `NOVAINFER_ATTN_ISA` and the logs use.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => "avx512",
        }
    }

    /// The ISA for attention of `shape` over a `dtype` cache: the faster of the bit-exact
    /// candidates this CPU and head size allow, timed on a problem of this geometry the first
    /// time the process asks (about 20 ms; memoised per geometry and dtype), unless
    /// `NOVAINFER_ATTN_ISA` forces one the CPU can run. See [`crate::kernel_select`].
    pub(crate) fn select(shape: AttentionShape, dtype: KvStorage) -> Self {
        use std::collections::HashMap;
        use std::sync::Mutex;
        type Key = (usize, usize, KvStorage);
        static CHOSEN: Mutex<Option<HashMap<Key, AttnIsa>>> = Mutex::new(None);
        let group = shape.num_heads / shape.num_kv_heads.max(1);
        let key = (shape.head_dim, group, dtype);
        let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
        let map = chosen.get_or_insert_with(HashMap::new);
        if let Some(&isa) = map.get(&key) {
            return isa;
        }
        let forced = kernel_select::forced_by(ISA_VAR);
        let forced_name = forced.as_ref().map(|(_, v)| v.as_str());
        #[cfg(target_arch = "x86_64")]
        let candidates = candidates(
            forced_name,
            shape.head_dim,
            ops::Avx2::detect(),
            avx512_usable,
        );
        #[cfg(not(target_arch = "x86_64"))]
        let candidates = vec![AttnIsa::Scalar];
        let (isa, selection) = timed(shape.head_dim, group, dtype, forced, candidates);
        kernel_select::record(&selection);
        map.insert(key, isa);
        isa
    }
}

/// Runs [`kernel_select::select`] over `candidates` on a problem of one KV head with `group`
/// query heads of `head_dim`: 32 prompt tokens at depth 992 (one prefill work item) and one
/// decode token at depth 1,024 (four partitions merged), the two regimes the model runs.
fn timed(
    head_dim: usize,
    group: usize,
    dtype: KvStorage,
    forced: Option<(&'static str, String)>,
    candidates: Vec<AttnIsa>,
) -> (AttnIsa, kernel_select::Selection) {
    let shape = AttentionShape {
        num_heads: group,
        num_kv_heads: 1,
        head_dim,
    };
    let kernel = format!(
        "attention (head_dim {head_dim}, {group} query heads per KV head, {dtype:?} cache)"
    );
    #[cfg(target_arch = "x86_64")]
    let problem = self_check::Problem::with(shape, &[(1024, 992..1024), (1025, 1024..1025)], dtype);
    let candidates = candidates
        .into_iter()
        .map(|isa| {
            #[cfg(target_arch = "x86_64")]
            let problem = &problem;
            kernel_select::Candidate::new(isa, isa.name(), move || {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: every candidate was detected on this CPU for this head size.
                unsafe {
                    match isa {
                        AttnIsa::Scalar => problem.run(Scalar),
                        AttnIsa::Avx2 => problem.run(ops::Avx2),
                        AttnIsa::Avx512 => problem.run(ops::Avx512),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                Vec::new()
            })
        })
        .collect();
    let forced = forced.as_ref().map(|(var, v)| (*var, v.as_str()));
    kernel_select::select(
        kernel,
        forced,
        candidates,
        kernel_select::MARGIN,
        &mut kernel_select::wall_clock,
    )
}

/// The ISAs this CPU can run for `head_dim`, the baseline first: AVX2 (with FMA/F16C) when
/// the CPU has it and `head_dim % 8 == 0`, then AVX-512 when `head_dim % 16 == 0` and
/// `avx512` (asked only then: it runs the self-check) says it is usable; the portable code
/// alone without AVX2, or added last when `forced` names it (it is never faster, so it is
/// not timed otherwise). `forced` = `avx2` or `scalar` skips the AVX-512 self-check.
#[cfg(target_arch = "x86_64")]
fn candidates(
    forced: Option<&str>,
    head_dim: usize,
    avx2: bool,
    avx512: impl FnOnce() -> bool,
) -> Vec<AttnIsa> {
    if !(avx2 && head_dim.is_multiple_of(8)) {
        return vec![AttnIsa::Scalar];
    }
    let mut v = vec![AttnIsa::Avx2];
    let lower = matches!(forced, Some("avx2" | "scalar"));
    if !lower && head_dim.is_multiple_of(16) && avx512() {
        v.push(AttnIsa::Avx512);
    }
    if forced == Some("scalar") {
        v.push(AttnIsa::Scalar);
    }
    v
}

/// Whether the CPU has AVX-512F and the AVX-512 kernel gives the portable kernel's bits on
/// [`self_check`]'s problem (run once per process, on first use: about a millisecond).
#[cfg(target_arch = "x86_64")]
fn avx512_usable() -> bool {
    static AGREES: OnceLock<bool> = OnceLock::new();
    ops::Avx512::detect()
        && *AGREES.get_or_init(|| {
            // SAFETY: AVX-512F (and AVX2/FMA/F16C) were detected just above.
            let agrees = unsafe { self_check::agrees(ops::Avx512) };
            if !agrees {
                // Once per process.
                tracing::warn!(
                    target: "novainfer::kernels",
                    "the AVX-512 attention kernel disagreed with the portable one on its \
                     self-check (a bug: please report it with this CPU's model); not using it"
                );
            }
            agrees
        })
}

/// `q`: `[tokens, num_heads·head_dim]` (rotated), token `t` at `positions[t]` of the sequence
/// whose span holds it; attends to positions `0..=positions[t]` of that sequence in `layer`.
/// Returns `[tokens, num_heads·head_dim]`.
#[cfg(test)]
pub(crate) fn paged_attention(
    q: &[f32],
    positions: &[usize],
    seqs: &[SeqSpan],
    layer: PoolLayer<'_>,
    shape: AttentionShape,
    isa: AttnIsa,
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut plan = Plan::default();
    paged_attention_into(q, positions, seqs, layer, shape, isa, &mut plan, &mut out);
    out
}

/// [`paged_attention`] into `out`, with `plan`'s buffers reused: allocates nothing once both
/// have grown to the step's size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_into(
    q: &[f32],
    positions: &[usize],
    seqs: &[SeqSpan],
    layer: PoolLayer<'_>,
    shape: AttentionShape,
    isa: AttnIsa,
    plan: &mut Plan,
    out: &mut Vec<f32>,
) {
    // SAFETY: an `AttnIsa` other than `Scalar` comes from `detect`, which checked the CPU and
    // the head size.
    unsafe {
        match isa {
            AttnIsa::Scalar => attend(Scalar, q, positions, seqs, layer, shape, plan, out),
            #[cfg(target_arch = "x86_64")]
            AttnIsa::Avx2 => attend(ops::Avx2, q, positions, seqs, layer, shape, plan, out),
            #[cfg(target_arch = "x86_64")]
            AttnIsa::Avx512 => attend(ops::Avx512, q, positions, seqs, layer, shape, plan, out),
        }
    }
}

/// [`paged_attention_into`] on kernel `k`.
///
/// # Safety
/// The CPU has `k`'s ISA.
#[allow(clippy::too_many_arguments)]
unsafe fn attend<K: Kernel>(
    k: K,
    q: &[f32],
    positions: &[usize],
    seqs: &[SeqSpan],
    layer: PoolLayer<'_>,
    shape: AttentionShape,
    plan: &mut Plan,
    out: &mut Vec<f32>,
) {
    // The ops read rows of `head_dim` numbers where the pool's rows lie.
    debug_assert_eq!(layer.geo.head_dim, shape.head_dim);
    out.clear();
    out.resize(q.len(), 0.0);
    plan.build(positions, seqs, shape);
    // The partials' heap buffer is written only through this pointer below.
    let partial_dst = SharedOut::new(&mut plan.partials);
    let plan = &*plan;
    let ctx = Ctx {
        q,
        positions,
        layer,
        shape,
        group: shape.num_heads / shape.num_kv_heads,
        scale: 1.0 / (shape.head_dim as f32).sqrt(),
        seqs,
    };
    let dst = SharedOut::new(out);
    // Split partitions left per merge: whoever finishes a group's last one merges it, so
    // decode needs one fork/join of the pool, not two.
    let pending = &plan.pending;
    candle_core::utils::barrier_pool().execute_chunked(plan.items.len(), |range| {
        let items = &plan.items[range];
        for (i, item) in items.iter().enumerate() {
            // SAFETY: each item writes only its own rows of `out` (its tokens × the heads of
            // its KV head) or its own range of `partials` (see `Plan`); the ISA as above.
            unsafe { k.item(&ctx, item, items.get(i + 1), dst, partial_dst) };
            let Some(Split { merge: m, .. }) = item.split else {
                continue;
            };
            // AcqRel: the last one sees every other item's partials of this group.
            if pending[m].fetch_sub(1, Ordering::AcqRel) == 1 {
                let mg = &plan.merges[m];
                let block = mg.tokens.len() * ctx.group * (shape.head_dim + 2);
                // SAFETY: every writer of this group's partials is done (the counter), no one
                // else reads them, and the merge writes only its own rows of `out`.
                unsafe {
                    let group = partial_dst.range(mg.partial, mg.parts * block);
                    k.merge_group(&ctx, mg, group, dst);
                }
            }
        }
    });
}

struct Ctx<'a> {
    q: &'a [f32],
    positions: &'a [usize],
    seqs: &'a [SeqSpan],
    layer: PoolLayer<'a>,
    shape: AttentionShape,
    group: usize,
    scale: f32,
}

/// Query rows `tokens × (heads of kv_head)` over partitions `parts`; finished into `out`, or,
/// for one partition of a split group, stored as a partial.
struct Item {
    seq: usize,
    kv_head: usize,
    tokens: std::ops::Range<usize>,
    parts: std::ops::Range<usize>,
    split: Option<Split>,
}

impl Item {
    /// The positions the item reads: its partitions, up to its latest token's.
    fn walk(&self, ctx: &Ctx) -> std::ops::Range<usize> {
        let last = self
            .tokens
            .clone()
            .map(|t| ctx.positions[t])
            .max()
            .unwrap_or(0);
        self.parts.start * PART..(last + 1).min(self.parts.end * PART)
    }
}

/// Prefetches the rows of an item's walk ahead of the tile it computes, past its end into
/// the walk of the item this thread runs next: it locates a tile's rows once ([`Ahead::locate`])
/// and asks for its keys and its values at two moments ([`Ahead::keys`], [`Ahead::values`]).
///
/// Why: a decode step's cache comes from memory (the weights streamed since the layer last
/// ran evict it), one partition after another, and the rows of a tile lie spread over the
/// pool's blocks: the hardware prefetchers fell behind, and a layer's attention at depth
/// 4,096 took 2.2× its time on rows in cache (1.5B shape, one thread, `kernel_timing` with
/// `NOVAINFER_KERNEL_LAYERS=28`: 0.88 against 0.40 ms). With the rows asked for [`AHEAD`]
/// positions early, continuing into the thread's next item: 0.64 ms; with the keys asked for
/// before a tile's transpose and the values after it rather than all at once: 0.55 (two
/// threads: median 0.37 → 0.33 ms). Into L2 (`T1`), not L1: on Zen 4, `T0` prefetches
/// gained nothing (the first level's miss buffers fill and stall the loads). For decode's
/// few rows, whose tiles go by fast, the same queueing again: its lines are asked for one at a
/// time from inside the kernel's loops ([`ops::Trickle`]). On an Intel Xeon with AMX (2 threads,
/// 200 layers' caches at depth 4,096), all at two moments: 0.5B shape 0.182 ms, 1.5B 0.316; a
/// half at each of four moments: 0.172, 0.311; a line at a time: see docs/benchmarks.md
/// (`T0`, `T2` and one or four tiles ahead no better). A prefill's tiles take long enough
/// for two moments (its 0.5B-shape chunk ran ~3% slower with four).
struct Ahead<'a, 'c> {
    ctx: &'a Ctx<'c>,
    item: &'a Item,
    walk: std::ops::Range<usize>,
    next: Option<(&'a Item, std::ops::Range<usize>)>,
    /// The keys (rows or tiles, `nk` of them) and value rows (`n`) of the positions last
    /// located.
    k: [*const u8; TILE],
    v: [*const u8; TILE],
    nk: usize,
    n: usize,
}

impl<'a, 'c> Ahead<'a, 'c> {
    fn new(ctx: &'a Ctx<'c>, item: &'a Item, next: Option<&'a Item>) -> Self {
        Self {
            ctx,
            item,
            walk: item.walk(ctx),
            next: next.map(|n| (n, n.walk(ctx))),
            k: [std::ptr::null(); TILE],
            v: [std::ptr::null(); TILE],
            nk: 0,
            n: 0,
        }
    }

    /// Locates the rows of the [`TILE`] positions from `pos` of the item's walk (the next
    /// item's first ones, as far as `pos` lies past its end; none past both).
    #[inline(always)]
    fn locate(&mut self, pos: usize) {
        (self.nk, self.n) = (0, 0);
        let next_walk = self.next.as_ref().map(|(_, walk)| walk);
        let Some((in_next, range)) = ahead_of(&self.walk, next_walk, pos, TILE) else {
            return;
        };
        let item = match &self.next {
            Some((next, _)) if in_next => *next,
            _ => self.item,
        };
        let table = &self.ctx.seqs[item.seq].block_table;
        self.nk = rows_of(
            self.ctx,
            table,
            item.kv_head,
            range.start,
            range.len(),
            (&mut self.k, &mut self.v),
        );
        self.n = range.len();
    }

    /// The located keys' lines, to be asked for a line at a time.
    #[inline(always)]
    fn keys(&self) -> Trickle<'_> {
        Trickle::new(&self.k[..self.nk], key_bytes(self.ctx))
    }

    /// The located values' lines, to be asked for a line at a time.
    #[inline(always)]
    fn values(&self) -> Trickle<'_> {
        Trickle::new(&self.v[..self.n], self.ctx.layer.geo.head_bytes)
    }
}

/// The positions `pos..pos + n` of `walk` followed by `next` mean: `(false, range)` in
/// `walk` itself, `(true, range)` in `next` (where `pos` lies past `walk`'s end), cut at the
/// walk's end; `None` past both.
fn ahead_of(
    walk: &std::ops::Range<usize>,
    next: Option<&std::ops::Range<usize>>,
    pos: usize,
    n: usize,
) -> Option<(bool, std::ops::Range<usize>)> {
    let (in_next, walk, pos) = if pos < walk.end {
        (false, walk, pos)
    } else {
        let next = next?;
        (true, next, next.start + (pos - walk.end))
    };
    (pos < walk.end).then(|| (in_next, pos..(pos + n).min(walk.end)))
}

/// Where a split item's partial goes: `partials[partial..]`, merged by `merges[merge]`.
#[derive(Clone, Copy)]
struct Split {
    partial: usize,
    merge: usize,
}

/// Merges partitions `0..parts` of a split group, stored from `partial` on (one block of
/// `rows·(head_dim+2)` floats per partition), into `out`; run by the item that finishes the
/// group's last partition.
struct Merge {
    kv_head: usize,
    tokens: std::ops::Range<usize>,
    partial: usize,
    parts: usize,
}

/// The work items of one attention call and the buffers they share; kept between calls
/// (one per forward) so a decode step allocates nothing once they have grown.
#[derive(Default)]
pub(crate) struct Plan {
    items: Vec<Item>,
    merges: Vec<Merge>,
    partial_floats: usize,
    /// Split items' partial results, at least `partial_floats` long.
    partials: Vec<f32>,
    /// Per merge, the split partitions not finished yet.
    pending: Vec<AtomicUsize>,
}

impl Plan {
    fn build(&mut self, positions: &[usize], seqs: &[SeqSpan], shape: AttentionShape) {
        let group = shape.num_heads / shape.num_kv_heads;
        let plan = self;
        plan.items.clear();
        plan.merges.clear();
        plan.partial_floats = 0;
        for (seq, span) in seqs.iter().enumerate() {
            let tokens = span.query_start..span.query_start + span.query_len;
            let Some(&last) = positions[tokens.clone()].iter().max() else {
                continue;
            };
            let parts = last / PART + 1;
            if span.query_len <= QUERY_TILE && parts > 1 {
                // Decode (or a short chunk) deep into a long history: one item per partition.
                let block = span.query_len * group * (shape.head_dim + 2);
                for kv_head in 0..shape.num_kv_heads {
                    let partial = plan.partial_floats;
                    for p in 0..parts {
                        plan.items.push(Item {
                            seq,
                            kv_head,
                            tokens: tokens.clone(),
                            parts: p..p + 1,
                            split: Some(Split {
                                partial: partial + p * block,
                                merge: plan.merges.len(),
                            }),
                        });
                    }
                    plan.merges.push(Merge {
                        kv_head,
                        tokens: tokens.clone(),
                        partial,
                        parts,
                    });
                    plan.partial_floats += parts * block;
                }
                continue;
            }
            // Latest tokens first: they have the most history, and the pool hands items out
            // in order, so the long ones start early and the short ones fill the tail.
            let mut t1 = tokens.end;
            while t1 > tokens.start {
                let t0 = t1.saturating_sub(QUERY_TILE).max(tokens.start);
                let last = positions[t0..t1].iter().max().copied().unwrap_or(0);
                for kv_head in 0..shape.num_kv_heads {
                    plan.items.push(Item {
                        seq,
                        kv_head,
                        tokens: t0..t1,
                        parts: 0..last / PART + 1,
                        split: None,
                    });
                }
                t1 = t0;
            }
        }
        // Grown, never cleared: every number a merge reads was written by its item this call
        // (zeroing them cost a memset of ~400 KB a layer at depth 16k for the 1.5B).
        if plan.partials.len() < plan.partial_floats {
            plan.partials.resize(plan.partial_floats, 0.0);
        }
        plan.pending.clear();
        plan.pending
            .extend(plan.merges.iter().map(|m| AtomicUsize::new(m.parts)));
    }
}

/// Per-thread buffers, grown to the largest item seen and reused.
#[derive(Default)]
struct Scratch {
    /// The tile's keys decoded, when they are not read in place ([`AttnOps::in_place`]).
    k: Vec<f32>,
    /// The tile's keys decoded and transposed (the ISA's layout, [`AttnOps::transpose`]).
    kt: Vec<f32>,
    /// The tile's values decoded, when they are not read in place ([`AttnOps::in_place`]).
    v: Vec<f32>,
    /// Per query row, the tile's scores, then its exponentials (`TILE` apart).
    s: Vec<f32>,
    /// Per query row, the tile's rescaling of the running values.
    alpha: Vec<f32>,
    q: Vec<f32>,
    limit: Vec<usize>,
    /// Running state of each row over the partitions merged so far, and of the current one.
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    pm: Vec<f32>,
    pl: Vec<f32>,
    pacc: Vec<f32>,
}

impl Scratch {
    fn fit(&mut self, rows: usize, hd: usize) {
        fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
            if v.len() < len {
                v.resize(len, T::default());
            }
        }
        grow(&mut self.k, TILE * hd);
        grow(&mut self.kt, TILE * hd);
        grow(&mut self.v, TILE * hd);
        grow(&mut self.s, rows * TILE);
        grow(&mut self.alpha, rows);
        for v in [&mut self.q, &mut self.acc, &mut self.pacc] {
            grow(v, rows * hd);
        }
        for v in [&mut self.m, &mut self.l, &mut self.pm, &mut self.pl] {
            grow(v, rows);
        }
        grow(&mut self.limit, rows);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Scratch {
    /// This thread's scratch, moved out of its thread-local (a few pointers) so that the
    /// kernel body runs in the ISA entry point itself: inside a closure passed to
    /// `LocalKey::with` it would be compiled without the entry point's target features, and
    /// every AVX-512 intrinsic in it became an out-of-line call with its vectors passed
    /// through memory (20x slower than AVX2 on an Intel Xeon, 3-5x on AMD Zen 4).
    fn take() -> Self {
        SCRATCH.with(|cell| cell.take())
    }

    /// Gives [`Scratch::take`]'s buffers back for the next item on this thread.
    fn put_back(self) {
        SCRATCH.with(|cell| *cell.borrow_mut() = self);
    }
}

/// [`AttnOps`] with their entry points into the driver, compiled with the ISA's target
/// features so that the ops inline.
///
/// # Safety
/// The methods may use the ISA's instructions: call them only where it was detected.
/// `out`/`partials` must be the buffers of this call's plan; `partials` of `merge_group` the
/// merge's own group (partition 0 first).
trait Kernel: AttnOps + Send + Sync {
    unsafe fn item(
        self,
        ctx: &Ctx,
        item: &Item,
        next: Option<&Item>,
        out: SharedOut,
        partials: SharedOut,
    );
    unsafe fn merge_group(self, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut);
}

impl Kernel for Scalar {
    unsafe fn item(
        self,
        ctx: &Ctx,
        item: &Item,
        next: Option<&Item>,
        out: SharedOut,
        partials: SharedOut,
    ) {
        // SAFETY: forwarded.
        unsafe { run_item(self, ctx, item, next, out, partials) }
    }

    unsafe fn merge_group(self, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
        // SAFETY: forwarded.
        unsafe { run_merge(self, ctx, m, partials, out) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel for ops::Avx2 {
    unsafe fn item(
        self,
        ctx: &Ctx,
        item: &Item,
        next: Option<&Item>,
        out: SharedOut,
        partials: SharedOut,
    ) {
        // SAFETY: forwarded; AVX2/FMA/F16C were detected.
        unsafe { run_item_avx2(self, ctx, item, next, out, partials) }
    }

    unsafe fn merge_group(self, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
        // SAFETY: forwarded; AVX2/FMA/F16C were detected.
        unsafe { run_merge_avx2(self, ctx, m, partials, out) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel for ops::Avx512 {
    unsafe fn item(
        self,
        ctx: &Ctx,
        item: &Item,
        next: Option<&Item>,
        out: SharedOut,
        partials: SharedOut,
    ) {
        // SAFETY: forwarded; AVX-512F (and AVX2/FMA/F16C) were detected.
        unsafe { run_item_avx512(ctx, item, next, out, partials) }
    }

    unsafe fn merge_group(self, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
        // SAFETY: forwarded; AVX-512F (and AVX2/FMA/F16C) were detected.
        unsafe { run_merge_avx512(ctx, m, partials, out) }
    }
}

/// Generic over the ops so that the self-check's tests can run wrapped AVX2 ops through it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_item_avx2<O: AttnOps>(
    o: O,
    ctx: &Ctx,
    item: &Item,
    next: Option<&Item>,
    out: SharedOut,
    partials: SharedOut,
) {
    // SAFETY: forwarded contract of `Kernel::item`.
    unsafe { run_item(o, ctx, item, next, out, partials) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_merge_avx2<O: AttnOps>(o: O, ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
    // SAFETY: forwarded contract of `Kernel::merge_group`.
    unsafe { run_merge(o, ctx, m, partials, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn run_item_avx512(
    ctx: &Ctx,
    item: &Item,
    next: Option<&Item>,
    out: SharedOut,
    partials: SharedOut,
) {
    // SAFETY: forwarded contract of `Kernel::item`.
    unsafe { run_item(ops::Avx512, ctx, item, next, out, partials) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn run_merge_avx512(ctx: &Ctx, m: &Merge, partials: &[f32], out: SharedOut) {
    // SAFETY: forwarded contract of `Kernel::merge_group`.
    unsafe { run_merge(ops::Avx512, ctx, m, partials, out) }
}

/// Folds partition state `(pm, pl, pacc)` into the running `(m, l, acc)`.
#[inline(always)]
unsafe fn merge_into<O: AttnOps>(
    o: O,
    (m, l, acc): (&mut f32, &mut f32, &mut [f32]),
    (pm, pl, pacc): (f32, f32, &[f32]),
) {
    let mx = m.max(pm);
    let (ca, cb) = (exp_scalar(*m - mx), exp_scalar(pm - mx));
    *l = *l * ca + pl * cb;
    // SAFETY: the caller's ISA contract.
    unsafe { o.merge(acc, ca, pacc, cb) };
    *m = mx;
}

/// Head `h` of the group of `kv_head` for token `t`: its output (and query) offset.
#[inline(always)]
fn head_offset(ctx: &Ctx, t: usize, kv_head: usize, h: usize) -> usize {
    let hd = ctx.shape.head_dim;
    t * ctx.shape.num_heads * hd + (kv_head * ctx.group + h) * hd
}

#[inline(always)]
unsafe fn run_item<O: AttnOps>(
    o: O,
    ctx: &Ctx,
    item: &Item,
    next: Option<&Item>,
    out: SharedOut,
    partials: SharedOut,
) {
    let hd = ctx.shape.head_dim;
    let rows = item.tokens.len() * ctx.group;
    let mut scratch = Scratch::take();
    {
        let sc = &mut scratch;
        sc.fit(rows, hd);
        for (r, (t, h)) in item
            .tokens
            .clone()
            .flat_map(|t| (0..ctx.group).map(move |h| (t, h)))
            .enumerate()
        {
            let src = &ctx.q[head_offset(ctx, t, item.kv_head, h)..][..hd];
            for (d, s) in sc.q[r * hd..(r + 1) * hd].iter_mut().zip(src) {
                *d = s * ctx.scale;
            }
            sc.limit[r] = ctx.positions[t];
        }
        let table = &ctx.seqs[item.seq].block_table[..];
        let max_limit = sc.limit[..rows].iter().copied().max().unwrap_or(0);
        let in_place = o.in_place(rows);
        let mut ahead = Ahead::new(ctx, item, next);
        // The first tiles, unless the item before on this thread asked for them already.
        for pos in (ahead.walk.start..).step_by(TILE).take(AHEAD / TILE) {
            ahead.locate(pos);
            ahead.keys().rest();
            ahead.values().rest();
        }
        // The tile's keys (rows or tiles) and value rows in the pool, and those of their
        // decoded copies.
        let [mut kp, mut vp, mut kd, mut vd] = [[std::ptr::null::<u8>(); TILE]; 4];
        for part in item.parts.clone() {
            let p0 = part * PART;
            let end = (p0 + PART).min(max_limit + 1);
            for r in 0..rows {
                if sc.limit[r] >= p0 {
                    sc.pm[r] = f32::NEG_INFINITY;
                    sc.pl[r] = 0.0;
                    sc.pacc[r * hd..(r + 1) * hd].fill(0.0);
                }
            }
            for t0 in (p0..end).step_by(TILE) {
                let nt = TILE.min(end - t0);
                let groups = nt.div_ceil(GROUP);
                // SAFETY (block): the caller's ISA contract; positions lie inside the table
                // (checked by `ForwardBatch::validate`) and slots inside the pool
                // (`check_slots`), so `locate`'s rows are valid; scratch sizes from `fit`.
                unsafe {
                    locate(ctx, table, item.kv_head, t0, nt, &mut kp, &mut vp);
                    // The rows of the tile `AHEAD` on, asked for over this one's work: spread
                    // out, the requests queue less (measured, see `Ahead`). Decode asks for
                    // them a line at a time from inside the loops, a prefill for its keys now
                    // and its values once this tile's keys are ready.
                    ahead.locate(t0 + AHEAD);
                    if !in_place {
                        ahead.keys().rest();
                    }
                    let keys = tile_keys(
                        o,
                        ctx,
                        in_place,
                        &kp,
                        groups,
                        (&mut sc.k, &mut sc.kt),
                        &mut kd,
                    );
                    let mut lines = if in_place {
                        ahead.keys()
                    } else {
                        ahead.values().rest();
                        Trickle::none()
                    };
                    o.scores(&sc.q, hd, rows, keys, groups, &mut sc.s, &mut lines);
                    lines.rest();
                }
                // Rows that end before `nt` (or before the tile) get zero weights past their
                // end, so the tile's value pass can run every row to the longest one.
                let mut longest = 0;
                for r in 0..rows {
                    let e = &mut sc.s[r * TILE..(r + 1) * TILE];
                    if sc.limit[r] < t0 {
                        e.fill(0.0);
                        sc.alpha[r] = 1.0;
                        continue;
                    }
                    let n = nt.min(sc.limit[r] + 1 - t0);
                    // SAFETY: the caller's ISA contract; `e` holds TILE floats, n ≥ 1.
                    let (m_new, sum) = unsafe { o.softmax(e, sc.pm[r], n) };
                    // exp(0) is exactly 1: skip the call when the maximum stays (most tiles).
                    let alpha = if m_new == sc.pm[r] {
                        1.0
                    } else {
                        exp_scalar(sc.pm[r] - m_new)
                    };
                    sc.pl[r] = sc.pl[r] * alpha + sum;
                    sc.pm[r] = m_new;
                    sc.alpha[r] = alpha;
                    longest = longest.max(n);
                }
                // SAFETY: `locate`'s rows; the ISA as above.
                let values =
                    unsafe { tile_rows(o, ctx, in_place, &vp, longest, &mut sc.v, &mut vd) };
                let mut lines = if in_place {
                    ahead.values()
                } else {
                    Trickle::none()
                };
                // SAFETY: as above; the first `longest` rows of `values` are valid.
                unsafe {
                    o.accumulate(
                        &mut sc.pacc[..rows * hd],
                        hd,
                        &sc.alpha,
                        &sc.s,
                        values,
                        longest,
                        &mut lines,
                    )
                };
                lines.rest();
            }
            for r in 0..rows {
                if sc.limit[r] < p0 {
                    continue;
                }
                let pacc = &sc.pacc[r * hd..(r + 1) * hd];
                if let Some(Split { partial: base, .. }) = item.split {
                    // SAFETY: this item owns `rows·(hd+2)` floats at `base` (see `Plan`).
                    let dst = unsafe { partials.range(base + r * (hd + 2), hd + 2) };
                    dst[0] = sc.pm[r];
                    dst[1] = sc.pl[r];
                    dst[2..].copy_from_slice(pacc);
                } else if part == 0 {
                    sc.m[r] = sc.pm[r];
                    sc.l[r] = sc.pl[r];
                    sc.acc[r * hd..(r + 1) * hd].copy_from_slice(pacc);
                } else {
                    let state = (
                        &mut sc.m[r],
                        &mut sc.l[r],
                        &mut sc.acc[r * hd..(r + 1) * hd],
                    );
                    // SAFETY: the caller's ISA contract.
                    unsafe { merge_into(o, state, (sc.pm[r], sc.pl[r], pacc)) };
                }
            }
        }
        if item.split.is_none() {
            for (r, (t, h)) in item
                .tokens
                .clone()
                .flat_map(|t| (0..ctx.group).map(move |h| (t, h)))
                .enumerate()
            {
                // SAFETY: row (t, head) of `out` belongs to this item only; ISA as above.
                unsafe {
                    let dst = out.range(head_offset(ctx, t, item.kv_head, h), hd);
                    o.finish(&sc.acc[r * hd..(r + 1) * hd], sc.l[r], dst);
                }
            }
        }
    }
    scratch.put_back();
}

#[inline(always)]
unsafe fn run_merge<O: AttnOps>(o: O, ctx: &Ctx, mg: &Merge, partials: &[f32], out: SharedOut) {
    let hd = ctx.shape.head_dim;
    let rows = mg.tokens.len() * ctx.group;
    let block = rows * (hd + 2);
    let mut scratch = Scratch::take();
    {
        let sc = &mut scratch;
        sc.fit(rows, hd);
        for (r, (t, h)) in mg
            .tokens
            .clone()
            .flat_map(|t| (0..ctx.group).map(move |h| (t, h)))
            .enumerate()
        {
            let at = |p: usize| &partials[p * block + r * (hd + 2)..][..hd + 2];
            let first = at(0);
            let (mut m, mut l) = (first[0], first[1]);
            let acc = &mut sc.acc[..hd];
            acc.copy_from_slice(&first[2..]);
            for p in 1..mg.parts.min(ctx.positions[t] / PART + 1) {
                let part = at(p);
                // SAFETY: the caller's ISA contract.
                unsafe {
                    merge_into(
                        o,
                        (&mut m, &mut l, &mut *acc),
                        (part[0], part[1], &part[2..]),
                    )
                };
            }
            // SAFETY: row (t, head) of `out` belongs to this merge only; ISA as above.
            unsafe {
                let dst = out.range(head_offset(ctx, t, mg.kv_head, h), hd);
                o.finish(acc, l, dst);
            }
        }
    }
    scratch.put_back();
}

/// The first `n` of a tile's `rows` (in the pool) as the ops should read them: in place, or
/// (`!in_place`) decoded into `buf` (rows of `head_dim`), `copy` pointing at those.
///
/// # Safety
/// The first `n` of `rows` are valid rows of the pool; the CPU has `o`'s ISA.
#[inline(always)]
unsafe fn tile_rows<'a, O: AttnOps>(
    o: O,
    ctx: &Ctx,
    in_place: bool,
    rows: &'a [*const u8; TILE],
    n: usize,
    buf: &mut [f32],
    copy: &'a mut [*const u8; TILE],
) -> Rows<'a> {
    let dtype = ctx.layer.geo.dtype;
    if in_place {
        return Rows { at: rows, dtype };
    }
    let geo = ctx.layer.geo;
    // SAFETY: the caller's contract.
    unsafe { decode_copies(o, dtype, rows, (n, geo.head_dim, geo.head_bytes), buf, copy) };
    Rows {
        at: copy,
        dtype: KvStorage::F32,
    }
}

/// Decodes the first `n` of `src` (`dtype`, `bytes` each holding `numbers` numbers) into
/// `buf`, one after another, `copy` pointing at each.
///
/// # Safety
/// The first `n` of `src` are valid for `bytes`; `buf` holds `n·numbers`; the CPU has `o`'s
/// ISA.
#[inline(always)]
unsafe fn decode_copies<O: AttnOps>(
    o: O,
    dtype: KvStorage,
    src: &[*const u8; TILE],
    (n, numbers, bytes): (usize, usize, usize),
    buf: &mut [f32],
    copy: &mut [*const u8; TILE],
) {
    for ((&src, dst), out) in src
        .iter()
        .zip(copy.iter_mut())
        .zip(buf.chunks_exact_mut(numbers))
        .take(n)
    {
        // SAFETY: the caller's contract.
        unsafe { o.decode_row(dtype, std::slice::from_raw_parts(src, bytes), out) };
        *dst = out.as_ptr().cast();
    }
}

/// The first `groups` groups of a tile's keys (`at`: rows or tiles in the pool, as
/// [`rows_of`] located them) as [`AttnOps::scores`] reads them: rows transposed into `kt`
/// (through the decoded copy `k` when `!in_place`), tiles where they lie, or (`!in_place`)
/// decoded into `kt`, `copy` pointing at those.
///
/// # Safety
/// As [`tile_rows`], for keys.
#[inline(always)]
unsafe fn tile_keys<'a, O: AttnOps>(
    o: O,
    ctx: &Ctx,
    in_place: bool,
    at: &'a [*const u8; TILE],
    groups: usize,
    (k, kt): (&mut [f32], &'a mut [f32]),
    copy: &'a mut [*const u8; TILE],
) -> Keys<'a> {
    let geo = ctx.layer.geo;
    let hd = geo.head_dim;
    let tiled = match geo.keys {
        KeyLayout::Rows => {
            // SAFETY: the caller's contract.
            unsafe {
                let rows = tile_rows(o, ctx, in_place, at, groups * GROUP, k, copy);
                o.transpose(rows, hd, groups, kt);
            }
            return Keys::Transposed(kt);
        }
        KeyLayout::Tiled(t) => t,
    };
    let first = |a: &'a [*const u8; TILE]| {
        a.first_chunk::<TILES>()
            .expect("a tile holds TILES key tiles")
    };
    if in_place {
        return Keys::Tiled {
            at: first(at),
            dtype: tiled,
        };
    }
    let tiles = (groups * GROUP).div_ceil(KEY_TILE);
    // SAFETY: the caller's contract (a located tile holds KEY_TILE·hd numbers).
    unsafe {
        let shape = (tiles, KEY_TILE * hd, key_bytes(ctx));
        decode_copies(o, tiled.storage(), at, shape, kt, copy)
    };
    Keys::Tiled {
        at: first(copy),
        dtype: crate::paged_kv::TiledDtype::F32,
    }
}

/// Bytes of what [`rows_of`] points a key at: a row, or a tile of [`KEY_TILE`] positions.
#[inline(always)]
fn key_bytes(ctx: &Ctx) -> usize {
    let geo = ctx.layer.geo;
    match geo.keys {
        KeyLayout::Rows => geo.head_bytes,
        KeyLayout::Tiled(_) => KEY_TILE * geo.head_bytes,
    }
}

/// Points `v[j]` at the value rows of positions `t0 + j` of `kv_head`, `j < n`, and `k` at
/// their keys as the pool lays them out: `k[j]` at the rows, or `k[0..]` at the tiles that
/// hold them, in order (with `t0` a multiple of [`KEY_TILE`], `k[i]` holds positions
/// `t0 + KEY_TILE·i..`); returns how many of `k` it set. Each row and tile lies inside the
/// pool (checked: one outside is a bug upstream, not a read past it).
#[inline(always)]
fn rows_of(
    ctx: &Ctx,
    table: &[u32],
    kv_head: usize,
    t0: usize,
    n: usize,
    (k, v): (&mut [*const u8; TILE], &mut [*const u8; TILE]),
) -> usize {
    let (geo, layer) = (ctx.layer.geo, ctx.layer);
    let tiled = matches!(geo.keys, KeyLayout::Tiled(_));
    let at = |buf: &[u8], at: usize, len: usize| buf[at..at + len].as_ptr();
    let (hb, tb) = (geo.head_bytes, key_bytes(ctx));
    let mut tiles = 0;
    each_slot(geo.block_size, table, t0, n, |j, slot| {
        v[j] = at(layer.v, geo.row_at(slot, kv_head), hb);
        if !tiled {
            k[j] = at(layer.k, geo.row_at(slot, kv_head), hb);
        } else if j == 0 || slot.is_multiple_of(KEY_TILE) {
            // A tile's slots lie in one block (blocks are whole tiles), so a new tile
            // starts with a slot that is a multiple of KEY_TILE.
            k[tiles] = at(layer.k, geo.key_tile_at(slot, kv_head), tb);
            tiles += 1;
        }
    });
    if tiled {
        tiles
    } else {
        n
    }
}

/// [`rows_of`] the `n` positions of the tile from `t0` (`n ≥ 1`), with the keys and value
/// rows past those pointing at the last one's.
#[inline(always)]
fn locate(
    ctx: &Ctx,
    table: &[u32],
    kv_head: usize,
    t0: usize,
    n: usize,
    k: &mut [*const u8; TILE],
    v: &mut [*const u8; TILE],
) {
    debug_assert!((1..=TILE).contains(&n));
    let nk = rows_of(ctx, table, kv_head, t0, n, (&mut *k, &mut *v));
    for j in nk..TILE {
        k[j] = k[nk - 1];
    }
    for j in n..TILE {
        v[j] = v[n - 1];
    }
}

/// `f(j, slot)` with the slot of position `t0 + j`, `j < n`, walking the block table one
/// block at a time.
#[inline(always)]
fn each_slot(bs: usize, table: &[u32], t0: usize, n: usize, mut f: impl FnMut(usize, usize)) {
    let (mut pos, end, mut j) = (t0, t0 + n, 0);
    while pos < end {
        let (block, within) = (table[pos / bs] as usize, pos % bs);
        let take = (bs - within).min(end - pos);
        for i in 0..take {
            f(j, block * bs + within + i);
            j += 1;
        }
        pos += take;
    }
}
