//! `POST /api/v1/reload`: the admin endpoint's one writing route.
//!
//! Owns: the route's HTTP answer — the source's reload run on the blocking pool (it reads
//! files and compiles rules: the control-plane thread that serves the admin endpoint keeps
//! publishing snapshots meanwhile), its JSON body, `405 Allow: POST` for any other method.
//! Does not own: who may ask (the access rules in `mod.rs` run first: a writing request
//! always needs the bearer token, ADR 0010) or what a reload does (`app/reload.rs`).

use std::sync::Arc;

use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, Response, StatusCode};

use super::{text, with_type, AdminSource};

/// The route's path.
pub(super) const PATH: &str = "/api/v1/reload";

/// Answer a request for [`PATH`] that passed the access rules.
pub(super) async fn answer(
    method: &Method,
    source: Arc<dyn AdminSource>,
) -> Response<super::AdminBody> {
    if method != Method::POST {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: POST /api/v1/reload re-reads the config file\n".to_string(),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST"));
        return response;
    }
    match tokio::task::spawn_blocking(move || source.reload()).await {
        Ok(Some((status, body))) => {
            let mut body = body.to_string().into_bytes();
            body.push(b'\n');
            with_type(status, "application/json", body)
        }
        Ok(None) => text(
            StatusCode::NOT_FOUND,
            "not found; GET / lists the endpoints\n".to_string(),
        ),
        Err(error) => {
            tracing::error!(%error, "the reload task failed");
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the reload failed; see the gateway's log\n".to_string(),
            )
        }
    }
}
