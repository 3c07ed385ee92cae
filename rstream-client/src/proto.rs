//! Protobuf messages of the rstream tunnel protocol, version 1.4.5.
//!
//! The types are hand-written `prost` derives (no `protoc` at build time). Field numbers, wire types and
//! wrapper presence follow the schema of package `rstream.io_rstrm.protobuf` exactly:
//!
//! * Google wrapper fields (`StringValue`, `BoolValue`, `UInt32Value`) are `Option<String>`,
//!   `Option<bool>` and `Option<u32>`: `Some(default)` is encoded as a present, empty sub-message.
//! * Plain proto3 scalars are plain Rust values (the default value is not encoded).
//! * Unknown fields and unknown `oneof` members are skipped when decoding.

// The types mirror generated protobuf code: large oneof variants are kept inline.
#![allow(clippy::large_enum_variant)]

/// The largest payload of a control frame (bytes); re-exported as `frame::MAX_FRAME_LEN`.
pub const MAX_FRAME_LEN: usize = 65_535;

/// The largest datagram a record of a datagram tunnel carries (bytes); re-exported as
/// `datagram::MAX_DATAGRAM_LEN`.
pub const MAX_DATAGRAM_LEN: usize = 65_535;

use std::collections::BTreeMap;
use std::net::IpAddr;

/// Protocol version sent in [`ClientDetails::protocol_version`].
pub const PROTOCOL_VERSION: &str = "1.4.5";

/// `google.protobuf.Timestamp`.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Non-negative fractions of a second, in nanoseconds.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl Timestamp {
    /// The current wall-clock time.
    pub fn now() -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            seconds: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
        }
    }
}

/// Engine error codes (`ErrorCode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ErrorCode {
    /// `ERROR_CODE_UNSPECIFIED`.
    Unspecified = 0,
    /// `ERROR_CODE_UNAUTHORIZED`: bad, expired or insufficient credential.
    Unauthorized = 1000,
    /// `ERROR_CODE_INVALID_REQUEST`: bad options.
    InvalidRequest = 2000,
    /// `ERROR_CODE_PROTOCOL_VERSION_MISSING`.
    ProtocolVersionMissing = 2010,
    /// `ERROR_CODE_PROTOCOL_VERSION_INVALID`.
    ProtocolVersionInvalid = 2020,
    /// `ERROR_CODE_PROTOCOL_VERSION_INCOMPATIBLE`.
    ProtocolVersionIncompatible = 2030,
    /// `ERROR_CODE_TUNNEL_NOT_FOUND`.
    TunnelNotFound = 3000,
    /// `ERROR_CODE_INVALID_STREAM`.
    InvalidStream = 4000,
    /// `ERROR_CODE_FEATURE_NOT_AVAILABLE`.
    FeatureNotAvailable = 5000,
    /// `ERROR_CODE_SERVICE_UNAVAILABLE`.
    ServiceUnavailable = 6000,
    /// `ERROR_CODE_CAPACITY_EXHAUSTED`.
    CapacityExhausted = 7000,
    /// `ERROR_CODE_INTERNAL`.
    Internal = 9000,
}

/// `IpAddress`: the downstream peer address of an inbound stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IpAddress {
    /// The address.
    #[prost(oneof = "ip_address::Addr", tags = "1, 2")]
    pub addr: Option<ip_address::Addr>,
}

/// Members of [`IpAddress`].
pub mod ip_address {
    /// The `addr` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Addr {
        /// IPv4 as `u32::from(Ipv4Addr)` (fixed32 on the wire).
        #[prost(fixed32, tag = "1")]
        V4(u32),
        /// IPv6: 16 bytes in network order.
        #[prost(bytes = "vec", tag = "2")]
        V6(Vec<u8>),
    }
}

