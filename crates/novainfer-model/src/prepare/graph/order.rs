//! The order of a replayed decode step's operations and of the captures at start-up, over
//! [`GraphOps`], which the CUDA executor implements on its stream (and the tests with a log).
//!
//! One stream carries everything, so stream order is the only synchronisation on the device.
//! What the host must order itself is the pinned staging buffer: a step's metadata is written
//! there and copied to the device asynchronously, so it must not be written again until that
//! copy has run. Every step therefore ends with a wait on the stream ([`GraphOps::finish`]
//! reads its results back; a failed step [`GraphOps::drain`]s), and at start-up each capture
//! step's upload is waited for before the next one is written.
//!
//! ```text
//! step:     pad → upload (write staging, H2D copy) → replay(bucket) → finish (sampling tail,
//!           D2H copies, wait, read)                      on error: drain (wait), then the error
//! start-up: for each bucket, largest first: upload(capture step) → synchronize → capture
//!           then for each bucket: upload(capture step) → replay → synchronize   (warm-up)
//! ```

use super::buckets::GraphBuckets;
use super::pad::{capture_step, pad_to_bucket};
use crate::prepare::PackedStep;

/// What a decode graph runner does on its device, in the order [`replay_step`] and
/// [`capture_all`] call it.
pub trait GraphOps {
    type Error;
    type Output;
    /// Block-table entries a sequence's row holds (the layout's `max_blocks_per_seq`).
    fn table_width(&self) -> usize;
    /// Writes `step` to the staging buffer and enqueues its copy to the device.
    fn upload(&mut self, step: &PackedStep) -> Result<(), Self::Error>;
    /// Runs the forward of `bucket` padded rows eagerly, as `capture` will record it: whatever a
    /// library does on a shape's first call (a GEMM heuristic, a plan cached) is done outside
    /// the capture, and a launch that cannot run fails here with its own error.
    fn warm(&mut self, bucket: usize) -> Result<(), Self::Error>;
    /// Records the forward of `bucket` padded rows into that bucket's graph (not run).
    fn capture(&mut self, bucket: usize) -> Result<(), Self::Error>;
    /// Enqueues `bucket`'s graph.
    fn replay(&mut self, bucket: usize) -> Result<(), Self::Error>;
    /// Enqueues the sampling tail over `step`'s own rows and the copies back, waits for the
    /// stream and reads the results.
    fn finish(&mut self, step: &PackedStep) -> Result<Self::Output, Self::Error>;
    /// Waits for the stream.
    fn synchronize(&mut self) -> Result<(), Self::Error>;
    /// Waits for the stream after a failure (its own error is the first one's consequence).
    fn drain(&mut self);
    /// The error for a step that cannot be replayed (a routing bug).
    fn unfit(&self, why: String) -> Self::Error;
}

/// Runs decode `step` (routed to `bucket`) by replaying the bucket's graph.
pub fn replay_step<O: GraphOps>(
    ops: &mut O,
    step: &PackedStep,
    bucket: usize,
) -> Result<O::Output, O::Error> {
    let Some(padded) = pad_to_bucket(step, bucket, ops.table_width()) else {
        return Err(ops.unfit(format!(
            "a step of {} sequences (decode only: {}) cannot replay the graph of bucket {bucket}",
            step.num_seqs(),
            step.decode_only
        )));
    };
    let result = ops
        .upload(&padded)
        .and_then(|()| ops.replay(bucket))
        .and_then(|()| ops.finish(step));
    if result.is_err() {
        ops.drain();
    }
    result
}

