//! The agent over TCP: [`PhdAgent`] and the small APDU readers it needs.

use super::*;

// ---------------------------------------------------------------------------------------------
// The agent on a socket.

/// What one attempt to read the next APDU produced.
pub(super) enum Incoming {
    Apdu(Vec<u8>),
    Closed,
    TimedOut,
}

/// The agent's byte stream: plain TCP or TLS over it.
trait AgentStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> AgentStream for T {}

/// A PHD agent connected to a manager; see the module documentation for its behaviour.
pub struct PhdAgent {
    stream: Box<dyn AgentStream>,
    peer: SocketAddr,
    spec: AgentSpec,
    aarq_fields: AarqFields,
    read_buf: Vec<u8>,
    /// APDUs that arrived while the agent waited for something else, for `read_apdu`.
    inbox: VecDeque<Vec<u8>>,
    /// Set once the manager closed the connection (EOF or error), with the reason.
    closed: Option<String>,
    next_invoke_id: u16,
    next_report_no: u16,
    response_timeout: Duration,
    answer_gets: bool,
    /// MDS Date-and-Time reported in GET responses.
    clock: [u8; 8],
    gets_answered: u64,
    confirmations_received: u64,
    reports_sent: u64,
}

impl fmt::Debug for PhdAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhdAgent")
            .field("peer", &self.peer)
            .field("spec", &self.spec)
            .field("inbox", &self.inbox.len())
            .field("closed", &self.closed)
            .field("gets_answered", &self.gets_answered)
            .field("confirmations_received", &self.confirmations_received)
            .finish_non_exhaustive()
    }
}

impl PhdAgent {
    /// Open a TCP connection to the manager at `addr` (nothing is sent yet).
    pub async fn connect(addr: SocketAddr, spec: AgentSpec) -> anyhow::Result<PhdAgent> {
        let stream = Self::tcp(addr).await?;
        Ok(Self::with_stream(Box::new(stream), addr, spec))
    }

    /// Open a TCP connection to the manager at `addr` from the local address `bind_ip` (any
    /// port): an agent on another host, e.g. `127.0.0.2` (all of 127.0.0.0/8 is loopback on
    /// Linux). Nothing is sent yet.
    pub async fn connect_from(
        addr: SocketAddr,
        bind_ip: std::net::IpAddr,
        spec: AgentSpec,
    ) -> anyhow::Result<PhdAgent> {
        let socket = match bind_ip {
            std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .context("TCP socket")?;
        socket
            .bind(SocketAddr::new(bind_ip, 0))
            .with_context(|| format!("binding the agent's socket to {bind_ip}"))?;
        let deadline = Instant::now() + DEFAULT_TIMEOUT;
        let stream = timeout_at(deadline, socket.connect(addr))
            .await
            .map_err(|_| anyhow!("TCP connect to PHD manager {addr} timed out"))?
            .with_context(|| format!("TCP connect to PHD manager {addr} from {bind_ip}"))?;
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        Ok(Self::with_stream(Box::new(stream), addr, spec))
    }

    /// Open a TLS connection (over TCP) to the manager at `addr` with `tls` (e.g.
    /// [`crate::TestPki::rustls_client_config`], with or without a client certificate),
    /// verifying the server as `server_name`; the handshake completes before this returns.
    pub async fn connect_tls(
        addr: SocketAddr,
        spec: AgentSpec,
        tls: std::sync::Arc<rustls::ClientConfig>,
        server_name: &str,
    ) -> anyhow::Result<PhdAgent> {
        let stream = Self::tcp(addr).await?;
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
            .context("TLS server name")?;
        let deadline = Instant::now() + DEFAULT_TIMEOUT;
        let stream = timeout_at(
            deadline,
            tokio_rustls::TlsConnector::from(tls).connect(name, stream),
        )
        .await
        .map_err(|_| anyhow!("TLS handshake with PHD manager {addr} timed out"))?
        .with_context(|| format!("TLS handshake with PHD manager {addr}"))?;
        Ok(Self::with_stream(Box::new(stream), addr, spec))
    }

    async fn tcp(addr: SocketAddr) -> anyhow::Result<TcpStream> {
        let deadline = Instant::now() + DEFAULT_TIMEOUT;
        let stream = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("TCP connect to PHD manager {addr} timed out"))?
            .with_context(|| format!("TCP connect to PHD manager {addr}"))?;
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        Ok(stream)
    }

