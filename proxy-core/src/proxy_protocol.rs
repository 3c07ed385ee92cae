//! PROXY protocol version 2 (binary), as specified by HAProxy's `proxy-protocol.txt` §2.2.
//!
//! The relay writes one header at the start of the upstream connection so that the backend
//! sees the client's address. The parser exists for tests and for backends written with this
//! crate; it accepts TCP over IPv4/IPv6 and the `LOCAL` command, and skips TLVs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The 12-byte signature that starts every v2 header.
pub const SIGNATURE: [u8; 12] = [
    0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A,
];

const VERSION_2: u8 = 0x20;
const COMMAND_LOCAL: u8 = 0x00;
const COMMAND_PROXY: u8 = 0x01;
const TCP_OVER_IPV4: u8 = 0x11;
const TCP_OVER_IPV6: u8 = 0x21;
const UNSPECIFIED: u8 = 0x00;
/// Signature, version/command, family/protocol and the 2-byte length.
const FIXED_LEN: usize = 16;

/// Encodes a `PROXY` header for a TCP connection from `source` (the client) to `destination`
/// (the address the client connected to).
///
/// When the two addresses are of different families, both are sent as IPv6 (IPv4 addresses
/// as `::ffff:a.b.c.d`), since the header carries one family.
///
/// ```
/// use proxy_core::proxy_protocol::{encode_v2, parse_v2, ProxyHeader};
/// let client = "192.0.2.1:40000".parse().unwrap();
/// let service = "198.51.100.7:443".parse().unwrap();
/// let header = encode_v2(client, service);
/// assert_eq!(header.len(), 28);
/// let (parsed, used) = parse_v2(&header).unwrap().unwrap();
/// assert_eq!(parsed, ProxyHeader::Proxy { source: client, destination: service });
/// assert_eq!(used, header.len());
/// ```
pub fn encode_v2(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let (family, addresses) = match (source.ip(), destination.ip()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => (
            TCP_OVER_IPV4,
            [src.octets().to_vec(), dst.octets().to_vec()].concat(),
        ),
        (src, dst) => (
            TCP_OVER_IPV6,
            [to_v6(src).octets(), to_v6(dst).octets()].concat(),
        ),
    };
    let payload_len = addresses.len() + 4;
    let mut header = Vec::with_capacity(FIXED_LEN + payload_len);
    header.extend_from_slice(&SIGNATURE);
    header.push(VERSION_2 | COMMAND_PROXY);
    header.push(family);
    // At most 36 bytes: the cast cannot truncate.
    header.extend_from_slice(&(payload_len as u16).to_be_bytes());
    header.extend_from_slice(&addresses);
    header.extend_from_slice(&source.port().to_be_bytes());
    header.extend_from_slice(&destination.port().to_be_bytes());
    header
}

/// Encodes a `LOCAL` header: a connection made by the proxy itself (a health check), for which
/// the backend must use the real connection addresses.
pub fn encode_v2_local() -> Vec<u8> {
    let mut header = Vec::with_capacity(FIXED_LEN);
    header.extend_from_slice(&SIGNATURE);
    header.push(VERSION_2 | COMMAND_LOCAL);
    header.push(UNSPECIFIED);
    header.extend_from_slice(&0u16.to_be_bytes());
    header
}

fn to_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// A parsed v2 header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// A relayed connection from `source` to `destination`.
    Proxy {
        /// The original client.
        source: SocketAddr,
        /// The address the client connected to.
        destination: SocketAddr,
    },
    /// A connection made by the proxy itself, or with an address family this parser does not
    /// decode (UNIX, UDP): use the real connection addresses.
    Local,
}

/// Why a header is invalid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseError {
    /// The bytes do not start with the v2 signature.
    #[error("not a PROXY protocol v2 header")]
    BadSignature,
    /// The version nibble is not 2.
    #[error("unsupported PROXY protocol version {0}")]
    BadVersion(u8),
    /// The command nibble is neither LOCAL nor PROXY.
    #[error("unknown PROXY protocol command {0}")]
    BadCommand(u8),
    /// The length field is too short for the announced address family.
    #[error("address block of {len} bytes too short for family 0x{family:02x}")]
    TooShort {
        /// The family/protocol byte.
        family: u8,
        /// The announced length.
        len: usize,
    },
}

