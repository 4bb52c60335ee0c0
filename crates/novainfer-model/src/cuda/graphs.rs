//! Decode steps replayed from CUDA graphs: the device's half of [`crate::prepare::graph`]
//! (buckets, routing, padding and the order of operations live there, tested without a GPU).
//!
//! At start-up each bucket's forward (embedding, the layers, the final norm and the LM head
//! over `bucket` padded rows) is captured on the executor's one stream, reading the step's
//! metadata buffer at its fixed offsets and writing the activations it always writes; a
//! replay is one launch. What a capture fixes:
//!
//! * every device pointer: the activations, the metadata buffer, the KV pool, the decode
//!   scratch and the cuBLAS workspace (set once per handle, so cuBLAS allocates nothing
//!   while capturing) are allocated once, before any capture; each bucket's forward runs once
//!   eagerly first (`warm`), so a library's first call of a shape (cuBLASLt's heuristic and
//!   cached plan) happens outside the capture;
//! * every launch dimension: `bucket` rows; decode attention's grid has one z-block per
//!   possible split of the longest history the executor holds, and blocks past a row's own
//!   history return at once, so one graph serves every context length. A row's splits start
//!   at multiples of `ATTN_SPLIT` of its own history, whatever the batch, and the first
//!   phase's kernel choice (fixed here for one split's worth of history) never changes a bit;
//! * the GEMMs' algorithms for `m = bucket` rows. cuBLAS may sum a row differently for a
//!   different `m` (see `ops::gemm`), so a padded batch's logits may differ in the last bits
//!   from the eager step's over the unpadded rows: the GPU tests compare them within a
//!   tolerance and the greedy tokens exactly.
//!
//! The sampling tail (grammar masks, penalties, the draw, the copies back) runs eagerly after
//! the replay over the step's own rows: its launches depend on each step's sampling options.
//!
//! The graphs are captured after the KV pool is sized; they allocate no device memory of
//! their own beyond their executable form (logged at start-up with the capture time).

use std::collections::BTreeMap;
use std::time::Instant;

use novainfer_cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use novainfer_cuda::cudarc::driver::CudaGraph;
use novainfer_cuda::ops::paged_attention::ATTN_SPLIT;

use super::driver_error;
use super::forward::{
    enqueue_tail, read_tail, Attention, Body, Failure, Step, TailPassed, TailStaging,
};
use crate::error::{ModelError, Result};
use crate::prepare::graph::{capture_all, capture_step, GraphBuckets, GraphOps};
use crate::prepare::PackedStep;

/// One bucket's instantiated graph.
struct Captured(CudaGraph);

// SAFETY: a CUDA graph must not be used from two threads at once; `Captured` lives in the
// executor, which every call reaches through `&mut`, so one thread at a time uses it. Moving
// it to another thread (as the engine moves its executor) is what the driver allows.
unsafe impl Send for Captured {}

/// The captured decode graphs of one executor.
pub(crate) struct DecodeGraphs {
    pub buckets: GraphBuckets,
    graphs: BTreeMap<usize, Captured>,
    /// The history bound of the captured decode launches: the longest a step may have.
    max_seq_len: usize,
}

impl DecodeGraphs {
    /// Captures a graph per bucket over `step`'s buffers (the engine's pool) and logs what
    /// it cost. `max_rows` bounds the buckets (the step buffers' sequences and tokens);
    /// `max_seq_len` is the longest history a step may have.
    pub fn capture(step: Step<'_>, max_rows: usize, max_seq_len: usize) -> Result<Self> {
        let buckets = GraphBuckets::new(max_rows).ok_or_else(|| {
            ModelError::config("cuda graphs", "no sequences to capture a graph for")
        })?;
        let mut graphs = Self {
            buckets: buckets.clone(),
            graphs: BTreeMap::new(),
            max_seq_len,
        };
        let (gpu, device) = (step.gpu, step.device);
        let free_before = gpu.mem_info().ok().map(|(free, _)| free);
        let started = Instant::now();
        capture_all(
            &mut Runner {
                step,
                graphs: &mut graphs,
                wait: true,
            },
            &buckets,
        )?;
        let took = started.elapsed();
        let free_after = gpu.mem_info().ok().map(|(free, _)| free);
        let graph_mib = match (free_before, free_after) {
            (Some(before), Some(after)) => before.saturating_sub(after) as f64 / (1 << 20) as f64,
            _ => f64::NAN,
        };
        tracing::info!(
            %device,
            buckets = ?buckets.sizes(),
            capture_ms = took.as_secs_f64() * 1e3,
            graph_mib,
            "CUDA graphs captured for decode"
        );
        Ok(graphs)
    }
}

