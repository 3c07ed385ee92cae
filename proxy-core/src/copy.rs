//! One-way byte copy: the adaptive buffered path, the Linux `splice(2)` path, and the live
//! byte counters both of them update.
//!
//! Each function here copies one direction until the reader reports EOF, then half-closes the
//! writer (FIN) so the other direction can keep flowing. Errors (reset, broken pipe) are
//! returned as is; the [`relay`](crate::relay) module decides which of them are normal endings.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use std::io::Read as _;

use futures::FutureExt;
use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::socket;

/// How a TCP-to-TCP relay moves bytes. Chosen per connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CopyMode {
    /// [`Splice`](CopyMode::Splice) on Linux, [`Buffered`](CopyMode::Buffered) elsewhere.
    #[default]
    Auto,
    /// Read into a user-space buffer and write it out. The buffer starts at 1 KiB and grows
    /// with the bytes moved (16 KiB after 128 KiB, 256 KiB after 10 MiB), so idle connections
    /// stay cheap and bulk transfers get large reads (ztunnel's scheme). Works for any stream.
    Buffered,
    /// Linux only: socket -> pipe -> socket with `splice(2)` for streaming data; the bytes
    /// never enter user space. The first bytes of each direction go through the buffered
    /// path; once a read fills a 16 KiB buffer the direction borrows a pipe from the
    /// process-wide [pool](crate::pipe) while data keeps coming. Stays buffered when the pipe
    /// budget is spent, when a pipe cannot be opened, or on other systems.
    Splice,
}

impl CopyMode {
    /// The mode actually used on this system for a TCP-to-TCP relay.
    pub fn resolve(self) -> CopyMode {
        match self {
            CopyMode::Auto | CopyMode::Splice if cfg!(target_os = "linux") => CopyMode::Splice,
            _ => CopyMode::Buffered,
        }
    }
}

/// The direction of a copy, named from the proxy's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Bytes read from the client and written to the upstream.
    ToUpstream,
    /// Bytes read from the upstream and written to the client.
    ToClient,
}

impl Direction {
    /// A short lowercase name, used in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::ToUpstream => "to_upstream",
            Direction::ToClient => "to_client",
        }
    }
}

/// Live byte counters of one connection, shared between the copy tasks and any reader.
///
/// Bytes are counted when they have been *written* to the destination, on both copy paths
/// (the splice path adds up `splice(2)` return values). Reading never blocks the copy.
#[derive(Debug)]
pub struct RelayCounters {
    to_upstream: AtomicU64,
    to_client: AtomicU64,
    started: Instant,
    /// Milliseconds after `started` when bytes last moved; drives the idle timeout.
    last_activity_ms: AtomicU64,
    /// Which way bytes last moved: 0 none yet, 1 to the upstream, 2 to the client.
    last_direction: AtomicU8,
}

impl Default for RelayCounters {
    fn default() -> Self {
        Self::new()
    }
}

impl RelayCounters {
    /// New counters, with the clock started now.
    pub fn new() -> Self {
        Self {
            to_upstream: AtomicU64::new(0),
            to_client: AtomicU64::new(0),
            started: Instant::now(),
            last_activity_ms: AtomicU64::new(0),
            last_direction: AtomicU8::new(0),
        }
    }

    /// Bytes written to the upstream so far.
    pub fn to_upstream(&self) -> u64 {
        self.to_upstream.load(Ordering::Relaxed)
    }

    /// Bytes written to the client so far.
    pub fn to_client(&self) -> u64 {
        self.to_client.load(Ordering::Relaxed)
    }

    /// Bytes written in `direction` so far.
    pub fn get(&self, direction: Direction) -> u64 {
        match direction {
            Direction::ToUpstream => self.to_upstream(),
            Direction::ToClient => self.to_client(),
        }
    }

    /// When the counters were created.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// When bytes last moved in either direction (the start if none moved yet), to the
    /// millisecond.
    pub fn last_activity(&self) -> Instant {
        self.started + Duration::from_millis(self.last_activity_ms.load(Ordering::Relaxed))
    }

    /// Which way bytes moved last (`None` before any moved). A connection whose last bytes went
    /// to the client has, as far as a byte stream can tell, been answered.
    pub fn last_direction(&self) -> Option<Direction> {
        match self.last_direction.load(Ordering::Relaxed) {
            1 => Some(Direction::ToUpstream),
            2 => Some(Direction::ToClient),
            _ => None,
        }
    }

    pub(crate) fn record(&self, direction: Direction, bytes: usize) {
        let (counter, code) = match direction {
            Direction::ToUpstream => (&self.to_upstream, 1),
            Direction::ToClient => (&self.to_client, 2),
        };
        self.last_direction.store(code, Ordering::Relaxed);
        counter.fetch_add(bytes as u64, Ordering::Relaxed);
        let elapsed = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_activity_ms.fetch_max(elapsed, Ordering::Relaxed);
    }
}

