//! Speculative decoding: the configuration (vLLM's `speculative_config`) and the proposers
//! that draft tokens for the scheduler to verify ([`novainfer_core::Scheduler::set_draft`]):
//! prompt lookup (n-gram) and a draft model ([`crate::draft_model`]).
//!
//! Verification ([`crate::engine_core`]) samples each verified row with the request's own
//! sampler and stops at the first token that differs from the draft, so the output is the
//! one decoding without speculation gives, token for token, whatever the temperature; a
//! draft only saves forward passes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use novainfer_core::{NgramIndex, NgramRange, ParamError, Request, RequestId};
use serde_json::Value;

use crate::draft_model::DraftModel;
use crate::draft_policy::{Decoding, DraftPolicy};
use novainfer_model::{Capabilities, Qwen2Config};

/// How drafts are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// sequence's longest suffix n-gram.
    Ngram(NgramRange),
    /// A smaller model with the same tokenizer, decoding greedily (a checkpoint directory or
    /// GGUF file, loaded on the target's device).
    DraftModel { model: PathBuf },
}

/// How many tokens a step drafts for each request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DraftPolicyKind {
    /// As many as measured costs and each request's acceptance say pay ([`DraftPolicy`]):
    /// none when drafting would be slower than plain decoding.
    #[default]
    Adaptive,
    /// `num_speculative_tokens` every step (cut only by the step's room and the grammar):
    /// for tests, and for measuring what drafting costs.
    Always,
}

/// vLLM's `speculative_config`, checked, with NovaInfer's `draft_policy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Most draft tokens per request per step.
    pub num_speculative_tokens: usize,
    pub policy: DraftPolicyKind,
}

const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpeculativeConfig {
    /// From vLLM's JSON shape: `{"method": "ngram", "num_speculative_tokens": 4,
    /// "prompt_lookup_min": 2, "prompt_lookup_max": 5}` or `{"method": "draft_model", "model":
    /// "<path>", "num_speculative_tokens": 4}` (as in vLLM, `method` may be left out when `model`
    /// is given), plus NovaInfer's `"draft_policy"`: `"adaptive"` (default) or `"always"`.
    /// Errors name the field at fault.
    pub fn from_json(value: &Value) -> Result<Self, ParamError> {
        let err = |field: &str, why: String| {
            ParamError::new("speculative_config", format!("{field}: {why}"))
        };
        let obj = value
            .as_object()
            .ok_or_else(|| err("speculative_config", "must be a JSON object".into()))?;
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "method"
                    | "model"
                    | "num_speculative_tokens"
                    | "prompt_lookup_min"
                    | "prompt_lookup_max"
                    | "draft_policy"
            ) {
                return Err(err(
                    key,
                    "unknown field (known: method, model, num_speculative_tokens, \
                     prompt_lookup_min, prompt_lookup_max, draft_policy)"
                        .into(),
                ));
            }
        }
        let count = |field: &str, default: Option<usize>| -> Result<usize, ParamError> {
            match obj.get(field) {
                None => default.ok_or_else(|| err(field, "is required".into())),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| err(field, format!("must be a non-negative integer, got {v}"))),
            }
        };
        let model = match obj.get("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) if !m.is_empty() => Some(PathBuf::from(m)),
            Some(v) => return Err(err("model", format!("must be a path, got {v}"))),
        };
        let method_name = match (obj.get("method"), &model) {
            (Some(Value::String(m)), _) => m.as_str(),
            (None | Some(Value::Null), Some(_)) => "draft_model",
            (None | Some(Value::Null), None) => {
                return Err(err(
                    "method",
                    "is required (\"ngram\", or \"draft_model\" with a model)".into(),
                ))
            }
            (Some(v), _) => return Err(err("method", format!("must be a string, got {v}"))),
        };
        let method = match method_name {
            "ngram" => {
                if model.is_some() {
                    return Err(err(
                        "model",
                        "is for method \"draft_model\", not \"ngram\"".into(),
                    ));
                }
                let min = count("prompt_lookup_min", Some(2))?;
                let max = count("prompt_lookup_max", Some(min.max(5)))?;
                let range = NgramRange::new(min, max).ok_or_else(|| {
                    err(
                        "prompt_lookup_min",
                        format!(
                            "need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min} and {max}"
                        ),
                    )
                })?;
                SpeculativeMethod::Ngram(range)
            }
            "draft_model" => {
                for field in ["prompt_lookup_min", "prompt_lookup_max"] {
                    if obj.contains_key(field) {
                        return Err(err(field, "is for method \"ngram\"".into()));
                    }
                }
                let model = model
                    .ok_or_else(|| err("model", "is required for method \"draft_model\"".into()))?;
                SpeculativeMethod::DraftModel { model }
            }
            other => {
                return Err(err(
                    "method",
                    format!(
                        "{other:?} is not supported here (supported: \"ngram\", \"draft_model\")"
                    ),
                ))
            }
        };
        let k = count("num_speculative_tokens", None)?;
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(err(
                "num_speculative_tokens",
                format!("must be in 1..={MAX_SPECULATIVE_TOKENS}, got {k}"),
            ));
        }
        let policy = match obj.get("draft_policy") {
            None | Some(Value::Null) => DraftPolicyKind::Adaptive,
            Some(Value::String(p)) if p == "adaptive" => DraftPolicyKind::Adaptive,
            Some(Value::String(p)) if p == "always" => DraftPolicyKind::Always,
            Some(v) => {
                return Err(err(
                    "draft_policy",
                    format!("must be \"adaptive\" or \"always\", got {v}"),
                ))
            }
        };
        Ok(Self {
            method,
            num_speculative_tokens: k,
            policy,
        })
    }
}

