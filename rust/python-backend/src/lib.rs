//! `cosyvoice_rust_backend`: each stage of the Rust engine (`cosyvoice_native`, candle on CPU) callable from
//! Python over numpy arrays, so that the tests can hold it against our Python engine and the official golden
//! fixtures stage by stage (tests/test_rust_backend_parity.py, tests/verify_flow_rust.py).
//!
//! Arrays go in as anything numpy can read as float32 / integer ids and come back as float32 numpy arrays.
//! numpy is called through Python (not its C API), so the module works with numpy 1 and 2 alike.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;

use candle_core::{Device, Tensor};
use cosyvoice_native::checkpoint::Checkpoint;
use cosyvoice_native::flow::Flow;
use cosyvoice_native::hift::Hift;
use cosyvoice_native::llm::{CosyVoice3Lm, KvCache};
use cosyvoice_native::sampling::{Sampler, SeededSampler};
use cosyvoice_native::t2w::{stream_all, FlowPrompt, Token2Wav};
use cosyvoice_native::tokenizer::CosyVoice3Tokenizer;
use cosyvoice_native::{audio, features, rng, Bundle};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

/// Any failure of the engine, as the ValueError Python sees (the engine's errors name their file or input).
fn py_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `value` as a C-contiguous numpy array of `dtype` (a copy only where it is not one already).
fn contiguous<'py>(py: Python<'py>, value: &PyAny, dtype: &str) -> PyResult<&'py PyAny> {
    let numpy = py.import("numpy")?;
    numpy.getattr("ascontiguousarray")?.call1((value, numpy.getattr(dtype)?))
}

/// A float32 tensor of `value`'s shape.
fn tensor(py: Python<'_>, value: &PyAny) -> PyResult<Tensor> {
    let buffer = PyBuffer::<f32>::get(contiguous(py, value, "float32")?)?;
    Tensor::from_vec(buffer.to_vec(py)?, buffer.shape().to_vec(), &Device::Cpu).map_err(py_err)
}

/// The samples of a 1-D float32 signal (any shape is flattened).
fn samples(py: Python<'_>, value: &PyAny) -> PyResult<Vec<f32>> {
    PyBuffer::<f32>::get(contiguous(py, value, "float32")?)?.to_vec(py)
}

/// Token ids of a list or integer array of any shape (flattened); each must fit in u32.
fn ids(py: Python<'_>, value: &PyAny) -> PyResult<Vec<u32>> {
    let values = PyBuffer::<i64>::get(contiguous(py, value, "int64")?)?.to_vec(py)?;
    values.into_iter().map(|v| u32::try_from(v).map_err(|_| py_err(format!("token id {v} out of range")))).collect()
}

/// A float32 numpy array (owning its memory) of `data` in `shape`.
fn array(py: Python<'_>, data: &[f32], shape: &[usize]) -> PyResult<PyObject> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let numpy = py.import("numpy")?;
    let flat = numpy.getattr("frombuffer")?.call1((PyByteArray::new(py, &bytes), numpy.getattr("float32")?))?;
    Ok(flat.call_method1("reshape", (shape.to_vec(),))?.into())
}

/// A float32 numpy array of a tensor.
fn tensor_array(py: Python<'_>, t: &Tensor) -> PyResult<PyObject> {
    let data = t.to_dtype(candle_core::DType::F32).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(py_err)?;
    array(py, &data, t.dims())
}

/// `cell`'s value, loaded on first use (a model's networks are read only when a stage needs them).
fn lazy<T>(cell: &OnceCell<T>, load: impl FnOnce() -> cosyvoice_native::Result<T>) -> PyResult<&T> {
    if let Some(value) = cell.get() {
        return Ok(value);
    }
    let value = load().map_err(py_err)?;
    Ok(cell.get_or_init(|| value))
}

/// Always the most likely token: the greedy decoding parity compares.
struct Greedy;

impl Sampler for Greedy {
    fn sample(&mut self, scores: &[f32], _history: &[u32]) -> u32 {
        scores.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).map_or(0, |(i, _)| i as u32)
    }
}

