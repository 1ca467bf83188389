//! API keys as the Python server checks them (`cosyvoice.server.common`).

/// The Bearer token of an `Authorization` header (as `cosyvoice.server.common.presented_key`).
pub fn presented_key(authorization: &str) -> String {
    match authorization.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("bearer ") => {
            authorization[7..].trim().to_string()
        }
        _ => String::new(),
    }
}

/// Whether `token` is one of `keys`, compared in constant time per key (as `hmac.compare_digest`).
pub fn key_is_valid(token: &str, keys: &[String]) -> bool {
    !token.is_empty()
        && keys.iter().fold(false, |found, key| {
            let (a, b) = (token.as_bytes(), key.as_bytes());
            let same =
                a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0;
            found | same
        })
}

#[cfg(test)]
mod tests {
    use super::{key_is_valid, presented_key};

    #[test]
    fn keys() {
        let keys = vec!["s3cret".to_string(), "other".to_string()];
        assert_eq!(presented_key("Bearer  s3cret "), "s3cret");
        assert_eq!(presented_key("bearer s3cret"), "s3cret");
        assert_eq!(presented_key("Basic s3cret"), "");
        assert!(key_is_valid("s3cret", &keys) && key_is_valid("other", &keys));
        assert!(
            !key_is_valid("s3cre", &keys)
                && !key_is_valid("", &keys)
                && !key_is_valid("wrong", &[])
        );
    }
}
