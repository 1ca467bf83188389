//! A JSON body's nesting, measured on its bytes before any parser (serde's, or an interpreter's, which
//! recurse per level) sees it.

/// Which bound a JSON body passes first.
#[derive(Debug, PartialEq, Eq)]
pub enum Exceeded {
    /// nested deeper than the bound
    Depth,
    /// more values than the bound (an array or object, or an item after a comma: Python's `JsonShape` count)
    Values,
}

/// Whether `raw` nests arrays and objects deeper than `max_depth` levels (brackets inside strings do not
/// count). Stops at the first level too deep; linear in the body otherwise, without allocating.
pub fn depth_exceeds(raw: &[u8], max_depth: usize) -> bool {
    shape_exceeds(raw, max_depth, usize::MAX).is_some()
}

/// The first bound `raw` passes while read from the start: `max_depth` levels or `max_values` values
/// (brackets and commas inside strings do not count), as the Python servers' `JsonShape` scans it.
pub fn shape_exceeds(raw: &[u8], max_depth: usize, max_values: usize) -> Option<Exceeded> {
    let (mut depth, mut values, mut in_string, mut escaped) = (0usize, 0usize, false, false);
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
            b',' => values += 1,
            b'[' | b'{' => {
                (depth, values) = (depth + 1, values + 1);
                if depth > max_depth {
                    return Some(Exceeded::Depth);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if values > max_values {
            return Some(Exceeded::Values);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{depth_exceeds, shape_exceeds, Exceeded};

    #[test]
    fn counts_levels_outside_strings() {
        assert!(!depth_exceeds(br#"{"a": [1, {"b": []}]}"#, 4));
        assert!(depth_exceeds(br#"{"a": [1, {"b": []}]}"#, 3));
        assert!(!depth_exceeds(br#"{"text": "[[[[[[\"[[[[", "n": [[]]}"#, 3));
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(depth_exceeds(deep.as_bytes(), 64));
        assert!(!depth_exceeds(b"[][][][]", 1));
    }

    #[test]
    fn counts_values_outside_strings() {
        assert_eq!(shape_exceeds(br#"[1, 2, "a,b,c"]"#, 64, 3), None);
        assert_eq!(
            shape_exceeds(br#"[1, 2, 3, 4]"#, 64, 3),
            Some(Exceeded::Values)
        );
        assert_eq!(shape_exceeds(b"[[[[", 2, 3), Some(Exceeded::Depth));
    }
}
