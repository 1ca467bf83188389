//! Text normalisation and splitting against the official frontend (golden `text_frontend.json`): every case
//! whose text the FST normaliser leaves alone (no digits) gives the reference's normalised text and pieces.
//! Digits are the documented difference: the native engine does not port wetext, so they pass through.

mod common;

use cosyvoice_native::prompts::{instruct_text, prefixed};
use cosyvoice_native::text::TextFrontend;
use cosyvoice_native::tokenizer::END_OF_PROMPT;
use cosyvoice_native::Bundle;

#[test]
fn text_frontend_matches_reference_without_numbers() {
    let Some(dir) = common::golden_dir() else { return };
    let golden = common::json(&dir, "text_frontend.json");
    let tokenizer = Bundle::open(&dir.join("tiny_bundle")).unwrap().tokenizer().unwrap();
    let frontend = TextFrontend::new(&tokenizer);
    let (mut checked, mut with_digits) = (0, 0);
    for case in golden["cases"].as_array().unwrap() {
        let input = case["input"].as_str().unwrap();
        let skipped = case["lang_branch"].as_str().unwrap().starts_with("skipped");
        if input.chars().any(|c| c.is_ascii_digit()) && !skipped {
            let normalized = frontend.normalize(input);
            assert!(normalized.chars().any(|c| c.is_ascii_digit()), "digits kept: {input:?} -> {normalized:?}");
            with_digits += 1;
            continue;
        }
        assert_eq!(frontend.normalize(input), case["split_false"].as_str().unwrap(), "normalize {input:?}");
        let pieces: Vec<String> =
            case["split_true"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect();
        assert_eq!(frontend.split(input).unwrap(), pieces, "split {input:?}");
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} cases without digits");
    println!("parity text: {checked} cases equal (normalised and split); {with_digits} with digits kept as digits");
}

#[test]
fn prompt_text_reaches_the_llm_verbatim() {
    let Some(dir) = common::golden_dir() else { return };
    let tokenizer = Bundle::open(&dir.join("tiny_bundle")).unwrap().tokenizer().unwrap();
    let frontend = TextFrontend::new(&tokenizer);
    let end_of_prompt = tokenizer.token_to_id(END_OF_PROMPT).unwrap();
    for text in
        [prefixed("I have 3 cats."), prefixed("今天是2024年。"), instruct_text("Speak 2 times faster.").unwrap()]
    {
        assert_eq!(frontend.normalize(&text), text, "markup skips normalisation");
        assert_eq!(frontend.split(&text).unwrap(), vec![text.clone()], "and splitting");
        let ids = tokenizer.encode(&text).unwrap();
        assert_eq!(ids.iter().filter(|&&id| id == end_of_prompt).count(), 1, "{text}");
    }
}
