//! `[limits]`: how fast devices may connect and publish (ADR 0008).
//!
//! Owns: the token bucket, the connection limits the device listener asks at accept (per
//! source address and whole gateway, [`ConnectLimits::admit_source`]) and at CONNECT
//! (flapping client ids, [`ConnectLimits::admit_client`]), the per-device publish rate an MQTT
//! connection keeps ([`PublishRate`]), the CoAP edge's per-device table of them
//! ([`DeviceRates`], one per shard and CoAP edge: CoAP has no connection to keep them), and
//! their metrics (`sluice_limits_*`) and rate-limited log lines. Does not own: acting on a refusal (the listener closes the socket or answers
//! CONNACK 0x9F / 3.1.1 0x03; the connection drops a QoS 0 message or stops reading).
//!
//! Invariants: every table is bounded in bytes (`connect_sources_memory`, `flap_memory`,
//! `coap_rates_memory`; each entry charged [`SOURCE_ENTRY_BYTES`] / [`FLAP_ENTRY_BYTES`] /
//! [`RATE_ENTRY_BYTES`] + its id), never in entries alone. A full table is swept of entries that no longer matter (a source whose
//! bucket is full again, an id whose window ended and that is not held) at most every
//! [`SWEEP_EVERY`]; while it stays full, new sources meet only the global bucket and new ids
//! are not tracked (counted, `table_full`). IPv6 sources are keyed by their /64, since one
//! host usually holds the whole prefix. The tables live on the listener thread (one lock,
//! never held across an await; uncontended).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::LimitsConfig;
use crate::telemetry::metrics::{Counter, PromWriter};

/// A token bucket: `rate` tokens a second, at most `burst` saved. Tokens may go below zero
/// (debt) so a message larger than the burst still passes once, then waits.
#[derive(Debug, Clone, Copy)]
pub struct TokenBucket {
    tokens: f64,
    rate: f64,
    burst: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: f64, burst: f64, now: Instant) -> TokenBucket {
        TokenBucket {
            tokens: burst,
            rate,
            burst,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = now;
    }

    /// Take `n` if there are that many.
    pub fn try_take(&mut self, n: f64, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }

    /// Take `n` whatever is left; how long until the bucket is out of debt.
    pub fn take(&mut self, n: f64, now: Instant) -> Duration {
        self.refill(now);
        self.tokens -= n;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }

    /// Full again (as if never used) at `now`.
    fn is_full(&self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens + dt * self.rate >= self.burst
    }
}

/// Bytes charged per per-source entry: the key, the bucket and the map's own slot.
pub const SOURCE_ENTRY_BYTES: usize = 96;
/// Bytes charged per flapping entry besides the client id's length.
pub const FLAP_ENTRY_BYTES: usize = 96;
/// A full table is swept at most this often.
pub const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// Bytes charged per CoAP device-rate entry besides its id: the key, the boxed buckets
/// (two 32 B buckets and the box) and the map's own slot.
pub const RATE_ENTRY_BYTES: usize = 160;
/// Log lines of one kind at most this often.
const LOG_EVERY: Duration = Duration::from_secs(1);

/// Why a connection was refused or a message dropped (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// `connect_rate_per_source`: socket closed at accept.
    SourceRate = 0,
    /// `connect_rate`: socket closed at accept.
    GlobalRate = 1,
    /// `flap_connects`: CONNACK 0x9F / 0x03.
    Flapping = 2,
    /// `publish_rate`/`publish_bytes_rate`, QoS 0: dropped.
    PublishDropped = 3,
    /// `publish_rate`/`publish_bytes_rate`, QoS 1/2: the device's reads paused.
    PublishThrottled = 4,
}

const LIMITED: [(Limited, &str, &str); 5] = [
    (
        Limited::SourceRate,
        "sluice_limits_connections_refused_total",
        "source_rate",
    ),
    (
        Limited::GlobalRate,
        "sluice_limits_connections_refused_total",
        "global_rate",
    ),
    (
        Limited::Flapping,
        "sluice_limits_connections_refused_total",
        "flapping",
    ),
    (
        Limited::PublishDropped,
        "sluice_limits_publish_dropped_total",
        "rate",
    ),
    (
        Limited::PublishThrottled,
        "sluice_limits_publish_throttled_total",
        "rate",
    ),
];