impl IpAddress {
    /// Converts to a standard address; `None` if unset or malformed.
    pub fn to_ip(&self) -> Option<IpAddr> {
        match &self.addr {
            Some(ip_address::Addr::V4(v)) => Some(IpAddr::from(std::net::Ipv4Addr::from(*v))),
            Some(ip_address::Addr::V6(b)) => {
                let octets: [u8; 16] = b.as_slice().try_into().ok()?;
                Some(IpAddr::from(octets))
            }
            None => None,
        }
    }
}

impl From<IpAddr> for IpAddress {
    fn from(ip: IpAddr) -> Self {
        let addr = match ip {
            IpAddr::V4(v4) => ip_address::Addr::V4(u32::from(v4)),
            IpAddr::V6(v6) => ip_address::Addr::V6(v6.octets().to_vec()),
        };
        Self { addr: Some(addr) }
    }
}

/// `Error`: an engine (or client) error with a code and an optional message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Error {
    /// The [`ErrorCode`] as a raw integer (unknown values are kept).
    #[prost(enumeration = "ErrorCode", tag = "1")]
    pub code: i32,
    /// Human-readable text.
    #[prost(message, optional, tag = "2")]
    pub message: Option<String>,
}

impl Error {
    /// Builds an error with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: code as i32,
            message: Some(message.into()),
        }
    }
}

/// `ClientDetails`: identity and credential of a client connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ClientDetails {
    /// Client software name.
    #[prost(message, optional, tag = "1")]
    pub agent: Option<String>,
    /// Release channel.
    #[prost(message, optional, tag = "2")]
    pub channel: Option<String>,
    /// Client version.
    #[prost(message, optional, tag = "3")]
    pub version: Option<String>,
    /// Operating system.
    #[prost(message, optional, tag = "4")]
    pub os: Option<String>,
    /// CPU architecture.
    #[prost(message, optional, tag = "5")]
    pub arch: Option<String>,
    /// Credential: user token, or the per-stream secret on proxy connections.
    #[prost(message, optional, tag = "6")]
    pub token: Option<String>,
    /// Protocol version, `"1.4.5"`.
    #[prost(message, optional, tag = "7")]
    pub protocol_version: Option<String>,
}

/// `ServerDetails`: informational engine details.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerDetails {
    /// Engine software.
    #[prost(message, optional, tag = "1")]
    pub agent: Option<String>,
    /// Engine channel.
    #[prost(message, optional, tag = "2")]
    pub channel: Option<String>,
    /// Engine version.
    #[prost(message, optional, tag = "3")]
    pub version: Option<String>,
    /// Project plan.
    #[prost(message, optional, tag = "4")]
    pub plan: Option<String>,
    /// Cloud provider.
    #[prost(message, optional, tag = "5")]
    pub provider: Option<String>,
    /// Engine region.
    #[prost(message, optional, tag = "6")]
    pub region: Option<String>,
    /// Update-available hint.
    #[prost(message, optional, tag = "7")]
    pub update: Option<String>,
}

