//! The server's settings with the Python servers' names: `--flag` over `COSYVOICE_<FIELD>` (a `.env` fills in
//! unset variables) over the default (`cosyvoice/settings.py`: `ServerSettings`, `Limits`; the bridge contract's
//! address 0.0.0.0:3000). Flags of the Python server that concern only its own engine (`--device`,
//! `--precision`, `--voice-dir`, ...) are accepted and have no effect here, so one command line starts either.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

/// Flags that take a value and are accepted without effect (the Python service's own settings).
const PYTHON_ONLY: [&str; 18] = [
    "min-prompt-sample-rate",
    "max-prompt-bytes",
    "device",
    "precision",
    "voice-dir",
    "log-level",
    "stream-idle-seconds",
    "stream-start-seconds",
    "default-voice",
    "voice-editors",
    "sharing",
    "max-prompt-channels",
    "max-prompt-sample-rate",
    "max-cached-voices",
    "max-cached-voice-bytes",
    "max-named-voices",
    "max-llm-positions",
    "flow-cache-mb",
];
/// Settings given as a list (repeat the flag, or comma-separate the variable).
const LISTS: [(&str, &str); 3] =
    [("api-key", "api_keys"), ("admin-key", "admin_keys"), ("cors-origin", "cors_origins")];
pub const USAGE: &str =
    "usage: cosyvoice-native-server [--model-dir DIR] [--host HOST] [--port PORT] [--api-key KEY]... \
[--admin-key KEY]... [--cors-origin ORIGIN]... [--max-body-bytes N] [--allowed-audio-dir DIR] [--max-sessions N] \
[--max-queued-requests N] [--queue-timeout-seconds S] [--shutdown-grace-seconds S] [--retry-after-seconds S] \
[--max-text-chars N] [--min-prompt-seconds S] [--max-prompt-seconds S] [--header-timeout-seconds S] \
[--body-timeout-seconds S] [--body-min-bytes-per-second N] [--keep-alive-timeout-seconds S] [--max-connections N] \
[--max-json-depth N] [--max-json-values N]\n\nEvery flag is also COSYVOICE_<NAME> (e.g. COSYVOICE_MODEL_DIR, COSYVOICE_API_KEYS=k1,k2); \
ONNX Runtime is ORT_DYLIB_PATH or the onnxruntime wheel of COSYVOICE_VENV / the repository's .venv.";

#[derive(Debug, Clone)]
pub struct Settings {
    pub model_dir: PathBuf,
    pub host: String,
    pub port: u16,
    pub api_keys: Vec<String>,
    pub cors_origins: Vec<String>,
    pub max_body_bytes: u64,
    pub allowed_audio_dir: Option<PathBuf>,
    pub retry_after_seconds: u64,
    pub shutdown_grace_seconds: f64,
    pub front: http_front::Settings,
    pub max_json_depth: usize,
    pub max_json_values: usize,
    pub max_sessions: usize,
    pub max_queued_requests: usize,
    pub queue_timeout_seconds: f64,
    pub max_text_chars: usize,
    pub min_prompt_seconds: f64,
    pub max_prompt_seconds: f64,
}

