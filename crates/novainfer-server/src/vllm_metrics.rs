//! vLLM's serving contract in `/metrics`: the `vllm:*` series that routers, autoscalers and
//! dashboards built for vLLM read, with vLLM's names, types, labels and meaning.
//!
//! Every series carries vLLM's labels `model_name` and `engine` (always `"0"`: one engine
//! core per served model). The series both namespaces share are defined once, in
//! [`crate::metrics::SERIES`], with both spellings; only vLLM's own (its cache configuration,
//! LoRA requests, and finish reasons folded into vLLM's fewer) are here. Who reads what is listed in docs/api.md ("vLLM-compatible metrics").

use std::fmt::Write;

use crate::metrics::{header, render_series, ModelSnapshot};

/// vLLM's `engine` label: the index of the engine core inside one server.
const ENGINE: &str = "0";

/// vLLM's finish reasons, and ours that each one counts.
const FINISHED: &[(&str, &[&str])] = &[
    ("stop", &["stop"]),
    ("length", &["length"]),
    // vLLM has no timeout: a request ended by the server's timeout was aborted.
    ("abort", &["abort", "timeout"]),
    ("error", &["error"]),
];

fn labels(m: &ModelSnapshot<'_>) -> String {
    format!("model_name=\"{}\",engine=\"{ENGINE}\"", m.name)
}

/// Appends every `vllm:*` series for `models` to `out`: the per-model series of
/// [`crate::metrics::SERIES`] under their vLLM names, and vLLM's own (the cache
/// configuration, LoRA requests, finish reasons folded into vLLM's).
pub fn render(out: &mut String, models: &[ModelSnapshot<'_>]) {
    render_series(out, models, |s| s.vllm, labels);
    cache_config_info(out, models);
    lora_requests_info(out, models);
    let name = "vllm:request_success_total";
    header(
        out,
        name,
        "counter",
        "Count of successfully processed requests.",
    );
    for m in models {
        for (reason, ours) in FINISHED {
            let count: u64 = ours.iter().map(|r| m.metrics.finished_count(r)).sum();
            let _ = writeln!(
                out,
                "{name}{{{},finished_reason=\"{reason}\"}} {count}",
                labels(m)
            );
        }
    }
}

/// `vllm:cache_config_info`: an info gauge (always 1) whose labels carry the KV cache's
/// configuration; routers read `block_size` and `num_gpu_blocks` from it (the pool's blocks,
/// whichever device holds them).
fn cache_config_info(out: &mut String, models: &[ModelSnapshot<'_>]) {
    let name = "vllm:cache_config_info";
    header(
        out,
        name,
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    for m in models {
        let Some(stats) = &m.engine else { continue };
        let kv = m.kv_config;
        let _ = writeln!(
            out,
            "{name}{{block_size=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{}\",\
             num_gpu_blocks=\"{}\",{}}} 1",
            kv.block_size,
            kv.dtype,
            if kv.prefix_caching { "True" } else { "False" },
            stats.kv.num_blocks,
            labels(m)
        );
    }
}

/// `vllm:lora_requests_info`: a gauge whose labels name the adapters of the running and of the
/// waiting requests (comma-separated) and `max_lora`; its value is the time of the reading in
/// seconds, as vLLM's. Only for models serving LoRA.
fn lora_requests_info(out: &mut String, models: &[ModelSnapshot<'_>]) {
    let name = "vllm:lora_requests_info";
    header(out, name, "gauge", "Running stats on lora requests.");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for m in models.iter().filter(|m| m.max_loras > 0) {
        let Some(stats) = &m.engine else { continue };
        let _ = writeln!(
            out,
            "{name}{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\",{}}} {now}",
            m.max_loras,
            stats.running_adapters.join(","),
            stats.waiting_adapters.join(","),
            labels(m)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_config::KvConfig;
    use crate::metrics::ModelMetrics;
    use novainfer_engine::EngineStats;

    #[test]
    fn the_vllm_contract_is_rendered_with_vllm_labels() {
        let metrics = ModelMetrics::default();
        metrics.finished("stop");
        metrics.finished("timeout");
        metrics.finished("abort");
        metrics.ttft.observe(0.3);
        let kv_config = KvConfig {
            layout: "block",
            block_size: 16,
            dtype: "f16",
            prefix_caching: true,
        };
        let mut engine = EngineStats {
            num_running: 3,
            num_waiting: 4,
            ..EngineStats::default()
        };
        engine.kv.num_blocks = 8;
        engine.kv.num_used_blocks = 2;
        engine.kv.num_query_tokens = 100;
        engine.kv.num_hit_tokens = 40;
        let mut out = String::new();
        render(
            &mut out,
            &[ModelSnapshot {
                name: "m",
                metrics: &metrics,
                engine: Some(engine),
                kv_config: &kv_config,
                max_loras: 0,
            }],
        );
        assert!(
            !out.contains("vllm:lora_requests_info{"),
            "no LoRA, no series"
        );
        let l = "model_name=\"m\",engine=\"0\"";
        for line in [
            format!("vllm:num_requests_running{{{l}}} 3"),
            format!("vllm:num_requests_waiting{{{l}}} 4"),
            format!("vllm:kv_cache_usage_perc{{{l}}} 0.25"),
            format!("vllm:gpu_cache_usage_perc{{{l}}} 0.25"),
            format!("vllm:prefix_cache_queries_total{{{l}}} 100"),
            format!("vllm:prefix_cache_hits_total{{{l}}} 40"),
            format!(
                "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"f16\",\
                 enable_prefix_caching=\"True\",num_gpu_blocks=\"8\",{l}}} 1"
            ),
            format!("vllm:request_success_total{{{l},finished_reason=\"abort\"}} 2"),
            format!("vllm:request_success_total{{{l},finished_reason=\"stop\"}} 1"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 1"),
            "# TYPE vllm:e2e_request_latency_seconds histogram".to_owned(),
            "# TYPE vllm:prefix_cache_hits_total counter".to_owned(),
        ] {
            assert!(out.lines().any(|x| x == line), "missing {line:?} in\n{out}");
        }
    }

    #[test]
    fn lora_requests_info_names_the_running_and_waiting_adapters() {
        let metrics = ModelMetrics::default();
        let kv_config = KvConfig {
            layout: "block",
            block_size: 16,
            dtype: "f16",
            prefix_caching: true,
        };
        let engine = EngineStats {
            running_adapters: vec!["sql".into(), "docs".into()],
            waiting_adapters: vec!["chat".into()],
            ..EngineStats::default()
        };
        let mut out = String::new();
        render(
            &mut out,
            &[ModelSnapshot {
                name: "m",
                metrics: &metrics,
                engine: Some(engine),
                kv_config: &kv_config,
                max_loras: 2,
            }],
        );
        let line = out
            .lines()
            .find(|l| l.starts_with("vllm:lora_requests_info{"))
            .expect("the series is rendered");
        assert!(
            line.starts_with(
                "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,docs\",\
                 waiting_lora_adapters=\"chat\",model_name=\"m\",engine=\"0\"} "
            ),
            "{line}"
        );
        assert!(out.contains("# TYPE vllm:lora_requests_info gauge"));
    }
}
