//! Fuzz target for how sluice reads a CloudEvents function's HTTP response
//! (crates/sluice/src/sink/http/conn.rs, `Conn::call`).
//!
//! The input is the function's side of one keep-alive connection: sluice sends one CloudEvent
//! POST over an in-memory pipe and the input answers it, whole or in two writes split at an
//! input-chosen offset, then the pipe closes. The sans-IO decoder (`ResponseBuf`, fuzzed
//! on its own by `onem2m_response`) parses the HTTP/1.1 framing; what is fuzzed here is the
//! exchange around it: the head limit, the body bound (`MAX_BODY_BYTES`), the
//! `Connection: close` / HTTP/1.0 rule, the `Content-Type` an answer carries into its MQTT 5
//! reply, and the error mapping.
//!
//! Checks, besides "no panic" and "no hang": the same answer (status, body, close, content
//! type) or the same kind of failure (no answer at all, or a malformed one: the dispatcher
//! re-sends the first at once on a reused connection) however the input is split; a body within `MAX_BODY_BYTES`
//! and never longer than the input; an HTTP/1.0 answer is always `close`; a final status in
//! 200..=999; an answer's content type, as the dispatcher publishes it (the reply's MQTT 5
//! Content Type property), encodes and decodes back unchanged.
#![no_main]

use std::sync::OnceLock;

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use sluice::sink::http::conn::{Answer, CallError, Conn, Outgoing};
use sluice::sink::onem2m::http::MAX_BODY_BYTES;
use sluice_proto::mqtt::{encode, Decoder, Packet, Properties, ProtocolVersion, Publish, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    })
}

fn request() -> Outgoing {
    let mut headers = hyper::HeaderMap::new();
    headers.insert(hyper::header::HOST, "f".parse().expect("static"));
    headers.insert("ce-id", "1".parse().expect("static"));
    Outgoing {
        path: hyper::Uri::from_static("/"),
        headers,
        body: Bytes::from_static(b"x"),
    }
}

/// The outcome, as the dispatcher acts on it (dispatch.rs, `exchange` and `on_done`).
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Answer(u16, Bytes, bool, Option<String>),
    /// Closed or broken before any answer: on a reused connection, sent again at once on a
    /// new one (a stale keep-alive connection), not counted as an attempt.
    NoAnswer,
    /// A malformed or over-long answer: a counted failed attempt.
    Failed,
}

fn outcome(r: Result<Answer, CallError>) -> Outcome {
    match r {
        Ok(a) => Outcome::Answer(
            a.status,
            a.body,
            a.close,
            a.content_type.map(|c| c.to_string()),
        ),
        Err(CallError::Closed | CallError::Io(_) | CallError::Connect(_)) => Outcome::NoAnswer,
        Err(CallError::Http(_) | CallError::BodyTooLarge | CallError::Upgrade) => Outcome::Failed,
    }
}

/// One exchange: the function answers with `pieces`, then closes its end.
fn exchange(pieces: &[&[u8]]) -> Result<Answer, CallError> {
    let pieces: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
    runtime().block_on(async move {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let function = tokio::spawn(async move {
            // Read the request's head and its 1-byte body before answering, like a server.
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") || !seen.ends_with(b"x") {
                match server.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            for p in pieces {
                if server.write_all(&p).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            let _ = server.shutdown().await;
            // Keep reading until sluice drops its end, so writes never fail on our side.
            while let Ok(n) = server.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        });
        let mut conn = Conn::over(client).await?;
        let result = conn.call(&request(), &|_| {}).await;
        drop(conn);
        let _ = function.await;
        result
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let split = (usize::from(split) * 4).min(data.len());
    let whole = exchange(&[data]);
    if let Ok(a) = &whole {
        check_answer(a, data);
    }
    let pieces = exchange(&[&data[..split], &data[split..]]);
    assert_eq!(
        outcome(whole),
        outcome(pieces),
        "result depends on how the answer arrived"
    );
});

fn check_answer(a: &Answer, input: &[u8]) {
    assert!(a.body.len() <= MAX_BODY_BYTES, "body over the bound");
    assert!(a.body.len() <= input.len(), "body longer than the input");
    assert!(
        (200..=999).contains(&a.status),
        "final answer with status {}",
        a.status
    );
    // (A final answer at the very start: a 1xx before it may be HTTP/1.0 and the answer not.)
    if input.starts_with(b"HTTP/1.0 2") {
        assert!(a.close, "an HTTP/1.0 answer must close the connection");
    }
    // The dispatcher publishes a 2xx body as a reply with this content type (dispatch.rs,
    // `reply`): it must be a valid MQTT 5 property.
    if let Some(ct) = &a.content_type {
        let publish = Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: "reply/t".into(),
            packet_id: None,
            properties: Some(Box::new(Properties {
                content_type: Some(ct.clone()),
                ..Default::default()
            })),
            payload: a.body.clone(),
        });
        let mut wire = BytesMut::new();
        if let Err(e) = encode(&publish, ProtocolVersion::V5, &mut wire) {
            panic!("reply with content type {ct:?} does not encode: {e}");
        }
        let again = Decoder::client(ProtocolVersion::V5, usize::MAX).decode(&mut wire);
        assert_eq!(
            again,
            Ok(Some(publish)),
            "reply does not decode back unchanged"
        );
    }
}
