//! Errors on HTTP as the Python server renders them (`cosyvoice/server/errors.py`): a JSON body
//! `{"error": {message, type, field, param}}`, compact, non-ASCII kept as is.

use http_front::answer::Canned;

/// One refusal: status, type, message, the field at fault, extra headers.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub field: Option<String>,
    pub headers: Vec<(String, String)>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: &str) -> ApiError {
        ApiError { status, kind, message: message.to_owned(), field: None, headers: Vec::new() }
    }

    /// A 400 for input the user can fix.
    pub fn invalid(message: &str, field: Option<&str>) -> ApiError {
        ApiError { field: field.map(str::to_owned), ..ApiError::new(400, "invalid_request_error", message) }
    }

    /// A 503 the client should retry after `retry_after` seconds.
    pub fn busy(message: &str, retry_after: u64) -> ApiError {
        ApiError::new(503, "busy", message).with_header("retry-after", &retry_after.to_string())
    }

    pub fn with_header(mut self, name: &str, value: &str) -> ApiError {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The answer's status, headers and body (keys in the Python server's order).
    pub fn canned(&self) -> Canned {
        let quote = |text: &str| serde_json::to_string(text).expect("JSON of a string");
        let field = self.field.as_deref().map_or_else(|| "null".to_owned(), quote);
        let (message, kind) = (quote(&self.message), quote(self.kind));
        let body = format!(r#"{{"error":{{"message":{message},"type":{kind},"field":{field},"param":{field}}}}}"#);
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        headers.extend(self.headers.iter().cloned());
        Canned { status: self.status, headers, body: body.into_bytes() }
    }
}
