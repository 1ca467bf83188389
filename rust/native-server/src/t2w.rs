//! Token to wave: speech tokens through the flow and the vocoder, whole or in the streaming chunks the
//! reference emits (`CosyVoice3Model.tts(stream=True)`), with its chunk schedule owned by one utterance.
//!
//! Each streaming chunk runs the flow over every token so far plus the look-ahead (chunk-causal attention),
//! keeps the mel frames after the previous chunk, and vocodes the whole mel so far, emitting the samples after
//! those already emitted; the last chunk runs the flow with full attention and finalises the vocoder. This
//! recomputes earlier frames as the reference does (our Python engine caches them; not yet ported).

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::flow::Flow;
use crate::hift::Hift;

/// CosyVoice3's streaming boundaries for one utterance: the first hop padded so that prompt tokens + first
/// hop fill whole flow chunks, then the hop doubling up to `max_hop` (the reference's schedule, restarted
/// for every request instead of kept on the model).
#[derive(Debug, Clone)]
pub struct ChunkPolicy {
    hop: usize,
    max_hop: usize,
    lookahead: usize,
    offset: usize,
    first_end: usize,
}

impl ChunkPolicy {
    const HOP: usize = 25; // fixed in the reference whatever the yaml's chunk_size says
    const MAX_HOP: usize = 100;

    pub fn new(prompt_len: usize, lookahead: usize) -> Self {
        let first_end = Self::HOP + (Self::HOP - prompt_len % Self::HOP) % Self::HOP;
        Self { hop: Self::HOP, max_hop: Self::MAX_HOP, lookahead, offset: 0, first_end }
    }

    fn current_hop(&self) -> usize {
        if self.offset < self.first_end {
            self.first_end - self.offset
        } else {
            self.hop
        }
    }

    /// Whether `n_tokens` known tokens complete the next chunk (its hop plus the look-ahead).
    pub fn ready(&self, n_tokens: usize) -> bool {
        n_tokens >= self.offset + self.current_hop() + self.lookahead
    }

    /// Consumes one hop; returns the token range (start, end) it finalised.
    pub fn advance(&mut self) -> (usize, usize) {
        let (start, end) = (self.offset, self.offset + self.current_hop());
        self.offset = end;
        if end >= self.first_end {
            self.hop = (self.hop * 2).min(self.max_hop);
        }
        (start, end)
    }

    /// Tokens finalised so far.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

/// The voice an utterance is spoken in: prompt speech tokens, their mel [1, 2P, 80], the speaker embedding.
pub struct FlowPrompt {
    pub tokens: Vec<u32>,
    pub feat: Tensor,
    pub embedding: Tensor,
}

/// One emitted piece of audio.
pub struct AudioChunk {
    /// float32 samples in [-audio_limit, audio_limit], [1, n]
    pub pcm: Tensor,
    /// the mel frames this chunk added, [1, 80, frames]
    pub mel: Tensor,
    /// the token range it finalised
    pub tokens: (usize, usize),
}

/// One utterance's token-to-wave state: the mel so far and the samples already emitted.
pub struct Token2Wav<'a> {
    flow: &'a Flow,
    hift: &'a Hift,
    prompt: &'a FlowPrompt,
    policy: ChunkPolicy,
    mel: Option<Tensor>,
    emitted: usize,
}

impl<'a> Token2Wav<'a> {
    pub fn new(flow: &'a Flow, hift: &'a Hift, prompt: &'a FlowPrompt) -> Self {
        let policy = ChunkPolicy::new(prompt.tokens.len(), flow.lookahead());
        Self { flow, hift, prompt, policy, mel: None, emitted: 0 }
    }

    /// The next streaming chunk if `tokens` (all known so far) complete one.
    pub fn next_chunk(&mut self, tokens: &[u32]) -> Result<Option<AudioChunk>> {
        if !self.policy.ready(tokens.len()) {
            return Ok(None);
        }
        let (start, end) = self.policy.advance();
        let known = &tokens[..end + self.flow.lookahead()];
        self.vocode(known, start, end, false).map(Some)
    }

    /// The last chunk: every remaining token, full attention, the vocoder finalised.
    pub fn finish(mut self, tokens: &[u32]) -> Result<AudioChunk> {
        let start = self.policy.offset();
        if tokens.len() < start {
            return Err(Error::Input(format!("{} tokens, but {start} were already finalised", tokens.len())));
        }
        self.vocode(tokens, start, tokens.len(), true)
    }

    fn vocode(&mut self, tokens: &[u32], start: usize, end: usize, last: bool) -> Result<AudioChunk> {
        let p = self.prompt;
        // streaming calls use the chunk-causal mask; the last one full attention, as the reference
        let mel = self.flow.inference(tokens, &p.tokens, &p.feat, &p.embedding, !last, last)?;
        let first = start * self.flow.token_mel_ratio();
        let new = mel.narrow(2, first, mel.dim(2)? - first)?;
        let all = match &self.mel {
            Some(before) => Tensor::cat(&[before, &new], 2)?,
            None => new.clone(),
        };
        let (speech, _) = self.hift.inference(&all, last)?;
        let n = speech.dim(1)?;
        let pcm = speech.narrow(1, self.emitted, n - self.emitted)?;
        self.emitted = n;
        self.mel = Some(all);
        Ok(AudioChunk { pcm, mel: new, tokens: (start, end) })
    }
}

/// Every chunk of `tokens` (known in advance) as the reference streams them.
pub fn stream_all(flow: &Flow, hift: &Hift, prompt: &FlowPrompt, tokens: &[u32]) -> Result<Vec<AudioChunk>> {
    let mut t2w = Token2Wav::new(flow, hift, prompt);
    let mut chunks = Vec::new();
    while let Some(chunk) = t2w.next_chunk(tokens)? {
        chunks.push(chunk);
    }
    chunks.push(t2w.finish(tokens)?);
    Ok(chunks)
}
