//! Finished generation requests counted by endpoint (`novainfer:endpoint_requests_total`), so a
//! dashboard can tell chat traffic from Responses or Anthropic Messages traffic. Kept apart from
//! the per-model series in `crate::metrics`, which stay labelled by model only.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::FINISH_REASONS;

/// The generation endpoints, as `Launch::endpoint` names them.
pub const ENDPOINTS: &[&str] = &["completions", "chat", "infill", "responses", "messages"];

pub struct EndpointMetrics {
    /// Endpoint-major: `counts[e * FINISH_REASONS.len() + r]`.
    counts: Vec<AtomicU64>,
}

impl Default for EndpointMetrics {
    fn default() -> Self {
        Self {
            counts: (0..ENDPOINTS.len() * FINISH_REASONS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }
}

impl EndpointMetrics {
    /// Counts one finished request; unknown names are not counted (they would be a bug).
    pub fn finished(&self, endpoint: &str, reason: &str) {
        let e = ENDPOINTS.iter().position(|n| *n == endpoint);
        let r = FINISH_REASONS.iter().position(|n| *n == reason);
        if let (Some(e), Some(r)) = (e, r) {
            self.counts[e * FINISH_REASONS.len() + r].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The Prometheus text of the series.
    pub fn render(&self, out: &mut String) {
        let name = "novainfer:endpoint_requests_total";
        let _ = writeln!(
            out,
            "# HELP {name} Finished generation requests by endpoint and finish reason.\n# TYPE {name} counter"
        );
        for (e, endpoint) in ENDPOINTS.iter().enumerate() {
            for (r, reason) in FINISH_REASONS.iter().enumerate() {
                let count = self.counts[e * FINISH_REASONS.len() + r].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{name}{{endpoint=\"{endpoint}\",finished_reason=\"{reason}\"}} {count}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_under_their_endpoint_and_reason() {
        let m = EndpointMetrics::default();
        m.finished("responses", "stop");
        m.finished("responses", "stop");
        m.finished("messages", "abort");
        m.finished("nope", "stop");
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains(
            "novainfer:endpoint_requests_total{endpoint=\"responses\",finished_reason=\"stop\"} 2"
        ));
        assert!(out.contains(
            "novainfer:endpoint_requests_total{endpoint=\"messages\",finished_reason=\"abort\"} 1"
        ));
        assert!(out.contains(
            "novainfer:endpoint_requests_total{endpoint=\"chat\",finished_reason=\"stop\"} 0"
        ));
    }
}
