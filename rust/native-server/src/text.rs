//! Text before tokenization: the CosyVoice-side normalisation and sentence splitting of
//! `cosyvoice/frontend/text.py` (the official `text_normalize` with the wetext path).
//!
//! What runs here: prompt markup (`<|...|>`) passes untouched and unsplit; the Chinese branch (a CJK
//! ideograph in the text) drops newlines and blanks between non-ASCII characters, spells `²`/`³`, maps
//! `.` -> `。`, ` - ` -> `，`, drops brackets, `——` -> ` `, a trailing comma -> `。`; sentences are cut after
//! sentence punctuation and packed into pieces of 60-80 units (characters for Chinese, tokens for English);
//! pieces made only of punctuation are dropped.
//!
//! Where it differs from the Python frontend: wetext's FST normaliser (numbers, dates, money, units -> words)
//! and the English number spelling are not ported, so digits pass through as digits (wetext itself only
//! acts on text with a digit: text without digits gets exactly the Python frontend's result).

use unicode_categories::UnicodeCategories;

use crate::error::Result;
use crate::tokenizer::CosyVoice3Tokenizer;

const TOKEN_MAX_N: usize = 80;
const TOKEN_MIN_N: usize = 60;
const MERGE_LEN: usize = 20;
const ZH_ENDERS: &str = "。？！；：、.?!;";
const EN_ENDERS: &str = ".?!;:";
const CLOSING_QUOTES: &str = "\"”";

/// Which path a text takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Branch {
    Zh,
    En,
    /// prompt markup: passed on untouched
    Skipped,
}

pub fn language_branch(text: &str) -> Branch {
    if text.contains("<|") && text.contains("|>") {
        Branch::Skipped
    } else if text.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)) {
        Branch::Zh
    } else {
        Branch::En
    }
}

/// True for text made only of Unicode punctuation (P*) and symbols (S*), including "".
pub fn is_only_punctuation(text: &str) -> bool {
    text.chars().all(|c| c.is_punctuation() || c.is_symbol())
}

/// Normalisation and splitting with the bundle's tokenizer (English pieces are measured in tokens).
pub struct TextFrontend<'a> {
    tokenizer: &'a CosyVoice3Tokenizer,
}

impl<'a> TextFrontend<'a> {
    pub fn new(tokenizer: &'a CosyVoice3Tokenizer) -> Self {
        Self { tokenizer }
    }

    /// The whole text normalised, not split (prompt and instruct text); markup passes untouched.
    pub fn normalize(&self, text: &str) -> String {
        match language_branch(text) {
            Branch::Skipped => text.to_owned(),
            Branch::Zh => clean_chinese(text.trim()),
            Branch::En => text.trim().to_owned(),
        }
    }

    /// Normalised pieces to synthesise one by one; `[]` when nothing is left to speak.
    pub fn split(&self, text: &str) -> Result<Vec<String>> {
        let branch = language_branch(text);
        if branch == Branch::Skipped {
            return Ok(if text.trim().is_empty() { vec![] } else { vec![text.to_owned()] });
        }
        let normalized = self.normalize(text);
        let pieces = if branch == Branch::Zh {
            split_paragraph(&normalized, ZH_ENDERS, '。', |s| Ok(s.chars().count()))?
        } else {
            split_paragraph(&normalized, EN_ENDERS, '.', |s| Ok(self.tokenizer.encode(s)?.len()))?
        };
        Ok(pieces.into_iter().filter(|p| !is_only_punctuation(p)).collect())
    }
}

/// The Chinese branch's cleanup (after wetext, which leaves text without digits as it is).
fn clean_chinese(text: &str) -> String {
    let text = text.replace('\n', "");
    // a blank survives only between two ASCII non-blank characters ("two bananas")
    let chars: Vec<char> = text.chars().collect();
    let ascii = |c: Option<&char>| c.is_some_and(|c| c.is_ascii() && *c != ' ');
    let kept: String = chars
        .iter()
        .enumerate()
        .filter(|&(i, c)| *c != ' ' || (i > 0 && ascii(chars.get(i - 1)) && ascii(chars.get(i + 1))))
        .map(|(_, c)| c)
        .collect();
    let mut text = kept
        .replace('²', "平方")
        .replace('³', "立方")
        .replace('.', "。")
        .replace(" - ", "，")
        .replace(['（', '）', '【', '】', '`'], "")
        .replace("——", " ");
    let trimmed = text.trim_end_matches(['，', ',', '、']).len();
    if trimmed < text.len() {
        text.truncate(trimmed);
        text.push('。');
    }
    text
}

/// Cuts `text` after each of `enders` and packs the sentences greedily: a piece closes before a sentence that
/// would push it past 80 units once it holds more than 60; a last piece under 20 joins the one before.
fn split_paragraph(
    text: &str,
    enders: &str,
    full_stop: char,
    length: impl Fn(&str) -> Result<usize>,
) -> Result<Vec<String>> {
    if text.is_empty() {
        return Ok(vec![]);
    }
    let mut chars: Vec<char> = text.chars().collect();
    if !enders.contains(chars[chars.len() - 1]) {
        chars.push(full_stop);
    }
    let mut sentences: Vec<String> = Vec::new();
    let mut start = 0;
    for i in 0..chars.len() {
        if !enders.contains(chars[i]) {
            continue;
        }
        if i > start {
            sentences.push(chars[start..=i].iter().collect());
        }
        // a mark right after another one is dropped (official quirk: "Wait..." -> "Wait.")
        start = i + 1;
        // a closing quote joins the sentence before it
        if start < chars.len() && CLOSING_QUOTES.contains(chars[start]) {
            if let Some(last) = sentences.last_mut() {
                last.push(chars[start]);
                start += 1;
            }
        }
    }
    let mut pieces: Vec<String> = Vec::new();
    let mut current = String::new();
    for sentence in sentences {
        if length(&format!("{current}{sentence}"))? > TOKEN_MAX_N && length(&current)? > TOKEN_MIN_N {
            pieces.push(std::mem::take(&mut current));
        }
        current.push_str(&sentence);
    }
    if !current.is_empty() {
        match pieces.last_mut() {
            Some(last) if length(&current)? < MERGE_LEN => last.push_str(&current),
            _ => pieces.push(current),
        }
    }
    Ok(pieces)
}
