//! Scheduler limits, valid by construction.
//!
//! Beyond per-field ranges, one cross-field rule: one request of `max_model_len`
//! tokens must fit the pool on its own. That is what guarantees progress: the
//! oldest running request can always preempt everyone else and still grow.

use super::policy::SchedulingPolicy;
use crate::builder::setter;
use crate::kv_manager::KvLayout;
use crate::sampling_params::ParamError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    max_model_len: usize,
    block_size: usize,
    num_blocks: usize,
    enable_prefix_caching: bool,
    long_prefill_token_threshold: Option<usize>,
    max_num_partial_prefills: Option<usize>,
    max_long_partial_prefills: Option<usize>,
    max_scored_tokens_per_step: usize,
    kv_layout: KvLayout,
    policy: SchedulingPolicy,
    priority_aging_steps: usize,
    max_loras: Option<usize>,
}

impl SchedulerConfig {
    pub fn builder() -> SchedulerConfigBuilder {
        SchedulerConfigBuilder::default()
    }
    /// Token budget of one step (all chunks and decodes together).
    pub fn max_num_batched_tokens(&self) -> usize {
        self.max_num_batched_tokens
    }
    /// Most requests running at once.
    pub fn max_num_seqs(&self) -> usize {
        self.max_num_seqs
    }
    /// Prompt + output limit of one request.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn enable_prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }
    /// Most tokens one request may compute in a step (caps prefill chunks), if set.
    pub fn long_prefill_token_threshold(&self) -> Option<usize> {
        self.long_prefill_token_threshold
    }
    /// Most requests admitted while their prompt is still being computed, if set (vLLM's
    /// `max_num_partial_prefills`).
    pub fn max_num_partial_prefills(&self) -> Option<usize> {
        self.max_num_partial_prefills
    }
    /// Most of those whose prompt is longer than `long_prefill_token_threshold`, if set (vLLM's
    /// `max_long_partial_prefills`): past it, a short prompt is admitted ahead of a long one.
    pub fn max_long_partial_prefills(&self) -> Option<usize> {
        self.max_long_partial_prefills
    }
    /// Most prompt tokens being scored (each one a full-vocabulary logits row) in a step.
    pub fn max_scored_tokens_per_step(&self) -> usize {
        self.max_scored_tokens_per_step
    }
    /// BLOCK (blocks of `block_size`) or SLOT (cells: `block_size` is 1).
    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }
    /// FCFS or priority order (see [`SchedulingPolicy`]).
    pub fn policy(&self) -> SchedulingPolicy {
        self.policy
    }
    /// Under the priority policy, steps after which a waiting request counts one priority
    /// level better (aging, so that nothing waits forever).
    pub fn priority_aging_steps(&self) -> usize {
        self.priority_aging_steps
    }
    /// Most distinct LoRA adapters among the running requests, if set (vLLM's `max_loras`):
    /// a waiting request on another adapter waits, and requests behind it may go first.
    pub fn max_loras(&self) -> Option<usize> {
        self.max_loras
    }
}

/// Raw values with vLLM-like defaults; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
pub struct SchedulerConfigBuilder {
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    max_model_len: usize,
    block_size: usize,
    num_blocks: usize,
    enable_prefix_caching: bool,
    long_prefill_token_threshold: Option<usize>,
    max_num_partial_prefills: Option<usize>,
    max_long_partial_prefills: Option<usize>,
    max_scored_tokens_per_step: usize,
    kv_layout: KvLayout,
    policy: SchedulingPolicy,
    priority_aging_steps: usize,
    max_loras: Option<usize>,
}

impl Default for SchedulerConfigBuilder {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 4096,
            block_size: 16,
            num_blocks: 1024,
            enable_prefix_caching: true,
            long_prefill_token_threshold: None,
            max_num_partial_prefills: None,
            max_long_partial_prefills: None,
            // 64 rows of a 152k vocabulary are 39 MB of f32 logits: bounded memory per step,
            // and a scoring chunk costs running streams about one prefill chunk's lm_head.
            max_scored_tokens_per_step: 64,
            kv_layout: KvLayout::Block,
            policy: SchedulingPolicy::Fcfs,
            // About 5 s of a GPU's decode steps, a minute or more of a CPU's, per level: an
            // explicit priority rules for a while, and a difference of a few levels is made up
            // within minutes.
            priority_aging_steps: 256,
            max_loras: None,
        }
    }
}

impl SchedulerConfigBuilder {
    setter!(max_num_batched_tokens: usize);
    setter!(max_num_seqs: usize);
    setter!(max_model_len: usize);
    setter!(block_size: usize);
    setter!(num_blocks: usize);
    setter!(enable_prefix_caching: bool);
    setter!(long_prefill_token_threshold: Option<usize>);
    setter!(max_num_partial_prefills: Option<usize>);
    setter!(max_long_partial_prefills: Option<usize>);
    setter!(max_scored_tokens_per_step: usize);
    setter!(kv_layout: KvLayout);
    setter!(policy: SchedulingPolicy);
    setter!(priority_aging_steps: usize);
    setter!(max_loras: Option<usize>);

