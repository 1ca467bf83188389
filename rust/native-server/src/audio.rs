//! Prompt audio from WAV files: RIFF/WAVE with integer PCM (8, 16, 24 or 32 bit) or IEEE float (32 or 64 bit),
//! plain or `WAVE_FORMAT_EXTENSIBLE`, scaled as libsndfile scales it (int / 2^(bits-1), unsigned 8-bit
//! centred) and averaged over channels, as `cosyvoice/frontend/audio.py` decodes prompts. Other containers
//! (MP3, Ogg, FLAC...) are not read yet.

use crate::error::{Error, Result};

/// Mono float32 samples and their sample rate.
pub struct Audio {
    pub samples: Vec<f32>,
    pub sample_rate: usize,
}

#[derive(Clone, Copy)]
enum Encoding {
    Int,
    Float,
}

fn bad(why: &str) -> Error {
    Error::Input(format!("not a WAV file we can read: {why}"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16> {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).ok_or_else(|| bad("cut short"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(|| bad("cut short"))
}

/// Decodes a whole WAV file to mono.
pub fn decode_wav(bytes: &[u8]) -> Result<Audio> {
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return Err(bad("no RIFF/WAVE header"));
    }
    let (mut format, mut data) = (None, None);
    let mut at = 12;
    while at + 8 <= bytes.len() && (format.is_none() || data.is_none()) {
        let size = u32_at(bytes, at + 4)? as usize;
        let body = at + 8;
        match &bytes[at..at + 4] {
            b"fmt " => format = Some(body),
            // a data chunk may claim more than the file holds (streamed writers): read what is there
            b"data" => data = Some(&bytes[body.min(bytes.len())..(body + size).min(bytes.len())]),
            _ => {}
        }
        at = body + size + size % 2; // chunks are word-aligned
    }
    let (fmt, data) = (format.ok_or_else(|| bad("no fmt chunk"))?, data.ok_or_else(|| bad("no data chunk"))?);
    let mut tag = u16_at(bytes, fmt)?;
    let channels = u16_at(bytes, fmt + 2)? as usize;
    let sample_rate = u32_at(bytes, fmt + 4)? as usize;
    let bits = u16_at(bytes, fmt + 14)? as usize;
    if tag == 0xFFFE {
        tag = u16_at(bytes, fmt + 24)?; // the sub-format GUID starts with the format tag
    }
    let encoding = match (tag, bits) {
        (1, 8 | 16 | 24 | 32) => Encoding::Int,
        (3, 32 | 64) => Encoding::Float,
        _ => return Err(bad(&format!("format {tag} with {bits}-bit samples is not PCM or float"))),
    };
    if channels == 0 || sample_rate == 0 {
        return Err(bad("no channels or no sample rate"));
    }
    let width = bits / 8;
    let frames = data.len() / (width * channels);
    let mut samples = Vec::with_capacity(frames);
    for frame in data.chunks_exact(width * channels).take(frames) {
        let sum: f32 = frame.chunks_exact(width).map(|s| sample(s, encoding)).sum();
        samples.push(if channels == 1 { sum } else { sum / channels as f32 });
    }
    Ok(Audio { samples, sample_rate })
}

/// One little-endian sample in [-1, 1) (floats as stored).
fn sample(s: &[u8], encoding: Encoding) -> f32 {
    match (encoding, s.len()) {
        (Encoding::Int, 1) => (s[0] as f32 - 128.0) / 128.0,
        (Encoding::Int, 2) => i16::from_le_bytes([s[0], s[1]]) as f32 / 32768.0,
        (Encoding::Int, 3) => (i32::from_le_bytes([0, s[0], s[1], s[2]]) >> 8) as f32 / 8_388_608.0,
        (Encoding::Int, _) => (i32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64 / 2_147_483_648.0) as f32,
        (Encoding::Float, 4) => f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        (Encoding::Float, _) => f64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WAV file of `data` with the given format tag, channels and bits (extensible when `tag` is 0xFFFE,
    /// with `sub` as its sub-format).
    fn wav(tag: u16, sub: u16, channels: u16, bits: u16, data: &[u8]) -> Vec<u8> {
        let mut fmt = Vec::new();
        fmt.extend(tag.to_le_bytes());
        fmt.extend(channels.to_le_bytes());
        fmt.extend(22050u32.to_le_bytes());
        fmt.extend((22050 * channels as u32 * bits as u32 / 8).to_le_bytes());
        fmt.extend((channels * bits / 8).to_le_bytes());
        fmt.extend(bits.to_le_bytes());
        if tag == 0xFFFE {
            fmt.extend(22u16.to_le_bytes());
            fmt.extend(bits.to_le_bytes());
            fmt.extend(0u32.to_le_bytes());
            fmt.extend(sub.to_le_bytes());
            fmt.extend([0u8; 14]);
        }
        let mut out = b"RIFF\0\0\0\0WAVE".to_vec();
        out.extend(b"LIST");
        out.extend(3u32.to_le_bytes());
        out.extend([1, 2, 3, 0]); // an odd-sized chunk before fmt, padded to a word
        out.extend(b"fmt ");
        out.extend((fmt.len() as u32).to_le_bytes());
        out.extend(fmt);
        out.extend(b"data");
        out.extend((data.len() as u32).to_le_bytes());
        out.extend(data);
        out
    }

    #[test]
    fn integer_and_float_samples_scale_as_libsndfile() {
        let stereo24 = [0x00, 0x00, 0x40, 0x00, 0x00, 0xC0]; // +0.5 and -0.5: their mean is 0
        assert_eq!(decode_wav(&wav(1, 0, 2, 24, &stereo24)).unwrap().samples, vec![0.0]);
        let mono24 = [0x00, 0x00, 0x40, 0xFF, 0xFF, 0xFF];
        assert_eq!(decode_wav(&wav(1, 0, 1, 24, &mono24)).unwrap().samples, vec![0.5, -1.0 / 8_388_608.0]);
        assert_eq!(decode_wav(&wav(1, 0, 1, 8, &[0, 128, 192])).unwrap().samples, vec![-1.0, 0.0, 0.5]);
        let float = [0.25f32.to_le_bytes(), (-0.75f32).to_le_bytes()].concat();
        let audio = decode_wav(&wav(0xFFFE, 3, 2, 32, &float)).unwrap();
        assert_eq!((audio.samples, audio.sample_rate), (vec![-0.25], 22050));
    }

    #[test]
    fn other_files_are_refused_naming_why() {
        let refused = |bytes: &[u8]| decode_wav(bytes).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused(b"ID3 not a wav").contains("no RIFF/WAVE header"));
        assert!(refused(&wav(2, 0, 1, 4, &[0, 0])).contains("format 2 with 4-bit samples"));
        assert!(refused(&wav(1, 0, 1, 16, &[])[..36]).contains("no data chunk"));
    }
}
