//! Answers both servers give alike: canned refusals, JSON bodies, header access, the JSON content type rule.

use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Response, StatusCode};

use crate::{full, ResponseBody};

/// A refusal the HTTP side answers alone: status, headers, JSON body (rendered once, at start).
#[derive(Clone)]
pub struct Canned {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The response of a [`Canned`] refusal.
pub fn canned(answer: &Canned) -> Response<ResponseBody> {
    response(answer.status, &answer.headers, answer.body.clone())
}

/// A response of a status, its headers and a body (a status that is not HTTP's is answered 500).
pub fn response(status: u16, headers: &[(String, String)], body: Vec<u8>) -> Response<ResponseBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in headers {
        set(response.headers_mut(), name, value);
    }
    response
}

/// A JSON body with its status.
pub fn json_response(status: u16, body: Vec<u8>) -> Response<ResponseBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    set(response.headers_mut(), "content-type", "application/json");
    response
}

/// A header's value, where it is text.
pub fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(String::from)
}

/// Sets a header; a name or value that is not valid HTTP is left out.
pub fn set(headers: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        headers.insert(name, value);
    }
}

/// Whether a body of `content_type` is JSON, as FastAPI decides (`application/json`, `application/*+json`).
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some(("application", subtype)) => subtype == "json" || subtype.ends_with("+json"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::is_json;

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json") && is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/problem+json") && !is_json("text/plain") && !is_json("json"));
    }
}
