//! The embedded interpreter and the one Python entry point: `cosyvoice.server.embedded.EmbeddedBridge`.
//! Every call here blocks and takes the GIL: call them from tokio's blocking threads only.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use serde_json::Value;

use http_front::answer::Canned;
use http_front::cors::Cors;

use crate::environment::PythonEnvironment;

/// Start Python as the venv's own `bin/python` would start: its `pyvenv.cfg` gives the base installation
/// and the site-packages; the executable's repository goes first on `sys.path`, so `cosyvoice` is its own.
pub fn start_interpreter(env: &PythonEnvironment) -> Result<(), String> {
    let program = env.venv.join("bin").join("python");
    let program = CString::new(program.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    unsafe {
        // Python keeps this pointer for its lifetime (the process's): it is never freed
        let wide = pyo3::ffi::Py_DecodeLocale(program.as_ptr(), std::ptr::null_mut());
        if wide.is_null() {
            return Err(format!("cannot decode the path {}", env.venv.display()));
        }
        pyo3::ffi::Py_SetProgramName(wide);
    }
    pyo3::prepare_freethreaded_python();
    Python::with_gil(|py| -> PyResult<()> {
        let sys = py.import("sys")?;
        if let Some(root) = &env.repository {
            let path: &PyList = sys.getattr("path")?.downcast()?;
            path.insert(0, root.to_string_lossy().to_string())?;
        }
        let mut argv = vec!["cosyvoice-server".to_string()];
        argv.extend(std::env::args().skip(1));
        sys.setattr("argv", argv)?;
        py.import("cosyvoice.server.embedded")?;
        Ok(())
    })
    .map_err(|e| {
        let (version, prefix) = Python::with_gil(|py| {
            let sys = py.import("sys").ok();
            let get = |name: &str| {
                sys.and_then(|s| s.getattr(name).ok()).map(|v| v.to_string()).unwrap_or_default()
            };
            (get("version"), get("prefix"))
        });
        format!(
            "cannot import cosyvoice.server.embedded with Python {} (prefix {}, environment {}): {}",
            version.split_whitespace().next().unwrap_or("?"),
            prefix,
            env.venv.display(),
            Python::with_gil(|py| e.value(py).to_string())
        )
    })
}

#[derive(Clone)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub api_keys: Vec<String>,
    pub max_body_bytes: u64,
    pub grace_seconds: f64,
    /// the HTTP front's bounds (timeouts, connection cap, the grace)
    pub front: http_front::Settings,
    pub max_json_depth: usize,
    pub model_dir: String,
    pub cors: Option<Cors>,
    pub unauthorized: Canned,
    pub payload_too_large: Canned,
    pub not_found: Canned,
    pub method_not_allowed: Canned,
    pub request_timeout: Canned,
    pub json_too_deep: Canned,
    pub over_capacity: Canned,
}

/// One answer of the Python side, with the labels the metrics count it under.
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub mode: String,
    pub reason: Option<String>,
    pub audio_seconds: f64,
}

pub struct Bridge {
    entry: PyObject,
    pub config: Config,
    /// `None` while loading or once loaded; the load failure's message (for key holders) otherwise
    pub load_error: Mutex<Option<String>>,
}

impl Bridge {
    /// The entry point built from the command line (`None`: it printed its help, or a usage error, and the
    /// process should exit with that status, which `Err` carries when it is not 0).
    pub fn new(argv: &[String]) -> Result<Option<Bridge>, String> {
        Python::with_gil(|py| {
            let module = py.import("cosyvoice.server.embedded").map_err(|e| describe(py, e))?;
            let entry = match module.getattr("EmbeddedBridge").and_then(|cls| cls.call1((argv.to_vec(),))) {
                Ok(entry) => entry,
                Err(e) if e.is_instance_of::<pyo3::exceptions::PySystemExit>(py) => {
                    let code: i32 = e.value(py).getattr("code").and_then(|c| c.extract()).unwrap_or(2);
                    if code == 0 {
                        return Ok(None);
                    }
                    std::process::exit(code); // argparse already printed the usage error
                }
                Err(e) => return Err(describe(py, e)),
            };
            let text: String = entry
                .call_method0("config")
                .and_then(|c| c.extract())
                .map_err(|e| describe(py, e))?;
            let config = parse_config(&text)?;
            Ok(Some(Bridge { entry: entry.into(), config, load_error: Mutex::new(None) }))
        })
    }

    /// Load the model; a failure is kept for `/health` (the Python side logged it).
    pub fn load(&self) {
        let failure = Python::with_gil(|py| {
            self.entry
                .call_method0(py, "load")
                .and_then(|r| r.extract::<Option<String>>(py))
                .unwrap_or_else(|e| Some(describe(py, e)))
        });
        *self.load_error.lock().unwrap() = failure;
    }

    pub fn cancel_token(&self) -> PyObject {
        Python::with_gil(|py| {
            py.import("cosyvoice.engine")
                .and_then(|m| m.getattr("CancelToken"))
                .and_then(|cls| cls.call0())
                .map(Into::into)
                .expect("cosyvoice.engine.CancelToken")
        })
    }

    pub fn synthesize(&self, body: &[u8], content_type: Option<String>, authorization: String, cancel: &PyObject) -> Answer {
        Python::with_gil(|py| {
            let args = (PyBytes::new(py, body), content_type, authorization, cancel.clone_ref(py));
            answer(py, self.entry.call_method1(py, "synthesize", args))
        })
    }