/// An opened model folder (the official layout); each network loads on first use.
#[pyclass(unsendable)]
struct Model {
    dir: PathBuf,
    bundle: Bundle,
    noise: Tensor,
    llm: OnceCell<CosyVoice3Lm>,
    hift: OnceCell<Hift>,
    tokenizer: OnceCell<CosyVoice3Tokenizer>,
    /// flows by Euler step count (their weights loaded once per count; the noise tensor shared)
    flows: RefCell<HashMap<usize, Rc<Flow>>>,
}

impl Model {
    fn llm(&self) -> PyResult<&CosyVoice3Lm> {
        lazy(&self.llm, || self.bundle.llm())
    }

    fn vocoder(&self) -> PyResult<&Hift> {
        lazy(&self.hift, || self.bundle.hift())
    }

    /// The flow solving in `n_steps` Euler steps (None: the model's default).
    fn flow(&self, n_steps: Option<usize>) -> PyResult<Rc<Flow>> {
        let n_steps = n_steps.unwrap_or(self.bundle.config.flow.n_timesteps);
        if let Some(flow) = self.flows.borrow().get(&n_steps) {
            return Ok(flow.clone());
        }
        let mut cfg = self.bundle.config.flow.clone();
        cfg.n_timesteps = n_steps;
        let checkpoint = Checkpoint::load(&self.dir.join("flow.pt"), None).map_err(py_err)?;
        let flow = Rc::new(Flow::load(&checkpoint, &cfg, self.noise.clone()).map_err(py_err)?);
        self.flows.borrow_mut().insert(n_steps, flow.clone());
        Ok(flow)
    }
}

/// The flow's voice: prompt speech tokens, their mel [1, F, 80], the speaker embedding [1, 192].
fn flow_prompt(py: Python<'_>, prompt_tokens: &PyAny, prompt_feat: &PyAny, embedding: &PyAny) -> PyResult<FlowPrompt> {
    Ok(FlowPrompt {
        tokens: ids(py, prompt_tokens)?,
        feat: tensor(py, prompt_feat)?,
        embedding: tensor(py, embedding)?,
    })
}

/// Hidden states [N + 1, H] at the last prompt position and after each of the N `fed` tokens.
fn forced_hidden(
    lm: &CosyVoice3Lm,
    lm_input: &Tensor,
    fed: &[u32],
    kv_cache: bool,
) -> cosyvoice_native::Result<Tensor> {
    let n_prompt = lm_input.dim(0)?;
    let mut cache = KvCache::default();
    if !kv_cache {
        let all = Tensor::cat(&[lm_input, &lm.speech_embeddings(fed)?], 0)?;
        return Ok(lm.forward(&all, &mut cache)?.narrow(0, n_prompt - 1, fed.len() + 1)?);
    }
    let prompt = lm.forward(lm_input, &mut cache)?;
    let mut rows = vec![prompt.narrow(0, n_prompt - 1, 1)?];
    for token in fed {
        rows.push(lm.forward(&lm.speech_embeddings(&[*token])?, &mut cache)?);
    }
    Ok(Tensor::cat(&rows, 0)?)
}

#[pymethods]
impl Model {
    /// Opens `model_dir`. `noise` [1, 80, L]: the flow's fixed start noise (default: the official buffer,
    /// replayed; 15000 frames).
    #[new]
    #[args(noise = "None")]
    fn new(py: Python<'_>, model_dir: &str, noise: Option<&PyAny>) -> PyResult<Self> {
        let dir = PathBuf::from(model_dir);
        let noise = match noise {
            Some(noise) => tensor(py, noise)?,
            None => rng::cfm_noise().map_err(py_err)?,
        };
        Ok(Self {
            bundle: Bundle::open(&dir).map_err(py_err)?,
            dir,
            noise,
            llm: OnceCell::new(),
            hift: OnceCell::new(),
            tokenizer: OnceCell::new(),
            flows: RefCell::new(HashMap::new()),
        })
    }

    /// Token ids of `text` (special tokens written in it become their id).
    fn tokenize(&self, text: &str) -> PyResult<Vec<u32>> {
        lazy(&self.tokenizer, || self.bundle.tokenizer())?.encode(text).map_err(py_err)
    }

    /// The LM's prompt [L, H]: sos, the text of `prompt_text ++ text`, task_id, the prompt speech.
    fn lm_input(&self, py: Python<'_>, text: &PyAny, prompt_text: &PyAny, prompt_speech: &PyAny) -> PyResult<PyObject> {
        let lm = self.llm()?;
        tensor_array(
            py,
            &lm.lm_input(&ids(py, text)?, &ids(py, prompt_text)?, &ids(py, prompt_speech)?).map_err(py_err)?,
        )
    }

