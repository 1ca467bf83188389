//! CORS as starlette's middleware answers it, so both Rust servers send the Python server's headers.

use hyper::{HeaderMap, Response, StatusCode};

use crate::answer::{header, set};
use crate::{full, ResponseBody};

/// CORS as starlette's middleware computes it from the settings (`cosyvoice.server.common.cors_options`).
#[derive(Clone)]
pub struct Cors {
    pub allow_origins: Vec<String>,
    pub allow_all_origins: bool,
    pub allow_credentials: bool,
    pub allow_methods: Vec<String>,
    pub allow_all_headers: bool,
    pub allow_headers: Vec<String>,
    pub preflight_explicit_allow_origin: bool,
    pub allow_private_network: bool,
    pub simple_headers: Vec<(String, String)>,
    pub preflight_headers: Vec<(String, String)>,
}

impl Cors {
    /// The policy the Python servers configure (`cosyvoice.server.common.cors_options`: these origins, every
    /// method and header, `expose` exposed, credentials unless `*`), with the values starlette's middleware
    /// (the version the project pins) computes from it.
    pub fn starlette(origins: &[String], expose: &[&str]) -> Cors {
        let allow_all_origins = origins.iter().any(|o| o == "*");
        let allow_credentials = !allow_all_origins;
        let explicit = !allow_all_origins || allow_credentials;
        let methods = [
            "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY",
        ];
        let pair = |name: &str, value: &str| (name.to_string(), value.to_string());
        let mut simple_headers = Vec::new();
        if allow_all_origins {
            simple_headers.push(pair("Access-Control-Allow-Origin", "*"));
        }
        if allow_credentials {
            simple_headers.push(pair("Access-Control-Allow-Credentials", "true"));
        }
        if !expose.is_empty() {
            simple_headers.push(pair("Access-Control-Expose-Headers", &expose.join(", ")));
        }
        let mut preflight_headers = vec![pair(
            "Vary",
            "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, \
             Access-Control-Request-Private-Network",
        )];
        if !explicit {
            preflight_headers.push(pair("Access-Control-Allow-Origin", "*"));
        }
        preflight_headers.push(pair("Access-Control-Allow-Methods", &methods.join(", ")));
        preflight_headers.push(pair("Access-Control-Max-Age", "600"));
        if allow_credentials {
            preflight_headers.push(pair("Access-Control-Allow-Credentials", "true"));
        }
        Cors {
            allow_origins: origins.to_vec(),
            allow_all_origins,
            allow_credentials,
            allow_methods: methods.iter().map(|m| m.to_string()).collect(),
            allow_all_headers: true,
            allow_headers: [
                "*",
                "accept",
                "accept-language",
                "content-language",
                "content-type",
            ]
            .iter()
            .map(|h| h.to_string())
            .collect(),
            preflight_explicit_allow_origin: explicit,
            allow_private_network: false,
            simple_headers,
            preflight_headers,
        }
    }
}

/// The answer to a CORS preflight (`OPTIONS` with `Access-Control-Request-Method`).
pub fn preflight(cors: &Cors, request: &HeaderMap) -> Response<ResponseBody> {
    let origin = header(request, "origin").unwrap_or_default();
    let method = header(request, "access-control-request-method").unwrap_or_default();
    let requested_headers = header(request, "access-control-request-headers");
    let mut headers = HeaderMap::new();
    for (name, value) in &cors.preflight_headers {
        set(&mut headers, name, value);
    }
    let mut failures = Vec::new();
    if allowed_origin(cors, &origin) {
        if cors.preflight_explicit_allow_origin {
            set(&mut headers, "access-control-allow-origin", &origin);
        }
    } else {
        failures.push("origin");
    }
    if !cors.allow_methods.contains(&method) {
        failures.push("method");
    }
    if let Some(requested) = &requested_headers {
        if cors.allow_all_headers {
            set(&mut headers, "access-control-allow-headers", requested);
        } else if requested
            .to_lowercase()
            .split(',')
            .any(|h| !cors.allow_headers.contains(&h.trim().to_string()))
        {
            failures.push("headers");
        }
    }
    if request.contains_key("access-control-request-private-network") {
        if cors.allow_private_network {
            set(&mut headers, "access-control-allow-private-network", "true");
        } else {
            failures.push("private-network");
        }
    }
    let (status, text) = if failures.is_empty() {
        (200, "OK".to_string())
    } else {
        (400, format!("Disallowed CORS {}", failures.join(", ")))
    };
    let mut response = Response::new(full(text));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    *response.headers_mut() = headers;
    set(
        response.headers_mut(),
        "content-type",
        "text/plain; charset=utf-8",
    );
    response
}

fn allowed_origin(cors: &Cors, origin: &str) -> bool {
    cors.allow_all_origins || cors.allow_origins.iter().any(|o| o == origin)
}

/// The CORS headers of an ordinary answer to a request from `origin`.
pub fn simple_cors(cors: &Cors, origin: Option<&str>, headers: &mut HeaderMap) {
    let explicit = match origin {
        None => false,
        Some(origin) => {
            for (name, value) in &cors.simple_headers {
                set(headers, name, value);
            }
            (cors.allow_all_origins && cors.allow_credentials)
                || (!cors.allow_all_origins && allowed_origin(cors, origin))
        }
    };
    if explicit {
        set(
            headers,
            "access-control-allow-origin",
            origin.unwrap_or_default(),
        );
    }
    let mut vary: Vec<String> = headers
        .get_all("vary")
        .iter()
        .filter_map(|v| v.to_str().ok().map(String::from))
        .collect();
    vary.push("Origin".to_string());
    set(headers, "vary", &vary.join(", "));
}
