//! The official checkpoints (`llm.pt`, `flow.pt`, `hift.pt`): `torch.save`d state dicts, read with candle's
//! pickle reader, with the official loader's key rules applied.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// One state dict: tensor name -> float32 tensor on the CPU.
pub struct Checkpoint {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl Checkpoint {
    /// Reads every tensor of `path`; `remove` is a substring dropped from every key, as the official loader
    /// does with `'generator.'` for `hift.pt` (so HiFiGan training checkpoints load too).
    pub fn load(path: &Path, remove: Option<&str>) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::Io {
                path: path.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "checkpoint not found"),
            });
        }
        let mut tensors = HashMap::new();
        for (name, tensor) in candle_core::pickle::read_all(path)? {
            let name = match remove {
                Some(part) => name.replace(part, ""),
                None => name,
            };
            tensors.insert(name, tensor.to_dtype(DType::F32)?);
        }
        Ok(Self { path: path.to_owned(), tensors })
    }

    /// Whether the state dict holds `key`.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// The tensor `key`, or an error naming the file and the key.
    pub fn get(&self, key: &str) -> Result<Tensor> {
        self.tensors
            .get(key)
            .cloned()
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), key: key.to_owned() })
    }

    /// The tensor `key`, checked to have `shape`.
    pub fn get_shaped(&self, key: &str, shape: &[usize]) -> Result<Tensor> {
        let tensor = self.get(key)?;
        if tensor.dims() != shape {
            return Err(Error::TensorShape {
                path: self.path.clone(),
                key: key.to_owned(),
                found: tensor.dims().to_vec(),
                expected: shape.to_vec(),
            });
        }
        Ok(tensor)
    }

    /// The effective weight of a weight-normed layer, `g * v / ||v||` (the norm over every dim but the first),
    /// computed in `dtype`. Reads the parametrization keys (`parametrizations.weight.original0` = g, `original1`
    /// = v) or the legacy `weight_g` / `weight_v`, as torch's load hook accepts both.
    pub fn weight_norm(&self, prefix: &str, dtype: DType) -> Result<Tensor> {
        let current = format!("{prefix}.parametrizations.weight.original0");
        let (g, v) = if self.contains(&current) {
            (self.get(&current)?, self.get(&format!("{prefix}.parametrizations.weight.original1"))?)
        } else {
            (self.get(&format!("{prefix}.weight_g"))?, self.get(&format!("{prefix}.weight_v"))?)
        };
        let (g, v) = (g.to_dtype(dtype)?, v.to_dtype(dtype)?);
        let dims: Vec<usize> = (1..v.rank()).collect();
        let norm = v.sqr()?.sum_keepdim(dims)?.sqrt()?;
        Ok(v.broadcast_mul(&g.broadcast_div(&norm)?)?)
    }

    /// The file this state dict came from (for error messages).
    pub fn path(&self) -> &Path {
        &self.path
    }
}
