//! `cosyvoice-server`: the bridge contract (`POST /synthesize`, `GET /health`, `GET /ready`, `GET /speakers`,
//! `GET /metrics`) over the HTTP front (rust/http-front: hyper 1 + tokio), with the CosyVoice3 Studio service
//! embedded through PyO3.
//!
//! Rust serves HTTP, `/health`, the Prometheus metrics, API keys, CORS and the body bound; every answer that
//! needs the model comes from one Python entry point, `cosyvoice.server.embedded.EmbeddedBridge`, which takes
//! the same flags and `COSYVOICE_*` settings as the Python REST server and answers with its errors.
//! Blocking Python calls run on tokio's blocking threads; the GIL is taken only there.

mod bridge;
mod environment;
mod http;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_front::{Body, Handler, ResponseBody};
use hyper::{Request, Response};
use tokio::net::TcpListener;
use tracing::info;

use crate::bridge::Bridge;
use crate::http::App;

/// The longest the service's drain waits, after cancelling, for the engine to let go (`SETTLE_SECONDS` in
/// `cosyvoice/service.py`).
const ENGINE_SETTLE: Duration = Duration::from_secs(10);

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(std::io::stderr).init();
    let code = match run() {
        Ok(()) => 0,
        Err(message) => {
            eprintln!("cosyvoice-server: {}", message);
            2
        }
    };
    // the engine's threads are not joined: the drain already ended every request
    std::process::exit(code);
}

fn run() -> Result<(), String> {
    environment::load_dotenv();
    let python = environment::find_python()?;
    bridge::start_interpreter(&python)?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let bridge = match Bridge::new(&argv)? {
        Some(bridge) => bridge,
        None => return Ok(()), // --help
    };
    let config = bridge.config.clone();
    let addr: SocketAddr = format!("{}:{}", bracket(&config.host), config.port)
        .parse()
        .map_err(|e| format!("cannot listen on {}:{}: {}", config.host, config.port, e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {}", e))?;
    let served = runtime.block_on(serve(App::new(bridge), addr));
    runtime.shutdown_background(); // a model still loading is not waited for
    served
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{}]", host)
    } else {
        host.to_string()
    }
}

/// The routes, as the HTTP front calls them.
struct Routes(Arc<App>);

impl Handler for Routes {
    fn handle(&self, request: Request<Body>) -> impl Future<Output = Response<ResponseBody>> + Send {
        http::handle(self.0.clone(), request)
    }

    fn over_capacity(&self) -> Response<ResponseBody> {
        http_front::answer::canned(&self.0.bridge.config.over_capacity)
    }
}

async fn serve(app: App, addr: SocketAddr) -> Result<(), String> {
    let app = Arc::new(app);
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {}: {}", addr, e))?;
    info!(%addr, model_dir = %app.bridge.config.model_dir, "serving the bridge contract; loading the model");
    let loader = app.clone();
    tokio::task::spawn_blocking(move || loader.load());

    // SIGTERM/SIGINT: the front stops accepting and closes idle and half-sent connections; running requests
    // may finish within the grace (new ones get 503 from the service), then the service cancels what still
    // runs, their answers go out, and the front closes every connection
    let drainer = app.clone();
    let (drain_started, drain_handle) = tokio::sync::oneshot::channel();
    let shutdown = async move {
        http_front::shutdown_signal().await;
        info!("shutting down: running requests may finish within {} s", drainer.bridge.config.grace_seconds);
        let _ = drain_started.send(tokio::task::spawn_blocking(move || drainer.bridge.drain()));
    };
    let settings = app.bridge.config.front.clone();
    http_front::serve(listener, settings.clone(), Arc::new(Routes(app)), shutdown).await;
    if let Ok(drain) = drain_handle.await {
        // the service's drain ends at the grace, then waits for the engine to finish the chunks it was computing
        // for the requests it cancelled (exiting while they run can crash in the native libraries' teardown);
        // a hung drain does not keep the process
        let _ = tokio::time::timeout(settings.close_delay + ENGINE_SETTLE, drain).await;
    }
    info!("stopped");
    Ok(())
}