/// `TunnelProperties`: requested (in `OpenTunnelReq`) or resulting (in `OpenTunnelRsp`) tunnel properties.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TunnelProperties {
    /// Engine-assigned tunnel ID (read-only).
    #[prost(message, optional, tag = "1")]
    pub id: Option<String>,
    /// Creation time (read-only).
    #[prost(message, optional, tag = "2")]
    pub creation_date: Option<Timestamp>,
    /// Tunnel name.
    #[prost(message, optional, tag = "3")]
    pub name: Option<String>,
    /// `bytestream` or `datagram`.
    #[prost(message, optional, tag = "4")]
    pub r#type: Option<String>,
    /// Published at the edge; absent means true.
    #[prost(message, optional, tag = "5")]
    pub publish: Option<bool>,
    /// `http`, `tls`, `tcp`, `dtls`, `quic`.
    #[prost(message, optional, tag = "6")]
    pub protocol: Option<String>,
    /// Inventory labels.
    #[prost(btree_map = "string, string", tag = "7")]
    pub labels: BTreeMap<String, String>,
    /// Allowed countries (ISO 3166-1 alpha-2).
    #[prost(string, repeated, tag = "8")]
    pub geoip: Vec<String>,
    /// Allowed source CIDRs.
    #[prost(string, repeated, tag = "9")]
    pub trusted_ips: Vec<String>,
    /// Deprecated legacy public authority (read-only).
    #[prost(message, optional, tag = "10")]
    pub host: Option<String>,
    /// `terminated` or `passthrough`.
    #[prost(message, optional, tag = "11")]
    pub tls_mode: Option<String>,
    /// ALPNs accepted at the edge.
    #[prost(string, repeated, tag = "12")]
    pub tls_alpns: Vec<String>,
    /// `tls1.2` or `tls1.3`.
    #[prost(message, optional, tag = "13")]
    pub tls_min_version: Option<String>,
    /// Edge cipher list.
    #[prost(string, repeated, tag = "14")]
    pub tls_ciphers: Vec<String>,
    /// Require downstream client certificates.
    #[prost(message, optional, tag = "15")]
    pub mtls_auth: Option<bool>,
    /// Deprecated legacy CA for downstream mTLS.
    #[prost(message, optional, tag = "16")]
    pub mtls_cacert_pem: Option<String>,
    /// `http/1.1`, `h2`, `h2c`, `h3`.
    #[prost(message, optional, tag = "17")]
    pub http_version: Option<String>,
    /// Deprecated, superseded by `upstream_tls`.
    #[prost(message, optional, tag = "18")]
    pub http_use_tls: Option<bool>,
    /// The edge requires a bearer token.
    #[prost(message, optional, tag = "19")]
    pub token_auth: Option<bool>,
    /// The edge requires an rstream account login.
    #[prost(message, optional, tag = "20")]
    pub rstream_auth: Option<bool>,
    /// The edge shows a browser challenge.
    #[prost(message, optional, tag = "21")]
    pub challenge_mode: Option<bool>,
    /// Stable hostname request / public host.
    #[prost(message, optional, tag = "22")]
    pub hostname: Option<String>,
    /// Public port (requestable for `tcp` only).
    #[prost(message, optional, tag = "23")]
    pub port: Option<u32>,
    /// The local upstream speaks TLS.
    #[prost(message, optional, tag = "24")]
    pub upstream_tls: Option<bool>,
    /// Datagram only: use the reliable path.
    #[prost(message, optional, tag = "25")]
    pub datagram_guaranteed_delivery: Option<bool>,
    /// Allow a cross-region payload path.
    #[prost(message, optional, tag = "26")]
    pub allow_cross_region_routing: Option<bool>,
}

/// `ControlChannelLiveness` (1.4.5).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct ControlChannelLiveness {
    /// Client heartbeat period in ms.
    #[prost(uint32, tag = "1")]
    pub heartbeat_interval_ms: u32,
    /// Silence after which the peer is considered dead, in ms (set by the engine).
    #[prost(uint32, tag = "2")]
    pub heartbeat_timeout_ms: u32,
}

/// `OpenControlChannelReq`: first frame of a control connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenControlChannelReq {
    /// Identity and credential.
    #[prost(message, optional, tag = "1")]
    pub client_details: Option<ClientDetails>,
    /// Requested liveness policy (only when heartbeats are enabled).
    #[prost(message, optional, tag = "2")]
    pub liveness: Option<ControlChannelLiveness>,
}

/// `OpenControlChannelRsp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenControlChannelRsp {
    /// Accepted or rejected.
    #[prost(oneof = "open_control_channel_rsp::Payload", tags = "1, 2")]
    pub payload: Option<open_control_channel_rsp::Payload>,
}

