//! Client of the [rstream](https://rstream.io) tunnel protocol (version 1.4.5), with a local engine for
//! tests.
//!
//! The protocol runs over TLS (ALPN `rstrm/1`) with one TLS connection per logical channel: a long-lived
//! **control channel** carrying length-prefixed protobuf frames, and one **data connection** per inbound
//! stream or private dial, which becomes a raw byte pipe after its first frame. This crate implements the
//! client side for bytestream tunnels (`http`, `tls`, `tcp`) and for datagram tunnels over TLS
//! (`dtls`: each datagram a length-prefixed record inside a data connection, see [`datagram`]).
//! The QUIC transport, `quic` tunnels and HTTP/3 are rejected with [`Error::Unsupported`].
//!
//! ```no_run
//! # async fn demo() -> rstream_client::Result<()> {
//! use rstream_client::{forward, tunnel::TunnelOptions, Client};
//!
//! let client = Client::builder().engine("abc.c.example.io:443").token("...").build()?;
//! let control = client.connect().await?;
//! let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await?;
//! println!("reachable at {}", tunnel.forwarding_address()?);
//! forward::forward(&mut tunnel, "127.0.0.1:8080").await?;
//! # Ok(()) }
//! ```
//!
//! With the `engine` feature, [`engine::LocalEngine`] runs an engine in-process on loopback; its module
//! documentation has a runnable end-to-end example.
//!
//! # Layout
//!
//! | Module | Role |
//! |---|---|
//! | [`proto`] | Hand-written `prost` types of the 1.4.5 schema (no `protoc` at build time) and the protocol's size limits. |
//! | [`frame`] | The frame codec: u32 big-endian length + `Message`, at most 65 535 bytes; leftover bytes kept. |
//! | [`tls`] | rustls client configuration: ALPN `rstrm/1`, CA bundle or system roots, SNI override, insecure mode, mTLS identity. |
//! | [`resolve`] | Engine addresses (`host[:port]`) and project-endpoint resolution through the control plane (redirects not followed, region rules). |
//! | [`client`] | [`Client`], [`ControlChannel`] (handshake, liveness negotiation, heartbeats, tunnels, inbound-stream dispatch with bounded dials and queue) and private dials. |
//! | [`tunnel`] | [`tunnel::TunnelOptions`] and its option values (serde: their wire strings), the SDKs' validation rules, the forwarding-address string and stable hostnames. |
//! | [`stream`] | [`RstreamStream`], the byte pipe of an inbound stream or a private dial. |
//! | [`supervisor`] | Keeps a tunnel up: reconnect with backoff and jitter, re-create, reuse a stable hostname, report state changes. |
//! | [`forward`] | Relays accepted streams to a local TCP target ([`forward::relay`] is the single copy function). |
//! | [`datagram`] | Datagram streams: the record codec, [`datagram::DatagramStream`], and the UDP relay of datagram tunnels. |
//! | [`error`] | [`Error`] with engine codes and [`Error::retryable`]; every error type of the crate (frame and datagram errors too), so it depends only on [`proto`]. |
//! | `engine` | (feature `engine`) `LocalEngine` and `LocalControlPlane` for tests, examples and demos. |
//!
//! # Errors
//!
//! A variant with a cause returns it from `source()` and does not repeat it in its message, which
//! says only what failed at its own level ("cannot listen on 0.0.0.0:80", not "...: address in
//! use"). That is the convention of the Rust ecosystem, so a caller can walk or downcast the
//! chain, and a program that prints every cause in turn shows each one once; printing the chain
//! is the binary's job (`netkit_runtime::error_chain` does it for this workspace's).
//!
//! # Feature flags
//!
//! * `engine`: the `engine` module, [`engine::LocalEngine`] and `LocalControlPlane`, an
//!   in-process engine for tests, examples and demos (pulls in `rcgen`).
//! * `schemars`: `schemars::JsonSchema` for the tunnel option values ([`tunnel::TunnelProtocol`],
//!   [`tunnel::TunnelType`], [`tunnel::HttpVersion`], [`tunnel::TlsMode`],
//!   [`tunnel::TlsMinVersion`]): strings whose `enum` is their wire strings, for schemas that
//!   embed them (a Kubernetes CRD). Their serde form, the wire string, needs no feature.
//!
//! # Behaviour notes
//!
//! * Tokens: a JWT whose `exp` is in the past fails [`ClientBuilder::build`] with [`Error::TokenExpired`].
//!   A token and an mTLS client certificate together are rejected ([`Error::AuthConflict`]).
//! * Heartbeats (default every 5 s) use the negotiated 1.4.5 mode when the engine returns a liveness
//!   policy; silence longer than the negotiated timeout ends the channel with [`Error::ControlLiveness`].
//! * When the control channel is lost (I/O error, EOF, liveness), streams already accepted keep working;
//!   an explicit close or a protocol violation also closes the streams being forwarded.
//! * Zero-RTT is on by default, like the official SDKs.
//! * An inbound-stream data dial that times out is tried once more (the Go SDK's rule); an HTTP
//!   proxy ([`ClientBuilder::proxy`]) carries every engine connection and the control-plane lookup.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
pub mod datagram;
#[cfg(feature = "engine")]
#[cfg_attr(docsrs, doc(cfg(feature = "engine")))]
pub mod engine;
pub mod error;
pub mod forward;
pub mod frame;
pub mod proto;
pub mod resolve;
pub mod stream;
pub mod supervisor;
pub mod tls;
pub mod tunnel;

pub use client::{Client, ClientBuilder, ControlChannel, IpFamily, Tunnel};
pub use error::{EngineErrorCode, Error, Result};
/// The HTTP proxy the client reaches engines and the control plane through
/// ([`ClientBuilder::proxy`]); proxy-core's connector, re-exported.
pub use proxy_core::http_connect::{HttpConnectError, HttpProxy};
pub use stream::RstreamStream;

// The README's code blocks are compiled as doctests, so its example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
