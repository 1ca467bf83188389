//! A JSON body's nesting, measured on its bytes before any parser (serde's, or an interpreter's, which
//! recurse per level) sees it.

/// Whether `raw` nests arrays and objects deeper than `max_depth` levels (brackets inside strings do not
/// count). Stops at the first level too deep; linear in the body otherwise, without allocating.
pub fn depth_exceeds(raw: &[u8], max_depth: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &byte in raw {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max_depth {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::depth_exceeds;

    #[test]
    fn counts_levels_outside_strings() {
        assert!(!depth_exceeds(br#"{"a": [1, {"b": []}]}"#, 4));
        assert!(depth_exceeds(br#"{"a": [1, {"b": []}]}"#, 3));
        assert!(!depth_exceeds(br#"{"text": "[[[[[[\"[[[[", "n": [[]]}"#, 3));
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(depth_exceeds(deep.as_bytes(), 64));
        assert!(!depth_exceeds(b"[][][][]", 1));
    }
}
