//! Prometheus metrics in the text exposition format, named in the spirit of vLLM's `vllm:*`
//! (here `novainfer:*`), labelled by `model_name`. Each per-model series is defined once, in
//! [`SERIES`], with its `novainfer:*` name and its `vllm:*` names; vLLM's spelling, for
//! routers and dashboards built for vLLM, is rendered after ours by [`crate::vllm_metrics`].
//!
//! Server-side timings (TTFT, inter-token latency, end-to-end) and token counts are recorded
//! here as requests finish; engine gauges and counters (running/waiting, KV blocks, prefix
//! cache, preemptions) are read from `EngineStats` when `/metrics` is scraped.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use novainfer_engine::EngineStats;

use crate::kv_config::KvConfig;

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

pub(crate) fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Where a per-model series' value comes from.
#[derive(Clone, Copy)]
pub(crate) enum Source {
    /// Read from the engine when scraped (absent for a model whose engine did not answer).
    Engine(fn(&EngineStats) -> f64),
    /// A count the server keeps.
    Count(fn(&ModelMetrics) -> u64),
    /// A latency histogram the server keeps.
    Histogram(fn(&ModelMetrics) -> &Histogram),
}

/// A series' name and help in one namespace.
pub(crate) struct Named {
    pub name: &'static str,
    pub help: &'static str,
}

/// One per-model series, defined once with its spelling in each namespace that exports it:
/// `novainfer:*` (ours, labelled by `model_name`) and vLLM's `vllm:*` (its current name, then
/// deprecated aliases of the same value; labelled by `model_name` and `engine`).
pub(crate) struct Series {
    pub kind: &'static str,
    pub source: Source,
    pub ours: &'static [Named],
    pub vllm: &'static [Named],
}

const fn named(name: &'static str, help: &'static str) -> Named {
    Named { name, help }
}

fn kv_usage(s: &EngineStats) -> f64 {
    s.kv.num_used_blocks as f64 / s.kv.num_blocks.max(1) as f64
}