    fn with_stream(stream: Box<dyn AgentStream>, addr: SocketAddr, spec: AgentSpec) -> PhdAgent {
        PhdAgent {
            stream,
            peer: addr,
            aarq_fields: AarqFields::for_spec(&spec),
            spec,
            read_buf: Vec::with_capacity(4096),
            inbox: VecDeque::new(),
            closed: None,
            next_invoke_id: 1,
            next_report_no: 0,
            response_timeout: DEFAULT_TIMEOUT,
            answer_gets: true,
            clock: [0x20, 0x07, 0x02, 0x01, 0x12, 0x05, 0x00, 0x00],
            gets_answered: 0,
            confirmations_received: 0,
            reports_sent: 0,
        }
    }

    pub fn spec(&self) -> &AgentSpec {
        &self.spec
    }
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
    /// AARQ fields used by [`PhdAgent::associate`] (default [`AarqFields::for_spec`]).
    pub fn set_aarq_fields(&mut self, fields: AarqFields) {
        self.aarq_fields = fields;
    }
    /// The invoke id of the next invoke the agent sends (config report, confirmed or unconfirmed
    /// report; not the Antidote oximeter's fixed `0x1111`). Ids then count up, wrapping.
    pub fn set_next_invoke_id(&mut self, invoke_id: u16) {
        self.next_invoke_id = invoke_id;
    }
    /// The scan-report-no of the next report (default 0; counts up, wrapping).
    pub fn set_next_report_no(&mut self, report_no: u16) {
        self.next_report_no = report_no;
    }
    /// How long [`PhdAgent::associate`] and [`PhdAgent::release`] wait for each answer.
    pub fn set_response_timeout(&mut self, timeout: Duration) {
        self.response_timeout = timeout;
    }
    /// Whether GETs are answered automatically (default true). When false, they are returned by
    /// [`PhdAgent::read_apdu`] like anything else.
    pub fn set_answer_gets(&mut self, answer: bool) {
        self.answer_gets = answer;
    }
    /// The MDS Date-and-Time (BCD) reported in GET responses (default 2007-02-01 12:05, as C5).
    pub fn set_clock(&mut self, time: [u8; 8]) {
        self.clock = time;
    }
    /// GETs on the MDS (handle 0) answered so far.
    pub fn gets_answered(&self) -> u64 {
        self.gets_answered
    }
    /// Scan-report confirmations received so far.
    pub fn confirmations_received(&self) -> u64 {
        self.confirmations_received
    }
    /// Scan reports sent so far (confirmed or not).
    pub fn reports_sent(&self) -> u64 {
        self.reports_sent
    }

