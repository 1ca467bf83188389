//! The routes, in the order the Python REST server's middleware applies them: CORS (outermost), API keys
//! (the probes stay open), the body bound, then the route.

use std::sync::Arc;
use std::time::Instant;

use http_front::{full, json, read_body, Body, BodyError, ResponseBody};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};
use pyo3::PyObject;
use tracing::info;

use crate::bridge::{Answer, Bridge, Canned, Cors};

const OPEN_PATHS: [&str; 2] = ["/health", "/ready"]; // probes answer without an API key
const ROUTES: [(&str, &str); 5] =
    [("/synthesize", "POST"), ("/health", "GET"), ("/ready", "GET"), ("/speakers", "GET"), ("/metrics", "GET")];
// the Python server's histogram buckets (cosyvoice/server/metrics.py)
const SECONDS: [f64; 13] = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0];
const RTF: [f64; 10] = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0];

/// The server's Prometheus families: counted here, from each answer of `/synthesize`.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    success: IntCounterVec,
    error: IntCounterVec,
    duration: HistogramVec,
    rtf: HistogramVec,
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let requests =
            IntCounterVec::new(Opts::new("tts_requests_total", "Synthesis requests received"), &["mode"]).unwrap();
        let success =
            IntCounterVec::new(Opts::new("tts_requests_success", "Synthesis requests completed"), &["mode"]).unwrap();
        let error = IntCounterVec::new(
            Opts::new("tts_requests_error", "Synthesis requests failed or cancelled"),
            &["mode", "reason"],
        )
        .unwrap();
        let duration = HistogramVec::new(
            HistogramOpts::new("tts_synthesis_duration_seconds", "Wall time of a completed request")
                .buckets(SECONDS.to_vec()),
            &["mode"],
        )
        .unwrap();
        let rtf = HistogramVec::new(
            HistogramOpts::new("tts_rtf", "Real-time factor (wall seconds per audio second) of a completed request")
                .buckets(RTF.to_vec()),
            &["mode"],
        )
        .unwrap();
        for collector in [&requests, &success, &error] {
            registry.register(Box::new(collector.clone())).unwrap();
        }
        registry.register(Box::new(duration.clone())).unwrap();
        registry.register(Box::new(rtf.clone())).unwrap();
        Metrics { registry, requests, success, error, duration, rtf }
    }

    fn observe(&self, mode: &str, reason: Option<&str>, seconds: f64, audio_seconds: f64) {
        self.requests.with_label_values(&[mode]).inc();
        match reason {
            Some(reason) => self.error.with_label_values(&[mode, reason]).inc(),
            None => {
                self.success.with_label_values(&[mode]).inc();
                self.duration.with_label_values(&[mode]).observe(seconds);
                if audio_seconds > 0.0 {
                    self.rtf.with_label_values(&[mode]).observe(seconds / audio_seconds);
                }
            }
        }
    }

    fn exposition(&self) -> (Vec<u8>, String) {
        let encoder = TextEncoder::new();
        let mut out = Vec::new();
        encoder.encode(&self.registry.gather(), &mut out).expect("text encoding");
        (out, encoder.format_type().to_string())
    }
}

pub struct App {
    pub bridge: Bridge,
    metrics: Metrics,
}

impl App {
    pub fn new(bridge: Bridge) -> App {
        App { bridge, metrics: Metrics::new() }
    }

    pub fn load(&self) {
        self.bridge.load();
    }
}

/// One request: its answer, with CORS headers, logged.
pub async fn handle(app: Arc<App>, request: Request<Body>) -> Response<ResponseBody> {
    let started = Instant::now();
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let headers = request.headers().clone();
    let origin = header(&headers, "origin");
    let response = match &app.bridge.config.cors {
        Some(cors) if origin.is_some() && method == Method::OPTIONS && headers.contains_key("access-control-request-method") => {
            preflight(cors, &headers)
        }
        Some(cors) => {
            let mut response = route(&app, request).await;
            simple_cors(cors, origin.as_deref(), response.headers_mut());
            response
        }
        None => route(&app, request).await,
    };
    info!(
        "{} {} {} {:.1} ms",
        method,
        path,
        response.status().as_u16(),
        started.elapsed().as_secs_f64() * 1000.0
    );
    response
}

