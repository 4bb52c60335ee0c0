//! From a [`StructuredOutput`] to a grammar ready to match: compiled once per distinct
//! constraint (a small LRU cache), then deep-cloned per request so requests never share
//! parser state (nor its lock).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use novainfer_core::StructuredOutput;
use serde_json::Value;
use toktrie::TokEnv;

use crate::matcher::GrammarMatcher;
use crate::StructuredError;

/// Distinct constraints kept compiled; a schema used once more costs nothing to recompile.
pub const CACHE_CAPACITY: usize = 64;

/// A grammar compiled for one vocabulary; [`Self::matcher`] starts a request's match.
pub struct CompiledGrammar {
    /// Behind a lock because a parser is not `Sync`; held only while cloning.
    parser: Mutex<TokenParser>,
}

impl CompiledGrammar {
    /// A fresh matcher, with its own copy of the lexer caches built so far.
    pub fn matcher(&self) -> GrammarMatcher {
        let parser = self
            .parser
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .deep_clone();
        GrammarMatcher::new(Matcher::new(Ok(parser)))
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

/// The JSON Schema options every schema gets unless it sets its own `x-guidance`: no free
/// whitespace between tokens (a small model given the choice loops on `\n` and `\t`), and the
/// compact separators `,` and `:`.
fn compact_json_options() -> Value {
    serde_json::json!({"whitespace_flexible": false})
}

/// The llguidance grammar of a constraint, or why the constraint is malformed.
pub fn top_level_grammar(spec: &StructuredOutput) -> Result<TopLevelGrammar, StructuredError> {
    Ok(match spec {
        StructuredOutput::JsonSchema(text) => {
            let schema: Value = serde_json::from_str(text).map_err(|e| {
                StructuredError::Invalid(format!("the JSON schema is not valid JSON: {e}"))
            })?;
            TopLevelGrammar::from_json_schema(with_compact_whitespace(schema)?)
        }
        StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_compact_whitespace(
            serde_json::json!({"type": "object"}),
        )?),
        StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
        StructuredOutput::Choice(choices) => {
            let alternatives: Vec<String> = choices
                .iter()
                .map(|c| serde_json::to_string(c).unwrap_or_default())
                .collect();
            TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
        }
        StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
    })
}

/// `schema` with compact whitespace unless it asks otherwise; only objects and booleans are
/// schemas.
fn with_compact_whitespace(schema: Value) -> Result<Value, StructuredError> {
    match schema {
        Value::Object(mut map) => {
            if !map.contains_key("x-guidance") {
                map.insert("x-guidance".into(), compact_json_options());
            }
            Ok(Value::Object(map))
        }
        Value::Bool(true) => Ok(serde_json::json!({"x-guidance": compact_json_options()})),
        Value::Bool(false) => Err(StructuredError::Invalid(
            "the JSON schema `false` matches nothing".into(),
        )),
        other => Err(StructuredError::Invalid(format!(
            "a JSON schema must be an object or a boolean, got {other}"
        ))),
    }
}

/// Compiles constraints for one tokenizer. The tokenizer side (a trie of the whole vocabulary)
/// is built on first use, so engines that never see a constrained request never pay for it.
pub struct GrammarCompiler {
    make_env: Box<dyn Fn() -> Result<TokEnv, StructuredError> + Send + Sync>,
    factory: OnceLock<Result<ParserFactory, StructuredError>>,
    cache: Mutex<Lru>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrammarCompiler")
    }
}

impl GrammarCompiler {
    /// `make_env` builds the tokenizer environment (see [`crate::vocab::tok_env`]) when first
    /// needed.
    pub fn new(
        make_env: impl Fn() -> Result<TokEnv, StructuredError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            make_env: Box::new(make_env),
            factory: OnceLock::new(),
            cache: Mutex::new(Lru::default()),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, StructuredError> {
        self.factory
            .get_or_init(|| {
                let env = (self.make_env)()?;
                let mut factory = ParserFactory::new_simple(&env)
                    .map_err(|e| StructuredError::Setup(e.to_string()))?;
                // Warnings and errors come back to us as values; nothing goes to stderr.
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The compiled grammar of `spec`, from the cache when it was compiled before.
    pub fn compile(
        &self,
        spec: &StructuredOutput,
    ) -> Result<Arc<CompiledGrammar>, StructuredError> {
        if let Some(hit) = self.lock_cache().get(spec) {
            return Ok(hit);
        }
        let factory = self.factory()?;
        let grammar = top_level_grammar(spec)?;
        // Compiled outside the lock: a big schema must not hold up requests for cached ones.
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Invalid(e.to_string()))?;
        let compiled = Arc::new(CompiledGrammar {
            parser: Mutex::new(parser),
        });
        self.lock_cache().put(spec.clone(), compiled.clone());
        Ok(compiled)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Number of compiled grammars held (for tests).
    pub fn cached(&self) -> usize {
        self.lock_cache().entries.len()
    }
}

/// Least recently used eviction over at most [`CACHE_CAPACITY`] entries; a linear scan for
/// the oldest is nothing next to a compile.
#[derive(Default)]
struct Lru {
    entries: HashMap<StructuredOutput, (u64, Arc<CompiledGrammar>)>,
    clock: u64,
}

impl Lru {
    fn get(&mut self, key: &StructuredOutput) -> Option<Arc<CompiledGrammar>> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|(used, g)| {
            *used = clock;
            g.clone()
        })
    }

    fn put(&mut self, key: StructuredOutput, value: Arc<CompiledGrammar>) {
        self.clock += 1;
        if self.entries.len() >= CACHE_CAPACITY && !self.entries.contains_key(&key) {
            if let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(k, _)| k.clone())
            {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(key, (self.clock, value));
    }
}
