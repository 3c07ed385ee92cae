//! Datagram streams: datagram tunnels (`type: datagram`, `protocol: dtls`) over TLS.
//!
//! Over the TLS transport each datagram travels inside an ordinary data connection (an inbound
//! stream or a private dial) as a length-prefixed record: a 4-byte big-endian length, then that many
//! bytes, at most [`MAX_DATAGRAM_LEN`] (protocol reference §5.9). The records keep their boundaries
//! and their order; the connection is reliable, so `datagram_guaranteed_delivery` changes nothing on
//! this path (it is passed through to the engine).
//!
//! * [`DatagramCodec`]: the record codec (tokio-util's `LengthDelimitedCodec` with a u32 big-endian
//!   length and a 65 535-byte limit), with typed errors for oversized and truncated records;
//! * [`DatagramStream`]: `send(&[u8])` / `recv()` over any byte stream (an [`RstreamStream`](crate::RstreamStream));
//! * [`relay_udp`]: relays one datagram stream to a UDP target;
//!   [`forward_to`](crate::forward::forward_to) with `TargetKind::Udp` every stream of a tunnel.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use rstream_client::datagram::{DatagramError, DatagramStream};
//! let (a, b) = tokio::io::duplex(1 << 17);
//! let (mut a, mut b) = (DatagramStream::new(a), DatagramStream::new(b));
//! a.send(b"ping").await.unwrap();
//! a.send(&[]).await.unwrap();
//! assert_eq!(b.recv().await.unwrap().as_deref(), Some(&b"ping"[..]));
//! assert_eq!(b.recv().await.unwrap().as_deref(), Some(&b""[..]));
//! assert!(matches!(a.send(&vec![0; 65_536]).await, Err(DatagramError::TooLarge { len: 65_536 })));
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UdpSocket;
use tokio::time::Instant;
use tokio_util::codec::{
    Decoder, Encoder, Framed, LengthDelimitedCodec, LengthDelimitedCodecError,
};
use tokio_util::sync::CancellationToken;
use tracing::debug;

pub use crate::error::DatagramError;
use crate::error::{Error, Result};
pub use crate::proto::MAX_DATAGRAM_LEN;

/// Size of the record length prefix (bytes).
pub const LENGTH_PREFIX_LEN: usize = 4;

/// How long [`crate::forward::forward_to`] keeps a stream's UDP socket without traffic in either direction.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest UDP payload read from a socket (the largest IPv6 payload without jumbograms).
const UDP_RECV_BUFFER: usize = 65_535;

/// The record codec: a 4-byte big-endian length, then the datagram (at most
/// [`MAX_DATAGRAM_LEN`] bytes). Decodes to [`Bytes`]; encodes `&[u8]`.
#[derive(Debug)]
pub struct DatagramCodec {
    inner: LengthDelimitedCodec,
    /// The body length of the record whose prefix the inner codec consumed (its `Data` state).
    body: Option<usize>,
}

impl Default for DatagramCodec {
    fn default() -> Self {
        Self {
            inner: LengthDelimitedCodec::builder()
                .length_field_type::<u32>()
                .big_endian()
                .max_frame_length(MAX_DATAGRAM_LEN)
                .new_codec(),
            body: None,
        }
    }
}

impl DatagramCodec {
    /// A codec with the protocol's limits.
    pub fn new() -> Self {
        Self::default()
    }
}

fn peek_len(src: &[u8]) -> Option<u32> {
    let p = src.get(..LENGTH_PREFIX_LEN)?;
    Some(u32::from_be_bytes([p[0], p[1], p[2], p[3]]))
}

