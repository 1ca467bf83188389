#![allow(dead_code)] // each test binary uses its own part of these helpers

//! What the parity tests share: the golden fixtures of the official reference (`../shared/golden` beside the
//! repository, or `COSYVOICE_GOLDEN_DIR`) and error measures.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

/// The golden folder, or None (after saying why the test is skipped) where it is absent.
pub fn golden_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("COSYVOICE_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden"));
    if dir.join("manifest.json").is_file() {
        return Some(dir);
    }
    eprintln!("SKIPPED: golden fixtures not found at {} (set COSYVOICE_GOLDEN_DIR)", dir.display());
    None
}

/// Every array of one golden safetensors file.
pub fn load(dir: &std::path::Path, file: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap()
}

/// A golden JSON file, parsed.
pub fn json(dir: &std::path::Path, file: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap()
}

/// A scalar of the manifest (`manifest[file].scalars[name].value`).
pub fn scalar(dir: &std::path::Path, file: &str, name: &str) -> serde_json::Value {
    json(dir, "manifest.json")[file]["scalars"][name]["value"].clone()
}

/// An integer array as token ids.
pub fn ids(tensor: &Tensor) -> Vec<u32> {
    tensor
        .flatten_all()
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|v| u32::try_from(v).unwrap())
        .collect()
}

/// Max |a - b| over two tensors of one shape (compared in float64).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}
