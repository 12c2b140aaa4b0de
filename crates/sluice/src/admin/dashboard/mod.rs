//! The dashboard: one page, its script and its style sheet, compiled into the binary, and the
//! `GET /api/v1/events` response that feeds it.
//!
//! Owns: the asset bytes (`index.html`, `app.js`, `style.css` beside this file, embedded with
//! `include_str!`), their headers, and the shape of an event-stream response. Does not own: the
//! numbers (the source's overview, `app/overview.rs`), the ticker and stream bounds
//! (`admin/events.rs`), access rules (`admin/mod.rs`).
//!
//! Invariants: the page loads nothing from anywhere but this endpoint — no CDN, no web fonts,
//! charts drawn as inline SVG by hand — and the `Content-Security-Policy` sent with it lets the
//! browser enforce that (`default-src 'self'`, `connect-src 'self'`). Assets carry no gateway
//! data, so they are served without the token (ADR 0010 addendum); everything the page shows
//! comes from `/api/v1/*`, which needs it. Total weight is checked by a test
//! ([`PAGE_WEIGHT_LIMIT`]).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::header::{HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};

use super::events::EventHub;
use super::AdminBody;

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const STYLE_CSS: &str = include_str!("style.css");

/// The page's whole weight must stay under this (issue 29: ≤ 200 KiB).
pub const PAGE_WEIGHT_LIMIT: usize = 200 * 1024;

/// Bytes of every asset together.
pub fn page_weight() -> usize {
    INDEX_HTML.len() + APP_JS.len() + STYLE_CSS.len()
}

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether `path` is one of the dashboard's assets.
pub fn is_asset(path: &str) -> bool {
    matches!(path, "/" | "/index.html" | "/app.js" | "/style.css")
}

/// Whether the client asked for HTML (a browser), rather than e.g. `curl /`.
pub fn wants_html<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// One asset (`is_asset(path)` must hold).
pub fn asset(path: &str) -> Response<AdminBody> {
    let (body, content_type) = match path {
        "/app.js" => (APP_JS, "text/javascript; charset=utf-8"),
        "/style.css" => (STYLE_CSS, "text/css; charset=utf-8"),
        _ => (INDEX_HTML, "text/html; charset=utf-8"),
    };
    let mut response = Response::new(Either::Left(Full::new(Bytes::from_static(body.as_bytes()))));
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        HeaderName::from_static("content-security-policy"),
        HeaderValue::from_static(CSP),
    );
    h.insert(
        HeaderName::from_static("x-content-type-options"),
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        HeaderName::from_static("referrer-policy"),
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// `GET /api/v1/events`: a `text/event-stream` of the overview, or 503 when
/// `events::MAX_STREAMS` are open.
pub fn event_stream(hub: &Arc<EventHub>, kill: Arc<tokio::sync::Notify>) -> Response<AdminBody> {
    match hub.open_stream(kill) {
        Some(body) => {
            let mut response = Response::new(Either::Right(body));
            let h = response.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        None => {
            let mut response = Response::new(Either::Left(Full::new(Bytes::from_static(
                b"too many event streams open; retry later or use GET /api/v1/overview\n",
            ))));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let h = response.headers_mut();
            h.insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            h.insert(
                HeaderName::from_static("retry-after"),
                HeaderValue::from_static("5"),
            );
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_weighs_less_than_200_kib_and_names_no_other_origin() {
        assert!(
            page_weight() <= PAGE_WEIGHT_LIMIT,
            "{} bytes",
            page_weight()
        );
        for (name, text) in [
            ("index.html", INDEX_HTML),
            ("app.js", APP_JS),
            ("style.css", STYLE_CSS),
        ] {
            for needle in ["http://", "https://", "//cdn", "@import", "url("] {
                // The SVG namespace is an identifier, not a request.
                let hits = text
                    .match_indices(needle)
                    .filter(|(i, _)| !text[*i..].starts_with("http://www.w3.org/2000/svg"))
                    .count();
                assert_eq!(hits, 0, "{name} mentions {needle}");
            }
        }
    }
}