/// `sluice_limits_*`.
#[derive(Debug, Default)]
pub struct LimitsMetrics {
    counts: [Counter; 5],
    /// Tables full: a source, client id or CoAP device not tracked.
    pub table_full: [Counter; 3],
    logged_ms: [AtomicU64; 5],
    started: std::sync::OnceLock<Instant>,
}

impl LimitsMetrics {
    pub fn get(&self, what: Limited) -> u64 {
        self.counts[what as usize].get()
    }

    /// Count one; log it, naming the device or address, at most once a second per kind.
    pub fn hit(&self, what: Limited, who: &dyn std::fmt::Display) {
        let c = &self.counts[what as usize];
        c.inc();
        let started = *self.started.get_or_init(Instant::now);
        let now = u64::try_from(started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let slot = &self.logged_ms[what as usize];
        let last = slot.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64)
            && slot
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let (_, _, reason) = LIMITED[what as usize];
            tracing::warn!(
                reason,
                device = %who,
                total = c.get(),
                "over a [limits] rate (more within a second are only counted)"
            );
        }
    }

    pub fn render(&self, w: &mut PromWriter) {
        for (what, name, reason) in LIMITED {
            let help = match what {
                Limited::SourceRate | Limited::GlobalRate | Limited::Flapping => {
                    "MQTT connections refused by [limits], by reason (source_rate and global_rate: closed at accept; flapping: CONNACK 0x9F / 0x03)"
                }
                Limited::PublishDropped => "Messages dropped over a device's [limits] publish rate (MQTT QoS 0; CoAP NON, answered 5.03)",
                Limited::PublishThrottled => {
                    "Times a device was held back for its [limits] publish rate (MQTT QoS 1/2: reads paused; CoAP CON: answered 5.03 with Max-Age, not accepted)"
                }
            };
            w.counter(name, help, &[("reason", reason)], self.get(what));
        }
        for (i, table) in ["sources", "flapping", "coap_devices"]
            .into_iter()
            .enumerate()
        {
            w.counter(
                "sluice_limits_table_full_total",
                "New sources, client ids or CoAP devices not tracked because their [limits] table was full",
                &[("table", table)],
                self.table_full[i].get(),
            );
        }
    }
}

#[derive(Debug)]
struct Flap {
    window_start: Instant,
    count: u32,
    held_until: Option<Instant>,
}

#[derive(Debug)]
struct Tables {
    global: Option<TokenBucket>,
    sources: HashMap<IpAddr, TokenBucket>,
    sources_swept: Option<Instant>,
    flaps: HashMap<Box<str>, Flap>,
    flaps_bytes: usize,
    flaps_swept: Option<Instant>,
}

/// The listener's connection limits.
#[derive(Debug)]
pub struct ConnectLimits {
    /// Replaced by a reload ([`ConnectLimits::reconfigure`]).
    cfg: arc_swap::ArcSwap<LimitsConfig>,
    tables: Mutex<Tables>,
    pub metrics: Arc<LimitsMetrics>,
}

/// The table key of a source: the address, or an IPv6 address's /64.
fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        IpAddr::V6(v6) => IpAddr::V4(
            v6.to_ipv4_mapped()
                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED),
        ),
        v4 => v4,
    }
}

impl ConnectLimits {
    pub fn new(cfg: &LimitsConfig, metrics: Arc<LimitsMetrics>) -> ConnectLimits {
        let now = Instant::now();
        ConnectLimits {
            cfg: arc_swap::ArcSwap::from_pointee(cfg.clone()),
            tables: Mutex::new(Tables {
                global: global_bucket(cfg, now),
                sources: HashMap::new(),
                sources_swept: None,
                flaps: HashMap::new(),
                flaps_bytes: 0,
                flaps_swept: None,
            }),
            metrics,
        }
    }

    /// Apply another `[limits]` (a reload). The global bucket starts full at the new rate;
    /// when the per-source or flapping settings changed, their table is emptied (every
    /// source and client id starts afresh, a held one released).
    pub fn reconfigure(&self, cfg: &LimitsConfig) {
        let old = self.cfg.swap(Arc::new(cfg.clone()));
        let Ok(mut t) = self.tables.lock() else {
            return;
        };
        let now = Instant::now();
        if (old.connect_rate, old.connect_burst) != (cfg.connect_rate, cfg.connect_burst) {
            t.global = global_bucket(cfg, now);
        }
        if (
            old.connect_rate_per_source,
            old.connect_burst_per_source,
            old.connect_sources_memory,
        ) != (
            cfg.connect_rate_per_source,
            cfg.connect_burst_per_source,
            cfg.connect_sources_memory,
        ) {
            t.sources = HashMap::new();
        }
        if (
            old.flap_connects,
            old.flap_window,
            old.flap_hold,
            old.flap_memory,
        ) != (
            cfg.flap_connects,
            cfg.flap_window,
            cfg.flap_hold,
            cfg.flap_memory,
        ) {
            t.flaps = HashMap::new();
            t.flaps_bytes = 0;
        }
    }

