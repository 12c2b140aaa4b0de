//! The io_uring floor's ring: the one module of sluice-bench allowed `unsafe` (ADR 0016).
//!
//! Owns: one io_uring instance (single issuer, deferred task work: completions are run inside
//! this thread's `io_uring_enter` and nowhere else), a provided-buffer ring of [`BUFFERS`] ×
//! [`BUFFER_LEN`] bytes that multishot receives fill, a registered file table (connections
//! are named by slot, sparing each operation a descriptor lookup), and the send buffers of
//! the writes in flight. Its API is safe: an operation's memory is owned here from the push until its
//! completion is reaped ([`Ring::push_send`] takes the bytes and [`Event::Sent`] gives them
//! back; a received buffer is lent as a [`RecvBuf`] until [`Ring::recycle`]), and a connection
//! accepted by the kernel comes out as an owned [`TcpStream`]. Does not own: what the bytes
//! mean or when a connection closes (the floor's loop, [`super`]).
//!
//! Invariants: every `unsafe` block has a SAFETY comment; memory the kernel may touch (the
//! buffer ring, the provided buffers, the send buffers of operations in flight) is never freed
//! while the ring lives, and is leaked when it is dropped (the kernel cancels a closed ring's
//! requests asynchronously; a floor runs until it is killed, so nothing is lost).

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::{BufRingEntry, Fd, Fixed};
use io_uring::{cqueue, opcode, squeue, IoUring};

/// Provided buffers in the ring (a power of two, at most 32,768).
pub const BUFFERS: u16 = 1024;
/// Bytes of one provided buffer: one completion carries at most this much of a connection's
/// stream (the epoll floor reads 16 KiB at a time, but a device has at most a few packets of
/// ≤ 1 KiB queued at 10 msg/s). The buffers take `BUFFERS × BUFFER_LEN` = 4 MiB of address
/// space, touched as they are used.
pub const BUFFER_LEN: u32 = 4096;
/// The buffer group id of the ring's provided buffers.
const GROUP: u16 = 0;
/// Submission queue entries; pushes beyond them submit early.
const SQ_ENTRIES: u32 = 4096;
/// Completion queue entries (the kernel keeps overflow beyond them on a list).
const CQ_ENTRIES: u32 = 16384;
/// Slots of the registered file table at most: connections below the table's size are
/// addressed as fixed files, so a receive or send skips the per-operation descriptor lookup
/// (`fget`); above it, by descriptor. The kernel refuses a table larger than RLIMIT_NOFILE,
/// so the size is halved until it takes it (down to [`MIN_FIXED_FILES`]).
const FIXED_FILES: u32 = 32768;
const MIN_FIXED_FILES: u32 = 256;

const ACCEPT: u64 = 1;
const RECV: u64 = 2;
const SEND: u64 = 3;

fn user_data(kind: u64, conn: u32) -> u64 {
    (u64::from(conn) << 8) | kind
}

/// A provided buffer the kernel filled for a receive, lent to the loop until
/// [`Ring::recycle`] (not `Clone`: a buffer is given back once).
#[derive(Debug)]
pub struct RecvBuf {
    bid: u16,
    len: u32,
}

/// One completion, decoded.
#[derive(Debug)]
pub enum Event {
    /// The multishot accept produced a connection (or an error); `more`: it stays armed.
    Accepted {
        result: io::Result<TcpStream>,
        more: bool,
    },
    /// Connection `conn`'s multishot receive: bytes, `None` at end of stream, or an error;
    /// `more`: it stays armed (else it must be pushed again to receive more).
    Received {
        conn: u32,
        result: io::Result<Option<RecvBuf>>,
        more: bool,
    },
    /// Connection `conn`'s send finished: bytes written, and the buffer given back.
    Sent {
        conn: u32,
        result: io::Result<usize>,
        buf: Vec<u8>,
    },
}

/// The ring, its provided buffers and the send buffers in flight.
pub struct Ring {
    ring: IoUring,
    /// `BUFFERS` entries, page-aligned, shared with the kernel; never freed.
    entries: *mut BufRingEntry,
    /// `BUFFERS × BUFFER_LEN` bytes; never freed. Only a buffer the kernel handed over in a
    /// completion and not yet recycled is read, through a slice of that buffer alone.
    buffers: *mut u8,
    /// The buffer ring's tail as this thread has filled it (published before each enter).
    tail: u16,
    /// Send buffers of the writes in flight, by connection (one write per connection at a time).
    sends: Vec<Option<Vec<u8>>>,
    /// Slots of the sparse file table the kernel took (0: none).
    fixed_files: u32,
    /// Connections whose socket is in the file table (by id).
    registered: Vec<bool>,
}

