//! LoRA adapters by name: the registry requests look their adapter up in.
//!
//! The registry is shared by every thread that submits requests (the server's handlers,
//! Python). Loading reads and checks the adapter on the caller's thread, so a bad file is
//! that caller's error and never stalls the engine loop. A request carries its adapter's
//! handle ([`AdapterRef`]) into the engine, which keeps it alive for as long as the request
//! runs: unloading only removes the name, so requests already running finish on the
//! adapter they started with and new ones get [`EngineError::AdapterNotFound`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use novainfer_core::ParamError;
use novainfer_model::lora::AdapterId;
use novainfer_model::{AdapterLimits, AdapterRef, LoraAdapter, Qwen2Config};

use crate::error::{EngineError, Result};

/// LoRA serving options (vLLM's `--enable-lora` family).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Most distinct adapters among the running requests (vLLM's `max_loras`); requests on
    /// another adapter wait for one to leave.
    pub max_loras: usize,
    /// Largest adapter rank accepted (vLLM's `max_lora_rank`).
    pub max_lora_rank: usize,
    /// Adapters loaded at start-up: `(name, path)`.
    pub modules: Vec<(String, PathBuf)>,
}

impl Default for LoraConfig {
    /// vLLM's defaults.
    fn default() -> Self {
        Self {
            max_loras: 1,
            max_lora_rank: 16,
            modules: Vec::new(),
        }
    }
}

impl LoraConfig {
    pub(crate) fn check(&self) -> Result<()> {
        if self.max_loras == 0 {
            return Err(ParamError::new("max_loras", "must be >= 1, got 0").into());
        }
        if self.max_lora_rank == 0 {
            return Err(ParamError::new("max_lora_rank", "must be >= 1, got 0").into());
        }
        Ok(())
    }
}

/// A loaded adapter as listed to users.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub id: AdapterId,
    pub path: PathBuf,
    pub rank: usize,
}

/// The adapters loaded for one base model, by name.
pub struct LoraRegistry {
    /// `None`: LoRA is off for this engine (no `LoraConfig`).
    limits: Option<AdapterLimits>,
    max_loras: usize,
    model: Qwen2Config,
    by_name: RwLock<BTreeMap<String, AdapterRef>>,
    /// Ids are never reused (see [`AdapterId`]).
    next_id: AtomicU64,
}

impl LoraRegistry {
    pub(crate) fn new(config: Option<&LoraConfig>, model: Qwen2Config) -> Self {
        Self {
            limits: config.map(|c| AdapterLimits {
                max_rank: c.max_lora_rank,
            }),
            max_loras: config.map_or(0, |c| c.max_loras),
            model,
            by_name: RwLock::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn enabled(&self) -> bool {
        self.limits.is_some()
    }

    /// Most distinct adapters running at once (0 when LoRA is off).
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }

    /// Reads and checks the adapter at `path` and registers it as `name`.
    pub fn load(&self, name: &str, path: &Path) -> Result<AdapterInfo> {
        self.load_as(name, path, false)
    }

    /// [`Self::load`]; with `replace`, a loaded adapter of the same name is swapped for the
    /// new one once that has loaded (vLLM's `load_inplace`; requests already running keep
    /// the old one).
    pub fn load_as(&self, name: &str, path: &Path, replace: bool) -> Result<AdapterInfo> {
        let limits = self.limits.ok_or(EngineError::LoraDisabled)?;
        if name.is_empty() {
            return Err(ParamError::new("lora_name", "must not be empty").into());
        }
        if !replace && self.read().contains_key(name) {
            return Err(EngineError::AdapterExists {
                name: name.to_owned(),
            });
        }
        let id = AdapterId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let adapter = LoraAdapter::load(path, id, name, &self.model, limits)?;
        let adapter = AdapterRef(std::sync::Arc::new(adapter));
        let info = info(&adapter);
        let mut map = self.by_name.write().unwrap_or_else(|e| e.into_inner());
        // Checked again: another thread may have loaded the name meanwhile.
        if !replace && map.contains_key(name) {
            return Err(EngineError::AdapterExists {
                name: name.to_owned(),
            });
        }
        map.insert(name.to_owned(), adapter);
        Ok(info)
    }

    /// Removes `name`; requests already running on it finish with it.
    pub fn unload(&self, name: &str) -> Result<()> {
        let mut map = self.by_name.write().unwrap_or_else(|e| e.into_inner());
        match map.remove(name) {
            Some(_) => Ok(()),
            None => Err(EngineError::AdapterNotFound {
                name: name.to_owned(),
            }),
        }
    }

    /// The adapter registered as `name`.
    pub fn get(&self, name: &str) -> Result<AdapterRef> {
        if !self.enabled() {
            return Err(EngineError::LoraDisabled);
        }
        self.read()
            .get(name)
            .cloned()
            .ok_or_else(|| EngineError::AdapterNotFound {
                name: name.to_owned(),
            })
    }

    /// Whether `name` is a registered adapter.
    pub fn contains(&self, name: &str) -> bool {
        self.read().contains_key(name)
    }

    /// Every registered adapter, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        self.read().values().map(info).collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, AdapterRef>> {
        self.by_name.read().unwrap_or_else(|e| e.into_inner())
    }
}

fn info(a: &AdapterRef) -> AdapterInfo {
    AdapterInfo {
        name: a.name().to_owned(),
        id: a.id(),
        path: a.source().to_owned(),
        rank: a.rank(),
    }
}
