//! Who may connect to a V1 entry port: the requester's source addresses, as CIDRs.
//!
//! A mapping records the addresses it admits (`allowedSources`); the data planes refuse any
//! other source at accept (the embedded one with proxy-core's source filter, see
//! [`crate::dataplane::embedded`]; HAProxy with a `tcp-request connection reject` ACL). What a
//! request may ask for is bounded by `--allowed-source-cidrs`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use clap::ValueEnum;
use proxy_core::source::{self, SourceFilter};

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
/// address). Written and parsed in that form, host bits masked. proxy-core's
/// [`Cidr`](proxy_core::source::Cidr), which the data plane checks at accept, with serde as
/// text for the API and the PortMapping objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr(source::Cidr);

impl Cidr {
    /// The network of `addr` with `prefix` leading bits; refuses a prefix longer than the
    /// address.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, String> {
        source::Cidr::new(addr, prefix)
            .map(Self)
            .map_err(|e| e.to_string())
    }

    /// The single address `addr` (`/32` or `/128`).
    pub fn host(addr: IpAddr) -> Self {
        Self(source::Cidr::host(addr))
    }

    /// Whether `ip` is inside (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(ip)
    }

    /// Whether every address of `other` is inside.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.0.covers(&other.0)
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.0.addr()
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.0.prefix()
    }
}

impl From<Cidr> for source::Cidr {
    fn from(cidr: Cidr) -> Self {
        cidr.0
    }
}

/// The filter a data plane checks at accept for a mapping admitting `cidrs`.
pub fn source_filter(cidrs: &[Cidr]) -> SourceFilter {
    cidrs.iter().copied().map(source::Cidr::from).collect()
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        text.parse().map(Self).map_err(|e| match e {
            // Name the text, as the parse error does.
            source::CidrError::PrefixTooLong { .. } => format!("{:?}: {e}", text.trim()),
            other => other.to_string(),
        })
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
    fn cidrs_are_proxy_cores_as_text_and_errors_name_the_text() {
        // Parsing and matching are proxy-core's (tested there); this wraps them for serde.
        let cidr = c("10.1.2.3/8");
        assert_eq!(cidr.to_string(), "10.0.0.0/8");
        assert_eq!(source::Cidr::from(cidr), "10.0.0.0/8".parse().unwrap());
        assert_eq!(serde_json::to_value(cidr).unwrap(), "10.0.0.0/8");
        let back: Cidr = serde_json::from_value("10.0.0.0/8".into()).unwrap();
        assert_eq!(back, cidr);
        assert!(source_filter(&[cidr]).admits("10.9.9.9".parse().unwrap()));
        assert!(!source_filter(&[]).admits("10.9.9.9".parse().unwrap()));
        for bad in ["10.0.0.0/33", "x", "10.0.0.0/x"] {
            let err = bad.parse::<Cidr>().unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        assert!(serde_json::from_value::<Cidr>("x".into()).is_err());
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
