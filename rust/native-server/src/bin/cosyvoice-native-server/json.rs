//! A `POST /synthesize` body read as the Python server reads it (`json.loads` on bytes), so a malformed one gets
//! the same words: the encoding detected as `json.detect_encoding` does (UTF-8, UTF-8 with a BOM, UTF-16,
//! UTF-32),
//! a decode error naming the first bad byte, and the scanner's messages ("Expecting value", "Extra data", ...).
//! The nesting was bounded before (http-front's depth check), so the recursion here is shallow.

use serde_json::{Map, Number, Value};

/// Why a body is not JSON, in the Python server's words (without the `the body is ...` frame).
#[derive(Debug, PartialEq)]
pub enum Malformed {
    /// not text in its encoding: the first bad byte and its offset
    Undecodable { byte: u8, offset: usize },
    /// the scanner's message
    Invalid(&'static str),
}

/// Decodes and parses `raw` as `json.loads(raw)` does.
pub fn loads(raw: &[u8]) -> Result<Value, Malformed> {
    let text = decode(raw)?;
    let chars: Vec<char> = text.chars().collect();
    let mut parser = Parser { s: &chars, at: 0 };
    parser.skip_ws();
    let value = parser.value()?;
    parser.skip_ws();
    if parser.at != chars.len() {
        return Err(Malformed::Invalid("Extra data"));
    }
    Ok(value)
}

fn decode(raw: &[u8]) -> Result<String, Malformed> {
    let utf16 = |big: bool, start: usize| -> Result<String, Malformed> {
        let body = &raw[start..];
        let units: Vec<u16> = body
            .chunks_exact(2)
            .map(|p| if big { u16::from_be_bytes([p[0], p[1]]) } else { u16::from_le_bytes([p[0], p[1]]) })
            .collect();
        if body.len() % 2 == 1 {
            let offset = raw.len() - 1;
            return Err(Malformed::Undecodable { byte: raw[offset], offset });
        }
        String::from_utf16(&units).map_err(|_| Malformed::Undecodable { byte: raw[start], offset: start })
    };
    // a unit that is no character (past U+10FFFF, or a surrogate, which Python's `surrogatepass` would keep
    // and a Rust string cannot hold) and a truncated last unit name their first byte, as Python's codec does
    let utf32 = |big: bool, start: usize| -> Result<String, Malformed> {
        let body = &raw[start..];
        let whole = body.len() - body.len() % 4;
        let bad = |offset: usize| Malformed::Undecodable { byte: raw[offset], offset };
        let text = body[..whole]
            .chunks_exact(4)
            .enumerate()
            .map(|(i, q)| {
                let unit = if big {
                    u32::from_be_bytes([q[0], q[1], q[2], q[3]])
                } else {
                    u32::from_le_bytes([q[0], q[1], q[2], q[3]])
                };
                char::from_u32(unit).ok_or_else(|| bad(start + 4 * i))
            })
            .collect::<Result<String, Malformed>>()?;
        if whole != body.len() {
            return Err(bad(start + whole));
        }
        Ok(text)
    };
    if raw.starts_with(&[0, 0, 0xfe, 0xff]) {
        return utf32(true, 4);
    }
    if raw.starts_with(&[0xff, 0xfe, 0, 0]) {
        return utf32(false, 4);
    }
    if raw.starts_with(&[0xff, 0xfe]) {
        return utf16(false, 2);
    }
    if raw.starts_with(&[0xfe, 0xff]) {
        return utf16(true, 2);
    }
    let raw_utf8 = raw.strip_prefix(&[0xef, 0xbb, 0xbf]).unwrap_or(raw);
    if raw.len() >= 4 && raw[0] == 0 {
        return if raw[1] != 0 { utf16(true, 0) } else { utf32(true, 0) };
    }
    if raw.len() >= 4 && raw[1] == 0 {
        return if raw[2] != 0 || raw[3] != 0 { utf16(false, 0) } else { utf32(false, 0) };
    }
    if raw.len() == 2 && raw[0] == 0 {
        return utf16(true, 0);
    }
    if raw.len() == 2 && raw[1] == 0 {
        return utf16(false, 0);
    }
    let skipped = raw.len() - raw_utf8.len();
    std::str::from_utf8(raw_utf8).map(str::to_owned).map_err(|e| {
        let offset = skipped + e.valid_up_to();
        Malformed::Undecodable { byte: raw[offset], offset }
    })
}

struct Parser<'a> {
    s: &'a [char],
    at: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(' ' | '\t' | '\n' | '\r')) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &str) -> bool {
        let n = word.chars().count();
        let matched = self.s.len() >= self.at + n && self.s[self.at..self.at + n].iter().copied().eq(word.chars());
        if matched {
            self.at += n;
        }
        matched
    }

    fn value(&mut self) -> Result<Value, Malformed> {
        let expecting = Malformed::Invalid("Expecting value");
        match self.peek() {
            Some('"') => self.string().map(Value::String),
            Some('{') => self.object(),
            Some('[') => self.array(),
            Some('n') if self.literal("null") => Ok(Value::Null),
            Some('t') if self.literal("true") => Ok(Value::Bool(true)),
            Some('f') if self.literal("false") => Ok(Value::Bool(false)),
            // Python accepts NaN and ±Infinity; no JSON number holds them, so they stay text for the checks
            Some('N') if self.literal("NaN") => Ok(Value::String("NaN".into())),
            Some('I') if self.literal("Infinity") => Ok(Value::String("Infinity".into())),
            Some('-') if self.literal("-Infinity") => Ok(Value::String("-Infinity".into())),
            Some('-' | '0'..='9') => self.number().ok_or(expecting),
            _ => Err(expecting),
        }
    }

    fn object(&mut self) -> Result<Value, Malformed> {
        let (mut map, mut first) = (Map::new(), true);
        self.at += 1;
        loop {
            self.skip_ws();
            if first && self.peek() == Some('}') {
                self.at += 1;
                return Ok(Value::Object(map));
            }
            if self.peek() != Some('"') {
                return Err(Malformed::Invalid("Expecting property name enclosed in double quotes"));
            }
            let key = self.string()?;
            self.skip_ws();
            if self.peek() != Some(':') {
                return Err(Malformed::Invalid("Expecting ':' delimiter"));
            }
            self.at += 1;
            self.skip_ws();
            map.insert(key, self.value()?);
            self.skip_ws();
            match self.peek() {
                Some('}') => {
                    self.at += 1;
                    return Ok(Value::Object(map));
                }
                Some(',') => self.at += 1,
                _ => return Err(Malformed::Invalid("Expecting ',' delimiter")),
            }
            first = false;
        }
    }

    fn array(&mut self) -> Result<Value, Malformed> {
        let mut items = Vec::new();
        self.at += 1;
        self.skip_ws();
        if self.peek() == Some(']') {
            self.at += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value()?);
            self.skip_ws();
            match self.peek() {
                Some(']') => {
                    self.at += 1;
                    return Ok(Value::Array(items));
                }
                Some(',') => self.at += 1,
                _ => return Err(Malformed::Invalid("Expecting ',' delimiter")),
            }
        }
    }

    fn string(&mut self) -> Result<String, Malformed> {
        let mut out = String::new();
        self.at += 1;
        loop {
            let c = self.peek().ok_or(Malformed::Invalid("Unterminated string starting at"))?;
            self.at += 1;
            match c {
                '"' => return Ok(out),
                '\\' => out.push(self.escape()?),
                c if (c as u32) < 0x20 => return Err(Malformed::Invalid("Invalid control character at")),
                c => out.push(c),
            }
        }
    }

    fn escape(&mut self) -> Result<char, Malformed> {
        let c = self.peek().ok_or(Malformed::Invalid("Unterminated string starting at"))?;
        self.at += 1;
        Ok(match c {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let unit = self.hex4()?;
                if (0xd800..0xdc00).contains(&unit) && self.s.get(self.at..self.at + 2) == Some(&['\\', 'u']) {
                    let saved = self.at;
                    self.at += 2;
                    let low = self.hex4()?;
                    if (0xdc00..0xe000).contains(&low) {
                        let code = 0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00);
                        return Ok(char::from_u32(code).unwrap_or('\u{fffd}'));
                    }
                    self.at = saved;
                }
                char::from_u32(unit).unwrap_or('\u{fffd}') // a lone surrogate: Python keeps it, UTF-8 cannot
            }
            _ => return Err(Malformed::Invalid("Invalid \\escape")),
        })
    }

    fn hex4(&mut self) -> Result<u32, Malformed> {
        let digits: String = self.s.get(self.at..self.at + 4).map(|d| d.iter().collect()).unwrap_or_default();
        let unit = u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == 4 && digits.chars().all(|c| c.is_ascii_hexdigit()))
            .ok_or(Malformed::Invalid("Invalid \\uXXXX escape"))?;
        self.at += 4;
        Ok(unit)
    }

    /// Python's number rule: `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`, the longest match.
    fn number(&mut self) -> Option<Value> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while matches!(p.peek(), Some('0'..='9')) {
                p.at += 1;
            }
            p.at - from
        };
        if self.peek() == Some('-') {
            self.at += 1;
        }
        match self.peek() {
            Some('0') => self.at += 1,
            Some('1'..='9') => {
                digits(self);
            }
            _ => {
                self.at = start;
                return None;
            }
        }
        let mut integer = true;
        if self.peek() == Some('.') && matches!(self.s.get(self.at + 1), Some('0'..='9')) {
            self.at += 1;
            digits(self);
            integer = false;
        }
        if matches!(self.peek(), Some('e' | 'E')) {
            let mark = self.at;
            self.at += 1;
            if matches!(self.peek(), Some('+' | '-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                self.at = mark;
            } else {
                integer = false;
            }
        }
        let text: String = self.s[start..self.at].iter().collect();
        let number = if integer {
            text.parse::<i64>().map(Number::from).ok().or_else(|| text.parse::<f64>().ok().and_then(Number::from_f64))
        } else {
            text.parse::<f64>().ok().and_then(Number::from_f64)
        };
        Some(number.map_or(Value::String(text), Value::Number))
    }
}

