//! Data connections: inbound streams (`ProxyReq`) and private dials (`StreamReq`).
//!
//! Every stream is its own TLS connection to the engine. After the handshake frame(s) the connection
//! is a raw byte pipe; bytes that arrived together with the response frame are handed to the
//! application first ([`PrefixedIo`]).

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// An I/O object that first yields `prefix` (bytes already read past a handshake frame), then reads
/// from the inner object. A TLS peer that closes the TCP connection without `close_notify` is reported
/// as a normal end of stream: the payload is a raw byte pipe whose own protocol detects truncation.
#[derive(Debug)]
pub struct PrefixedIo<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> PrefixedIo<T> {
    /// Wraps `inner`, yielding `prefix` first.
    pub fn new(prefix: Bytes, inner: T) -> Self {
        Self { prefix, inner }
    }

    /// The inner object (bytes of the prefix that were not read yet are lost).
    pub fn into_inner(self) -> T {
        self.inner
    }

    /// A reference to the inner object.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for PrefixedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Poll::Ready(Ok(())),
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for PrefixedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

pub(crate) type ClientTls = tokio_rustls::client::TlsStream<TcpStream>;

/// A bidirectional byte stream carried by the engine: an inbound stream accepted on a tunnel, or a
/// private dial. `shutdown()` ends the write side (TLS `close_notify`) while reading continues.
#[derive(Debug)]
pub struct RstreamStream {
    io: PrefixedIo<ClientTls>,
    stream_id: Option<String>,
    tunnel_id: Option<String>,
    remote_ip: Option<IpAddr>,
}

impl RstreamStream {
    pub(crate) fn new(
        io: PrefixedIo<ClientTls>,
        stream_id: Option<String>,
        tunnel_id: Option<String>,
        remote_ip: Option<IpAddr>,
    ) -> Self {
        Self {
            io,
            stream_id,
            tunnel_id,
            remote_ip,
        }
    }

    /// The engine stream ID (absent for a zero-RTT private dial).
    pub fn stream_id(&self) -> Option<&str> {
        self.stream_id.as_deref()
    }

    /// The tunnel this inbound stream belongs to (absent for private dials).
    pub fn tunnel_id(&self) -> Option<&str> {
        self.tunnel_id.as_deref()
    }

    /// The downstream peer IP reported by the engine (`source_ip`), if any.
    pub fn remote_ip(&self) -> Option<IpAddr> {
        self.remote_ip
    }

    /// The engine socket address of the underlying connection.
    pub fn engine_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.io.get_ref().get_ref().0.peer_addr()
    }
}

impl AsyncRead for RstreamStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for RstreamStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn prefix_is_read_first() {
        let mut io = PrefixedIo::new(Bytes::from_static(b"abc"), &b"def"[..]);
        let mut out = String::new();
        io.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "abcdef");
    }
}
