//! Layers the three networks share, built from checkpoint tensors with their shapes checked.

use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// `prefix.weight` [out, in] (and `prefix.bias` [out]) as a linear layer.
pub(crate) fn linear(ckpt: &Checkpoint, prefix: &str, shape: [usize; 2], bias: bool) -> Result<Linear> {
    let weight = ckpt.get_shaped(&format!("{prefix}.weight"), &shape)?;
    let bias = if bias { Some(ckpt.get_shaped(&format!("{prefix}.bias"), &shape[..1])?) } else { None };
    Ok(Linear::new(weight, bias))
}

/// An unpadded 1-d convolution (`torch.nn.Conv1d` with padding 0): callers pad as the reference does.
pub(crate) struct Conv1d {
    weight: Tensor,
    bias: Option<Tensor>,
    groups: usize,
    stride: usize,
    dilation: usize,
}

impl Conv1d {
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias, groups: 1, stride: 1, dilation: 1 }
    }

    /// `prefix.weight` [out, in / groups, kernel] and `prefix.bias` [out].
    pub(crate) fn load(ckpt: &Checkpoint, prefix: &str, shape: [usize; 3], groups: usize) -> Result<Self> {
        let weight = ckpt.get_shaped(&format!("{prefix}.weight"), &shape)?;
        let bias = ckpt.get_shaped(&format!("{prefix}.bias"), &shape[..1])?;
        Ok(Self { groups, ..Self::new(weight, Some(bias)) })
    }

    /// A weight-normed convolution (see [`Checkpoint::weight_norm`]) with its bias, in `dtype`.
    pub(crate) fn weight_normed(ckpt: &Checkpoint, prefix: &str, shape: [usize; 3], dtype: DType) -> Result<Self> {
        let weight = ckpt.weight_norm(prefix, dtype)?;
        if weight.dims() != shape {
            return Err(Error::TensorShape {
                path: ckpt.path().to_owned(),
                key: format!("{prefix} (weight norm)"),
                found: weight.dims().to_vec(),
                expected: shape.to_vec(),
            });
        }
        let bias = ckpt.get_shaped(&format!("{prefix}.bias"), &shape[..1])?.to_dtype(dtype)?;
        Ok(Self::new(weight, Some(bias)))
    }

    pub(crate) fn with_stride(self, stride: usize) -> Self {
        Self { stride, ..self }
    }

    pub(crate) fn with_dilation(self, dilation: usize) -> Self {
        Self { dilation, ..self }
    }

    /// `(kernel - 1) * dilation`: the input frames each output reads beyond its own.
    pub(crate) fn context(&self) -> usize {
        (self.weight.dim(2).unwrap_or(1) - 1) * self.dilation
    }

    /// [B, in, L] -> [B, out, (L - context - 1) / stride + 1].
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.conv1d(&self.weight, 0, self.stride, self.dilation, self.groups)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1))?)?,
            None => y,
        })
    }
}

/// `x` [.., L] with `left` and `right` zero frames added on the last axis.
pub(crate) fn pad_zeros(x: &Tensor, left: usize, right: usize) -> Result<Tensor> {
    Ok(x.pad_with_zeros(candle_core::D::Minus1, left, right)?)
}

/// Layer norm over the last axis without affine parameters (`F.layer_norm(x, (C,), eps=eps)`).
pub(crate) fn layer_norm(x: &Tensor, eps: f32) -> Result<Tensor> {
    let width = x.dim(candle_core::D::Minus1)?;
    let ones = Tensor::ones(width, x.dtype(), &Device::Cpu)?;
    let zeros = Tensor::zeros(width, x.dtype(), &Device::Cpu)?;
    Ok(candle_nn::ops::layer_norm(x, &ones, &zeros, eps)?)
}

/// Mish: x * tanh(softplus(x)), softplus linear above 20 as torch's.
pub(crate) fn mish(x: &Tensor) -> Result<Tensor> {
    let softplus = (x.exp()? + 1.0)?.log()?;
    let softplus = x.gt(20.0)?.where_cond(x, &softplus)?;
    Ok((x * softplus.tanh()?)?)
}

/// `x` [B, C, T] with every frame repeated `rate` times (nearest-neighbour upsampling).
pub(crate) fn repeat_frames(x: &Tensor, rate: usize) -> Result<Tensor> {
    let (b, c, t) = x.dims3()?;
    Ok(x.unsqueeze(3)?.broadcast_as((b, c, t, rate))?.reshape((b, c, t * rate))?)
}
