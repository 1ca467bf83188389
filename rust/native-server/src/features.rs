//! Prompt-audio features, as `cosyvoice/frontend/audio.py` and `features.py` compute them: torchaudio's
//! band-limited resampler, the flow's 24 kHz log-mel (Matcha), Whisper's log-mel (speech tokenizer input) and
//! Kaldi's fbank (speaker encoder input). Spectra are DFTs as matrix products (tables in float64).

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// Band-limited resampling equal to `torchaudio.transforms.Resample` defaults (Hann-windowed sinc, 6 zero
/// crossings, rolloff 0.99): output length ceil(N * new / orig), zero-padded at both ends.
pub fn resample(wav: &[f32], orig_sr: usize, new_sr: usize) -> Vec<f32> {
    if orig_sr == new_sr {
        return wav.to_vec();
    }
    let g = gcd(orig_sr, new_sr);
    let (orig, new) = (orig_sr / g, new_sr / g);
    let (zero_crossings, rolloff) = (6.0f64, 0.99f64);
    let cutoff = orig.min(new) as f64 * rolloff;
    let width = (zero_crossings * orig as f64 / cutoff).ceil() as usize;
    // one filter per output phase j: a sinc low-pass under a Hann window, over 2 * width + orig taps
    let kernels: Vec<Vec<f32>> = (0..new)
        .map(|j| {
            let phase = (-(j as f32) / new as f32) as f64; // formed in float32, as torchaudio
            (0..2 * width + orig)
                .map(|i| {
                    let tap = (i as f64 - width as f64) / orig as f64;
                    let t = ((phase + tap) * cutoff).clamp(-zero_crossings, zero_crossings);
                    let window = (t * std::f64::consts::PI / zero_crossings / 2.0).cos().powi(2);
                    let t = t * std::f64::consts::PI;
                    let sinc = if t == 0.0 { 1.0 } else { t.sin() / t };
                    (sinc * (window * (cutoff / orig as f64))) as f32
                })
                .collect()
        })
        .collect();
    let mut padded = vec![0f32; width];
    padded.extend_from_slice(wav);
    padded.extend(std::iter::repeat_n(0.0, width + orig));
    let blocks = (padded.len() - (2 * width + orig)) / orig + 1;
    let target = (new * wav.len()).div_ceil(orig);
    let mut out = Vec::with_capacity(blocks * new);
    for b in 0..blocks {
        let frame = &padded[b * orig..b * orig + 2 * width + orig];
        out.extend(kernels.iter().map(|k| k.iter().zip(frame).map(|(a, x)| a * x).sum::<f32>()));
    }
    out.truncate(target);
    out
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `signal` with `left` / `right` samples mirrored at its ends (numpy/torch "reflect": the edge not repeated).
pub fn reflect_pad(signal: &[f32], left: usize, right: usize) -> Vec<f32> {
    let n = signal.len() as isize;
    (-(left as isize)..n + right as isize)
        .map(|i| {
            let j = if i < 0 {
                -i
            } else if i >= n {
                2 * (n - 1) - i
            } else {
                i
            };
            signal[j as usize]
        })
        .collect()
}

/// Periodic (`periodic`) or symmetric Hann window, in float32 as `torch.hann_window`.
fn hann(length: usize, periodic: bool) -> Vec<f32> {
    let denominator = if periodic { length } else { length - 1 } as f32;
    (0..length).map(|n| 0.5 - 0.5 * (n as f32 * (2.0 * std::f32::consts::PI / denominator)).cos()).collect()
}

/// Real and imaginary DFT parts [T, n_fft / 2 + 1] (summed in float64: near-silent bins keep their digits) of
/// windowed frames of `signal` (`hop` apart, `window`
/// applied, zero-padded to `n_fft`).
fn spectrum(signal: &[f32], n_fft: usize, hop: usize, window: &[f32]) -> Result<(Tensor, Tensor)> {
    let frames = (signal.len() - window.len()) / hop + 1;
    let mut data = vec![0f64; frames * n_fft];
    for f in 0..frames {
        for (n, w) in window.iter().enumerate() {
            data[f * n_fft + n] = (signal[f * hop + n] * w) as f64;
        }
    }
    let bins = n_fft / 2 + 1;
    let table = |sine: bool| -> Result<Tensor> {
        let values: Vec<f64> = (0..n_fft)
            .flat_map(|n| {
                (0..bins).map(move |k| {
                    let a = 2.0 * std::f64::consts::PI * ((k * n) % n_fft) as f64 / n_fft as f64;
                    if sine {
                        -a.sin()
                    } else {
                        a.cos()
                    }
                })
            })
            .collect();
        Ok(Tensor::from_vec(values, (n_fft, bins), &Device::Cpu)?)
    };
    let frames = Tensor::from_vec(data, (frames, n_fft), &Device::Cpu)?;
    let part = |sine: bool| -> Result<Tensor> { Ok(frames.matmul(&table(sine)?)?.to_dtype(DType::F32)?) };
    Ok((part(false)?, part(true)?))
}

/// Triangular filters on the Slaney mel scale, area-normalised (librosa's default, which Matcha and Whisper
/// use), [n_mels, n_fft / 2 + 1].
pub fn slaney_filterbank(sample_rate: usize, n_fft: usize, n_mels: usize, fmin: f64, fmax: f64) -> Result<Tensor> {
    const STEP: f64 = 200.0 / 3.0;
    const LOG_START_HZ: f64 = 1000.0;
    let log_start_mel = LOG_START_HZ / STEP;
    let log_step = 6.4f64.ln() / 27.0;
    let to_mel =
        |hz: f64| if hz < LOG_START_HZ { hz / STEP } else { log_start_mel + (hz / LOG_START_HZ).ln() / log_step };
    let to_hz = |mel: f64| {
        if mel >= log_start_mel {
            LOG_START_HZ * (log_step * (mel - log_start_mel)).exp()
        } else {
            mel * STEP
        }
    };
    let (low, high) = (to_mel(fmin), to_mel(fmax));
    let edges: Vec<f64> = (0..n_mels + 2).map(|i| to_hz(low + (high - low) * i as f64 / (n_mels + 1) as f64)).collect();
    let bins = n_fft / 2 + 1;
    let mut basis = Vec::with_capacity(n_mels * bins);
    for m in 0..n_mels {
        let norm = 2.0 / (edges[m + 2] - edges[m]);
        for b in 0..bins {
            let hz = b as f64 * sample_rate as f64 / n_fft as f64;
            let rising = (hz - edges[m]) / (edges[m + 1] - edges[m]);
            let falling = (edges[m + 2] - hz) / (edges[m + 2] - edges[m + 1]);
            // librosa stores the triangle in float32 first, then scales it by the float64 norm
            let triangle = rising.min(falling).max(0.0) as f32;
            basis.push((triangle as f64 * norm) as f32);
        }
    }
    Ok(Tensor::from_vec(basis, (n_mels, bins), &Device::Cpu)?)
}

/// The flow's prompt mel (Matcha `mel_spectrogram`, center=False): natural log of the mel magnitude of
/// `wav` at `sample_rate`, [1, n_mels, T], T = N / hop.
pub fn prompt_mel(wav: &[f32], sample_rate: usize, n_fft: usize, hop: usize, n_mels: usize) -> Result<Tensor> {
    let pad = (n_fft - hop) / 2;
    let (re, im) = spectrum(&reflect_pad(wav, pad, pad), n_fft, hop, &hann(n_fft, true))?;
    let magnitude = ((re.sqr()? + im.sqr()?)? + 1e-9)?.sqrt()?;
    let basis = slaney_filterbank(sample_rate, n_fft, n_mels, 0.0, sample_rate as f64 / 2.0)?;
    Ok(basis.matmul(&magnitude.t()?)?.clamp(1e-5, f32::MAX)?.log()?.unsqueeze(0)?)
}

/// Whisper's normalised log10 power mel of 16 kHz audio, [1, n_mels, N / 160]: a centred STFT (n_fft 400) whose
/// last frame is dropped, clipped to 8 decades below its maximum, mapped as (x + 4) / 4.
pub fn whisper_log_mel(wav_16k: &[f32], n_mels: usize) -> Result<Tensor> {
    let (n_fft, hop) = (400, 160);
    let (re, im) = spectrum(&reflect_pad(wav_16k, n_fft / 2, n_fft / 2), n_fft, hop, &hann(n_fft, true))?;
    let frames = re.dim(0)? - 1;
    let power = (re.narrow(0, 0, frames)?.sqr()? + im.narrow(0, 0, frames)?.sqr()?)?;
    let basis = slaney_filterbank(16000, n_fft, n_mels, 0.0, 8000.0)?;
    let log_spec = (basis.matmul(&power.t()?)?.clamp(1e-10, f32::MAX)?.log()? / std::f64::consts::LN_10)?;
    let floor = log_spec.flatten_all()?.max(0)?.to_scalar::<f32>()? - 8.0;
    Ok(((log_spec.maximum(floor)? + 4.0)? / 4.0)?.unsqueeze(0)?)
}

/// Kaldi's (HTK) mel scale.
fn kaldi_mel(hz: f32) -> f32 {
    1127.0 * (1.0 + hz / 700.0).ln()
}

/// Log mel filterbank energies of 16 kHz audio in [-1, 1), [T, n_mels], as `torchaudio.compliance.kaldi.fbank`
/// with dither 0: 25 ms frames every 10 ms that fit entirely, DC removed, pre-emphasis 0.97, Povey window,
/// 512-point power spectrum, mel bins from 20 Hz to Nyquist, natural log floored at float32 epsilon.
pub fn kaldi_fbank(wav_16k: &[f32], n_mels: usize) -> Result<Tensor> {
    let (frame, shift, padded) = (400, 160, 512);
    if wav_16k.len() < frame {
        return Ok(Tensor::zeros((0, n_mels), candle_core::DType::F32, &Device::Cpu)?);
    }
    let count = (wav_16k.len() - frame) / shift + 1;
    let povey: Vec<f32> = hann(frame, false).iter().map(|w| w.powf(0.85)).collect();
    let mut prepared = Vec::with_capacity(count * frame);
    for f in 0..count {
        let x = &wav_16k[f * shift..f * shift + frame];
        let mean = x.iter().sum::<f32>() / frame as f32;
        let centred: Vec<f32> = x.iter().map(|v| v - mean).collect();
        prepared.extend((0..frame).map(|n| centred[n] - 0.97 * centred[n.saturating_sub(1)]));
    }
    // the prepared frames lie back to back, so a hop of one frame reads each whole
    let (re, im) = spectrum(&prepared, padded, frame, &povey)?;
    let power = (re.sqr()? + im.sqr()?)?;
    let (low, high) = (kaldi_mel(20.0), kaldi_mel(8000.0));
    let step = (high - low) / (n_mels + 1) as f32;
    let bins = padded / 2 + 1;
    let mut banks = vec![0f32; n_mels * bins];
    for m in 0..n_mels {
        let (left, centre, right) =
            (low + m as f32 * step, low + (m as f32 + 1.0) * step, low + (m as f32 + 2.0) * step);
        for b in 0..padded / 2 {
            let mel = kaldi_mel(16000.0 / padded as f32 * b as f32);
            let value = ((mel - left) / (centre - left)).min((right - mel) / (right - centre));
            banks[m * bins + b] = value.max(0.0);
        }
    }
    let banks = Tensor::from_vec(banks, (n_mels, bins), &Device::Cpu)?;
    Ok(power.matmul(&banks.t()?)?.clamp(f32::EPSILON, f32::MAX)?.log()?)
}

/// The prompt mel [1, T, mels] and its speech tokens trimmed to exactly `ratio` mel frames per token, as the
/// flow reads them: n = min(T / ratio, tokens) tokens and n * ratio frames.
pub fn align_prompt(mel: &Tensor, tokens: &[u32], ratio: usize) -> Result<(Tensor, Vec<u32>)> {
    let n = (mel.dim(1)? / ratio).min(tokens.len());
    Ok((mel.narrow(1, 0, n * ratio)?, tokens[..n].to_vec()))
}
