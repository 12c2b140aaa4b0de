//! A cuttable link: a TCP relay between a system under test and its cloud that can be cut
//! (every connection dropped, the port closed) and restored (listening again on the same port).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{sleep, Instant};

use crate::payload::unix_now_ns;

/// A TCP relay between sluice and the cloud broker that can be cut (every connection dropped,
/// the port closed) and restored (listening again on the same port).
pub(crate) struct Link {
    pub(crate) addr: SocketAddr,
    pub(crate) up: watch::Sender<bool>,
    pub(crate) accepts: Arc<Mutex<Vec<u64>>>,
    pub(crate) upstream: SocketAddr,
    pub(crate) task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Link {
    pub(crate) async fn start(upstream: SocketAddr) -> anyhow::Result<Link> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the link relay")?;
        let addr = listener.local_addr()?;
        let (up, _) = watch::channel(true);
        let link = Link {
            addr,
            up,
            accepts: Arc::default(),
            upstream,
            task: Mutex::new(None),
        };
        link.serve(listener);
        Ok(link)
    }

    pub(crate) fn serve(&self, listener: TcpListener) {
        let mut up = self.up.subscribe();
        let accepts = self.accepts.clone();
        let upstream = self.upstream;
        let pipes_up = self.up.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = up.wait_for(|u| !*u) => return,
                    accepted = listener.accept() => {
                        let Ok((down, _)) = accepted else { continue };
                        accepts.lock().unwrap_or_else(|p| p.into_inner()).push(unix_now_ns());
                        tokio::spawn(pipe(down, upstream, pipes_up.subscribe()));
                    }
                }
            }
        });
        *self.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    }

    /// Drop every relayed connection and close the port.
    pub(crate) fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Listen again on the same port.
    pub(crate) async fn restore(&self) -> anyhow::Result<()> {
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        self.up.send_replace(true);
        let mut last = None;
        for _ in 0..100 {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => {
                    self.serve(listener);
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            sleep(Duration::from_millis(50)).await;
        }
        Err(anyhow!(
            "re-binding the link relay on {}: {last:?}",
            self.addr
        ))
    }

    /// The first accepted connection at or after `after_ns`.
    pub(crate) async fn wait_accept_after(
        &self,
        after_ns: u64,
        wait: Duration,
    ) -> anyhow::Result<u64> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(&t) = self
                .accepts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|&&t| t >= after_ns)
            {
                return Ok(t);
            }
            if Instant::now() >= deadline {
                bail!("no connection through the link within {wait:?}");
            }
            sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.up.send_replace(false);
    }
}

pub(crate) async fn pipe(mut down: TcpStream, upstream: SocketAddr, mut up: watch::Receiver<bool>) {
    let Ok(mut upper) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = down.set_nodelay(true);
    let _ = upper.set_nodelay(true);
    tokio::select! {
        _ = up.wait_for(|u| !*u) => {}
        _ = tokio::io::copy_bidirectional(&mut down, &mut upper) => {}
    }
}
