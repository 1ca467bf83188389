//! CosyVoice3's prompt conventions, applied for the user as `cosyvoice/frontend/prompts.py` applies them.
//!
//! Fun-CosyVoice3 was trained with a system prompt in front of the text the LLM conditions on, closed by
//! `<|endofprompt|>`: zero-shot transcripts and cross-lingual text become
//! `You are a helpful assistant.<|endofprompt|>{text}`, an instruct2 instruction
//! `You are a helpful assistant. {instruction}<|endofprompt|>`. Input already in that form (with stray
//! whitespace, a bare marker, or none) comes out canonical, nothing is added twice, and a marker anywhere
//! else is removed.

use crate::error::{Error, Result};
use crate::tokenizer::END_OF_PROMPT;

pub const SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// The zero-shot prompt text (system prompt + the prompt audio's transcript), also the cross-lingual text:
/// `{system}<|endofprompt|>{body}`. A head before the marker that starts with the system prompt is kept
/// (canonically spaced); any other marker is stray and the text around it is the body.
pub fn prefixed(text: &str) -> String {
    let (head, body) = split_marker(text);
    let (system, body) = match head {
        Some(head) if head.trim().starts_with(SYSTEM_PROMPT) => {
            let instruction = drop_system_prompt(head);
            let system = if instruction.is_empty() {
                SYSTEM_PROMPT.to_owned()
            } else {
                format!("{SYSTEM_PROMPT} {instruction}")
            };
            (system, body)
        }
        _ => (SYSTEM_PROMPT.to_owned(), drop_system_prompt(&format!("{}{body}", head.unwrap_or("")))),
    };
    format!("{system}{END_OF_PROMPT}{}", body.trim())
}

/// The instruct2 prompt text `You are a helpful assistant. {instruction}<|endofprompt|>` of a plain or an
/// already wrapped instruction; text after `<|endofprompt|>` is refused. A blank instruction gives the bare
/// system prefix.
pub fn instruct_text(instruction: &str) -> Result<String> {
    let (head, body) = split_marker(instruction);
    let head = match head {
        None => body.clone(),
        Some(_) if !body.trim().is_empty() => {
            let shown: String = body.trim().chars().take(80).collect();
            return Err(Error::Input(format!(
                "an instruction must end at {END_OF_PROMPT}; found text after it: {} (put the text to speak in \
                 the tts text, not in the instruction)",
                py_repr(&shown)
            )));
        }
        Some(head) => head.to_owned(),
    };
    let instruction = drop_system_prompt(&head);
    Ok(if instruction.is_empty() {
        format!("{SYSTEM_PROMPT}{END_OF_PROMPT}")
    } else {
        format!("{SYSTEM_PROMPT} {instruction}{END_OF_PROMPT}")
    })
}

/// Python's `repr` of a string (the Python frontend quotes user text so in its messages).
fn py_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    let mut out = String::from(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// (before, after) the first `<|endofprompt|>` (before is None without one); further markers are removed
/// from after, so the result never carries two.
fn split_marker(text: &str) -> (Option<&str>, String) {
    match text.split_once(END_OF_PROMPT) {
        Some((head, body)) => (Some(head), body.replace(END_OF_PROMPT, "")),
        None => (None, text.to_owned()),
    }
}

/// `text` trimmed, without a leading system sentence (so it is never added a second time).
fn drop_system_prompt(text: &str) -> String {
    let text = text.trim();
    text.strip_prefix(SYSTEM_PROMPT).map_or(text, str::trim).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp_eop(body: &str) -> String {
        format!("{SYSTEM_PROMPT}{END_OF_PROMPT}{body}")
    }

    #[test]
    fn prefixed_forms_are_canonical() {
        let (sp, eop) = (SYSTEM_PROMPT, END_OF_PROMPT);
        assert_eq!(prefixed("Hello there."), sp_eop("Hello there."));
        assert_eq!(prefixed(&format!("  {sp}  {eop}   Hello there.  ")), sp_eop("Hello there."));
        assert_eq!(prefixed(&format!("{eop}Hello there.")), sp_eop("Hello there."));
        assert_eq!(prefixed(&format!("{sp} Hello there.")), sp_eop("Hello there."));
        for blank in ["", "  ", eop] {
            assert_eq!(prefixed(blank), sp_eop(""));
        }
        assert_eq!(prefixed(&format!("{sp}   Speak happily. {eop} Hi")), format!("{sp} Speak happily.{eop}Hi"));
        assert_eq!(prefixed(&format!("Hello {eop}there.{eop}")), sp_eop("Hello there."));
    }

    #[test]
    fn instructions_are_wrapped_once() {
        let (sp, eop) = (SYSTEM_PROMPT, END_OF_PROMPT);
        let wrapped = format!("{sp} 请用广东话表达。{eop}");
        assert_eq!(instruct_text("请用广东话表达。").unwrap(), wrapped);
        assert_eq!(instruct_text(&wrapped).unwrap(), wrapped);
        assert_eq!(instruct_text(&format!("  {sp}Speak slowly.  ")).unwrap(), format!("{sp} Speak slowly.{eop}"));
        assert_eq!(instruct_text(&format!("Speak slowly.{eop}  ")).unwrap(), format!("{sp} Speak slowly.{eop}"));
        for blank in [String::new(), sp_eop(""), eop.to_owned()] {
            assert_eq!(instruct_text(&blank).unwrap(), sp_eop(""));
        }
        let refused = instruct_text(&format!("Speak slowly.{eop} Hello ")).unwrap_err().to_string();
        assert!(refused.contains("found text after it: 'Hello' (put"), "{refused}");
        assert_eq!(py_repr("it's"), "\"it's\"");
    }

    #[test]
    fn applying_twice_changes_nothing() {
        let (sp, eop) = (SYSTEM_PROMPT, END_OF_PROMPT);
        let inputs = [
            "Hello, this is a short prompt.".to_owned(),
            "  希望你以后能够做的比我还好呦。 ".to_owned(),
            format!("  {sp}  {eop}   Hello there.  "),
            format!("Hello {eop} there {eop}."),
            "[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点。".to_owned(),
            sp_eop(""),
        ];
        for text in &inputs {
            let once = prefixed(text);
            assert_eq!(prefixed(&once), once);
            assert_eq!((once.matches(eop).count(), once.matches(sp).count()), (1, 1), "{once}");
            if let Ok(wrapped) = instruct_text(text) {
                assert_eq!(instruct_text(&wrapped).unwrap(), wrapped);
            }
        }
    }
}
