//! The bundle's settings: `cosyvoice3.yaml` (hyperpyyaml) read as plain data, and the Qwen2
//! `CosyVoice-BlankEN/config.json`.
//!
//! hyperpyyaml tags would import and run Python; a model folder is untrusted input, so tags are dropped to
//! their data and `!ref <key>` is resolved against the document, with `+ - * /` between numbers (the
//! official file writes `!ref <chunk_size> * <token_mel_ratio>`), as `cosyvoice/config.py` does.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

use crate::error::{Error, Result};

/// The Qwen2 sizes CosyVoice3's LLM is built from (`config.json` of `CosyVoice-BlankEN`).
#[derive(Debug, Clone, Deserialize)]
pub struct QwenConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
}

impl QwenConfig {
    /// Reads `config.json`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        let cfg: Self = serde_json::from_str(&text).map_err(|e| config_error(path, e.to_string()))?;
        if cfg.num_attention_heads == 0
            || cfg.num_key_value_heads == 0
            || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads)
            || !cfg.num_attention_heads.is_multiple_of(cfg.num_key_value_heads)
        {
            return Err(config_error(path, "heads must divide hidden_size and kv heads divide heads".into()));
        }
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// The LM's repetition-aware sampler settings (`llm.sampling`).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    pub top_p: f64,
    pub top_k: usize,
    pub win_size: usize,
    pub tau_r: f64,
}

/// `llm:` of the yaml.
#[derive(Debug, Clone)]
pub struct LlmConfig {
    pub input_size: usize,
    pub output_size: usize,
    pub speech_token_size: usize,
    pub sampling: SamplingConfig,
}

/// The DiT velocity estimator (`flow.decoder.estimator`).
#[derive(Debug, Clone)]
pub struct DitConfig {
    pub dim: usize,
    pub depth: usize,
    pub heads: usize,
    pub dim_head: usize,
    pub ff_mult: usize,
    pub mel_dim: usize,
    pub mu_dim: usize,
    pub spk_dim: usize,
    /// Mel frames per chunk of the chunk-causal attention mask.
    pub static_chunk_size: usize,
}

/// `flow:` of the yaml: token embedding, look-ahead layer, CFM decoder.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    pub input_size: usize,
    pub output_size: usize,
    pub spk_embed_dim: usize,
    pub vocab_size: usize,
    pub token_mel_ratio: usize,
    pub pre_lookahead_len: usize,
    pub pre_lookahead_channels: usize,
    pub dit: DitConfig,
    /// Classifier-free guidance strength at inference.
    pub cfg_rate: f64,
    /// Euler steps of the ODE (the reference's default; the yaml does not set it).
    pub n_timesteps: usize,
}

/// The vocoder's F0 predictor (`hift.f0_predictor`).
#[derive(Debug, Clone)]
pub struct F0PredictorConfig {
    pub num_class: usize,
    pub in_channels: usize,
    pub cond_channels: usize,
}

/// `hift:` of the yaml: the causal HiFT vocoder.
#[derive(Debug, Clone)]
pub struct HiftConfig {
    pub in_channels: usize,
    pub base_channels: usize,
    pub nb_harmonics: usize,
    pub sampling_rate: usize,
    pub nsf_alpha: f64,
    pub nsf_sigma: f64,
    pub nsf_voiced_threshold: f64,
    pub upsample_rates: Vec<usize>,
    pub upsample_kernel_sizes: Vec<usize>,
    pub n_fft: usize,
    pub hop_len: usize,
    pub resblock_kernel_sizes: Vec<usize>,
    pub resblock_dilation_sizes: Vec<Vec<usize>>,
    pub source_resblock_kernel_sizes: Vec<usize>,
    pub source_resblock_dilation_sizes: Vec<Vec<usize>>,
    pub lrelu_slope: f64,
    pub audio_limit: f64,
    pub conv_pre_look_right: usize,
    pub f0_predictor: F0PredictorConfig,
}

impl HiftConfig {
    /// Waveform samples per mel frame (480 for the released model).
    pub fn upsample_scale(&self) -> usize {
        self.hop_len * self.upsample_rates.iter().product::<usize>()
    }
}

/// The prompt mel's analysis (`feat_extractor`: Matcha's `mel_spectrogram`, window = n_fft).
#[derive(Debug, Clone)]
pub struct MelConfig {
    pub n_fft: usize,
    pub hop: usize,
    pub n_mels: usize,
}

/// Everything inference reads from `cosyvoice3.yaml`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub sample_rate: usize,
    pub mel: MelConfig,
    pub llm: LlmConfig,
    pub flow: FlowConfig,
    pub hift: HiftConfig,
}