/// Buffer sizes and the bytes after which they apply (ztunnel's `copy.rs` scheme).
const BUFFER_STEPS: [(u64, usize); 3] =
    [(0, 1024), (128 * 1024, 16 * 1024), (10 << 20, 256 * 1024)];

/// A copy buffer that grows with the bytes it has moved.
#[derive(Debug, Default)]
pub(crate) struct AdaptiveBuffer {
    buf: Vec<u8>,
    moved: u64,
}

impl AdaptiveBuffer {
    /// The buffer to read into, sized for the bytes moved so far. Allocates on first use.
    fn spare(&mut self) -> &mut [u8] {
        let wanted = BUFFER_STEPS
            .iter()
            .rev()
            .find(|(after, _)| self.moved >= *after)
            .map_or(BUFFER_STEPS[0].1, |(_, size)| *size);
        if self.buf.len() < wanted {
            self.buf.resize(wanted, 0);
        }
        &mut self.buf
    }

    fn filled(&self, len: usize) -> &[u8] {
        &self.buf[..len]
    }

    fn advance(&mut self, bytes: usize) {
        self.moved += bytes as u64;
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.buf.len()
    }
}

/// Copies `reader` to `writer` with an adaptive buffer until EOF, then shuts `writer` down.
///
/// Works for any stream (TLS, tunnels). `writer` is flushed only when `reader` has nothing
/// ready, so a TLS writer emits few, full records and a plain socket pays no extra syscalls.
pub(crate) async fn copy_stream<R, W>(
    reader: &mut R,
    writer: &mut W,
    counters: &RelayCounters,
    direction: Direction,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + ?Sized,
    W: AsyncWrite + Unpin + ?Sized,
{
    let mut buffer = AdaptiveBuffer::default();
    loop {
        // Poll once without waiting; flush pending output before sleeping on the reader.
        let ready = reader.read(buffer.spare()).now_or_never();
        let read = match ready {
            Some(result) => result?,
            None => {
                writer.flush().await?;
                reader.read(buffer.spare()).await?
            }
        };
        if read == 0 {
            break;
        }
        writer.write_all(buffer.filled(read)).await?;
        counters.record(direction, read);
        buffer.advance(read);
    }
    writer.flush().await?;
    writer.shutdown().await
}

/// A buffered read at least this large that fills its buffer marks a direction as streaming:
/// from then on it borrows a pipe (when the copy mode and the pipe budget allow).
pub(crate) const STREAMING_READ: usize = 16 * 1024;

/// Copies `src` to `dst` until EOF, then half-closes `dst`, unless `one_done` says the other
/// direction has finished already: then both sockets are about to be closed, and the close
/// sends the FIN (`dst` has nothing left to read, so the close cannot turn into a reset).
/// Bytes read once the FIN is in are sent with `MSG_MORE`, so they and the FIN leave in one
/// segment.
///
/// Works on shared references, so both directions of a connection run concurrently without
/// splitting the streams. With [`CopyMode::Splice`], the first bytes go through the adaptive
/// buffer; once a read fills a 16 KiB buffer the direction splices through a pipe borrowed
/// from the process-wide [pool](crate::pipe) while data keeps coming, and returns the pipe
/// whenever `src` runs dry. Without a pipe (budget spent, other systems) it stays buffered.
pub(crate) async fn copy_tcp(
    src: &TcpStream,
    dst: &TcpStream,
    mode: CopyMode,
    pipe_size: usize,
    counters: &RelayCounters,
    direction: Direction,
    one_done: &AtomicBool,
) -> io::Result<()> {
    let splice_pipe = (mode.resolve() == CopyMode::Splice).then_some(pipe_size);
    // Allocated after the first readiness, so an idle connection holds no buffer.
    let mut buffer = AdaptiveBuffer::default();
    let mut streaming = false;
    loop {
        let ready = src.ready(Interest::READABLE).await?;
        #[cfg(target_os = "linux")]
        if let Some(size) = splice_pipe.filter(|_| streaming)
            && let Some(pipe) = crate::pipe::take(size)
        {
            match splice::copy_while_ready(src, dst, pipe, counters, direction).await? {
                splice::Paused::Eof => break,
                splice::Paused::Drained(moved) => {
                    buffer.advance(moved);
                    continue;
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = splice_pipe;
        let spare = buffer.spare();
        let capacity = spare.len();
        let read = match try_io_short(src, Interest::READABLE, capacity, || {
            (&*SockRef::from(src)).read(spare)
        }) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        };
        // TCP takes a FIN only after every byte before it, and a read returns all it has: a
        // read short of the buffer after the FIN was seen took the last bytes. They go out with
        // the FIN, and the read that would return 0 is saved (as on the event loop).
        let last = read < capacity && ready.is_read_closed() && !ready.is_error();
        let mut written = 0;
        while written < read {
            dst.writable().await?;
            let rest = &buffer.filled(read)[written..];
            match try_io_short(dst, Interest::WRITABLE, rest.len(), || {
                socket::send_before_fin(dst, rest, last)
            }) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    written += n;
                    counters.record(direction, n);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Err(error),
            }
        }
        buffer.advance(read);
        if last {
            break;
        }
        streaming = read == capacity && capacity >= STREAMING_READ;
    }
    if one_done.swap(true, Ordering::Relaxed) {
        return Ok(());
    }
    socket::shutdown_write(dst)
}

/// One `read` or `write` of up to `len` bytes on `stream` under tokio's readiness tracking.
/// A short transfer (more than 0, fewer than `len` bytes) means the socket is drained (read)
/// or its send buffer full (write), so the readiness is cleared there and then, as tokio's
/// own `poll_read` does, instead of being learnt from one more syscall returning `EAGAIN`.
/// The readiness cleared is the one seen before the syscall, so an event that arrived since
/// still counts, and a closed state is never cleared.
fn try_io_short(
    stream: &TcpStream,
    interest: Interest,
    len: usize,
    io: impl FnOnce() -> io::Result<usize>,
) -> io::Result<usize> {
    let mut short = None;
    let result = stream.try_io(interest, || {
        let moved = io()?;
        if moved > 0 && moved < len {
            short = Some(moved);
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(moved)
    });
    match short {
        Some(moved) => Ok(moved),
        None => result,
    }
}

#[cfg(target_os = "linux")]
mod splice {
    //! Zero-copy through a borrowed pipe. The pipe is filled only when empty, so `EAGAIN`
    //! from `splice` always means "socket not ready" (never "pipe full/empty") and clearing
    //! the socket's readiness in `try_io` is correct.

    use std::io;

    use rustix::pipe::{SpliceFlags, splice};
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    use super::{Direction, RelayCounters};
    use crate::pipe::PooledPipe;

    const FLAGS: SpliceFlags = SpliceFlags::NONBLOCK.union(SpliceFlags::MOVE);

    /// Why [`copy_while_ready`] gave its pipe back.
    pub(super) enum Paused {
        /// `src` reached EOF; everything before it was written.
        Eof,
        /// `src` has nothing to read now; this many bytes were moved, all written.
        Drained(usize),
    }

    /// Splices `src` to `dst` through `pipe` until `src` would block or ends. The pipe goes
    /// back to the pool empty when this returns, or is closed if this fails or is dropped
    /// half way.
    pub(super) async fn copy_while_ready(
        src: &TcpStream,
        dst: &TcpStream,
        pipe: PooledPipe,
        counters: &RelayCounters,
        direction: Direction,
    ) -> io::Result<Paused> {
        let Some((pipe_in, pipe_out, capacity)) = pipe.ends() else {
            return Ok(Paused::Drained(0));
        };
        let mut moved = 0;
        let paused = loop {
            let filled = match src.try_io(Interest::READABLE, || {
                Ok(splice(src, None, pipe_in, None, capacity, FLAGS)?)
            }) {
                Ok(0) => break Paused::Eof,
                Ok(filled) => filled,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    break Paused::Drained(moved);
                }
                Err(error) => return Err(error),
            };
            // Drain everything before reading again: FIN must follow the last byte.
            let mut in_pipe = filled;
            while in_pipe > 0 {
                dst.writable().await?;
                match dst.try_io(Interest::WRITABLE, || {
                    Ok(splice(pipe_out, None, dst, None, in_pipe, FLAGS)?)
                }) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(out) => {
                        in_pipe -= out;
                        counters.record(direction, out);
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(error) => return Err(error),
                }
            }
            moved += filled;
        };
        pipe.give_back();
        Ok(paused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_buffer_grows_with_bytes_moved() {
        let mut buffer = AdaptiveBuffer::default();
        assert_eq!(buffer.capacity(), 0, "no allocation before first use");
        assert_eq!(buffer.spare().len(), 1024);
        buffer.advance(128 * 1024);
        assert_eq!(buffer.spare().len(), 16 * 1024);
        buffer.advance(10 << 20);
        assert_eq!(buffer.spare().len(), 256 * 1024);
    }

    #[test]
    fn auto_resolves_to_splice_on_linux_only() {
        let expected = if cfg!(target_os = "linux") {
            CopyMode::Splice
        } else {
            CopyMode::Buffered
        };
        assert_eq!(CopyMode::Auto.resolve(), expected);
        assert_eq!(CopyMode::Buffered.resolve(), CopyMode::Buffered);
    }

    #[tokio::test(start_paused = true)]
    async fn counters_track_bytes_and_activity() {
        let counters = RelayCounters::new();
        tokio::time::advance(Duration::from_secs(5)).await;
        counters.record(Direction::ToClient, 10);
        counters.record(Direction::ToUpstream, 3);
        assert_eq!(counters.to_client(), 10);
        assert_eq!(counters.get(Direction::ToUpstream), 3);
        assert_eq!(
            counters.last_activity() - counters.started(),
            Duration::from_secs(5)
        );
    }
}
