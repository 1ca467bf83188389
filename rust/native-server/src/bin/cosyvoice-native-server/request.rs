//! A `POST /synthesize` body to a synthesis request, refused with the Python server's words at each step it
//! takes: the body (`embedded.parse_body`), its fields (pydantic's `BridgeSynthesis`, first error in field
//! order), the contract (`bridge.contract_request`: `prompt_audio` required, the mode and instruction rule),
//! the prompt audio argument (`common.audio_argument`) and the plain checks (`checks.check`).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::Value;

use crate::errors::ApiError;
use crate::json::{loads, Malformed};
use crate::settings::Settings;

pub const DEFAULT_INSTRUCTION: &str = "Speak naturally in English.";
const PROMPT_AUDIO_REQUIRED: &str = "prompt_audio is required for CosyVoice3 synthesis";
const NOT_A_MAPPING: &str = "Input should be a valid dictionary or object to extract fields from";
const SPEED_RANGE: (f64, f64) = (0.5, 2.0);
const STEPS_RANGE: (i64, i64) = (1, 32);
const MAX_FIRST_HOP: i64 = 25;

/// Where the prompt audio comes from.
pub enum AudioSource {
    Upload(Vec<u8>),
    File(PathBuf),
}

/// How the voice speaks: cloned from the transcript, or as instructed.
pub enum Conditioning {
    ZeroShot { transcript: String },
    Instruct { instruction: String },
}

impl Conditioning {
    /// The metrics' mode label.
    pub fn label(&self) -> &'static str {
        match self {
            Conditioning::ZeroShot { .. } => "zero_shot",
            Conditioning::Instruct { .. } => "instruct",
        }
    }
}

/// A checked request.
pub struct Synthesis {
    pub text: String,
    pub conditioning: Conditioning,
    pub audio: AudioSource,
    pub speed: f32,
    pub seed: Option<u64>,
}

/// The body's fields, or the first refusal; the mode label is known once the fields are.
pub fn parse(
    raw: &[u8],
    content_type: Option<&str>,
    settings: &Settings,
) -> Result<Synthesis, (ApiError, &'static str)> {
    let fields = body(raw, content_type).map_err(|e| (e, "unknown"))?;
    contract(&fields, settings)
}

fn body(raw: &[u8], content_type: Option<&str>) -> Result<Value, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::invalid("Field required", None));
    }
    if !content_type.is_some_and(http_front::answer::is_json) {
        return Err(ApiError::invalid(NOT_A_MAPPING, None));
    }
    let value = loads(raw).map_err(|e| match e {
        Malformed::Undecodable { byte, offset } => {
            ApiError::invalid(&format!("the body is not UTF-8 text (byte {byte:#04x} at offset {offset})"), None)
        }
        Malformed::Invalid(message) => ApiError::invalid(&format!("the body is not valid JSON: {message}"), None),
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(NOT_A_MAPPING, None));
    }
    check_types(&value)?;
    Ok(value)
}

/// pydantic's lax checks of `BridgeSynthesis`, in its field order.
fn check_types(v: &Value) -> Result<(), ApiError> {
    let wrong = |field: &str, what: &str| Err(ApiError::invalid(&format!("{field}: {what}"), Some(field)));
    match v.get("text") {
        None => return wrong("text", "Field required"),
        Some(Value::String(_)) => {}
        Some(_) => return wrong("text", "Input should be a valid string"),
    }
    for field in ["prompt_audio", "prompt_text", "instruct", "speaker"] {
        if !matches!(v.get(field), None | Some(Value::Null | Value::String(_))) {
            return wrong(field, "Input should be a valid string");
        }
    }
    if let Some(speed) = v.get("speed") {
        if number(speed).is_none() {
            return wrong("speed", number_error(speed));
        }
    }
    for field in ["seed", "steps"] {
        if let Some(value) = v.get(field).filter(|x| !x.is_null()) {
            if let Err(why) = integer(value) {
                return wrong(field, why);
            }
        }
    }
    if !matches!(v.get("final"), None | Some(Value::Null | Value::String(_))) {
        return wrong("final", "Input should be a valid string");
    }
    if let Some(value) = v.get("first_hop").filter(|x| !x.is_null()) {
        if let Err(why) = integer(value) {
            return wrong("first_hop", why);
        }
    }
    Ok(())
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        _ => None,
    }
}

fn number_error(v: &Value) -> &'static str {
    if v.is_string() {
        "Input should be a valid number, unable to parse string as a number"
    } else {
        "Input should be a valid number"
    }
}

fn integer(v: &Value) -> Result<i64, &'static str> {
    match v {
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Ok(i),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.2e18 => Ok(f as i64),
            _ => Err("Input should be a valid integer, got a number with a fractional part"),
        },
        Value::String(s) => {
            s.trim().parse::<i64>().map_err(|_| "Input should be a valid integer, unable to parse string as an integer")
        }
        Value::Bool(b) => Ok(i64::from(*b)),
        _ => Err("Input should be a valid integer"),
    }
}

fn text_field<'a>(v: &'a Value, name: &str) -> &'a str {
    v.get(name).and_then(Value::as_str).unwrap_or("")
}

