//! The engine-facing sink and the task that owns the ZMQ sockets.
//!
//! The engine thread calls [`KvEventPublisher::publish`] once per step with that step's
//! events: a `try_send` into a bounded queue, so a slow or absent subscriber can never make
//! the step loop wait; a full queue drops the batch and counts it
//! (`novainfer:kv_events_dropped_total`). Subscribers see the gap in sequence numbers and
//! can ask the replay socket for what the buffer still holds.

use std::collections::VecDeque;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use novainfer_core::{KvEvent, KvEventSink};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage, ZmqResult};

use super::config::{bind_or_connect, KvEventsConfig};
use super::encode::{encode_batch, Encoding};

/// The replay socket's end-of-replay marker: sequence number -1 with an empty payload.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

#[derive(Debug, thiserror::Error)]
#[error("--kv-events-config: cannot open {endpoint}: {source}")]
pub struct PublisherError {
    endpoint: String,
    source: zeromq::ZmqError,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    dropped: AtomicU64,
}

#[derive(Debug)]
pub struct KvEventPublisher {
    queue: mpsc::Sender<Vec<KvEvent>>,
    counters: Arc<Counters>,
}

impl KvEventSink for KvEventPublisher {
    fn publish(&self, events: Vec<KvEvent>) {
        if self.queue.try_send(events).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl KvEventPublisher {
    /// Opens the sockets (on the current tokio runtime) and starts the sending task.
    pub async fn start(
        config: &KvEventsConfig,
        encoding: Encoding,
    ) -> Result<Arc<Self>, PublisherError> {
        let mut publisher = PubSocket::new();
        open(&mut publisher, &config.endpoint).await?;
        let replay = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut router = RouterSocket::new();
                open(&mut router, endpoint).await?;
                Some(router)
            }
            None => None,
        };
        let (queue, batches) = mpsc::channel(config.max_queue_size);
        let counters = Arc::new(Counters::default());
        let task = SendTask {
            publisher,
            replay,
            topic: Bytes::from(config.topic.clone().into_bytes()),
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
            counters: counters.clone(),
            encoding,
        };
        tokio::spawn(task.run(batches));
        tracing::info!(endpoint = %config.endpoint, replay = ?config.replay_endpoint, topic = %config.topic, "publishing KV-cache events");
        Ok(Arc::new(Self { queue, counters }))
    }

    /// This publisher's `novainfer:kv_events_*` series, labelled with the model's name.
    pub fn render_metrics(&self, out: &mut String, model_name: &str) {
        for (name, help, value) in [
            (
                "novainfer:kv_events_published_total",
                "KV-cache event batches (one per engine step with events) sent on the ZMQ socket.",
                &self.counters.published,
            ),
            (
                "novainfer:kv_events_dropped_total",
                "KV-cache event batches dropped because the publisher's queue was full.",
                &self.counters.dropped,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model_name=\"{model_name}\"}} {}",
                value.load(Ordering::Relaxed)
            );
        }
    }
}

async fn open(socket: &mut impl Socket, endpoint: &str) -> Result<(), PublisherError> {
    let (bind, address) = bind_or_connect(endpoint);
    let opened = if bind {
        socket.bind(&address).await.map(|_| ())
    } else {
        socket.connect(&address).await
    };
    opened.map_err(|source| PublisherError {
        endpoint: endpoint.to_owned(),
        source,
    })
}

struct SendTask {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    /// The last `buffer_steps` batches, for replay: (sequence number, payload).
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
    counters: Arc<Counters>,
    encoding: Encoding,
}

impl SendTask {
    async fn run(mut self, mut batches: mpsc::Receiver<Vec<KvEvent>>) {
        loop {
            tokio::select! {
                batch = batches.recv() => match batch {
                    Some(events) => self.send(&events).await,
                    // The engine is gone.
                    None => return,
                },
                request = recv(&mut self.replay) => match request {
                    Ok(request) => {
                        if let Err(e) = self.replay(request).await {
                            tracing::warn!(error = %e, "KV-cache event replay failed");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "KV-cache event replay socket"),
                },
            }
        }
    }

    async fn send(&mut self, events: &[KvEvent]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_batch(unix_seconds(), events, self.encoding));
        let mut message = ZmqMessage::from(self.topic.clone());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(payload.clone());
        match self.publisher.send(message).await {
            Ok(()) => {
                self.counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, seq, "KV-cache event batch not sent"),
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// A request is `[identity, (empty delimiter,) start sequence number (8 bytes, big-endian)]`
    /// (a REQ client sends the delimiter, a DEALER may not). Every buffered batch from that
    /// number on is sent back as `[identity, (delimiter,) seq, payload]`, then the end marker.
    async fn replay(&mut self, request: ZmqMessage) -> ZmqResult<()> {
        let Some(router) = self.replay.as_mut() else {
            return Ok(());
        };
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            return Ok(());
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!(frames = frames.len(), "malformed KV-cache replay request");
            return Ok(());
        };
        let start = u64::from_be_bytes(start);
        let delimited = frames.len() == 3 && frames[1].is_empty();
        let reply = |seq: Bytes, payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            if delimited {
                m.push_back(Bytes::new());
            }
            m.push_back(seq);
            m.push_back(payload);
            m
        };
        for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
            router
                .send(reply(
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.clone(),
                ))
                .await?;
        }
        router
            .send(reply(Bytes::copy_from_slice(&END_SEQ), Bytes::new()))
            .await
    }
}

/// The next replay request, or never when there is no replay socket.
async fn recv(replay: &mut Option<RouterSocket>) -> ZmqResult<ZmqMessage> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        // Nobody drains the queue: the sending task is stuck (a slow subscriber, say).
        let (queue, _batches) = mpsc::channel(1);
        let publisher = KvEventPublisher {
            queue,
            counters: Arc::new(Counters::default()),
        };
        for _ in 0..3 {
            publisher.publish(vec![KvEvent::AllBlocksCleared]);
        }
        let mut text = String::new();
        publisher.render_metrics(&mut text, "m");
        assert!(
            text.contains("novainfer:kv_events_dropped_total{model_name=\"m\"} 2"),
            "{text}"
        );
        assert!(text.contains("novainfer:kv_events_published_total{model_name=\"m\"} 0"));
    }
}
