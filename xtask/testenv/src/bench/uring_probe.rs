//! `bench proxy`'s io_uring probe: the least a completion-based relay can spend per connection.
//!
//! Not a product path. It relays plain TCP on one thread with io_uring and nothing else: no
//! metrics, limits, timeouts, routes or splice; a 16 KiB buffer per direction, taken from a
//! free list when a connection opens. What it spends per connection is close to what the
//! kernel spends for any relay doing the same socket work, so it tells the kernel's floor
//! from the user space and the readiness plumbing (`epoll_ctl`, `epoll_wait`) of the other
//! contenders.
//!
//! One ring. A multishot accept; per connection: a blocking upstream socket (io_uring arms
//! its own poll for blocking sockets), its connect, then per direction a receive into the
//! direction's buffer followed by sends until it is written, then the next receive. A
//! receive of 0 bytes half-closes the other socket with a direct `shutdown(2)` (io_uring
//! hands `IORING_OP_SHUTDOWN` to its worker threads, which costs more than the call); both
//! directions done, the two descriptors are closed by the ring. An error shuts both sockets
//! down so that the operations still in flight complete, then closes them.

use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd as _, IntoRawFd as _, OwnedFd, RawFd};

use anyhow::Context as _;
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use socket2::{Domain, SockAddr, SockRef, Socket, Type};

/// Bytes one receive moves (the connection phases move one byte each way).
const BUFFER: usize = 16 * 1024;
const RING_ENTRIES: u32 = 4096;

/// What a completion is for: the low 4 bits of its `user_data`; the slab key is above them.
const ACCEPT: u64 = 0;
const CONNECT: u64 = 1;
/// Receives and sends client to upstream; the same plus 1 upstream to client.
const RECV: u64 = 2;
const RECV_BACK: u64 = RECV + 1;
const SEND: u64 = 4;
const SEND_BACK: u64 = SEND + 1;
const CLOSE: u64 = 6;

fn user_data(key: usize, op: u64) -> u64 {
    (key as u64) << 4 | op
}

/// Whether this kernel lets this process make a ring (seccomp, `kernel.io_uring_disabled`).
pub fn available() -> bool {
    IoUring::new(8).is_ok()
}

/// One direction: its buffer and how much of it is still to send.
struct Direction {
    buffer: Box<[u8]>,
    len: usize,
    sent: usize,
    /// The source's receive returned 0 bytes.
    eof: bool,
    /// The source's EOF was passed on.
    done: bool,
}

struct Conn {
    /// Client, upstream.
    sockets: [OwnedFd; 2],
    connected: bool,
    directions: [Direction; 2],
    /// Operations submitted and not completed: the connection (and its buffers, which the
    /// kernel may still write) stays until none is left.
    in_flight: u32,
    failed: bool,
}

struct Probe {
    ring: IoUring,
    listener: TcpListener,
    upstream: SockAddr,
    upstream_domain: Domain,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    buffers: Vec<Box<[u8]>>,
}

/// Relays connections to `listen` towards `upstream` until the process is killed.
pub fn serve(listen: SocketAddr, upstream: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
    // Accepted sockets inherit it, as from proxy-core's listener.
    SockRef::from(&listener).set_tcp_nodelay(true)?;
    let ring = IoUring::builder()
        .setup_single_issuer()
        .setup_coop_taskrun()
        .setup_defer_taskrun()
        .build(RING_ENTRIES)
        .context("making an io_uring")?;
    let mut probe = Probe {
        ring,
        listener,
        upstream: SockAddr::from(upstream),
        upstream_domain: Domain::for_address(upstream),
        conns: Vec::new(),
        free: Vec::new(),
        buffers: Vec::new(),
    };
    probe.accept()?;
    loop {
        probe
            .ring
            .submit_and_wait(1)
            .context("waiting for completions")?;
        // Collected first: handling a completion pushes submissions to the same ring.
        let completed: Vec<cqueue::Entry> = probe.ring.completion().collect();
        for entry in completed {
            probe.complete(&entry)?;
        }
    }
}

