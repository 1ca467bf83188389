//! Layers the networks share, built from checkpoint tensors with their shapes checked.

use candle_nn::Linear;

use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// `prefix.weight` [out, in] (and `prefix.bias` [out]) as a linear layer.
pub(crate) fn linear(ckpt: &Checkpoint, prefix: &str, shape: [usize; 2], bias: bool) -> Result<Linear> {
    let weight = ckpt.get_shaped(&format!("{prefix}.weight"), &shape)?;
    let bias = if bias { Some(ckpt.get_shaped(&format!("{prefix}.bias"), &shape[..1])?) } else { None };
    Ok(Linear::new(weight, bias))
}