    pub fn speakers(&self, authorization: String) -> Answer {
        Python::with_gil(|py| answer(py, self.entry.call_method1(py, "speakers", (authorization,))))
    }

    pub fn ready(&self, authorization: String) -> Answer {
        Python::with_gil(|py| answer(py, self.entry.call_method1(py, "ready", (authorization,))))
    }

    pub fn drain(&self) {
        Python::with_gil(|py| {
            if let Err(e) = self.entry.call_method1(py, "drain", (self.config.grace_seconds,)) {
                tracing::error!("draining the service failed: {}", describe(py, e));
            }
        })
    }
}

pub fn cancel(token: &PyObject) {
    Python::with_gil(|py| {
        if let Err(e) = token.call_method0(py, "cancel") {
            tracing::error!("cancelling a request failed: {}", describe(py, e));
        }
    })
}

fn describe(py: Python<'_>, e: PyErr) -> String {
    let name = e.get_type(py).name().unwrap_or("Exception").to_string();
    format!("{}: {}", name, e.value(py))
}

/// An `EmbeddedBridge` answer (a named tuple); an exception there (a bug: the entry point answers every
/// error it knows) is a 500 in the REST server's words.
fn answer(py: Python<'_>, result: PyResult<PyObject>) -> Answer {
    let extracted = result.and_then(|a| {
        let (status, headers, body, mode, reason, audio_seconds): (u16, Vec<(String, String)>, &PyBytes, String, Option<String>, f64) =
            a.extract(py)?;
        Ok(Answer { status, headers, body: body.as_bytes().to_vec(), mode, reason, audio_seconds })
    });
    extracted.unwrap_or_else(|e| {
        tracing::error!("the Python entry point failed: {}", describe(py, e));
        let body = br#"{"error":{"message":"internal error; the server log has the details","type":"internal_error","field":null,"param":null}}"#;
        Answer {
            status: 500,
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_vec(),
            mode: "unknown".into(),
            reason: Some("internal".into()),
            audio_seconds: 0.0,
        }
    })
}

fn parse_config(text: &str) -> Result<Config, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("bad configuration from Python: {}", e))?;
    let strings = |value: &Value| -> Vec<String> {
        value.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
    };
    let pairs = |value: &Value| -> Vec<(String, String)> {
        match value {
            Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string())).collect(),
            Value::Array(items) => items
                .iter()
                .filter_map(|p| Some((p.get(0)?.as_str()?.to_string(), p.get(1)?.as_str()?.to_string())))
                .collect(),
            _ => Vec::new(),
        }
    };
    let canned = |name: &str| -> Canned {
        let c = &v["refusals"][name];
        Canned {
            status: c["status"].as_u64().unwrap_or(500) as u16,
            headers: pairs(&c["headers"]),
            body: c["body"].as_str().unwrap_or("").as_bytes().to_vec(),
        }
    };
    let cors = match &v["cors"] {
        Value::Null => None,
        c => Some(Cors {
            allow_origins: strings(&c["allow_origins"]),
            allow_all_origins: c["allow_all_origins"].as_bool().unwrap_or(false),
            allow_credentials: c["allow_credentials"].as_bool().unwrap_or(false),
            allow_methods: strings(&c["allow_methods"]),
            allow_all_headers: c["allow_all_headers"].as_bool().unwrap_or(false),
            allow_headers: strings(&c["allow_headers"]),
            preflight_explicit_allow_origin: c["preflight_explicit_allow_origin"].as_bool().unwrap_or(true),
            allow_private_network: c["allow_private_network"].as_bool().unwrap_or(false),
            simple_headers: pairs(&c["simple_headers"]),
            preflight_headers: pairs(&c["preflight_headers"]),
        }),
    };
    let http = &v["http"];
    let seconds = |name: &str, default: f64| Duration::from_secs_f64(http[name].as_f64().unwrap_or(default).max(0.0));
    let grace_seconds = v["shutdown_grace_seconds"].as_f64().unwrap_or(30.0).max(0.0);
    let defaults = http_front::Settings::default();
    let front = http_front::Settings {
        header_timeout: seconds("header_timeout_seconds", defaults.header_timeout.as_secs_f64()),
        body_timeout: seconds("body_timeout_seconds", defaults.body_timeout.as_secs_f64()),
        body_min_rate: http["body_min_bytes_per_second"].as_u64().unwrap_or(defaults.body_min_rate),
        keep_alive_timeout: seconds("keep_alive_timeout_seconds", defaults.keep_alive_timeout.as_secs_f64()),
        max_connections: http["max_connections"].as_u64().map_or(defaults.max_connections, |n| n as usize),
        grace: Duration::from_secs_f64(grace_seconds),
        close_delay: defaults.close_delay,
    };
    Ok(Config {
        host: v["host"].as_str().unwrap_or("0.0.0.0").to_string(),
        port: v["port"].as_u64().unwrap_or(3000) as u16,
        api_keys: strings(&v["api_keys"]),
        max_body_bytes: v["max_body_bytes"].as_u64().unwrap_or(0),
        grace_seconds,
        front,
        max_json_depth: http["max_json_depth"].as_u64().unwrap_or(64) as usize,
        model_dir: v["model_dir"].as_str().unwrap_or("").to_string(),
        cors,
        unauthorized: canned("unauthorized"),
        payload_too_large: canned("payload_too_large"),
        not_found: canned("not_found"),
        method_not_allowed: canned("method_not_allowed"),
        request_timeout: canned("request_timeout"),
        json_too_deep: canned("json_too_deep"),
        over_capacity: canned("over_capacity"),
    })
}