async fn route(app: &Arc<App>, request: Request<Body>) -> Response<ResponseBody> {
    let config = &app.bridge.config;
    let path = request.uri().path().to_string();
    let authorization = header(request.headers(), "authorization").unwrap_or_default();
    let holder = key_is_valid(&presented_key(&authorization), &config.api_keys);
    if !config.api_keys.is_empty() && !OPEN_PATHS.contains(&path.as_str()) && !holder {
        return canned(&config.unauthorized);
    }
    let declared = header(request.headers(), "content-length").and_then(|n| n.trim().parse::<u64>().ok());
    if declared.map_or(false, |n| n > config.max_body_bytes) {
        if path == "/synthesize" {
            app.metrics.observe("unknown", Some("invalid_input"), 0.0, 0.0);
        }
        return canned(&config.payload_too_large);
    }
    let method = request.method().as_str().to_string();
    match ROUTES.iter().find(|(p, _)| *p == path) {
        None => canned(&config.not_found),
        Some((_, allowed)) if *allowed != method => {
            let mut response = canned(&config.method_not_allowed);
            response.headers_mut().insert("allow", HeaderValue::from_static(allowed));
            response
        }
        Some(_) => match path.as_str() {
            "/health" => health(app, !config.api_keys.is_empty() && holder),
            "/metrics" => {
                let (body, content_type) = app.metrics.exposition();
                let mut response = Response::new(full(body));
                set(response.headers_mut(), "content-type", &content_type);
                response
            }
            "/ready" => blocking(app, move |app| app.bridge.ready(authorization)).await,
            "/speakers" => blocking(app, move |app| app.bridge.speakers(authorization)).await,
            _ => synthesize(app, request, authorization).await,
        },
    }
}

/// `/health`: the process serves; 503 only when the model failed to load. Answered here, never waiting
/// for the interpreter, so it answers at once however busy synthesis is.
fn health(app: &Arc<App>, holder: bool) -> Response<ResponseBody> {
    let failure = app.bridge.load_error.lock().unwrap().clone();
    let (status, body) = match failure {
        None => (200, r#"{"status":"ok"}"#.to_string()),
        Some(error) => {
            let shown = if holder { error } else { "see the server log".to_string() };
            (503, format!(r#"{{"status":"failed","error":{}}}"#, serde_json::to_string(&shown).unwrap()))
        }
    };
    json_response(status, body.into_bytes())
}

/// `/synthesize`: the body (bounded while read), then the service on a blocking thread. If the client
/// goes away first, hyper drops this future: the guard then cancels the request's token, and the engine
/// stops within one LLM step and frees its slot.
async fn synthesize(app: &Arc<App>, request: Request<Body>, authorization: String) -> Response<ResponseBody> {
    let started = Instant::now();
    let content_type = header(request.headers(), "content-type");
    let limit = app.bridge.config.max_body_bytes;
    let config = &app.bridge.config;
    let raw = match read_body(request.into_body(), limit).await {
        Ok(raw) => raw,
        Err(BodyError::TooLarge) => return refused(app, &config.payload_too_large),
        Err(BodyError::TimedOut) => {
            let mut response = refused(app, &config.request_timeout);
            response.headers_mut().insert("connection", HeaderValue::from_static("close"));
            return response;
        }
        Err(BodyError::Broken(_)) => return Response::builder().status(400).body(full("")).unwrap(), // the client left
    };
    // a JSON body nested too deep is refused before Python parses it (its parser recurses per level)
    if content_type.as_deref().map_or(false, is_json) && json::depth_exceeds(&raw, config.max_json_depth) {
        return refused(app, &config.json_too_deep);
    }
    let raw = raw.to_vec();
    let token = blocking_call(app, |app| app.bridge.cancel_token()).await;
    let mut guard = CancelOnDrop { app: app.clone(), token: Some(token.clone()), started };
    let answer = blocking(app, move |app| app.bridge.synthesize(&raw, content_type, authorization, &token)).await;
    guard.token = None; // answered: nothing left to cancel
    answer
}

struct CancelOnDrop {
    app: Arc<App>,
    token: Option<PyObject>,
    started: Instant,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(token) = self.token.take() {
            info!("the client left after {:.1} s: cancelling its synthesis", self.started.elapsed().as_secs_f64());
            self.app.metrics.observe("unknown", Some("cancelled"), 0.0, 0.0);
            tokio::task::spawn_blocking(move || crate::bridge::cancel(&token));
        }
    }
}

async fn blocking_call<T: Send + 'static>(app: &Arc<App>, call: impl FnOnce(&App) -> T + Send + 'static) -> T {
    let app = app.clone();
    tokio::task::spawn_blocking(move || call(&app)).await.expect("a blocking call panicked")
}

/// A Python answer, computed on a blocking thread (`/synthesize`'s are counted in the metrics).
async fn blocking(app: &Arc<App>, call: impl FnOnce(&App) -> Answer + Send + 'static) -> Response<ResponseBody> {
    let started = Instant::now();
    let answer = blocking_call(app, call).await;
    if answer.mode != "unknown" || answer.reason.is_some() || answer.audio_seconds > 0.0 {
        let seconds = started.elapsed().as_secs_f64();
        app.metrics.observe(&answer.mode, answer.reason.as_deref(), seconds, answer.audio_seconds);
    }
    let mut response = Response::new(full(answer.body));
    *response.status_mut() = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in &answer.headers {
        set(response.headers_mut(), name, value);
    }
    response
}

/// A `/synthesize` body refused before Python sees it, counted as the invalid input it is.
fn refused(app: &Arc<App>, answer: &Canned) -> Response<ResponseBody> {
    app.metrics.observe("unknown", Some("invalid_input"), 0.0, 0.0);
    canned(answer)
}

/// Whether a body of `content_type` is JSON, as FastAPI decides (`application/json`, `application/*+json`).
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    match essence.split_once('/') {
        Some(("application", subtype)) => subtype == "json" || subtype.ends_with("+json"),
        _ => false,
    }
}

