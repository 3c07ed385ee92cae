//! One-way byte copy: the adaptive buffered path, the Linux `splice(2)` path, and the live
//! byte counters both of them update.
//!
//! Each function here copies one direction until the reader reports EOF, then half-closes the
//! writer (FIN) so the other direction can keep flowing. Errors (reset, broken pipe) are
//! returned as is; the [`relay`](crate::relay) module decides which of them are normal endings.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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
    /// Linux only: socket -> pipe -> socket with `splice(2)`; the bytes never enter user
    /// space. Costs two pipes (four descriptors) per connection, created lazily when the first
    /// byte arrives in each direction. Falls back to `Buffered` if a pipe cannot be created
    /// (for example at the descriptor limit) or on other systems.
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

    pub(crate) fn record(&self, direction: Direction, bytes: usize) {
        let counter = match direction {
            Direction::ToUpstream => &self.to_upstream,
            Direction::ToClient => &self.to_client,
        };
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

/// Copies `src` to `dst` until EOF, then half-closes `dst`.
///
/// Works on shared references, so both directions of a connection run concurrently without
/// splitting the streams.
pub(crate) async fn copy_tcp(
    src: &TcpStream,
    dst: &TcpStream,
    mode: CopyMode,
    pipe_size: usize,
    counters: &RelayCounters,
    direction: Direction,
) -> io::Result<()> {
    match mode.resolve() {
        #[cfg(target_os = "linux")]
        CopyMode::Splice => splice::copy(src, dst, pipe_size, counters, direction).await,
        _ => {
            let _ = pipe_size;
            copy_tcp_buffered(src, dst, counters, direction).await
        }
    }
}

/// Buffered copy between sockets, driven by readiness (no split, no lock).
async fn copy_tcp_buffered(
    src: &TcpStream,
    dst: &TcpStream,
    counters: &RelayCounters,
    direction: Direction,
) -> io::Result<()> {
    // Allocated after the first readiness, so an idle connection holds no buffer.
    let mut buffer = AdaptiveBuffer::default();
    loop {
        src.readable().await?;
        let read = match src.try_read(buffer.spare()) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        };
        let mut written = 0;
        while written < read {
            dst.writable().await?;
            match dst.try_write(&buffer.filled(read)[written..]) {
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
    }
    socket::shutdown_write(dst)
}

#[cfg(target_os = "linux")]
mod splice {
    //! Zero-copy through a pipe. The pipe is filled only when empty, so `EAGAIN` from
    //! `splice` always means "socket not ready" (never "pipe full/empty") and clearing the
    //! socket's readiness in `try_io` is correct.

    use std::io;
    use std::os::fd::OwnedFd;

    use rustix::pipe::{
        PipeFlags, SpliceFlags, fcntl_getpipe_size, fcntl_setpipe_size, pipe_with, splice,
    };
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    use super::{Direction, RelayCounters, copy_tcp_buffered};
    use crate::socket;

    struct Pipe {
        read: OwnedFd,
        write: OwnedFd,
        capacity: usize,
    }

    impl Pipe {
        fn new(size: usize) -> io::Result<Self> {
            let (read, write) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
            // Raising the size can fail past /proc/sys/fs/pipe-max-size or the per-user pipe
            // budget; the default 64 KiB pipe still works, only with more syscalls.
            if let Err(error) = fcntl_setpipe_size(&write, size) {
                tracing::debug!(%error, size, "cannot raise pipe size, using the default");
            }
            let capacity = fcntl_getpipe_size(&write)?;
            Ok(Self {
                read,
                write,
                capacity,
            })
        }
    }

    const FLAGS: SpliceFlags = SpliceFlags::NONBLOCK.union(SpliceFlags::MOVE);

    pub(super) async fn copy(
        src: &TcpStream,
        dst: &TcpStream,
        pipe_size: usize,
        counters: &RelayCounters,
        direction: Direction,
    ) -> io::Result<()> {
        src.readable().await?;
        let pipe = match Pipe::new(pipe_size) {
            Ok(pipe) => pipe,
            Err(error) => {
                tracing::debug!(%error, "cannot create a pipe, copying through a buffer");
                return copy_tcp_buffered(src, dst, counters, direction).await;
            }
        };
        loop {
            src.readable().await?;
            let filled = match src.try_io(Interest::READABLE, || {
                Ok(splice(src, None, &pipe.write, None, pipe.capacity, FLAGS)?)
            }) {
                Ok(0) => break,
                Ok(filled) => filled,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
                Err(error) => return Err(error),
            };
            // Drain everything before reading again: FIN must follow the last byte.
            let mut in_pipe = filled;
            while in_pipe > 0 {
                dst.writable().await?;
                match dst.try_io(Interest::WRITABLE, || {
                    Ok(splice(&pipe.read, None, dst, None, in_pipe, FLAGS)?)
                }) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(moved) => {
                        in_pipe -= moved;
                        counters.record(direction, moved);
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(error) => return Err(error),
                }
            }
        }
        socket::shutdown_write(dst)
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