impl Probe {
    /// Queues `entry`, submitting what is queued when the submission queue is full.
    ///
    /// Every entry built here points at memory that outlives its operation: a connection's
    /// buffers and sockets stay until its `in_flight` count is 0, the upstream address and the
    /// listener for the probe's whole life.
    fn push(&mut self, entry: &squeue::Entry) -> anyhow::Result<()> {
        loop {
            // SAFETY: see above: the buffers, addresses and descriptors `entry` names stay
            // valid and unmoved (boxed slices, fields of `self`) until its completion arrives.
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                return Ok(());
            }
            self.ring.submit().context("submitting")?;
        }
    }

    fn accept(&mut self) -> anyhow::Result<()> {
        let entry = opcode::AcceptMulti::new(types::Fd(self.listener.as_raw_fd()))
            .build()
            .user_data(user_data(0, ACCEPT));
        self.push(&entry)
    }

    fn complete(&mut self, entry: &cqueue::Entry) -> anyhow::Result<()> {
        let (op, key) = (entry.user_data() & 15, (entry.user_data() >> 4) as usize);
        let result = entry.result();
        if op == ACCEPT {
            if !cqueue::more(entry.flags()) {
                self.accept()?;
            }
            if result >= 0 {
                // SAFETY: a successful accept's result is a new descriptor that nothing else
                // owns.
                let client = unsafe { OwnedFd::from_raw_fd(result) };
                self.open(client)?;
            }
            return Ok(());
        }
        if op == CLOSE {
            return Ok(());
        }
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return Ok(());
        };
        conn.in_flight -= 1;
        // A receive or send's direction is the low bit of its operation.
        let direction = (op & 1) as usize;
        match (op, usize::try_from(result)) {
            (_, Err(_)) => conn.failed = true,
            (CONNECT, Ok(_)) => {
                conn.connected = true;
                self.receive(key, 1)?;
                self.send(key, 0)?;
            }
            (RECV | RECV_BACK, Ok(len)) => {
                let way = &mut conn.directions[direction];
                (way.len, way.sent, way.eof) = (len, 0, len == 0);
                // Bytes from the client wait for the connect.
                if direction == 1 || conn.connected {
                    self.send(key, direction)?;
                }
            }
            (SEND | SEND_BACK, Ok(sent)) => {
                let way = &mut conn.directions[direction];
                way.sent += sent;
                if way.sent < way.len {
                    self.send(key, direction)?;
                } else {
                    self.receive(key, direction)?;
                }
            }
            _ => {}
        }
        self.settle(key)
    }

    /// Takes a slot and a buffer pair for `client`, connects its upstream, starts reading it.
    fn open(&mut self, client: OwnedFd) -> anyhow::Result<()> {
        let upstream = Socket::new(self.upstream_domain, Type::STREAM, None)?;
        upstream.set_tcp_nodelay(true)?;
        let mut direction = || Direction {
            buffer: self
                .buffers
                .pop()
                .unwrap_or_else(|| vec![0; BUFFER].into_boxed_slice()),
            len: 0,
            sent: 0,
            eof: false,
            done: false,
        };
        let directions = [direction(), direction()];
        let key = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        let upstream_fd = upstream.as_raw_fd();
        self.conns[key] = Some(Conn {
            sockets: [client, OwnedFd::from(upstream)],
            connected: false,
            directions,
            in_flight: 1,
            failed: false,
        });
        let connect = opcode::Connect::new(
            types::Fd(upstream_fd),
            self.upstream.as_ptr().cast(),
            self.upstream.len(),
        )
        .build()
        .user_data(user_data(key, CONNECT));
        self.push(&connect)?;
        self.receive(key, 0)
    }

    /// Reads the source of `direction` into its buffer, unless that direction is done.
    fn receive(&mut self, key: usize, direction: usize) -> anyhow::Result<()> {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return Ok(());
        };
        let source: RawFd = conn.sockets[direction].as_raw_fd();
        let way = &mut conn.directions[direction];
        if way.done || conn.failed {
            return Ok(());
        }
        conn.in_flight += 1;
        let entry = opcode::Recv::new(types::Fd(source), way.buffer.as_mut_ptr(), BUFFER as u32)
            .build()
            .user_data(user_data(key, RECV + direction as u64));
        self.push(&entry)
    }

    /// Sends what `direction` holds, or passes its EOF on; nothing before its first receive.
    fn send(&mut self, key: usize, direction: usize) -> anyhow::Result<()> {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return Ok(());
        };
        let destination = &conn.sockets[1 - direction];
        let way = &mut conn.directions[direction];
        if way.sent == way.len {
            if !way.eof || way.done {
                return Ok(());
            }
            // EOF: half-close the other side. A failure ends the connection in `settle`.
            way.done = true;
            if SockRef::from(destination)
                .shutdown(Shutdown::Write)
                .is_err()
            {
                conn.failed = true;
            }
            return Ok(());
        }
        let pending = &way.buffer[way.sent..way.len];
        let entry = opcode::Send::new(
            types::Fd(destination.as_raw_fd()),
            pending.as_ptr(),
            pending.len() as u32,
        )
        .build()
        .user_data(user_data(key, SEND + direction as u64));
        conn.in_flight += 1;
        self.push(&entry)
    }

    /// Closes `key` once both directions are done or it failed, and nothing is in flight.
    fn settle(&mut self, key: usize) -> anyhow::Result<()> {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return Ok(());
        };
        let finished = conn.failed || conn.directions.iter().all(|way| way.done);
        if !finished {
            return Ok(());
        }
        if conn.in_flight > 0 {
            // Ends the receives and sends still waiting; their completions come back here.
            for socket in &conn.sockets {
                let _ = SockRef::from(socket).shutdown(Shutdown::Both);
            }
            return Ok(());
        }
        let Some(conn) = self.conns[key].take() else {
            return Ok(());
        };
        self.free.push(key);
        for way in conn.directions {
            self.buffers.push(way.buffer);
        }
        for socket in conn.sockets {
            let close = opcode::Close::new(types::Fd(socket.into_raw_fd()))
                .build()
                .flags(squeue::Flags::SKIP_SUCCESS)
                .user_data(user_data(key, CLOSE));
            self.push(&close)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};
    use std::net::TcpStream;
    use std::time::Duration;

    use super::*;

    /// The probe relays both ways and passes each half-close on. Where the kernel's sysctl
    /// forbids rings, the bench leaves the probe out and so does this test.
    #[test]
    fn relays_both_ways_and_passes_half_closes_on() {
        let forbidden = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
            .is_ok_and(|value| value.trim() == "2");
        if forbidden {
            assert!(!available(), "io_uring_disabled is 2, yet a ring was made");
            eprintln!("io_uring is disabled on this machine: the bench leaves the probe out");
            return;
        }
        assert!(available(), "this process cannot make an io_uring");
        // An upstream that answers what it read, reversed, after the client's FIN.
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in upstream.incoming() {
                let mut stream = stream.unwrap();
                let mut read = Vec::new();
                stream.read_to_end(&mut read).unwrap();
                read.reverse();
                stream.write_all(&read).unwrap();
            }
        });
        let listen = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        std::thread::spawn(move || serve(listen, upstream_addr));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        for round in 0..3u8 {
            let mut client = loop {
                match TcpStream::connect(listen) {
                    Ok(client) => break client,
                    Err(error) if std::time::Instant::now() < deadline => {
                        eprintln!("probe not listening yet: {error}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(error) => panic!("the probe never listened: {error}"),
                }
            };
            client
                .set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            // More than one buffer, so that a receive is followed by another.
            let sent: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8 ^ round).collect();
            client.write_all(&sent).unwrap();
            client.shutdown(Shutdown::Write).unwrap();
            let mut received = Vec::new();
            client.read_to_end(&mut received).unwrap();
            let mut expected = sent.clone();
            expected.reverse();
            assert_eq!(received.len(), expected.len(), "round {round}");
            assert!(received == expected, "round {round}: the bytes differ");
        }
    }
}