/// Python's `{:g}` for the settings' round numbers.
pub fn format_g(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

impl Settings {
    /// From the command line and the environment; `Ok(None)` for `--help`.
    pub fn parse(argv: &[String], env: &HashMap<String, String>) -> Result<Option<Settings>, String> {
        let mut given: HashMap<String, Vec<String>> = HashMap::new();
        let mut args = argv.iter();
        while let Some(arg) = args.next() {
            if arg == "-h" || arg == "--help" {
                return Ok(None);
            }
            let flag = arg.strip_prefix("--").ok_or_else(|| format!("unrecognized arguments: {arg}"))?;
            let (name, inline) = match flag.split_once('=') {
                Some((name, value)) => (name.replace('_', "-"), Some(value.to_owned())),
                None => (flag.replace('_', "-"), None),
            };
            let value = match inline {
                Some(value) => value,
                None => args.next().cloned().ok_or_else(|| format!("argument --{name}: expected one argument"))?,
            };
            let key =
                LISTS.iter().find(|(flag, _)| *flag == name).map_or(name.replace('-', "_"), |(_, k)| k.to_string());
            if !KNOWN.contains(&key.as_str()) && !PYTHON_ONLY.contains(&name.as_str()) {
                return Err(format!("unrecognized arguments: --{name}"));
            }
            given.entry(key).or_default().push(value);
        }
        Settings::from_values(&Values { given, env })
    }

    fn from_values(v: &Values) -> Result<Option<Settings>, String> {
        let defaults = http_front::Settings::default();
        let seconds = |name: &str, default: Duration| -> Result<Duration, String> {
            let s = v.number(name, default.as_secs_f64())?;
            if s <= 0.0 {
                return Err(format!("{name} must be positive"));
            }
            Ok(Duration::from_secs_f64(s))
        };
        let grace = v.number("shutdown_grace_seconds", 30.0)?;
        let front = http_front::Settings {
            header_timeout: seconds("header_timeout_seconds", defaults.header_timeout)?,
            body_timeout: seconds("body_timeout_seconds", defaults.body_timeout)?,
            body_min_rate: v.number("body_min_bytes_per_second", defaults.body_min_rate as f64)? as u64,
            keep_alive_timeout: seconds("keep_alive_timeout_seconds", defaults.keep_alive_timeout)?,
            max_connections: v.count("max_connections", defaults.max_connections)?,
            grace: Duration::from_secs_f64(grace.max(0.0)),
            close_delay: defaults.close_delay,
        };
        let mut api_keys = v.list("api_keys");
        api_keys.extend(v.list("admin_keys"));
        let cors_origins = v.list("cors_origins");
        if cors_origins.iter().any(|o| o == "*") && !api_keys.is_empty() {
            return Err("CORS origin '*' with API keys would let any web page use a visitor's key; list the allowed \
                        origins instead"
                .into());
        }
        let port = v.number("port", 3000.0)?;
        if !(1.0..65536.0).contains(&port) || port.fract() != 0.0 {
            return Err(format!("port must be in 1..65535, got {port}"));
        }
        Ok(Some(Settings {
            model_dir: PathBuf::from(v.text("model_dir").unwrap_or("pretrained_models/Fun-CosyVoice3-0.5B")),
            host: v.text("host").unwrap_or("0.0.0.0").to_owned(),
            port: port as u16,
            api_keys,
            cors_origins,
            max_body_bytes: v.count("max_body_bytes", 72 * 1024 * 1024)? as u64,
            allowed_audio_dir: v.text("allowed_audio_dir").map(PathBuf::from),
            retry_after_seconds: v.number("retry_after_seconds", 5.0)? as u64,
            shutdown_grace_seconds: grace.max(0.0),
            front,
            max_json_depth: v.count("max_json_depth", 64)?,
            max_json_values: v.count("max_json_values", 200_000)?,
            max_sessions: v.count("max_sessions", 8)?,
            max_queued_requests: v.number("max_queued_requests", 32.0)? as usize,
            queue_timeout_seconds: v.number("queue_timeout_seconds", 30.0)?,
            max_text_chars: v.count("max_text_chars", 5000)?,
            min_prompt_seconds: v.number("min_prompt_seconds", 1.0)?,
            max_prompt_seconds: v.number("max_prompt_seconds", 30.0)?,
        }))
    }
}

/// Settings this server uses (their flag is `--` + the name with `-` for `_`).
const KNOWN: [&str; 23] = [
    "model_dir",
    "host",
    "port",
    "api_keys",
    "admin_keys",
    "cors_origins",
    "max_body_bytes",
    "allowed_audio_dir",
    "retry_after_seconds",
    "shutdown_grace_seconds",
    "header_timeout_seconds",
    "body_timeout_seconds",
    "body_min_bytes_per_second",
    "keep_alive_timeout_seconds",
    "max_connections",
    "max_json_depth",
    "max_json_values",
    "max_sessions",
    "max_queued_requests",
    "queue_timeout_seconds",
    "max_text_chars",
    "min_prompt_seconds",
    "max_prompt_seconds",
];

/// The flags given, over the environment's `COSYVOICE_<NAME>`.
struct Values<'a> {
    given: HashMap<String, Vec<String>>,
    env: &'a HashMap<String, String>,
}

impl Values<'_> {
    fn text(&self, name: &str) -> Option<&str> {
        match self.given.get(name).and_then(|v| v.last()) {
            Some(value) => Some(value),
            None => self.env.get(&format!("COSYVOICE_{}", name.to_uppercase())).map(String::as_str),
        }
    }

    fn list(&self, name: &str) -> Vec<String> {
        match self.given.get(name) {
            Some(values) => values.clone(),
            None => self
                .env
                .get(&format!("COSYVOICE_{}", name.to_uppercase()))
                .map(|raw| raw.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
                .unwrap_or_default(),
        }
    }

    fn number(&self, name: &str, default: f64) -> Result<f64, String> {
        match self.text(name) {
            None => Ok(default),
            Some(raw) => raw.trim().parse::<f64>().map_err(|_| format!("{name}={raw:?} is not a valid number")),
        }
    }

    /// A positive whole number.
    fn count(&self, name: &str, default: usize) -> Result<usize, String> {
        let n = self.number(name, default as f64)?;
        if n < 1.0 || n.fract() != 0.0 {
            return Err(format!("{name} must be a positive whole number, got {}", format_g(n)));
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<Option<Settings>, String> {
        let argv: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Settings::parse(&argv, &env)
    }

    #[test]
    fn flags_over_environment_over_defaults() {
        let s = parse(
            &["--api-key", "a", "--api-key=b", "--port", "8080", "--device", "cpu"],
            &[
                ("COSYVOICE_PORT", "9000"),
                ("COSYVOICE_MODEL_DIR", "/m"),
                ("COSYVOICE_CORS_ORIGINS", "https://x, https://y"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.port, s.host.as_str(), s.model_dir.to_str().unwrap()), (8080, "0.0.0.0", "/m"));
        assert_eq!(s.api_keys, ["a", "b"]);
        assert_eq!(s.cors_origins, ["https://x", "https://y"]);
        assert_eq!((s.max_sessions, s.max_body_bytes), (8, 72 * 1024 * 1024));
        assert!(parse(&["--help"], &[]).unwrap().is_none());
        assert_eq!(parse(&["--bogus", "1"], &[]).unwrap_err(), "unrecognized arguments: --bogus");
        assert!(parse(&["--max-sessions", "0"], &[]).unwrap_err().contains("positive"));
        assert!(parse(&["--cors-origin", "*", "--api-key", "k"], &[]).unwrap_err().contains("'*'"));
    }
}