/// Members of [`OpenControlChannelRsp`].
pub mod open_control_channel_rsp {
    /// `OpenControlChannelRsp.Ok`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Ok {
        /// Engine-assigned client ID.
        #[prost(string, tag = "1")]
        pub client_id: String,
        /// Engine information.
        #[prost(message, optional, tag = "2")]
        pub server_details: Option<super::ServerDetails>,
        /// Negotiated liveness; absent means legacy heartbeat mode.
        #[prost(message, optional, tag = "3")]
        pub liveness: Option<super::ControlChannelLiveness>,
    }

    /// The `payload` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// Accepted.
        #[prost(message, tag = "1")]
        Ok(Ok),
        /// Rejected.
        #[prost(message, tag = "2")]
        Error(super::Error),
    }
}

/// `CloseControlChannelReq` (no fields).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct CloseControlChannelReq {}

/// `CloseControlChannelRsp` (no fields).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct CloseControlChannelRsp {}

/// `OpenTunnelReq`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenTunnelReq {
    /// Client correlation ID.
    #[prost(string, tag = "1")]
    pub request_id: String,
    /// Requested properties.
    #[prost(message, optional, tag = "2")]
    pub tunnel_properties: Option<TunnelProperties>,
}

/// `OpenTunnelRsp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenTunnelRsp {
    /// Echo of the request ID.
    #[prost(string, tag = "1")]
    pub request_id: String,
    /// Result.
    #[prost(oneof = "open_tunnel_rsp::Payload", tags = "2, 3")]
    pub payload: Option<open_tunnel_rsp::Payload>,
}

/// Members of [`OpenTunnelRsp`].
pub mod open_tunnel_rsp {
    /// The `payload` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// The resulting tunnel.
        #[prost(message, tag = "2")]
        TunnelProperties(super::TunnelProperties),
        /// Creation failed.
        #[prost(message, tag = "3")]
        Error(super::Error),
    }
}

/// `CloseTunnelReq`.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct CloseTunnelReq {
    /// Tunnel to close.
    #[prost(string, tag = "1")]
    pub tunnel_id: String,
}

/// `CloseTunnelRsp`: reply to a close, or unsolicited when the engine drops a tunnel.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct CloseTunnelRsp {
    /// The closed tunnel.
    #[prost(string, tag = "1")]
    pub tunnel_id: String,
}

/// `ProxyConnReq`: engine asks the owner to open a data connection for a stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProxyConnReq {
    /// Which of the owner's tunnels.
    #[prost(string, tag = "1")]
    pub tunnel_id: String,
    /// Stream identifier.
    #[prost(string, tag = "2")]
    pub stream_id: String,
    /// Per-stream credential.
    #[prost(message, optional, tag = "3")]
    pub secret: Option<String>,
    /// Downstream peer IP.
    #[prost(message, optional, tag = "4")]
    pub source_ip: Option<IpAddress>,
    /// Dial this `host:port` instead of the control engine (1.4.5).
    #[prost(message, optional, tag = "5")]
    pub proxy_endpoint: Option<String>,
}

/// `ProxyConnRsp`: owner reports the delivery result.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProxyConnRsp {
    /// Echo.
    #[prost(string, tag = "1")]
    pub stream_id: String,
    /// Absent = delivered.
    #[prost(message, optional, tag = "2")]
    pub error: Option<Error>,
}

/// `ProxyReq`: first frame of an owner's data connection.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProxyReq {
    /// Client identity; `token` is the per-stream secret.
    #[prost(message, optional, tag = "1")]
    pub client_details: Option<ClientDetails>,
    /// From `ProxyConnReq`.
    #[prost(string, tag = "2")]
    pub stream_id: String,
    /// True: the engine sends no `ProxyRsp`.
    #[prost(message, optional, tag = "3")]
    pub zero_rtt: Option<bool>,
}

/// `ProxyRsp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProxyRsp {
    /// Absent = success.
    #[prost(message, optional, tag = "1")]
    pub error: Option<Error>,
}