    /// At accept: may a new connection from `peer` go on? Counted and logged when not.
    pub fn admit_source(&self, peer: std::net::SocketAddr) -> bool {
        let cfg = self.cfg.load();
        let now = Instant::now();
        let Ok(mut t) = self.tables.lock() else {
            return true;
        };
        let t = &mut *t;
        if cfg.connect_rate_per_source > 0 {
            let key = source_key(peer.ip());
            let cap = (cfg.connect_sources_memory.as_usize() / SOURCE_ENTRY_BYTES).max(1);
            if !t.sources.contains_key(&key)
                && t.sources.len() >= cap
                && t.sources_swept
                    .is_none_or(|s| now.duration_since(s) >= SWEEP_EVERY)
            {
                t.sources.retain(|_, b| !b.is_full(now));
                t.sources_swept = Some(now);
            }
            if t.sources.contains_key(&key) || t.sources.len() < cap {
                let (rate, burst) = (
                    cfg.connect_rate_per_source as f64,
                    cfg.connect_burst_per_source as f64,
                );
                let b = t
                    .sources
                    .entry(key)
                    .or_insert_with(|| TokenBucket::new(rate, burst, now));
                if !b.try_take(1.0, now) {
                    self.metrics.hit(Limited::SourceRate, &peer.ip());
                    return false;
                }
            } else {
                self.metrics.table_full[0].inc();
            }
        }
        if let Some(g) = t.global.as_mut() {
            if !g.try_take(1.0, now) {
                self.metrics.hit(Limited::GlobalRate, &peer.ip());
                return false;
            }
        }
        true
    }

    /// At CONNECT: is this client id flapping (more than `flap_connects` CONNECTs within
    /// `flap_window`)? Then it is refused until `flap_hold` has passed.
    pub fn admit_client(&self, client_id: &str) -> bool {
        let cfg = self.cfg.load();
        let n = cfg.flap_connects;
        if n == 0 || client_id.is_empty() {
            return true;
        }
        let now = Instant::now();
        let Ok(mut t) = self.tables.lock() else {
            return true;
        };
        let t = &mut *t;
        let (window, hold) = (cfg.flap_window, cfg.flap_hold);
        let cost = FLAP_ENTRY_BYTES + client_id.len();
        let max = cfg.flap_memory.as_usize();
        if !t.flaps.contains_key(client_id) && t.flaps_bytes + cost > max {
            if t.flaps_swept
                .is_none_or(|s| now.duration_since(s) >= SWEEP_EVERY)
            {
                let mut freed = 0;
                t.flaps.retain(|k, f| {
                    let keep = f.held_until.is_some_and(|h| h > now)
                        || now.duration_since(f.window_start) < window;
                    if !keep {
                        freed += FLAP_ENTRY_BYTES + k.len();
                    }
                    keep
                });
                t.flaps_bytes -= freed;
                t.flaps_swept = Some(now);
            }
            if t.flaps_bytes + cost > max {
                self.metrics.table_full[1].inc();
                return true;
            }
        }
        let f = t.flaps.entry(client_id.into()).or_insert_with(|| Flap {
            window_start: now,
            count: 0,
            held_until: None,
        });
        if f.count == 0 && f.held_until.is_none() {
            t.flaps_bytes += cost;
        }
        if let Some(until) = f.held_until {
            if now < until {
                self.metrics.hit(Limited::Flapping, &client_id);
                return false;
            }
            f.held_until = None;
            f.window_start = now;
            f.count = 0;
        }
        if now.duration_since(f.window_start) >= window {
            f.window_start = now;
            f.count = 0;
        }
        f.count = f.count.saturating_add(1);
        if f.count > n {
            f.held_until = Some(now + hold);
            self.metrics.hit(Limited::Flapping, &client_id);
            return false;
        }
        true
    }
}

/// The whole-gateway bucket (`connect_rate`), full; `None` when off.
fn global_bucket(cfg: &LimitsConfig, now: Instant) -> Option<TokenBucket> {
    (cfg.connect_rate > 0)
        .then(|| TokenBucket::new(cfg.connect_rate as f64, cfg.connect_burst as f64, now))
}

