//! The two ONNX networks of a model folder, run through ONNX Runtime as `cosyvoice/frontend/onnx_models.py`
//! runs them: the S3 speech tokenizer (Whisper log-mel -> speech tokens) and the CAM++ speaker encoder
//! (mean-normalised Kaldi fbank -> embedding), fed by the names the model declares, one intra-op thread
//! (more may reorder reductions), every graph optimisation on.
//!
//! ONNX Runtime is not linked: its shared library is opened at run time (`ort`'s `load-dynamic`), from
//! `ORT_DYLIB_PATH`, else from the onnxruntime wheel of the project's virtual environment, so no binary is
//! downloaded at build time and the process never loads Python.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use candle_core::{Device, Tensor};
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::{TensorElementType, ValueType};

use crate::error::{Error, Result};
use crate::features::{kaldi_fbank, whisper_log_mel};

/// Sample rate both networks read.
pub const SAMPLE_RATE: usize = 16000;

static ENVIRONMENT: OnceLock<std::result::Result<ort::environment::Environment, String>> = OnceLock::new();

/// The ONNX Runtime library this process uses: `ORT_DYLIB_PATH`, else `libonnxruntime.so*` of the onnxruntime
/// wheel in the virtual environment (`COSYVOICE_VENV`, else `.venv` of the repository holding the executable).
pub fn runtime_library() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(Error::Runtime(format!("ORT_DYLIB_PATH={} is not a file", path.display())));
        }
        return Ok(path);
    }
    let venv = std::env::var_os("COSYVOICE_VENV").map(PathBuf::from).or_else(|| {
        let exe = std::env::current_exe().ok()?.canonicalize().ok()?;
        exe.ancestors().find(|dir| dir.join("pyproject.toml").is_file()).map(|root| root.join(".venv"))
    });
    venv.as_deref().and_then(wheel_library).ok_or_else(|| {
        Error::Runtime(format!(
            "ONNX Runtime not found: set ORT_DYLIB_PATH to libonnxruntime.so (the onnxruntime wheel ships it in \
                 site-packages/onnxruntime/capi/), or COSYVOICE_VENV to a virtual environment with onnxruntime \
                 installed (looked in {})",
            venv.map_or("no virtual environment".to_owned(), |v| v.display().to_string())
        ))
    })
}

/// `lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so*` under `venv`.
fn wheel_library(venv: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    let capi =
        lib.flatten().map(|entry| entry.path().join("site-packages/onnxruntime/capi")).find(|dir| dir.is_dir())?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(capi)
        .ok()?
        .flatten()
        .map(|entry| entry.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libonnxruntime.so")))
        .collect();
    found.sort(); // the versioned name sorts last: the file itself, not a link
    found.pop()
}

/// The process's one ONNX Runtime environment, created on first use.
fn environment() -> Result<&'static ort::environment::Environment> {
    let built = ENVIRONMENT.get_or_init(|| {
        let library = runtime_library().map_err(|e| e.to_string())?;
        let builder = ort::init_from(&library)
            .map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", library.display()))?;
        builder.with_name("cosyvoice-native").build().map_err(|e| format!("cannot start ONNX Runtime: {e}"))
    });
    built.as_ref().map_err(|message| Error::Runtime(message.clone()))
}

fn open_session(path: &Path) -> Result<Session> {
    if !path.is_file() {
        return Err(Error::Config {
            path: path.to_owned(),
            message: "missing; a CosyVoice3 model folder ships it next to cosyvoice3.yaml".into(),
        });
    }
    let bad = |e: &dyn std::fmt::Display| Error::Config {
        path: path.to_owned(),
        message: format!("not a loadable ONNX model: {e}"),
    };
    Session::builder(environment()?)
        .map_err(|e| bad(&e))?
        .with_optimization_level(GraphOptimizationLevel::All)
        .map_err(|e| bad(&e))?
        .with_intra_threads(1)
        .map_err(|e| bad(&e))?
        .commit_from_file(path)
        .map_err(|e| bad(&e))
}

/// Axis `axis` of a session input when the model fixes it, else `default`.
fn static_dim(value: &ValueType, axis: usize, default: usize) -> usize {
    match value.tensor_shape().and_then(|shape| shape.get(axis).copied()) {
        Some(dim) if dim > 0 => dim as usize,
        _ => default,
    }
}

fn runtime_error(e: ort::Error) -> Error {
    Error::Runtime(format!("ONNX Runtime: {e}"))
}

