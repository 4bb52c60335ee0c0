//! What a constrained request's output must match: the user's constraint as data.
//!
//! Compiling it into a grammar and masking the sampler with it is the job of
//! `novainfer-structured`; here it is only text, so the core stays free of grammar engines.
//! It is the cache key of compiled grammars, hence `Eq + Hash`.

/// The constraint on one request's generated text (vLLM's `structured_outputs`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StructuredOutput {
    /// Any JSON value valid against this JSON Schema (the schema as JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (whole output).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark dialect (`start` is the start rule).
    /// Servers also build these for tool calls: `%json { ... }` embeds a JSON Schema.
    Grammar(String),
}

impl StructuredOutput {
    /// The user-facing name of the form, as vLLM's `structured_outputs` spells it.
    pub fn kind(&self) -> &'static str {
        match self {
            StructuredOutput::JsonSchema(_) => "json",
            StructuredOutput::JsonObject => "json_object",
            StructuredOutput::Regex(_) => "regex",
            StructuredOutput::Choice(_) => "choice",
            StructuredOutput::Grammar(_) => "grammar",
        }
    }

    /// Why this constraint can never be met, for the checks that need no grammar engine.
    pub(crate) fn check(&self) -> Result<(), String> {
        match self {
            StructuredOutput::Choice(choices) if choices.is_empty() => {
                Err("choice must list at least one string".into())
            }
            StructuredOutput::Choice(choices) if choices.iter().any(String::is_empty) => {
                Err("choice strings must not be empty".into())
            }
            StructuredOutput::Regex(r) if r.is_empty() => Err("regex must not be empty".into()),
            StructuredOutput::Grammar(g) if g.trim().is_empty() => {
                Err("grammar must not be empty".into())
            }
            StructuredOutput::JsonSchema(s) if s.trim().is_empty() => {
                Err("json schema must not be empty".into())
            }
            _ => Ok(()),
        }
    }
}