/// A device's publish rate (`publish_rate`, `publish_bytes_rate`), kept by its connection.
#[derive(Debug)]
pub struct PublishRate {
    messages: Option<TokenBucket>,
    bytes: Option<TokenBucket>,
}

impl PublishRate {
    /// `None` when neither rate is set (the connection then keeps nothing).
    pub fn new(cfg: &LimitsConfig, max_packet: u64) -> Option<Box<PublishRate>> {
        let now = Instant::now();
        let messages = (cfg.publish_rate > 0).then(|| {
            TokenBucket::new(
                cfg.publish_rate as f64,
                cfg.publish_burst.max(1) as f64,
                now,
            )
        });
        let bytes = (cfg.publish_bytes_rate.0 > 0).then(|| {
            let burst = cfg.publish_bytes_burst.0.max(max_packet).max(1);
            TokenBucket::new(cfg.publish_bytes_rate.0 as f64, burst as f64, now)
        });
        (messages.is_some() || bytes.is_some()).then(|| Box::new(PublishRate { messages, bytes }))
    }

    /// QoS 0: may a message of `len` bytes go now? (Nothing taken when not.)
    pub fn try_send(&mut self, len: usize, now: Instant) -> bool {
        let m_ok = self.messages.as_mut().is_none_or(|b| {
            b.refill(now);
            b.tokens >= 1.0
        });
        let b_ok = self.bytes.as_mut().is_none_or(|b| {
            b.refill(now);
            b.tokens >= len as f64 || b.tokens >= b.burst
        });
        if !(m_ok && b_ok) {
            return false;
        }
        if let Some(b) = self.messages.as_mut() {
            b.take(1.0, now);
        }
        if let Some(b) = self.bytes.as_mut() {
            b.take(len as f64, now);
        }
        true
    }

    /// May a message of `len` bytes go now? If so its tokens are taken; if not, nothing is
    /// taken and the answer is how long until it could (CoAP: the 5.03's Max-Age).
    pub fn try_send_or_wait(&mut self, len: usize, now: Instant) -> Result<(), Duration> {
        if self.try_send(len, now) {
            return Ok(());
        }
        let short = |b: &TokenBucket, need: f64| {
            Duration::from_secs_f64(((need - b.tokens) / b.rate).max(0.0))
        };
        let m = self
            .messages
            .as_ref()
            .map_or(Duration::ZERO, |b| short(b, 1.0));
        let b = self
            .bytes
            .as_ref()
            .map_or(Duration::ZERO, |b| short(b, (len as f64).min(b.burst)));
        Err(m.max(b))
    }

    /// Both buckets full again at `now` (the entry can be forgotten).
    fn is_full(&self, now: Instant) -> bool {
        self.messages.as_ref().is_none_or(|b| b.is_full(now))
            && self.bytes.as_ref().is_none_or(|b| b.is_full(now))
    }

    /// QoS 1/2: take the message's tokens; how long to stop reading the device.
    pub fn send(&mut self, len: usize, now: Instant) -> Duration {
        let m = self
            .messages
            .as_mut()
            .map_or(Duration::ZERO, |b| b.take(1.0, now));
        let b = self
            .bytes
            .as_mut()
            .map_or(Duration::ZERO, |b| b.take(len as f64, now));
        m.max(b)
    }
}

/// Whose publish rate a CoAP request is charged to (ADR 0008, "CoAP devices"): a DTLS
/// device by its authenticated identity; a plain CoAP device by its source address (IPv6:
/// its /64), the one thing it cannot change at will (its `c=` id and its port are free).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RateKey {
    Identity(bytestring::ByteString),
    Address(IpAddr),
}

impl RateKey {
    /// The key of a plain CoAP request from `ip`.
    pub fn address(ip: IpAddr) -> RateKey {
        RateKey::Address(source_key(ip))
    }

    fn cost(&self) -> usize {
        RATE_ENTRY_BYTES
            + match self {
                RateKey::Identity(id) => id.len(),
                RateKey::Address(_) => 0,
            }
    }
}

/// The publish rates of the CoAP devices seen by one shard's CoAP edge, at most
/// `max_bytes` of entries. Full, it is swept (at most every [`SWEEP_EVERY`]) of devices whose
/// buckets are full again; if it stays full a new device is not tracked (it meets no rate,
/// counted in `table_full{table="coap_devices"}`), as the other `[limits]` tables do.
#[derive(Debug)]
pub struct DeviceRates {
    cfg: LimitsConfig,
    max_packet: u64,
    entries: HashMap<RateKey, Box<PublishRate>>,
    bytes: usize,
    max_bytes: usize,
    swept: Option<Instant>,
    metrics: Arc<LimitsMetrics>,
}