/// A step's buffers with the graphs: what [`GraphOps`] runs on.
pub(crate) struct Runner<'a> {
    pub step: Step<'a>,
    pub graphs: &'a mut DecodeGraphs,
    /// Whether `finish` waits for the tail and reads it ([`TailPassed::Done`]), or leaves
    /// its copies on their way ([`TailPassed::Reads`]: the executor reads them later).
    pub wait: bool,
}

impl Runner<'_> {
    /// The forward a bucket's graph holds (embedding, layers, final norm, LM head over `bucket`
    /// padded rows of the uploaded capture step), enqueued: run by `warm`, recorded by `capture`.
    fn bucket_forward(&mut self, bucket: usize) -> std::result::Result<(), Failure> {
        let s = &mut self.step;
        let padding = capture_step(bucket, s.meta.layout.max_blocks_per_seq);
        let views = s.meta.views(&padding)?;
        let mut body = Body {
            gpu: s.gpu,
            cfg: s.cfg,
            model: s.model,
            rope: s.rope,
            act: &mut *s.act,
            kv: &mut *s.kv,
            scratch: &mut *s.scratch,
            lora: None,
            linear: s.linear,
        };
        let attention = Attention::Decode {
            max_seq_len: self.graphs.max_seq_len,
            choose_for: ATTN_SPLIT,
        };
        body.layers(&views, bucket, attention)?;
        body.final_rows(&views, bucket, bucket)?;
        body.lm_head(bucket)
    }
}

impl GraphOps for Runner<'_> {
    type Error = ModelError;
    type Output = TailPassed;

    fn table_width(&self) -> usize {
        self.step.meta.layout.max_blocks_per_seq
    }

    fn upload(&mut self, step: &PackedStep) -> Result<()> {
        let s = &mut self.step;
        s.meta.write_and_copy(s.gpu, step, s.slot)?;
        s.meta.chain(s.gpu, step, &s.act.drawn_ids)
    }

    fn warm(&mut self, bucket: usize) -> Result<()> {
        let device = self.step.device;
        self.bucket_forward(bucket)
            .map_err(|e| e.into_model(device))
    }

    fn capture(&mut self, bucket: usize) -> Result<()> {
        let (gpu, device) = (self.step.gpu, self.step.device);
        let stream = gpu.stream();
        // Thread-local: only this thread's unsafe calls (an allocation) would break it.
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_error("cuStreamBeginCapture"))?;
        let recorded = self.bucket_forward(bucket);
        // Ended whatever happened, so the stream leaves capture mode before an error returns.
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("cuStreamEndCapture"));
        recorded.map_err(|e| e.into_model(device))?;
        let graph = graph?.ok_or_else(|| {
            ModelError::Cuda(format!("capturing bucket {bucket} recorded no work"))
        })?;
        graph.upload().map_err(driver_error("cuGraphUpload"))?;
        self.graphs.graphs.insert(bucket, Captured(graph));
        Ok(())
    }

    fn replay(&mut self, bucket: usize) -> Result<()> {
        let graph =
            self.graphs.graphs.get(&bucket).ok_or_else(|| {
                ModelError::Cuda(format!("no graph captured for bucket {bucket}"))
            })?;
        graph.0.launch().map_err(driver_error("cuGraphLaunch"))
    }

    fn finish(&mut self, step: &PackedStep) -> Result<TailPassed> {
        let s = &mut self.step;
        let views = s.meta.views(step)?;
        let device = s.device;
        let staging = TailStaging {
            edits: &mut *s.edits,
            masks: &mut *s.masks,
            slot: s.slot,
        };
        let reads = enqueue_tail(
            s.gpu,
            s.cfg,
            &mut *s.act,
            &mut *s.readback,
            staging,
            &views,
            step,
        )
        .map_err(|e| e.into_model(device))?;
        if !self.wait {
            return Ok(TailPassed::Reads(reads));
        }
        // Every copy of the tail was recorded on the stream; waiting for it covers them and
        // surfaces the kernels' own errors as this step's.
        s.gpu
            .synchronize()
            .map_err(|e| super::cuda_error(device, e))?;
        read_tail(s.cfg, &*s.readback, step, reads)
            .map(TailPassed::Done)
            .map_err(|e| e.into_model(device))
    }

    fn synchronize(&mut self) -> Result<()> {
        self.step
            .gpu
            .synchronize()
            .map_err(|e| super::cuda_error(self.step.device, e))
    }

    fn drain(&mut self) {
        let _ = self.step.gpu.synchronize();
    }

    fn unfit(&self, why: String) -> ModelError {
        ModelError::Cuda(why)
    }
}
