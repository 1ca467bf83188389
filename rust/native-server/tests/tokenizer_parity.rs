//! The tokenizer against the official one (golden `text_frontend.json`): every registered special token's id,
//! and the ids of each case's raw input, its normalised text and its sentence pieces.

mod common;

use cosyvoice_native::Bundle;

#[test]
fn tokenizer_matches_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let golden = common::json(&dir, "text_frontend.json");
    let tokenizer = Bundle::open(&dir.join("tiny_bundle")).unwrap().tokenizer().unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
    };

    let specials = golden["special_token_ids"].as_object().unwrap();
    for (token, id) in specials {
        assert_eq!(tokenizer.token_to_id(token), Some(ids(id)[0]), "special token {token}");
    }
    let cases = golden["cases"].as_array().unwrap();
    let mut checked = 0;
    for case in cases {
        let input = case["input"].as_str().unwrap();
        assert_eq!(tokenizer.encode(input).unwrap(), ids(&case["raw_token_ids"]), "raw {input:?}");
        let normalised = case["split_false"].as_str().unwrap();
        assert_eq!(tokenizer.encode(normalised).unwrap(), ids(&case["split_false_token_ids"]), "{normalised:?}");
        let pieces = case["split_true"].as_array().unwrap();
        for (piece, expected) in pieces.iter().zip(case["split_true_token_ids"].as_array().unwrap()) {
            assert_eq!(tokenizer.encode(piece.as_str().unwrap()).unwrap(), ids(expected), "piece {piece}");
        }
        checked += 2 + pieces.len();
    }
    println!("parity tokenizer: {} special ids and {checked} texts of {} cases equal", specials.len(), cases.len());
}
