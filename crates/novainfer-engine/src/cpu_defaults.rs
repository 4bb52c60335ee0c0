//! Scheduling defaults on the CPU, where a step that carries a prefill chunk takes seconds:
//! what the operator did not set is chosen so that no single request holds the engine.
//!
//! The rule:
//! - **`max_model_len`**: at most [`CPU_MAX_MODEL_LEN`] tokens by default. A full prompt then
//!   prefills in a minute or two on a few cores (the 0.5B model computes ~100 prompt tokens/s
//!   per 2 cores at 8k context), not the ten minutes of the model's 32k. An explicit
//!   `max_model_len` always wins.
//! - **`long_prefill_token_threshold`**: `128 × threads`, clamped to 256–2048 tokens: a step
//!   that carries a long prompt's chunk takes one to two seconds, so running streams keep
//!   getting a token every second or two, and ordinary chat prompts (a few hundred tokens)
//!   count as short: they are admitted whole beside the long one instead of queueing for its
//!   long-prefill slot.
//! - **`max_long_partial_prefills`**: 1. One long prompt is computed at a time; shorter ones
//!   overtake the rest (vLLM's rule).
//! - **`max_num_seqs`**: 64. On the CPU a decode row costs about a third of a one-row step
//!   (docs/benchmarks.md): batching's gain levels off after a few rows, and seats past a few
//!   dozen only lengthen every stream's step.
//! - **`max_num_batched_tokens`**: twice the long-prefill threshold, `256 × threads` clamped to
//!   512–2048 tokens. Short prompts are admitted whole, so with the GPU server's 2048 a burst of chat
//!   requests made one step of ~2000 prompt tokens: ~9 s on two cores for the 0.5B model, during
//!   which no stream got a token and every prompt of the step waited for the slowest's first
//!   token. With 512 a step takes about two seconds, first tokens come out a few prompts at a time,
//!   and the prompt work is the same (a 512-row product is as efficient per row as a 2048-row one).

/// The default context on the CPU.
pub const CPU_MAX_MODEL_LEN: usize = 8192;

/// The CPU's sequences a step when unset.
pub const CPU_MAX_NUM_SEQS: usize = 64;

/// What the CPU rule fills in for the knobs left unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDefaults {
    pub max_model_len_cap: usize,
    pub long_prefill_token_threshold: usize,
    pub max_long_partial_prefills: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

impl CpuDefaults {
    pub fn for_threads(threads: usize) -> Self {
        Self {
            max_model_len_cap: CPU_MAX_MODEL_LEN,
            long_prefill_token_threshold: (128 * threads).clamp(256, 2048),
            max_long_partial_prefills: 1,
            max_num_seqs: CPU_MAX_NUM_SEQS,
            max_num_batched_tokens: (256 * threads).clamp(512, 2048),
        }
    }

    /// For the threads the forward pass will use (`RAYON_NUM_THREADS`, else every core).
    pub fn for_this_machine() -> Self {
        let threads = std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1);
        Self::for_threads(threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_grows_with_threads_within_bounds() {
        let threshold = |threads| CpuDefaults::for_threads(threads).long_prefill_token_threshold;
        assert_eq!(
            [threshold(1), threshold(2), threshold(8), threshold(64)],
            [256, 256, 1024, 2048]
        );
    }

    #[test]
    fn the_step_budget_is_twice_the_threshold_and_never_above_the_gpu_servers() {
        for threads in [1, 2, 3, 8, 64] {
            let d = CpuDefaults::for_threads(threads);
            assert_eq!(
                d.max_num_batched_tokens,
                (2 * d.long_prefill_token_threshold).clamp(512, 2048)
            );
            // A short prompt (up to the threshold) fits a step whole.
            assert!(d.max_num_batched_tokens >= d.long_prefill_token_threshold);
            let serving = crate::gpu_defaults::GpuDefaults::for_usage(crate::Usage::Serving);
            assert!(d.max_num_batched_tokens <= serving.max_num_batched_tokens);
        }
        assert_eq!(CpuDefaults::for_threads(2).max_num_batched_tokens, 512);
    }
}
