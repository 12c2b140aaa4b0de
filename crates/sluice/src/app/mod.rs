//! Start-up and shutdown order.
//!
//! `Gateway::build` does everything that can fail on bad configuration — binding the device
//! and admin listeners (and the CoAP sockets, one per shard, `edge::coap::socket`), loading uplink certificates — before any thread starts, so `sluice
//! run` fails fast with a clear message. `Gateway::start` then starts, in order: the shard
//! threads (each with its uplink sessions), the control-plane thread (subscription snapshots,
//! retained store, device registry, admin endpoint), and last the device listener's thread
//! (accept, CONNECT read, admission, hand-over to a shard). `RunningGateway::shutdown` flips
//! one watch channel that every task selects on, and joins the threads: the listener first,
//! then the shards, then the control plane.

use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, watch};

use crate::admin::AdminSource;
use crate::config::Config;
use crate::control::admission::Admission;
use crate::control::{ControlMetrics, ControlPlane, SubscriptionSnapshot};
use crate::edge::mqtt::listener::{DeviceListener, ListenerKind, MqttListener, TlsPolicy};
use crate::shard::metrics::ShardMetrics;
use crate::shard::{self, ShardSeed};
use crate::sink::LaneMetrics;
use crate::telemetry::metrics::PromWriter;