/// Cuts `drafts` (in running order) to `room` tokens in all, one token per request per round,
/// so every request keeps a share.
pub fn share_room(drafts: &mut [Vec<u32>], room: usize) {
    let wanted: usize = drafts.iter().map(Vec::len).sum();
    if wanted <= room {
        return;
    }
    let mut keep = vec![0usize; drafts.len()];
    let mut left = room;
    while left > 0 {
        let mut gave = false;
        for (k, d) in keep.iter_mut().zip(drafts.iter()) {
            if left > 0 && *k < d.len() {
                *k += 1;
                left -= 1;
                gave = true;
            }
        }
        if !gave {
            break;
        }
    }
    for (d, k) in drafts.iter_mut().zip(keep) {
        d.truncate(k);
    }
}

/// Where drafts come from.
enum Source {
    /// Per request: its n-gram index (prompt and output so far).
    Ngram {
        range: NgramRange,
        indexes: HashMap<RequestId, NgramIndex>,
    },
    Draft(Box<DraftModel>),
}

/// Weights a token's forward pass reads (its matrix multiplications: attention, MLP, logits),
/// which on a CPU or a GPU alike set most of what a decode row or a prefill token costs.
fn weights_per_token(c: &Qwen2Config) -> f64 {
    let (h, kv) = (
        c.hidden_size as f64,
        (c.head_dim() * c.num_key_value_heads) as f64,
    );
    let layer = h * (h + 2.0 * kv) + h * h + 3.0 * h * c.intermediate_size as f64;
    c.num_hidden_layers as f64 * layer + c.vocab_size as f64 * h
}

/// What the draft model is assumed to cost relative to the target until measured.
pub fn draft_cost_share(draft: &Qwen2Config, target: &Qwen2Config) -> f64 {
    (weights_per_token(draft) / weights_per_token(target).max(1.0)).clamp(0.01, 1.0)
}

/// Drafts for the running requests, kept up to date as their tokens arrive, sized by what
/// drafting has been measured to cost and each request's recent acceptance (adaptive k).
pub struct Proposer {
    source: Source,
    policy: DraftPolicy,
}

