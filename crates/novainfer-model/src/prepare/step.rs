//! One step's metadata for the device: the flat arrays the kernels read, validated on the
//! host, and their places in one staging buffer uploaded with a single copy.
//!
//! Kernels stay defensive about values they cannot check (an out-of-range id gives a zero
//! row, an unknown slot is skipped), which would turn a runner bug into a silently wrong
//! token. So every value is checked here first and a bad one is a [`ModelError`]: token ids
//! against the vocabulary, positions against the RoPE table, slots against the pool, the
//! block-table entries a sequence's history reaches against the pool and the padded row.

use novainfer_cuda::sample_params::{DrawMode, RowEdit, RowPenalties, SampleParams};

use crate::draw::{MAX_DEVICE_EDITS, MAX_TOP_LOGPROBS};
use crate::error::{ModelError, Result};
use crate::forward_batch::{Draw, ForwardBatch, SpanOutput};
use crate::lora::AdapterRef;

/// What the executor's buffers and pool were sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCapacity {
    pub vocab_size: usize,
    /// Rows of the RoPE table: positions must lie below.
    pub rope_positions: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Row length of the padded block tables.
    pub max_blocks_per_seq: usize,
    /// Tokens the activation buffers hold (`max_num_batched_tokens`).
    pub max_tokens: usize,
    /// Sequences the per-sequence buffers hold (`max_num_seqs`).
    pub max_seqs: usize,
}

/// A step as the kernels read it. Sequences with no tokens in this step are left out: they
/// attend to nothing and produce no row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PackedStep {
    pub token_ids: Vec<u32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i64>,
    /// `[num_seqs, max_blocks_per_seq]`, each row padded with block 0 (never read: a
    /// sequence's kernels stop at its `seq_len`).
    pub block_tables: Vec<i32>,
    /// Per sequence: its last position in this step + 1, the history attention reads.
    pub seq_lens: Vec<i32>,
    /// `[num_seqs + 1]`: sequence s owns tokens `query_start_loc[s]..query_start_loc[s+1]`.
    pub query_start_loc: Vec<i32>,
    /// The token rows whose logits are computed, in `batch.seqs` order (the CPU's
    /// `ForwardBatch::logits_indices`).
    pub sample_rows: Vec<i32>,
    /// Per sampled row: what the `draw` kernel does with it ([`DrawMode::Skip`] for a row
    /// whose logits go back to the engine) and its parameters.
    pub draw_modes: Vec<DrawMode>,
    pub draw_params: Vec<SampleParams>,
    /// Indices into the sampled rows of those returned as logits, in order.
    pub host_rows: Vec<i32>,
    /// The drawn rows' edits (penalties, bias, mask) in CSR form: row r's are
    /// `edits[edit_offsets[r]..edit_offsets[r + 1]]` (`[rows + 1]`), with strengths
    /// `row_penalties[r]`.
    pub edit_offsets: Vec<i32>,
    pub edits: Vec<RowEdit>,
    pub row_penalties: Vec<RowPenalties>,
    /// Per sampled row: −1, or how many top logprobs its draw returns (with its rank).
    pub tops: Vec<i32>,
    /// Per sampled row: −1, or which of `masks` (a grammar's, `mask_words` words each) the
    /// row is masked by.
    pub masks_at: Vec<i32>,
    pub masks: Vec<u32>,
    pub mask_words: usize,
    /// Every sequence has exactly one query token: the decode kernel applies.
    pub decode_only: bool,
    /// Sequences are ordered by kind: the first `prefill_seqs` have more than one query token
    /// (prompt chunks, tokens `0..query_start_loc[prefill_seqs]`), the rest one each (decodes),
    /// so a mixed step can run the prefill kernel over the first run and the decode kernel over
    /// the second ([`Self::attention`]). Rows are permuted with their sequences; `sample_rows`
    /// point at the moved rows and keep `batch.seqs` order.
    pub prefill_seqs: usize,
    /// The longest `seq_lens` entry.
    pub max_seq_len: usize,
    /// The LoRA adapters of the step's sequences, each once, in order of first appearance;
    /// empty when every row runs the base model alone.
    pub adapters: Vec<AdapterRef>,
    /// Per token row (empty without adapters): its adapter's index in `adapters`, or −1. The
    /// executor turns indices into its resident slots before the upload.
    pub lora_rows: Vec<i32>,
    /// Tokens this step takes from the draws of the step enqueued before it, on the device:
    /// `[token row, that step's sampled row]` pairs, flattened (empty: none).
    pub chain: Vec<i32>,
}

fn bad(field: &str, reason: String) -> ModelError {
    ModelError::config(field, reason)
}

impl PackedStep {
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Checks `batch` against `cap` and flattens it.
    pub fn pack(batch: &ForwardBatch, cap: &StepCapacity) -> Result<Self> {
        Self::pack_chained(batch, cap, &[])
    }