impl DeviceRates {
    /// `None` when no publish rate is set (then nothing is kept). `max_packet`: the largest
    /// publish, which the bytes bucket always lets through once.
    pub fn new(
        cfg: &LimitsConfig,
        max_packet: u64,
        max_bytes: usize,
        metrics: Arc<LimitsMetrics>,
    ) -> Option<DeviceRates> {
        PublishRate::new(cfg, max_packet)?;
        Some(DeviceRates {
            cfg: cfg.clone(),
            max_packet,
            entries: HashMap::new(),
            bytes: 0,
            max_bytes,
            swept: None,
            metrics,
        })
    }

    /// May `key`'s publish of `len` bytes go now? `Err(wait)`: not taken; the caller answers
    /// 5.03 with Max-Age `wait` and counts it (`confirmable`: throttled, else dropped), and
    /// this logs it (at most once a second per kind) naming `who`.
    pub fn admit(
        &mut self,
        key: &RateKey,
        len: usize,
        confirmable: bool,
        who: &dyn std::fmt::Display,
    ) -> Result<(), Duration> {
        let now = Instant::now();
        if !self.entries.contains_key(key) {
            let cost = key.cost();
            if self.bytes + cost > self.max_bytes {
                if self
                    .swept
                    .is_none_or(|s| now.duration_since(s) >= SWEEP_EVERY)
                {
                    let mut freed = 0;
                    self.entries.retain(|k, r| {
                        let keep = !r.is_full(now);
                        if !keep {
                            freed += k.cost();
                        }
                        keep
                    });
                    self.bytes -= freed;
                    self.swept = Some(now);
                }
                if self.bytes + cost > self.max_bytes {
                    self.metrics.table_full[2].inc();
                    return Ok(());
                }
            }
            let Some(rate) = PublishRate::new(&self.cfg, self.max_packet) else {
                return Ok(());
            };
            self.bytes += cost;
            self.entries.insert(key.clone(), rate);
        }
        let Some(rate) = self.entries.get_mut(key) else {
            return Ok(());
        };
        rate.try_send_or_wait(len, now).inspect_err(|_| {
            let what = if confirmable {
                Limited::PublishThrottled
            } else {
                Limited::PublishDropped
            };
            self.metrics.hit(what, who);
        })
    }