    /// Teacher-forced decoding: the prompt, then `forced` tokens fed back one by one; returns (hidden [N, H],
    /// log-probs [N, V]) of the N = len(forced) decisions (before any sampler mask). `kv_cache=False` runs one
    /// causal pass over the whole sequence instead of a step per token.
    #[args(kv_cache = "true")]
    fn teacher_forced(
        &self,
        py: Python<'_>,
        text: &PyAny,
        prompt_text: &PyAny,
        prompt_speech: &PyAny,
        forced: &PyAny,
        kv_cache: bool,
    ) -> PyResult<(PyObject, PyObject)> {
        let lm = self.llm()?;
        let forced = ids(py, forced)?;
        if forced.is_empty() {
            return Err(py_err("teacher_forced needs at least one forced token"));
        }
        let lm_input =
            lm.lm_input(&ids(py, text)?, &ids(py, prompt_text)?, &ids(py, prompt_speech)?).map_err(py_err)?;
        let hidden = forced_hidden(lm, &lm_input, &forced[..forced.len() - 1], kv_cache).map_err(py_err)?;
        let logp = lm.log_probs(&hidden).map_err(py_err)?;
        Ok((tensor_array(py, &hidden)?, tensor_array(py, &logp)?))
    }

    /// Speech tokens by the official decoding loop (length limits from the text, silent-run rule applied):
    /// greedy when `seed` is None, else repetition-aware sampling with the counter-based random stream of
    /// `seed` (the Python engine's `SeededSampler`: the same seed gives the same tokens).
    #[args(seed = "None")]
    fn generate(
        &self,
        py: Python<'_>,
        text: &PyAny,
        prompt_text: &PyAny,
        prompt_speech: &PyAny,
        seed: Option<u64>,
    ) -> PyResult<Vec<u32>> {
        let lm = self.llm()?;
        let text = ids(py, text)?;
        let lm_input = lm.lm_input(&text, &ids(py, prompt_text)?, &ids(py, prompt_speech)?).map_err(py_err)?;
        let (min_len, max_len) = CosyVoice3Lm::length_limits(text.len());
        let mut sampler: Box<dyn Sampler> = match seed {
            Some(seed) => Box::new(SeededSampler::new(seed, lm.sampling.clone())),
            None => Box::new(Greedy),
        };
        lm.generate(&lm_input, min_len, max_len, sampler.as_mut()).map_err(py_err)
    }

    /// Mel [1, 80, T] after the prompt for speech `tokens` (the flow's `inference`): chunk-causal attention when
    /// `streaming`, the last look-ahead tokens as context only unless `finalize`; `n_steps` Euler steps (None:
    /// the model's).
    #[args(streaming = "false", finalize = "true", n_steps = "None")]
    #[allow(clippy::too_many_arguments)] // the flow's own inputs, as Python passes them
    fn flow_mel(
        &self,
        py: Python<'_>,
        tokens: &PyAny,
        prompt_tokens: &PyAny,
        prompt_feat: &PyAny,
        embedding: &PyAny,
        streaming: bool,
        finalize: bool,
        n_steps: Option<usize>,
    ) -> PyResult<PyObject> {
        let prompt = flow_prompt(py, prompt_tokens, prompt_feat, embedding)?;
        let flow = self.flow(n_steps)?;
        let mel = flow
            .inference(&ids(py, tokens)?, &prompt.tokens, &prompt.feat, &prompt.embedding, streaming, finalize)
            .map_err(py_err)?;
        tensor_array(py, &mel)
    }

    /// The vocoder on mel [1, 80, T]: (waveform [1, N], excitation [1, 1, N]); see `Hift::inference` for N
    /// when not `finalize` (streaming: the look-ahead frames give no samples yet).
    #[args(finalize = "true")]
    fn hift(&self, py: Python<'_>, mel: &PyAny, finalize: bool) -> PyResult<(PyObject, PyObject)> {
        let (speech, source) = self.vocoder()?.inference(&tensor(py, mel)?, finalize).map_err(py_err)?;
        Ok((tensor_array(py, &speech)?, tensor_array(py, &source)?))
    }

