//! The connection layer: accepts TCP connections and drives each with hyper's HTTP/1
//! server, adding what `axum::serve` lacks.
//!
//! - A cap on open connections (`--max-connections`): one more is answered with a 503 JSON
//!   error and closed (logged), so a flood cannot exhaust file descriptors or memory.
//! - A header read timeout (hyper's own timer): a client that trickles its headers
//!   (slowloris) is disconnected. Hyper runs that timer also while a kept-alive connection
//!   waits for its next request, so an idle connection is closed after at most that long.
//! - An idle timeout: a connection with no request in flight for `--idle-timeout` is
//!   closed; one with a request in flight (a long stream) never is.
//! - Draining: when `stop` fires, accepting stops and every connection is told to close
//!   after its current response (hyper's graceful shutdown); [`Connections::wait_idle`]
//!   tells when all have gone.
//!
//! The body read deadline is applied where bodies are read ([`crate::routes`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use crate::error::ApiError;

#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_read: Duration,
    pub idle: Duration,
    pub max_connections: usize,
}

/// Open connections, counted by the permits they hold.
#[derive(Clone)]
pub struct Connections {
    permits: Arc<Semaphore>,
    max: usize,
}

impl Connections {
    pub fn new(max: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    pub fn num_open(&self) -> usize {
        self.max - self.permits.available_permits()
    }

    /// Waits until every connection has closed, or `limit` has passed; true if all closed.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.num_open() > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }
}

/// Accepts until `stop` turns true.
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    conns: Connections,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors, say: back off rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => return,
        };
        match conns.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                tokio::spawn(serve_connection(
                    stream,
                    app.clone(),
                    limits,
                    stop.clone(),
                    permit,
                ));
            }
            Err(_) => {
                tracing::warn!(%peer, max_connections = limits.max_connections, "connection refused: --max-connections reached");
                tokio::spawn(refuse(stream, limits.max_connections));
            }
        }
    }
}

/// Answers a connection over the cap with a 503 in OpenAI's shape and closes it.
async fn refuse(stream: TcpStream, max: usize) {
    let body = ApiError::unavailable(format!(
        "the server has reached its limit of {max} open connections (--max-connections); retry later"
    ))
    .with_code("too_many_connections")
    .body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    // Bounded: a refused peer that does not read gets no more than a second of our time.
    let written = tokio::time::timeout(Duration::from_secs(1), async {
        // Drain what the peer sent already: closing with unread input would send a reset,
        // which can destroy our answer before the peer reads it.
        let mut scratch = [0u8; 4096];
        while matches!(stream.try_read(&mut scratch), Ok(n) if n > 0) {}
        stream.writable().await?;
        stream.try_write(response.as_bytes())
    })
    .await;
    if let Ok(std) = stream.into_std() {
        let _ = std.shutdown(std::net::Shutdown::Write);
    }
    drop(written);
}

/// Resolves once `stop` is true (the borrow it takes is not held across an await).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Requests in flight on one connection and when the last one ended.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    last_done_ms: AtomicU64,
}

impl Activity {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn idle_for(&self) -> Option<Duration> {
        (self.in_flight.load(Ordering::SeqCst) == 0).then(|| {
            let since = self
                .now_ms()
                .saturating_sub(self.last_done_ms.load(Ordering::SeqCst));
            Duration::from_millis(since)
        })
    }
}

/// Held by a request from arrival until its response body is dropped (sent or abandoned).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_done_ms.store(self.0.now_ms(), Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in flight until it is dropped.
struct Counted {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity {
        opened: Instant::now(),
        in_flight: AtomicUsize::new(0),
        last_done_ms: AtomicU64::new(0),
    });
    let service = hyper::service::service_fn({
        let activity = activity.clone();
        move |request: hyper::Request<Incoming>| {
            let in_flight = InFlight::new(&activity);
            let app = app.clone();
            async move {
                let response = app
                    .oneshot(request.map(Body::new))
                    .await
                    .unwrap_or_else(|never| match never {});
                Ok::<_, std::convert::Infallible>(response.map(|inner| Counted {
                    inner,
                    _in_flight: in_flight,
                }))
            }
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut check = tokio::time::interval(
        (limits.idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
    );
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    // Header timeouts, resets and malformed requests end here.
                    tracing::debug!(error = %e, "connection ended");
                }
                return;
            }
            _ = stopped(&mut stop), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = check.tick(), if !closing => {
                if activity.idle_for().is_some_and(|idle| idle >= limits.idle) {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}
