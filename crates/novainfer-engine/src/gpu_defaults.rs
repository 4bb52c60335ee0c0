//! Scheduling defaults on a GPU: what the operator did not set follows vLLM V1's defaults for
//! GPUs, by what the engine is for.
//!
//! The rule:
//! - **`max_num_seqs`**: 256 sequences a step. A decode step reads every weight once whatever
//!   its rows, so on a GPU the batch is what throughput is made of: aggregate decode grows
//!   almost linearly with it until the step turns compute-bound, far past the CPU's 64. The
//!   step's buffers grow with it (the sampled rows' logits: 256 × vocab × 4 bytes, 156 MB for
//!   Qwen2's vocabulary), small beside a GPU's memory.
//! - **`max_num_batched_tokens`**: 8192 tokens offline (the `LLM` class: throughput first; a
//!   step of 8192 prompt tokens keeps the tensor cores busy), 2048 serving (the HTTP server: a
//!   step that carries prompt chunks delays every stream's next token, and 2048 tokens keep that
//!   pause short). These are vLLM's `LLM_CLASS` and `OPENAI_API_SERVER` figures for GPUs other than
//!   its largest.
//! - **`long_prefill_token_threshold`**, **`max_long_partial_prefills`**: none (a GPU computes
//!   a step's prompt chunks in a fraction of a second: no request holds the engine for long).

/// What the engine is for, which decides the GPU's step budget (vLLM's `UsageContext`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Usage {
    /// Offline generation (`LLM(...)`, benchmarks): throughput first.
    #[default]
    Offline,
    /// An HTTP server: streams wait for every step, so steps stay short.
    Serving,
}

/// What the GPU rule fills in for the knobs left unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuDefaults {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// The GPU's sequences a step when unset.
pub const GPU_MAX_NUM_SEQS: usize = 256;

impl GpuDefaults {
    pub fn for_usage(usage: Usage) -> Self {
        Self {
            max_num_seqs: GPU_MAX_NUM_SEQS,
            max_num_batched_tokens: match usage {
                Usage::Offline => 8192,
                Usage::Serving => 2048,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_defaults::CpuDefaults;

    #[test]
    fn offline_steps_are_larger_than_serving_ones_and_seats_the_same() {
        let (offline, serving) = (
            GpuDefaults::for_usage(Usage::Offline),
            GpuDefaults::for_usage(Usage::Serving),
        );
        assert_eq!(
            (offline.max_num_seqs, offline.max_num_batched_tokens),
            (256, 8192)
        );
        assert_eq!(
            (serving.max_num_seqs, serving.max_num_batched_tokens),
            (256, 2048)
        );
        // Every step fits its seats' decodes.
        assert!(serving.max_num_batched_tokens >= serving.max_num_seqs);
    }

    #[test]
    fn the_cpu_rule_never_exceeds_either_gpu_rule() {
        // Step limits follow the GPU rule before an `auto` device may move the model to the
        // CPU: they must hold the CPU's steps whatever the usage.
        for usage in [Usage::Offline, Usage::Serving] {
            let gpu = GpuDefaults::for_usage(usage);
            for threads in [1, 2, 8, 64, 512] {
                let cpu = CpuDefaults::for_threads(threads);
                assert!(cpu.max_num_seqs <= gpu.max_num_seqs);
                assert!(cpu.max_num_batched_tokens <= gpu.max_num_batched_tokens);
            }
        }
    }
}
