//! The wire side of an upstream's connection: dialling (TCP or MPTCP, from a path's place),
//! the RFC 8323 CSM exchange, serving one connection (writing waiting requests, reading
//! responses, Ping/Pong, Release/Abort) and matching responses to their requests.

use super::*;

impl Upstream {
    /// TCP (or MPTCP with `mptcp = true`) to the upstream from connection `i`'s place,
    /// trying each resolved address; the connection's MPTCP state is kept for status until
    /// `connection_lost`.
    pub(super) async fn dial(&self, i: usize, target: &ProxyTarget) -> std::io::Result<TcpStream> {
        let c = &self.conns[i];
        let mut last = None;
        for addr in tokio::net::lookup_host((target.host.as_str(), target.port)).await? {
            let (socket, mptcp_socket) = match crate::net::dial::socket_for(addr, &c.dial) {
                Ok(s) => s,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            match socket.connect(addr).await {
                Ok(tcp) => {
                    let key = self.m().mptcp.on_connect(&tcp, c.dial.mptcp, mptcp_socket);
                    self.m().mptcp.on_close(c.mptcp_key.replace(key));
                    return Ok(tcp);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} resolved to no address", target.host),
            )
        }))
    }

    pub(super) async fn connect(
        &self,
        i: usize,
    ) -> Result<(Box<dyn Io>, BytesMut, Capabilities), ConnError> {
        let target = self.target.as_ref().ok_or(ConnError::BadUrl)?;
        let tcp = self.dial(i, target).await?;
        tcp.set_nodelay(true)?;
        let mut io: Box<dyn Io> = match &self.tls {
            None => Box::new(tcp),
            Some(Err(e)) => return Err(ConnError::Tls(e.clone())),
            Some(Ok(config)) => {
                let name = self
                    .cfg
                    .server_name
                    .clone()
                    .unwrap_or_else(|| target.host.clone());
                let name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| ConnError::Tls(e.to_string()))?;
                let connector = tokio_rustls::TlsConnector::from(config.clone());
                Box::new(connector.connect(name, tcp).await?)
            }
        };
        let mut out = BytesMut::new();
        encode_tcp(&tcp::csm(self.max_message_size as u32, false), &mut out);
        io.write_all(&out).await?;
        io.flush().await?;
        let mut rbuf = BytesMut::with_capacity(4096);
        let first = loop {
            if let Some(m) = decode_tcp(&mut rbuf, self.max_message_size)? {
                break m;
            }
            if io.read_buf(&mut rbuf).await? == 0 {
                return Err(ConnError::Closed);
            }
        };
        if first.code != Code::CSM {
            let _ = self
                .send_abort(&mut io, None, "first message must be a CSM")
                .await;
            return Err(ConnError::NoCsm);
        }
        match tcp::read_csm(&first, Capabilities::default()) {
            Ok(caps) => Ok((io, rbuf, caps)),
            Err(n) => {
                let _ = self
                    .send_abort(&mut io, Some(n), "unknown critical CSM option")
                    .await;
                Err(ConnError::BadCsm(n))
            }
        }
    }

    pub(super) async fn send_abort(
        &self,
        io: &mut Box<dyn Io>,
        option: Option<u16>,
        why: &'static str,
    ) -> std::io::Result<()> {
        let mut out = BytesMut::new();
        encode_tcp(&tcp::abort(option, why), &mut out);
        io.write_all(&out).await?;
        io.flush().await
    }

    /// Move requests over connection `i`'s connected `io` until it ends.
    pub(super) async fn serve(
        &self,
        i: usize,
        io: &mut Box<dyn Io>,
        rbuf: &mut BytesMut,
        mut caps: Capabilities,
    ) -> ConnError {
        enum Ev {
            Read(std::io::Result<usize>),
            Work,
            Link,
            Idle,
            Stall,
        }
        let c = &self.conns[i];
        let mut last_read = tokio::time::Instant::now();
        let mut ping_sent = false;
        let mut wbuf = BytesMut::new();
        loop {
            if c.link_up.get() == Some(false) {
                return ConnError::LinkDown;
            }
            // Frames already buffered (the server may send more right behind its CSM).
            loop {
                match decode_tcp(rbuf, self.max_message_size) {
                    Ok(Some(m)) => {
                        if let Err(e) = self.on_message(i, m, &mut caps, &mut ping_sent, &mut wbuf)
                        {
                            return e;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = self.send_abort(io, None, "bad frame").await;
                        return ConnError::Decode(e);
                    }
                }
            }
            self.fill(i, &caps, &mut wbuf);
            if !wbuf.is_empty() {
                let written = async {
                    io.write_all(&wbuf).await?;
                    io.flush().await
                };
                // A path whose link stalls must not hold its task in a write forever.
                let written = if self.multipath() {
                    match tokio::time::timeout(self.cfg.path_timeout, written).await {
                        Ok(r) => r,
                        Err(_) => return ConnError::Stalled,
                    }
                } else {
                    written.await
                };
                if let Err(e) = written {
                    return ConnError::Io(e);
                }
                wbuf.clear();
            }
            let deadline = last_read + self.cfg.ping_interval;
            // With paths: requests outstanding and nothing read since they went out.
            let stall_at = (self.multipath() && !c.outstanding.borrow().is_empty()).then(|| {
                last_read.max(tokio::time::Instant::from_std(c.busy_since.get()))
                    + self.cfg.path_timeout
            });
            let ev = tokio::select! {
                r = io.read_buf(rbuf) => Ev::Read(r),
                _ = c.work.notified() => Ev::Work,
                _ = c.link.notified() => Ev::Link,
                _ = tokio::time::sleep_until(deadline) => Ev::Idle,
                _ = async {
                    match stall_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => Ev::Stall,
            };
            match ev {
                Ev::Read(Ok(0)) => return ConnError::Closed,
                Ev::Read(Err(e)) => return ConnError::Io(e),
                Ev::Read(Ok(_)) => {
                    last_read = tokio::time::Instant::now();
                    ping_sent = false;
                }
                Ev::Work | Ev::Link => {}
                Ev::Stall => return ConnError::Stalled,
                Ev::Idle if ping_sent => return ConnError::PingTimeout,
                Ev::Idle => {
                    encode_tcp(&tcp::ping(Token::EMPTY), &mut wbuf);
                    ping_sent = true;
                    last_read = tokio::time::Instant::now();
                }
            }
        }
    }

    /// One frame from the upstream on connection `i`.
    pub(super) fn on_message(
        &self,
        i: usize,
        m: Message,
        caps: &mut Capabilities,
        ping_sent: &mut bool,
        wbuf: &mut BytesMut,
    ) -> Result<(), ConnError> {
        match m.code {
            Code::PING => encode_tcp(&tcp::pong(&m), wbuf),
            Code::PONG => *ping_sent = false,
            Code::RELEASE => return Err(ConnError::Release),
            Code::ABORT => return Err(ConnError::Abort),
            Code::CSM => *caps = tcp::read_csm(&m, *caps).map_err(ConnError::BadCsm)?,
            c if c.is_response() => {
                let conn = &self.conns[i];
                let Some(p) = conn.take(&m.token) else {
                    // Answered after its 5.04, or not ours.
                    return Ok(());
                };
                self.gauges();
                let rtt = p.written_at.elapsed();
                let srtt = match conn.srtt.get() {
                    Some(s) => (s * 7 + rtt) / 8,
                    None => rtt,
                };
                conn.srtt.set(Some(srtt));
                if let Some(pm) = self.pm(i) {
                    pm.responses.inc();
                    pm.srtt_us.set(srtt.as_micros() as i64);
                }
                self.m().latency.observe(rtt);
                self.m().responses[c.class() as usize].inc();
                let mut res = m;
                res.remove_option(opt::OBSERVE);
                let _ = p.reply.send(res);
                // A slot freed: more may go out, here or on another path.
                self.kick();
            }
            _ => {} // empty (keep-alive), requests to the proxy, unknown signals: ignored
        }
        Ok(())
    }
}