    /// [`Self::pack`], with `chained` `(batch token, sampled row)` pairs: that token of the
    /// batch is what the step enqueued before this one drew for its sampled row (its draws are
    /// still on the device); the batch holds any valid id there until the device writes it.
    pub fn pack_chained(
        batch: &ForwardBatch,
        cap: &StepCapacity,
        chained: &[(usize, usize)],
    ) -> Result<Self> {
        let vocab_size = cap.vocab_size;
        if let Some(&id) = batch.token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ModelError::TokenOutOfRange { id, vocab_size });
        }
        batch.validate(cap.block_size)?;
        let n = batch.num_tokens();
        if n > cap.max_tokens {
            return Err(bad(
                "forward_batch",
                format!(
                    "{n} tokens exceed the {} (max_num_batched_tokens) the device buffers hold",
                    cap.max_tokens
                ),
            ));
        }
        let positions = batch
            .positions
            .iter()
            .map(|&p| {
                if p >= cap.rope_positions {
                    return Err(bad(
                        "positions",
                        format!(
                            "position {p} at or past the {} positions the model was loaded for \
                             (max_model_len)",
                            cap.rope_positions
                        ),
                    ));
                }
                i32::try_from(p).map_err(|_| bad("positions", format!("{p} exceeds i32")))
            })
            .collect::<Result<Vec<i32>>>()?;
        let num_slots = cap.num_blocks * cap.block_size;
        let slot_mapping = batch
            .slot_mapping
            .iter()
            .map(|&s| match i64::try_from(s) {
                Ok(slot) if s < num_slots => Ok(slot),
                _ => Err(bad(
                    "slot_mapping",
                    format!("slot {s} outside a pool of {num_slots} slots"),
                )),
            })
            .collect::<Result<Vec<i64>>>()?;

        // Prompt chunks first, then single-token spans, each kind in batch order.
        let (mut spans, decodes): (Vec<_>, Vec<_>) = batch
            .seqs
            .iter()
            .filter(|s| s.query_len > 0)
            .partition(|s| s.query_len > 1);
        let prefill_seqs = spans.len();
        spans.extend(decodes);
        if spans.len() > cap.max_seqs {
            return Err(bad(
                "forward_batch",
                format!(
                    "{} sequences exceed the {} (max_num_seqs) the device buffers hold",
                    spans.len(),
                    cap.max_seqs
                ),
            ));
        }
        let width = cap.max_blocks_per_seq;
        let mut block_tables = vec![0i32; spans.len() * width];
        let mut seq_lens = Vec::with_capacity(spans.len());
        let mut query_start_loc = Vec::with_capacity(spans.len() + 1);
        query_start_loc.push(0);
        // New row → the batch's row.
        let mut row_order = Vec::with_capacity(n);
        for (s, span) in spans.iter().enumerate() {
            let range = span.query_start..span.query_start + span.query_len;
            // The last position bounds what attention reads; the CPU checked it against
            // the table, the maximum also covers spans whose positions are not increasing.
            let reach = batch.positions[range.clone()]
                .iter()
                .max()
                .map_or(0, |p| p + 1);
            let used = reach.div_ceil(cap.block_size);
            if used > width || used > span.block_table.len() {
                return Err(bad(
                    "block_tables",
                    format!(
                        "sequence {s} reaches position {} ({used} blocks of {}), past its table \
                         of {} blocks or the {width} blocks a sequence may hold (max_model_len)",
                        reach - 1,
                        cap.block_size,
                        span.block_table.len()
                    ),
                ));
            }
            for (b, &id) in span.block_table[..used].iter().enumerate() {
                if id as usize >= cap.num_blocks {
                    return Err(bad(
                        "block_tables",
                        format!(
                            "sequence {s}, entry {b}: block {id} outside a pool of {} blocks",
                            cap.num_blocks
                        ),
                    ));
                }
                block_tables[s * width + b] = id as i32;
            }
            // `reach` ≤ rope_positions and the rows ≤ max_tokens, both checked to fit i32.
            seq_lens.push(reach as i32);
            row_order.extend(range);
            query_start_loc.push(row_order.len() as i32);
        }
        let (adapters, lora_rows) = lora_rows(&spans, n);
        // Where each of the batch's rows went.
        let mut moved_to = vec![0usize; n];
        for (new, &old) in row_order.iter().enumerate() {
            moved_to[old] = new;
        }

        let Draws {
            modes: draw_modes,
            params: draw_params,
            edit_offsets,
            edits,
            penalties: row_penalties,
            tops,
            masks_at,
            masks,
        } = draws(batch, cap.vocab_size)?;
        let host_rows = (0..draw_modes.len())
            .filter(|&r| draw_modes[r] == DrawMode::Skip)
            .map(|r| r as i32)
            .collect();
        if chained.len() > cap.max_seqs {
            return Err(bad(
                "chained",
                format!(
                    "{} chained tokens, more than the {} sequences a step holds",
                    chained.len(),
                    cap.max_seqs
                ),
            ));
        }
        let mut chain = Vec::with_capacity(2 * chained.len());
        for &(token, row) in chained {
            let (Some(&to), Ok(from)) = (moved_to.get(token), i32::try_from(row)) else {
                return Err(bad(
                    "chained",
                    format!("token {token} of a batch of {n}, or sampled row {row}"),
                ));
            };
            chain.extend([to as i32, from]);
        }
        Ok(Self {
            chain,
            draw_modes,
            draw_params,
            host_rows,
            edit_offsets,
            edits,
            row_penalties,
            tops,
            masks_at,
            masks,
            mask_words: cap.vocab_size.div_ceil(32),
            token_ids: permuted(&batch.token_ids, &row_order),
            positions: permuted(&positions, &row_order),
            slot_mapping: permuted(&slot_mapping, &row_order),
            block_tables,
            decode_only: !spans.is_empty() && prefill_seqs == 0,
            prefill_seqs,
            max_seq_len: seq_lens.iter().copied().max().unwrap_or(0) as usize,
            seq_lens,
            query_start_loc,
            adapters,
            lora_rows,
            sample_rows: batch
                .logits_indices()
                .iter()
                .map(|&r| moved_to[r] as i32)
                .collect(),
        })
    }
}

/// What the `adjust_rows` and `draw` kernels take per sampled row.
struct Draws {
    modes: Vec<DrawMode>,
    params: Vec<SampleParams>,
    edit_offsets: Vec<i32>,
    edits: Vec<RowEdit>,
    penalties: Vec<RowPenalties>,
    tops: Vec<i32>,
    masks_at: Vec<i32>,
    masks: Vec<u32>,
}

