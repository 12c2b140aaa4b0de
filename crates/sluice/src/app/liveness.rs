//! Whether the gateway's threads still run their event loops: the check behind the systemd
//! watchdog ping (`WATCHDOG=1`, `app::notify`).
//!
//! Owns: [`Liveness`], the table of the runtimes to probe (every shard, the control plane with
//! the admin endpoint, the device listener), and [`Liveness::probe`]. Does not own: what is
//! done with a failed probe (the watchdog in `notify.rs` withholds its ping, so systemd
//! restarts the service after `WatchdogSec`).
//!
//! How: a probe spawns one tiny task onto each registered runtime (a `tokio` handle, from
//! another thread) and waits, up to a deadline, for each to run. A task runs only when its
//! runtime's thread gets back to its scheduler, so a thread that is blocked (deadlock, a
//! blocking call, an endless loop without `.await`), has panicked, or has ended (its runtime
//! dropped, so the task is dropped unrun) does not answer. Probing costs nothing between
//! probes: no timers, no wake-ups in the shards.
//!
//! Invariant: a runtime registers once, from its own thread, before it serves anything; the
//! table only grows (it holds one entry per gateway thread, a few dozen at most). The gateway
//! says how many threads it started ([`Liveness::expect`]); a probe waits, within its deadline,
//! for threads still starting to register, and fails if fewer did (a thread that could not
//! build its runtime).

use std::sync::{mpsc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The runtimes whose event loops are probed.
#[derive(Debug, Default)]
pub struct Liveness {
    runtimes: Mutex<Vec<(String, tokio::runtime::Handle)>>,
    /// Signalled on every registration: a probe waits on it for threads still starting.
    registered: Condvar,
    expected: std::sync::atomic::AtomicUsize,
}

/// What a probe found: the threads that did not answer within its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresponsive(pub Vec<String>);

impl std::fmt::Display for Unresponsive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.join(", "))
    }
}

impl Liveness {
    pub fn new() -> Liveness {
        Liveness::default()
    }