    /// AARQ → AARE. When the AARE says accepted-unknown-config (3), sends the config report
    /// (report id = the effective config id, the device's object table) and reads the
    /// ConfigReportRsp. A rejection is `Ok` with that result; `Err` means no AARE (or no
    /// ConfigReportRsp) arrived: close, ABRT, timeout, or something else in its place.
    pub async fn associate(&mut self) -> anyhow::Result<Association> {
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&aarq_with(&self.spec, &self.aarq_fields))
            .await
            .context("sending AARQ")?;
        let aare = self
            .wait_for("AARE", deadline, false, |apdu| {
                tag(apdu) == Some(apdu::AARE)
            })
            .await?;
        let aare_result =
            u16_at(&aare, 4).ok_or_else(|| anyhow!("manager sent an AARE without a result"))?;
        if aare_result != aare_result::ACCEPTED_UNKNOWN_CONFIG {
            return Ok(Association {
                aare_result,
                config_result: None,
            });
        }
        let invoke_id = self.allocate_invoke_id();
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&config_report(&self.spec, invoke_id))
            .await
            .context("sending the config report")?;
        let rsp = self
            .wait_for("ConfigReportRsp", deadline, false, |apdu| {
                answers(apdu, invoke_id)
            })
            .await?;
        let data =
            parse_data(&rsp).ok_or_else(|| anyhow!("malformed answer to the config report"))?;
        check_not_error(&data, "the config report")?;
        if data.choice != data_choice::RORS_CONFIRMED_EVENT_REPORT {
            bail!(
                "manager answered the config report with data choice {:#06x}",
                data.choice
            );
        }
        // EventReportResultSimple: obj-handle · currentTime · event-type · reply-info length ·
        // ConfigReportRsp { config-report-id, config-result }.
        let event = u16_at(data.body, 6);
        if event != Some(event_type::CONFIG) {
            bail!("manager's answer to the config report has event-type {event:?}, not 0x0D1C");
        }
        let config_result = u16_at(data.body, 12)
            .ok_or_else(|| anyhow!("manager's ConfigReportRsp is too short"))?;
        Ok(Association {
            aare_result,
            config_result: Some(config_result),
        })
    }

    /// One fixed-format scan report (MDC_NOTI_SCAN_REPORT_FIXED) with `time` as the absolute
    /// time stamp where the device's value map has one. Confirmed: waits for the confirmation
    /// (rors-cmip-confirmed-event-report, same invoke id) up to `timeout` (at most 3 s with
    /// Antidote quirks) and returns how long it took; unconfirmed: returns `None`.
    pub async fn report(
        &mut self,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::Fixed, reading, time, timeout)
            .await
    }

    /// Variable-format report (MDC_NOTI_SCAN_REPORT_VAR) of the same reading; as
    /// [`PhdAgent::report`].
    pub async fn report_var(
        &mut self,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::Var, reading, time, timeout)
            .await
    }

    /// Multi-person fixed report (MDC_NOTI_SCAN_REPORT_MP_FIXED) for `person_id`; as
    /// [`PhdAgent::report`].
    pub async fn report_mp_fixed(
        &mut self,
        person_id: u16,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        self.send_report(ScanForm::MpFixed { person_id }, reading, time, timeout)
            .await
    }

    /// Any report form; what the `report*` methods share.
    pub async fn send_report(
        &mut self,
        form: ScanForm,
        reading: &Reading,
        time: [u8; 8],
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        if reading.device() != self.spec.device {
            bail!(
                "a {:?} agent cannot report a {:?} reading (use send_raw with scan_report for that)",
                self.spec.device,
                reading.device()
            );
        }
        reading.check()?;
        let invoke_id = if self.spec.antidote_quirks && self.spec.device == PhdDevice::PulseOximeter
        {
            ANTIDOTE_OXIMETER_INVOKE_ID
        } else {
            self.allocate_invoke_id()
        };
        let report_no = self.next_report_no;
        self.next_report_no = self.next_report_no.wrapping_add(1);
        let bytes = scan_report(
            &self.spec,
            form,
            &ReportHeader::new(invoke_id, report_no),
            reading,
            time,
        );
        let started = Instant::now();
        self.send_raw(&bytes)
            .await
            .context("sending a scan report")?;
        self.reports_sent += 1;
        if !self.spec.sends_confirmed() {
            return Ok(None);
        }
        let timeout = if self.spec.antidote_quirks {
            timeout.min(ANTIDOTE_CONFIRM_TIMEOUT)
        } else {
            timeout
        };
        let waited = self
            .wait_for(
                "scan report confirmation",
                started + timeout,
                false,
                |apdu| answers(apdu, invoke_id),
            )
            .await;
        let answer = match waited {
            Ok(answer) => answer,
            Err(e) if self.closed.is_none() && e.is::<NoAnswer>() => {
                let reason = if self.spec.antidote_quirks {
                    reason::ABORT_UNDEFINED
                } else {
                    reason::ABORT_RESPONSE_TIMEOUT
                };
                // Best effort: the error that matters is the missing confirmation.
                let _ = self.send_raw(&abrt(reason)).await;
                return Err(e.context(format!("agent sent ABRT (reason {reason})")));
            }
            Err(e) => return Err(e),
        };
        let elapsed = started.elapsed();
        let data =
            parse_data(&answer).ok_or_else(|| anyhow!("malformed answer to a scan report"))?;
        check_not_error(&data, "a scan report")?;
        if data.choice != data_choice::RORS_CONFIRMED_EVENT_REPORT {
            bail!(
                "manager answered scan report {invoke_id:#06x} with data choice {:#06x}",
                data.choice
            );
        }
        self.confirmations_received += 1;
        Ok(Some(elapsed))
    }

    /// RLRQ (reason normal) → waits for RLRE; returns its reason. An RLRQ from the manager that
    /// crosses ours is answered with RLRE and the wait for the manager's RLRE goes on.
    pub async fn release(&mut self) -> anyhow::Result<u16> {
        let deadline = Instant::now() + self.response_timeout;
        self.send_raw(&rlrq(reason::RELEASE_NORMAL))
            .await
            .context("sending RLRQ")?;
        let rlre = self
            .wait_for("RLRE", deadline, true, |apdu| tag(apdu) == Some(apdu::RLRE))
            .await?;
        u16_at(&rlre, 4).ok_or_else(|| anyhow!("manager sent an RLRE without a reason"))
    }

    /// Send ABRT with `reason` (no answer expected).
    pub async fn abort(&mut self, reason: u16) -> anyhow::Result<()> {
        self.send_raw(&abrt(reason)).await.context("sending ABRT")
    }

    /// Write `bytes` as they are (any framing, any garbage).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.response_timeout;
        timeout_at(deadline, async {
            self.stream.write_all(bytes).await?;
            self.stream.flush().await
        })
        .await
        .map_err(|_| anyhow!("writing to PHD manager {} timed out", self.peer))?
        .with_context(|| format!("writing to PHD manager {}", self.peer))
    }

    /// Next whole APDU from the manager (header + body), or `None` on EOF, within `timeout`
    /// (`Err` when none arrives in time). APDUs kept while the agent waited for something else
    /// come first. GETs are answered and not returned (see [`PhdAgent::set_answer_gets`]).
    pub async fn read_apdu(&mut self, timeout: Duration) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(apdu) = self.inbox.pop_front() {
            return Ok(Some(apdu));
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.read_next(deadline).await? {
                Incoming::Apdu(apdu) => {
                    if !self.answered_get(&apdu).await? {
                        return Ok(Some(apdu));
                    }
                }
                Incoming::Closed => return Ok(None),
                Incoming::TimedOut => {
                    bail!("no APDU from PHD manager {} within {timeout:?}", self.peer)
                }
            }
        }
    }

    /// Whether the connection is known closed by the manager, and why.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    fn allocate_invoke_id(&mut self) -> u16 {
        let id = self.next_invoke_id;
        self.next_invoke_id = self.next_invoke_id.wrapping_add(1);
        id
    }

    /// Wait until `deadline` for an APDU `wanted` accepts (looking in the inbox first), keeping
    /// others for `read_apdu`. ABRT fails the wait; RLRQ is answered with RLRE and fails it
    /// unless `rlrq_completes` (a release collision), in which case waiting goes on.
    async fn wait_for(
        &mut self,
        what: &str,
        deadline: Instant,
        rlrq_completes: bool,
        wanted: impl Fn(&[u8]) -> bool,
    ) -> anyhow::Result<Vec<u8>> {
        if let Some(at) = self.inbox.iter().position(|apdu| wanted(apdu)) {
            if let Some(apdu) = self.inbox.remove(at) {
                return Ok(apdu);
            }
        }
        loop {
            let apdu = match self.read_next(deadline).await? {
                Incoming::Apdu(apdu) => apdu,
                Incoming::Closed => bail!(
                    "PHD manager {} closed the connection while the agent waited for {what} ({})",
                    self.peer,
                    self.closed.as_deref().unwrap_or("end of stream")
                ),
                Incoming::TimedOut => return Err(anyhow!(NoAnswer(what.to_string()))),
            };
            if wanted(&apdu) {
                return Ok(apdu);
            }
            if self.answered_get(&apdu).await? {
                continue;
            }
            match tag(&apdu) {
                Some(apdu::ABRT) => bail!(
                    "PHD manager aborted (ABRT reason {:?}) while the agent waited for {what}",
                    u16_at(&apdu, 4)
                ),
                Some(apdu::RLRQ) => {
                    self.send_raw(&rlre(reason::RELEASE_NORMAL))
                        .await
                        .context("answering the manager's RLRQ")?;
                    if !rlrq_completes {
                        bail!(
                            "PHD manager released (RLRQ reason {:?}, answered) while the agent waited for {what}",
                            u16_at(&apdu, 4)
                        );
                    }
                }
                _ => {
                    if self.inbox.len() >= MAX_INBOX {
                        bail!("{MAX_INBOX} unread APDUs while waiting for {what}; drain them with read_apdu");
                    }
                    self.inbox.push_back(apdu);
                }
            }
        }
    }

    /// If `apdu` is a GET and GETs are answered, answer it and return true.
    async fn answered_get(&mut self, apdu: &[u8]) -> anyhow::Result<bool> {
        if !self.answer_gets {
            return Ok(false);
        }
        let Some(data) = parse_data(apdu) else {
            return Ok(false);
        };
        if data.choice != data_choice::ROIV_GET {
            return Ok(false);
        }
        let Some(handle) = u16_at(data.body, 0) else {
            return Ok(false);
        };
        let answer = if handle == 0 {
            let ids = attribute_ids(&data.body[2..]);
            mds_get_response_filtered(&self.spec, data.invoke_id, &ids, self.clock)
        } else {
            roer(data.invoke_id, ROER_NO_SUCH_OBJECT_INSTANCE)
        };
        self.send_raw(&answer).await.context("answering a GET")?;
        if handle == 0 {
            self.gets_answered += 1;
        }
        Ok(true)
    }

    /// The next whole APDU, reading from the socket as needed until `deadline`.
    async fn read_next(&mut self, deadline: Instant) -> anyhow::Result<Incoming> {
        loop {
            if self.read_buf.len() >= 4 {
                let total =
                    usize::from(u16::from_be_bytes([self.read_buf[2], self.read_buf[3]])) + 4;
                if self.read_buf.len() >= total {
                    let rest = self.read_buf.split_off(total);
                    let apdu = std::mem::replace(&mut self.read_buf, rest);
                    return Ok(Incoming::Apdu(apdu));
                }
            }
            if self.closed.is_some() {
                if !self.read_buf.is_empty() {
                    bail!(
                        "PHD manager {} closed the connection inside an APDU ({} bytes pending)",
                        self.peer,
                        self.read_buf.len()
                    );
                }
                return Ok(Incoming::Closed);
            }
            let mut chunk = [0u8; 4096];
            match timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return Ok(Incoming::TimedOut),
                Ok(Ok(0)) => self.closed = Some("end of stream".to_string()),
                Ok(Ok(n)) => self.read_buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => self.closed = Some(e.to_string()),
            }
        }
    }
}