pub fn canned(answer: &Canned) -> Response<ResponseBody> {
    let mut response = Response::new(full(answer.body.clone()));
    *response.status_mut() = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in &answer.headers {
        set(response.headers_mut(), name, value);
    }
    response
}

fn json_response(status: u16, body: Vec<u8>) -> Response<ResponseBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    set(response.headers_mut(), "content-type", "application/json");
    response
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(String::from)
}

fn set(headers: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
        headers.insert(name, value);
    }
}

/// The Bearer token of an `Authorization` header (as `cosyvoice.server.common.presented_key`).
fn presented_key(authorization: &str) -> String {
    match authorization.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("bearer ") => authorization[7..].trim().to_string(),
        _ => String::new(),
    }
}

/// Whether `token` is one of `keys`, compared in constant time per key (as `hmac.compare_digest`).
fn key_is_valid(token: &str, keys: &[String]) -> bool {
    !token.is_empty()
        && keys.iter().fold(false, |found, key| {
            let (a, b) = (token.as_bytes(), key.as_bytes());
            let same = a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0;
            found | same
        })
}

// ----------------------------------------------------------------------------- CORS, as starlette answers it

fn preflight(cors: &Cors, request: &HeaderMap) -> Response<ResponseBody> {
    let origin = header(request, "origin").unwrap_or_default();
    let method = header(request, "access-control-request-method").unwrap_or_default();
    let requested_headers = header(request, "access-control-request-headers");
    let mut headers = HeaderMap::new();
    for (name, value) in &cors.preflight_headers {
        set(&mut headers, name, value);
    }
    let mut failures = Vec::new();
    if allowed_origin(cors, &origin) {
        if cors.preflight_explicit_allow_origin {
            set(&mut headers, "access-control-allow-origin", &origin);
        }
    } else {
        failures.push("origin");
    }
    if !cors.allow_methods.contains(&method) {
        failures.push("method");
    }
    if let Some(requested) = &requested_headers {
        if cors.allow_all_headers {
            set(&mut headers, "access-control-allow-headers", requested);
        } else if requested.to_lowercase().split(',').any(|h| !cors.allow_headers.contains(&h.trim().to_string())) {
            failures.push("headers");
        }
    }
    if request.contains_key("access-control-request-private-network") {
        if cors.allow_private_network {
            set(&mut headers, "access-control-allow-private-network", "true");
        } else {
            failures.push("private-network");
        }
    }
    let (status, text) =
        if failures.is_empty() { (200, "OK".to_string()) } else { (400, format!("Disallowed CORS {}", failures.join(", "))) };
    let mut response = Response::new(full(text));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    *response.headers_mut() = headers;
    set(response.headers_mut(), "content-type", "text/plain; charset=utf-8");
    response
}

fn allowed_origin(cors: &Cors, origin: &str) -> bool {
    cors.allow_all_origins || cors.allow_origins.iter().any(|o| o == origin)
}

fn simple_cors(cors: &Cors, origin: Option<&str>, headers: &mut HeaderMap) {
    let explicit = match origin {
        None => false,
        Some(origin) => {
            for (name, value) in &cors.simple_headers {
                set(headers, name, value);
            }
            (cors.allow_all_origins && cors.allow_credentials) || (!cors.allow_all_origins && allowed_origin(cors, origin))
        }
    };
    if explicit {
        set(headers, "access-control-allow-origin", origin.unwrap_or_default());
    }
    let mut vary: Vec<String> = headers.get_all("vary").iter().filter_map(|v| v.to_str().ok().map(String::from)).collect();
    vary.push("Origin".to_string());
    set(headers, "vary", &vary.join(", "));
}

#[cfg(test)]
mod tests {
    use super::{is_json, key_is_valid, presented_key};

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json") && is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/problem+json") && !is_json("text/plain") && !is_json("json"));
    }

    #[test]
    fn keys() {
        let keys = vec!["s3cret".to_string(), "other".to_string()];
        assert_eq!(presented_key("Bearer  s3cret "), "s3cret");
        assert_eq!(presented_key("bearer s3cret"), "s3cret");
        assert_eq!(presented_key("Basic s3cret"), "");
        assert!(key_is_valid("s3cret", &keys) && key_is_valid("other", &keys));
        assert!(!key_is_valid("s3cre", &keys) && !key_is_valid("", &keys) && !key_is_valid("wrong", &[]));
    }
}