/// The kernels' mode, parameters and edits for each sampled row, in `logits_indices` order.
fn draws(batch: &ForwardBatch, vocab_size: usize) -> Result<Draws> {
    let mut d = Draws {
        modes: Vec::new(),
        params: Vec::new(),
        edit_offsets: vec![0],
        edits: Vec::new(),
        penalties: Vec::new(),
        tops: Vec::new(),
        masks_at: Vec::new(),
        masks: Vec::new(),
    };
    for s in batch.seqs.iter().filter(|s| s.query_len > 0) {
        match &s.output {
            SpanOutput::None | SpanOutput::LastHidden => {}
            SpanOutput::LastLogits => d.push_skip(1),
            SpanOutput::AllLogits => d.push_skip(s.query_len),
            SpanOutput::Draw(draw) => d.push_draw(draw, vocab_size)?,
            SpanOutput::DrawEach(each) => {
                if each.len() != s.query_len {
                    return Err(bad(
                        "draw",
                        format!("{} rules for a span of {} tokens", each.len(), s.query_len),
                    ));
                }
                for draw in each {
                    d.push_draw(draw, vocab_size)?;
                }
            }
        }
    }
    Ok(d)
}

impl Draws {
    /// `rows` rows whose logits go back to the engine.
    fn push_skip(&mut self, rows: usize) {
        for _ in 0..rows {
            self.modes.push(DrawMode::Skip);
            self.params.push(SampleParams::UNUSED);
            self.tops.push(-1);
            self.masks_at.push(-1);
            self.penalties.push(RowPenalties::NEUTRAL);
            self.edit_offsets.push(self.edits.len() as i32);
        }
    }

    /// One row drawn by `draw`, checked against what the kernels take.
    fn push_draw(&mut self, draw: &Draw, vocab_size: usize) -> Result<()> {
        let words = vocab_size.div_ceil(32);
        let (mode, p) = draw.kernel_args()?;
        let top = match draw.logprobs {
            None => -1,
            Some(n) if n <= MAX_TOP_LOGPROBS => n as i32,
            Some(n) => {
                return Err(bad(
                    "draw",
                    format!("{n} top logprobs exceed the {MAX_TOP_LOGPROBS} a draw returns"),
                ))
            }
        };
        self.modes.push(mode);
        self.params.push(p);
        self.tops.push(top);
        match draw.allowed.as_deref() {
            Some(mask) if mask.len() != words => {
                return Err(bad(
                    "draw",
                    format!(
                    "a grammar mask of {} words for a vocabulary of {vocab_size} ({words} words)",
                    mask.len()
                ),
                ))
            }
            Some(mask) => {
                self.masks_at.push((self.masks.len() / words) as i32);
                self.masks.extend_from_slice(mask);
            }
            None => self.masks_at.push(-1),
        }
        match draw.adjust.as_deref() {
            Some(a) if a.edits.len() > MAX_DEVICE_EDITS => {
                return Err(bad(
                    "draw",
                    format!(
                        "{} edits of one row exceed the {MAX_DEVICE_EDITS} the device takes",
                        a.edits.len()
                    ),
                ))
            }
            Some(a) => {
                self.edits.extend_from_slice(&a.edits);
                self.penalties.push(a.penalties);
            }
            None => self.penalties.push(RowPenalties::NEUTRAL),
        }
        self.edit_offsets.push(self.edits.len() as i32);
        Ok(())
    }
}

/// The distinct adapters of `spans` (in packed order) and each packed row's index among them
/// (−1: none); both empty when no span has an adapter.
fn lora_rows(spans: &[&crate::forward_batch::SeqSpan], n: usize) -> (Vec<AdapterRef>, Vec<i32>) {
    if spans.iter().all(|s| s.adapter.is_none()) {
        return (Vec::new(), Vec::new());
    }
    let mut adapters: Vec<AdapterRef> = Vec::new();
    let mut rows = Vec::with_capacity(n);
    for span in spans {
        let index = match &span.adapter {
            None => -1,
            Some(a) => match adapters.iter().position(|b| b == a) {
                Some(i) => i as i32,
                None => {
                    adapters.push(a.clone());
                    (adapters.len() - 1) as i32
                }
            },
        };
        rows.extend(std::iter::repeat_n(index, span.query_len));
    }
    (adapters, rows)
}

/// `values` in `order` (an index per output).
fn permuted<T: Copy>(values: &[T], order: &[usize]) -> Vec<T> {
    order.iter().map(|&r| values[r]).collect()
}

/// Environment variable choosing how a step with both prompt chunks and decodes attends
/// ([`MixedSteps`]).
pub const MIXED_STEPS_ENV: &str = "NOVAINFER_CUDA_MIXED";

/// How a step mixing prompt chunks and single-token decodes runs its attention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MixedSteps {
    /// The prefill kernel over the chunks, the decode kernel over the decodes (as vLLM's
    /// backends split a mixed batch): a decode in the prefill kernel fills one query row of
    /// a tile meant for many, and reads its whole history without the decode kernel's split.
    #[default]
    Split,
    /// Every sequence through the prefill kernel (the behaviour before the split; kept to
    /// rule the split out when a GPU result looks wrong).
    Prefill,
}

impl MixedSteps {
    pub fn parse(value: &str) -> Result<Self> {
        match value {
            "" | "split" => Ok(Self::Split),
            "prefill" => Ok(Self::Prefill),
            other => Err(bad(
                MIXED_STEPS_ENV,
                format!("`{other}` is not `split` or `prefill`"),
            )),
        }
    }

    /// The choice [`MIXED_STEPS_ENV`] names (read once per process).
    pub fn from_env() -> Result<Self> {
        static CHOICE: std::sync::OnceLock<std::result::Result<MixedSteps, String>> =
            std::sync::OnceLock::new();
        CHOICE
            .get_or_init(|| {
                let value = std::env::var(MIXED_STEPS_ENV).unwrap_or_default();
                Self::parse(&value).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|why| bad(MIXED_STEPS_ENV, why))
    }
}

/// Which attention kernels a step runs, over which of its sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAttention {
    /// One query token per sequence; histories up to `max_seq_len`.
    Decode { max_seq_len: usize },
    /// Every sequence through the prefill kernel.
    Prefill,
    /// The first `prefill_seqs` sequences (rows `0..prefill_tokens`) through the prefill
    /// kernel; the others, a row each from `prefill_tokens` on, through the decode kernel
    /// over histories up to `decode_max_seq_len`.
    Mixed {
        prefill_seqs: usize,
        prefill_tokens: usize,
        decode_max_seq_len: usize,
    },
}

