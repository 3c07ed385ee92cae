//! Who may connect to a V1 entry port: the requester's source addresses, as CIDRs.
//!
//! A mapping records the addresses it admits (`allowedSources`); the data planes refuse any
//! other source at accept (the embedded one in [`crate::dataplane::embedded`], HAProxy with a
//! `tcp-request connection reject` ACL). What a request may ask for is bounded by
//! `--allowed-source-cidrs`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use clap::ValueEnum;

/// Who may connect to a V1 entry port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EntryAccess {
    /// Only the source addresses of the mapping's requester (the API client's IP, or the
    /// `sources` of the request within --allowed-source-cidrs); others are refused at accept.
    Requester,
    /// Anyone who can reach the entry port, as the original did.
    Any,
}

/// An IP network: an address and a prefix length (`10.0.0.0/8`, `fd00::/64`, or a single
/// address). Written and parsed in that form; the address is kept as given, host bits masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network of `addr` with `prefix` leading bits; refuses a prefix longer than the
    /// address.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, String> {
        let addr = canonical(addr);
        let max = max_prefix(addr);
        if prefix > max {
            return Err(format!("prefix /{prefix} is longer than {max} bits"));
        }
        Ok(Self {
            addr: mask(addr, prefix),
            prefix,
        })
    }

    /// The single address `addr` (`/32` or `/128`).
    pub fn host(addr: IpAddr) -> Self {
        let addr = canonical(addr);
        Self {
            addr,
            prefix: max_prefix(addr),
        }
    }

    /// Whether `ip` is inside (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
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
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or CIDR (e.g. 10.0.0.0/8)"))?;
        match prefix {
            None => Ok(Cidr::host(addr)),
            Some(prefix) => {
                let prefix: u8 = prefix
                    .parse()
                    .map_err(|_| format!("{text:?}: the prefix length is not a number"))?;
                Cidr::new(addr, prefix).map_err(|e| format!("{text:?}: {e}"))
            }
        }
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

fn canonical(addr: IpAddr) -> IpAddr {
    addr.to_canonical()
}

fn max_prefix(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let kept = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((bits & kept).into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let kept = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((bits & kept).into())
        }
    }
}

/// Whether `ip` is inside any of `cidrs`.
pub fn admits(cidrs: &[Cidr], ip: IpAddr) -> bool {
    cidrs.iter().any(|c| c.contains(ip))
}

/// The sources a request may ask for: its own address always, anything else only inside
/// `--allowed-source-cidrs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourcePolicy {
    /// `--allowed-source-cidrs`.
    pub allowed: Vec<Cidr>,
}

impl SourcePolicy {
    /// The sources of a mapping requested from `client` with `asked` (none: the client alone),
    /// or why they are refused.
    pub fn resolve(&self, client: IpAddr, asked: Option<&[Cidr]>) -> Result<Vec<Cidr>, String> {
        let Some(asked) = asked else {
            return Ok(vec![Cidr::host(client)]);
        };
        if asked.is_empty() {
            return Err("sources is empty: leave it out to admit your own address only".to_owned());
        }
        let own = Cidr::host(client);
        let mut sources: Vec<Cidr> = Vec::new();
        for cidr in asked {
            let inside = *cidr == own || self.allowed.iter().any(|a| a.covers(cidr));
            if !inside {
                let policy = if self.allowed.is_empty() {
                    "none: only your own address".to_owned()
                } else {
                    self.allowed
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(format!(
                    "source {cidr} is outside what this pod-proxier lets a request admit \
                     (--allowed-source-cidrs: {policy})"
                ));
            }
            if !sources.contains(cidr) {
                sources.push(*cidr);
            }
        }
        Ok(sources)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn c(text: &str) -> Cidr {
        text.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_mask_and_contain() {
        assert_eq!(c("10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert_eq!(c("10.1.2.3").to_string(), "10.1.2.3/32");
        assert_eq!(c("fd00::1/64").to_string(), "fd00::/64");
        assert_eq!(c("0.0.0.0/0").to_string(), "0.0.0.0/0");
        assert!(c("0.0.0.0/0").contains("192.168.1.1".parse().unwrap()));
        assert!(!c("0.0.0.0/0").contains("::1".parse().unwrap()));
        assert!(c("127.0.0.1").contains("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!c("127.0.0.1").contains("127.0.0.2".parse().unwrap()));
        assert!(c("10.0.0.0/8").covers(&c("10.2.0.0/16")));
        assert!(!c("10.2.0.0/16").covers(&c("10.0.0.0/8")));
        for bad in ["10.0.0.0/33", "fd00::/129", "x", "10.0.0.0/x", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_request_admits_its_own_address_and_only_what_the_policy_allows() {
        let client: IpAddr = "192.0.2.7".parse().unwrap();
        let none = SourcePolicy::default();
        assert_eq!(none.resolve(client, None).unwrap(), vec![c("192.0.2.7")]);
        assert_eq!(
            none.resolve(client, Some(&[c("192.0.2.7")])).unwrap(),
            vec![c("192.0.2.7")]
        );
        let err = none.resolve(client, Some(&[c("0.0.0.0/0")])).unwrap_err();
        assert!(
            err.contains("outside") && err.contains("only your own"),
            "{err}"
        );
        let policy = SourcePolicy {
            allowed: vec![c("10.0.0.0/8")],
        };
        assert_eq!(
            policy
                .resolve(client, Some(&[c("10.1.0.0/16"), c("10.1.0.0/16")]))
                .unwrap(),
            vec![c("10.1.0.0/16")]
        );
        let err = policy
            .resolve(client, Some(&[c("10.0.0.0/7")]))
            .unwrap_err();
        assert!(err.contains("10.0.0.0/8"), "{err}");
        assert!(policy.resolve(client, Some(&[])).is_err());
    }
}
