//! `GET /server_info`: what a client (the Web UI) shows about each served model: its context
//! length, device, KV cache layout and use, prefix-cache hit rate, and which optional features
//! the server has (so a client can hide what it cannot use).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use novainfer_engine::EngineStats;
use serde_json::{json, Value};

use crate::engine_io;
use crate::models::ServedModel;
use crate::state::AppState;

/// Optional features a client may offer only when the server has them: `json_schema` and
/// `tool_calls` always; `speculative_decoding` when the model's engine drafts tokens.
fn features(m: &ServedModel) -> [(&'static str, bool); 3] {
    [
        ("json_schema", true),
        ("tool_calls", true),
        ("speculative_decoding", m.speculative),
    ]
}

pub async fn server_info(State(app): State<Arc<AppState>>) -> Response {
    let mut models = Vec::with_capacity(app.models.0.len());
    for m in &app.models.0 {
        // A dead engine answers nothing: its live numbers are null, the configuration stays.
        let stats = engine_io::stats(&m.handle).await.ok();
        models.push(model_info(m, stats.as_ref()));
    }
    axum::Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "models": models,
    }))
    .into_response()
}

fn model_info(m: &ServedModel, stats: Option<&EngineStats>) -> Value {
    let device = m.handle.device();
    let kv = &m.kv_config;
    let features: serde_json::Map<String, Value> = features(m)
        .iter()
        .map(|(name, on)| ((*name).to_owned(), Value::Bool(*on)))
        .collect();
    json!({
        "id": m.name,
        "max_model_len": m.frontend.max_model_len(),
        "device": device.device.to_string(),
        "device_reason": device.reason,
        "reasoning": m.reasoning,
        "kv_cache": {
            "layout": kv.layout,
            "block_size": kv.block_size,
            "dtype": kv.dtype,
            "prefix_caching": kv.prefix_caching,
            "num_blocks": stats.map(|s| s.kv.num_blocks),
            "num_used_blocks": stats.map(|s| s.kv.num_used_blocks),
            "bytes": stats.map(|s| s.kv_pool_bytes),
            "bytes_per_block": stats.map(|s| s.kv_bytes_per_block),
        },
        "prefix_cache": prefix_cache(stats),
        "features": features,
    })
}

/// Since the server started: prompt tokens looked up in the prefix cache, those found there,
/// and their ratio (null before the first lookup).
fn prefix_cache(stats: Option<&EngineStats>) -> Value {
    let Some(s) = stats else {
        return json!({"query_tokens": null, "hit_tokens": null, "hit_rate": null});
    };
    let rate = (s.kv.num_query_tokens > 0)
        .then(|| s.kv.num_hit_tokens as f64 / s.kv.num_query_tokens as f64);
    json!({
        "query_tokens": s.kv.num_query_tokens,
        "hit_tokens": s.kv.num_hit_tokens,
        "hit_rate": rate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_hits_over_lookups_and_null_before_any() {
        let mut stats = EngineStats::default();
        assert_eq!(prefix_cache(Some(&stats))["hit_rate"], Value::Null);
        stats.kv.num_query_tokens = 200;
        stats.kv.num_hit_tokens = 50;
        let v = prefix_cache(Some(&stats));
        assert_eq!(v["hit_rate"], json!(0.25));
        assert_eq!(
            (v["query_tokens"].clone(), v["hit_tokens"].clone()),
            (json!(200), json!(50))
        );
        assert_eq!(prefix_cache(None)["hit_tokens"], Value::Null);
    }
}