impl PackedStep {
    /// How this step attends, `mixed` deciding for steps with both kinds of sequences.
    pub fn attention(&self, mixed: MixedSteps) -> StepAttention {
        let split = self.prefill_seqs;
        if self.decode_only {
            return StepAttention::Decode {
                max_seq_len: self.max_seq_len,
            };
        }
        if mixed == MixedSteps::Prefill || split == 0 || split >= self.num_seqs() {
            return StepAttention::Prefill;
        }
        StepAttention::Mixed {
            prefill_seqs: split,
            prefill_tokens: self.query_start_loc[split] as usize,
            decode_max_seq_len: self.seq_lens[split..].iter().copied().max().unwrap_or(0) as usize,
        }
    }

    /// Sampled rows the device draws itself.
    pub fn num_draws(&self) -> usize {
        self.draw_modes.len() - self.host_rows.len()
    }

    /// The sampled row of each token the device draws, in the order the step returns them.
    pub fn drawn_rows(&self) -> Vec<usize> {
        (0..self.draw_modes.len())
            .filter(|&r| self.draw_modes[r] != DrawMode::Skip)
            .collect()
    }
}

/// Where each array of a [`PackedStep`] lives in the staging buffer (and in its device
/// copy): fixed offsets for the capacity, so device views never move (CUDA graphs will
/// capture them). The block tables come last so a step uploads only the rows it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    pub slot_mapping: usize,
    pub token_ids: usize,
    pub positions: usize,
    pub seq_lens: usize,
    pub query_start_loc: usize,
    pub sample_rows: usize,
    pub draw_params: usize,
    pub draw_modes: usize,
    pub host_rows: usize,
    pub row_penalties: usize,
    pub edit_offsets: usize,
    pub tops: usize,
    pub masks_at: usize,
    pub lora_rows: usize,
    pub chain: usize,
    pub block_tables: usize,
    pub total: usize,
    pub max_blocks_per_seq: usize,
}

/// Section alignment: the i64 slot mapping needs 8; 256 is what cudaMalloc gives a base.
const ALIGN: usize = 256;

impl StepLayout {
    pub fn new(cap: &StepCapacity) -> Self {
        let (t, s) = (cap.max_tokens, cap.max_seqs);
        let mut at = 0;
        let mut section = |bytes: usize| {
            let start = at;
            at = (at + bytes).next_multiple_of(ALIGN);
            start
        };
        let slot_mapping = section(8 * t);
        let token_ids = section(4 * t);
        let positions = section(4 * t);
        let seq_lens = section(4 * s);
        let query_start_loc = section(4 * (s + 1));
        let sample_rows = section(4 * s);
        let draw_params = section(std::mem::size_of::<SampleParams>() * s);
        let draw_modes = section(4 * s);
        let host_rows = section(4 * s);
        let row_penalties = section(std::mem::size_of::<RowPenalties>() * s);
        let edit_offsets = section(4 * (s + 1));
        let tops = section(4 * s);
        let masks_at = section(4 * s);
        let lora_rows = section(4 * t);
        let chain = section(8 * s);
        let block_tables = section(4 * s * cap.max_blocks_per_seq);
        Self {
            slot_mapping,
            token_ids,
            positions,
            seq_lens,
            query_start_loc,
            sample_rows,
            draw_params,
            draw_modes,
            host_rows,
            row_penalties,
            edit_offsets,
            tops,
            masks_at,
            lora_rows,
            chain,
            block_tables,
            total: at.max(ALIGN),
            max_blocks_per_seq: cap.max_blocks_per_seq,
        }
    }

    /// Writes `step` into `staging` (at least `total` bytes, native byte order as the
    /// device reads it) and returns how many leading bytes must be uploaded.
    pub fn write(&self, step: &PackedStep, staging: &mut [u8]) -> usize {
        fn put<const N: usize>(dst: &mut [u8], at: usize, values: impl Iterator<Item = [u8; N]>) {
            for (i, bytes) in values.enumerate() {
                dst[at + i * N..at + (i + 1) * N].copy_from_slice(&bytes);
            }
        }
        put(
            staging,
            self.slot_mapping,
            step.slot_mapping.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.token_ids,
            step.token_ids.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.positions,
            step.positions.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.seq_lens,
            step.seq_lens.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.query_start_loc,
            step.query_start_loc.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.sample_rows,
            step.sample_rows.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.draw_params,
            step.draw_params.iter().map(params_bytes),
        );
        put(
            staging,
            self.draw_modes,
            step.draw_modes.iter().map(|&m| (m as i32).to_ne_bytes()),
        );
        put(
            staging,
            self.host_rows,
            step.host_rows.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.lora_rows,
            step.lora_rows.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.row_penalties,
            step.row_penalties.iter().map(|p| {
                let mut out = [0u8; 16];
                out[0..4].copy_from_slice(&p.repetition.to_ne_bytes());
                out[4..8].copy_from_slice(&p.frequency.to_ne_bytes());
                out[8..12].copy_from_slice(&p.presence.to_ne_bytes());
                out
            }),
        );
        put(
            staging,
            self.edit_offsets,
            step.edit_offsets.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.tops,
            step.tops.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.masks_at,
            step.masks_at.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.chain,
            step.chain.iter().map(|v| v.to_ne_bytes()),
        );
        put(
            staging,
            self.block_tables,
            step.block_tables.iter().map(|v| v.to_ne_bytes()),
        );
        self.block_tables + 4 * step.block_tables.len()
    }
}

/// The kernel's `RowEdit`s (`#[repr(C)]`, 16 bytes each, no padding) as the device reads them,
/// into `staging` (the edit buffer's own, uploaded apart from the step's metadata); returns the
/// bytes written.
pub fn write_edits(edits: &[RowEdit], staging: &mut [u8]) -> usize {
    for (e, out) in edits.iter().zip(staging.chunks_exact_mut(16)) {
        out[0..4].copy_from_slice(&e.token_id.to_ne_bytes());
        out[4..8].copy_from_slice(&e.output_count.to_ne_bytes());
        out[8..12].copy_from_slice(&e.flags.to_ne_bytes());
        out[12..16].copy_from_slice(&e.bias.to_ne_bytes());
    }
    16 * edits.len()
}

