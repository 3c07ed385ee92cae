//! Accept layers: what happens between accepting a client and relaying its bytes, for listeners
//! that do more than connect TCP to TCP (terminate TLS, say).
//!
//! A listener with a [`StreamAcceptor`] keeps everything else of [`ProxyServer`]: connection
//! limits, accept backoff, metrics and drain. The acceptor turns the accepted client into the
//! pair of streams to relay; the server then relays them with the buffered copy path (spliced
//! copies need two plain sockets).
//!
//! [`ProxyServer`]: crate::server::ProxyServer

use std::fmt;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::error::ConnectError;
use crate::relay::{RelayConfig, Route};

/// A byte stream an acceptor hands over: TLS, plain TCP, anything that reads and writes.
pub trait IoStream: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> IoStream for T {}

/// The client and upstream legs an acceptor prepared.
pub struct Accepted {
    /// The client leg (e.g. the decrypted TLS stream).
    pub client: Box<dyn IoStream>,
    /// The upstream leg.
    pub upstream: Box<dyn IoStream>,
}

impl fmt::Debug for Accepted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accepted").finish_non_exhaustive()
    }
}

/// Why an acceptor gave up on a connection; the server then closes the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcceptError {
    /// The upstream could not be reached (counted as a connect failure).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A handshake with the client or the upstream failed.
    #[error("handshake failed: {stage}")]
    Handshake {
        /// Which step failed (`client hello`, `TLS to the upstream`, ...).
        stage: String,
        /// Why.
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// Prepares both legs of one connection. Called once per accepted client, under the listener's
/// connection limit and the route's connect timeout; the route is the listener's current one.
pub trait StreamAcceptor: fmt::Debug + Send + Sync + 'static {
    /// Turns `client` into the streams to relay, connecting to `route`'s upstream (for example
    /// with [`relay::connect_upstream`](crate::relay::connect_upstream)).
    fn accept<'a>(
        &'a self,
        client: TcpStream,
        route: &'a Route,
        config: &'a RelayConfig,
    ) -> BoxFuture<'a, Result<Accepted, AcceptError>>;
}
