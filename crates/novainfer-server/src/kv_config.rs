//! How a served model's KV cache is configured, as the Web UI, `/server_info` and the
//! metrics show it. Apart from `models` so that `metrics` needs nothing of the served models.

use novainfer_engine::EngineConfig;
use novainfer_model::{Capabilities, Device};

/// How a model's KV cache is laid out, as configured (the engine keeps these inside; the
/// Web UI and `/server_info` show them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvConfig {
    /// `block` (paged, prefix caching) or `slot` (one cell per token).
    pub layout: &'static str,
    /// Tokens per block (1 in the slot layout).
    pub block_size: usize,
    /// The storage actually used: `auto` resolved for the device the model runs on.
    pub dtype: &'static str,
    pub prefix_caching: bool,
}

impl KvConfig {
    pub fn new(cfg: &EngineConfig, device: Device) -> Self {
        // The engine refuses, or moves to the CPU, a dtype the device's backend cannot hold.
        let dtype = Capabilities::of(device)
            .kv_storage(cfg.kv_cache_dtype)
            .map_or(cfg.kv_cache_dtype.as_str(), |s| s.as_str());
        Self {
            layout: cfg.kv_layout.as_str(),
            block_size: cfg.effective_block_size(),
            dtype,
            prefix_caching: cfg.enable_prefix_caching && cfg.kv_layout.as_str() == "block",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_dtype_auto_is_resolved_for_the_device() {
        let mut cfg = EngineConfig::new("/m");
        assert_eq!(KvConfig::new(&cfg, Device::Cpu).dtype, "f16");
        assert_eq!(KvConfig::new(&cfg, Device::Cuda(0)).dtype, "bf16");
        cfg.kv_cache_dtype = novainfer_model::KvCacheDtype::parse("q8_0").expect("known dtype");
        let kv = KvConfig::new(&cfg, Device::Cpu);
        assert_eq!(
            (kv.dtype, kv.layout, kv.block_size),
            ("q8_0", "block", cfg.block_size)
        );
        assert!(kv.prefix_caching);
    }
}
