//! Starting and signalling one local function instance: its listening socket, its
//! environment, the clone/exec, and signals to its process group. The only `unsafe` of the
//! runtime lives here (the clone and the child's set-up, and `libc` calls that have no safe
//! std equivalent); each
//! block says why it is sound. (ADR 0004 lists the crate's `unsafe`; this module is to be
//! added to it.)
//!
//! Owns: the socket handed to a child, the child's argv/env block, `kill` on its group.
//! Does not own: when to start or stop (the scaler), waiting for exits (the shell reaps on
//! SIGCHLD), or readiness in `socket = "port"` mode (the shell connects).
//!
//! # What a child gets
//! The function's `socket` resolved for this start is a [`Plan`]:
//! - [`Plan::Inherit`] (`socket = "inherit"`, or `"auto"` once detected or when the command
//!   names fd 3): a TCP socket bound to `127.0.0.1:0` (SO_REUSEADDR) and listening (backlog
//!   [`BACKLOG`]) as fd 3, with `LISTEN_FDS=1`, `LISTEN_FDNAMES=http` and
//!   `LISTEN_PID=<its own pid>` (systemd socket activation), and `PORT=<port>`. sluice closes
//!   its copy once the child is spawned, so the kernel queue belongs to the child alone;
//!   connections made before the child accepts wait in the backlog.
//! - [`Plan::Port`] (`socket = "port"`, or `"auto"` once detected): `PORT=<a port that was
//!   free>` (bound to :0, read, closed); the child binds it itself (Knative's contract).
//! - [`Plan::Detect`] (`socket = "auto"` before the first instance told): both — the fd-3
//!   socket as in `Inherit`, and `PORT` naming *another* free port, so a program that binds
//!   `$PORT` never finds it taken. sluice keeps a duplicate of the fd-3 socket
//!   ([`Spawned::detect`]) to see its accept queue drain.
//! - Always `K_SERVICE`, `K_CONFIGURATION`, `SLUICE_FUNCTION` (= name), `K_REVISION`
//!   (= `{name}-1`), then the configured `env` (which may override them), on top of sluice's
//!   own environment minus any `LISTEN_*` sluice itself was given. Working directory `dir`,
//!   stdin `/dev/null`, stdout and stderr inherited from sluice.
//! - Its own process group (pgid = pid), so a stop signals the child and its children.
//! - `PR_SET_PDEATHSIG = SIGKILL`: the kernel kills it when the thread that started it (the
//!   `sluice-functions` thread, which lives as long as the runtime) dies, sluice crashing
//!   included. If sluice died between the clone and `prctl`, the child sees a different parent
//!   (`getppid`) and exits at once.
//!
//! # Starting without fork
//! sluice is a multi-threaded process with shards working while an instance starts, so it
//! does not `fork`: copying its page tables write-locks its memory map for up to a
//! millisecond, and every page a shard writes afterwards (until the exec) is copied. Instead
//! the runtime thread calls `clone(CLONE_VM | CLONE_VFORK)` with a small stack of its own (as
//! `posix_spawn` does): the child runs in sluice's memory and the calling thread is suspended
//! until the child has called `execve`. Between the two only async-signal-safe calls are
//! allowed (no allocation, no lock), so the whole exec block — program path, argv, envp — is
//! built before, in one byte arena, with `LISTEN_PID=` followed by room for 20 digits (the
//! child's pid is known only in the child). All signals are blocked around the clone; the
//! child (which has its own copy of the signal handlers) resets handled signals and SIGPIPE to
//! the default and unblocks them, joins its own process group, sets `PR_SET_PDEATHSIG`,
//! checks its parent, puts `/dev/null` on stdin, changes to `dir`, puts the socket on fd 3
//! (`dup2`, or clearing `FD_CLOEXEC` if it already is fd 3), writes `getpid()`'s digits into
//! the room and calls `execve`. On failure it stores the errno where the parent reads it and
//! exits 127; the parent reaps it and reports the error. The program is looked up in `PATH`
//! before the clone too (execve does no search).