/// `contract_request` and the service's plain checks, in the Python server's order.
fn contract(v: &Value, settings: &Settings) -> Result<Synthesis, (ApiError, &'static str)> {
    let prompt_audio = text_field(v, "prompt_audio");
    if prompt_audio.is_empty() {
        return Err((ApiError::invalid(PROMPT_AUDIO_REQUIRED, Some("prompt_audio")), "unknown"));
    }
    let instruction = text_field(v, "instruct").trim();
    let instruction = if instruction.is_empty() { text_field(v, "speaker").trim() } else { instruction };
    let transcript = text_field(v, "prompt_text");
    let conditioning = if instruction.is_empty() && !transcript.trim().is_empty() {
        Conditioning::ZeroShot { transcript: transcript.to_owned() }
    } else {
        let instruction = if instruction.is_empty() { DEFAULT_INSTRUCTION } else { instruction };
        Conditioning::Instruct { instruction: instruction.to_owned() }
    };
    let mode = conditioning.label();
    let fail = |e: ApiError| (e, mode);
    let audio = audio_argument(prompt_audio, settings).map_err(fail)?;
    let text = text_field(v, "text").to_owned();
    check_text(&text, settings.max_text_chars, "text").map_err(fail)?;
    let seed = v.get("seed").filter(|s| !s.is_null()).and_then(|s| integer(s).ok());
    let seed = seed.and_then(|s| u64::try_from(s).ok()); // negative: random, as the contract says
    let speed = v.get("speed").map_or(Some(1.0), number).unwrap_or(1.0);
    if !(SPEED_RANGE.0..=SPEED_RANGE.1).contains(&speed) {
        return Err(fail(ApiError::invalid(
            &format!("speed must be between 0.5 and 2, got {}", py_float(speed)),
            Some("speed"),
        )));
    }
    if let Conditioning::Instruct { instruction } = &conditioning {
        check_text(instruction, settings.max_text_chars, "instruction").map_err(fail)?;
    }
    options(v).map_err(fail)?;
    Ok(Synthesis { text, conditioning, audio, speed: speed as f32, seed })
}

/// The schedule options the Python engine takes (`steps`, `final`, `first_hop`): checked with its words; this
/// engine runs the model's steps and the reference's schedule, so other values are refused as unsupported.
fn options(v: &Value) -> Result<(), ApiError> {
    if let Some(steps) = v.get("steps").filter(|s| !s.is_null()).and_then(|s| integer(s).ok()) {
        if !(STEPS_RANGE.0..=STEPS_RANGE.1).contains(&steps) {
            return Err(ApiError::invalid(
                &format!("steps must be an integer from 1 to 32, got {steps}"),
                Some("steps"),
            ));
        }
        return Err(ApiError::invalid(
            "steps: the native server runs the model's own flow steps; leave steps out",
            Some("steps"),
        ));
    }
    match v.get("final").and_then(Value::as_str) {
        None | Some("full") => {}
        Some(other) => {
            return Err(ApiError::invalid(
                &format!("final must be one of 'full', 'chunked', got {other:?}").replace('"', "'"),
                Some("final"),
            ))
        }
    }
    if let Some(hop) = v.get("first_hop").filter(|s| !s.is_null()).and_then(|s| integer(s).ok()) {
        if !(1..=MAX_FIRST_HOP).contains(&hop) {
            return Err(ApiError::invalid(
                &format!("first_hop must be a whole number of speech tokens from 1 to 25, got {hop}"),
                Some("first_hop"),
            ));
        }
    }
    Ok(())
}

/// Python's `repr` of a float (`7.0`, `0.1`).
fn py_float(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// `check_text`: a non-empty string within the character limit.
fn check_text(text: &str, max_chars: usize, what: &str) -> Result<(), ApiError> {
    if text.trim().is_empty() {
        return Err(ApiError::invalid(&format!("{what} is empty; type something to say"), Some(what)));
    }
    let n = text.chars().count();
    if n > max_chars {
        return Err(ApiError::invalid(
            &format!(
                "{what} has {n} characters; at most {max_chars} are allowed per request (COSYVOICE_MAX_TEXT_CHARS); \
                 split it into several requests"
            ),
            Some(what),
        ));
    }
    Ok(())
}

/// A file under the allowed folder, else base64 (a `data:` URL too).
fn audio_argument(value: &str, settings: &Settings) -> Result<AudioSource, ApiError> {
    if let Some(root) = &settings.allowed_audio_dir {
        if value.len() < 4096 {
            if let Some(path) = allowed_path(value, root) {
                return Ok(AudioSource::File(path));
            }
        }
    }
    let payload = if value.starts_with("data:") { value.split_once(',').map_or("", |(_, p)| p) } else { value };
    base64::engine::general_purpose::STANDARD.decode(payload).map(AudioSource::Upload).map_err(|_| {
        let place = if settings.allowed_audio_dir.is_some() {
            "a file in the allowed audio folder".to_owned()
        } else {
            "a server path (refused unless COSYVOICE_ALLOWED_AUDIO_DIR, --allowed-audio-dir, names their folder)"
                .to_owned()
        };
        ApiError::invalid(&format!("prompt_audio is neither base64 audio nor {place}"), Some("prompt_audio"))
    })
}

/// `path` resolved under `root` (symlinks followed) if it names a file there.
fn allowed_path(path: &str, root: &Path) -> Option<PathBuf> {
    let base = root.canonicalize().ok()?;
    let target = base.join(path).canonicalize().ok()?;
    (target.starts_with(&base) && target.is_file()).then_some(target)
}