/// Captures a graph per bucket, largest first (the largest is the likeliest to fail for want
/// of memory, before the others have cost time), each after one eager run of the same forward
/// (`warm`), then replays each once on its inert capture step: a graph that cannot run fails
/// here, not in a request, and the first replay's setup is paid at start-up.
pub fn capture_all<O: GraphOps>(ops: &mut O, buckets: &GraphBuckets) -> Result<(), O::Error> {
    let width = ops.table_width();
    let result = (|| {
        for &bucket in buckets.sizes().iter().rev() {
            ops.upload(&capture_step(bucket, width))?;
            ops.warm(bucket)?;
            ops.synchronize()?;
            ops.capture(bucket)?;
        }
        for &bucket in buckets.sizes() {
            ops.upload(&capture_step(bucket, width))?;
            ops.replay(bucket)?;
            ops.synchronize()?;
        }
        Ok(())
    })();
    if result.is_err() {
        ops.drain();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward_batch::ForwardBatch;
    use crate::prepare::StepCapacity;

    #[derive(Debug, Clone, PartialEq)]
    enum Op {
        Upload { seqs: usize },
        Warm(usize),
        Capture(usize),
        Replay(usize),
        Finish { seqs: usize },
        Synchronize,
        Drain,
    }

    /// Logs each call and checks the staging rule: no upload while the last one's copy may
    /// still be in flight. `fail` makes the named call fail.
    #[derive(Default)]
    struct Log {
        ops: Vec<Op>,
        copy_in_flight: bool,
        captured: Vec<usize>,
        fail: Option<Op>,
    }

    impl Log {
        fn check(&mut self, op: Op) -> Result<(), String> {
            self.ops.push(op.clone());
            if self.fail.as_ref() == Some(&op) {
                return Err(format!("{op:?} failed"));
            }
            Ok(())
        }
    }

    impl GraphOps for Log {
        type Error = String;
        type Output = usize;
        fn table_width(&self) -> usize {
            2
        }
        fn upload(&mut self, step: &PackedStep) -> Result<(), String> {
            assert!(
                !self.copy_in_flight,
                "staging rewritten under a copy: {:?}",
                self.ops
            );
            self.copy_in_flight = true;
            self.check(Op::Upload {
                seqs: step.num_seqs(),
            })
        }
        fn warm(&mut self, bucket: usize) -> Result<(), String> {
            self.check(Op::Warm(bucket))
        }
        fn capture(&mut self, bucket: usize) -> Result<(), String> {
            self.check(Op::Capture(bucket))?;
            self.captured.push(bucket);
            Ok(())
        }
        fn replay(&mut self, bucket: usize) -> Result<(), String> {
            assert!(
                self.captured.contains(&bucket),
                "replay of an uncaptured bucket"
            );
            self.check(Op::Replay(bucket))
        }
        fn finish(&mut self, step: &PackedStep) -> Result<usize, String> {
            self.check(Op::Finish {
                seqs: step.num_seqs(),
            })?;
            self.copy_in_flight = false;
            Ok(step.num_seqs())
        }
        fn synchronize(&mut self) -> Result<(), String> {
            self.check(Op::Synchronize)?;
            self.copy_in_flight = false;
            Ok(())
        }
        fn drain(&mut self) {
            self.ops.push(Op::Drain);
            self.copy_in_flight = false;
        }
        fn unfit(&self, why: String) -> String {
            why
        }
    }

    fn decode(n: usize) -> PackedStep {
        let cap = StepCapacity {
            vocab_size: 50,
            rope_positions: 64,
            num_blocks: 10,
            block_size: 4,
            max_blocks_per_seq: 2,
            max_tokens: 8,
            max_seqs: 8,
        };
        let mut b = ForwardBatch::default();
        for i in 0..n {
            b.push(&[7], 5, vec![4 + i], vec![0, 1], true);
        }
        PackedStep::pack(&b, &cap).expect("valid")
    }

    fn captured(buckets: &GraphBuckets) -> Log {
        let mut log = Log::default();
        capture_all(&mut log, buckets).expect("captured");
        log.ops.clear();
        log
    }

    #[test]
    fn start_up_captures_largest_first_then_warms_each_graph() {
        let buckets = GraphBuckets::new(4).expect("rows");
        let mut log = Log::default();
        capture_all(&mut log, &buckets).expect("captured");
        use Op::*;
        assert_eq!(
            log.ops,
            [
                Upload { seqs: 4 },
                Warm(4),
                Synchronize,
                Capture(4),
                Upload { seqs: 2 },
                Warm(2),
                Synchronize,
                Capture(2),
                Upload { seqs: 1 },
                Warm(1),
                Synchronize,
                Capture(1),
                Upload { seqs: 1 },
                Replay(1),
                Synchronize,
                Upload { seqs: 2 },
                Replay(2),
                Synchronize,
                Upload { seqs: 4 },
                Replay(4),
                Synchronize,
            ]
        );
    }

    #[test]
    fn a_step_uploads_its_padded_rows_replays_then_samples_its_own() {
        let buckets = GraphBuckets::new(4).expect("rows");
        let mut log = captured(&buckets);
        assert_eq!(replay_step(&mut log, &decode(3), 4), Ok(3));
        // A second step right after: its upload finds the first step's copy done.
        assert_eq!(replay_step(&mut log, &decode(1), 1), Ok(1));
        use Op::*;
        assert_eq!(
            log.ops,
            [
                Upload { seqs: 4 },
                Replay(4),
                Finish { seqs: 3 },
                Upload { seqs: 1 },
                Replay(1),
                Finish { seqs: 1 },
            ]
        );
    }

    #[test]
    fn a_failed_replay_drains_the_stream_before_the_next_step() {
        let buckets = GraphBuckets::new(4).expect("rows");
        let mut log = captured(&buckets);
        log.fail = Some(Op::Replay(2));
        assert_eq!(
            replay_step(&mut log, &decode(2), 2),
            Err("Replay(2) failed".to_owned())
        );
        assert_eq!(log.ops.last(), Some(&Op::Drain));
        log.fail = None;
        assert_eq!(
            replay_step(&mut log, &decode(2), 2),
            Ok(2),
            "no copy left in flight"
        );
    }

    #[test]
    fn a_failed_capture_stops_start_up_and_drains() {
        let buckets = GraphBuckets::new(4).expect("rows");
        let mut log = Log {
            fail: Some(Op::Capture(2)),
            ..Log::default()
        };
        assert!(capture_all(&mut log, &buckets).is_err());
        assert!(
            !log.ops.contains(&Op::Capture(1)),
            "no capture after a failure"
        );
        assert_eq!(log.ops.last(), Some(&Op::Drain));
    }

    #[test]
    fn a_step_that_does_not_fit_its_bucket_is_refused_before_any_upload() {
        let buckets = GraphBuckets::new(4).expect("rows");
        let mut log = captured(&buckets);
        let e = replay_step(&mut log, &decode(3), 2).expect_err("too big");
        assert!(e.contains("bucket 2"), "{e}");
        assert!(log.ops.is_empty());
    }
}
