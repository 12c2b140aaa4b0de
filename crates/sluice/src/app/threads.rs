//! The threads and helpers `Gateway::start` uses: the control-plane thread, the device
//! listener threads, binding the secure listeners, current-thread runtimes, an uplink's tc
//! manager and the link watcher.

use super::*;

/// The control-plane thread: the [`ControlPlane`] loop (subscription snapshots, retained
/// store, device registry) and the admin endpoint, on one current-thread runtime. It runs
/// until shutdown, then gives the plane up to 3 s to see every shard's sender go.
pub(super) fn spawn_control(
    plane: ControlPlane,
    inbox: mpsc::Receiver<crate::control::ControlCmd>,
    admin: Option<(std::net::TcpListener, crate::admin::Access)>,
    status: Arc<GatewayStatus>,
    mut shutdown: watch::Receiver<bool>,
    core: Option<usize>,
    liveness: Arc<liveness::Liveness>,
) -> Result<std::thread::JoinHandle<()>, AppError> {
    let thread = move || {
        pin_control_thread(core, "sluice-control");
        let Some(rt) = current_thread_runtime("control-plane") else {
            return;
        };
        liveness.register("control", rt.handle().clone());
        tokio::task::LocalSet::new().block_on(&rt, async move {
            if let Some((admin, access)) = admin {
                match tokio::net::TcpListener::from_std(admin) {
                    Ok(l) => {
                        let source: Arc<dyn AdminSource> = status;
                        tokio::task::spawn_local(crate::admin::serve(
                            l,
                            source,
                            access,
                            shutdown.clone(),
                        ));
                    }
                    Err(error) => tracing::error!(%error, "cannot register the admin listener"),
                }
            }
            let plane_task = tokio::task::spawn_local(plane.run(inbox));
            if shutdown.wait_for(|stop| *stop).await.is_err() {
                // The gateway was dropped without `shutdown`: keep serving, as the shards do.
                std::future::pending::<()>().await;
            }
            // The plane ends when every shard has dropped its sender.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), plane_task).await;
        });
    };
    std::thread::Builder::new()
        .name("sluice-control".into())
        .spawn(thread)
        .map_err(AppError::Thread)
}

/// The device listener's thread: accept, CONNECT read, admission (password checks on this
/// runtime's blocking pool) and hand-over to a shard, on a current-thread runtime of its own,
/// so a reconnect storm costs this thread and never the control plane or the admin endpoint.
pub(super) fn spawn_listener(
    listener: MqttListener,
    listeners: Vec<DeviceListener>,
    shutdown: watch::Receiver<bool>,
    core: Option<usize>,
    liveness: Arc<liveness::Liveness>,
) -> Result<std::thread::JoinHandle<()>, AppError> {
    let thread = move || {
        pin_control_thread(core, "sluice-listener");
        let Some(rt) = current_thread_runtime("device listener") else {
            return;
        };
        liveness.register("listener", rt.handle().clone());
        tokio::task::LocalSet::new().block_on(&rt, listener.serve(listeners, shutdown));
        // Handshakes still reading a CONNECT were dropped with the LocalSet; a password check
        // still hashing on the blocking pool gets a moment to return its slot.
        rt.shutdown_timeout(std::time::Duration::from_secs(5));
    };
    std::thread::Builder::new()
        .name("sluice-listener".into())
        .spawn(thread)
        .map_err(AppError::Thread)
}

/// Bind `[mqtt.tls]`, `[mqtt.ws]` and `[mqtt.wss]` (each when configured) and build the TLS
/// configuration they share.
pub(super) fn bind_secure_listeners(config: &Config) -> Result<Vec<DeviceListener>, AppError> {
    let bind = |addr: SocketAddr| {
        crate::net::listen::bind(addr).map_err(|source| AppError::BindDevices { addr, source })
    };
    let mut out = Vec::new();
    let policy = match &config.mqtt.tls {
        Some(tls) => Some(Arc::new(TlsPolicy {
            config: arc_swap::ArcSwap::new(crate::edge::mqtt::stream::tls::server_config(tls)?),
            identity_from_cert: tls.identity_from_cert,
        })),
        None => None,
    };
    if let (Some(tls), Some(policy)) = (&config.mqtt.tls, &policy) {
        out.push(DeviceListener {
            socket: bind(tls.listen)?,
            kind: ListenerKind::Tls(policy.clone()),
        });
    }
    if let Some(ws) = &config.mqtt.ws {
        out.push(DeviceListener {
            socket: bind(ws.listen)?,
            kind: ListenerKind::Ws {
                path: ws.path.clone(),
            },
        });
    }
    if let (Some(wss), Some(policy)) = (&config.mqtt.wss, &policy) {
        out.push(DeviceListener {
            socket: bind(wss.listen)?,
            kind: ListenerKind::Wss {
                path: wss.path.clone(),
                tls: policy.clone(),
            },
        });
    }
    Ok(out)
}

/// A current-thread runtime for one of the gateway's own threads; logs and returns `None` if
/// it cannot be built.
pub(super) fn current_thread_runtime(what: &'static str) -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(error) => {
            tracing::error!(%error, thread = what, "cannot build a runtime");
            None
        }
    }
}

/// Install `install_tc`'s htb tree on the uplink's interface (configured, or the one routing
/// to the broker).
pub(super) fn start_tc(
    u: &crate::config::UplinkConfig,
) -> Result<crate::sink::tc::TcManager, String> {
    use crate::sink::tc;
    let rate = u.tc_rate.clone().ok_or("tc_rate is not set")?;
    let interface = match &u.tc_interface {
        Some(i) => i.clone(),
        None => {
            use std::net::ToSocketAddrs;
            let ip = (u.url.host.as_str(), u.url.port)
                .to_socket_addrs()
                .map_err(|e| {
                    format!(
                        "cannot resolve {} to find the uplink interface: {e}",
                        u.url.host
                    )
                })?
                .next()
                .ok_or_else(|| format!("{} resolved to no address", u.url.host))?
                .ip();
            tc::route_interface(ip).map_err(|e| e.to_string())?
        }
    };
    tc::TcManager::start(None, interface, rate).map_err(|e| e.to_string())
}

/// A non-blocking listener on `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as the
/// standard library sets it, so a restart does not wait out TIME_WAIT).
/// Start the link watcher when `[multipath] interfaces` are set or an uplink or a CoAP proxy
/// upstream has paths. A
/// failure (no `ip` command) is logged; paths then rely on their own timeouts.
pub(super) fn start_link_watcher(config: &Config) -> Option<crate::net::links::LinkWatcher> {
    let paths = config
        .uplink
        .iter()
        .flat_map(|u| &u.paths)
        .chain(config.coap.proxy.iter().flat_map(|p| &p.paths));
    let spec = crate::net::links::WatchSpec {
        interfaces: config
            .multipath
            .interfaces
            .iter()
            .cloned()
            .chain(paths.clone().filter_map(|p| p.interface.clone()))
            .collect(),
        addrs: paths.filter_map(|p| p.bind).collect(),
        refresh_endpoints: config.multipath.refresh_endpoints,
    };
    if spec.interfaces.is_empty() && spec.addrs.is_empty() {
        return None;
    }
    match crate::net::links::LinkWatcher::start(spec) {
        Ok(w) => Some(w),
        Err(error) => {
            tracing::error!(%error, "cannot watch the links (no netlink socket?); paths notice dead links by their own timeouts only");
            None
        }
    }
}
