//! `cosyvoice-native-server`: the bridge contract (`POST /synthesize`, `GET /health`, `/ready`, `/speakers`,
//! `/metrics`) served by the native engine, with no Python in the process: the HTTP front, keys, CORS and
//! metrics are rust/http-front's (shared with the bridge server), the model is `cosyvoice_native` (candle, and
//! ONNX Runtime opened at run time for the two prompt networks). Settings and refusals are the Python
//! server's, so a client cannot tell the servers apart except where docs/servers.md says.

mod admission;
mod errors;
mod json;
mod request;
mod routes;
mod service;
mod settings;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http_front::{Body, Handler, ResponseBody};
use hyper::{Request, Response};
use tokio::net::TcpListener;
use tracing::info;

use crate::routes::App;
use crate::service::Service;
use crate::settings::{Settings, USAGE};

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(std::io::stderr).init();
    let code = match run() {
        Ok(()) => 0,
        Err(message) => {
            eprintln!("{USAGE}\ncosyvoice-native-server: error: {message}");
            2
        }
    };
    // a model still loading is not waited for
    std::process::exit(code);
}

fn run() -> Result<(), String> {
    http_front::dotenv::load_dotenv();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let env: HashMap<String, String> = std::env::vars().collect();
    let Some(settings) = Settings::parse(&argv, &env)? else {
        println!("{USAGE}");
        return Ok(());
    };
    // where ONNX Runtime is missing, say so now rather than at the first request
    cosyvoice_native::onnx::runtime_library().map_err(|e| e.to_string())?;
    let host = if settings.host.contains(':') { format!("[{}]", settings.host) } else { settings.host.clone() };
    let addr: SocketAddr = format!("{host}:{}", settings.port)
        .parse()
        .map_err(|e| format!("cannot listen on {}:{}: {e}", settings.host, settings.port))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let served = runtime.block_on(serve(App::new(Service::new(settings)), addr));
    runtime.shutdown_background();
    served
}

/// The routes, as the HTTP front calls them.
struct Routes(Arc<App>);

impl Handler for Routes {
    fn handle(&self, request: Request<Body>) -> impl Future<Output = Response<ResponseBody>> + Send {
        routes::handle(self.0.clone(), request)
    }

    fn over_capacity(&self) -> Response<ResponseBody> {
        http_front::answer::canned(&self.0.refusals().over_capacity)
    }
}

async fn serve(app: App, addr: SocketAddr) -> Result<(), String> {
    let app = Arc::new(app);
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let model_dir = app.service.settings.model_dir.display().to_string();
    info!(%addr, %model_dir, "serving the bridge contract natively; loading the model");
    let loader = app.clone();
    tokio::task::spawn_blocking(move || loader.service.load());

    // SIGTERM/SIGINT: the front stops accepting; running requests may finish within the grace, then the
    // service cancels what still runs (answered 503), and the front closes every connection
    let drainer = app.clone();
    let (drain_started, drain_handle) = tokio::sync::oneshot::channel();
    let shutdown = async move {
        http_front::shutdown_signal().await;
        info!(
            "shutting down: running requests may finish within {} s",
            drainer.service.settings.shutdown_grace_seconds
        );
        let _ = drain_started.send(tokio::task::spawn_blocking(move || {
            drainer.service.drain();
            drainer.drained.notify_waiters();
        }));
    };
    let front = app.service.settings.front.clone();
    http_front::serve(listener, front.clone(), Arc::new(Routes(app)), shutdown).await;
    if let Ok(drain) = drain_handle.await {
        let _ = tokio::time::timeout(front.close_delay, drain).await;
    }
    info!("stopped");
    Ok(())
}
