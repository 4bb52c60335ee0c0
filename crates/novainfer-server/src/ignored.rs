//! Fields accepted as true no-ops (`store`, `metadata`, `service_tier`, and /infill's
//! performance hints): each is logged once
//! per process, so an operator learns that clients send it without a line per request.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

fn seen() -> &'static Mutex<HashSet<&'static str>> {
    static SEEN: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    SEEN.get_or_init(Mutex::default)
}

/// Logs each field of `fields` the first time any request carries it.
pub fn log_once(endpoint: &str, fields: &[&'static str]) {
    if fields.is_empty() {
        return;
    }
    let Ok(mut seen) = seen().lock() else { return };
    for &field in fields {
        if seen.insert(field) {
            tracing::info!(
                target: "novainfer::request",
                endpoint,
                field,
                "`{field}` accepted and ignored: it changes nothing this server does (logged once)"
            );
        }
    }
}
