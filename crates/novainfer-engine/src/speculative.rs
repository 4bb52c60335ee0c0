//! Speculative decoding: the configuration (vLLM's `speculative_config`, [`crate::spec_config`])
//! and the proposer it asks for ([`proposer`]), which drafts tokens for the scheduler to verify
//! ([`novainfer_core::Scheduler::set_draft`]): prompt lookup ([`NgramProposer`]) or a draft
//! model ([`DraftModelProposer`]), behind the [`Proposer`] trait the step loop drives.
//!
//! Verification ([`crate::engine_core`]) samples each verified row with the request's own
//! sampler and stops at the first token that differs from the draft, so the output is the
//! one decoding without speculation gives, token for token, whatever the temperature; a
//! draft only saves forward passes.

use novainfer_model::{Capabilities, Qwen2Config};

use crate::draft_model::DraftModel;
use crate::draft_policy::DraftPolicy;
use crate::draft_proposer::{draft_cost_share, DraftModelProposer};
use crate::ngram_proposer::NgramProposer;
use crate::proposer::Proposer;
pub use crate::spec_config::{DraftPolicyKind, SpeculativeConfig, SpeculativeMethod};

/// The proposer `config` asks for. `draft` is the loaded draft model when the method is
/// [`SpeculativeMethod::DraftModel`]; `backend` (what a step's extra row is assumed to cost, until measured) and
/// `target` are the target's.
pub fn proposer(
    config: &SpeculativeConfig,
    draft: Option<DraftModel>,
    backend: &Capabilities,
    target: &Qwen2Config,
) -> Box<dyn Proposer> {
    let policy = |draft_share| {
        DraftPolicy::new(
            config.num_speculative_tokens,
            config.policy,
            backend.assumed_row_share,
            draft_share,
        )
    };
    match (&config.method, draft) {
        (SpeculativeMethod::Ngram(range), _) => Box::new(NgramProposer::new(*range, policy(None))),
        (SpeculativeMethod::DraftModel { .. }, Some(draft)) => {
            let share = draft_cost_share(draft.config(), target);
            Box::new(DraftModelProposer::new(draft, policy(Some(share))))
        }
        (SpeculativeMethod::DraftModel { .. }, None) => {
            unreachable!("the engine loads the draft model of a draft_model config")
        }
    }
}