/// A wait that ended because its deadline passed.
#[derive(Debug)]
pub(super) struct NoAnswer(String);

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no {} from the PHD manager in time", self.0)
    }
}

impl std::error::Error for NoAnswer {}

// ---------------------------------------------------------------------------------------------
// Reading what the manager sends (only the fields the agent needs; every access is checked).

pub(super) fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    let pair = bytes.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([pair[0], pair[1]]))
}

pub(super) fn tag(apdu: &[u8]) -> Option<u16> {
    u16_at(apdu, 0)
}

/// The Data APDU inside a PRST.
pub(super) struct DataApdu<'a> {
    invoke_id: u16,
    choice: u16,
    /// The message body, bounded by its own length field.
    body: &'a [u8],
}

pub(super) fn parse_data(apdu: &[u8]) -> Option<DataApdu<'_>> {
    if tag(apdu)? != apdu::PRST {
        return None;
    }
    let invoke_id = u16_at(apdu, 6)?;
    let choice = u16_at(apdu, 8)?;
    let len = usize::from(u16_at(apdu, 10)?);
    let body = apdu.get(12..12 + len)?;
    Some(DataApdu {
        invoke_id,
        choice,
        body,
    })
}

/// Whether `apdu` is a response (rors, roer, rorj) to invoke `invoke_id`.
pub(super) fn answers(apdu: &[u8], invoke_id: u16) -> bool {
    parse_data(apdu)
        .is_some_and(|data| data.invoke_id == invoke_id && matches!(data.choice >> 8, 0x02..=0x04))
}

pub(super) fn check_not_error(data: &DataApdu<'_>, what: &str) -> anyhow::Result<()> {
    match data.choice {
        data_choice::ROER => bail!(
            "manager answered {what} with ROER error-value {:?}",
            u16_at(data.body, 0)
        ),
        data_choice::RORJ => bail!(
            "manager answered {what} with RORJ problem {:?}",
            u16_at(data.body, 0)
        ),
        _ => Ok(()),
    }
}

/// The ids of a GET's attribute-id-list (count · length · ids); malformed → empty (= all).
pub(super) fn attribute_ids(list: &[u8]) -> Vec<u16> {
    let (Some(count), Some(len)) = (u16_at(list, 0), u16_at(list, 2)) else {
        return Vec::new();
    };
    let Some(ids) = list.get(4..4 + usize::from(len)) else {
        return Vec::new();
    };
    ids.chunks_exact(2)
        .take(usize::from(count))
        .map(|pair| u16::from_be_bytes([pair[0], pair[1]]))
        .collect()
}