use std::ffi::CString;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use socket2::{Domain, Protocol, Socket, Type};

use crate::config::{FunctionConfig, SocketMode};

/// Listen backlog of an inherited socket: requests queue here while the instance starts.
pub const BACKLOG: i32 = 1024;
/// The fd an inherited socket gets (systemd's `SD_LISTEN_FDS_START`).
const LISTEN_FD: libc::c_int = 3;
/// Room for the decimal digits of a pid (u64 max has 20).
const PID_ROOM: usize = 20;

/// Stack of the cloned child between `clone` and `execve` (it runs a few syscalls only).
const CHILD_STACK: usize = 64 * 1024;

/// A started instance's process, reaped by pid (`waitpid`, never `waitpid(-1)`).
#[derive(Debug)]
pub struct Proc {
    pid: libc::pid_t,
}

impl Proc {
    /// Reaps it if it exited; `Ok(None)` while it runs.
    #[allow(unsafe_code)]
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid writes one int we own.
        let rc = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        match rc {
            0 => Ok(None),
            r if r == self.pid => Ok(Some(ExitStatus::from_raw(status))),
            _ => Err(io::Error::last_os_error()),
        }
    }
}

/// A started instance's process.
#[derive(Debug)]
pub struct Spawned {
    pub child: Proc,
    pub pid: u32,
    /// Where it serves (127.0.0.1); with [`Plan::Detect`], its fd 3's address.
    pub addr: SocketAddr,
    /// [`Plan::Detect`]: what the runtime watches to learn which socket it serves.
    pub detect: Option<Detect>,
}

/// Why an instance could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("function {function}: no listening socket on 127.0.0.1 (local): {source}")]
    Socket { function: String, source: io::Error },
    #[error("function {function}: program {program:?} not found in PATH (config: fix command)")]
    NotFound { function: String, program: String },
    #[error("function {function}: command is empty (config)")]
    NoCommand { function: String },
    #[error("function {function}: a command or env value holds a NUL byte (config)")]
    Nul { function: String },
    #[error(
        "function {function}: could not start {program:?} (local; retried with backoff): {source}"
    )]
    Exec {
        function: String,
        program: String,
        source: io::Error,
    },
}

/// An instance ready to start: its socket bound (and, when inherited, listening), its exec
/// block built. Connections to [`Prepared::addr`] of an inherited socket already succeed
/// (they wait in the backlog), so the runtime publishes the instance before
/// [`Prepared::spawn`] and the first request is written while the process starts.
pub struct Prepared {
    block: ExecBlock,
    listener: Option<Socket>,
    /// The child's stdin.
    devnull: File,
    dir: Option<CString>,
    addr: SocketAddr,
    /// What `PORT` names: `addr`, except with [`Plan::Detect`].
    port_addr: SocketAddr,
    function: String,
    program: String,
}

impl Prepared {
    /// Where the instance will serve (127.0.0.1); with [`Plan::Detect`], its fd 3's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Start the process (see "Starting without fork" in the module docs). On failure the
    /// socket is closed: connections waiting in its backlog are reset.
    pub fn spawn(self) -> Result<Spawned, SpawnError> {
        let child = ChildSetup {
            block: &self.block,
            listen_fd: self.listener.as_ref().map(|s| s.as_raw_fd()),
            stdin_fd: self.devnull.as_raw_fd(),
            dir: self.dir.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
            parent_pid: std::process::id(),
            errno: 0,
        };
        let pid = child.clone_and_exec().map_err(|source| SpawnError::Exec {
            function: self.function,
            program: self.program,
            source,
        })?;
        // With Plan::Detect sluice keeps a duplicate to watch the accept queue (dropped once
        // the runtime knows); otherwise the child has it alone and so does the kernel queue.
        let detect = match self.listener {
            Some(l) if self.port_addr != self.addr => Some(Detect {
                listener: l,
                fd3: self.addr,
                port: self.port_addr,
            }),
            _ => None,
        };
        Ok(Spawned {
            child: Proc { pid },
            pid: pid as u32,
            addr: self.addr,
            detect,
        })
    }
}

