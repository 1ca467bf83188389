//! The CosyVoice3 text tokenizer: the bundle's Qwen2 byte-level BPE (`CosyVoice-BlankEN/vocab.json` +
//! `merges.txt`) plus CosyVoice3's control tokens, built with the `tokenizers` crate exactly as
//! `cosyvoice/frontend/tokenizer.py` builds it with the Python binding of the same library (and as
//! transformers converts the official slow tokenizer):
//!
//! * model: byte-level BPE, no unknown token, no byte fallback; normaliser: Unicode NFC;
//! * pre-tokenizer: the Qwen2 split regex (isolated matches), then the byte-to-unicode mapping;
//! * added tokens: `tokenizer_config.json`'s `added_tokens_decoder` in id order, then CosyVoice3's specials
//!   in the official order (so `<|endofprompt|>` lands right after `<|im_end|>`: 151646 for Qwen2).
//!
//! Special tokens written in the text are matched before normalisation and never split (the official
//! `allowed_special='all'`).

use std::collections::HashMap;
use std::path::Path;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::config::{config_error, read_text};
use crate::error::{Error, Result};

pub const END_OF_PROMPT: &str = "<|endofprompt|>";

const QWEN2_SPLIT_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// Vocal events, emphasis tags and prompt separators, in the official registration order.
const CONTROL_TOKENS: [&str; 20] = [
    "<|im_start|>",
    "<|im_end|>",
    END_OF_PROMPT,
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
    "<|endofsystem|>",
];

// CMU (ARPAbet) phonemes, sorted; vowels also with stress 0/1/2.
const ARPABET_VOWELS: [&str; 15] =
    ["AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW"];
const ARPABET_CONSONANTS: [&str; 24] = [
    "B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH", "T", "TH", "V", "W",
    "Y", "Z", "ZH",
];

// Pinyin initials and toned finals for inline Chinese pronunciation, official order.
const PINYIN_UNITS: &str = "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo \
    iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u \
    uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng \
    uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó \
    óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ \
    ǒng ǒu ǔ ǔn ǘ ǚ ǜ";

/// Everything CosyVoice3 registers on top of the Qwen2 vocabulary; the order determines the new ids.
pub fn cosyvoice3_special_tokens() -> Vec<String> {
    let mut phones: Vec<&str> = ARPABET_VOWELS.iter().chain(&ARPABET_CONSONANTS).copied().collect();
    phones.sort_unstable();
    let arpabet = phones.into_iter().flat_map(|p| {
        let stresses: &[&str] = if ARPABET_VOWELS.contains(&p) { &["", "0", "1", "2"] } else { &[""] };
        stresses.iter().map(move |s| format!("[{p}{s}]"))
    });
    let pinyin = PINYIN_UNITS.split_whitespace().map(|u| format!("[{u}]"));
    CONTROL_TOKENS.iter().map(|t| t.to_string()).chain(arpabet).chain(pinyin).collect()
}

/// Text -> token ids for the CosyVoice3 LLM, identical to the official tokenizer.
pub struct CosyVoice3Tokenizer {
    inner: Tokenizer,
}

impl CosyVoice3Tokenizer {
    /// Builds the tokenizer of `dir` (`<model_dir>/CosyVoice-BlankEN`).
    pub fn load(dir: &Path) -> Result<Self> {
        let vocab: HashMap<String, u32> = serde_json::from_str(&read_text(&dir.join("vocab.json"))?)
            .map_err(|e| config_error(&dir.join("vocab.json"), e.to_string()))?;
        let merges = read_merges(&dir.join("merges.txt"))?;
        let vocab: Vocab = vocab.into_iter().collect();
        let bpe =
            BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| config_error(dir, e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        let split =
            Split::new(SplitPattern::Regex(QWEN2_SPLIT_PATTERN.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| config_error(dir, e.to_string()))?;
        inner.with_normalizer(Some(NFC));
        inner.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()])));
        add_configured_tokens(&mut inner, &dir.join("tokenizer_config.json"))?;
        let specials: Vec<AddedToken> =
            cosyvoice3_special_tokens().into_iter().map(|t| AddedToken::from(t, true).normalized(false)).collect();
        inner.add_special_tokens(&specials);
        Ok(Self { inner })
    }

    /// Token ids of `text` (no BOS/EOS); special tokens written in it become their single id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, false).map_err(|e| Error::Input(format!("tokenizer: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The id of one token (a special token's name, or a vocabulary entry).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// `added_tokens_decoder` of `tokenizer_config.json` (when present), in id order, each checked to land on its id.
fn add_configured_tokens(inner: &mut Tokenizer, path: &Path) -> Result<()> {
    if !path.is_file() {
        return Ok(());
    }
    let config: serde_json::Value =
        serde_json::from_str(&read_text(path)?).map_err(|e| config_error(path, e.to_string()))?;
    let Some(declared) = config.get("added_tokens_decoder").and_then(|d| d.as_object()) else { return Ok(()) };
    let mut entries = declared
        .iter()
        .map(|(id, spec)| Ok((id.parse::<u32>().map_err(|_| config_error(path, format!("id '{id}'")))?, spec)))
        .collect::<Result<Vec<_>>>()?;
    entries.sort_by_key(|(id, _)| *id);
    for (id, spec) in entries {
        let flag = |key: &str, default: bool| spec.get(key).and_then(|v| v.as_bool()).unwrap_or(default);
        let content = spec.get("content").and_then(|c| c.as_str());
        let content = content.ok_or_else(|| config_error(path, format!("added token {id} has no 'content'")))?;
        let special = flag("special", false);
        let token = AddedToken::from(content, special)
            .single_word(flag("single_word", false))
            .lstrip(flag("lstrip", false))
            .rstrip(flag("rstrip", false))
            .normalized(flag("normalized", !special));
        if special {
            inner.add_special_tokens(&[token]);
        } else {
            inner.add_tokens(&[token]);
        }
        if inner.token_to_id(content) != Some(id) {
            return Err(config_error(
                path,
                format!("added token {content:?} is declared as id {id} but lands elsewhere"),
            ));
        }
    }
    Ok(())
}

/// BPE merges in rank order: only a first line starting with `#version:` is a header, blank lines are skipped,
/// a repeated pair keeps its first position (as transformers reads them).
fn read_merges(path: &Path) -> Result<Vec<(String, String)>> {
    let text = read_text(path)?;
    let mut seen = std::collections::HashSet::new();
    let mut merges = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (number == 0 && line.starts_with("#version:")) {
            continue;
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [left, right] = parts[..] else {
            return Err(config_error(path, format!("line {}: expected two space-separated symbols", number + 1)));
        };
        let pair = (left.to_owned(), right.to_owned());
        if seen.insert(pair.clone()) {
            merges.push(pair);
        }
    }
    Ok(merges)
}