/// Parses a v2 header at the start of `bytes`.
///
/// Returns `Ok(None)` when more bytes are needed, otherwise the header and the number of bytes
/// it used (including TLVs, which are skipped).
pub fn parse_v2(bytes: &[u8]) -> Result<Option<(ProxyHeader, usize)>, ParseError> {
    let available = bytes.len().min(SIGNATURE.len());
    if bytes[..available] != SIGNATURE[..available] {
        return Err(ParseError::BadSignature);
    }
    let Some(fixed) = bytes.get(..FIXED_LEN) else {
        return Ok(None);
    };
    let version_command = fixed[12];
    if version_command & 0xF0 != VERSION_2 {
        return Err(ParseError::BadVersion(version_command >> 4));
    }
    let command = version_command & 0x0F;
    let family = fixed[13];
    let len = usize::from(u16::from_be_bytes([fixed[14], fixed[15]]));
    let Some(block) = bytes.get(FIXED_LEN..FIXED_LEN + len) else {
        return Ok(None);
    };
    let used = FIXED_LEN + len;
    let header = match command {
        COMMAND_LOCAL => ProxyHeader::Local,
        COMMAND_PROXY => match family {
            TCP_OVER_IPV4 => {
                let [a, b, c, d, e, f, g, h, p1, p2, q1, q2, ..] = *block else {
                    return Err(ParseError::TooShort { family, len });
                };
                ProxyHeader::Proxy {
                    source: SocketAddr::new(
                        Ipv4Addr::new(a, b, c, d).into(),
                        u16::from_be_bytes([p1, p2]),
                    ),
                    destination: SocketAddr::new(
                        Ipv4Addr::new(e, f, g, h).into(),
                        u16::from_be_bytes([q1, q2]),
                    ),
                }
            }
            TCP_OVER_IPV6 => {
                if block.len() < 36 {
                    return Err(ParseError::TooShort { family, len });
                }
                let ip = |at: usize| {
                    let mut octets = [0u8; 16];
                    octets.copy_from_slice(&block[at..at + 16]);
                    IpAddr::V6(Ipv6Addr::from(octets))
                };
                let port = |at: usize| u16::from_be_bytes([block[at], block[at + 1]]);
                ProxyHeader::Proxy {
                    source: SocketAddr::new(ip(0), port(32)),
                    destination: SocketAddr::new(ip(16), port(34)),
                }
            }
            _ => ProxyHeader::Local,
        },
        other => return Err(ParseError::BadCommand(other)),
    };
    Ok(Some((header, used)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn ipv4_header_matches_the_spec_layout() {
        let header = encode_v2(addr("10.1.2.3:4567"), addr("10.9.8.7:80"));
        let expected: Vec<u8> = [
            &SIGNATURE[..],
            &[0x21, 0x11, 0x00, 0x0C],
            &[10, 1, 2, 3, 10, 9, 8, 7],
            &4567u16.to_be_bytes(),
            &80u16.to_be_bytes(),
        ]
        .concat();
        assert_eq!(header, expected);
    }

    #[test]
    fn round_trips_v4_v6_and_mixed() {
        let cases = [
            (addr("127.0.0.1:1"), addr("127.0.0.2:65535")),
            (addr("[2001:db8::1]:443"), addr("[::1]:8443")),
        ];
        for (source, destination) in cases {
            let header = encode_v2(source, destination);
            assert_eq!(
                parse_v2(&header),
                Ok(Some((
                    ProxyHeader::Proxy {
                        source,
                        destination
                    },
                    header.len()
                )))
            );
        }
        let header = encode_v2(addr("192.0.2.1:1000"), addr("[2001:db8::2]:80"));
        assert_eq!(header[13], TCP_OVER_IPV6);
        assert_eq!(header.len(), 16 + 36);
        assert_eq!(
            parse_v2(&header),
            Ok(Some((
                ProxyHeader::Proxy {
                    source: addr("[::ffff:192.0.2.1]:1000"),
                    destination: addr("[2001:db8::2]:80"),
                },
                header.len()
            )))
        );
    }

    #[test]
    fn incomplete_input_asks_for_more() {
        let header = encode_v2(addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        for cut in 0..header.len() {
            assert_eq!(parse_v2(&header[..cut]), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn skips_tlvs_and_keeps_payload() {
        let mut header = encode_v2(addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        header[15] += 5; // announce a 5-byte TLV
        header.extend_from_slice(&[0x04, 0x00, 0x02, 0xAB, 0xCD]);
        header.extend_from_slice(b"GET /");
        let (_, used) = parse_v2(&header).unwrap().unwrap();
        assert_eq!(&header[used..], b"GET /");
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(
            parse_v2(b"GET / HTTP/1.1\r\n"),
            Err(ParseError::BadSignature)
        );
        let mut header = encode_v2(addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        header[12] = 0x11;
        assert_eq!(parse_v2(&header), Err(ParseError::BadVersion(1)));
        header[12] = 0x2F;
        assert_eq!(parse_v2(&header), Err(ParseError::BadCommand(0xF)));
        let mut short = encode_v2_local();
        short[12] = 0x21;
        short[13] = TCP_OVER_IPV4;
        assert_eq!(
            parse_v2(&short),
            Err(ParseError::TooShort {
                family: 0x11,
                len: 0
            })
        );
    }

    #[test]
    fn local_header() {
        let header = encode_v2_local();
        assert_eq!(parse_v2(&header), Ok(Some((ProxyHeader::Local, 16))));
    }
}
