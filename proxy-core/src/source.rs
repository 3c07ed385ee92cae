//! Which client addresses a listener admits: IP networks ([`Cidr`]) and a per-listener
//! [`SourceFilter`] checked at accept.
//!
//! A listener with a filter
//! ([`ListenerConfig::with_source_filter`](crate::server::ListenerConfig::with_source_filter))
//! closes a client from any other source as soon as it is accepted, with a reset, before any
//! upstream is connected, and reports it to the observer
//! ([`RelayObserver::source_refused`](crate::metrics::RelayObserver::source_refused)). The
//! check runs on both data paths, so such a listener keeps the splice path and the event loops.
//! [`ProxyServer::set_source_filter`](crate::server::ProxyServer::set_source_filter) changes the
//! filter live, for the connections accepted from then on.
//!
//! ```
//! use proxy_core::source::{Cidr, SourceFilter};
//!
//! let filter = SourceFilter::new(["10.0.0.0/8".parse::<Cidr>()?, "192.0.2.7".parse()?]);
//! assert!(filter.admits("10.1.2.3".parse()?));
//! assert!(filter.admits("::ffff:192.0.2.7".parse()?)); // an IPv4-mapped address is its IPv4 one
//! assert!(!filter.admits("192.0.2.8".parse()?));
//! assert!(!SourceFilter::deny_all().admits("10.1.2.3".parse()?));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

/// An IP network: an address and a prefix length (`10.0.0.0/8`, `fd00::/64`, or one address).
/// The host bits are cleared; an IPv4-mapped IPv6 address is taken as its IPv4 address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// A network that cannot be one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CidrError {
    /// The prefix is longer than the address (more than 32 bits for IPv4, 128 for IPv6).
    #[error("prefix /{prefix} is longer than {max} bits")]
    PrefixTooLong {
        /// The prefix given.
        prefix: u8,
        /// The address's length in bits.
        max: u8,
    },
    /// The text is not `ADDRESS` or `ADDRESS/PREFIX`.
    #[error("{input:?} is not an IP address or CIDR (e.g. 10.0.0.0/8)")]
    Invalid {
        /// The text that was given.
        input: String,
    },
}

impl Cidr {
    /// The network of `addr` with `prefix` leading bits; refuses a prefix longer than the
    /// address.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, CidrError> {
        let addr = addr.to_canonical();
        let max = bits(addr);
        if prefix > max {
            return Err(CidrError::PrefixTooLong { prefix, max });
        }
        Ok(Self {
            addr: mask(addr, prefix),
            prefix,
        })
    }

    /// The single address `addr` (`/32` or `/128`).
    pub fn host(addr: IpAddr) -> Self {
        let addr = addr.to_canonical();
        Self {
            addr,
            prefix: bits(addr),
        }
    }

    /// Whether `ip` is inside.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.addr.is_ipv4() && mask(ip, self.prefix) == self.addr
    }

    /// Whether every address of `other` is inside.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    /// Parses `ADDRESS/PREFIX`, or `ADDRESS` alone for that one address.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let text = input.trim();
        let invalid = || CidrError::Invalid {
            input: input.to_owned(),
        };
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| invalid())?;
        match prefix {
            None => Ok(Cidr::host(addr)),
            Some(prefix) => Cidr::new(addr, prefix.parse().map_err(|_| invalid())?),
        }
    }
}

fn bits(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    // A shift by the whole width (prefix 0) overflows: nothing is kept then.
    match addr {
        IpAddr::V4(v4) => {
            let kept = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((u32::from(v4) & kept).into())
        }
        IpAddr::V6(v6) => {
            let kept = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & kept).into())
        }
    }
}

/// The source networks a listener admits; a client from anywhere else is closed at accept.
/// Cheap to clone. An empty filter admits nobody.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceFilter {
    allowed: Arc<[Cidr]>,
}

impl SourceFilter {
    /// Admits the sources inside any of `allowed`.
    pub fn new(allowed: impl IntoIterator<Item = Cidr>) -> Self {
        Self {
            allowed: allowed.into_iter().collect(),
        }
    }

    /// Admits nobody (e.g. while a listener changes hands).
    pub fn deny_all() -> Self {
        Self::new([])
    }

    /// Whether a client from `ip` may pass.
    pub fn admits(&self, ip: IpAddr) -> bool {
        self.allowed.iter().any(|cidr| cidr.contains(ip))
    }

    /// The admitted networks.
    pub fn allowed(&self) -> &[Cidr] {
        &self.allowed
    }
}

impl fmt::Display for SourceFilter {
    /// The networks, comma-separated, or `nobody` when empty.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.allowed.is_empty() {
            return f.write_str("nobody");
        }
        for (index, cidr) in self.allowed.iter().enumerate() {
            if index > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{cidr}")?;
        }
        Ok(())
    }
}

impl FromIterator<Cidr> for SourceFilter {
    fn from_iter<I: IntoIterator<Item = Cidr>>(allowed: I) -> Self {
        Self::new(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(text: &str) -> Cidr {
        text.parse().unwrap()
    }

    #[test]
    fn networks_parse_mask_and_contain() {
        assert_eq!(c("10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert_eq!(c("10.1.2.3").to_string(), "10.1.2.3/32");
        assert_eq!(c("fd00::1/64").to_string(), "fd00::/64");
        assert_eq!(c("::ffff:10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert!(c("0.0.0.0/0").contains("192.168.1.1".parse().unwrap()));
        assert!(!c("0.0.0.0/0").contains("::1".parse().unwrap()));
        assert!(c("127.0.0.1").contains("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!c("127.0.0.1").contains("127.0.0.2".parse().unwrap()));
        assert!(c("10.0.0.0/8").covers(&c("10.2.0.0/16")));
        assert!(!c("10.2.0.0/16").covers(&c("10.0.0.0/8")));
        assert_eq!(
            "10.0.0.0/33".parse::<Cidr>(),
            Err(CidrError::PrefixTooLong {
                prefix: 33,
                max: 32
            })
        );
        for bad in ["fd00::/129", "x", "10.0.0.0/x", "", "10.0.0.0/-1"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_filter_admits_only_its_networks() {
        let filter: SourceFilter = [c("10.0.0.0/8"), c("fd00::/64")].into_iter().collect();
        assert!(filter.admits("10.9.9.9".parse().unwrap()));
        assert!(filter.admits("fd00::5".parse().unwrap()));
        assert!(!filter.admits("11.0.0.1".parse().unwrap()));
        assert!(!filter.admits("fd01::5".parse().unwrap()));
        assert!(!SourceFilter::deny_all().admits("10.9.9.9".parse().unwrap()));
        assert_eq!(filter.allowed().len(), 2);
        assert_eq!(filter.to_string(), "10.0.0.0/8, fd00::/64");
        assert_eq!(SourceFilter::deny_all().to_string(), "nobody");
    }
}
