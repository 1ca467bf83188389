//! CosyVoice3 inference in Rust on candle (CPU), reading the official model folder as it is: no Python at
//! run time. Each stage is checked against the official reference's golden fixtures (tests/).

pub mod audio;
pub mod bundle;
pub mod checkpoint;
pub mod config;
pub mod dit;
pub mod error;
pub mod features;
pub mod flow;
pub mod hift;
pub mod llm;
mod nn;
pub mod onnx;
pub mod prompt;
pub mod prompts;
pub mod rng;
pub mod sampling;
pub mod source;
pub mod stft;
pub mod synthesis;
pub mod t2w;
pub mod text;
pub mod tokenizer;

pub use bundle::Bundle;
pub use error::{Error, Result};