#[cfg(test)]
mod tests {
    use super::{loads, Malformed};

    fn invalid(raw: &[u8]) -> Malformed {
        loads(raw).unwrap_err()
    }

    #[test]
    fn pythons_messages() {
        assert_eq!(invalid(b"{"), Malformed::Invalid("Expecting property name enclosed in double quotes"));
        assert_eq!(invalid(b"{\"a\":"), Malformed::Invalid("Expecting value"));
        assert_eq!(
            invalid(b"{\"text\": \"a\",}"),
            Malformed::Invalid("Expecting property name enclosed in double quotes")
        );
        assert_eq!(invalid(b"nul"), Malformed::Invalid("Expecting value"));
        assert_eq!(invalid(b"{\"text\": \"a\"} x"), Malformed::Invalid("Extra data"));
        assert_eq!(invalid(b"[1,]"), Malformed::Invalid("Expecting value"));
        assert_eq!(invalid(b"{\"a\" 1}"), Malformed::Invalid("Expecting ':' delimiter"));
        assert_eq!(invalid(b"\xff\xfe{"), Malformed::Undecodable { byte: 0x7b, offset: 2 });
        assert_eq!(invalid(b"\xe9"), Malformed::Undecodable { byte: 0xe9, offset: 0 });
        assert_eq!(invalid(b"{\"text\":\"\xe9\"}"), Malformed::Undecodable { byte: 0xe9, offset: 9 });
        // UTF-32, as Python reads it: a truncated last unit, a unit past U+10FFFF
        assert_eq!(invalid(b"\xff\xfe\x00\x00{\x00\x00"), Malformed::Undecodable { byte: 0x7b, offset: 4 });
        assert_eq!(invalid(b"\x00\x00\x00{\x00\x00\x00"), Malformed::Undecodable { byte: 0, offset: 4 });
        assert_eq!(invalid(b"{\x00\x00\x00\x00\x00\x11\x00"), Malformed::Undecodable { byte: 0, offset: 4 });
    }

    #[test]
    fn utf32_bodies() {
        let empty = serde_json::json!({});
        for raw in [
            &b"\xff\xfe\x00\x00{\x00\x00\x00}\x00\x00\x00"[..],
            b"\x00\x00\xfe\xff\x00\x00\x00{\x00\x00\x00}",
            b"{\x00\x00\x00}\x00\x00\x00",
            b"\x00\x00\x00{\x00\x00\x00}",
        ] {
            assert_eq!(loads(raw).unwrap(), empty);
        }
        let text: Vec<u8> = "{\"text\": \"h\u{e9}\u{1f600}\"}".chars().flat_map(|c| (c as u32).to_le_bytes()).collect();
        assert_eq!(loads(&text).unwrap()["text"], "h\u{e9}\u{1f600}");
    }

    #[test]
    fn values() {
        let v = loads(b" {\"text\": \"h\\u00e9\", \"seed\": -3, \"speed\": 1.5e0, \"x\": [true, null]} ").unwrap();
        assert_eq!(v["text"], "hé");
        assert_eq!(v["seed"], -3);
        assert_eq!(v["speed"], 1.5);
        assert_eq!(loads("\u{feff}".as_bytes()).unwrap_err(), Malformed::Invalid("Expecting value"));
    }
}