impl Decoder for DatagramCodec {
    type Item = Bytes;
    type Error = DatagramError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Bytes>, DatagramError> {
        // The inner codec consumes a complete prefix and then waits for the body: mirror that
        // state, so a stream that ends after a prefix is reported as truncated.
        let announced = match self.body {
            None => peek_len(src),
            Some(_) => None,
        };
        match self.inner.decode(src) {
            Ok(Some(record)) => {
                self.body = None;
                Ok(Some(record.freeze()))
            }
            Ok(None) => {
                if let Some(len) = announced {
                    self.body = Some(len as usize);
                }
                Ok(None)
            }
            // The inner codec refuses a prefix over the limit without consuming it.
            Err(e)
                if e.get_ref()
                    .is_some_and(|i| i.is::<LengthDelimitedCodecError>()) =>
            {
                Err(DatagramError::RecordTooLarge {
                    len: u64::from(announced.or_else(|| peek_len(src)).unwrap_or(u32::MAX)),
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, DatagramError> {
        if let Some(record) = self.decode(buf)? {
            return Ok(Some(record));
        }
        match self.body {
            Some(body) => Err(DatagramError::Truncated {
                expected: LENGTH_PREFIX_LEN + body,
                received: LENGTH_PREFIX_LEN + buf.len(),
            }),
            None if buf.is_empty() => Ok(None),
            None => Err(DatagramError::Truncated {
                expected: LENGTH_PREFIX_LEN,
                received: buf.len(),
            }),
        }
    }
}

impl Encoder<&[u8]> for DatagramCodec {
    type Error = DatagramError;

    fn encode(&mut self, datagram: &[u8], dst: &mut BytesMut) -> Result<(), DatagramError> {
        let len = u32::try_from(datagram.len())
            .ok()
            .filter(|&l| l as usize <= MAX_DATAGRAM_LEN)
            .ok_or(DatagramError::TooLarge {
                len: datagram.len(),
            })?;
        dst.reserve(LENGTH_PREFIX_LEN + datagram.len());
        dst.put_u32(len);
        dst.put_slice(datagram);
        Ok(())
    }
}

/// Datagrams over a byte stream (an inbound stream of a datagram tunnel, or a private dial to one),
/// as length-prefixed records. Bad input from the peer ends the stream with a typed error.
#[derive(Debug)]
pub struct DatagramStream<S> {
    framed: Framed<S, DatagramCodec>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> DatagramStream<S> {
    /// Wraps a byte stream.
    pub fn new(io: S) -> Self {
        Self {
            framed: Framed::new(io, DatagramCodec::new()),
        }
    }

    /// Sends one datagram (and flushes it). A datagram over [`MAX_DATAGRAM_LEN`] bytes fails with
    /// [`DatagramError::TooLarge`] and writes nothing.
    pub async fn send(&mut self, datagram: &[u8]) -> Result<(), DatagramError> {
        self.framed.send(datagram).await
    }

    /// Receives the next datagram; `None` when the peer ended the stream between records.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, DatagramError> {
        self.framed.next().await.transpose()
    }

    /// Ends the write side (the peer's [`recv`](Self::recv) returns `None`); receiving continues.
    pub async fn close(&mut self) -> Result<(), DatagramError> {
        SinkExt::<&[u8]>::close(&mut self.framed).await
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &S {
        self.framed.get_ref()
    }

    /// The underlying stream (bytes read but not yet decoded are lost).
    pub fn into_inner(self) -> S {
        self.framed.into_inner()
    }
}

/// Why a [`relay_udp`] ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum UdpRelayEnding {
    /// The stream ended between records.
    Eof,
    /// No datagram in either direction for the idle timeout.
    Idle,
    /// The cancellation token fired.
    Cancelled,
    /// The stream failed or sent a bad record (the error text).
    Stream(String),
}

/// What a [`relay_udp`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdpRelaySummary {
    /// Datagrams sent to the target.
    pub to_target: u64,
    /// Datagrams from the target written to the stream.
    pub from_target: u64,
    /// Datagrams the target socket refused (too large for UDP, port unreachable).
    pub dropped: u64,
    /// Why it ended.
    pub ending: UdpRelayEnding,
}

/// Resolves `target` (`host:port`) and connects a fresh UDP socket to it.
async fn connect_udp(target: &str) -> Result<UdpSocket> {
    let addr: SocketAddr = tokio::net::lookup_host(target)
        .await
        .map_err(|e| Error::connect(target, e))?
        .next()
        .ok_or_else(|| {
            Error::connect(
                target,
                io::Error::new(io::ErrorKind::NotFound, "no address"),
            )
        })?;
    let local = if addr.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let socket = UdpSocket::bind(local)
        .await
        .map_err(|e| Error::connect(target, e))?;
    socket
        .connect(addr)
        .await
        .map_err(|e| Error::connect(target, e))?;
    Ok(socket)
}

/// Relays the datagram stream `stream` to the UDP address `target`: each record is sent as one UDP
/// datagram from a socket of its own (connected to `target`), each datagram the target answers
/// becomes a record. Ends when the stream ends or fails, after `idle_timeout` without a datagram
/// either way, or when `cancel` fires. Fails only if the target cannot be resolved or bound.
pub async fn relay_udp<S>(
    stream: S,
    target: &str,
    idle_timeout: Duration,
    cancel: &CancellationToken,
) -> Result<UdpRelaySummary>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let socket = connect_udp(target).await?;
    let mut stream = DatagramStream::new(stream);
    let mut buf = vec![0u8; UDP_RECV_BUFFER];
    let mut summary = UdpRelaySummary {
        to_target: 0,
        from_target: 0,
        dropped: 0,
        ending: UdpRelayEnding::Eof,
    };
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    summary.ending = loop {
        tokio::select! {
            () = cancel.cancelled() => break UdpRelayEnding::Cancelled,
            () = &mut idle => break UdpRelayEnding::Idle,
            record = stream.recv() => match record {
                Ok(Some(datagram)) => {
                    idle.as_mut().reset(Instant::now() + idle_timeout);
                    match socket.send(&datagram).await {
                        Ok(_) => summary.to_target += 1,
                        Err(e) => {
                            summary.dropped += 1;
                            debug!(error = %e, len = datagram.len(), "datagram not sent to the target");
                        }
                    }
                }
                Ok(None) => break UdpRelayEnding::Eof,
                Err(e) => break UdpRelayEnding::Stream(crate::error::chain(&e)),
            },
            received = socket.recv(&mut buf) => match received {
                Ok(n) => {
                    idle.as_mut().reset(Instant::now() + idle_timeout);
                    if let Err(e) = stream.send(&buf[..n]).await {
                        break UdpRelayEnding::Stream(crate::error::chain(&e));
                    }
                    summary.from_target += 1;
                }
                // An ICMP error for an earlier datagram (nothing listening): UDP carries on.
                Err(e) => {
                    summary.dropped += 1;
                    debug!(error = %e, "UDP target reported an error");
                }
            },
        }
    };
    let _ = stream.close().await;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn pair() -> (
        DatagramStream<tokio::io::DuplexStream>,
        DatagramStream<tokio::io::DuplexStream>,
    ) {
        let (a, b) = tokio::io::duplex(1 << 18);
        (DatagramStream::new(a), DatagramStream::new(b))
    }

    #[tokio::test]
    async fn edge_sizes_round_trip_in_order() {
        let (mut a, mut b) = pair();
        let sizes = [0usize, 1, 4, 1500, 65_534, MAX_DATAGRAM_LEN, 0];
        for (i, &n) in sizes.iter().enumerate() {
            let d: Vec<u8> = (0..n).map(|j| (i + j) as u8).collect();
            a.send(&d).await.unwrap();
            assert_eq!(b.recv().await.unwrap().unwrap(), d, "size {n}");
        }
        a.close().await.unwrap();
        assert_eq!(b.recv().await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_oversized_datagram_is_refused_and_nothing_is_written() {
        let (mut a, mut b) = pair();
        let err = a.send(&vec![7; MAX_DATAGRAM_LEN + 1]).await.unwrap_err();
        assert!(
            matches!(err, DatagramError::TooLarge { len: 65_536 }),
            "{err}"
        );
        assert!(err.to_string().contains("65535"), "{err}");
        a.send(b"after").await.unwrap();
        assert_eq!(b.recv().await.unwrap().unwrap(), &b"after"[..]);
    }

    #[tokio::test]
    async fn a_record_announcing_more_than_the_limit_is_an_error() {
        let (mut raw, b) = tokio::io::duplex(1024);
        let mut b = DatagramStream::new(b);
        raw.write_all(&[0, 1, 0, 0, 1, 2, 3]).await.unwrap();
        let err = b.recv().await.unwrap_err();
        assert!(
            matches!(err, DatagramError::RecordTooLarge { len: 65_536 }),
            "{err}"
        );
        // The largest u32 does not overflow anything either.
        let (mut raw, b) = tokio::io::duplex(1024);
        let mut b = DatagramStream::new(b);
        raw.write_all(&[0xff; 4]).await.unwrap();
        assert!(matches!(
            b.recv().await,
            Err(DatagramError::RecordTooLarge { len: 4_294_967_295 })
        ));
    }

    #[tokio::test]
    async fn a_truncated_record_is_an_error_not_a_datagram() {
        // Header complete, body short.
        let (mut raw, b) = tokio::io::duplex(1024);
        let mut b = DatagramStream::new(b);
        raw.write_all(&[0, 0, 0, 10, b'a', b'b', b'c'])
            .await
            .unwrap();
        drop(raw);
        match b.recv().await {
            Err(DatagramError::Truncated { expected, received }) => {
                assert_eq!((expected, received), (14, 7));
            }
            other => panic!("expected a truncated record, got {other:?}"),
        }
        // A prefix alone.
        let (mut raw, b) = tokio::io::duplex(1024);
        let mut b = DatagramStream::new(b);
        raw.write_all(&[0, 0, 0, 10]).await.unwrap();
        drop(raw);
        assert!(matches!(
            b.recv().await,
            Err(DatagramError::Truncated {
                expected: 14,
                received: 4
            })
        ));
        // Header cut.
        let (mut raw, b) = tokio::io::duplex(1024);
        let mut b = DatagramStream::new(b);
        raw.write_all(&[0, 0, 0, 3, b'x', b'y', b'z', 0, 0])
            .await
            .unwrap();
        drop(raw);
        assert_eq!(b.recv().await.unwrap().unwrap(), &b"xyz"[..]);
        assert!(matches!(
            b.recv().await,
            Err(DatagramError::Truncated {
                expected: 4,
                received: 2
            })
        ));
    }

    proptest::proptest! {
        /// Any byte sequence, cut anywhere: records come out whole, or a typed error; no panic.
        #[test]
        fn arbitrary_input_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), cut in 0usize..512) {
            let mut codec = DatagramCodec::new();
            let cut = cut.min(data.len());
            let mut buf = BytesMut::from(&data[..cut]);
            let mut done = false;
            while let Ok(Some(record)) = codec.decode(&mut buf) {
                proptest::prop_assert!(record.len() <= MAX_DATAGRAM_LEN);
            }
            buf.extend_from_slice(&data[cut..]);
            while !done {
                match codec.decode_eof(&mut buf) {
                    Ok(Some(record)) => proptest::prop_assert!(record.len() <= MAX_DATAGRAM_LEN),
                    Ok(None) | Err(_) => done = true,
                }
            }
        }
    }

    #[tokio::test]
    async fn relay_udp_carries_datagrams_both_ways_and_ends_idle() {
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65_535];
            while let Ok((n, peer)) = echo.recv_from(&mut buf).await {
                let _ = echo.send_to(&buf[..n], peer).await;
            }
        });
        let (near, far) = tokio::io::duplex(1 << 18);
        let cancel = CancellationToken::new();
        let relay = tokio::spawn(async move {
            relay_udp(
                far,
                &echo_addr.to_string(),
                Duration::from_millis(300),
                &cancel,
            )
            .await
        });
        let mut near = DatagramStream::new(near);
        for d in [&b""[..], b"one", &[9u8; 60_000]] {
            near.send(d).await.unwrap();
            assert_eq!(near.recv().await.unwrap().unwrap(), d);
        }
        // No traffic: the relay closes the stream after its idle timeout.
        assert_eq!(near.recv().await.unwrap(), None);
        let summary = relay.await.unwrap().unwrap();
        assert_eq!(summary.ending, UdpRelayEnding::Idle);
        assert_eq!((summary.to_target, summary.from_target), (3, 3));
    }

    #[tokio::test]
    async fn relay_udp_reports_a_target_that_does_not_resolve() {
        let (_near, far) = tokio::io::duplex(64);
        let err = relay_udp(
            far,
            "no-such-host.invalid:53",
            Duration::from_secs(1),
            &CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("no-such-host.invalid"), "{err}");
    }
}
