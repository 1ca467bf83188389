//! The vocoder's short STFT and its inverse (`torch.stft` / `torch.istft` with a periodic Hann window,
//! `center=True`, reflect padding, onesided), as plain DFT sums: the transform is 16 points long.

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::features::reflect_pad;

/// One STFT size: its window and DFT tables.
pub struct Stft {
    n_fft: usize,
    hop: usize,
    window: Vec<f32>,
}

impl Stft {
    pub fn new(n_fft: usize, hop: usize) -> Self {
        // periodic Hann computed in float64 then rounded, as the reference's window
        let window = (0..n_fft)
            .map(|n| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / n_fft as f64).cos()) as f32)
            .collect();
        Self { n_fft, hop, window }
    }

    fn bins(&self) -> usize {
        self.n_fft / 2 + 1
    }

    /// cos and sin of 2 pi k n / n_fft, in float64.
    fn angle(&self, k: usize, n: usize) -> (f64, f64) {
        let a = 2.0 * std::f64::consts::PI * ((k * n) % self.n_fft) as f64 / self.n_fft as f64;
        (a.cos(), a.sin())
    }

    /// Real and imaginary parts [1, bins, samples / hop + 1] of `signal`, reflect-padded by n_fft / 2.
    pub fn forward(&self, signal: &[f32]) -> Result<(Tensor, Tensor)> {
        let len = signal.len();
        let padded = reflect_pad(signal, self.n_fft / 2, self.n_fft / 2);
        let frames = len / self.hop + 1;
        let bins = self.bins();
        let (mut re, mut im) = (vec![0f32; bins * frames], vec![0f32; bins * frames]);
        for f in 0..frames {
            let frame = &padded[f * self.hop..f * self.hop + self.n_fft];
            for k in 0..bins {
                let (mut sr, mut si) = (0f64, 0f64);
                for (n, (&x, &w)) in frame.iter().zip(&self.window).enumerate() {
                    let (c, s) = self.angle(k, n);
                    let v = (x * w) as f64;
                    sr += v * c;
                    si -= v * s;
                }
                re[k * frames + f] = sr as f32;
                im[k * frames + f] = si as f32;
            }
        }
        let tensor = |v: Vec<f32>| Tensor::from_vec(v, (1, bins, frames), &Device::Cpu);
        Ok((tensor(re)?, tensor(im)?))
    }

    /// The signal [1, hop * (frames - 1)] of a onesided spectrum [1, bins, frames]: inverse DFT of each frame
    /// (the imaginary parts of the DC and Nyquist bins ignored), windowed, overlap-added, divided by the summed
    /// squared window, the centre padding cut.
    pub fn inverse(&self, re: &Tensor, im: &Tensor) -> Result<Tensor> {
        let (re, im) = (re.squeeze(0)?.to_vec2::<f32>()?, im.squeeze(0)?.to_vec2::<f32>()?);
        let (bins, frames) = (re.len(), re[0].len());
        let total = self.n_fft + self.hop * (frames - 1);
        let (mut out, mut envelope) = (vec![0f64; total], vec![0f64; total]);
        for f in 0..frames {
            for n in 0..self.n_fft {
                let mut x = 0f64;
                for k in 0..bins {
                    let (c, s) = self.angle(k, n);
                    let edge = k == 0 || 2 * k == self.n_fft;
                    let (r, i) = (re[k][f] as f64, if edge { 0.0 } else { im[k][f] as f64 });
                    x += if edge { 1.0 } else { 2.0 } * (r * c - i * s);
                }
                let w = self.window[n] as f64;
                out[f * self.hop + n] += x / self.n_fft as f64 * w;
                envelope[f * self.hop + n] += w * w;
            }
        }
        let start = self.n_fft / 2;
        let samples: Vec<f32> =
            (start..start + self.hop * (frames - 1)).map(|i| (out[i] / envelope[i]) as f32).collect();
        let n = samples.len();
        Ok(Tensor::from_vec(samples, (1, n), &Device::Cpu)?)
    }
}