/// Every per-model series both `/metrics` namespaces draw from.
pub(crate) const SERIES: &[Series] = &[
    Series {
        kind: "gauge",
        source: Source::Engine(|s| s.num_running as f64),
        ours: &[named(
            "novainfer:num_requests_running",
            "Requests in the engine's running batch.",
        )],
        vllm: &[named(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
        )],
    },
    Series {
        kind: "gauge",
        source: Source::Engine(|s| s.num_waiting as f64),
        ours: &[named(
            "novainfer:num_requests_waiting",
            "Requests waiting in the engine's queue.",
        )],
        vllm: &[named(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
        )],
    },
    Series {
        kind: "gauge",
        // vLLM's meaning: the fraction of blocks not free (cached free blocks count as free).
        source: Source::Engine(kv_usage),
        ours: &[named(
            "novainfer:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
        )],
        vllm: &[
            named(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            ),
            named(
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage (deprecated: vllm:kv_cache_usage_perc).",
            ),
        ],
    },
    Series {
        kind: "gauge",
        source: Source::Engine(|s| s.kv.num_used_blocks as f64),
        ours: &[named(
            "novainfer:kv_cache_used_blocks",
            "KV blocks held by requests.",
        )],
        vllm: &[],
    },
    Series {
        kind: "gauge",
        source: Source::Engine(|s| s.kv.num_blocks as f64),
        ours: &[named(
            "novainfer:kv_cache_total_blocks",
            "KV blocks in the pool.",
        )],
        vllm: &[],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.kv.num_query_tokens as f64),
        ours: &[named(
            "novainfer:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
        )],
        vllm: &[
            named(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            named(
                "vllm:gpu_prefix_cache_queries_total",
                "Prefix cache queries in tokens (deprecated: vllm:prefix_cache_queries).",
            ),
        ],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.kv.num_hit_tokens as f64),
        ours: &[named(
            "novainfer:prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache.",
        )],
        vllm: &[
            named(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
            ),
            named(
                "vllm:gpu_prefix_cache_hits_total",
                "Prefix cache hits in tokens (deprecated: vllm:prefix_cache_hits).",
            ),
        ],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_preemptions as f64),
        ours: &[named(
            "novainfer:num_preemptions_total",
            "Requests preempted (recomputed later) for lack of KV room.",
        )],
        vllm: &[named(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_steps as f64),
        ours: &[named(
            "novainfer:engine_steps_total",
            "Forward steps the engine ran (tokens per step = prompt tokens computed plus \
             generated tokens, over steps).",
        )],
        vllm: &[],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_drafts as f64),
        ours: &[named(
            "novainfer:spec_decode_num_drafts_total",
            "Speculative decoding: drafts verified (one per request per step; mean acceptance \
             length = 1 + accepted tokens / drafts).",
        )],
        vllm: &[named(
            "vllm:spec_decode_num_drafts_total",
            "Number of spec decoding drafts.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_draft_tokens as f64),
        ours: &[named(
            "novainfer:spec_decode_num_draft_tokens_total",
            "Speculative decoding: draft tokens verified.",
        )],
        vllm: &[named(
            "vllm:spec_decode_num_draft_tokens_total",
            "Number of draft tokens.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_accepted_tokens as f64),
        ours: &[named(
            "novainfer:spec_decode_num_accepted_tokens_total",
            "Speculative decoding: draft tokens confirmed by the model.",
        )],
        vllm: &[named(
            "vllm:spec_decode_num_accepted_tokens_total",
            "Number of accepted tokens.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Engine(|s| s.num_prompt_tokens_computed as f64),
        ours: &[named(
            "novainfer:prompt_tokens_computed_total",
            "Prompt tokens the engine computed (prefix hits excluded).",
        )],
        vllm: &[],
    },
    Series {
        kind: "counter",
        source: Source::Count(|m| m.prompt_tokens.load(Ordering::Relaxed)),
        ours: &[named(
            "novainfer:prompt_tokens_total",
            "Prompt tokens of finished requests.",
        )],
        vllm: &[named(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Count(|m| m.generation_tokens.load(Ordering::Relaxed)),
        ours: &[named(
            "novainfer:generation_tokens_total",
            "Tokens generated.",
        )],
        vllm: &[named(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
        )],
    },
    Series {
        kind: "counter",
        source: Source::Count(|m| m.cached_tokens.load(Ordering::Relaxed)),
        ours: &[named(
            "novainfer:cached_prompt_tokens_total",
            "Prompt tokens of finished requests served from the prefix cache.",
        )],
        vllm: &[],
    },
    Series {
        kind: "histogram",
        source: Source::Histogram(|m| &m.ttft),
        ours: &[named(
            "novainfer:time_to_first_token_seconds",
            "Time from arrival to the first token.",
        )],
        vllm: &[named(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        )],
    },
    Series {
        kind: "histogram",
        source: Source::Histogram(|m| &m.queue_time),
        ours: &[named(
            "novainfer:request_queue_time_seconds",
            "Time from arrival (waiting for a permit included) to the engine's first step for it.",
        )],
        vllm: &[named(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )],
    },
    Series {
        kind: "histogram",
        source: Source::Histogram(|m| &m.prefill_time),
        ours: &[named(
            "novainfer:request_prefill_time_seconds",
            "Time from the engine's first step for a request to its first token.",
        )],
        vllm: &[named(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )],
    },
    Series {
        kind: "histogram",
        source: Source::Histogram(|m| &m.itl),
        ours: &[named(
            "novainfer:inter_token_latency_seconds",
            "Time between successive tokens of a stream.",
        )],
        vllm: &[named(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
        )],
    },
    Series {
        kind: "histogram",
        source: Source::Histogram(|m| &m.e2e),
        ours: &[named(
            "novainfer:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
        )],
        vllm: &[named(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
        )],
    },
];

/// Renders, for `models`, every series of [`SERIES`] under the names `spelled` gives it,
/// each sample labelled by `labels`.
pub(crate) fn render_series(
    out: &mut String,
    models: &[ModelSnapshot<'_>],
    spelled: fn(&Series) -> &'static [Named],
    labels: fn(&ModelSnapshot<'_>) -> String,
) {
    for series in SERIES {
        for Named { name, help } in spelled(series) {
            header(out, name, series.kind, help);
            for m in models {
                let l = labels(m);
                match series.source {
                    Source::Engine(value) => {
                        if let Some(stats) = &m.engine {
                            let _ = writeln!(out, "{name}{{{l}}} {}", value(stats));
                        }
                    }
                    Source::Count(value) => {
                        let _ = writeln!(out, "{name}{{{l}}} {}", value(m.metrics));
                    }
                    Source::Histogram(histogram) => histogram(m.metrics).render(out, name, &l),
                }
            }
        }
    }
}

/// The `novainfer:*` exposition: the per-model series of [`SERIES`] and ours alone (waiting
/// requests by priority, finish reasons, the server's admission). vLLM's spelling is
/// [`crate::vllm_metrics::render`], appended by the caller.
pub fn render(
    server: &ServerMetrics,
    queued: usize,
    in_flight: usize,
    models: &[ModelSnapshot<'_>],
) -> String {
    let mut out = String::new();
    render_series(
        &mut out,
        models,
        |s| s.ours,
        |m| format!("model_name=\"{}\"", m.name),
    );
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
        let models = [ModelSnapshot {
            name: "m",
            metrics: &metrics,
            engine: Some(engine),
            kv_config: &crate::kv_config::KvConfig {
                layout: "block",
                block_size: 16,
                dtype: "f16",
                prefix_caching: true,
            },
            max_loras: 0,
        }];
        // As the /metrics route composes it: ours, then vLLM's spelling.
        let mut text = render(&server, 3, 1, &models);
        crate::vllm_metrics::render(&mut text, &models);
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

#[cfg(test)]
mod one_registry {
    use super::*;

    /// The values of `name`'s samples in `text`, label sets dropped, in order.
    fn values<'t>(text: &'t str, name: &str) -> Vec<&'t str> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit(' ').next())
            .collect()
    }

    /// Every series both namespaces export shows the same values under each of its names
    /// (defined once, in `SERIES`), and each namespace has every name once.
    #[test]
    fn both_namespaces_render_each_series_from_one_definition() {
        let metrics = ModelMetrics::default();
        metrics.prompt_tokens.fetch_add(11, Ordering::Relaxed);
        metrics.generation_tokens.fetch_add(7, Ordering::Relaxed);
        metrics.ttft.observe(0.3);
        metrics.itl.observe(0.02);
        let engine = EngineStats {
            num_running: 2,
            num_waiting: 4,
            num_preemptions: 1,
            num_drafts: 5,
            num_draft_tokens: 9,
            num_accepted_tokens: 6,
            kv: novainfer_core::KvCacheStats {
                num_blocks: 10,
                num_used_blocks: 5,
                num_query_tokens: 40,
                num_hit_tokens: 20,
                ..Default::default()
            },
            ..EngineStats::default()
        };
        let kv = crate::kv_config::KvConfig {
            layout: "block",
            block_size: 16,
            dtype: "f16",
            prefix_caching: true,
        };
        let models = [
            ModelSnapshot {
                name: "m",
                metrics: &metrics,
                engine: Some(engine),
                kv_config: &kv,
                max_loras: 0,
            },
            // A model whose engine did not answer: no engine samples, server ones still.
            ModelSnapshot {
                name: "idle",
                metrics: &metrics,
                engine: None,
                kv_config: &kv,
                max_loras: 0,
            },
        ];
        let mut text = render(&ServerMetrics::default(), 0, 0, &models);
        crate::vllm_metrics::render(&mut text, &models);
        for series in SERIES {
            let suffix = if series.kind == "histogram" {
                "_count"
            } else {
                ""
            };
            let spelled: Vec<&Named> = series.ours.iter().chain(series.vllm).collect();
            assert!(!spelled.is_empty());
            let first = format!("{}{suffix}", spelled[0].name);
            let want = values(&text, &first);
            let samples = match series.source {
                Source::Engine(_) => 1,
                _ => 2,
            };
            assert_eq!(
                want.len(),
                samples,
                "{first}: one sample per answering model"
            );
            for named in &spelled {
                let name = format!("{}{suffix}", named.name);
                assert_eq!(values(&text, &name), want, "{name} shows {first}'s values");
                let typed = format!("# TYPE {} {}", named.name, series.kind);
                assert_eq!(text.lines().filter(|l| *l == typed).count(), 1, "{typed}");
            }
        }
    }
}
