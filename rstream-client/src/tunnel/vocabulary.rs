//! The option values of a tunnel: protocol, transport type, HTTP version, edge TLS mode and minimum
//! TLS version.
//!
//! Each is written as its wire string (`http`, `datagram`, `http/1.1`, `passthrough`, `tls1.3`...):
//! [`Display`](std::fmt::Display), `as_str` and serde's `Serialize` give it, and
//! [`FromStr`] and serde's `Deserialize` read it the same way (surrounding blanks and case are
//! ignored), so a configuration file, a Kubernetes resource and the wire spell them alike. With the
//! `schemars` feature each also has a `JsonSchema`: one of its wire strings (`oneOf` of `const`s,
//! each with its description, as schemars derives it for a documented enum).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

macro_rules! string_enum {
    (
        #[doc = $doc:literal]
        $(#[$meta:meta])*
        $name:ident { $(#[doc = $vdoc:literal] $variant:ident => $text:literal),+ $(,)? }
    ) => {
        #[doc = $doc]
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name { $(#[doc = $vdoc] $variant),+ }

        impl $name {
            /// Every wire string, in declaration order.
            const WIRE_STRINGS: &'static [&'static str] = &[$($text),+];

            /// The wire string.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($text => Ok(Self::$variant),)+
                    other => Err(Error::InvalidTunnelOptions(format!(
                        concat!("unknown ", stringify!($name), " '{}'"), other))),
                }
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(
                &self,
                serializer: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(
                deserializer: D,
            ) -> std::result::Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                text.parse()
                    .map_err(|_| serde::de::Error::unknown_variant(&text, Self::WIRE_STRINGS))
            }
        }

        #[cfg(feature = "schemars")]
        #[cfg_attr(docsrs, doc(cfg(feature = "schemars")))]
        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn schema_id() -> std::borrow::Cow<'static, str> {
                concat!(module_path!(), "::", stringify!($name)).into()
            }

            // As schemars derives it for an enum of documented unit variants.
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({
                    "description": $doc.trim(),
                    "oneOf": [$({
                        "type": "string",
                        "const": $text,
                        "description": $vdoc.trim(),
                    }),+],
                })
            }
        }
    };
}

string_enum!(
    /// Edge protocol of a tunnel.
    TunnelProtocol {
        /// HTTP (the edge terminates TLS and HTTP).
        Http => "http",
        /// TLS (passthrough or terminated).
        Tls => "tls",
        /// DTLS (datagram tunnels, carried over TLS as length-prefixed records).
        Dtls => "dtls",
        /// QUIC (needs the QUIC transport; unsupported here).
        Quic => "quic",
        /// Raw TCP on a public port.
        Tcp => "tcp",
    }
);

string_enum!(
    /// Tunnel transport type.
    TunnelType {
        /// Stream of bytes.
        Bytestream => "bytestream",
        /// Datagrams (length-prefixed records over TLS, see [`crate::datagram`]).
        Datagram => "datagram",
    }
);

string_enum!(
    /// HTTP version spoken on inbound streams of an HTTP tunnel.
    HttpVersion {
        /// HTTP/1.1.
        Http11 => "http/1.1",
        /// HTTP/2 (known by some SDKs).
        H2 => "h2",
        /// HTTP/2 with prior knowledge.
        H2c => "h2c",
        /// HTTP/3 (needs the QUIC transport; unsupported here).
        H3 => "h3",
    }
);

string_enum!(
    /// Edge TLS handling.
    TlsMode {
        /// The edge terminates TLS.
        Terminated => "terminated",
        /// The edge forwards the raw TLS stream.
        Passthrough => "passthrough",
    }
);

string_enum!(
    /// Minimum TLS version at the edge.
    TlsMinVersion {
        /// TLS 1.2.
        Tls12 => "tls1.2",
        /// TLS 1.3.
        Tls13 => "tls1.3",
    }
);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn enum_parsing() {
        assert_eq!(
            "HTTP".parse::<TunnelProtocol>().unwrap(),
            TunnelProtocol::Http
        );
        assert_eq!(
            "http/1.1".parse::<HttpVersion>().unwrap(),
            HttpVersion::Http11
        );
        assert!("webtty".parse::<TunnelProtocol>().is_err());
    }

    #[test]
    fn serde_writes_and_reads_the_wire_strings() {
        let values = (
            TunnelProtocol::Dtls,
            TunnelType::Datagram,
            HttpVersion::H2c,
            TlsMode::Passthrough,
            TlsMinVersion::Tls13,
        );
        let json = serde_json::to_string(&values).unwrap();
        assert_eq!(json, r#"["dtls","datagram","h2c","passthrough","tls1.3"]"#);
        assert_eq!(
            serde_json::from_str::<(
                TunnelProtocol,
                TunnelType,
                HttpVersion,
                TlsMode,
                TlsMinVersion
            )>(&json)
            .unwrap(),
            values
        );
        // Read as `FromStr` reads them.
        assert_eq!(
            serde_json::from_str::<TunnelProtocol>(r#"" TCP ""#).unwrap(),
            TunnelProtocol::Tcp
        );
        let err = serde_json::from_str::<TlsMode>(r#""mirrored""#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mirrored") && err.contains("terminated") && err.contains("passthrough"),
            "{err}"
        );
        for (protocol, text) in [
            (TunnelProtocol::Http, "http"),
            (TunnelProtocol::Tls, "tls"),
            (TunnelProtocol::Dtls, "dtls"),
            (TunnelProtocol::Quic, "quic"),
            (TunnelProtocol::Tcp, "tcp"),
        ] {
            assert_eq!(protocol.to_string(), text);
            assert_eq!(text.parse::<TunnelProtocol>().unwrap(), protocol);
        }
    }

    #[cfg(feature = "schemars")]
    #[test]
    fn schemas_list_the_wire_strings() {
        let consts = |schema: &schemars::Schema| -> Vec<String> {
            let one_of = schema.get("oneOf").and_then(|v| v.as_array()).unwrap();
            one_of
                .iter()
                .map(|v| {
                    assert_eq!(v["type"], "string");
                    assert!(v["description"].as_str().is_some_and(|d| !d.is_empty()));
                    v["const"].as_str().unwrap().to_owned()
                })
                .collect()
        };
        let schema = schemars::schema_for!(TunnelProtocol);
        assert_eq!(consts(&schema), ["http", "tls", "dtls", "quic", "tcp"]);
        assert_eq!(
            schema.get("description").unwrap(),
            "Edge protocol of a tunnel."
        );
        let schema = schemars::schema_for!(HttpVersion);
        assert_eq!(consts(&schema), ["http/1.1", "h2", "h2c", "h3"]);
    }
}