pub mod liveness;
pub mod notify;
mod overview;
mod reload;
mod status;
mod threads;
pub mod uplinks;
pub use reload::{ReloadOutcome, ReloadTrigger};
use status::GatewayStatus;
use threads::{bind_secure_listeners, spawn_control, spawn_listener, start_link_watcher, start_tc};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot listen for devices on {addr}: {source}")]
    BindDevices {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("mqtt.tls: {0}")]
    Tls(#[from] crate::edge::mqtt::stream::tls::TlsSetupError),
    #[error("cannot listen for CoAP devices on udp {addr}: {source}")]
    BindCoap {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen for CoAP over DTLS on {addr}: {source}")]
    BindCoapDtls {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    CoapDtls(#[from] crate::edge::coap::dtls::ContextError),
    #[error("cannot listen for the admin endpoint on {addr}: {source}")]
    BindAdmin {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen for health devices (PHD) on {addr}: {source}")]
    BindPhd {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("PHD listener: {0}")]
    PhdTls(#[from] crate::edge::phd::tls::PhdTlsError),
    #[error("uplink {name:?}: {source}")]
    Uplink {
        name: String,
        source: crate::sink::UplinkError,
    },
    #[error(transparent)]
    AdminToken(crate::config::ConfigError),
    #[error("admin TLS (admin.cert_file, admin.key_file): {0}")]
    AdminTls(#[from] crate::admin::AdminTlsError),
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Spool(#[from] crate::sink::spool::SpoolStartError),
    #[error("state (state.dir): {0}")]
    State(#[from] crate::state::StateError),
    #[error("access control list: {0}")]
    Acl(String),
}

/// A configured gateway whose sockets are bound but whose threads are not started yet.
pub struct Gateway {
    config: Arc<Config>,
    shards: usize,
    mqtt: std::net::TcpListener,
    /// Whether the device listener is MPTCP (`None`: `[mqtt] mptcp` not asked).
    mqtt_mptcp: Option<bool>,
    /// The TLS, ws and wss device listeners (`[mqtt.tls]`, `[mqtt.ws]`, `[mqtt.wss]`).
    mqtt_more: Vec<DeviceListener>,
    /// One per shard, bound with SO_REUSEPORT; empty when `[coap] enabled = false`.
    coap: Vec<std::net::UdpSocket>,
    /// `[coap.dtls]`: its context and one socket per shard.
    coap_dtls: Option<(
        Arc<crate::edge::coap::dtls::DtlsContext>,
        Vec<std::net::UdpSocket>,
    )>,
    admin: Option<std::net::TcpListener>,
    /// Who may use the admin endpoint (`[admin] token_file`, TLS).
    admin_access: crate::admin::Access,
    /// `[phd] listen`.
    phd: Option<std::net::TcpListener>,
    uplink_tls: Vec<Option<Arc<rustls::ClientConfig>>>,
    /// Per uplink: the handle through which a reload replaces its roots and certificate.
    uplink_tls_live: Vec<Option<Arc<crate::sink::ReloadableClientTls>>>,
    /// The file a reload re-reads (`Gateway::with_config_file`).
    config_path: Option<std::path::PathBuf>,
    /// Opened and recovered; empty without a spool.
    spools: crate::sink::spool::OpenedSpools,
    /// `[acl]` compiled (its file read).
    acl: crate::control::acl::AclSnapshot,
    /// `[state] dir`: the writer and what was loaded (`None`: memory only).
    state: Option<(crate::state::StateService, crate::state::Restored)>,
    state_metrics: Arc<crate::state::StateMetrics>,
}

impl Gateway {
    pub fn build(config: Config) -> Result<Gateway, AppError> {
        // Functions are sinks: each `[[function]]` becomes one more uplink entry.
        let config = config.with_function_sinks();
        let shards = config.gateway.shard_count();
        let mut uplink_tls = Vec::new();
        let mut uplink_tls_live = Vec::new();
        for u in &config.uplink {
            let (tls, live) = if u.url.tls {
                let (tls, live) =
                    crate::sink::reloadable_client_tls(u).map_err(|source| AppError::Uplink {
                        name: u.name.clone(),
                        source,
                    })?;
                (Some(tls), Some(live))
            } else {
                (None, None)
            };
            uplink_tls.push(tls);
            uplink_tls_live.push(live);
        }
        let addr = config.mqtt.listen;
        let (mqtt, mqtt_mptcp) = crate::net::listen::bind_devices(addr, config.mqtt.mptcp)
            .map_err(|source| AppError::BindDevices { addr, source })?;
        let mqtt_more = bind_secure_listeners(&config)?;
        let coap = if config.coap.enabled {
            let addr = config.coap.listen;
            crate::edge::coap::socket::bind(addr, shards)
                .map_err(|source| AppError::BindCoap { addr, source })?
        } else {
            Vec::new()
        };
        let mut admin_access = crate::admin::Access::default();
        let coap_dtls = match &config.coap.dtls {
            Some(d) if config.coap.enabled => {
                let context = crate::edge::coap::dtls::DtlsContext::new(d)?;
                let addr = d.listen;
                let sockets = crate::edge::coap::socket::bind(addr, shards)
                    .map_err(|source| AppError::BindCoapDtls { addr, source })?;
                Some((context, sockets))
            }
            _ => None,
        };
        let admin = if config.admin.enabled {
            let a = &config.admin;
            admin_access.token = a.read_token().map_err(AppError::AdminToken)?;
            if let (Some(cert), Some(key)) = (&a.cert_file, &a.key_file) {
                admin_access.tls = Some(crate::admin::tls_config(cert, key)?);
            }
            let addr = a.listen;
            Some(
                crate::net::listen::bind(addr)
                    .map_err(|source| AppError::BindAdmin { addr, source })?,
            )
        } else {
            None
        };
        let phd = match config.phd.listen {
            Some(addr) => Some(
                crate::net::listen::bind(addr)
                    .map_err(|source| AppError::BindPhd { addr, source })?,
            ),
            None => None,
        };
        let acl_file = match &config.acl.file {
            Some(path) => {
                Some(crate::config::read_acl_file(path).map_err(|e| AppError::Acl(e.to_string()))?)
            }
            None => None,
        };
        let acl =
            crate::control::acl::AclSnapshot::compile(&config.acl, acl_file.as_ref(), &config.mqtt)
                .map_err(|e| AppError::Acl(e.to_string()))?;
        // Last, after everything cheap has been checked: recovery may read the whole spool.
        let spools = crate::sink::spool::open_all(&config, shards)?;
        let state_metrics = Arc::new(crate::state::StateMetrics::default());
        let state = crate::state::StateService::open(&config, shards, state_metrics.clone())?;
        Ok(Gateway {
            state,
            state_metrics,
            acl,
            config: Arc::new(config),
            shards,
            mqtt,
            mqtt_mptcp,
            mqtt_more,
            coap,
            coap_dtls,
            admin,
            admin_access,
            phd,
            uplink_tls,
            uplink_tls_live,
            config_path: None,
            spools,
        })
    }

    /// The config file a reload (`SIGHUP`, `POST /api/v1/reload`) re-reads; without one, a
    /// reload asked over the API is refused (there is nothing to re-read).
    pub fn with_config_file(mut self, path: Option<std::path::PathBuf>) -> Gateway {
        self.config_path = path;
        self
    }

    /// The CoAP over DTLS listener's address (`None` without `[coap.dtls]`).
    pub fn coap_dtls_addr(&self) -> Option<SocketAddr> {
        let (_, sockets) = self.coap_dtls.as_ref()?;
        sockets.first().and_then(|s| s.local_addr().ok())
    }

    /// The CoAP listener's address (`None` when `[coap] enabled = false`).
    pub fn coap_addr(&self) -> Option<SocketAddr> {
        self.coap.first().and_then(|s| s.local_addr().ok())
    }

    pub fn mqtt_addr(&self) -> SocketAddr {
        self.mqtt.local_addr().unwrap_or(self.config.mqtt.listen)
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn start(self) -> Result<RunningGateway, AppError> {
        let Gateway {
            config,
            shards,
            mqtt,
            mqtt_mptcp,
            mqtt_more,
            coap,
            coap_dtls,
            admin,
            admin_access,
            phd,
            uplink_tls,
            uplink_tls_live,
            config_path,
            spools,
            acl,
            state,
            state_metrics,
        } = self;
        let (state, restored) = match state {
            Some((service, restored)) => (Some(service), restored),
            None => (None, crate::state::Restored::default()),
        };
        let state_log = state.as_ref().map(|s| s.log());
        let mut restored_sessions = restored.sessions.into_iter();
        let addr_of = |kind: crate::edge::mqtt::stream::StreamKind| {
            mqtt_more
                .iter()
                .find(|l| l.kind.stream_kind() == kind)
                .and_then(|l| l.socket.local_addr().ok())
        };
        use crate::edge::mqtt::stream::StreamKind;
        let (tls_addr, ws_addr, wss_addr) = (
            addr_of(StreamKind::Tls),
            addr_of(StreamKind::Ws),
            addr_of(StreamKind::Wss),
        );
        let coap_addr = coap.first().and_then(|s| s.local_addr().ok());
        let mut coap = coap.into_iter();
        let coap_metrics: Vec<Arc<crate::edge::coap::CoapMetrics>> =
            (0..shards).map(|_| Arc::default()).collect();
        let coap_dtls_addr = coap_dtls
            .as_ref()
            .and_then(|(_, s)| s.first())
            .and_then(|s| s.local_addr().ok());
        // Per shard: the DTLS listener's counters and those of the CoAP requests over it.
        let coap_dtls_metrics: Vec<(
            Arc<crate::edge::coap::dtls::DtlsMetrics>,
            Arc<crate::edge::coap::CoapMetrics>,
        )> = match &coap_dtls {
            Some(_) => (0..shards).map(|_| Default::default()).collect(),
            None => Vec::new(),
        };
        let (dtls_context, dtls_sockets) = match coap_dtls {
            Some((c, s)) => (Some(c), s),
            None => (None, Vec::new()),
        };
        let mut dtls_sockets = dtls_sockets.into_iter();
        let mqtt_addr = mqtt.local_addr().unwrap_or(config.mqtt.listen);
        let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let cap = config.gateway.mailbox_capacity.max(1);
        let snapshot = Arc::new(ArcSwap::from_pointee(SubscriptionSnapshot::default()));
        let (control_tx, control_rx) = mpsc::channel(cap);
        let live = Arc::new(AtomicUsize::new(0));
        let online = Arc::new(AtomicUsize::new(0));
        let control_metrics = Arc::new(ControlMetrics {
            state: state_metrics,
            ..ControlMetrics::default()
        });
        let shard_metrics: Vec<Arc<ShardMetrics>> = (0..shards)
            .map(|_| Arc::new(ShardMetrics::default()))
            .collect();
        let proxy_metrics: Vec<Arc<crate::proxy::ProxyMetrics>> = (0..shards)
            .map(|_| Arc::new(crate::proxy::ProxyMetrics::new(&config)))
            .collect();
        // What a reload replaces under running shards (`control/live.rs`, `reload.rs`).
        let rules = crate::control::live::Rules::new(&config);
        let has_high = rules.load().priority.has_high();
        let routes: Vec<crate::sink::UplinkRoute> = config
            .uplink
            .iter()
            .map(crate::sink::UplinkRoute::new)
            .collect();
        let acl = crate::control::acl::Acl::new(acl, control_metrics.acl.clone());
        let connect_limits = Arc::new(crate::control::limits::ConnectLimits::new(
            &config.limits,
            control_metrics.limits.clone(),
        ));
        let uplink_metrics: Vec<Vec<LaneMetrics>> = (0..shards)
            .map(|_| {
                config
                    .uplink
                    .iter()
                    .map(|_| LaneMetrics::new(has_high))
                    .collect()
            })
            .collect();
        let link_watcher = start_link_watcher(&config);
        let links: Option<crate::net::links::LinkWatch> = link_watcher.as_ref().map(|w| w.watch());
        let mut tc = Vec::new();
        let mut tc_status = Vec::new();
        let uplink_ports: Vec<Option<crate::sink::PortSink>> = config
            .uplink
            .iter()
            .map(|u| {
                if !(u.install_tc && has_high) {
                    tc_status.push(serde_json::Value::Null);
                    return None;
                }
                match start_tc(u) {
                    Ok(manager) => {
                        tracing::info!(uplink = %u.name, interface = manager.interface(), "traffic control installed for the high lane");
                        tc_status.push(serde_json::json!({ "installed": true, "interface": manager.interface() }));
                        let manager = Arc::new(manager);
                        tc.push(manager.clone());
                        Some(crate::sink::PortSink::new(manager))
                    }
                    Err(error) => {
                        tracing::error!(uplink = %u.name, %error, "install_tc: traffic control NOT installed; the high lane keeps its own session and marked socket");
                        tc_status.push(serde_json::json!({ "installed": false, "error": error.to_string() }));
                        None
                    }
                }
            })
            .collect();

        let (mut txs, mut rxs) = (Vec::new(), Vec::new());
        for _ in 0..shards {
            let (tx, rx) = mpsc::channel(cap);
            txs.push(tx);
            rxs.push(rx);
        }
        let cores = if config.gateway.pin_threads {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        // `[shard][uplink]` metrics, and each shard's spools (one per uplink).
        let crate::sink::spool::OpenedSpools {
            per_uplink: spools,
            former,
        } = spools;
        let spool_metrics: Vec<Vec<Arc<crate::sink::spool::SpoolMetrics>>> = (0..shards)
            .map(|s| {
                spools
                    .iter()
                    .filter_map(|per_shard| per_shard.get(s).map(|o| o.metrics.clone()))
                    .collect()
            })
            .collect();
        let mut shard_spools: Vec<Vec<crate::sink::spool::OpenedSpool>> =
            (0..shards).map(|_| Vec::new()).collect();
        for per_shard in spools {
            for (s, opened) in per_shard.into_iter().enumerate() {
                if let Some(v) = shard_spools.get_mut(s) {
                    v.push(opened);
                }
            }
        }
        let former_metrics: Vec<Arc<crate::sink::spool::SpoolMetrics>> =
            former.iter().map(|(_, _, o)| o.metrics.clone()).collect();
        let mut shard_former: Vec<Vec<(usize, usize, crate::sink::spool::OpenedSpool)>> =
            (0..shards).map(|_| Vec::new()).collect();
        for (uplink, index, opened) in former {
            if let Some(v) = shard_former.get_mut(index % shards) {
                v.push((uplink, index, opened));
            }
        }
        // Each local function's runtime (thread `sluice-functions`): idle until a first
        // event; a reload adds and removes functions in the set (ADR 0013).
        let function_set = Arc::new(
            crate::functions::live::FunctionSet::start(&config.function)
                .map_err(AppError::Thread)?,
        );
        let functions = function_set.handles();
        let phd_addr = phd.as_ref().and_then(|l| l.local_addr().ok());
        let phd = phd
            .map(|l| crate::edge::phd::PhdStart::new(&config, l, txs.clone()))
            .transpose()?;
        let mut shard_spools = shard_spools.into_iter();
        let mut shard_former = shard_former.into_iter();
        let mut threads = Vec::new();
        let liveness = Arc::new(liveness::Liveness::new());
        // The shards, the control plane and the device listener.
        liveness.expect(shards + 2);
        // Input bounds: sessions on all shards, against mqtt.max_sessions.
        let sessions_total = Arc::new(AtomicUsize::new(0));
        for (id, inbox) in rxs.into_iter().enumerate() {
            let seed = ShardSeed {
                id,
                config: config.clone(),
                mailboxes: txs.clone(),
                inbox,
                control: control_tx.clone(),
                snapshot: snapshot.clone(),
                metrics: shard_metrics[id].clone(),
                rules: rules.clone(),
                acl: acl.clone(),
                limits: control_metrics.limits.clone(),
                uplink_metrics: uplink_metrics[id].clone(),
                uplink_tls: uplink_tls.clone(),
                uplink_ports: uplink_ports.clone(),
                live_connections: live.clone(),
                online_devices: online.clone(),
                shutdown: shutdown_rx.clone(),
                core: if cores.is_empty() {
                    None
                } else {
                    Some(cores[id % cores.len()])
                },
                spools: shard_spools.next().unwrap_or_default(),
                former_spools: shard_former.next().unwrap_or_default(),
                sessions_total: sessions_total.clone(),
                proxy_metrics: proxy_metrics[id].clone(),
                coap: coap.next(),
                coap_metrics: coap_metrics[id].clone(),
                coap_dtls: match (&dtls_context, dtls_sockets.next()) {
                    (Some(context), Some(socket)) => Some(crate::edge::coap::dtls::DtlsSeed {
                        socket,
                        context: context.clone(),
                        metrics: coap_dtls_metrics[id].0.clone(),
                        coap_metrics: coap_dtls_metrics[id].1.clone(),
                    }),
                    _ => None,
                },
                links: links.clone(),
                phd: phd.as_ref().map(|p| p.shared.clone()),
                functions: functions.clone(),
                liveness: liveness.clone(),
                routes: routes.clone(),
                state: state_log.clone(),
                restored_sessions: restored_sessions.next().unwrap_or_default(),
            };
            threads.push(shard::spawn(seed).map_err(AppError::Thread)?);
        }

        let plane = ControlPlane::new(
            shards,
            config.mqtt.max_retained_messages,
            snapshot,
            control_metrics.clone(),
        )
        .with_max_retained_bytes(config.mqtt.max_retained_bytes.as_usize());
        let plane = match state_log {
            Some(log) => plane.with_state(log, restored.retained),
            None => plane,
        };
        let admission = Admission::new(&config.mqtt)
            .with_acl(acl.clone())
            .with_limits(connect_limits.clone());
        let device_tls = mqtt_more.iter().find_map(|l| match &l.kind {
            ListenerKind::Tls(policy) | ListenerKind::Wss { tls: policy, .. } => {
                Some(policy.clone())
            }
            _ => None,
        });
        // The admin's table of sinks, by stable id (ADR 0013): ids 0.. in config order.
        let mut tc_status = tc_status.into_iter();
        let uplink_table = Arc::new(uplinks::UplinkTable::at_start(
            config
                .uplink
                .iter()
                .enumerate()
                .map(|(u, cfg)| uplinks::StartEntry {
                    name: cfg.name.clone(),
                    lanes: uplink_metrics
                        .iter()
                        .filter_map(|per_shard| per_shard.get(u).cloned())
                        .collect(),
                    spools: spool_metrics
                        .iter()
                        .filter_map(|per_shard| per_shard.get(u).cloned())
                        .collect(),
                    tc: tc_status.next().unwrap_or(serde_json::Value::Null),
                }),
        ));
        let reloader = Arc::new(reload::Reloader::new(
            config_path,
            config.clone(),
            reload::LiveHandles {
                rules,
                routes,
                uplink_tls: uplink_tls_live,
                acl: acl.clone(),
                logins: admission.logins(),
                connect_limits: connect_limits.clone(),
                device_tls,
                shards: txs.clone(),
                table: uplink_table.clone(),
                functions: function_set.clone(),
            },
        ));
        let status = Arc::new(GatewayStatus {
            name: config.gateway.effective_name(),
            started: Instant::now(),
            device_table: plane.device_table(),
            uplinks: uplink_table,
            shard_metrics,
            devices_per_shard: plane.devices_per_shard(),
            control: control_metrics.clone(),
            former_spool_metrics: former_metrics,
            spool_dir: config.spool.dir.clone(),
            spool_ack: config.spool.ack,
            proxy_metrics,
            coap_addr,
            coap_metrics,
            coap_dtls_addr,
            coap_dtls_metrics,
            mqtt_mptcp,
            links: link_watcher.as_ref().map(|w| w.metrics.clone()),
            phd: phd.as_ref().map(|p| p.shared.room.clone()),
            functions: function_set.clone(),
            reloads: reloader,
            overview: Default::default(),
        });
        let listener = MqttListener {
            admission,
            limits: connect_limits,
            shards: txs,
            live_connections: live,
            max_connections: config.mqtt.max_connections,
            max_packet_size: config.mqtt.max_packet_size.0.min(u32::MAX as u64) as usize,
            connect_timeout: config.mqtt.connect_timeout,
            metrics: control_metrics,
        };
        drop(control_tx);
        // The control plane and admin endpoint first, then the listener: a device admitted
        // from the first accept on finds its shard and the control plane running.
        threads.push(spawn_control(
            plane,
            control_rx,
            admin.map(|l| (l, admin_access)),
            status.clone(),
            shutdown_rx.clone(),
            config.gateway.control_core,
            liveness.clone(),
        )?);
        if let Some(phd) = phd {
            threads.insert(
                0,
                phd.spawn(shutdown_rx.clone(), config.gateway.control_core)
                    .map_err(AppError::Thread)?,
            );
        }
        // Joined first on shutdown: accepting stops before the shards drain.
        let mut listeners = vec![DeviceListener {
            socket: mqtt,
            kind: ListenerKind::Plain,
        }];
        listeners.extend(mqtt_more);
        threads.insert(
            0,
            spawn_listener(
                listener,
                listeners,
                shutdown_rx,
                config.gateway.control_core,
                liveness.clone(),
            )?,
        );
        tracing::info!(%mqtt_addr, mqtt_tls = ?tls_addr, mqtt_ws = ?ws_addr, mqtt_wss = ?wss_addr, coap = ?coap_addr, admin = ?admin_addr, shards, uplinks = config.uplink.len(), "sluice started");
        Ok(RunningGateway {
            shutdown: shutdown_tx,
            threads,
            tc,
            link_watcher,
            mqtt_addr,
            tls_addr,
            ws_addr,
            wss_addr,
            coap_addr,
            coap_dtls_addr,
            admin_addr,
            phd_addr,
            status,
            function_set,
            liveness,
            state,
        })
    }
}

/// A started gateway. Dropping it without `shutdown` leaves the threads running.
pub struct RunningGateway {
    shutdown: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Traffic control installed for `install_tc`; removed when the last reference drops.
    tc: Vec<Arc<crate::sink::tc::TcManager>>,
    /// The `sluice-links` thread (`[multipath]`, uplink paths); stopped after the shards.
    link_watcher: Option<crate::net::links::LinkWatcher>,
    pub mqtt_addr: SocketAddr,
    /// `[mqtt.tls]`'s listener, if configured.
    pub tls_addr: Option<SocketAddr>,
    /// `[mqtt.ws]`'s listener, if configured.
    pub ws_addr: Option<SocketAddr>,
    /// `[mqtt.wss]`'s listener, if configured.
    pub wss_addr: Option<SocketAddr>,
    /// The CoAP listener (`None` when `[coap] enabled = false`).
    pub coap_addr: Option<SocketAddr>,
    /// The CoAP over DTLS listener (`None` without `[coap.dtls]`).
    pub coap_dtls_addr: Option<SocketAddr>,
    pub admin_addr: Option<SocketAddr>,
    /// The PHD listener (`None` without `[phd] listen`).
    pub phd_addr: Option<SocketAddr>,
    status: Arc<GatewayStatus>,
    /// Stopped after the shards (their dispatchers are gone), killing every instance.
    /// Every function and its runtime: stopped after the shards.
    function_set: Arc<crate::functions::live::FunctionSet>,
    /// Every gateway thread's runtime, for the watchdog's probe (`notify::Watchdog`).
    liveness: Arc<liveness::Liveness>,
    /// `[state] dir`'s writer: stopped (last commit written) after the shards.
    state: Option<crate::state::StateService>,
}

impl RunningGateway {
    /// The CoAP listener's address (`None` when `[coap] enabled = false`).
    pub fn coap_addr(&self) -> Option<SocketAddr> {
        self.coap_addr
    }
}

impl RunningGateway {
    /// Metrics in Prometheus text form (what `/metrics` serves).
    pub fn metrics_text(&self) -> String {
        let mut w = PromWriter::new();
        self.status.render_metrics(&mut w);
        w.finish()
    }

    pub fn status_json(&self) -> serde_json::Value {
        self.status.status()
    }

    /// The runtimes of every gateway thread (shards, control plane, device listener), for a
    /// liveness probe.
    pub fn liveness(&self) -> Arc<liveness::Liveness> {
        self.liveness.clone()
    }

    /// Stop every thread: devices get DISCONNECT (MQTT 5), uplinks disconnect cleanly.
    pub fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.threads {
            let _ = t.join();
        }
        if let Some(state) = self.state {
            state.stop();
        }
        // The control thread (the status's other holder) is joined: stop the instances.
        drop(self.status);
        self.function_set.stop_all();
        if let Some(w) = self.link_watcher {
            w.stop();
        }
        for manager in self.tc {
            // Shards are gone, so this is the last reference: remove the qdisc now.
            match Arc::try_unwrap(manager) {
                Ok(m) => {
                    if let Err(error) = m.shutdown() {
                        tracing::warn!(%error, "could not remove the traffic control rules");
                    }
                }
                Err(m) => drop(m),
            }
        }
        tracing::info!("sluice stopped");
    }
}

/// Pin the calling control-plane thread to `[gateway] control_core`, if set.
pub(crate) fn pin_control_thread(core: Option<usize>, thread: &'static str) {
    let Some(core) = core else { return };
    let ids = core_affinity::get_core_ids().unwrap_or_default();
    match ids.into_iter().find(|c| c.id == core) {
        Some(id) if core_affinity::set_for_current(id) => {}
        _ => tracing::warn!(
            core,
            thread,
            "could not pin the control-plane thread to gateway.control_core"
        ),
    }
}