impl ModelConfig {
    /// Reads `cosyvoice3.yaml` and checks it against the Qwen2 sizes.
    pub fn read(path: &Path, qwen: &QwenConfig) -> Result<Self> {
        let doc: Value = serde_yaml::from_str(&read_text(path)?).map_err(|e| config_error(path, e.to_string()))?;
        let doc = Yaml { path: path.to_owned(), resolved: resolve(&doc, &doc, path, 0)? };
        let sampling = |key: &str| doc.num(&["llm", "sampling", key]);
        let llm = LlmConfig {
            input_size: doc.size(&["llm", "llm_input_size"])?,
            output_size: doc.size(&["llm", "llm_output_size"])?,
            speech_token_size: doc.size(&["llm", "speech_token_size"])?,
            sampling: SamplingConfig {
                top_p: sampling("top_p")?,
                top_k: doc.size(&["llm", "sampling", "top_k"])?,
                win_size: doc.size(&["llm", "sampling", "win_size"])?,
                tau_r: sampling("tau_r")?,
            },
        };
        if llm.input_size != qwen.hidden_size || llm.output_size != qwen.hidden_size {
            return Err(config_error(
                path,
                format!(
                    "llm_input_size/llm_output_size ({}/{}) must equal the Qwen2 hidden_size ({})",
                    llm.input_size, llm.output_size, qwen.hidden_size
                ),
            ));
        }
        let flow = read_flow(&doc)?;
        if flow.vocab_size != llm.speech_token_size {
            return Err(config_error(path, "llm.speech_token_size must equal flow.vocab_size".into()));
        }
        let mel = MelConfig {
            n_fft: doc.size(&["feat_extractor", "n_fft"])?,
            hop: doc.size(&["feat_extractor", "hop_size"])?,
            n_mels: doc.size(&["feat_extractor", "num_mels"])?,
        };
        Ok(Self { sample_rate: doc.size(&["sample_rate"])?, mel, llm, flow, hift: read_hift(&doc)? })
    }
}

fn read_flow(doc: &Yaml) -> Result<FlowConfig> {
    let flow = |key: &str| doc.size(&["flow", key]);
    let est = |key: &str| doc.size(&["flow", "decoder", "estimator", key]);
    Ok(FlowConfig {
        input_size: flow("input_size")?,
        output_size: flow("output_size")?,
        spk_embed_dim: flow("spk_embed_dim")?,
        vocab_size: flow("vocab_size")?,
        token_mel_ratio: flow("token_mel_ratio")?,
        pre_lookahead_len: flow("pre_lookahead_len")?,
        pre_lookahead_channels: doc.size(&["flow", "pre_lookahead_layer", "channels"])?,
        dit: DitConfig {
            dim: est("dim")?,
            depth: est("depth")?,
            heads: est("heads")?,
            dim_head: est("dim_head")?,
            ff_mult: est("ff_mult")?,
            mel_dim: est("mel_dim")?,
            mu_dim: est("mu_dim")?,
            spk_dim: est("spk_dim")?,
            static_chunk_size: est("static_chunk_size")?,
        },
        cfg_rate: doc.num(&["flow", "decoder", "cfm_params", "content", "inference_cfg_rate"])?,
        n_timesteps: 10,
    })
}

fn read_hift(doc: &Yaml) -> Result<HiftConfig> {
    let size = |key: &str| doc.size(&["hift", key]);
    let num = |key: &str| doc.num(&["hift", key]);
    let sizes = |key: &str| doc.sizes(doc.get(&["hift", key])?, key);
    let nested = |key: &str| -> Result<Vec<Vec<usize>>> {
        let node = doc.get(&["hift", key])?;
        let rows = node.as_sequence().ok_or_else(|| config_error(&doc.path, format!("'hift.{key}' is not a list")))?;
        rows.iter().map(|row| doc.sizes(row, key)).collect()
    };
    let f0 = |key: &str| doc.size(&["hift", "f0_predictor", key]);
    Ok(HiftConfig {
        in_channels: size("in_channels")?,
        base_channels: size("base_channels")?,
        nb_harmonics: size("nb_harmonics")?,
        sampling_rate: size("sampling_rate")?,
        nsf_alpha: num("nsf_alpha")?,
        nsf_sigma: num("nsf_sigma")?,
        nsf_voiced_threshold: num("nsf_voiced_threshold")?,
        upsample_rates: sizes("upsample_rates")?,
        upsample_kernel_sizes: sizes("upsample_kernel_sizes")?,
        n_fft: doc.size(&["hift", "istft_params", "n_fft"])?,
        hop_len: doc.size(&["hift", "istft_params", "hop_len"])?,
        resblock_kernel_sizes: sizes("resblock_kernel_sizes")?,
        resblock_dilation_sizes: nested("resblock_dilation_sizes")?,
        source_resblock_kernel_sizes: sizes("source_resblock_kernel_sizes")?,
        source_resblock_dilation_sizes: nested("source_resblock_dilation_sizes")?,
        lrelu_slope: num("lrelu_slope")?,
        audio_limit: num("audio_limit")?,
        conv_pre_look_right: size("conv_pre_look_right")?,
        f0_predictor: F0PredictorConfig {
            num_class: f0("num_class")?,
            in_channels: f0("in_channels")?,
            cond_channels: f0("cond_channels")?,
        },
    })
}