/// How one instance gets its socket: the function's `socket` resolved for this start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// A listening socket as fd 3 (`LISTEN_FDS`), `PORT` = its port.
    Inherit,
    /// `PORT` names a free port the instance binds itself.
    Port,
    /// `socket = "auto"` before sluice knows: a listening socket as fd 3 *and* `PORT` naming
    /// another free port; the runtime watches which one the instance serves
    /// ([`Spawned::detect`]).
    Detect,
}

impl Plan {
    /// `cfg.socket` for the next start, given what was detected about the function so far.
    pub fn of(cfg: &FunctionConfig, detected: Option<SocketMode>) -> Plan {
        match cfg.socket {
            SocketMode::Inherit => Plan::Inherit,
            SocketMode::Port => Plan::Port,
            SocketMode::Auto => {
                if crate::config::command_takes_fd3(cfg.command.as_deref().unwrap_or_default()) {
                    return Plan::Inherit;
                }
                match detected {
                    Some(SocketMode::Inherit) => Plan::Inherit,
                    Some(SocketMode::Port) => Plan::Port,
                    Some(SocketMode::Auto) | None => Plan::Detect,
                }
            }
        }
    }
}

/// What the runtime needs to find out which socket a [`Plan::Detect`] instance serves.
#[derive(Debug)]
pub struct Detect {
    /// sluice's own duplicate of the instance's fd 3: its accept queue drains when the
    /// instance accepts there.
    pub listener: Socket,
    /// The fd-3 socket's address.
    pub fd3: SocketAddr,
    /// The address `PORT` names.
    pub port: SocketAddr,
}

/// Connections waiting in a listening socket's accept queue (`TCP_INFO`: for a listening
/// socket Linux reports the queue length in `tcpi_unacked`, the u32 at byte 24).
pub fn accept_queue_len(listener: &Socket) -> io::Result<u32> {
    use std::os::fd::AsFd;
    let mut buf = [0u8; 32];
    let n =
        crate::net::mptcp::getsockopt(listener.as_fd(), libc::SOL_TCP, libc::TCP_INFO, &mut buf)?;
    match buf.get(24..28).filter(|_| n >= 28) {
        Some(b) => Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        None => Err(io::Error::other("short TCP_INFO")),
    }
}

/// Binds the socket(s) and builds the command of one instance of `cfg` (see the module docs
/// for what it gets), without starting it.
pub fn prepare(cfg: &FunctionConfig, plan: Plan) -> Result<Prepared, SpawnError> {
    let function = || cfg.name.clone();
    let command = cfg.command.as_deref().unwrap_or_default();
    let Some(program) = command.first() else {
        return Err(SpawnError::NoCommand {
            function: function(),
        });
    };
    let socket_err = |source| SpawnError::Socket {
        function: function(),
        source,
    };
    let free_port = || -> Result<SocketAddr, SpawnError> {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(socket_err)?;
        l.local_addr().map_err(socket_err)
    };
    let (listener, addr) = match plan {
        Plan::Inherit | Plan::Detect => {
            let s = listening_socket().map_err(socket_err)?;
            let addr = s
                .local_addr()
                .map_err(socket_err)?
                .as_socket()
                .ok_or_else(|| socket_err(io::Error::other("not an inet socket")))?;
            (Some(s), addr)
        }
        Plan::Port => (None, free_port()?),
    };
    let port_addr = match plan {
        Plan::Detect => free_port()?,
        Plan::Inherit | Plan::Port => addr,
    };

    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !k.as_bytes().starts_with(b"LISTEN_"))
        .collect();
    let mut set = |k: &str, v: &str| {
        env.retain(|(ek, _)| ek != k);
        env.push((k.into(), v.into()));
    };
    set("PORT", &port_addr.port().to_string());
    set("K_SERVICE", &cfg.name);
    set("K_CONFIGURATION", &cfg.name);
    set("K_REVISION", &format!("{}-1", cfg.name));
    set("SLUICE_FUNCTION", &cfg.name);
    if listener.is_some() {
        set("LISTEN_FDS", "1");
        set("LISTEN_FDNAMES", "http");
    }
    for (k, v) in &cfg.env {
        set(k, v);
    }
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    let resolved = resolve(OsStr::new(program), path_var.as_deref(), cfg.dir.as_deref())
        .ok_or_else(|| SpawnError::NotFound {
            function: function(),
            program: program.clone(),
        })?;
    let block = ExecBlock::new(&resolved, command, &env, listener.is_some()).ok_or_else(|| {
        SpawnError::Nul {
            function: function(),
        }
    })?;

    let devnull = File::open("/dev/null").map_err(|source| SpawnError::Exec {
        function: function(),
        program: program.clone(),
        source,
    })?;
    let dir = match &cfg.dir {
        Some(d) => Some(
            CString::new(d.as_os_str().as_bytes()).map_err(|_| SpawnError::Nul {
                function: function(),
            })?,
        ),
        None => None,
    };
    Ok(Prepared {
        block,
        listener,
        devnull,
        dir,
        addr,
        port_addr,
        function: function(),
        program: program.clone(),
    })
}

