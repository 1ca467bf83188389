//! A request body read under the front's time bounds: no wait for the next bytes longer than the body
//! timeout, and, once it has been read that long, an average rate of at least the minimum.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

/// Why a body could not be read whole.
#[derive(Debug)]
pub enum BodyError {
    /// more than the handler's bound
    TooLarge,
    /// no bytes for the body timeout, or fewer on average than the minimum rate
    TimedOut,
    /// the client closed the connection or broke the framing
    Broken(hyper::Error),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge => write!(f, "the body is larger than allowed"),
            BodyError::TimedOut => write!(f, "the body was sent too slowly"),
            BodyError::Broken(e) => write!(f, "the body could not be read: {}", e),
        }
    }
}

impl std::error::Error for BodyError {}

/// A request's body ([`hyper::body::Incoming`]) under the body timeout and minimum rate.
pub struct Body {
    inner: Incoming,
    timeout: Duration,
    min_rate: u64,
    started: Option<Instant>,
    last: Instant,
    received: u64,
    timer: Pin<Box<Sleep>>,
}

impl Body {
    pub(crate) fn new(inner: Incoming, timeout: Duration, min_rate: u64) -> Body {
        let now = Instant::now();
        let timer = Box::pin(tokio::time::sleep_until(now));
        Body { inner, timeout, min_rate, started: None, last: now, received: 0, timer }
    }

}

/// When a body is too slow unless more bytes come: `timeout` after the `last` bytes, or when the average
/// since it `started` falls under `min_rate` bytes per second (never before `timeout` has passed).
fn deadline(started: Instant, last: Instant, received: u64, timeout: Duration, min_rate: u64) -> Instant {
    let idle = last + timeout;
    if min_rate == 0 {
        return idle;
    }
    let earned = Duration::from_secs_f64(received as f64 / min_rate as f64);
    idle.min(started + timeout.max(earned))
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let started = *this.started.get_or_insert_with(|| {
            this.last = Instant::now(); // the clock starts when the handler first reads
            this.last
        });
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received += data.len() as u64;
                    this.last = Instant::now();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(BodyError::Broken(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let deadline = deadline(started, this.last, this.received, this.timeout, this.min_rate);
                this.timer.as_mut().reset(deadline);
                match this.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::TimedOut))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The whole body, refused as [`BodyError::TooLarge`] as soon as it passes `max_bytes` (a declared
/// Content-Length over it, before reading anything).
pub async fn read_body(mut body: Body, max_bytes: u64) -> Result<Bytes, BodyError> {
    if hyper::body::Body::size_hint(&body).lower() > max_bytes {
        return Err(BodyError::TooLarge);
    }
    let mut raw = BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            if (raw.len() + data.len()) as u64 > max_bytes {
                return Err(BodyError::TooLarge);
            }
            raw.extend_from_slice(&data);
        }
    }
    Ok(raw.freeze())
}

#[cfg(test)]
mod tests {
    use super::deadline;
    use std::time::Duration;
    use tokio::time::Instant;

    #[test]
    fn a_body_is_cut_after_the_timeout_without_bytes_or_under_the_rate() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // nothing yet: the timeout from the start
        assert_eq!(deadline(t0, t0, 0, s(2), 100), t0 + s(2));
        // 1000 bytes at 100 B/s earn 10 s, but a silence of 2 s after the last bytes ends it first
        assert_eq!(deadline(t0, t0 + s(3), 1000, s(2), 100), t0 + s(5));
        // trickling (last byte just now): the average decides, never before the timeout
        assert_eq!(deadline(t0, t0 + s(9), 300, s(2), 100), t0 + s(3));
        assert_eq!(deadline(t0, t0 + s(1), 50, s(2), 100), t0 + s(2));
        // no minimum rate: only the silence counts
        assert_eq!(deadline(t0, t0 + s(9), 1, s(2), 0), t0 + s(11));
    }
}