    /// Devices tracked and the bytes charged for them.
    pub fn usage(&self) -> (usize, usize) {
        (self.entries.len(), self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;

    fn cfg() -> LimitsConfig {
        LimitsConfig {
            connect_rate_per_source: 2,
            connect_burst_per_source: 2,
            connect_rate: 0,
            flap_connects: 3,
            ..LimitsConfig::default()
        }
    }

    #[test]
    fn a_source_over_its_burst_is_refused_and_another_is_not() {
        let l = ConnectLimits::new(&cfg(), Arc::default());
        let a: std::net::SocketAddr = "10.0.0.1:1000".parse().unwrap();
        let b: std::net::SocketAddr = "10.0.0.2:1000".parse().unwrap();
        assert!(l.admit_source(a));
        assert!(l.admit_source(a));
        assert!(!l.admit_source(a));
        assert!(l.admit_source(b));
        assert_eq!(l.metrics.get(Limited::SourceRate), 1);
    }

    #[test]
    fn a_reconfigured_rate_applies_to_the_next_connection() {
        let l = ConnectLimits::new(&cfg(), Arc::default());
        let a: std::net::SocketAddr = "10.0.0.1:1000".parse().unwrap();
        assert!(l.admit_source(a));
        assert!(l.admit_source(a));
        assert!(!l.admit_source(a), "over the burst of 2");
        let mut more = cfg();
        more.connect_burst_per_source = 5;
        l.reconfigure(&more);
        for _ in 0..5 {
            assert!(l.admit_source(a), "a fresh bucket of 5");
        }
        assert!(!l.admit_source(a));
        let mut off = more.clone();
        off.connect_rate_per_source = 0;
        l.reconfigure(&off);
        assert!(l.admit_source(a), "the per-source rate is off");
    }

    #[test]
    fn ipv6_sources_share_their_slash_64() {
        let l = ConnectLimits::new(&cfg(), Arc::default());
        for host in ["[2001:db8::1]:1", "[2001:db8::2]:1"] {
            assert!(l.admit_source(host.parse().unwrap()));
        }
        assert!(!l.admit_source("[2001:db8::3]:1".parse().unwrap()));
        assert!(l.admit_source("[2001:db8:0:1::3]:1".parse().unwrap()));
    }

    #[test]
    fn the_source_table_stays_within_its_bytes() {
        let mut c = cfg();
        c.connect_sources_memory = ByteSize::b(10 * SOURCE_ENTRY_BYTES as u64);
        let l = ConnectLimits::new(&c, Arc::default());
        for i in 0..100u32 {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i);
            l.admit_source(std::net::SocketAddr::new(ip.into(), 1));
        }
        assert!(l.tables.lock().unwrap().sources.len() <= 10);
        assert!(l.metrics.table_full[0].get() > 0);
    }

    #[test]
    fn a_flapping_client_id_is_held_and_others_are_not() {
        let l = ConnectLimits::new(&cfg(), Arc::default());
        for _ in 0..3 {
            assert!(l.admit_client("flappy"));
        }
        assert!(!l.admit_client("flappy"), "fourth within the window");
        assert!(!l.admit_client("flappy"), "held");
        assert!(l.admit_client("calm"));
        assert!(l.admit_client(""), "assigned ids are not tracked");
        assert_eq!(l.metrics.get(Limited::Flapping), 2);
    }

    #[test]
    fn the_flap_table_stays_within_its_bytes() {
        let mut c = cfg();
        c.flap_memory = ByteSize::b(10 * (FLAP_ENTRY_BYTES as u64 + 8));
        let l = ConnectLimits::new(&c, Arc::default());
        for i in 0..100 {
            assert!(l.admit_client(&format!("id-{i:05}")));
        }
        let t = l.tables.lock().unwrap();
        assert!(t.flaps_bytes <= c.flap_memory.as_usize());
        assert!(t.flaps.len() <= 10);
    }

    #[test]
    fn publish_rate_drops_qos0_and_delays_qos1_beyond_the_burst() {
        let c = LimitsConfig {
            publish_rate: 10,
            publish_burst: 2,
            ..LimitsConfig::default()
        };
        let mut r = PublishRate::new(&c, 1024).unwrap();
        let now = Instant::now();
        assert!(r.try_send(10, now));
        assert!(r.try_send(10, now));
        assert!(!r.try_send(10, now));
        let wait = r.send(10, now);
        assert!(
            wait > Duration::from_millis(50) && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        assert!(
            PublishRate::new(&LimitsConfig::default(), 1024).is_none(),
            "off by default"
        );
    }

    #[test]
    fn a_coap_device_over_its_rate_waits_and_the_table_stays_within_its_bytes() {
        let c = LimitsConfig {
            publish_rate: 1,
            publish_burst: 1,
            ..LimitsConfig::default()
        };
        let metrics = Arc::new(LimitsMetrics::default());
        let mut r = DeviceRates::new(&c, 1024, 10 * (RATE_ENTRY_BYTES + 8), metrics.clone())
            .expect("a rate is set");
        let dev = RateKey::Identity("sensor-7".into());
        assert_eq!(r.admit(&dev, 10, true, &"sensor-7"), Ok(()));
        let wait = r.admit(&dev, 10, true, &"sensor-7").unwrap_err();
        assert!(
            // About a second, less whatever time passed (a loaded machine) since the take.
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        assert!(r.admit(&dev, 10, false, &"sensor-7").is_err());
        assert_eq!(metrics.get(Limited::PublishThrottled), 1);
        assert_eq!(metrics.get(Limited::PublishDropped), 1);
        let other = RateKey::address("10.0.0.1".parse().unwrap());
        assert_eq!(
            r.admit(&other, 10, true, &"10.0.0.1"),
            Ok(()),
            "its own bucket"
        );
        for i in 0..100 {
            let k = RateKey::Identity(format!("id-{i:05}").into());
            let _ = r.admit(&k, 10, false, &"x");
        }
        let (n, bytes) = r.usage();
        assert!(
            bytes <= 10 * (RATE_ENTRY_BYTES + 8) && n <= 10,
            "{n} entries, {bytes} B"
        );
        assert!(metrics.table_full[2].get() > 0);
        assert!(
            DeviceRates::new(&LimitsConfig::default(), 1024, 1 << 20, metrics).is_none(),
            "off by default"
        );
    }
}