/// `StreamReq`: first frame of a private dial.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamReq {
    /// Client identity; `token` is the user token.
    #[prost(message, optional, tag = "1")]
    pub client_details: Option<ClientDetails>,
    /// Target tunnel ID or name.
    #[prost(string, tag = "2")]
    pub tunnel_id_name: String,
    /// True: the engine sends no `StreamRsp`.
    #[prost(message, optional, tag = "3")]
    pub zero_rtt: Option<bool>,
    /// Go QUIC datagram channel (unused here).
    #[prost(message, optional, tag = "4")]
    pub datagram_channel: Option<bool>,
}

/// `StreamRsp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamRsp {
    /// Success or failure.
    #[prost(oneof = "stream_rsp::Payload", tags = "1, 2")]
    pub payload: Option<stream_rsp::Payload>,
}

/// Members of [`StreamRsp`].
pub mod stream_rsp {
    /// The `payload` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// Success: the assigned stream ID.
        #[prost(string, tag = "1")]
        StreamId(String),
        /// Failure.
        #[prost(message, tag = "2")]
        Error(super::Error),
    }
}

/// `DatagramChannelClose` (1.4.3+, Go QUIC only).
#[derive(Clone, PartialEq, prost::Message)]
pub struct DatagramChannelClose {
    /// The datagram channel stream.
    #[prost(string, tag = "1")]
    pub stream_id: String,
    /// Optional reason.
    #[prost(message, optional, tag = "2")]
    pub error: Option<Error>,
}

/// `Heartbeat`: `sequence` from the client, `acknowledgement` from the engine (both 0 in legacy mode).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct Heartbeat {
    /// Client sequence number.
    #[prost(uint64, tag = "1")]
    pub sequence: u64,
    /// Engine acknowledgement.
    #[prost(uint64, tag = "2")]
    pub acknowledgement: u64,
}

/// `ServerMessage`: informational text from the engine.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ServerMessage {
    /// The text.
    #[prost(string, tag = "1")]
    pub message: String,
}

/// The top-level `Message` carried by every frame.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Message {
    /// The payload; `None` for an empty (or unknown) message.
    #[prost(
        oneof = "message::Payload",
        tags = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17"
    )]
    pub payload: Option<message::Payload>,
}