/// A resolved yaml document and where it came from.
struct Yaml {
    path: PathBuf,
    resolved: Value,
}

impl Yaml {
    fn get(&self, keys: &[&str]) -> Result<&Value> {
        let mut node = &self.resolved;
        for key in keys {
            node = node.get(*key).ok_or_else(|| config_error(&self.path, format!("no '{}'", keys.join("."))))?;
        }
        Ok(node)
    }

    fn num(&self, keys: &[&str]) -> Result<f64> {
        let node = self.get(keys)?;
        as_number(node).ok_or_else(|| config_error(&self.path, format!("'{}' is not a number", keys.join("."))))
    }

    /// A list of positive integers (`what` names it in errors).
    fn sizes(&self, node: &Value, what: &str) -> Result<Vec<usize>> {
        let bad = || config_error(&self.path, format!("'{what}' must be a list of positive integers"));
        let items = node.as_sequence().ok_or_else(bad)?;
        items.iter().map(|v| v.as_u64().filter(|n| *n > 0).map(|n| n as usize).ok_or_else(bad)).collect()
    }

    fn size(&self, keys: &[&str]) -> Result<usize> {
        match self.get(keys)?.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(config_error(&self.path, format!("'{}' must be a positive integer", keys.join(".")))),
        }
    }
}

fn as_number(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(), // yaml 1.1 floats such as `1e-06` may arrive as text
        _ => None,
    }
}

/// `value` with tags dropped to their data and every `!ref` replaced by what it points at.
fn resolve(value: &Value, doc: &Value, path: &Path, depth: usize) -> Result<Value> {
    if depth > 64 {
        return Err(config_error(path, "!ref chain too deep (a cycle?)".into()));
    }
    Ok(match value {
        Value::Tagged(tagged) if tagged.tag == "ref" => {
            let expr = tagged.value.as_str().ok_or_else(|| config_error(path, "!ref needs a string".into()))?;
            resolve_ref(expr, doc, path, depth)?
        }
        Value::Tagged(tagged) => resolve(&tagged.value, doc, path, depth + 1)?,
        Value::Mapping(map) => Value::Mapping(
            map.iter().map(|(k, v)| Ok((k.clone(), resolve(v, doc, path, depth + 1)?))).collect::<Result<_>>()?,
        ),
        Value::Sequence(items) => {
            Value::Sequence(items.iter().map(|v| resolve(v, doc, path, depth + 1)).collect::<Result<_>>()?)
        }
        other => other.clone(),
    })
}

/// `<a>` alone is the value at `a` (dotted path); otherwise references and numbers joined by `+ - * /`,
/// evaluated left to right (the official files use one operator).
fn resolve_ref(expr: &str, doc: &Value, path: &Path, depth: usize) -> Result<Value> {
    let lookup = |name: &str| -> Result<Value> {
        let mut node = doc;
        for part in name.split('.') {
            node = node.get(part).ok_or_else(|| config_error(path, format!("!ref <{name}> points at nothing")))?;
        }
        resolve(node, doc, path, depth + 1)
    };
    let trimmed = expr.trim();
    if let Some(name) = trimmed.strip_prefix('<').and_then(|s| s.strip_suffix('>')) {
        if !name.contains('<') {
            return lookup(name);
        }
    }
    let mut total: Option<f64> = None;
    let mut op = '+';
    for token in trimmed.split_whitespace() {
        if matches!(token, "+" | "-" | "*" | "/") {
            op = token.chars().next().unwrap_or('+');
            continue;
        }
        let operand = match token.strip_prefix('<').and_then(|s| s.strip_suffix('>')) {
            Some(name) => as_number(&lookup(name)?),
            None => token.parse().ok(),
        }
        .ok_or_else(|| config_error(path, format!("!ref '{expr}': '{token}' is not a number")))?;
        total = Some(match (total, op) {
            (None, _) => operand,
            (Some(t), '+') => t + operand,
            (Some(t), '-') => t - operand,
            (Some(t), '*') => t * operand,
            (Some(t), _) => t / operand,
        });
    }
    let total = total.ok_or_else(|| config_error(path, format!("empty !ref '{expr}'")))?;
    Ok(if total.fract() == 0.0 && total >= 0.0 { Value::from(total as u64) } else { Value::from(total) })
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_owned(), source })
}

pub(crate) fn config_error(path: &Path, message: String) -> Error {
    Error::Config { path: path.to_owned(), message }
}