/// A listening TCP socket on 127.0.0.1:0 (close-on-exec, SO_REUSEADDR, backlog [`BACKLOG`]).
fn listening_socket() -> io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).into())?;
    s.listen(BACKLOG)?;
    // Never 0-2 (if sluice runs with a standard stream closed): the child's stdio set-up
    // would replace it. try_clone duplicates to fd 3 or above.
    if s.as_raw_fd() < LISTEN_FD {
        return s.try_clone();
    }
    Ok(s)
}

/// The path execve is given: `program` as is when it holds a `/` (relative to the child's
/// working directory), else the first executable file named so in `PATH`.
fn resolve(program: &OsStr, path: Option<&OsStr>, dir: Option<&Path>) -> Option<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(program));
    }
    let path = path
        .map(OsStr::to_owned)
        .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path).find_map(|d| {
        let d = match dir {
            Some(base) if d.is_relative() => base.join(d),
            _ => d,
        };
        let p = d.join(program);
        let meta = std::fs::metadata(&p).ok()?;
        (meta.is_file() && meta.permissions().mode() & 0o111 != 0).then_some(p)
    })
}

/// Sends `signal` to the process group of `pid` (the instance and its children). Call only
/// while `pid` is not reaped (its zombie keeps the pid and group id from being reused).
#[allow(unsafe_code)]
pub fn signal_group(pid: u32, signal: libc::c_int) -> io::Result<()> {
    let pgid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    let rc = unsafe { libc::kill(-pgid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Program, argv and envp for execve, built before the clone in one arena (see the module
/// docs). The pointers point into `arena`, which is never resized after they are taken.
struct ExecBlock {
    /// Owns the bytes the pointers point to.
    _arena: Vec<u8>,
    program: *const libc::c_char,
    /// NULL-terminated.
    argv: Vec<*const libc::c_char>,
    /// NULL-terminated.
    envp: Vec<*const libc::c_char>,
    /// The `PID_ROOM` bytes after `LISTEN_PID=`, when the socket is inherited.
    pid_room: Option<*mut u8>,
}

// SAFETY: the raw pointers point into `arena`, owned by the block and moved with it (a Vec's
// heap buffer does not move). The block is only read by the runtime thread, and written (the
// pid room) only by the cloned child, which shares the memory but runs while the thread that
// cloned it is suspended (CLONE_VFORK) and no other thread has the block.
#[allow(unsafe_code)]
unsafe impl Send for ExecBlock {}
#[allow(unsafe_code)]
unsafe impl Sync for ExecBlock {}

impl ExecBlock {
    /// `None` if a string holds a NUL byte.
    fn new(
        program: &Path,
        argv: &[String],
        env: &[(OsString, OsString)],
        listen_pid: bool,
    ) -> Option<ExecBlock> {
        let mut strings: Vec<Vec<u8>> = Vec::with_capacity(1 + argv.len() + env.len() + 1);
        strings.push(program.as_os_str().as_bytes().to_vec());
        strings.extend(argv.iter().map(|a| a.as_bytes().to_vec()));
        for (k, v) in env {
            let mut kv = k.clone().into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            strings.push(kv);
        }
        if listen_pid {
            let mut kv = b"LISTEN_PID=".to_vec();
            kv.extend_from_slice(&[b'0'; PID_ROOM]);
            strings.push(kv);
        }
        if strings.iter().any(|s| s.contains(&0)) {
            return None;
        }
        let mut offsets = Vec::with_capacity(strings.len());
        let mut arena = Vec::with_capacity(strings.iter().map(|s| s.len() + 1).sum());
        for s in &strings {
            offsets.push(arena.len());
            arena.extend_from_slice(s);
            arena.push(0);
        }
        // The arena has its final length: it is not touched again except through these
        // pointers (wrapping_add is safe arithmetic; every offset is inside the arena).
        let base = arena.as_mut_ptr();
        let at = |i: usize| base.wrapping_add(offsets[i]);
        let program_ptr = at(0) as *const libc::c_char;
        let mut argv_ptrs: Vec<*const libc::c_char> =
            (1..=argv.len()).map(|i| at(i) as *const _).collect();
        argv_ptrs.push(std::ptr::null());
        let env_start = 1 + argv.len();
        let mut envp: Vec<*const libc::c_char> = (env_start..strings.len())
            .map(|i| at(i) as *const _)
            .collect();
        envp.push(std::ptr::null());
        let pid_room = listen_pid.then(|| at(strings.len() - 1).wrapping_add(b"LISTEN_PID=".len()));
        Some(ExecBlock {
            _arena: arena,
            program: program_ptr,
            argv: argv_ptrs,
            envp,
            pid_room,
        })
    }
}

/// What the cloned child needs, in the parent's memory (shared until `execve`).
struct ChildSetup<'a> {
    block: &'a ExecBlock,
    listen_fd: Option<libc::c_int>,
    stdin_fd: libc::c_int,
    /// NUL-terminated working directory, or null.
    dir: *const libc::c_char,
    parent_pid: u32,
    /// Written by the child when its set-up or `execve` failed.
    errno: libc::c_int,
}

impl ChildSetup<'_> {
    /// `clone(CLONE_VM | CLONE_VFORK)` on a stack of its own, all signals blocked around it;
    /// returns once the child has called `execve` (or exited after a failure, whose errno is
    /// returned as the error).
    #[allow(unsafe_code)]
    fn clone_and_exec(mut self) -> io::Result<libc::pid_t> {
        let mut stack = vec![0u8; CHILD_STACK];
        let top = stack.as_mut_ptr().wrapping_add(CHILD_STACK);
        let top = top.wrapping_sub(top as usize % 16); // 16-byte aligned, inside the Vec
                                                       // SAFETY: sigset_t is plain data (zeroed is valid before sigfillset); clone runs
                                                       // `child_main` on `stack`, which outlives it: with CLONE_VFORK this thread is
                                                       // suspended until the child execs or exits, so `self` and `stack` stay put and are
                                                       // not touched by us meanwhile. The child gets a copy of the signal handlers (no
                                                       // CLONE_SIGHAND) and starts with every signal blocked, so no handler of ours runs
                                                       // on its stack.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            let pid = libc::clone(
                child_main,
                top.cast(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                std::ptr::addr_of_mut!(self).cast(),
            );
            let clone_err = io::Error::last_os_error();
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            drop(stack);
            if pid < 0 {
                return Err(clone_err);
            }
            let errno = std::ptr::read_volatile(std::ptr::addr_of!(self.errno));
            if errno != 0 {
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
                return Err(io::Error::from_raw_os_error(errno));
            }
            Ok(pid)
        }
    }

    /// Runs in the child, before exec, in the parent's memory: only syscalls, no allocation,
    /// no lock, writes only to the exec block's pid room and `errno`. Returns only on failure
    /// (the errno).
    #[allow(unsafe_code)]
    fn run(&self) -> libc::c_int {
        let fail = || {
            io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        };
        // SAFETY: see above; every pointer passed points into the exec block (NUL-terminated
        // strings, NULL-terminated arrays as built by `ExecBlock::new`) or is `dir` (a
        // CString the parent keeps) or a local.
        unsafe {
            // Handlers back to the default (the child has its own copy of the table), and
            // SIGPIPE too (Rust ignores it, and an ignored signal stays ignored across exec),
            // then unblock everything.
            for sig in 1..=64 {
                if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                    continue;
                }
                let mut sa: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut sa) != 0 {
                    continue; // signals reserved by libc
                }
                let ignored = sa.sa_sigaction == libc::SIG_IGN && sig != libc::SIGPIPE;
                if sa.sa_sigaction != libc::SIG_DFL && !ignored {
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(sig, &dfl, std::ptr::null_mut());
                }
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            if libc::setpgid(0, 0) != 0 {
                return fail();
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return fail();
            }
            if libc::getppid() as u32 != self.parent_pid {
                libc::_exit(1); // sluice is already gone
            }
            if !move_fd(self.stdin_fd, 0) {
                return fail();
            }
            if !self.dir.is_null() && libc::chdir(self.dir) != 0 {
                return fail();
            }
            if let Some(fd) = self.listen_fd {
                if !move_fd(fd, LISTEN_FD) {
                    return fail();
                }
            }
            if let Some(room) = self.block.pid_room {
                // The room and the string's NUL after it, inside the arena.
                let room = std::slice::from_raw_parts_mut(room, PID_ROOM + 1);
                write_digits(room, libc::getpid() as u64);
            }
            libc::execve(
                self.block.program,
                self.block.argv.as_ptr(),
                self.block.envp.as_ptr(),
            );
            fail()
        }
    }
}

