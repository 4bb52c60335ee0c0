//! A generation request checked against the model once, where it enters the engine.
//!
//! Every way in (the Python `LLM`, the server's endpoints, the engine's own tests) used to
//! call `Frontend::max_new_tokens` itself, and the engine thread called it again, so the
//! limits were checked in four places and the number of tokens a request may generate was
//! worked out twice. A [`CheckedRequest`] can only be made by [`Frontend::check_request`]:
//! holding one is the proof that its prompt is in the vocabulary, that it leaves room in the
//! context for the tokens it asks for, and that its output constraint compiled. The engine
//! takes nothing else, so none of this is checked again after it.

use std::sync::Arc;

use novainfer_core::SamplingParams;
use novainfer_structured::CompiledGrammar;

use crate::engine::Frontend;
use crate::error::Result;

/// A prompt and its parameters that passed [`Frontend::check_request`].
#[derive(Debug, Clone)]
pub struct CheckedRequest {
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    max_tokens: usize,
    grammar: Option<Arc<CompiledGrammar>>,
}

impl CheckedRequest {
    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The most tokens each completion may generate: `max_tokens`, or all the room the
    /// context has left after the prompt.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// `params`' output constraint, compiled.
    pub fn grammar(&self) -> Option<&Arc<CompiledGrammar>> {
        self.grammar.as_ref()
    }

    /// The parts, for the engine thread that queues the request.
    pub(crate) fn into_parts(
        self,
    ) -> (
        Vec<u32>,
        SamplingParams,
        usize,
        Option<Arc<CompiledGrammar>>,
    ) {
        (self.prompt_ids, self.params, self.max_tokens, self.grammar)
    }
}

impl Frontend {
    /// Checks a generation request once for everything the engine needs of it: its prompt is
    /// not empty and in the vocabulary, its `logit_bias` names real tokens, the context has
    /// room for the prompt and `max_tokens`, and its output constraint compiles (which can take
    /// a while for a large schema the first time: call this off any thread that must stay
    /// responsive).
    pub fn check_request(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
    ) -> Result<CheckedRequest> {
        self.check_tokens(&prompt_ids)?;
        let max_tokens = self.max_new_tokens(prompt_ids.len(), &params)?;
        let grammar = self.compile_structured(&params)?;
        Ok(CheckedRequest {
            prompt_ids,
            params,
            max_tokens,
            grammar,
        })
    }
}
