//! A model folder in the official layout: `cosyvoice3.yaml`, `llm.pt`, `flow.pt`, `hift.pt` and
//! `CosyVoice-BlankEN/`, read as it is (no conversion step).

use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::checkpoint::Checkpoint;
use crate::config::{ModelConfig, QwenConfig};
use crate::error::Result;
use crate::flow::Flow;
use crate::hift::Hift;
use crate::llm::CosyVoice3Lm;
use crate::rng::SineGenNoise;
use crate::tokenizer::CosyVoice3Tokenizer;

/// An opened model folder: its settings, and loaders for its networks.
pub struct Bundle {
    dir: PathBuf,
    pub qwen: QwenConfig,
    pub config: ModelConfig,
}

impl Bundle {
    /// Reads the folder's settings; the networks load on demand.
    pub fn open(dir: &Path) -> Result<Self> {
        let qwen = QwenConfig::read(&dir.join("CosyVoice-BlankEN").join("config.json"))?;
        let config = ModelConfig::read(&dir.join("cosyvoice3.yaml"), &qwen)?;
        Ok(Self { dir: dir.to_owned(), qwen, config })
    }

    /// The folder itself.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The speech-token LM from `llm.pt`.
    pub fn llm(&self) -> Result<CosyVoice3Lm> {
        let checkpoint = Checkpoint::load(&self.dir.join("llm.pt"), None)?;
        CosyVoice3Lm::load(&checkpoint, &self.qwen, &self.config.llm)
    }

    /// The flow from `flow.pt`, starting every utterance from `noise` [1, mel, L] (see [`Flow::load`]).
    pub fn flow(&self, noise: Tensor) -> Result<Flow> {
        let checkpoint = Checkpoint::load(&self.dir.join("flow.pt"), None)?;
        Flow::load(&checkpoint, &self.config.flow, noise)
    }

    /// The vocoder from `hift.pt` (every `generator.` removed from its keys, as the official loader does), with
    /// SineGen2's fixed buffers replayed for this bundle's dims.
    pub fn hift(&self) -> Result<Hift> {
        let checkpoint = Checkpoint::load(&self.dir.join("hift.pt"), Some("generator."))?;
        Hift::load(&checkpoint, &self.config.hift, SineGenNoise::for_model(&self.config)?)
    }

    /// The text tokenizer of `CosyVoice-BlankEN/`.
    pub fn tokenizer(&self) -> Result<CosyVoice3Tokenizer> {
        CosyVoice3Tokenizer::load(&self.dir.join("CosyVoice-BlankEN"))
    }
}
