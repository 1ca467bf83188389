//! A voice prompt recording to what synthesis conditions on, as `cosyvoice/frontend/prompt.py` derives it:
//! 16 kHz audio for the speech tokenizer and the speaker encoder, audio at the model rate for the flow's mel
//! prompt, then mel and tokens trimmed to exactly `token_mel_ratio` frames per token (24 kHz models, as the
//! reference). The recording is first checked with `validate_prompt`'s rules and words.

use crate::audio::Audio;
use crate::bundle::Bundle;
use crate::config::MelConfig;
use crate::error::{Error, Result};
use crate::features::{align_prompt, prompt_mel, resample};
use crate::onnx::{CampPlus, SpeechTokenizer, SAMPLE_RATE};
use crate::t2w::FlowPrompt;

/// What a prompt recording must be (the Python `Limits` defaults).
#[derive(Debug, Clone)]
pub struct PromptLimits {
    pub min_sample_rate: usize,
    pub min_seconds: f64,
    pub max_seconds: f64,
    pub silence_peak: f32,
}

impl Default for PromptLimits {
    fn default() -> Self {
        Self { min_sample_rate: 16000, min_seconds: 1.0, max_seconds: 30.0, silence_peak: 1e-3 }
    }
}

impl PromptLimits {
    /// The reason a mono prompt is unusable, in the Python frontend's words.
    pub fn check(&self, audio: &Audio) -> Result<()> {
        let refuse = |message: String| Err(Error::Input(message));
        let (frames, rate) = (audio.samples.len(), audio.sample_rate);
        if frames == 0 {
            return refuse("the prompt audio contains no samples (empty recording)".into());
        }
        if rate < self.min_sample_rate {
            let khz = format_g(self.min_sample_rate as f64 / 1000.0);
            return refuse(format!(
                "the prompt audio is sampled at {rate} Hz; it must be at least {khz} kHz ({} Hz). Record or \
                 export it at {khz} kHz or higher",
                self.min_sample_rate
            ));
        }
        if audio.samples.iter().any(|x| !x.is_finite()) {
            return refuse("the prompt audio contains NaN or infinite samples".into());
        }
        let seconds = frames as f64 / rate as f64;
        if seconds < self.min_seconds {
            return refuse(format!(
                "the prompt audio is {seconds:.2} s long; it must be at least {} s of speech",
                format_g(self.min_seconds)
            ));
        }
        if seconds > self.max_seconds {
            return refuse(format!(
                "the prompt audio is {seconds:.2} s long; at most {} s is supported (the speech tokenizer's \
                 limit). Trim it to a shorter clip",
                format_g(self.max_seconds)
            ));
        }
        let peak = audio.samples.iter().fold(0f32, |m, x| m.max(x.abs()));
        if peak <= self.silence_peak {
            return refuse(format!(
                "the prompt audio is silent (peak amplitude {}); record some speech or raise the input level",
                format_e2(peak)
            ));
        }
        Ok(())
    }
}

/// Python's `{:g}` for the limits' round values (integers without a fraction).
fn format_g(value: f64) -> String {
    if value.fract() == 0.0 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

/// Python's `{:.2e}` (a two-digit exponent with its sign).
fn format_e2(value: f32) -> String {
    let text = format!("{value:.2e}");
    match text.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => text,
    }
}

/// The prompt networks and settings of one model folder.
pub struct PromptAudio {
    tokenizer: SpeechTokenizer,
    campplus: CampPlus,
    sample_rate: usize,
    mel: MelConfig,
    token_mel_ratio: usize,
    pub limits: PromptLimits,
}

impl PromptAudio {
    /// Opens the folder's two ONNX networks.
    pub fn open(bundle: &Bundle) -> Result<Self> {
        let dir = bundle.dir();
        Ok(Self {
            tokenizer: SpeechTokenizer::open(&dir.join(SpeechTokenizer::FILENAME))?,
            campplus: CampPlus::open(&dir.join(CampPlus::FILENAME))?,
            sample_rate: bundle.config.sample_rate,
            mel: bundle.config.mel.clone(),
            token_mel_ratio: bundle.config.flow.token_mel_ratio,
            limits: PromptLimits::default(),
        })
    }

    /// The voice of a recording: checked, then featurised (prompt tokens, their mel [1, ratio*T, 80] and
    /// the speaker embedding [1, 192]).
    pub fn features(&self, audio: &Audio) -> Result<FlowPrompt> {
        self.limits.check(audio)?;
        let wav_16k = resample(&audio.samples, audio.sample_rate, SAMPLE_RATE);
        let wav_model = resample(&audio.samples, audio.sample_rate, self.sample_rate);
        let m = &self.mel;
        let feat = prompt_mel(&wav_model, self.sample_rate, m.n_fft, m.hop, m.n_mels)?.transpose(1, 2)?;
        let tokens = self.tokenizer.tokens(&wav_16k)?;
        let embedding = self.campplus.embed(&wav_16k)?;
        let (feat, tokens) = if self.sample_rate == 24000 {
            align_prompt(&feat, &tokens, self.token_mel_ratio)?
        } else {
            (feat, tokens)
        };
        Ok(FlowPrompt { tokens, feat: feat.contiguous()?, embedding })
    }
}