    /// Speech `tokens` known in advance to waveform chunks (1-D float32 each), in the prompt's voice: the
    /// reference's streaming chunks when `stream`, else one chunk (full attention, the vocoder finalised).
    #[args(stream = "false")]
    fn token2wav(
        &self,
        py: Python<'_>,
        tokens: &PyAny,
        prompt_tokens: &PyAny,
        prompt_feat: &PyAny,
        embedding: &PyAny,
        stream: bool,
    ) -> PyResult<Vec<PyObject>> {
        let prompt = flow_prompt(py, prompt_tokens, prompt_feat, embedding)?;
        let tokens = ids(py, tokens)?;
        let (flow, hift) = (self.flow(None)?, self.vocoder()?);
        let chunks = if stream {
            stream_all(&flow, hift, &prompt, &tokens)
        } else {
            Token2Wav::new(&flow, hift, &prompt).finish(&tokens).map(|chunk| vec![chunk])
        };
        chunks
            .map_err(py_err)?
            .iter()
            .map(|chunk| tensor_array(py, &chunk.pcm.flatten_all().map_err(py_err)?))
            .collect()
    }
}

/// Mono float32 samples and the sample rate of a WAV file's bytes (channels averaged).
#[pyfunction]
fn decode_wav(py: Python<'_>, data: &PyBytes) -> PyResult<(PyObject, usize)> {
    let decoded = audio::decode_wav(data.as_bytes()).map_err(py_err)?;
    Ok((array(py, &decoded.samples, &[decoded.samples.len()])?, decoded.sample_rate))
}

/// `wav` resampled from `orig_sr` to `new_sr` (torchaudio's Resample defaults), 1-D.
#[pyfunction]
fn resample(py: Python<'_>, wav: &PyAny, orig_sr: usize, new_sr: usize) -> PyResult<PyObject> {
    let out = features::resample(&samples(py, wav)?, orig_sr, new_sr);
    array(py, &out, &[out.len()])
}

/// The flow's prompt mel (Matcha `mel_spectrogram`, center=False) of `wav` at `sample_rate`, [1, n_mels, T].
#[pyfunction(n_fft = "1920", hop = "480", n_mels = "80")]
fn prompt_mel(
    py: Python<'_>,
    wav: &PyAny,
    sample_rate: usize,
    n_fft: usize,
    hop: usize,
    n_mels: usize,
) -> PyResult<PyObject> {
    tensor_array(py, &features::prompt_mel(&samples(py, wav)?, sample_rate, n_fft, hop, n_mels).map_err(py_err)?)
}

/// Whisper's log-mel of 16 kHz audio (the speech tokenizer's input), [1, n_mels, T].
#[pyfunction(n_mels = "128")]
fn whisper_log_mel(py: Python<'_>, wav_16k: &PyAny, n_mels: usize) -> PyResult<PyObject> {
    tensor_array(py, &features::whisper_log_mel(&samples(py, wav_16k)?, n_mels).map_err(py_err)?)
}

/// Kaldi's log mel filterbank of 16 kHz audio in [-1, 1) (the speaker encoder's input), [T, n_mels].
#[pyfunction(n_mels = "80")]
fn kaldi_fbank(py: Python<'_>, wav_16k: &PyAny, n_mels: usize) -> PyResult<PyObject> {
    tensor_array(py, &features::kaldi_fbank(&samples(py, wav_16k)?, n_mels).map_err(py_err)?)
}

/// The flow's official start noise [1, 80, 15000], replayed from torch's generator.
#[pyfunction]
fn cfm_noise(py: Python<'_>) -> PyResult<PyObject> {
    tensor_array(py, &rng::cfm_noise().map_err(py_err)?)
}

#[pymodule]
fn cosyvoice_rust_backend(_py: Python<'_>, m: &PyModule) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_function(wrap_pyfunction!(decode_wav, m)?)?;
    m.add_function(wrap_pyfunction!(resample, m)?)?;
    m.add_function(wrap_pyfunction!(prompt_mel, m)?)?;
    m.add_function(wrap_pyfunction!(whisper_log_mel, m)?)?;
    m.add_function(wrap_pyfunction!(kaldi_fbank, m)?)?;
    m.add_function(wrap_pyfunction!(cfm_noise, m)?)?;
    Ok(())
}