/// Members of [`Message`].
pub mod message {
    /// The `payload` oneof of the top-level [`Message`](super::Message).
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// Client, first control frame.
        #[prost(message, tag = "1")]
        OpenControlChannelReq(super::OpenControlChannelReq),
        /// Engine reply.
        #[prost(message, tag = "2")]
        OpenControlChannelRsp(super::OpenControlChannelRsp),
        /// Client close request.
        #[prost(message, tag = "3")]
        CloseControlChannelReq(super::CloseControlChannelReq),
        /// Engine close reply.
        #[prost(message, tag = "4")]
        CloseControlChannelRsp(super::CloseControlChannelRsp),
        /// Create a tunnel.
        #[prost(message, tag = "5")]
        OpenTunnelReq(super::OpenTunnelReq),
        /// Tunnel creation result.
        #[prost(message, tag = "6")]
        OpenTunnelRsp(super::OpenTunnelRsp),
        /// Close a tunnel.
        #[prost(message, tag = "7")]
        CloseTunnelReq(super::CloseTunnelReq),
        /// Tunnel closed.
        #[prost(message, tag = "8")]
        CloseTunnelRsp(super::CloseTunnelRsp),
        /// Engine asks for a data connection.
        #[prost(message, tag = "9")]
        ProxyConnReq(super::ProxyConnReq),
        /// Owner reports delivery.
        #[prost(message, tag = "10")]
        ProxyConnRsp(super::ProxyConnRsp),
        /// Owner data connection request.
        #[prost(message, tag = "11")]
        ProxyReq(super::ProxyReq),
        /// Engine reply to `ProxyReq`.
        #[prost(message, tag = "12")]
        ProxyRsp(super::ProxyRsp),
        /// Private dial request.
        #[prost(message, tag = "13")]
        StreamReq(super::StreamReq),
        /// Engine reply to `StreamReq`.
        #[prost(message, tag = "14")]
        StreamRsp(super::StreamRsp),
        /// Heartbeat or acknowledgement.
        #[prost(message, tag = "15")]
        Heartbeat(super::Heartbeat),
        /// Informational engine text.
        #[prost(message, tag = "16")]
        ServerMessage(super::ServerMessage),
        /// Datagram channel closed.
        #[prost(message, tag = "17")]
        DatagramChannelClose(super::DatagramChannelClose),
    }

    impl Payload {
        /// The protobuf field name of this member, for diagnostics.
        pub fn name(&self) -> &'static str {
            match self {
                Payload::OpenControlChannelReq(_) => "open_control_channel_req",
                Payload::OpenControlChannelRsp(_) => "open_control_channel_rsp",
                Payload::CloseControlChannelReq(_) => "close_control_channel_req",
                Payload::CloseControlChannelRsp(_) => "close_control_channel_rsp",
                Payload::OpenTunnelReq(_) => "open_tunnel_req",
                Payload::OpenTunnelRsp(_) => "open_tunnel_rsp",
                Payload::CloseTunnelReq(_) => "close_tunnel_req",
                Payload::CloseTunnelRsp(_) => "close_tunnel_rsp",
                Payload::ProxyConnReq(_) => "proxy_conn_req",
                Payload::ProxyConnRsp(_) => "proxy_conn_rsp",
                Payload::ProxyReq(_) => "proxy_req",
                Payload::ProxyRsp(_) => "proxy_rsp",
                Payload::StreamReq(_) => "stream_req",
                Payload::StreamRsp(_) => "stream_rsp",
                Payload::Heartbeat(_) => "heartbeat",
                Payload::ServerMessage(_) => "server_message",
                Payload::DatagramChannelClose(_) => "datagram_channel_close",
            }
        }
    }
}

impl Message {
    /// Wraps a payload.
    pub fn new(payload: message::Payload) -> Self {
        Self {
            payload: Some(payload),
        }
    }

    /// The payload name, or `"empty"`.
    pub fn kind(&self) -> &'static str {
        self.payload
            .as_ref()
            .map_or("empty", message::Payload::name)
    }
}

impl From<message::Payload> for Message {
    fn from(payload: message::Payload) -> Self {
        Self::new(payload)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use prost::Message as _;

    #[test]
    fn ip_address_vector_and_roundtrip() {
        let ip: IpAddr = "203.0.113.7".parse().unwrap();
        let encoded = IpAddress::from(ip).encode_to_vec();
        assert_eq!(encoded, [0x0d, 0x07, 0x71, 0x00, 0xcb]);
        assert_eq!(
            IpAddress::decode(encoded.as_slice()).unwrap().to_ip(),
            Some(ip)
        );
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(IpAddress::from(v6).to_ip(), Some(v6));
        let bad = IpAddress {
            addr: Some(ip_address::Addr::V6(vec![1, 2, 3])),
        };
        assert_eq!(bad.to_ip(), None);
    }

    #[test]
    fn wrapper_presence_is_encoded() {
        let req = ProxyReq {
            client_details: None,
            stream_id: "s1".into(),
            zero_rtt: Some(false),
        };
        assert_eq!(req.encode_to_vec(), [0x12, 0x02, b's', b'1', 0x1a, 0x00]);
        let absent = ProxyReq {
            client_details: None,
            stream_id: "s1".into(),
            zero_rtt: None,
        };
        assert_eq!(absent.encode_to_vec(), [0x12, 0x02, b's', b'1']);
    }

    #[test]
    fn unknown_error_codes_are_kept() {
        let e = Error {
            code: 1234,
            message: None,
        };
        let back = Error::decode(e.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.code, 1234);
        assert!(ErrorCode::try_from(back.code).is_err());
    }
}
