//! Repetition-aware sampling (VALL-E 2) of speech tokens, as the official `ras_sampling` and our
//! `cosyvoice/llm/sampling.py`: the nucleus (top-p / top-k with the reference's float32 running sum), a draw
//! from it, and, when that draw already occurs `win_size * tau_r` times in the last `win_size` tokens, a draw
//! from the softmax over every other token instead.
//!
//! Randomness is counter-based and equal to the Python engine's: draw `c` of a session is an integer hash of
//! (seed, c), so the same seed gives the same tokens in both engines.

use crate::config::SamplingConfig;

const MASK32: u64 = 0xFFFF_FFFF;
const SEED_SALT: u64 = 0x3243_F6A8; // digits of pi: keeps seed 0 from hashing a zero word

/// A 32-bit integer finaliser (xor-shift / multiply, "lowbias32"): a bijection with full avalanche.
fn hash32(x: u64) -> u64 {
    let x = (x ^ (x >> 16)) as u32;
    let x = x.wrapping_mul(0x7FEB_352D);
    let x = x ^ (x >> 15);
    let x = x.wrapping_mul(0x846C_A68B);
    (x ^ (x >> 16)) as u64
}

/// A float64 in [0, 1), a pure function of (seed, counter): 53 bits from two chained 32-bit hashes.
pub fn uniform(seed: u64, counter: u64) -> f64 {
    let (lo, hi) = (seed & MASK32, (seed >> 32) & MASK32);
    let key = hash32(hash32(lo ^ SEED_SALT) ^ hi);
    let a = hash32(key ^ (counter & MASK32));
    let b = hash32(a ^ SEED_SALT);
    let bits = (a >> 5) * (1 << 26) + (b >> 6);
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

/// float32 softmax of log-probs (entries of -inf get probability 0).
fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// The nucleus the official sampler draws from: (token ids, their probabilities), by descending probability
/// (stable), kept while the float32 running sum of the kept ones is below `top_p` and fewer than `top_k`
/// are kept (the token that crosses `top_p` is included). Probabilities are not renormalised.
pub fn nucleus(scores: &[f32], top_p: f64, top_k: usize) -> (Vec<u32>, Vec<f32>) {
    let probs = softmax(scores);
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    order.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize])); // stable
    let (mut ids, mut kept) = (Vec::new(), Vec::new());
    let mut running = 0f32;
    for &id in order.iter().take(top_k) {
        if running >= top_p as f32 {
            break;
        }
        ids.push(id);
        kept.push(probs[id as usize]);
        running += probs[id as usize];
    }
    (ids, kept)
}

/// The first index whose float64 running sum of `weights` exceeds `u` times their total; never a zero weight.
fn inverse_cdf(weights: &[f32], u: f64) -> usize {
    let mut cumulative = Vec::with_capacity(weights.len());
    let mut sum = 0f64;
    for w in weights {
        sum += *w as f64;
        cumulative.push(sum);
    }
    let target = u * sum;
    let index = cumulative.iter().filter(|c| **c <= target).count();
    let last = weights.iter().rposition(|w| *w > 0.0).unwrap_or(0);
    index.min(last)
}

/// Picks the next speech token from the step's log-probs and the tokens decoded so far.
pub trait Sampler {
    fn sample(&mut self, scores: &[f32], history: &[u32]) -> u32;
}

/// One session's sampler: its seed and draw counter (two uniforms per token: nucleus, then fallback).
pub struct SeededSampler {
    seed: u64,
    counter: u64,
    cfg: SamplingConfig,
}

impl SeededSampler {
    pub fn new(seed: u64, cfg: SamplingConfig) -> Self {
        Self { seed, counter: 0, cfg }
    }
}

impl Sampler for SeededSampler {
    /// One token for log-probs `scores` (bans already applied) after the decoded `history`.
    fn sample(&mut self, scores: &[f32], history: &[u32]) -> u32 {
        let counter = self.counter;
        self.counter += 1;
        let (ids, probs) = nucleus(scores, self.cfg.top_p, self.cfg.top_k);
        let first = ids[inverse_cdf(&probs, uniform(self.seed, 2 * counter))];
        let tail = &history[history.len().saturating_sub(self.cfg.win_size)..];
        let repeats = tail.iter().filter(|&&t| t == first).count();
        if (repeats as f64) < self.cfg.win_size as f64 * self.cfg.tau_r {
            return first;
        }
        let mut banned = scores.to_vec();
        banned[first as usize] = f32::NEG_INFINITY;
        inverse_cdf(&softmax(&banned), uniform(self.seed, 2 * counter + 1)) as u32
    }
}