impl Ring {
    /// A ring with deferred task work (falling back to a plain ring where the kernel refuses
    /// it) and its provided-buffer ring registered; fails where the kernel has no io_uring or
    /// no buffer rings (before 5.19), or io_uring is disabled.
    pub fn new() -> io::Result<Ring> {
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_cqsize(CQ_ENTRIES)
            .build(SQ_ENTRIES)
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(CQ_ENTRIES)
                    .build(SQ_ENTRIES)
            })?;
        let layout = std::alloc::Layout::from_size_align(
            usize::from(BUFFERS) * std::mem::size_of::<BufRingEntry>(),
            4096,
        )
        .map_err(io::Error::other)?;
        // SAFETY: the layout has a non-zero size (BUFFERS > 0 entries of 16 bytes).
        let entries = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<BufRingEntry>();
        if entries.is_null() {
            return Err(io::ErrorKind::OutOfMemory.into());
        }
        let total = usize::from(BUFFERS) * BUFFER_LEN as usize;
        let buffers = Box::leak(vec![0u8; total].into_boxed_slice()).as_mut_ptr();
        let mut this = Ring {
            ring,
            entries,
            buffers,
            tail: 0,
            sends: Vec::new(),
            fixed_files: 0,
            registered: Vec::new(),
        };
        let mut files = FIXED_FILES;
        while files >= MIN_FIXED_FILES {
            if this.ring.submitter().register_files_sparse(files).is_ok() {
                this.fixed_files = files;
                break;
            }
            files /= 2;
        }
        // SAFETY: `entries` points to BUFFERS page-aligned entries that are never freed (see
        // the struct), so they stay valid for as long as the kernel may use them.
        unsafe {
            this.ring.submitter().register_buf_ring_with_flags(
                entries as u64,
                BUFFERS,
                GROUP,
                0,
            )?;
        }
        for bid in 0..BUFFERS {
            this.put_buffer(bid);
        }
        this.publish_tail();
        Ok(this)
    }

    /// Write buffer `bid` into the ring's next free entry (visible at the next publish).
    fn put_buffer(&mut self, bid: u16) {
        let index = usize::from(self.tail & (BUFFERS - 1));
        // SAFETY: `index < BUFFERS`, so the entry is inside the allocation; the kernel reads
        // only entries before the published tail, and this one is at or after it (at most
        // BUFFERS buffers are ever in the ring, and `bid` is not among them: it was handed to
        // this thread by a completion, or never given out). The buffer address is inside the
        // never-freed buffer allocation.
        unsafe {
            let entry = &mut *self.entries.add(index);
            entry.set_addr(self.buffers.add(usize::from(bid) * BUFFER_LEN as usize) as u64);
            entry.set_len(BUFFER_LEN);
            entry.set_bid(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Make the buffers put back so far visible to the kernel.
    fn publish_tail(&self) {
        // SAFETY: `entries` is the page-aligned first entry of the registered ring; its tail
        // is a u16 the kernel only reads (with acquire), so storing with release through an
        // atomic is the protocol of io_uring_buf_ring_advance.
        unsafe {
            let tail = BufRingEntry::tail(self.entries).cast_mut();
            AtomicU16::from_ptr(tail).store(self.tail, Ordering::Release);
        }
    }

    /// The bytes the kernel received into `buf`.
    pub fn data(&self, buf: &RecvBuf) -> &[u8] {
        // SAFETY: `buf` came from a completion and is not recycled yet (recycling consumes
        // it), so the kernel will not write into this buffer while the slice lives; `len`
        // is the completion's result, at most BUFFER_LEN.
        unsafe {
            std::slice::from_raw_parts(
                self.buffers
                    .add(usize::from(buf.bid) * BUFFER_LEN as usize)
                    .cast_const(),
                buf.len as usize,
            )
        }
    }

    /// Give `buf` back to the kernel (at the next enter).
    pub fn recycle(&mut self, buf: RecvBuf) {
        self.put_buffer(buf.bid);
    }

    /// Push an entry, submitting what is queued first if the submission queue is full.
    ///
    /// # Safety
    /// The memory `entry` refers to must stay valid until its completion is reaped.
    unsafe fn push(&mut self, entry: squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: passed on from the caller.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    /// Arm a multishot accept on `listener` (it must outlive the ring's use of it).
    pub fn push_accept(&mut self, listener: &TcpListener) -> io::Result<()> {
        let entry = opcode::AcceptMulti::new(Fd(listener.as_raw_fd()))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(ACCEPT, 0));
        // SAFETY: a multishot accept refers to no memory (no address buffer), only to the fd.
        unsafe { self.push(entry) }
    }

    /// Put connection `conn`'s socket `fd` in the registered file table when there is room,
    /// so that its receives and sends name it by slot (one system call per connection).
    pub fn attach(&mut self, conn: u32, fd: RawFd) {
        if conn >= self.fixed_files {
            return;
        }
        let ok = self
            .ring
            .submitter()
            .register_files_update(conn, &[fd])
            .is_ok();
        let slot = conn as usize;
        if self.registered.len() <= slot {
            self.registered.resize(slot + 1, false);
        }
        self.registered[slot] = ok;
    }

    /// Take connection `conn`'s socket out of the file table (before its descriptor is closed:
    /// the table holds a reference of its own). Call once none of its operations is in flight.
    pub fn detach(&mut self, conn: u32) {
        if let Some(r) = self.registered.get_mut(conn as usize) {
            if std::mem::take(r) {
                let _ = self.ring.submitter().register_files_update(conn, &[-1]);
            }
        }
    }

    fn is_fixed(&self, conn: u32) -> bool {
        self.registered.get(conn as usize).copied().unwrap_or(false)
    }

    /// Arm a multishot receive on connection `conn`'s socket `fd`, into the provided buffers.
    pub fn push_recv(&mut self, conn: u32, fd: RawFd) -> io::Result<()> {
        let entry = if self.is_fixed(conn) {
            opcode::RecvMulti::new(Fixed(conn), GROUP).build()
        } else {
            opcode::RecvMulti::new(Fd(fd), GROUP).build()
        }
        .user_data(user_data(RECV, conn));
        // SAFETY: the receive writes only into provided buffers, which are never freed.
        unsafe { self.push(entry) }
    }

    /// Write `buf` to connection `conn`'s socket `fd`; the buffer comes back in
    /// [`Event::Sent`]. One write per connection at a time.
    pub fn push_send(&mut self, conn: u32, fd: RawFd, buf: Vec<u8>) -> io::Result<()> {
        let slot = conn as usize;
        if self.sends.len() <= slot {
            self.sends.resize_with(slot + 1, || None);
        }
        if self.sends[slot].is_some() {
            return Err(io::Error::other(
                "a write is already in flight on this connection",
            ));
        }
        let len = u32::try_from(buf.len()).map_err(io::Error::other)?;
        let entry = if self.is_fixed(conn) {
            opcode::Send::new(Fixed(conn), buf.as_ptr(), len).build()
        } else {
            opcode::Send::new(Fd(fd), buf.as_ptr(), len).build()
        }
        .user_data(user_data(SEND, conn));
        // Kept here (its heap block does not move with the Vec) until the completion.
        self.sends[slot] = Some(buf);
        // SAFETY: the buffer's heap block is owned by `self.sends` until the completion is
        // reaped in `complete` (which takes it out then), and leaked if the ring is dropped.
        unsafe { self.push(entry) }
    }

    /// Submit what is queued and wait for at least `want` completions (running the deferred
    /// task work of the receives and sends in this one call).
    pub fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        self.publish_tail();
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // The completion queue is full with overflow pending: reap first.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Reap every completion into `events`.
    pub fn complete(&mut self, events: &mut Vec<Event>) {
        let mut stray = Vec::new();
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            let (res, flags, ud) = (cqe.result(), cqe.flags(), cqe.user_data());
            let conn = (ud >> 8) as u32;
            let error = || io::Error::from_raw_os_error(-res);
            match ud & 0xff {
                ACCEPT => events.push(Event::Accepted {
                    result: if res >= 0 {
                        // SAFETY: a non-negative accept result is a new descriptor the kernel
                        // just installed in this process for this completion; nothing else
                        // owns it.
                        Ok(unsafe { TcpStream::from_raw_fd(res) })
                    } else {
                        Err(error())
                    },
                    more: cqueue::more(flags),
                }),
                RECV => {
                    let bid = cqueue::buffer_select(flags);
                    let result = match (res, bid) {
                        (1.., Some(bid)) => Ok(Some(RecvBuf {
                            bid,
                            len: res as u32,
                        })),
                        (1.., None) => Err(io::Error::other("receive without a buffer")),
                        (0, _) => Ok(None),
                        _ => Err(error()),
                    };
                    if res <= 0 {
                        stray.extend(bid);
                    }
                    events.push(Event::Received {
                        conn,
                        result,
                        more: cqueue::more(flags),
                    });
                }
                SEND => {
                    let buf = self
                        .sends
                        .get_mut(conn as usize)
                        .and_then(Option::take)
                        .unwrap_or_default();
                    events.push(Event::Sent {
                        conn,
                        result: if res >= 0 {
                            Ok(res as usize)
                        } else {
                            Err(error())
                        },
                        buf,
                    });
                }
                _ => {}
            }
        }
        drop(cq);
        for bid in stray {
            self.put_buffer(bid);
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The kernel cancels the closed ring's sends asynchronously: their buffers are leaked
        // rather than freed under it (the buffer ring and provided buffers already are).
        std::mem::forget(std::mem::take(&mut self.sends));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_goes_into_the_file_table_under_the_process_file_limit() {
        // The table is sized within RLIMIT_NOFILE (20,000 here, below FIXED_FILES): a table
        // the kernel refuses would leave every operation on plain descriptors.
        let mut ring = Ring::new().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        ring.attach(0, stream.as_raw_fd());
        assert!(
            ring.is_fixed(0),
            "the socket is addressed by its file-table slot"
        );
        ring.detach(0);
        assert!(!ring.is_fixed(0));
    }
}
