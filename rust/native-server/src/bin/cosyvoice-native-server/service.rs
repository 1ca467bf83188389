//! The service behind the routes: the engine (loaded once, in the background), the synthesis slots, the
//! requests running (each with its cancel flag) and the drain. Calls block: run them on blocking threads.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cosyvoice_native::audio::decode_wav;
use cosyvoice_native::synthesis::{Engine, Mode, Request};
use cosyvoice_native::{Bundle, Error};
use tracing::{error, info};

use crate::admission::Admission;
use crate::errors::ApiError;
use crate::request::{self, AudioSource, Conditioning, Synthesis};
use crate::settings::Settings;

const ACCEPTED: &str = "Upload WAV, FLAC, MP3, OGG (Vorbis or Opus), WebM or M4A";
const SHUT_DOWN: &str = "shutting down: this request was cancelled; retry on another server";

/// An answer with what the metrics count of it (`reason` None: a success).
pub struct Outcome {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub mode: &'static str,
    pub reason: Option<&'static str>,
    pub audio_seconds: f64,
}

impl Outcome {
    fn refused(error: &ApiError, mode: &'static str, reason: &'static str) -> Outcome {
        let canned = error.canned();
        Outcome {
            status: canned.status,
            headers: canned.headers,
            body: canned.body,
            mode,
            reason: Some(reason),
            audio_seconds: 0.0,
        }
    }
}

pub struct Service {
    pub settings: Settings,
    engine: OnceLock<Engine>,
    pub load_error: Mutex<Option<String>>,
    admission: Admission,
    running: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    next_id: AtomicU64,
}

impl Service {
    pub fn new(settings: Settings) -> Service {
        let admission = Admission::new(
            settings.max_sessions,
            settings.max_queued_requests,
            Duration::from_secs_f64(settings.queue_timeout_seconds.max(0.0)),
        );
        Service {
            settings,
            engine: OnceLock::new(),
            load_error: Mutex::new(None),
            admission,
            running: Mutex::default(),
            next_id: AtomicU64::new(0),
        }
    }

    /// Loads the model folder; a failure is kept for `/health` and `/ready`.
    pub fn load(&self) {
        let started = Instant::now();
        let dir = &self.settings.model_dir;
        let loaded = Bundle::open(dir).and_then(|bundle| Engine::load(&bundle));
        match loaded {
            Ok(mut engine) => {
                engine.prompt_limits_mut().min_seconds = self.settings.min_prompt_seconds;
                engine.prompt_limits_mut().max_seconds = self.settings.max_prompt_seconds;
                let _ = self.engine.set(engine);
                info!("loaded {} in {:.1} s; serving", dir.display(), started.elapsed().as_secs_f64());
            }
            Err(e) => {
                error!("loading the model failed: {e}");
                *self.load_error.lock().unwrap() = Some(format!("{}: {e}", kind(&e)));
            }
        }
    }

    /// `/ready`'s status and body (counters for `details`, the model folder for a key `holder`).
    pub fn ready(&self, details: bool, holder: bool) -> (u16, serde_json::Value) {
        let Some(engine) = self.engine.get() else {
            let failure = self.load_error.lock().unwrap().clone();
            return match failure {
                None => (503, serde_json::json!({"status": "loading"})),
                Some(e) => (
                    503,
                    serde_json::json!({"status": "failed", "error": if holder { e } else { "see the server log".into() }}),
                ),
            };
        };
        let mut body = serde_json::Map::new();
        body.insert("status".into(), "ready".into());
        if details {
            let (active, queued) = self.admission.load();
            body.insert("sample_rate".into(), engine.sample_rate.into());
            body.insert("active_sessions".into(), active.into());
            body.insert("queued_requests".into(), queued.into());
            body.insert("max_sessions".into(), self.settings.max_sessions.into());
            body.insert("max_queued_requests".into(), self.settings.max_queued_requests.into());
            body.insert("saved_voices".into(), 0.into());
            if holder {
                body.insert("model_dir".into(), self.settings.model_dir.display().to_string().into());
            }
        }
        (200, serde_json::Value::Object(body))
    }