/// Whisper log-mel of 16 kHz audio -> discrete speech tokens (25 per second).
pub struct SpeechTokenizer {
    session: Mutex<Session>,
    feats: String,
    length: String,
    length_i64: bool,
    n_mels: usize,
}

impl SpeechTokenizer {
    pub const FILENAME: &'static str = "speech_tokenizer_v3.onnx";

    pub fn open(path: &Path) -> Result<Self> {
        let session = open_session(path)?;
        let inputs = session.inputs();
        if inputs.len() != 2 {
            return Err(Error::Config {
                path: path.to_owned(),
                message: format!("must take (feats, feats_length), it takes {} inputs", inputs.len()),
            });
        }
        let (feats, length) = (inputs[0].name().to_owned(), inputs[1].name().to_owned());
        let length_i64 = inputs[1].dtype().tensor_type() == Some(TensorElementType::Int64);
        let n_mels = static_dim(inputs[0].dtype(), 1, 128);
        Ok(Self { session: Mutex::new(session), feats, length, length_i64, n_mels })
    }

    /// Mono 16 kHz audio -> token ids.
    pub fn tokens(&self, wav_16k: &[f32]) -> Result<Vec<u32>> {
        self.tokenize_log_mel(&whisper_log_mel(wav_16k, self.n_mels)?)
    }

    /// Whisper log-mel [1, n_mels, T] -> token ids (ceil(T / 4) of them).
    pub fn tokenize_log_mel(&self, log_mel: &Tensor) -> Result<Vec<u32>> {
        let (_, mels, frames) = log_mel.dims3()?;
        let data = log_mel.flatten_all()?.to_vec1::<f32>()?;
        let feats = ort::value::Tensor::from_array(([1usize, mels, frames], data)).map_err(runtime_error)?;
        let length = if self.length_i64 {
            ort::value::Tensor::from_array(([1usize], vec![frames as i64])).map_err(runtime_error)?.into_dyn()
        } else {
            ort::value::Tensor::from_array(([1usize], vec![frames as i32])).map_err(runtime_error)?.into_dyn()
        };
        let mut session = self.session.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let inputs = ort::inputs![self.feats.as_str() => feats, self.length.as_str() => length];
        let outputs = session.run(inputs).map_err(runtime_error)?;
        let tokens: Vec<i64> = match outputs[0].try_extract_tensor::<i32>() {
            Ok((_, values)) => values.iter().map(|&v| v as i64).collect(),
            Err(_) => outputs[0].try_extract_tensor::<i64>().map_err(runtime_error)?.1.to_vec(),
        };
        tokens
            .into_iter()
            .map(|t| u32::try_from(t).map_err(|_| Error::Runtime(format!("the speech tokenizer produced token {t}"))))
            .collect()
    }
}

/// CAM++ speaker encoder: mean-normalised Kaldi fbank of 16 kHz audio -> an (unnormalised) embedding.
pub struct CampPlus {
    session: Mutex<Session>,
    input: String,
    n_mels: usize,
}

impl CampPlus {
    pub const FILENAME: &'static str = "campplus.onnx";

    pub fn open(path: &Path) -> Result<Self> {
        let session = open_session(path)?;
        let input = session.inputs()[0].name().to_owned();
        let n_mels = static_dim(session.inputs()[0].dtype(), 2, 80);
        Ok(Self { session: Mutex::new(session), input, n_mels })
    }

    /// Mono 16 kHz audio -> embedding [1, D].
    pub fn embed(&self, wav_16k: &[f32]) -> Result<Tensor> {
        let fbank = kaldi_fbank(wav_16k, self.n_mels)?;
        if fbank.dim(0)? == 0 {
            return Err(Error::Input("the prompt audio is shorter than one 25 ms analysis frame".into()));
        }
        self.embed_fbank(&fbank.broadcast_sub(&fbank.mean_keepdim(0)?)?)
    }

    /// Mean-normalised fbank [T, n_mels] -> embedding [1, D].
    pub fn embed_fbank(&self, features: &Tensor) -> Result<Tensor> {
        let (frames, mels) = features.dims2()?;
        let data = features.flatten_all()?.to_vec1::<f32>()?;
        let input = ort::value::Tensor::from_array(([1usize, frames, mels], data)).map_err(runtime_error)?;
        let mut session = self.session.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let outputs = session.run(ort::inputs![self.input.as_str() => input]).map_err(runtime_error)?;
        let (_, values) = outputs[0].try_extract_tensor::<f32>().map_err(runtime_error)?;
        Ok(Tensor::from_vec(values.to_vec(), (1, values.len()), &Device::Cpu)?)
    }
}
