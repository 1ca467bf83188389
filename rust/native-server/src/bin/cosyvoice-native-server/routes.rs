//! The routes, in the order the Python REST server's middleware applies them: CORS (outermost), API keys
//! (the probes stay open), the body bound, then the route; every refusal in its words.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http_front::answer::{canned, header, is_json, json_response, response, set, Canned};
use http_front::auth::{key_is_valid, presented_key};
use http_front::cors::{preflight, simple_cors, Cors};
use http_front::json::Exceeded;
use http_front::metrics::Metrics;
use http_front::{full, json, read_body, Body, BodyError, ResponseBody};
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response};
use tracing::info;

use crate::errors::ApiError;
use crate::service::{Outcome, Service};

const OPEN_PATHS: [&str; 2] = ["/health", "/ready"]; // probes answer without an API key
const ROUTES: [(&str, &str); 5] =
    [("/synthesize", "POST"), ("/health", "GET"), ("/ready", "GET"), ("/speakers", "GET"), ("/metrics", "GET")];

/// The refusals answered before a route runs, rendered once.
pub struct Refusals {
    unauthorized: Canned,
    payload_too_large: Canned,
    not_found: Canned,
    method_not_allowed: Canned,
    request_timeout: Canned,
    json_too_deep: Canned,
    json_too_many: Canned,
    pub over_capacity: Canned,
}

pub struct App {
    pub service: Service,
    /// notified once the drain has cancelled what still runs: those requests are answered at once, without
    /// waiting for the engine call in progress (a long vocoder call) to return
    pub drained: tokio::sync::Notify,
    metrics: Metrics,
    cors: Option<Cors>,
    refusals: Refusals,
}

impl App {
    pub fn new(service: Service) -> App {
        let s = &service.settings;
        let refusals = Refusals {
            unauthorized: ApiError::new(
                401,
                "unauthorized",
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
            )
            .with_header("www-authenticate", "Bearer")
            .canned(),
            payload_too_large: ApiError::new(
                413,
                "payload_too_large",
                &format!("request body larger than {} bytes", s.max_body_bytes),
            )
            .canned(),
            not_found: ApiError::new(404, "not_found", "Not Found").canned(),
            method_not_allowed: ApiError::new(405, "method_not_allowed", "Method Not Allowed").canned(),
            request_timeout: ApiError::new(
                408,
                "request_timeout",
                &format!(
                    "the request body was sent too slowly (no bytes for {} s, or under {} bytes per second)",
                    crate::settings::format_g(s.front.body_timeout.as_secs_f64()),
                    s.front.body_min_rate
                ),
            )
            .with_header("connection", "close")
            .canned(),
            json_too_deep: ApiError::invalid(
                &format!("the body nests JSON deeper than {} levels", s.max_json_depth),
                None,
            )
            .canned(),
            json_too_many: ApiError::invalid(
                &format!(
                    "the body holds more than {} JSON values (array items and object members; \
                     COSYVOICE_MAX_JSON_VALUES)",
                    thousands(s.max_json_values)
                ),
                None,
            )
            .canned(),
            over_capacity: ApiError::busy(
                "the server has too many connections open; retry shortly",
                s.retry_after_seconds,
            )
            .canned(),
        };
        let cors = (!s.cors_origins.is_empty())
            .then(|| Cors::starlette(&s.cors_origins, &["X-Audio-Duration", "X-Sample-Rate"]));
        App { metrics: Metrics::new(), cors, refusals, service, drained: tokio::sync::Notify::new() }
    }

    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }
}

/// Python's `{:,}`: digits grouped by three with commas.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One request: its answer, with CORS headers, logged.
pub async fn handle(app: Arc<App>, request: Request<Body>) -> Response<ResponseBody> {
    let started = Instant::now();
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let headers = request.headers().clone();
    let origin = header(&headers, "origin");
    let response = match &app.cors {
        Some(cors)
            if origin.is_some()
                && method == Method::OPTIONS
                && headers.contains_key("access-control-request-method") =>
        {
            preflight(cors, &headers)
        }
        Some(cors) => {
            let mut response = route(&app, request).await;
            simple_cors(cors, origin.as_deref(), response.headers_mut());
            response
        }
        None => route(&app, request).await,
    };
    info!("{} {} {} {:.1} ms", method, path, response.status().as_u16(), started.elapsed().as_secs_f64() * 1000.0);
    response
}

