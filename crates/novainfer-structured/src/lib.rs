//! Structured outputs: a request's output constrained to a JSON Schema, a regex, a choice or a
//! Lark grammar, by masking the sampler's logits with llguidance at every step.
//!
//! - [`vocab`]: our tokenizer's vocabulary as llguidance needs it (each id's bytes);
//! - [`compiler`]: constraint → compiled grammar, cached per distinct constraint;
//! - [`matcher`]: per-request state: the next token's mask, advancing by the chosen token;
//! - [`tool_grammar`]: grammars servers build for tool calls.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod compiler;
pub mod matcher;
pub mod tool_grammar;
pub mod vocab;

pub use compiler::{CompiledGrammar, GrammarCompiler};
pub use matcher::{Constraint, GrammarMatcher, Progress};
pub use novainfer_core::StructuredOutput;

/// What can go wrong with a constraint.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StructuredError {
    /// The constraint itself is malformed or cannot compile (the user's to fix).
    #[error("{0}")]
    Invalid(String),
    /// The tokenizer cannot support constrained decoding.
    #[error("structured outputs are unavailable for this tokenizer: {0}")]
    Setup(String),
    /// Matching failed mid-generation.
    #[error("grammar matcher: {0}")]
    Matcher(String),
}

#[cfg(test)]
mod tests;
