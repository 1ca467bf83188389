//! One request end to end: text and a prompt recording (with its transcript, or an instruction) -> prompt
//! features -> LLM -> flow -> HiFT -> 24 kHz audio, with the conditioning of `cosyvoice/pipeline.py`:
//!
//! * zero-shot: the LLM's prompt ids are the system prompt's (the head the user typed before
//!   `<|endofprompt|>`, else the default), then the plain transcript's, and it continues the voice's speech
//!   tokens;
//! * instruct2: the wrapped instruction replaces the transcript and the LLM starts fresh;
//! * cross-lingual: the text carries the system prompt as its head and the LLM starts fresh.
//!
//! The flow is always prompted with the voice. The text is normalised and split into pieces; piece i is
//! generated with seed `seed + i` (the Python engine's counter-based draws, so equal seeds give equal tokens)
//! and vocoded whole (the non-streaming path: one flow call with full attention, the vocoder finalised).

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Tensor};

use crate::audio::Audio;
use crate::bundle::Bundle;
use crate::error::{Error, Result};
use crate::flow::Flow;
use crate::hift::Hift;
use crate::llm::CosyVoice3Lm;
use crate::prompt::{PromptAudio, PromptLimits};
use crate::prompts::{instruct_text, prefixed};
use crate::rng::cfm_noise;
use crate::sampling::{Sampler, SeededSampler};
use crate::t2w::FlowPrompt;
use crate::text::TextFrontend;
use crate::tokenizer::{CosyVoice3Tokenizer, END_OF_PROMPT};

/// How the voice conditions the LLM.
#[derive(Debug, Clone)]
pub enum Mode {
    /// clone the recording; its transcript (optionally after a system prompt and `<|endofprompt|>`)
    ZeroShot { transcript: String },
    /// speak as instructed in the recording's voice
    Instruct { instruction: String },
    /// the recording's voice, without its transcript
    CrossLingual,
}

/// One synthesis request.
pub struct Request {
    pub text: String,
    pub mode: Mode,
    pub prompt: Audio,
    pub seed: u64,
    /// 0.5..=2.0: the mel is stretched before the vocoder
    pub speed: f32,
}

/// A loaded model folder: every network, ready for concurrent requests.
pub struct Engine {
    lm: CosyVoice3Lm,
    flow: Flow,
    hift: Hift,
    tokenizer: CosyVoice3Tokenizer,
    prompt: PromptAudio,
    pub sample_rate: usize,
}

impl Engine {
    pub fn load(bundle: &Bundle) -> Result<Self> {
        Ok(Self {
            lm: bundle.llm()?,
            flow: bundle.flow(cfm_noise()?)?,
            hift: bundle.hift()?,
            tokenizer: bundle.tokenizer()?,
            prompt: PromptAudio::open(bundle)?,
            sample_rate: bundle.config.sample_rate,
        })
    }

    /// What a prompt recording must be (the server sets its configured bounds).
    pub fn prompt_limits_mut(&mut self) -> &mut PromptLimits {
        &mut self.prompt.limits
    }