async fn route(app: &Arc<App>, request: Request<Body>) -> Response<ResponseBody> {
    let settings = &app.service.settings;
    let path = request.uri().path().to_string();
    let authorization = header(request.headers(), "authorization").unwrap_or_default();
    let keyed = !settings.api_keys.is_empty();
    let holder = key_is_valid(&presented_key(&authorization), &settings.api_keys);
    if keyed && !OPEN_PATHS.contains(&path.as_str()) && !holder {
        return canned(&app.refusals.unauthorized);
    }
    let declared = header(request.headers(), "content-length").and_then(|n| n.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > settings.max_body_bytes) {
        if path == "/synthesize" {
            app.metrics.observe("unknown", Some("invalid_input"), 0.0, 0.0);
        }
        return canned(&app.refusals.payload_too_large);
    }
    let method = request.method().as_str().to_string();
    match ROUTES.iter().find(|(p, _)| *p == path) {
        None => canned(&app.refusals.not_found),
        Some((_, allowed)) if *allowed != method => {
            let mut response = canned(&app.refusals.method_not_allowed);
            response.headers_mut().insert("allow", HeaderValue::from_static(allowed));
            response
        }
        Some(_) => match path.as_str() {
            "/health" => health(app, keyed && holder),
            "/metrics" => {
                let (body, content_type) = app.metrics.exposition();
                let mut response = Response::new(full(body));
                set(response.headers_mut(), "content-type", &content_type);
                response
            }
            "/ready" => {
                let (status, body) = app.service.ready(!keyed || holder, keyed && holder);
                json_response(status, serde_json::to_vec(&body).expect("JSON"))
            }
            "/speakers" => json_response(200, br#"{"speakers":[]}"#.to_vec()), // no voice library here
            _ => synthesize(app, request).await,
        },
    }
}

/// `/health`: the process serves; 503 only when the model failed to load.
fn health(app: &Arc<App>, holder: bool) -> Response<ResponseBody> {
    let failure = app.service.load_error.lock().unwrap().clone();
    let body = match failure {
        None => return json_response(200, br#"{"status":"ok"}"#.to_vec()),
        Some(error) => {
            serde_json::json!({"status": "failed", "error": if holder { error } else { "see the server log".into() }})
        }
    };
    json_response(503, serde_json::to_vec(&body).expect("JSON"))
}

/// `/synthesize`: the body (bounded while read), then the engine on a blocking thread. If the client goes away
/// first, hyper drops this future: the guard then sets the request's cancel flag.
async fn synthesize(app: &Arc<App>, request: Request<Body>) -> Response<ResponseBody> {
    let started = Instant::now();
    let content_type = header(request.headers(), "content-type");
    let settings = &app.service.settings;
    let raw = match read_body(request.into_body(), settings.max_body_bytes).await {
        Ok(raw) => raw,
        Err(BodyError::TooLarge) => return refused(app, &app.refusals.payload_too_large),
        Err(BodyError::TimedOut) => return refused(app, &app.refusals.request_timeout),
        Err(BodyError::Broken(_)) => return Response::builder().status(400).body(full("")).unwrap(), // the client left
    };
    if content_type.as_deref().is_some_and(is_json) {
        match json::shape_exceeds(&raw, settings.max_json_depth, settings.max_json_values) {
            Some(Exceeded::Depth) => return refused(app, &app.refusals.json_too_deep),
            Some(Exceeded::Values) => return refused(app, &app.refusals.json_too_many),
            None => {}
        }
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let mut guard = CancelOnDrop { app: app.clone(), cancel: Some(cancel.clone()), started };
    let worker = app.clone();
    let job = tokio::task::spawn_blocking(move || worker.service.synthesize(&raw, content_type.as_deref(), cancel));
    let outcome = tokio::select! {
        done = job => done.expect("synthesis panicked"),
        _ = app.drained.notified() => app.service.shut_down(),
    };
    guard.cancel = None; // answered: nothing left to cancel
    let seconds = started.elapsed().as_secs_f64();
    app.metrics.observe(outcome.mode, outcome.reason, seconds, outcome.audio_seconds);
    answer(outcome)
}

struct CancelOnDrop {
    app: Arc<App>,
    cancel: Option<Arc<AtomicBool>>,
    started: Instant,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.cancel.take() {
            info!("the client left after {:.1} s: cancelling its synthesis", self.started.elapsed().as_secs_f64());
            self.app.metrics.observe("unknown", Some("cancelled"), 0.0, 0.0);
            cancel.store(true, Ordering::Relaxed);
        }
    }
}

fn answer(outcome: Outcome) -> Response<ResponseBody> {
    response(outcome.status, &outcome.headers, outcome.body)
}

/// A `/synthesize` body refused before it is parsed, counted as the invalid input it is.
fn refused(app: &Arc<App>, answer: &Canned) -> Response<ResponseBody> {
    app.metrics.observe("unknown", Some("invalid_input"), 0.0, 0.0);
    canned(answer)
}
