//! [`TargetAddr`]: a `host:port` or socket address that a connection is made to, directly
//! ([`upstream`](crate::upstream)) or through an HTTP proxy's tunnel
//! ([`http_connect`](crate::http_connect)); both use it, so it sits below them.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::error::{ConfigError, ConnectError};
use crate::socket;

/// An upstream address: a socket address, or a host name resolved at each connect.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TargetAddr {
    /// An IP address and port.
    Socket(SocketAddr),
    /// A host name and port, resolved with the system resolver when connecting.
    Host {
        /// The host name.
        host: String,
        /// The port.
        port: u16,
    },
}

impl From<SocketAddr> for TargetAddr {
    fn from(addr: SocketAddr) -> Self {
        TargetAddr::Socket(addr)
    }
}

impl fmt::Display for TargetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetAddr::Socket(addr) => addr.fmt(f),
            TargetAddr::Host { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl FromStr for TargetAddr {
    type Err = ConfigError;

    /// Parses `1.2.3.4:80`, `[::1]:80` or `name.example:80`.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let invalid = |reason| ConfigError::InvalidAddress {
            input: input.to_owned(),
            reason,
        };
        if let Ok(addr) = input.parse::<SocketAddr>() {
            if addr.port() == 0 {
                return Err(invalid("port 0 cannot be connected to"));
            }
            return Ok(TargetAddr::Socket(addr));
        }
        let (host, port) = input
            .rsplit_once(':')
            .ok_or_else(|| invalid("missing :port"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| invalid("port is not a number in 0-65535"))?;
        let valid_host = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !valid_host {
            return Err(invalid("not an IP address or DNS name"));
        }
        if port == 0 {
            return Err(invalid("port 0 cannot be connected to"));
        }
        Ok(TargetAddr::Host {
            host: host.to_owned(),
            port,
        })
    }
}

impl TargetAddr {
    /// Connects with `timeout` covering resolution and connect. For a host name, each resolved
    /// address is tried in turn.
    pub async fn connect(&self, timeout: Duration) -> Result<TcpStream, ConnectError> {
        let attempt = async {
            match self {
                TargetAddr::Socket(addr) => {
                    socket::connect(*addr)
                        .await
                        .map_err(|cause| ConnectError::Io {
                            target: self.to_string(),
                            cause,
                        })
                }
                TargetAddr::Host { host, port } => {
                    let resolve_error = |cause| ConnectError::Resolve {
                        target: self.to_string(),
                        cause,
                    };
                    let addrs = tokio::net::lookup_host((host.as_str(), *port))
                        .await
                        .map_err(resolve_error)?;
                    let mut last = None;
                    for addr in addrs {
                        match socket::connect(addr).await {
                            Ok(stream) => return Ok(stream),
                            Err(error) => last = Some(error),
                        }
                    }
                    Err(match last {
                        Some(cause) => ConnectError::Io {
                            target: self.to_string(),
                            cause,
                        },
                        None => {
                            resolve_error(io::Error::new(io::ErrorKind::NotFound, "no address"))
                        }
                    })
                }
            }
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ConnectError::Timeout {
                    target: self.to_string(),
                    after: timeout,
                })
            })
    }
}
