//! Health probes for load balancers, orchestrators and the packaged unit: `GET /healthz`
//! (liveness) and `GET /readyz` (readiness), both `application/json`.
//!
//! Owns: what the two answers say and their status codes. Does not own: routing, access rules
//! or bounds (the admin server in `mod.rs` applies them first: with `admin.token_file` set, a
//! probe sends the bearer token like any other request), nor how uplink state is tracked (the
//! sinks set it; the status document carries it).
//!
//! - `/healthz`: 200 `{"live":true,...}` whenever the admin endpoint answers — its thread (the
//!   control plane's) is running its event loop. A process that is gone or wedged does not
//!   answer at all, which is what a liveness probe needs to see. (The systemd watchdog probes
//!   every thread, shards included: `app::liveness`.)
//! - `/readyz`: 200 `{"ready":true,...}` when every configured uplink's session (not one a
//!   reload removed: `draining` or `removed`) is
//!   `connected` on every shard (each shard holds its own session per uplink, so a shard whose
//!   session is down holds its devices' messages back); otherwise 503 with `"ready":false`,
//!   a `"reason"` naming the first uplink and shard that is not connected, and every session's
//!   state. A gateway without uplinks is ready (messages stay local by configuration).
//!   A spool whose file system is full or read-only (`shards[].spools[].stalled`) makes the
//!   gateway not ready too (it refuses new device messages meanwhile): it comes first in
//!   `"reason"`, and every stalled spool is listed in `"spools_stalled"`.
//!
//! Readiness is read from the same status document as `/api/v1/status` (its
//! `shards[].uplinks[].state`), so the two never disagree.

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use super::AdminSource;

/// `GET /healthz`.
pub fn healthz(source: &dyn AdminSource) -> Response<Full<Bytes>> {
    let status = source.status();
    json(
        StatusCode::OK,
        serde_json::json!({
            "live": true,
            "version": status.get("version"),
            "uptime_seconds": status.get("uptime_seconds"),
        }),
    )
}

/// `GET /readyz`.
pub fn readyz(source: &dyn AdminSource) -> Response<Full<Bytes>> {
    let verdict = readiness(&source.status());
    let code = if verdict["ready"] == serde_json::Value::Bool(true) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(code, verdict)
}

/// The readiness verdict from a status document (`/api/v1/status`'s shape).
pub fn readiness(status: &serde_json::Value) -> serde_json::Value {
    let mut sessions = Vec::new();
    let mut reason: Option<String> = None;
    let shards = status["shards"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let mut stalled = Vec::new();
    for shard in shards {
        for spool in shard["spools"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let Some(why) = spool["stalled"].as_str() else {
                continue;
            };
            let name = spool["uplink"].as_str().unwrap_or("?");
            if reason.is_none() {
                let what = match why {
                    "no_space" => "has no space left on its file system",
                    "read_only" => "is on a read-only file system",
                    _ => "is stalled",
                };
                reason = Some(format!(
                    "spool of uplink {name:?} on shard {} {what} (new device messages are refused; what it holds is still sent)",
                    shard["shard"]
                ));
            }
            stalled.push(
                serde_json::json!({ "uplink": name, "shard": shard["shard"], "stalled": why }),
            );
        }
    }
    for shard in shards {
        let id = &shard["shard"];
        for uplink in shard["uplinks"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            // Removed by a reload (draining, or gone): not what readiness waits for.
            if matches!(uplink["lifecycle"].as_str(), Some("draining" | "removed")) {
                continue;
            }
            let name = uplink["name"].as_str().unwrap_or("?");
            let state = uplink["state"].as_str().unwrap_or("unknown");
            if state != "connected" && reason.is_none() {
                reason = Some(format!(
                    "uplink {name:?} is {state} on shard {id} (messages for it are held back)"
                ));
            }
            sessions.push(serde_json::json!({ "uplink": name, "shard": id, "state": state }));
        }
    }
    match reason {
        None => serde_json::json!({ "ready": true, "uplinks": sessions }),
        Some(reason) => serde_json::json!({
            "ready": false,
            "reason": reason,
            "uplinks": sessions,
            "spools_stalled": stalled,
        }),
    }
}

fn json(code: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut bytes = body.to_string().into_bytes();
    bytes.push(b'\n');
    let mut response = Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = code;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    // A probe must see the state now, never a cached answer.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(states: &[&[(&str, &str)]]) -> serde_json::Value {
        let shards: Vec<_> = states
            .iter()
            .enumerate()
            .map(|(i, ups)| {
                let ups: Vec<_> = ups
                    .iter()
                    .map(|(n, s)| serde_json::json!({ "name": n, "state": s }))
                    .collect();
                serde_json::json!({ "shard": i, "uplinks": ups })
            })
            .collect();
        serde_json::json!({ "shards": shards })
    }

    #[test]
    fn ready_only_when_every_uplink_is_connected_on_every_shard() {
        let all = status(&[
            &[("cloud", "connected"), ("backup", "connected")],
            &[("cloud", "connected"), ("backup", "connected")],
        ]);
        assert_eq!(readiness(&all)["ready"], true);
        assert_eq!(readiness(&all)["uplinks"].as_array().unwrap().len(), 4);

        let one_down = status(&[
            &[("cloud", "connected"), ("backup", "connected")],
            &[("cloud", "connected"), ("backup", "connecting")],
        ]);
        let v = readiness(&one_down);
        assert_eq!(v["ready"], false);
        assert_eq!(
            v["reason"],
            "uplink \"backup\" is connecting on shard 1 (messages for it are held back)"
        );
    }

    #[test]
    fn a_stalled_spool_makes_the_gateway_not_ready_and_comes_first_in_the_reason() {
        let mut st = status(&[&[("cloud", "connecting")], &[("cloud", "connected")]]);
        st["shards"][0]["spools"] = serde_json::json!([{ "uplink": "cloud", "stalled": null }]);
        st["shards"][1]["spools"] =
            serde_json::json!([{ "uplink": "cloud", "stalled": "read_only" }]);
        let v = readiness(&st);
        assert_eq!(v["ready"], false);
        assert_eq!(
            v["reason"],
            "spool of uplink \"cloud\" on shard 1 is on a read-only file system (new device messages are refused; what it holds is still sent)"
        );
        assert_eq!(
            v["spools_stalled"],
            serde_json::json!([{ "uplink": "cloud", "shard": 1, "stalled": "read_only" }])
        );
        st["shards"][1]["spools"][0]["stalled"] = serde_json::Value::Null;
        st["shards"][0]["uplinks"][0]["state"] = serde_json::json!("connected");
        assert_eq!(readiness(&st)["ready"], true);
    }

    #[test]
    fn a_gateway_without_uplinks_is_ready() {
        let v = readiness(&status(&[&[], &[]]));
        assert_eq!(v["ready"], true);
        assert_eq!(v["uplinks"], serde_json::json!([]));
    }
}
