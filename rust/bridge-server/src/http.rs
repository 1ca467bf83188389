//! The routes, in the order the Python REST server's middleware applies them: CORS (outermost), API keys
//! (the probes stay open), the body bound, then the route.

use std::sync::Arc;
use std::time::Instant;

use http_front::answer::{canned, header, is_json, json_response, response, set, Canned};
use http_front::auth::{key_is_valid, presented_key};
use http_front::cors::{preflight, simple_cors};
use http_front::metrics::Metrics;
use http_front::{full, json, read_body, Body, BodyError, ResponseBody};
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response};
use pyo3::PyObject;
use tracing::info;

use crate::bridge::{Answer, Bridge};

const OPEN_PATHS: [&str; 2] = ["/health", "/ready"]; // probes answer without an API key
const ROUTES: [(&str, &str); 5] =
    [("/synthesize", "POST"), ("/health", "GET"), ("/ready", "GET"), ("/speakers", "GET"), ("/metrics", "GET")];
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
    response(answer.status, &answer.headers, answer.body)
}

/// A `/synthesize` body refused before Python sees it, counted as the invalid input it is.
fn refused(app: &Arc<App>, answer: &Canned) -> Response<ResponseBody> {
    app.metrics.observe("unknown", Some("invalid_input"), 0.0, 0.0);
    canned(answer)
}
