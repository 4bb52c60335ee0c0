//! Prometheus metrics in the text exposition format, named in the spirit of vLLM's `vllm:*`
//! (here `novainfer:*`), labelled by `model_name`. vLLM's own series, for routers and
//! dashboards built for vLLM, are rendered after ours by [`crate::vllm_metrics`].
//!
//! Server-side timings (TTFT, inter-token latency, end-to-end) and token counts are recorded
//! here as requests finish; engine gauges and counters (running/waiting, KV blocks, prefix
//! cache, preemptions) are read from `EngineStats` when `/metrics` is scraped.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use novainfer_engine::EngineStats;

use crate::models::KvConfig;

const TTFT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
];

/// A cumulative histogram with fixed upper bounds.
pub struct Histogram {
    bounds: &'static [f64],
    /// counts[i] = observations <= bounds[i] that are > bounds[i-1]; last = +Inf bucket.
    inner: Mutex<(Vec<u64>, f64)>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    pub fn observe(&self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.0[i] += 1;
        inner.1 += value;
    }

    pub(crate) fn render(&self, out: &mut String, name: &str, labels: &str) {
        let (counts, sum) = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// Finish reasons counted in `request_success_total`.
pub const FINISH_REASONS: &[&str] = &["stop", "length", "abort", "error", "timeout"];

/// What the server records for one served model.
pub struct ModelMetrics {
    pub ttft: Histogram,
    /// Arrival (permit wait included) to the engine's first step for the request.
    pub queue_time: Histogram,
    /// The engine's first step for the request to its first token.
    pub prefill_time: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    finished: Vec<AtomicU64>,
}

impl Default for ModelMetrics {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(TTFT_BUCKETS),
            queue_time: Histogram::new(TTFT_BUCKETS),
            prefill_time: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            finished: FINISH_REASONS.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl ModelMetrics {
    pub fn finished(&self, reason: &str) {
        if let Some(i) = FINISH_REASONS.iter().position(|r| *r == reason) {
            self.finished[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Requests finished for `reason` (one of [`FINISH_REASONS`]; 0 for any other).
    pub fn finished_count(&self, reason: &str) -> u64 {
        FINISH_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.finished[i].load(Ordering::Relaxed))
    }
}

/// Reasons a request is refused before it reaches the engine.
pub const REJECTIONS: &[&str] = &[
    "server_overloaded",
    "token_budget_exceeded",
    "tenant_queue_full",
];

#[derive(Default)]
pub struct ServerMetrics {
    rejected: [AtomicU64; 3],
}

impl ServerMetrics {
    pub fn rejected(&self, code: &str) {
        if let Some(i) = REJECTIONS.iter().position(|r| *r == code) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One model's view for rendering.
pub struct ModelSnapshot<'a> {
    pub name: &'a str,
    pub metrics: &'a ModelMetrics,
    pub engine: Option<EngineStats>,
    pub kv_config: &'a KvConfig,
    /// `--max-loras` when LoRA is on for this model; 0 when off.
    pub max_loras: usize,
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

pub fn render(
    server: &ServerMetrics,
    queued: usize,
    in_flight: usize,
    models: &[ModelSnapshot<'_>],
) -> String {
    let mut out = String::new();
    type Gauge = fn(&EngineStats) -> f64;
    let engine_series: &[(&str, &str, &str, Gauge)] = &[
        (
            "novainfer:num_requests_running",
            "gauge",
            "Requests in the engine's running batch.",
            |s| s.num_running as f64,
        ),
        (
            "novainfer:num_requests_waiting",
            "gauge",
            "Requests waiting in the engine's queue.",
            |s| s.num_waiting as f64,
        ),
        (
            "novainfer:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV blocks in use (1 = full).",
            |s| s.kv.num_used_blocks as f64 / s.kv.num_blocks.max(1) as f64,
        ),
        (
            "novainfer:kv_cache_used_blocks",
            "gauge",
            "KV blocks held by requests.",
            |s| s.kv.num_used_blocks as f64,
        ),
        (
            "novainfer:kv_cache_total_blocks",
            "gauge",
            "KV blocks in the pool.",
            |s| s.kv.num_blocks as f64,
        ),
        (
            "novainfer:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            |s| s.kv.num_query_tokens as f64,
        ),
        (
            "novainfer:prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            |s| s.kv.num_hit_tokens as f64,
        ),
        (
            "novainfer:num_preemptions_total",
            "counter",
            "Requests preempted (recomputed later) for lack of KV room.",
            |s| s.num_preemptions as f64,
        ),
        (
            "novainfer:spec_decode_num_drafts_total",
            "counter",
            "Speculative decoding: drafts verified (one per request per step; mean acceptance \
             length = 1 + accepted tokens / drafts).",
            |s| s.num_drafts as f64,
        ),
        (
            "novainfer:spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative decoding: draft tokens verified.",
            |s| s.num_draft_tokens as f64,
        ),
        (
            "novainfer:spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens confirmed by the model.",
            |s| s.num_accepted_tokens as f64,
        ),
        (
            "novainfer:prompt_tokens_computed_total",
            "counter",
            "Prompt tokens the engine computed (prefix hits excluded).",
            |s| s.num_prompt_tokens_computed as f64,
        ),
    ];
    for (name, kind, help, value) in engine_series {
        header(&mut out, name, kind, help);
        for m in models {
            if let Some(stats) = &m.engine {
                let _ = writeln!(out, "{name}{{model_name=\"{}\"}} {}", m.name, value(stats));
            }
        }
    }
    let name = "novainfer:num_requests_waiting_by_priority";
    header(
        &mut out,
        name,
        "gauge",
        "Requests waiting in the engine's queue, by priority value.",
    );
    for m in models {
        for (priority, count) in m.engine.iter().flat_map(|s| &s.num_waiting_by_priority) {
            let _ = writeln!(
                out,
                "{name}{{model_name=\"{}\",priority=\"{priority}\"}} {count}",
                m.name
            );
        }
    }
    type Counter = fn(&ModelMetrics) -> u64;
    let counters: &[(&str, &str, Counter)] = &[
        (
            "novainfer:prompt_tokens_total",
            "Prompt tokens of finished requests.",
            |m| m.prompt_tokens.load(Ordering::Relaxed),
        ),
        (
            "novainfer:generation_tokens_total",
            "Tokens generated.",
            |m| m.generation_tokens.load(Ordering::Relaxed),
        ),
        (
            "novainfer:cached_prompt_tokens_total",
            "Prompt tokens of finished requests served from the prefix cache.",
            |m| m.cached_tokens.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in counters {
        header(&mut out, name, "counter", help);
        for m in models {
            let _ = writeln!(
                out,
                "{name}{{model_name=\"{}\"}} {}",
                m.name,
                value(m.metrics)
            );
        }
    }
    let name = "novainfer:request_success_total";
    header(
        &mut out,
        name,
        "counter",
        "Finished requests by finish reason.",
    );
    for m in models {
        for (reason, count) in FINISH_REASONS.iter().zip(&m.metrics.finished) {
            let _ = writeln!(
                out,
                "{name}{{model_name=\"{}\",finished_reason=\"{reason}\"}} {}",
                m.name,
                count.load(Ordering::Relaxed)
            );
        }
    }
    type HistogramOf = fn(&ModelMetrics) -> &Histogram;
    let histograms: &[(&str, &str, HistogramOf)] = &[
        (
            "novainfer:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            |m| &m.ttft,
        ),
        (
            "novainfer:request_queue_time_seconds",
            "Time from arrival (waiting for a permit included) to the engine's first step for it.",
            |m| &m.queue_time,
        ),
        (
            "novainfer:request_prefill_time_seconds",
            "Time from the engine's first step for a request to its first token.",
            |m| &m.prefill_time,
        ),
        (
            "novainfer:inter_token_latency_seconds",
            "Time between successive tokens of a stream.",
            |m| &m.itl,
        ),
        (
            "novainfer:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            |m| &m.e2e,
        ),
    ];
    for (name, help, histogram) in histograms {
        header(&mut out, name, "histogram", help);
        for m in models {
            histogram(m.metrics).render(&mut out, name, &format!("model_name=\"{}\"", m.name));
        }
    }
    header(
        &mut out,
        "novainfer:server_requests_in_flight",
        "gauge",
        "Requests holding a concurrency permit.",
    );
    let _ = writeln!(out, "novainfer:server_requests_in_flight {in_flight}");
    header(
        &mut out,
        "novainfer:server_requests_queued",
        "gauge",
        "Requests waiting for a concurrency permit.",
    );
    let _ = writeln!(out, "novainfer:server_requests_queued {queued}");
    let name = "novainfer:request_rejections_total";
    header(
        &mut out,
        name,
        "counter",
        "Requests refused with 429, by reason.",
    );
    for (reason, count) in REJECTIONS.iter().zip(&server.rejected) {
        let _ = writeln!(
            out,
            "{name}{{reason=\"{reason}\"}} {}",
            count.load(Ordering::Relaxed)
        );
    }
    crate::vllm_metrics::render(&mut out, models);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "m=\"a\"");
        assert_eq!(
            out,
            "x_bucket{m=\"a\",le=\"0.1\"} 1\nx_bucket{m=\"a\",le=\"1\"} 3\nx_bucket{m=\"a\",le=\"+Inf\"} 4\n\
             x_sum{m=\"a\"} 4.25\nx_count{m=\"a\"} 4\n"
        );
    }

    #[test]
    fn exposition_lists_engine_and_server_series() {
        let metrics = ModelMetrics::default();
        metrics.finished("stop");
        metrics.generation_tokens.fetch_add(7, Ordering::Relaxed);
        let server = ServerMetrics::default();
        server.rejected("server_overloaded");
        metrics.queue_time.observe(0.2);
        let engine = EngineStats {
            num_running: 2,
            num_waiting_by_priority: vec![(-1, 2), (0, 5)],
            kv: novainfer_core::KvCacheStats {
                num_blocks: 10,
                num_used_blocks: 5,
                ..Default::default()
            },
            ..EngineStats::default()
        };
        let text = render(
            &server,
            3,
            1,
            &[ModelSnapshot {
                name: "m",
                metrics: &metrics,
                engine: Some(engine),
                kv_config: &crate::models::KvConfig {
                    layout: "block",
                    block_size: 16,
                    dtype: "f16",
                    prefix_caching: true,
                },
                max_loras: 0,
            }],
        );
        for line in [
            "novainfer:num_requests_running{model_name=\"m\"} 2",
            "novainfer:kv_cache_usage_perc{model_name=\"m\"} 0.5",
            "novainfer:kv_cache_used_blocks{model_name=\"m\"} 5",
            "novainfer:generation_tokens_total{model_name=\"m\"} 7",
            "novainfer:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 1",
            "novainfer:server_requests_queued 3",
            "novainfer:request_rejections_total{reason=\"server_overloaded\"} 1",
            "# TYPE novainfer:time_to_first_token_seconds histogram",
            "novainfer:num_requests_waiting_by_priority{model_name=\"m\",priority=\"-1\"} 2",
            "novainfer:num_requests_waiting_by_priority{model_name=\"m\",priority=\"0\"} 5",
            "novainfer:request_queue_time_seconds_count{model_name=\"m\"} 1",
            "vllm:request_queue_time_seconds_count{model_name=\"m\",engine=\"0\"} 1",
            "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
