//! Host-side preparation for a device executor, kept free of any GPU so that the default
//! (CPU-only) test run checks it: what the CUDA executor uploads and how it lays it out.
//!
//! * [`dequant`]: the CPU twin of the device's GGUF → bf16 expansion, bit for bit.
//! * [`matrix`]: weight matrices as stacks of row blocks (fused QKV, fused gate|up), each
//!   block raw GGUF bytes or bf16, and their host assembly (the device's layout).
//! * [`reader`]: the checkpoint read layer by layer with the CPU builder's name and shape
//!   checks, into those matrices.
//! * [`graph`]: CUDA graphs for decode on the host's side: buckets, routing, padding and
//!   the order of a replayed step.
//! * [`step`]: one [`ForwardBatch`](crate::ForwardBatch) turned into the flat arrays the
//!   kernels read, validated against the pool, the RoPE table and the buffers.

pub mod dequant;
pub mod graph;
pub mod linear;
pub mod matrix;
pub mod reader;
pub mod step;

pub use dequant::{dequantize_bf16, ggml_of, gpu_quant_of, GpuQuant, GGUF_KINDS};
pub use matrix::{HostMatrix, InputOrder, MatrixPart, PartData};
pub use reader::{HostLayer, HostModelReader};
pub use step::{write_edits, MixedSteps, PackedStep, StepAttention, StepCapacity, StepLayout};