impl Proposer {
    /// `draft` is the loaded draft model when the method is [`SpeculativeMethod::DraftModel`];
    /// `backend` (what a step's extra row is assumed to cost, until measured) and `target` are
    /// the target's.
    pub fn new(
        config: &SpeculativeConfig,
        draft: Option<DraftModel>,
        backend: &Capabilities,
        target: &Qwen2Config,
    ) -> Self {
        let source = match (&config.method, draft) {
            (_, Some(draft)) => Source::Draft(Box::new(draft)),
            (SpeculativeMethod::Ngram(range), None) => Source::Ngram {
                range: *range,
                indexes: HashMap::new(),
            },
            (SpeculativeMethod::DraftModel { .. }, None) => {
                unreachable!("the engine loads the draft model of a draft_model config")
            }
        };
        let draft_share = match &source {
            Source::Draft(draft) => Some(draft_cost_share(draft.config(), target)),
            Source::Ngram { .. } => None,
        };
        let policy = DraftPolicy::new(
            config.num_speculative_tokens,
            config.policy,
            backend.assumed_row_share,
            draft_share,
        );
        Self { source, policy }
    }

    /// What the verification of `id`'s draft of `drafted` tokens confirmed.
    pub fn record(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        self.policy.record(id, drafted, accepted);
    }

    /// A pure decode step of the target over `rows` rows (decodes and draft tokens) took
    /// `seconds`.
    pub fn observe_step(&mut self, rows: usize, seconds: f64) {
        self.policy.observe_step(rows, seconds);
    }

    /// Drafts to follow each request's tokens so far, in order (empty: nothing to propose),
    /// `room` draft tokens at most in all. A draft model that fails leaves the step without
    /// drafts: speculation only saves work, so its failure must not fail requests.
    pub fn propose(&mut self, requests: &[&Request], room: usize) -> Vec<Vec<u32>> {
        let decoding: Vec<Decoding> = requests
            .iter()
            .map(|r| Decoding {
                id: r.id,
                catch_up: match &self.source {
                    Source::Draft(draft) => draft.catch_up(r),
                    Source::Ngram { .. } => 0,
                },
                remaining: r.max_tokens.saturating_sub(r.output_token_ids.len()),
            })
            .collect();
        let lengths = self.policy.plan(&decoding, room);
        let wants: Vec<(&Request, usize)> = requests.iter().copied().zip(lengths).collect();
        match &mut self.source {
            Source::Ngram { range, indexes } => wants
                .iter()
                .map(|&(request, k)| {
                    let index = indexes
                        .entry(request.id)
                        .or_insert_with(|| NgramIndex::new(*range));
                    // Catch up with what arrived since the last step (a whole prompt the
                    // first time).
                    if index.tokens().len() > request.num_tokens() {
                        *index = NgramIndex::new(*range);
                    }
                    let known = index.tokens().len();
                    index.extend(&request.token_ids(known..request.num_tokens()));
                    index.propose(k)
                })
                .collect(),
            Source::Draft(draft) => {
                if wants.iter().all(|&(_, k)| k == 0) {
                    return vec![Vec::new(); requests.len()];
                }
                let started = Instant::now();
                match draft.propose(&wants) {
                    Ok((drafts, work)) => {
                        self.policy
                            .observe_draft(work, started.elapsed().as_secs_f64());
                        drafts
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the draft model failed; no drafts this step");
                        vec![Vec::new(); requests.len()]
                    }
                }
            }
        }
    }

