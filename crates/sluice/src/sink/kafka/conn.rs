//! One connection to a Kafka broker before the transport uses it: dialling (TCP, TLS verified
//! for the broker's name), SASL/SCRAM authentication, one request answered at a time while
//! connecting ([`Call`]), and writing a connection's pending bytes ([`write_out`]).
//!
//! Owns: the connection set-up and its errors. Does not own: what is sent once the
//! connection is up (`mod.rs`, `produce.rs`).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::{SaslAuthenticateRequest, SaslHandshakeRequest};
use kafka_protocol::protocol::StrBytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::answers::{Answer, SaslAuthenticateAnswer, SaslHandshakeAnswer};
use super::{protocol, scram, to_io, wire, Io, KafkaTransport};
use crate::sink::UplinkError;

impl KafkaTransport {
    pub(super) async fn dial(&self, addr: &str) -> Result<Box<dyn Io>, UplinkError> {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| UplinkError::CloudUnreachable {
                addr: addr.to_string(),
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.params.tls else {
            return self.authenticated(Box::new(tcp)).await;
        };
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let host = self
            .params
            .server_name
            .as_deref()
            .unwrap_or_else(|| host.trim_start_matches('[').trim_end_matches(']'));
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|_| UplinkError::InvalidServerName(host.to_string()))?;
        let tls = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(UplinkError::TlsHandshake)?;
        self.authenticated(Box::new(tls)).await
    }

    /// With SASL/SCRAM configured, authenticate `io` before anything else is sent on it
    /// (SaslHandshake, then two SaslAuthenticate rounds; the server's signature checked).
    async fn authenticated(&self, mut io: Box<dyn Io>) -> Result<Box<dyn Io>, UplinkError> {
        let Some(sasl) = &self.params.sasl else {
            return Ok(io);
        };
        let call = Call {
            client_id: &self.client_id,
            timeout: self.params.request_timeout,
        };
        let mut rbuf = BytesMut::new();
        let mut hs = SaslHandshakeRequest::default();
        hs.mechanism = StrBytes::from_static_str(sasl.mechanism.name());
        let resp: SaslHandshakeAnswer = call
            .exchange(&mut io, &mut rbuf, 1, &hs, "SASL handshake answer")
            .await?;
        if resp.error_code != 0 {
            let offered = &resp.mechanisms;
            return Err(UplinkError::SaslFailed(format!(
                "the broker does not take {} (it offers {offered:?})",
                sasl.mechanism.name()
            )));
        }
        let mut scram = scram::ScramClient::new(sasl.mechanism, &sasl.username, &sasl.password);
        let mut auth = SaslAuthenticateRequest::default();
        auth.auth_bytes = Bytes::from(scram.client_first());
        let first: SaslAuthenticateAnswer = call
            .exchange(&mut io, &mut rbuf, 2, &auth, "SASL answer")
            .await?;
        sasl_ok(&first)?;
        let fin = scram
            .client_final(&first.auth_bytes)
            .map_err(|e| UplinkError::SaslFailed(e.to_string()))?;
        auth.auth_bytes = Bytes::from(fin);
        let last: SaslAuthenticateAnswer = call
            .exchange(&mut io, &mut rbuf, 3, &auth, "SASL answer")
            .await?;
        sasl_ok(&last)?;
        scram
            .verify_server_final(&last.auth_bytes)
            .map_err(|e| UplinkError::SaslFailed(e.to_string()))?;
        Ok(io)
    }
}

/// A SaslAuthenticate answer's error, if any.
fn sasl_ok(resp: &SaslAuthenticateAnswer) -> Result<(), UplinkError> {
    if resp.error_code == 0 {
        return Ok(());
    }
    Err(UplinkError::SaslFailed(format!(
        "error {}: {}",
        resp.error_code,
        resp.error_message.as_deref().unwrap_or("(no message)")
    )))
}

/// One request and its answer on a connection nothing else is using yet.
pub(super) struct Call<'a> {
    pub(super) client_id: &'a StrBytes,
    pub(super) timeout: Duration,
}

impl Call<'_> {
    /// Send `req` as the request `Resp` answers (its api key and version), read the answer.
    pub(super) async fn exchange<Req, Resp>(
        &self,
        io: &mut Box<dyn Io>,
        rbuf: &mut BytesMut,
        corr: i32,
        req: &Req,
        what: &'static str,
    ) -> Result<Resp, UplinkError>
    where
        Req: kafka_protocol::protocol::Encodable + kafka_protocol::protocol::HeaderVersion,
        Resp: Answer,
    {
        let mut out = BytesMut::new();
        wire::encode_request(
            &mut out,
            Resp::KEY,
            Resp::VERSION,
            corr,
            self.client_id,
            req,
        )
        .map_err(protocol)?;
        let exchange = async {
            io.write_all(&out).await?;
            io.flush().await?;
            loop {
                if let Some(frame) = wire::next_frame(rbuf).map_err(to_io)? {
                    return Ok::<_, std::io::Error>(frame);
                }
                if io.read_buf(rbuf).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        };
        let frame = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| UplinkError::ResponseTimeout(self.timeout))?
            .map_err(UplinkError::ConnectionLost)?;
        if wire::peek_correlation_id(&frame).map_err(protocol)? != corr {
            return Err(UplinkError::Protocol(format!(
                "the Kafka broker answered another request than the {what}"
            )));
        }
        wire::decode_response(&frame, what).map_err(protocol)
    }
}

pub(super) async fn write_out(
    io: &mut Box<dyn Io>,
    out: &mut BytesMut,
    timeout: Duration,
) -> Result<(), UplinkError> {
    let write = async {
        io.write_all(out).await?;
        io.flush().await
    };
    match tokio::time::timeout(timeout, write).await {
        Ok(Ok(())) => {
            out.clear();
            Ok(())
        }
        Ok(Err(e)) => Err(UplinkError::ConnectionLost(e)),
        Err(_) => Err(UplinkError::WriteTimeout(timeout)),
    }
}