    pub fn build(self) -> Result<SchedulerConfig, ParamError> {
        let at_least = |param: &'static str, value: usize, min: usize| {
            if value < min {
                Err(ParamError::new(
                    param,
                    format!("must be >= {min}, got {value}"),
                ))
            } else {
                Ok(())
            }
        };
        at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)?;
        at_least("max_num_seqs", self.max_num_seqs, 1)?;
        // A prompt needs at least one token and room for one output token.
        at_least("max_model_len", self.max_model_len, 2)?;
        at_least("block_size", self.block_size, 1)?;
        at_least("num_blocks", self.num_blocks, 1)?;
        at_least(
            "max_scored_tokens_per_step",
            self.max_scored_tokens_per_step,
            1,
        )?;
        at_least("priority_aging_steps", self.priority_aging_steps, 1)?;
        if let Some(t) = self.long_prefill_token_threshold {
            at_least("long_prefill_token_threshold", t, 1)?;
        }
        if let Some(n) = self.max_loras {
            at_least("max_loras", n, 1)?;
        }
        if let Some(n) = self.max_num_partial_prefills {
            at_least("max_num_partial_prefills", n, 1)?;
        }
        if let Some(n) = self.max_long_partial_prefills {
            at_least("max_long_partial_prefills", n, 1)?;
            if self.long_prefill_token_threshold.is_none() {
                return Err(ParamError::new(
                    "max_long_partial_prefills",
                    "needs long_prefill_token_threshold, which says which prompts are long"
                        .to_owned(),
                ));
            }
        }
        if self.num_blocks >= u32::MAX as usize {
            return Err(ParamError::new(
                "num_blocks",
                format!("must be < {}, got {}", u32::MAX, self.num_blocks),
            ));
        }
        if self.kv_layout == KvLayout::Slot && self.block_size != 1 {
            return Err(ParamError::new(
                "block_size",
                format!(
                    "kv_layout=slot stores one token per cell: block_size must be 1, got {}",
                    self.block_size
                ),
            ));
        }
        let needed = self.max_model_len.div_ceil(self.block_size);
        if self.num_blocks < needed {
            return Err(ParamError::new(
                "num_blocks",
                format!(
                    "one max_model_len={} sequence needs {needed} blocks of {} tokens, got {}",
                    self.max_model_len, self.block_size, self.num_blocks
                ),
            ));
        }
        Ok(SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            enable_prefix_caching: self.enable_prefix_caching,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            max_num_partial_prefills: self.max_num_partial_prefills,
            max_long_partial_prefills: self.max_long_partial_prefills,
            max_scored_tokens_per_step: self.max_scored_tokens_per_step,
            kv_layout: self.kv_layout,
            policy: self.policy,
            priority_aging_steps: self.priority_aging_steps,
            max_loras: self.max_loras,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_value_names_its_field() {
        let b = SchedulerConfig::builder;
        let param = |b: SchedulerConfigBuilder| b.build().expect_err("accepted a bad value").param;
        assert_eq!(
            param(b().max_num_batched_tokens(0)),
            "max_num_batched_tokens"
        );
        assert_eq!(param(b().max_num_seqs(0)), "max_num_seqs");
        assert_eq!(param(b().max_model_len(1)), "max_model_len");
        assert_eq!(param(b().block_size(0)), "block_size");
        assert_eq!(
            param(b().long_prefill_token_threshold(Some(0))),
            "long_prefill_token_threshold"
        );
        let err = b()
            .max_model_len(100)
            .block_size(16)
            .num_blocks(6)
            .build()
            .unwrap_err();
        assert_eq!(err.param, "num_blocks");
        assert!(err.to_string().contains("needs 7 blocks"), "{err}");
        assert_eq!(
            param(b().max_num_partial_prefills(Some(0))),
            "max_num_partial_prefills"
        );
        assert_eq!(
            param(b().max_long_partial_prefills(Some(1))),
            "max_long_partial_prefills"
        );
        assert_eq!(
            param(b().max_scored_tokens_per_step(0)),
            "max_scored_tokens_per_step"
        );
        assert_eq!(param(b().kv_layout(KvLayout::Slot)), "block_size");
        assert_eq!(param(b().priority_aging_steps(0)), "priority_aging_steps");
        assert_eq!(param(b().max_loras(Some(0))), "max_loras");
        assert!(b()
            .kv_layout(KvLayout::Slot)
            .block_size(1)
            .num_blocks(4096)
            .build()
            .is_ok());
        assert!(b()
            .max_model_len(96)
            .block_size(16)
            .num_blocks(6)
            .build()
            .is_ok());
    }
}
