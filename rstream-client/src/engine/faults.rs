//! Fault injection: what a test can make the engine do wrong.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

use bytes::Bytes;

use crate::proto::ErrorCode;

/// Runtime fault-injection switches. Change them at any time through
/// [`LocalEngine::faults`](super::LocalEngine::faults).
#[derive(Debug, Default)]
pub struct Faults {
    /// Stop acknowledging heartbeats.
    pub stop_acking_heartbeats: AtomicBool,
    /// Stop reading and answering control frames (the client sees silence).
    pub stall_control: AtomicBool,
    /// Reply to `OpenControlChannelReq` with this error.
    pub open_control_error: Mutex<Option<(ErrorCode, String)>>,
    /// Reply to `OpenTunnelReq` with this error.
    pub open_tunnel_error: Mutex<Option<(ErrorCode, String)>>,
    /// Reply to `StreamReq` with this error (when the dialer awaits a response).
    pub stream_error: Mutex<Option<(ErrorCode, String)>>,
    /// Never answer the TLS handshake of this many upcoming connections (each is held, then
    /// dropped): the client's dial times out.
    pub hang_next_tls_handshakes: AtomicUsize,
    /// Delay the TLS handshake of every new connection by this much.
    pub stall_tls_handshake: Mutex<Option<Duration>>,
    /// Send these bytes in the same write as the next `ProxyRsp` to an owner (one shot).
    pub coalesce_proxy_rsp: Mutex<Option<Bytes>>,
    /// Send these bytes in the same write as the next `StreamRsp` to a dialer (one shot).
    pub coalesce_stream_rsp: Mutex<Option<Bytes>>,
}