    /// Keeps the state of requests for which `alive` holds.
    pub fn retain(&mut self, mut alive: impl FnMut(RequestId) -> bool) {
        self.policy.retain(&mut alive);
        match &mut self.source {
            Source::Ngram { indexes, .. } => indexes.retain(|id, _| alive(*id)),
            Source::Draft(draft) => draft.retain(alive),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_config_reads_vllms_shape_and_names_bad_fields() {
        let c =
            SpeculativeConfig::from_json(&json!({"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5}))
            .expect("valid");
        assert_eq!(c.num_speculative_tokens, 4);
        assert_eq!(c.policy, DraftPolicyKind::Adaptive);
        let always = SpeculativeConfig::from_json(
            &json!({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "always"}),
        )
        .expect("valid");
        assert_eq!(always.policy, DraftPolicyKind::Always);
        assert_eq!(
            c.method,
            SpeculativeMethod::Ngram(NgramRange::new(2, 5).expect("valid"))
        );
        for (bad, field) in [
            (
                json!({"method": "eagle", "num_speculative_tokens": 2}),
                "method",
            ),
            (json!({"num_speculative_tokens": 2}), "method"),
            (json!({"method": "ngram"}), "num_speculative_tokens"),
            (
                json!({"method": "ngram", "num_speculative_tokens": 0}),
                "num_speculative_tokens",
            ),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                "prompt_lookup_max": 3}),
                "prompt_lookup_min",
            ),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}),
                "typo",
            ),
            (json!([1]), "speculative_config"),
            (
                json!({"method": "draft_model", "num_speculative_tokens": 2}),
                "model",
            ),
            (
                json!({"method": "ngram", "model": "m", "num_speculative_tokens": 2}),
                "model",
            ),
            (
                json!({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 2}),
                "prompt_lookup_min",
            ),
            (json!({"model": 3, "num_speculative_tokens": 2}), "model"),
            (
                json!({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "never"}),
                "draft_policy",
            ),
        ] {
            let e = SpeculativeConfig::from_json(&bad).expect_err("refused");
            assert_eq!(e.param, "speculative_config");
            assert!(e.to_string().contains(field), "{e} should name {field}");
        }
    }

    #[test]
    fn drafts_share_the_room_one_token_a_round() {
        let mut drafts = vec![vec![1, 2, 3, 4], vec![5], vec![6, 7, 8]];
        share_room(&mut drafts, 5);
        assert_eq!(drafts, vec![vec![1, 2], vec![5], vec![6, 7]]);
        share_room(&mut drafts, 0);
        assert!(drafts.iter().all(Vec::is_empty));
        let mut few = vec![vec![1], vec![2]];
        share_room(&mut few, 8);
        assert_eq!(few, vec![vec![1], vec![2]]);
    }

    #[test]
    fn a_draft_model_config_needs_a_model_and_may_leave_out_the_method() {
        for value in [
            json!({"method": "draft_model", "model": "/m/small.gguf", "num_speculative_tokens": 3}),
            json!({"model": "/m/small.gguf", "num_speculative_tokens": 3}),
        ] {
            let c = SpeculativeConfig::from_json(&value).expect("valid");
            assert_eq!(
                c.method,
                SpeculativeMethod::DraftModel {
                    model: PathBuf::from("/m/small.gguf")
                }
            );
            assert_eq!(c.num_speculative_tokens, 3);
        }
    }

    #[test]
    fn the_proposer_follows_a_request_as_its_tokens_arrive() {
        let config = SpeculativeConfig {
            method: SpeculativeMethod::Ngram(NgramRange::new(2, 3).expect("valid")),
            num_speculative_tokens: 3,
            policy: DraftPolicyKind::Adaptive,
        };
        let target = Qwen2Config {
            vocab_size: 100,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            max_position_embeddings: 64,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        let mut p = Proposer::new(&config, None, &novainfer_model::capabilities::CPU, &target);
        let mut r = Request::new(RequestId(1), vec![5, 6, 7, 8, 9, 5, 6], 10);
        assert_eq!(p.propose(&[&r], 8), vec![vec![7, 8, 9]]);
        r.output_token_ids.extend([7, 1]);
        assert_eq!(p.propose(&[&r], 8), vec![Vec::<u32>::new()]);
        p.retain(|_| false);
        let Source::Ngram { indexes, .. } = &p.source else {
            panic!("an n-gram proposer")
        };
        assert!(indexes.is_empty());
    }
}
