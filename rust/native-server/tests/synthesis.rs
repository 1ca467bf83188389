//! The whole request in Rust on the golden tiny bundle: a prompt WAV and text in each mode to 24 kHz audio,
//! seeded runs repeatable, a cancelled request stopped, an unusable prompt refused in the Python words.

mod common;

use std::sync::atomic::AtomicBool;

use cosyvoice_native::audio::{decode_wav, Audio};
use cosyvoice_native::synthesis::{Engine, Mode, Request};
use cosyvoice_native::{Bundle, Error};

fn request(mode: Mode, prompt: Audio, seed: u64) -> Request {
    Request { text: "Hello there, my friend.".into(), mode, prompt, seed, speed: 1.0 }
}

#[test]
fn every_mode_speaks_and_a_seed_repeats() {
    let Some(dir) = common::golden_dir() else { return };
    let engine = Engine::load(&Bundle::open(&dir.join("tiny_bundle")).unwrap()).unwrap();
    let wav = std::fs::read(dir.join("prompt_24k.wav")).unwrap();
    let prompt = || decode_wav(&wav).unwrap();
    let go = AtomicBool::new(false);
    let modes = [
        Mode::ZeroShot { transcript: "Hello, this is a short prompt for testing.".into() },
        Mode::Instruct { instruction: "Speak slowly.".into() },
        Mode::CrossLingual,
    ];
    for mode in modes {
        let pcm = engine.synthesize(&request(mode.clone(), prompt(), 3), &go).unwrap();
        assert!(!pcm.is_empty() && pcm.len() % 480 == 0, "{mode:?}: {} samples", pcm.len());
        assert!(pcm.iter().all(|x| x.is_finite() && x.abs() <= 1.0), "{mode:?}: audio within [-1, 1]");
        let again = engine.synthesize(&request(mode.clone(), prompt(), 3), &go).unwrap();
        assert_eq!(pcm, again, "{mode:?}: the same seed gives the same audio");
    }
    let stop = AtomicBool::new(true);
    let mode = Mode::Instruct { instruction: "Speak.".into() };
    assert!(matches!(engine.synthesize(&request(mode.clone(), prompt(), 1), &stop), Err(Error::Cancelled)));
    let short = Audio { samples: vec![0.1; 8000], sample_rate: 16000 };
    let refused = engine.synthesize(&request(mode, short, 1), &go).unwrap_err().to_string();
    assert_eq!(refused, "the prompt audio is 0.50 s long; it must be at least 1 s of speech");
}
