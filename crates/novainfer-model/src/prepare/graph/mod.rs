//! CUDA graphs for decode, the host's half: everything about replaying captured decode steps
//! that needs no GPU, so the default test run checks it.
//!
//! A graph replays fixed launches over fixed addresses, so a captured step must read its
//! inputs from the same device buffer, in arrays of the same length, every time: a decode step
//! of `n` sequences is padded to the smallest captured batch size `≥ n` (its *bucket*) and
//! written in place into the step's metadata buffer, then the bucket's graph is replayed.
//!
//! * [`mode`]: whether graphs are on ([`CudaGraphs`]): off by default, on with
//!   `NOVAINFER_CUDA_GRAPHS=1`, always off with `enforce_eager`.
//! * [`buckets`]: the captured batch sizes for a `max_num_seqs`.
//! * [`route`]: per step, a graph (pure decode within the largest bucket) or the eager path.
//! * [`pad`]: a step padded to its bucket, and the byte sections a bucket's graph reads.
//! * [`order`]: the order of a replayed step's operations and of the captures at start-up,
//!   over a trait the CUDA executor implements.

pub mod buckets;
pub mod mode;
pub mod order;
pub mod pad;
pub mod route;

pub use buckets::{GraphBuckets, BUCKET_LADDER};
pub use mode::{CudaGraphs, GRAPHS_ENV};
pub use order::{capture_all, replay_step, GraphOps};
pub use pad::{capture_step, fits_bucket, pad_to_bucket, GraphSections};
pub use route::{route, EagerReason, StepRoute};