/// The kernel's `SampleParams` (`#[repr(C)]`, 32 bytes, no padding) as the device reads it.
fn params_bytes(p: &SampleParams) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[0..8].copy_from_slice(&p.seed.to_ne_bytes());
    out[8..16].copy_from_slice(&p.offset.to_ne_bytes());
    out[16..20].copy_from_slice(&p.inv_temperature.to_ne_bytes());
    out[20..24].copy_from_slice(&p.top_p.to_ne_bytes());
    out[24..28].copy_from_slice(&p.min_p.to_ne_bytes());
    out[28..32].copy_from_slice(&p.top_k.to_ne_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: StepCapacity = StepCapacity {
        vocab_size: 50,
        rope_positions: 64,
        num_blocks: 10,
        block_size: 4,
        max_blocks_per_seq: 4,
        max_tokens: 16,
        max_seqs: 4,
    };

    fn slots(table: &[u32], positions: std::ops::Range<usize>) -> Vec<usize> {
        positions
            .map(|p| table[p / 4] as usize * 4 + p % 4)
            .collect()
    }

    /// a: chunk of 4 at positions 5..9 (not sampled), b: one decode at 5, c: empty span.
    fn batch() -> ForwardBatch {
        let mut b = ForwardBatch::default();
        b.push(
            &[1, 2, 3, 4],
            5,
            slots(&[5, 1, 8], 5..9),
            vec![5, 1, 8],
            false,
        );
        b.push(&[7], 5, slots(&[0, 6], 5..6), vec![0, 6], true);
        b.push(&[], 0, vec![], vec![3], true);
        b
    }

    #[test]
    fn packs_a_mixed_step() {
        let p = PackedStep::pack(&batch(), &CAP).expect("valid");
        assert_eq!(p.positions, [5, 6, 7, 8, 5]);
        assert_eq!(p.slot_mapping, [5, 6, 7, 32, 25]);
        assert_eq!(p.seq_lens, [9, 6], "the empty span is dropped");
        assert_eq!(p.query_start_loc, [0, 4, 5]);
        assert_eq!(p.block_tables, [5, 1, 8, 0, 0, 6, 0, 0]);
        assert_eq!(
            p.sample_rows,
            [4],
            "only b samples; the empty span has no row"
        );
        assert!(!p.decode_only);
        assert_eq!(p.max_seq_len, 9);

        let mut decode = ForwardBatch::default();
        decode.push(&[7], 5, slots(&[0, 6], 5..6), vec![0, 6], true);
        decode.push(&[9], 0, vec![12], vec![3], true);
        let p = PackedStep::pack(&decode, &CAP).expect("valid");
        assert!(p.decode_only);
        assert_eq!(p.sample_rows, [0, 1]);
    }

    #[test]
    fn chained_tokens_follow_their_rows_and_reach_the_device_layout() {
        // A decode first, then a chunk: packing puts the chunk first, so the decode's token
        // (batch row 0) moves to row 4.
        let mut b = ForwardBatch::default();
        b.push(&[0], 5, slots(&[0, 6], 5..6), vec![0, 6], true);
        b.push(
            &[1, 2, 3, 4],
            5,
            slots(&[5, 1, 8], 5..9),
            vec![5, 1, 8],
            false,
        );
        let p = PackedStep::pack_chained(&b, &CAP, &[(0, 3)]).expect("valid");
        assert_eq!(p.token_ids[4], 0);
        assert_eq!(
            p.chain,
            [4, 3],
            "token row 4 takes the step before's sampled row 3"
        );
        let layout = StepLayout::new(&CAP);
        let mut staging = vec![0u8; layout.total];
        layout.write(&p, &mut staging);
        let at = |i: usize| {
            i32::from_ne_bytes(staging[layout.chain + 4 * i..][..4].try_into().expect("4"))
        };
        assert_eq!([at(0), at(1)], [4, 3]);
        assert!(
            layout.chain + 8 * CAP.max_seqs <= layout.block_tables,
            "sections do not overlap"
        );
        // A token past the batch, or more chained tokens than sequences, is refused.
        assert!(PackedStep::pack_chained(&b, &CAP, &[(9, 0)]).is_err());
        let many = vec![(0, 0); CAP.max_seqs + 1];
        assert!(PackedStep::pack_chained(&b, &CAP, &many).is_err());
        assert!(PackedStep::pack(&b, &CAP).expect("valid").chain.is_empty());
    }

    #[test]
    fn drawn_rows_are_the_sampled_rows_the_device_draws() {
        let p = PackedStep {
            draw_modes: vec![
                DrawMode::Skip,
                DrawMode::Greedy,
                DrawMode::Skip,
                DrawMode::Random,
            ],
            ..PackedStep::default()
        };
        assert_eq!(p.drawn_rows(), [1, 3]);
    }

    /// Random mixes of decodes, prompt chunks, unsampled chunks and empty spans: the packed
    /// step lists the chunks first and the decodes after, each sequence keeps its own rows
    /// (tokens, positions, slots), block table and history, and every sampled row still
    /// names the token the batch's `logits_indices` named, in the batch's order.
    #[test]
    fn mixed_steps_put_prompt_chunks_before_decodes_and_keep_every_row() {
        use rand::{RngExt, SeedableRng};
        let cap = StepCapacity {
            max_tokens: 64,
            max_seqs: 8,
            num_blocks: 64,
            max_blocks_per_seq: 8,
            ..CAP
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut kinds = std::collections::HashSet::new();
        for _ in 0..300 {
            let mut b = ForwardBatch::default();
            let mut next_block = 0u32;
            let mut expected = Vec::new(); // per non-empty span: (tokens, positions, slots)
            for _ in 0..rng.random_range(1..=8) {
                let len = [0, 1, 1, 1, 2, 5][rng.random_range(0..6)];
                let start: usize = rng.random_range(0..12);
                let blocks = (start + len).div_ceil(4).max(1);
                let table: Vec<u32> = (next_block..next_block + blocks as u32).collect();
                next_block += blocks as u32;
                let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..50)).collect();
                let slot = slots(&table, start..start + len);
                if len > 0 {
                    let pos: Vec<i32> = (start..start + len).map(|p| p as i32).collect();
                    let sl: Vec<i64> = slot.iter().map(|&x| x as i64).collect();
                    expected.push((tokens.clone(), pos, sl, table.clone()));
                }
                b.push(&tokens, start, slot, table, rng.random_bool(0.7));
            }
            let p = PackedStep::pack(&b, &cap).expect("valid");
            // Sequences: chunks (len > 1) in batch order, then decodes in batch order.
            let mut want: Vec<_> = expected.iter().filter(|e| e.0.len() > 1).collect();
            want.extend(expected.iter().filter(|e| e.0.len() == 1));
            assert_eq!(p.num_seqs(), want.len());
            assert_eq!(
                p.prefill_seqs,
                expected.iter().filter(|e| e.0.len() > 1).count()
            );
            for (s, (tokens, pos, sl, table)) in want.iter().enumerate() {
                let rows = p.query_start_loc[s] as usize..p.query_start_loc[s + 1] as usize;
                assert_eq!(p.token_ids[rows.clone()], tokens[..]);
                assert_eq!(p.positions[rows.clone()], pos[..]);
                assert_eq!(p.slot_mapping[rows], sl[..]);
                assert_eq!(p.seq_lens[s], pos.last().expect("non-empty") + 1);
                let used = (p.seq_lens[s] as usize).div_ceil(4);
                let row = &p.block_tables[s * 8..s * 8 + used];
                assert!(row.iter().zip(table.iter()).all(|(&a, &b)| a == b as i32));
            }
            let sampled: Vec<_> = b.logits_indices();
            assert_eq!(p.sample_rows.len(), sampled.len());
            for (&packed, &orig) in p.sample_rows.iter().zip(&sampled) {
                let packed = packed as usize;
                assert_eq!(p.token_ids[packed], b.token_ids[orig]);
                assert_eq!(p.positions[packed] as usize, b.positions[orig]);
                assert_eq!(p.slot_mapping[packed] as usize, b.slot_mapping[orig]);
            }
            let attention = p.attention(MixedSteps::Split);
            match attention {
                StepAttention::Decode { max_seq_len } => {
                    assert!(p.prefill_seqs == 0 && p.num_seqs() > 0);
                    assert_eq!(max_seq_len, p.max_seq_len);
                }
                StepAttention::Prefill => {
                    assert!(p.prefill_seqs == p.num_seqs() || p.num_seqs() == 0);
                }
                StepAttention::Mixed {
                    prefill_seqs,
                    prefill_tokens,
                    decode_max_seq_len,
                } => {
                    assert!(prefill_seqs > 0 && prefill_seqs < p.num_seqs());
                    assert_eq!(prefill_tokens + p.num_seqs() - prefill_seqs, p.num_tokens());
                    let longest = p.seq_lens[prefill_seqs..].iter().max().copied();
                    assert_eq!(Some(decode_max_seq_len as i32), longest);
                    assert_eq!(p.attention(MixedSteps::Prefill), StepAttention::Prefill);
                }
            }
            kinds.insert(std::mem::discriminant(&attention));
        }
        assert_eq!(kinds.len(), 3, "every kind of step came up");
    }

    /// Rows carry their sequence's adapter (an index into the step's distinct adapters, in
    /// packed order) through the reordering; a step without adapters carries nothing.
    #[test]
    fn lora_rows_follow_their_sequences() {
        use crate::lora::test_support::empty_adapter;
        let (a, b) = (empty_adapter(7, 1), empty_adapter(9, 1));
        let cap = StepCapacity {
            max_tokens: 16,
            max_seqs: 8,
            ..CAP
        };
        let mut batch = ForwardBatch::default();
        let spans: [(&[u32], Option<&AdapterRef>); 4] = [
            (&[1], Some(&a)),
            (&[2, 3, 4], Some(&b)),
            (&[5], None),
            (&[6, 7], Some(&a)),
        ];
        for (i, (tokens, adapter)) in spans.iter().enumerate() {
            let table = vec![i as u32];
            let slots = slots(&table, 0..tokens.len());
            batch.push(tokens, 0, slots, table, true);
            batch.seqs[i].adapter = adapter.cloned();
        }
        let p = PackedStep::pack(&batch, &cap).expect("valid");
        // Packed: the chunks [2, 3, 4] (b) and [6, 7] (a) first, then the decodes [1] (a), [5].
        assert_eq!(p.token_ids, [2, 3, 4, 6, 7, 1, 5]);
        assert_eq!(p.adapters, [b.clone(), a.clone()]);
        assert_eq!(p.lora_rows, [0, 0, 0, 1, 1, 1, -1]);
        for s in &mut batch.seqs {
            s.adapter = None;
        }
        let plain = PackedStep::pack(&batch, &cap).expect("valid");
        assert!(plain.adapters.is_empty() && plain.lora_rows.is_empty());
    }

    #[test]
    fn the_mixed_step_switch_parses() {
        assert_eq!(MixedSteps::default(), MixedSteps::Split);
        assert_eq!(MixedSteps::parse("").ok(), Some(MixedSteps::Split));
        assert_eq!(MixedSteps::parse("prefill").ok(), Some(MixedSteps::Prefill));
        let err = MixedSteps::parse("both").expect_err("unknown").to_string();
        assert!(
            err.contains(MIXED_STEPS_ENV) && err.contains("both"),
            "{err}"
        );
    }

    #[test]
    fn the_layout_places_every_array_and_uploads_only_used_table_rows() {
        let cap = StepCapacity {
            max_tokens: 5,
            ..CAP
        };
        let layout = StepLayout::new(&cap);
        let p = PackedStep::pack(&batch(), &cap).expect("valid");
        let mut staging = vec![0u8; layout.total];
        let used = layout.write(&p, &mut staging);
        assert_eq!(used, layout.block_tables + 4 * 2 * 4);
        assert!(used <= layout.total);
        let i32_at = |at: usize| i32::from_ne_bytes(staging[at..at + 4].try_into().expect("4"));
        let i64_at = |at: usize| i64::from_ne_bytes(staging[at..at + 8].try_into().expect("8"));
        assert_eq!(i64_at(layout.slot_mapping + 8 * 3), 32);
        assert_eq!(i32_at(layout.positions + 4 * 4), 5);
        assert_eq!(i32_at(layout.token_ids + 4 * 4), 7);
        assert_eq!(i32_at(layout.query_start_loc + 4 * 2), 5);
        assert_eq!(i32_at(layout.sample_rows), 4);
        assert_eq!(i32_at(layout.block_tables + 4 * 5), 6);
        for at in [
            layout.slot_mapping,
            layout.token_ids,
            layout.positions,
            layout.seq_lens,
            layout.query_start_loc,
            layout.sample_rows,
            layout.draw_params,
            layout.draw_modes,
            layout.host_rows,
            layout.row_penalties,
            layout.edit_offsets,
            layout.tops,
            layout.masks_at,
            layout.lora_rows,
            layout.block_tables,
        ] {
            assert_eq!(at % ALIGN, 0);
        }
    }

    /// Draw spans get their kernel mode and parameters, logits spans `Skip` and a host row;
    /// the parameters land in the staging buffer in the kernel struct's field order.
    #[test]
    fn draws_are_packed_per_sampled_row() {
        use crate::forward_batch::{Draw, DrawRule};
        let mut b = ForwardBatch::default();
        let random = Draw {
            seed: 0x0102_0304_0506_0708,
            offset: 11,
            rule: DrawRule::Random {
                temperature: 0.5,
                top_k: Some(7),
                top_p: 0.9,
                min_p: 0.1,
            },
            adjust: None,
            logprobs: None,
            allowed: None,
        };
        let greedy = Draw {
            seed: 1,
            offset: 0,
            rule: DrawRule::Greedy,
            adjust: None,
            logprobs: Some(7),
            allowed: None,
        };
        b.push_span(&[1], 0, vec![0], vec![0], SpanOutput::Draw(random.clone()));
        b.push_span(&[2, 3], 0, vec![4, 5], vec![1], SpanOutput::AllLogits);
        b.push_span(&[4], 0, vec![8], vec![2], SpanOutput::None);
        b.push_span(&[5], 0, vec![12], vec![3], SpanOutput::Draw(greedy.clone()));
        b.push_span(&[6], 0, vec![16], vec![4], SpanOutput::LastLogits);
        let cap = StepCapacity { max_seqs: 8, ..CAP };
        let p = PackedStep::pack(&b, &cap).expect("valid");
        // The two-token span's rows move first (prompt chunks before decodes); the sampled
        // rows keep the batch's order.
        assert_eq!(p.sample_rows, [2, 0, 1, 4, 5]);
        assert_eq!(p.token_ids, [2, 3, 1, 4, 5, 6]);
        assert_eq!(
            p.draw_modes,
            [
                DrawMode::Random,
                DrawMode::Skip,
                DrawMode::Skip,
                DrawMode::Greedy,
                DrawMode::Skip
            ]
        );
        assert_eq!(p.host_rows, [1, 2, 4]);
        assert_eq!(p.num_draws(), 2);
        assert_eq!(p.draw_params[0].top_k, 7);
        assert_eq!(p.draw_params[0].inv_temperature, 2.0);

        let layout = StepLayout::new(&cap);
        let mut staging = vec![0u8; layout.total];
        layout.write(&p, &mut staging);
        let at = layout.draw_params;
        assert_eq!(&staging[at..at + 8], &random.seed.to_ne_bytes());
        assert_eq!(&staging[at + 8..at + 16], &11u64.to_ne_bytes());
        assert_eq!(&staging[at + 16..at + 20], &2.0f32.to_ne_bytes());
        assert_eq!(&staging[at + 20..at + 24], &0.9f32.to_ne_bytes());
        assert_eq!(&staging[at + 24..at + 28], &0.1f32.to_ne_bytes());
        assert_eq!(&staging[at + 28..at + 32], &7i32.to_ne_bytes());
        let i32_at = |at: usize| i32::from_ne_bytes(staging[at..at + 4].try_into().expect("4"));
        assert_eq!(i32_at(layout.draw_modes), DrawMode::Random as i32);
        assert_eq!(i32_at(layout.draw_modes + 4 * 3), DrawMode::Greedy as i32);
        assert_eq!(i32_at(layout.host_rows + 4 * 2), 4);

        assert_eq!(p.edit_offsets, [0, 0, 0, 0, 0, 0], "no row has edits");
        assert_eq!(
            p.tops,
            [-1, -1, -1, 7, -1],
            "the greedy draw asked for 7 top logprobs"
        );
        assert_eq!(i32_at(layout.tops + 4 * 3), 7);

        // A drawn row with edits: CSR offsets over the sampled rows, its strengths, and the
        // edits' bytes in the kernel's field order.
        let edits = vec![
            RowEdit {
                token_id: 4,
                output_count: 2,
                flags: RowEdit::PENALIZE | RowEdit::IN_PROMPT,
                bias: 0.0,
            },
            RowEdit {
                token_id: 9,
                output_count: 0,
                flags: RowEdit::MASK,
                bias: -1.5,
            },
        ];
        let penalties = RowPenalties {
            repetition: 1.2,
            frequency: 0.5,
            presence: 0.25,
            _pad: 0.0,
        };
        let adjusted = Draw {
            adjust: Some(std::sync::Arc::new(crate::draw::Adjust {
                penalties,
                edits: edits.clone(),
            })),
            ..greedy.clone()
        };
        let mut e = ForwardBatch::default();
        e.push_span(&[6], 0, vec![16], vec![4], SpanOutput::LastLogits);
        e.push_span(&[1], 0, vec![0], vec![0], SpanOutput::Draw(adjusted));
        let p = PackedStep::pack(&e, &cap).expect("valid");
        assert_eq!(p.edit_offsets, [0, 0, 2]);
        assert_eq!(p.edits, edits);
        assert_eq!(p.row_penalties, [RowPenalties::NEUTRAL, penalties]);
        let mut staging = vec![0u8; layout.total];
        layout.write(&p, &mut staging);
        let word = |at: usize| -> [u8; 4] { staging[at..at + 4].try_into().expect("4") };
        assert_eq!(f32::from_ne_bytes(word(layout.row_penalties + 16)), 1.2);
        assert_eq!(f32::from_ne_bytes(word(layout.row_penalties + 16 + 4)), 0.5);
        assert_eq!(
            f32::from_ne_bytes(word(layout.row_penalties + 16 + 8)),
            0.25
        );
        assert_eq!(i32::from_ne_bytes(word(layout.edit_offsets + 8)), 2);
        let mut bytes = vec![0u8; 64];
        assert_eq!(write_edits(&p.edits, &mut bytes), 32);
        assert_eq!(&bytes[16..20], &9u32.to_ne_bytes());
        assert_eq!(&bytes[24..28], &RowEdit::MASK.to_ne_bytes());
        assert_eq!(&bytes[28..32], &(-1.5f32).to_ne_bytes());

        // Grammar masks: one per masked row, ⌈vocab / 32⌉ words each (CAP's vocab is 50: 2).
        let mut m = ForwardBatch::default();
        let masked = |words: Vec<u32>| Draw {
            allowed: Some(words.into()),
            ..greedy.clone()
        };
        m.push_span(&[1], 0, vec![0], vec![0], SpanOutput::LastLogits);
        m.push_span(
            &[2],
            0,
            vec![4],
            vec![1],
            SpanOutput::Draw(masked(vec![5, 6])),
        );
        m.push_span(
            &[3],
            0,
            vec![8],
            vec![2],
            SpanOutput::Draw(masked(vec![7, 8])),
        );
        let p = PackedStep::pack(&m, &cap).expect("valid");
        assert_eq!(
            (p.masks_at, p.masks, p.mask_words),
            (vec![-1, 0, 1], vec![5, 6, 7, 8], 2)
        );
        let mut short = ForwardBatch::default();
        short.push_span(&[2], 0, vec![4], vec![1], SpanOutput::Draw(masked(vec![5])));
        assert_eq!(field(PackedStep::pack(&short, &cap)), "draw");

        // A verify span: each token's row drawn by its own rule; one rule per token.
        let mut v = ForwardBatch::default();
        let each = vec![greedy.clone(), random.clone(), greedy.clone()];
        v.push_span(
            &[1, 2, 3],
            0,
            vec![0, 1, 2],
            vec![0],
            SpanOutput::DrawEach(each),
        );
        let p = PackedStep::pack(&v, &cap).expect("valid");
        assert_eq!(p.sample_rows, [0, 1, 2]);
        assert_eq!(
            p.draw_modes,
            [DrawMode::Greedy, DrawMode::Random, DrawMode::Greedy]
        );
        assert_eq!(p.tops, [7, -1, 7]);
        let mut short = ForwardBatch::default();
        let one = vec![greedy.clone()];
        short.push_span(&[1, 2], 0, vec![0, 1], vec![0], SpanOutput::DrawEach(one));
        assert_eq!(field(PackedStep::pack(&short, &cap)), "draw");

        // A rule outside the kernel's ranges is refused before anything runs.
        let mut bad = ForwardBatch::default();
        let zero = Draw {
            rule: DrawRule::Random {
                temperature: 0.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
            },
            ..greedy
        };
        bad.push_span(&[1], 0, vec![0], vec![0], SpanOutput::Draw(zero));
        assert_eq!(field(PackedStep::pack(&bad, &CAP)), "draw");
    }

    fn field(r: Result<PackedStep>) -> String {
        match r {
            Err(ModelError::InvalidConfig { field, .. }) => field,
            Err(ModelError::TokenOutOfRange { .. }) => "token_ids".into(),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn every_bad_value_is_an_error() {
        let mut b = batch();
        b.token_ids[2] = 50;
        assert_eq!(field(PackedStep::pack(&b, &CAP)), "token_ids");

        let mut b = batch();
        b.slot_mapping[0] = 40;
        assert_eq!(field(PackedStep::pack(&b, &CAP)), "slot_mapping");

        let mut b = batch();
        b.seqs[0].block_table[2] = 10;
        assert_eq!(field(PackedStep::pack(&b, &CAP)), "block_tables");

        // A block id past the history is never read and not checked.
        let mut b = batch();
        b.seqs[1].block_table.push(99);
        PackedStep::pack(&b, &CAP).expect("unused table entries are ignored");

        let cap = StepCapacity {
            rope_positions: 8,
            ..CAP
        };
        assert_eq!(field(PackedStep::pack(&batch(), &cap)), "positions");

        let cap = StepCapacity {
            max_blocks_per_seq: 2,
            ..CAP
        };
        assert_eq!(field(PackedStep::pack(&batch(), &cap)), "block_tables");

        let cap = StepCapacity {
            max_tokens: 4,
            ..CAP
        };
        assert_eq!(field(PackedStep::pack(&batch(), &cap)), "forward_batch");

        let cap = StepCapacity { max_seqs: 1, ..CAP };
        assert_eq!(field(PackedStep::pack(&batch(), &cap)), "forward_batch");

        // Positions beyond the table: the CPU's own check.
        let mut b = batch();
        b.positions[3] = 12;
        assert_eq!(field(PackedStep::pack(&b, &CAP)), "forward_batch");
    }
}