/// The cloned child's entry: set up, exec; on failure record the errno and exit 127.
#[allow(unsafe_code)]
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildSetup` the suspended parent passed to clone.
    unsafe {
        let setup = &mut *arg.cast::<ChildSetup<'_>>();
        let errno = setup.run();
        std::ptr::write_volatile(std::ptr::addr_of_mut!(setup.errno), errno);
        libc::_exit(127)
    }
}

/// `dup2(from, to)`, or, when `from` already is `to`, clear its close-on-exec flag.
#[allow(unsafe_code)]
fn move_fd(from: libc::c_int, to: libc::c_int) -> bool {
    // SAFETY: fcntl and dup2 take plain integers.
    unsafe {
        if from == to {
            let flags = libc::fcntl(from, libc::F_GETFD);
            flags >= 0 && libc::fcntl(from, libc::F_SETFD, flags & !libc::FD_CLOEXEC) >= 0
        } else {
            libc::dup2(from, to) >= 0
        }
    }
}

/// Writes `n`'s decimal digits at the start of `room` followed by a NUL (at most
/// `room.len() - 1` digits: the high ones are cut). No allocation.
fn write_digits(room: &mut [u8], mut n: u64) {
    let Some(max) = room.len().checked_sub(1) else {
        return;
    };
    let mut digits = [0u8; PID_ROOM];
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 || len == PID_ROOM {
            break;
        }
    }
    let len = len.min(max);
    for (i, d) in room.iter_mut().take(len).enumerate() {
        *d = digits[len - 1 - i];
    }
    room[len] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_digits_writes_the_pid_and_ends_the_string() {
        let mut buf = [b'0'; PID_ROOM + 1];
        buf[PID_ROOM] = 0;
        write_digits(&mut buf, 40213);
        assert_eq!(&buf[..6], b"40213\0");
        write_digits(&mut buf, u64::MAX);
        assert_eq!(&buf[..PID_ROOM], b"18446744073709551615");
        assert_eq!(buf[PID_ROOM], 0);
    }

    #[test]
    fn the_accept_queue_length_counts_connections_not_yet_accepted() {
        let s = listening_socket().unwrap();
        assert_eq!(accept_queue_len(&s).unwrap(), 0);
        let addr = s.local_addr().unwrap().as_socket().unwrap();
        let _a = std::net::TcpStream::connect(addr).unwrap();
        let _b = std::net::TcpStream::connect(addr).unwrap();
        assert_eq!(accept_queue_len(&s).unwrap(), 2);
        let _taken = s.accept().unwrap();
        assert_eq!(accept_queue_len(&s).unwrap(), 1);
    }

    #[test]
    fn auto_detects_unless_the_command_names_fd3_or_a_mode_was_detected() {
        let cfg = |socket: &str, cmd: &str| -> FunctionConfig {
            toml::from_str(&format!(
                "name = \"f\"\ntopics = [\"#\"]\ncommand = {cmd}\n{socket}"
            ))
            .unwrap()
        };
        let py = "[\"python3\", \"fn.py\"]";
        let uv = "[\"uvicorn\", \"--fd\", \"3\", \"app:app\"]";
        assert_eq!(Plan::of(&cfg("", py), None), Plan::Detect);
        assert_eq!(Plan::of(&cfg("", py), Some(SocketMode::Port)), Plan::Port);
        assert_eq!(
            Plan::of(&cfg("", py), Some(SocketMode::Inherit)),
            Plan::Inherit
        );
        assert_eq!(Plan::of(&cfg("", uv), None), Plan::Inherit);
        assert_eq!(Plan::of(&cfg("socket = \"port\"", uv), None), Plan::Port);
        assert_eq!(
            Plan::of(&cfg("socket = \"inherit\"", py), None),
            Plan::Inherit
        );
    }

    #[test]
    fn detect_gives_port_another_free_port_than_fd3() {
        let cfg: FunctionConfig =
            toml::from_str("name = \"f\"\ntopics = [\"#\"]\ncommand = [\"sh\"]").unwrap();
        let p = prepare(&cfg, Plan::Detect).unwrap();
        assert!(p.listener.is_some());
        assert_ne!(
            p.port_addr, p.addr,
            "PORT must not name the port fd 3 holds"
        );
        std::net::TcpListener::bind(p.port_addr).expect("PORT is free to bind");
        let p = prepare(&cfg, Plan::Inherit).unwrap();
        assert_eq!(p.port_addr, p.addr);
    }

    #[test]
    fn programs_are_found_in_path_and_paths_are_kept() {
        assert_eq!(
            resolve(
                OsStr::new("sh"),
                Some(OsStr::new("/nonexistent:/bin:/usr/bin")),
                None
            )
            .map(|p| p.file_name().unwrap().to_owned()),
            Some("sh".into())
        );
        assert_eq!(resolve(OsStr::new("no-such-program-xyz"), None, None), None);
        assert_eq!(
            resolve(OsStr::new("./fn.py"), None, None),
            Some(PathBuf::from("./fn.py"))
        );
    }

    #[test]
    fn the_exec_block_is_null_terminated_and_refuses_nul_bytes() {
        let env = vec![("A".into(), "1".into())];
        let b = ExecBlock::new(Path::new("/bin/sh"), &["sh".into()], &env, true).unwrap();
        assert_eq!((b.argv.len(), b.envp.len()), (2, 3));
        assert!(b.argv[1].is_null() && b.envp[2].is_null());
        assert!(b.pid_room.is_some());
        assert!(ExecBlock::new(Path::new("/bin/sh"), &["s\0h".into()], &env, false).is_none());
    }
}