    /// `POST /synthesize`: a whole 16-bit WAV, or the Python server's refusal. `cancel` (the client left)
    /// stops the engine within one LLM step.
    pub fn synthesize(&self, raw: &[u8], content_type: Option<&str>, cancel: Arc<AtomicBool>) -> Outcome {
        let checked = match request::parse(raw, content_type, &self.settings) {
            Ok(checked) => checked,
            Err((error, mode)) => return Outcome::refused(&error, mode, "invalid_input"),
        };
        let mode = checked.conditioning.label();
        let Some(engine) = self.engine.get() else {
            let message = if self.load_error.lock().unwrap().is_some() {
                "the model failed to load; the server log says why"
            } else {
                "the model is still loading; retry shortly"
            };
            let error = ApiError::new(503, "loading", message)
                .with_header("retry-after", &self.settings.retry_after_seconds.to_string());
            return Outcome::refused(&error, mode, "model_error");
        };
        if let Err(message) = self.admission.acquire() {
            return Outcome::refused(&ApiError::busy(&message, self.settings.retry_after_seconds), mode, "busy");
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.running.lock().unwrap().insert(id, cancel.clone());
        let result = self.run(engine, checked, &cancel);
        self.running.lock().unwrap().remove(&id);
        self.admission.release();
        match result {
            Ok(pcm) => {
                let (body, seconds) = wav(&pcm, engine.sample_rate);
                let headers = vec![
                    ("content-type".to_owned(), "audio/wav".to_owned()),
                    ("x-audio-duration".to_owned(), format!("{seconds:.3}")),
                    ("x-sample-rate".to_owned(), engine.sample_rate.to_string()),
                ];
                Outcome { status: 200, headers, body, mode, reason: None, audio_seconds: seconds }
            }
            Err(Error::Cancelled) => Outcome { mode, ..self.shut_down() },
            Err(Error::Input(message)) => {
                Outcome::refused(&ApiError::invalid(&message, Some("prompt_audio")), mode, "invalid_input")
            }
            Err(e) => {
                error!("POST /synthesize failed: {e}");
                let error = ApiError::new(500, "model_error", "synthesis failed; the server log has the details");
                Outcome::refused(&error, mode, "model_error")
            }
        }
    }

    fn run(&self, engine: &Engine, checked: Synthesis, cancel: &AtomicBool) -> Result<Vec<f32>, Error> {
        let prompt = read_prompt(&checked.audio)?;
        let mode = match checked.conditioning {
            Conditioning::ZeroShot { transcript } => Mode::ZeroShot { transcript },
            Conditioning::Instruct { instruction } => Mode::Instruct { instruction },
        };
        let seed = checked.seed.unwrap_or_else(random_seed);
        let request = Request { text: checked.text, mode, prompt, seed, speed: checked.speed };
        engine.synthesize(&request, cancel)
    }

    /// The answer of a request the drain cancelled.
    pub fn shut_down(&self) -> Outcome {
        Outcome::refused(&ApiError::busy(SHUT_DOWN, self.settings.retry_after_seconds), "unknown", "cancelled")
    }

    /// Shutting down: no new requests; running ones may finish within the grace, then are cancelled.
    pub fn drain(&self) {
        self.admission.close();
        let deadline = Instant::now() + Duration::from_secs_f64(self.settings.shutdown_grace_seconds);
        while Instant::now() < deadline && !self.running.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        for cancel in self.running.lock().unwrap().values() {
            cancel.store(true, Ordering::Relaxed);
        }
    }
}

/// The prompt recording, decoded; refusals in the Python server's words.
fn read_prompt(source: &AudioSource) -> Result<cosyvoice_native::audio::Audio, Error> {
    let (bytes, label) = match source {
        AudioSource::Upload(bytes) => (bytes.clone(), "the uploaded audio".to_owned()),
        AudioSource::File(path) => (
            std::fs::read(path).map_err(|e| Error::Input(format!("cannot read {}: {e}", name(path))))?,
            format!("'{}'", name(path)),
        ),
    };
    if bytes.is_empty() {
        return Err(Error::Input(format!("{label} is empty (0 bytes): no audio to read")));
    }
    if !bytes.starts_with(b"RIFF") {
        return Err(Error::Input(match container(&bytes) {
            Some(format) => format!(
                "{label} looks like {format}; this server (cosyvoice-native-server) reads WAV prompts only: \
                 convert it to WAV, or use the Python server"
            ),
            None => format!("{label} is not an audio file we can read. {ACCEPTED}"),
        }));
    }
    decode_wav(&bytes).map_err(|e| Error::Input(format!("cannot decode {label}: {e}")))
}

/// The audio container other than WAV that `head` starts like (as `frontend/audio.py`'s `sniff_format`).
fn container(head: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, magic: &[u8]| head.get(offset..offset + magic.len()) == Some(magic);
    let named = [(0, &b"fLaC"[..], "FLAC"), (0, b"OggS", "Ogg"), (0, b"ID3", "MP3"), (0, b"\x1a\x45\xdf\xa3", "WebM")];
    if let Some((_, _, name)) = named.iter().find(|(offset, magic, _)| at(*offset, magic)) {
        return Some(name);
    }
    if at(4, b"ftyp") {
        return Some("M4A");
    }
    (head.len() >= 2 && head[0] == 0xff && head[1] & 0xe0 == 0xe0).then_some("MP3")
}

fn name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Runtime(_) => "RuntimeError",
        Error::Io { .. } => "OSError",
        _ => "ModelBundleError",
    }
}

/// A seed for a request that names none.
fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos.wrapping_mul(0x9e37_79b9_7f4a_7c15) % (1 << 63)
}

/// A 16-bit mono WAV of `pcm` (scaled by 2^15, clipped, truncated toward zero, as the Python encoder), and its
/// length in seconds.
fn wav(pcm: &[f32], sample_rate: usize) -> (Vec<u8>, f64) {
    let data = (pcm.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + pcm.len() * 2);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    for field in [16u32.to_le_bytes().as_slice(), &1u16.to_le_bytes(), &1u16.to_le_bytes()] {
        out.extend_from_slice(field);
    }
    out.extend_from_slice(&(sample_rate as u32).to_le_bytes());
    out.extend_from_slice(&(sample_rate as u32 * 2).to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data.to_le_bytes());
    for x in pcm {
        out.extend_from_slice(&((x * 32768.0).clamp(-32768.0, 32767.0) as i16).to_le_bytes());
    }
    (out, pcm.len() as f64 / sample_rate as f64)
}
