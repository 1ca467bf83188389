//! One connection under the front's bounds: hyper's header read timeout, the idle keep-alive close, the
//! shutdown that drains it (or closes it at once when no request runs) and ends it at the grace, and the
//! lingering close of a connection hyper ends itself (an answer given before the body was read).

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONNECTION};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::{Body, Handler, ResponseBody, Settings};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the watchdogs see of a connection: bytes read, requests running, and the bytes read when the last
/// one ended (more since then: the next request's head is arriving).
#[derive(Default)]
struct Activity {
    read: AtomicU64,
    read_when_settled: AtomicU64,
    in_flight: AtomicUsize,
    settled: Notify,
}

impl Activity {
    fn head_in_progress(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
            && self.read.load(Ordering::SeqCst) > self.read_when_settled.load(Ordering::SeqCst)
    }
}

/// Resolves once the connection has run no request and read no byte for `timeout`.
async fn idle(activity: &Activity, timeout: Duration) {
    loop {
        let settled = activity.settled.notified();
        if activity.in_flight.load(Ordering::SeqCst) > 0 {
            settled.await;
            continue;
        }
        let seen = activity.read.load(Ordering::SeqCst);
        tokio::time::sleep(timeout).await;
        if activity.in_flight.load(Ordering::SeqCst) == 0 && activity.read.load(Ordering::SeqCst) == seen {
            return;
        }
    }
}

/// Counts one running request from its head until its answer's body is done (or dropped).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> InFlight {
        activity.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        activity.read_when_settled.store(activity.read.load(Ordering::SeqCst), Ordering::SeqCst);
        if activity.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            activity.settled.notify_waiters();
        }
    }
}

/// An answer's body that holds its request's [`InFlight`] until hyper has taken all of it.
struct Tracked {
    inner: ResponseBody,
    _in_flight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, counting the bytes read from it.
struct Counted {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        self.activity.read.fetch_add(read, Ordering::SeqCst);
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn builder(settings: &Settings) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(settings.header_timeout);
    builder
}

/// Serve one connection's requests until the client closes it, a bound closes it, or the shutdown ends it.
pub(crate) async fn serve<H: Handler>(
    stream: TcpStream,
    settings: Arc<Settings>,
    handler: Arc<H>,
    mut stopping: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::default());
    let io = TokioIo::new(Counted { inner: stream, activity: activity.clone() });
    let (body_timeout, min_rate) = (settings.body_timeout, settings.body_min_rate);
    let counter = activity.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let in_flight = InFlight::start(&counter);
        let handler = handler.clone();
        Box::pin(async move {
            let request = request.map(|body| Body::new(body, body_timeout, min_rate));
            let response = handler.handle(request).await;
            Ok::<_, Infallible>(response.map(|inner| Tracked { inner, _in_flight: in_flight }.boxed_unsync()))
        })
    });
    let mut connection = builder(&settings).serve_connection(io, service);
    let idle = idle(&activity, settings.keep_alive_timeout);
    tokio::pin!(idle);
    let (mut closing, mut stopped) = (false, false);
    let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let ends = tokio::time::sleep_until(far);
    tokio::pin!(ends);
    let ended_itself = loop {
        tokio::select! {
            done = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => {
                break done.is_ok() && !closing && !stopped;
            }
            _ = &mut idle, if !closing => {
                closing = true;
                Pin::new(&mut connection).graceful_shutdown();
            }
            changed = stopping.changed(), if !stopped => {
                stopped = true;
                if changed.is_err() || activity.head_in_progress() {
                    return; // no request runs here: a head half sent is not waited for
                }
                Pin::new(&mut connection).graceful_shutdown(); // idle: closed now; running: after its answer
                ends.as_mut().reset(Instant::now() + settings.grace + settings.close_delay);
            }
            _ = &mut ends => return,
        }
    };
    let mut stream = connection.into_parts().io.into_inner().inner;
    if ended_itself {
        linger(&mut stream, &mut stopping).await;
    } else {
        let _ = stream.shutdown().await;
    }
}

/// How long a connection hyper ended itself still reads (and drops) what its client sends.
const LINGER: Duration = Duration::from_secs(2);

/// Send the FIN after the last answer, then read and drop the client's bytes until it closes, [`LINGER`]
/// passes or the server stops. A socket closed with bytes unread, or receiving bytes after its close, answers
/// with a reset, and a client still sending its body (answered early: the 408 of a slow body) would lose the
/// answer it has not read yet.
async fn linger(stream: &mut TcpStream, stopping: &mut watch::Receiver<bool>) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut sink = [0u8; 8192];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        _ = tokio::time::timeout(LINGER, drain) => {}
        _ = stopping.changed() => {}
    }
}

/// A connection over the cap: `handler`'s over-capacity answer to its first request, then closed (lingering:
/// a client may still be sending that request's body).
pub(crate) async fn refuse<H: Handler>(
    stream: TcpStream,
    settings: Arc<Settings>,
    handler: Arc<H>,
    mut stopping: watch::Receiver<bool>,
) {
    let service = service_fn(move |_request: Request<Incoming>| {
        let mut response = handler.over_capacity();
        response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
        std::future::ready(Ok::<_, Infallible>(response))
    });
    let mut builder = builder(&settings);
    builder.keep_alive(false);
    let mut connection = builder.serve_connection(TokioIo::new(stream), service);
    let bound = settings.header_timeout + Duration::from_secs(1);
    let answered = tokio::select! {
        done = tokio::time::timeout(bound, std::future::poll_fn(|cx| connection.poll_without_shutdown(cx))) => {
            matches!(done, Ok(Ok(())))
        }
        _ = stopping.changed() => false,
    };
    if answered {
        linger(&mut connection.into_parts().io.into_inner(), &mut stopping).await;
    }
}
