//! vLLM's `KVEventsConfig` (`--kv-events-config '<json>'`), with vLLM's field names and
//! defaults. Unknown fields are refused, naming the field, rather than silently ignored.

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum KvEventsConfigError {
    #[error("--kv-events-config: {0}")]
    Json(String),
    #[error("--kv-events-config: `{field}` {reason}")]
    Invalid { field: &'static str, reason: String },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; default: `zmq` when events are enabled, else `null`.
    #[serde(default)]
    pub publisher: Option<String>,
    /// The PUB socket: `tcp://*:5557` (or `tcp://[::]:…`) binds, `tcp://host:port` connects
    /// (vLLM's rule: bind when the host is a wildcard).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// The ROUTER socket answering replay requests; none by default.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches (engine steps) kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// Accepted for vLLM compatibility; the pure-Rust ZMQ socket has no high-water mark (a
    /// slow subscriber slows the publisher task, whose bounded queue then drops batches).
    #[serde(default = "default_queue")]
    pub hwm: usize,
    /// Batches waiting to be sent; past it, new batches are dropped (and counted).
    #[serde(default = "default_queue")]
    pub max_queue_size: usize,
    #[serde(default)]
    pub topic: String,
}

fn default_endpoint() -> String {
    "tcp://*:5557".to_owned()
}
fn default_buffer_steps() -> usize {
    10_000
}
fn default_queue() -> usize {
    100_000
}

impl KvEventsConfig {
    /// Parses and checks the JSON. `Ok(None)`: events are off (not enabled, or the `null`
    /// publisher).
    pub fn parse(json: &str) -> Result<Option<Self>, KvEventsConfigError> {
        let config: Self =
            serde_json::from_str(json).map_err(|e| KvEventsConfigError::Json(e.to_string()))?;
        let publisher = config.publisher.clone().unwrap_or_else(|| {
            if config.enable_kv_cache_events {
                "zmq"
            } else {
                "null"
            }
            .to_owned()
        });
        match publisher.as_str() {
            "null" => return Ok(None),
            "zmq" => {}
            other => {
                return Err(KvEventsConfigError::Invalid {
                    field: "publisher",
                    reason: format!("must be \"zmq\" or \"null\", got {other:?}"),
                })
            }
        }
        if !config.enable_kv_cache_events {
            return Ok(None);
        }
        if config.max_queue_size == 0 {
            return Err(KvEventsConfigError::Invalid {
                field: "max_queue_size",
                reason: "must be at least 1".to_owned(),
            });
        }
        for (field, endpoint) in [
            ("endpoint", Some(&config.endpoint)),
            ("replay_endpoint", config.replay_endpoint.as_ref()),
        ] {
            if let Some(e) = endpoint {
                if !e.starts_with("tcp://") {
                    return Err(KvEventsConfigError::Invalid {
                        field,
                        reason: format!("must be a tcp:// endpoint, got {e:?}"),
                    });
                }
            }
        }
        Ok(Some(config))
    }
}

/// How to open a socket on `endpoint`: bind (wildcard host, as vLLM decides) or connect.
/// The wildcard is spelled as an address the socket library can bind.
pub fn bind_or_connect(endpoint: &str) -> (bool, String) {
    if let Some(port) = endpoint.strip_prefix("tcp://*:") {
        (true, format!("tcp://0.0.0.0:{port}"))
    } else if endpoint.contains("::") {
        (true, endpoint.to_owned())
    } else {
        (false, endpoint.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_spellings_and_defaults() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv@pod@m",
                "replay_endpoint": "tcp://*:5558", "buffer_steps": 8}"#,
        )
        .expect("valid")
        .expect("on");
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert_eq!((c.buffer_steps, c.max_queue_size), (8, 100_000));
        assert_eq!(c.topic, "kv@pod@m");
        // Enabled without a publisher: zmq, as vLLM.
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#)
            .expect("valid")
            .is_some());
    }

    #[test]
    fn off_and_bad_configs() {
        for off in [
            r#"{}"#,
            r#"{"enable_kv_cache_events": true, "publisher": "null"}"#,
        ] {
            assert!(
                KvEventsConfig::parse(off).expect("valid").is_none(),
                "{off}"
            );
        }
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "nats"}"#)
            .expect_err("unknown publisher");
        assert!(e.to_string().contains("`publisher`"), "{e}");
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "bufer_steps": 3}"#)
            .expect_err("typo");
        assert!(e.to_string().contains("bufer_steps"), "{e}");
        let e =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}"#)
                .expect_err("transport");
        assert!(e.to_string().contains("`endpoint`"), "{e}");
    }

    #[test]
    fn wildcards_bind_and_hosts_connect() {
        assert_eq!(
            bind_or_connect("tcp://*:5557"),
            (true, "tcp://0.0.0.0:5557".to_owned())
        );
        assert!(bind_or_connect("tcp://[::]:5557").0);
        assert_eq!(
            bind_or_connect("tcp://router:5557"),
            (false, "tcp://router:5557".to_owned())
        );
    }
}
