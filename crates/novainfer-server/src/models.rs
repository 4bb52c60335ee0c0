//! The served models: where each comes from (a path or a cached demo model), its loaded
//! engine, and lookup by the `model` a request names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use novainfer_engine::{EngineHandle, Frontend};
use novainfer_model::AdapterRef;

use crate::error::ApiError;
pub use crate::kv_config::KvConfig;
use crate::metrics::ModelMetrics;
use crate::reasoning::ReasoningParser;

/// Demo-model names and their cached file names. `python/novainfer/fetch.py` (which
/// downloads them) is the source of truth; this copy lets the standalone binary find them.
pub const DEMO_MODELS: &[(&str, &str)] = &[
    (
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    (
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error(
        "demo model {name:?} is not in the cache ({path}); fetch it with `novainfer fetch {name}`"
    )]
    NotFetched { name: String, path: PathBuf },
    #[error(
        "model {spec:?} is neither an existing file or directory nor a demo model name ({known})"
    )]
    Unknown { spec: String, known: String },
}

/// `$NOVAINFER_HOME`, else `~/.cache/novainfer` (as in fetch.py).
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("NOVAINFER_HOME") {
        Some(home) if !home.is_empty() => PathBuf::from(home),
        _ => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default()
            .join(".cache")
            .join("novainfer"),
    }
}

/// The path of a model spec and the name to serve it under by default.
pub fn resolve(spec: &str) -> Result<(PathBuf, String), ResolveError> {
    let path = Path::new(spec);
    if path.exists() {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| spec.to_owned());
        return Ok((path.to_path_buf(), name));
    }
    match DEMO_MODELS.iter().find(|(name, _)| *name == spec) {
        Some((name, file)) => {
            let path = cache_dir().join("models").join(file);
            if path.is_file() {
                Ok((path, (*name).to_owned()))
            } else {
                Err(ResolveError::NotFetched {
                    name: (*name).to_owned(),
                    path,
                })
            }
        }
        None => Err(ResolveError::Unknown {
            spec: spec.to_owned(),
            known: DEMO_MODELS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

pub struct ServedModel {
    pub name: String,
    pub path: PathBuf,
    pub handle: Arc<EngineHandle>,
    pub frontend: Frontend,
    pub created: u64,
    /// Split `</think>` reasoning out of chat replies.
    pub reasoning: bool,
    pub metrics: ModelMetrics,
    pub kv_config: KvConfig,
    /// Whether the engine drafts tokens (`--speculative-config`).
    pub speculative: bool,
    /// Where the engine's KV-cache events go (`--kv-events-config`), for its metrics.
    pub kv_events: Option<Arc<crate::kv_events::KvEventPublisher>>,
}

impl ServedModel {
    pub fn new(
        name: String,
        path: PathBuf,
        handle: EngineHandle,
        parser: ReasoningParser,
        created: u64,
        kv_config: KvConfig,
    ) -> Self {
        let frontend = handle.frontend().clone();
        let reasoning = match parser {
            ReasoningParser::DeepseekR1 => true,
            ReasoningParser::None => false,
            ReasoningParser::Auto => frontend.tokenizer().token_to_id("</think>").is_some(),
        };
        Self {
            name,
            path,
            handle: Arc::new(handle),
            frontend,
            created,
            reasoning,
            metrics: ModelMetrics::default(),
            kv_config,
            speculative: false,
            kv_events: None,
        }
    }
}

/// The model a request runs on: a served model, or one of its LoRA adapters (named in `model`
/// like a model, as in vLLM). It derefs to the served model; its own `name` is the one the
/// request gave, which responses echo.
#[derive(Clone)]
pub struct ModelRef {
    pub name: String,
    /// The adapter the request runs with; `None`: the base model.
    pub adapter: Option<AdapterRef>,
    served: Arc<ServedModel>,
}

impl ModelRef {
    /// The served model itself, without an adapter.
    pub fn base(served: &Arc<ServedModel>) -> Self {
        Self {
            name: served.name.clone(),
            adapter: None,
            served: served.clone(),
        }
    }

    /// The served model underneath (the one an adapter belongs to).
    pub fn served(&self) -> &Arc<ServedModel> {
        &self.served
    }
}

impl std::ops::Deref for ModelRef {
    type Target = ServedModel;
    fn deref(&self) -> &ServedModel {
        &self.served
    }
}

pub struct Models(pub Vec<Arc<ServedModel>>);

impl Models {
    /// The model or LoRA adapter a request names; with one model served, `model` may be
    /// omitted (the base model).
    pub fn get(&self, requested: Option<&str>) -> Result<ModelRef, ApiError> {
        match requested {
            Some(name) => {
                if let Some(m) = self.0.iter().find(|m| m.name == name) {
                    return Ok(ModelRef::base(m));
                }
                for m in &self.0 {
                    if let Ok(adapter) = m.frontend.loras().get(name) {
                        return Ok(ModelRef {
                            name: name.to_owned(),
                            adapter: Some(adapter),
                            served: m.clone(),
                        });
                    }
                }
                Err(ApiError::model_not_found(name, &self.names()))
            }
            None if self.0.len() == 1 => Ok(ModelRef::base(&self.0[0])),
            None => Err(ApiError::invalid_param(
                "model",
                format!(
                    "`model` is required when several models are served: {}",
                    self.names().join(", ")
                ),
            )),
        }
    }

    /// Every name a request may give: the served models, then their adapters.
    pub fn names(&self) -> Vec<String> {
        let adapters = self
            .0
            .iter()
            .flat_map(|m| m.frontend.loras().list().into_iter().map(|a| a.name));
        self.0
            .iter()
            .map(|m| m.name.clone())
            .chain(adapters)
            .collect()
    }

    /// The served model named `name` (not an adapter).
    pub fn served(&self, name: &str) -> Option<&Arc<ServedModel>> {
        self.0.iter().find(|m| m.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_paths_are_served_by_their_name() {
        let dir = std::env::temp_dir();
        let (path, name) = resolve(dir.to_str().expect("utf-8 temp dir")).expect("exists");
        assert_eq!(path, dir);
        assert!(!name.is_empty());
    }

    #[test]
    fn unknown_specs_list_the_demo_models() {
        let e = resolve("no-such-model-xyz").expect_err("unknown");
        assert!(e.to_string().contains("qwen2.5-coder-0.5b"), "{e}");
    }
}