    /// Register the calling thread's runtime under `name` (e.g. `shard-0`). Call from inside
    /// the runtime; outside one it logs and registers nothing.
    pub fn register_current(&self, name: impl Into<String>) {
        let name = name.into();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => self.register(name, handle),
            Err(_) => tracing::error!(thread = %name, "liveness: no runtime to register"),
        }
    }

    /// Register `handle`'s runtime under `name`.
    pub fn register(&self, name: impl Into<String>, handle: tokio::runtime::Handle) {
        self.lock().push((name.into(), handle));
        self.registered.notify_all();
    }

    /// `threads` runtimes will register; a probe fails while fewer have.
    pub fn expect(&self, threads: usize) {
        self.expected
            .store(threads, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many runtimes are probed.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ask every registered runtime to run a task, and wait up to `within` for all of them.
    /// Threads the gateway started but that have not registered yet (the first probe comes
    /// right after `READY=1`, while they may still be building their runtimes) are waited for
    /// within the same deadline. Blocks the calling thread (never call it from a gateway
    /// runtime).
    pub fn probe(&self, within: Duration) -> Result<(), Unresponsive> {
        let deadline = Instant::now() + within;
        let expected = self.expected.load(std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<usize>();
        let ask = |i: usize, handle: &tokio::runtime::Handle| {
            let tx = tx.clone();
            // A runtime that has shut down drops the task unrun: no answer.
            drop(handle.spawn(async move {
                let _ = tx.send(i);
            }));
        };
        let mut runtimes = self.lock().clone();
        for (i, (_, handle)) in runtimes.iter().enumerate() {
            ask(i, handle);
        }
        if runtimes.len() < expected {
            // The registered ones answer meanwhile; then ask the late ones (the table only grows).
            let mut table = self.lock();
            while table.len() < expected {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                table = match self.registered.wait_timeout(table, left) {
                    Ok((table, _)) => table,
                    Err(poisoned) => poisoned.into_inner().0,
                };
            }
            let late = table[runtimes.len()..].to_vec();
            drop(table);
            for (name, handle) in late {
                ask(runtimes.len(), &handle);
                runtimes.push((name, handle));
            }
        }
        drop(tx);
        let mut answered = vec![false; runtimes.len()];
        let mut missing = runtimes.len();
        while missing > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(i) => {
                    if let Some(a) = answered.get_mut(i) {
                        if !*a {
                            *a = true;
                            missing -= 1;
                        }
                    }
                }
                // Timed out, or every task is gone (answered or dropped unrun).
                Err(_) => break,
            }
        }
        let unregistered = expected.saturating_sub(runtimes.len());
        if missing == 0 && unregistered == 0 {
            return Ok(());
        }
        let mut names: Vec<String> = runtimes
            .into_iter()
            .zip(answered)
            .filter(|(_, a)| !a)
            .map(|((name, _), _)| name)
            .collect();
        if unregistered > 0 {
            names.push(format!("{unregistered} thread(s) never registered"));
        }
        Err(Unresponsive(names))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, tokio::runtime::Handle)>> {
        // A panic while holding this lock leaves a valid Vec: keep using it.
        self.runtimes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A current-thread runtime driven by its own thread until `stop` is sent.
    fn runtime_thread(
        liveness: &std::sync::Arc<Liveness>,
        name: &'static str,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    ) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (registered_tx, registered) = mpsc::channel();
        let liveness = liveness.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                liveness.register_current(name);
                registered_tx.send(()).unwrap();
                let _ = stopped.await;
            });
        });
        registered.recv().unwrap();
        (stop, thread)
    }

    #[test]
    fn running_event_loops_answer_the_probe() {
        let liveness = std::sync::Arc::new(Liveness::new());
        liveness.expect(2);
        let (stop_a, a) = runtime_thread(&liveness, "shard-0");
        assert_eq!(
            liveness.probe(Duration::from_millis(50)),
            Err(Unresponsive(vec!["1 thread(s) never registered".into()]))
        );
        let (stop_b, b) = runtime_thread(&liveness, "control");
        assert_eq!(liveness.len(), 2);
        assert_eq!(liveness.probe(Duration::from_secs(5)), Ok(()));
        stop_a.send(()).unwrap();
        stop_b.send(()).unwrap();
        a.join().unwrap();
        b.join().unwrap();
    }

    /// The watchdog's first probe comes right after READY=1, while the threads
    /// `Gateway::start` spawned may still be building their runtimes: a thread that registers
    /// within the probe's deadline answers it. (Found by scripts/test-systemd: a healthy start
    /// under load logged "1 thread(s) never registered" at ERROR and withheld the first ping.)
    #[test]
    fn a_thread_that_registers_during_the_probe_answers_it() {
        let liveness = std::sync::Arc::new(Liveness::new());
        liveness.expect(2);
        let (stop_a, a) = runtime_thread(&liveness, "shard-0");
        // The control thread is slow to start (a loaded machine): it registers 200 ms later.
        let (stop_b, stopped) = tokio::sync::oneshot::channel::<()>();
        let late = liveness.clone();
        let b = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(async move {
                late.register_current("control");
                let _ = stopped.await;
            });
        });
        assert_eq!(liveness.len(), 1);
        assert_eq!(liveness.probe(Duration::from_secs(5)), Ok(()));
        stop_a.send(()).unwrap();
        stop_b.send(()).unwrap();
        a.join().unwrap();
        b.join().unwrap();
    }

    #[test]
    fn a_blocked_thread_and_an_ended_one_are_named_by_the_probe() {
        let liveness = std::sync::Arc::new(Liveness::new());
        let (stop_ok, ok) = runtime_thread(&liveness, "shard-0");
        // shard-1's thread blocks inside its event loop (as a deadlock would).
        let (unblock, blocked_rx) = mpsc::channel::<()>();
        let (registered_tx, registered) = mpsc::channel();
        let l = liveness.clone();
        let blocked = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(async move {
                l.register_current("shard-1");
                registered_tx.send(()).unwrap();
                blocked_rx.recv().unwrap();
            });
        });
        registered.recv().unwrap();
        // "listener" ended: its runtime is gone.
        let (stop_gone, gone) = runtime_thread(&liveness, "listener");
        stop_gone.send(()).unwrap();
        gone.join().unwrap();

        let started = Instant::now();
        let result = liveness.probe(Duration::from_millis(300));
        assert_eq!(
            result,
            Err(Unresponsive(vec!["shard-1".into(), "listener".into()]))
        );
        assert!(started.elapsed() >= Duration::from_millis(300));

        unblock.send(()).unwrap();
        blocked.join().unwrap();
        stop_ok.send(()).unwrap();
        ok.join().unwrap();
    }
}
