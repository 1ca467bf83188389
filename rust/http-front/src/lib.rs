//! The HTTP/1.1 front both CosyVoice3 Rust servers serve through (hyper 1 + tokio): it bounds what a
//! hostile or broken client can hold, so that the server's own work (synthesis) is the only thing that takes
//! time.
//!
//! - a request's head must arrive within [`Settings::header_timeout`] (slowloris);
//! - its body is read with [`Settings::body_timeout`] between bytes and at [`Settings::body_min_rate`] on
//!   average ([`Body`], [`read_body`]: the handler answers the [`BodyError`]); a connection answered before
//!   its body was read sends its FIN and drops what still comes for a while, so the client reads the answer;
//! - an idle keep-alive connection is closed after [`Settings::keep_alive_timeout`];
//! - at most [`Settings::max_connections`] connections are served; the next ones get the handler's
//!   [`Handler::over_capacity`] answer (503) and are closed;
//! - on shutdown, running requests get [`Settings::grace`] (plus [`Settings::close_delay`] for the answers
//!   the application gives when it cancels them at the grace), then every connection is closed, so the
//!   server always returns.
//!
//! A server implements [`Handler`] and calls [`serve`]; [`json::depth_exceeds`] checks a JSON body's
//! nesting before any parser sees it. What both servers answer alike lives here too: API keys ([`auth`]),
//! CORS ([`cors`]), canned refusals ([`answer`]), the Prometheus families ([`metrics`]) and `.env` ([`dotenv`]).

pub mod answer;
pub mod auth;
mod body;
mod connection;
pub mod cors;
pub mod dotenv;
pub mod json;
pub mod metrics;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tracing::{error, info, warn};

pub use body::{read_body, Body, BodyError};

/// What an answer's body may be: whole bytes ([`full`]) or a stream.
pub type ResponseBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The bounds of [`serve`]; `Default` gives the documented defaults (docs/servers.md).
#[derive(Clone, Debug)]
pub struct Settings {
    /// a request's head (request line and headers) must be complete this long after the connection opens
    /// or its previous answer is sent
    pub header_timeout: Duration,
    /// the longest wait for the next bytes of a request body
    pub body_timeout: Duration,
    /// bytes per second a body must average once it has been read for `body_timeout` (0: no minimum)
    pub body_min_rate: u64,
    /// an open connection with no request in progress and no new bytes is closed after this
    pub keep_alive_timeout: Duration,
    /// connections served at once; one more is answered `over_capacity` and closed
    pub max_connections: usize,
    /// on shutdown, running requests may finish this long
    pub grace: Duration,
    /// after the grace, connections stay open this much longer for the answers of cancelled requests
    pub close_delay: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            body_min_rate: 1024,
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 512,
            grace: Duration::from_secs(30),
            close_delay: Duration::from_secs(2),
        }
    }
}

/// A server's routes, as the front calls them.
pub trait Handler: Send + Sync + 'static {
    /// The answer to one request (its body is a bounded [`Body`]).
    fn handle(&self, request: Request<Body>) -> impl Future<Output = Response<ResponseBody>> + Send;

    /// The answer a connection over [`Settings::max_connections`] gets before it is closed.
    fn over_capacity(&self) -> Response<ResponseBody> {
        let body = r#"{"error":{"message":"the server has too many connections open; retry shortly","type":"busy","field":null,"param":null}}"#;
        let mut response = Response::new(full(body));
        *response.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
        response.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
        response.headers_mut().insert("retry-after", hyper::header::HeaderValue::from_static("1"));
        response
    }
}

/// Whole bytes as a [`ResponseBody`].
pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into()).map_err(|never: Infallible| match never {}).boxed_unsync()
}

/// Serve `handler` on `listener` until `shutdown` completes, then stop accepting, let running requests
/// finish within the grace (plus the close delay) and close every connection. Returns once all are closed.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    settings: Settings,
    handler: Arc<H>,
    shutdown: impl Future<Output = ()>,
) {
    let settings = Arc::new(settings);
    let served = Arc::new(Semaphore::new(settings.max_connections));
    // a refused connection is answered, not held: at most as many at once as are served
    let refused = Arc::new(Semaphore::new(settings.max_connections.max(1)));
    let (stop, stopping) = watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // out of file descriptors and the like: wait a moment rather than spin
                        warn!("accepting a connection failed: {}", e);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                if let Ok(permit) = served.clone().try_acquire_owned() {
                    let task = connection::serve(stream, settings.clone(), handler.clone(), stopping.clone());
                    connections.spawn(async move {
                        task.await;
                        drop(permit);
                    });
                } else if let Ok(permit) = refused.clone().try_acquire_owned() {
                    info!(%peer, "over {} connections: answered 503", settings.max_connections);
                    let task = connection::refuse(stream, settings.clone(), handler.clone(), stopping.clone());
                    connections.spawn(async move {
                        task.await;
                        drop(permit);
                    });
                } // else: dropped at once, the only bound left against a flood
            }
        }
    }
    drop(listener);
    let _ = stop.send(true);
    info!(
        "stopped accepting; {} connection(s) open, running requests may finish within {:.1} s",
        connections.len(),
        settings.grace.as_secs_f64()
    );
    // each connection closes itself at the grace plus the close delay; this bound is a backstop
    let deadline = settings.grace + settings.close_delay + Duration::from_secs(1);
    if tokio::time::timeout(deadline, async { while connections.join_next().await.is_some() {} }).await.is_err() {
        warn!("{} connection(s) still open after the grace: closed", connections.len());
        connections.abort_all();
    }
}

/// Resolves at SIGTERM or Ctrl-C, the signals both servers drain on; where SIGTERM cannot be listened for it
/// says so and never resolves (no signal could then be told from a failure).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(stream) => stream,
        Err(e) => {
            error!("cannot listen for SIGTERM: {e}");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = terminate.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
