//! The crate's one error type: every failure names the file, key or setting it is about.

use std::path::PathBuf;

/// What can go wrong reading a model folder or running a stage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: no tensor '{key}'")]
    MissingTensor { path: PathBuf, key: String },
    #[error("{path}: tensor '{key}' has shape {found:?}, expected {expected:?}")]
    TensorShape { path: PathBuf, key: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("{0}")]
    Input(String),
    /// ONNX Runtime missing or failing
    #[error("{0}")]
    Runtime(String),
    /// the caller cancelled the request
    #[error("the request was cancelled")]
    Cancelled,
}

pub type Result<T> = std::result::Result<T, Error>;