    /// The request's audio, mono float32 at [`Engine::sample_rate`]; stops within one LLM step once `cancel`
    /// is set.
    pub fn synthesize(&self, request: &Request, cancel: &AtomicBool) -> Result<Vec<f32>> {
        let (head, pieces) = self.text_plan(&request.mode, &request.text)?;
        let voice = self.prompt.features(&request.prompt)?;
        let (prompt_ids, llm_speech) = self.conditioning(&request.mode)?;
        let mut pcm = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let text: Vec<u32> = head.iter().copied().chain(self.tokenizer.encode(piece)?).collect();
            let speech = if llm_speech { voice.tokens.as_slice() } else { &[] };
            let lm_input = self.lm.lm_input(&text, &prompt_ids, speech)?;
            let (min_len, max_len) = CosyVoice3Lm::length_limits(text.len());
            let mut sampler = Cancellable {
                inner: SeededSampler::new(request.seed.wrapping_add(i as u64) % (1 << 63), self.lm.sampling.clone()),
                cancel,
                stop: self.lm.eos(),
            };
            let tokens = self.lm.generate(&lm_input, min_len, max_len, &mut sampler)?;
            pcm.extend(self.vocode(&tokens, &voice, request.speed, cancel)?);
        }
        Ok(pcm)
    }

    /// (head ids, normalised pieces): the text's system-prompt head (cross-lingual, or text that carries
    /// `<|endofprompt|>`) and the pieces spoken after it.
    fn text_plan(&self, mode: &Mode, text: &str) -> Result<(Vec<u32>, Vec<String>)> {
        let (head, body) = match mode {
            Mode::CrossLingual => {
                let full = prefixed(text);
                let (head, body) = full.split_once(END_OF_PROMPT).unwrap_or(("", &full));
                (format!("{head}{END_OF_PROMPT}"), body.to_owned())
            }
            _ => match text.rsplit_once(END_OF_PROMPT) {
                Some((before, body)) => (format!("{before}{END_OF_PROMPT}"), body.to_owned()),
                None => (String::new(), text.to_owned()),
            },
        };
        if !head.is_empty() && body.trim().is_empty() {
            return Err(Error::Input(format!(
                "text has nothing to speak after {END_OF_PROMPT}: the marker ends a prompt (a system prompt or an \
                 instruction); leave it out of the text to speak"
            )));
        }
        let pieces = TextFrontend::new(&self.tokenizer).split(&body)?;
        if pieces.is_empty() {
            let shown: String = body.trim().chars().take(80).collect();
            return Err(Error::Input(format!("text {shown:?} has nothing to speak (only punctuation?)")));
        }
        let head = if head.is_empty() { Vec::new() } else { self.tokenizer.encode(&head)? };
        Ok((head, pieces))
    }

    /// (the LLM's prompt ids, whether it continues the voice's speech tokens) of a mode.
    fn conditioning(&self, mode: &Mode) -> Result<(Vec<u32>, bool)> {
        match mode {
            Mode::ZeroShot { transcript } => {
                let full = prefixed(transcript);
                let (head, plain) = full.split_once(END_OF_PROMPT).unwrap_or(("", &full));
                let mut ids = self.tokenizer.encode(&format!("{head}{END_OF_PROMPT}"))?;
                ids.extend(self.tokenizer.encode(plain)?);
                Ok((ids, true))
            }
            Mode::Instruct { instruction } => Ok((self.tokenizer.encode(&instruct_text(instruction)?)?, false)),
            Mode::CrossLingual => Ok((Vec::new(), false)),
        }
    }

    /// Speech tokens -> audio in the voice, whole: flow with full attention, the mel stretched by `speed`,
    /// the vocoder finalised; [`Error::Cancelled`] at the next flow step once `cancel` is set.
    pub fn vocode(&self, tokens: &[u32], voice: &FlowPrompt, speed: f32, cancel: &AtomicBool) -> Result<Vec<f32>> {
        let stopped = || if cancel.load(Ordering::Relaxed) { Err(Error::Cancelled) } else { Ok(()) };
        stopped()?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let mode = (false, true);
        let mel = self.flow.inference_until(tokens, &voice.tokens, &voice.feat, &voice.embedding, mode, cancel)?;
        stopped()?;
        let mel = if speed == 1.0 { mel } else { stretch(&mel, speed)? };
        let (speech, _) = self.hift.inference(&mel, true)?;
        Ok(speech.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// `F.interpolate(mel, size=int(T / speed), mode="linear")` (align_corners False) of a mel [1, C, T].
fn stretch(mel: &Tensor, speed: f32) -> Result<Tensor> {
    let (_, channels, frames) = mel.dims3()?;
    let size = (frames as f32 / speed) as usize;
    let scale = frames as f32 / size as f32;
    let rows = mel.squeeze(0)?.to_vec2::<f32>()?;
    let mut out = Vec::with_capacity(channels * size);
    for row in &rows {
        out.extend((0..size).map(|i| {
            let x = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
            let left = (x as usize).min(frames - 1);
            let right = (left + 1).min(frames - 1);
            let w = x - left as f32;
            row[left] * (1.0 - w) + row[right] * w
        }));
    }
    Ok(Tensor::from_vec(out, (1, channels, size), &Device::Cpu)?)
}

/// A sampler that answers the end-of-speech id once `cancel` is set, so generation ends at the next step.
struct Cancellable<'a> {
    inner: SeededSampler,
    cancel: &'a AtomicBool,
    stop: u32,
}

impl Sampler for Cancellable<'_> {
    fn sample(&mut self, scores: &[f32], decoded: &[u32]) -> u32 {
        if self.cancel.load(Ordering::Relaxed) {
            return self.stop;
        }
        self.inner.sample(scores, decoded)
    }
}
