//! Frame codec: a 4-byte big-endian length followed by a protobuf [`Message`], at most 65 535 bytes.
//!
//! [`decode`] works on a buffer (streaming-friendly: it returns `Ok(None)` until a frame is complete),
//! [`FrameReader`] reads frames from an [`AsyncRead`] and keeps any bytes that arrived after a frame
//! (the leftover payload of a data connection), and [`write_frame`] writes one frame.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::proto::Message;

pub use crate::error::FrameError;
pub use crate::proto::MAX_FRAME_LEN;
/// Size of the length header.
pub const HEADER_LEN: usize = 4;

/// Encodes a message as one frame (header + payload).
pub fn encode(message: &Message) -> Result<Bytes, FrameError> {
    let mut buf = BytesMut::new();
    encode_into(message, &mut buf)?;
    Ok(buf.freeze())
}

/// Appends one frame to `buf`. Nothing is written if the message is too large.
pub fn encode_into(message: &Message, buf: &mut BytesMut) -> Result<(), FrameError> {
    let len = message.encoded_len();
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    buf.reserve(HEADER_LEN + len);
    // `len` fits in u32 because it is <= MAX_FRAME_LEN.
    buf.put_u32(len as u32);
    // prost fails only when the buffer cannot take `len` more bytes.
    message
        .encode(buf)
        .map_err(|_| FrameError::TooLarge { len })
}

/// Decodes one frame from the front of `buf`.
///
/// Returns `Ok(None)` if `buf` does not yet hold a whole frame (nothing is consumed), `Ok(Some(msg))`
/// after consuming exactly one frame, or an error for an oversized header or an undecodable payload.
/// An oversized header is rejected as soon as the 4 header bytes are present.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Message>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    if buf.len() < HEADER_LEN + len {
        return Ok(None);
    }
    buf.advance(HEADER_LEN);
    let payload = buf.split_to(len);
    Message::decode(payload.freeze())
        .map(Some)
        .map_err(FrameError::Decode)
}

/// Reads frames from `io`, keeping the bytes that follow the last frame.
#[derive(Debug)]
pub struct FrameReader<R> {
    io: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Wraps a reader.
    pub fn new(io: R) -> Self {
        Self {
            io,
            buf: BytesMut::with_capacity(8 * 1024),
        }
    }

    /// Reads the next frame. EOF before a frame starts is [`FrameError::Closed`]; in the middle of a
    /// frame it is [`FrameError::Truncated`]; I/O errors are returned as [`crate::Error::Io`].
    pub async fn read_frame(&mut self) -> crate::Result<Message> {
        loop {
            if let Some(message) = decode(&mut self.buf)? {
                return Ok(message);
            }
            let n = self
                .io
                .read_buf(&mut self.buf)
                .await
                .map_err(crate::Error::io)?;
            if n == 0 {
                if self.buf.is_empty() {
                    return Err(FrameError::Closed.into());
                }
                let expected = if self.buf.len() >= HEADER_LEN {
                    HEADER_LEN
                        + u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                            as usize
                } else {
                    HEADER_LEN
                };
                return Err(FrameError::Truncated {
                    expected,
                    got: self.buf.len(),
                }
                .into());
            }
        }
    }

    /// Bytes received after the last decoded frame.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// A mutable reference to the inner reader.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.io
    }

    /// Returns the reader and the bytes received after the last frame.
    pub fn into_parts(self) -> (R, Bytes) {
        (self.io, self.buf.freeze())
    }
}

/// Writes one frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    io: &mut W,
    message: &Message,
) -> crate::Result<()> {
    let frame = encode(message)?;
    io.write_all(&frame).await.map_err(crate::Error::io)?;
    io.flush().await.map_err(crate::Error::io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::proto::{self, message::Payload};
    use proptest::prelude::*;

    fn hex(b: &[u8]) -> String {
        b.iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn reference_vectors() {
        let cases: Vec<(Message, &str)> = vec![
            (
                Payload::Heartbeat(proto::Heartbeat::default()).into(),
                "00 00 00 02 7a 00",
            ),
            (
                Payload::Heartbeat(proto::Heartbeat {
                    sequence: 1,
                    acknowledgement: 0,
                })
                .into(),
                "00 00 00 04 7a 02 08 01",
            ),
            (
                Payload::Heartbeat(proto::Heartbeat {
                    sequence: 0,
                    acknowledgement: 1,
                })
                .into(),
                "00 00 00 04 7a 02 10 01",
            ),
            (
                Payload::CloseControlChannelReq(proto::CloseControlChannelReq {}).into(),
                "00 00 00 02 1a 00",
            ),
            (
                Payload::CloseControlChannelRsp(proto::CloseControlChannelRsp {}).into(),
                "00 00 00 02 22 00",
            ),
            (
                Payload::ProxyRsp(proto::ProxyRsp { error: None }).into(),
                "00 00 00 02 62 00",
            ),
            (
                Payload::CloseTunnelReq(proto::CloseTunnelReq {
                    tunnel_id: "t1".into(),
                })
                .into(),
                "00 00 00 06 3a 04 0a 02 74 31",
            ),
            (
                Payload::ProxyReq(proto::ProxyReq {
                    client_details: None,
                    stream_id: "s1".into(),
                    zero_rtt: Some(false),
                })
                .into(),
                "00 00 00 08 5a 06 12 02 73 31 1a 00",
            ),
        ];
        for (message, expected) in cases {
            let encoded = encode(&message).unwrap();
            assert_eq!(hex(&encoded), expected, "{}", message.kind());
            let mut buf = BytesMut::from(&encoded[..]);
            assert_eq!(decode(&mut buf).unwrap(), Some(message));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn oversized_header_is_rejected_before_payload() {
        let mut buf = BytesMut::from(&[0x00, 0x01, 0x00, 0x00][..]);
        assert_eq!(decode(&mut buf), Err(FrameError::TooLarge { len: 65_536 }));
        let mut max = BytesMut::from(&[0x00, 0x00, 0xff, 0xff][..]);
        assert_eq!(
            decode(&mut max),
            Ok(None),
            "65535 is allowed; waits for the payload"
        );
    }

    #[test]
    fn oversized_message_is_not_sent() {
        let big = Message::new(Payload::ServerMessage(proto::ServerMessage {
            message: "x".repeat(70_000),
        }));
        assert!(matches!(encode(&big), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn malformed_and_empty_payloads() {
        let mut buf = BytesMut::from(&[0x00, 0x00, 0x00, 0x01, 0xff][..]);
        assert!(matches!(decode(&mut buf), Err(FrameError::Decode(_))));
        let mut empty = BytesMut::from(&[0, 0, 0, 0][..]);
        assert_eq!(decode(&mut empty).unwrap(), Some(Message { payload: None }));
    }

    #[test]
    fn unknown_oneof_member_is_ignored() {
        // field 99, length-delimited, 2 bytes; then a heartbeat.
        let payload = [0x9a, 0x06, 0x02, 0x08, 0x01, 0x7a, 0x00];
        let mut buf = BytesMut::new();
        buf.put_u32(payload.len() as u32);
        buf.put_slice(&payload);
        let msg = decode(&mut buf).unwrap().unwrap();
        assert_eq!(msg.kind(), "heartbeat");
        let only_unknown = [0x9a, 0x06, 0x00];
        let mut buf = BytesMut::new();
        buf.put_u32(3);
        buf.put_slice(&only_unknown);
        assert_eq!(decode(&mut buf).unwrap().unwrap().payload, None);
    }

    #[tokio::test]
    async fn reader_reports_truncation_and_keeps_leftover() {
        let mut bytes = encode(&Payload::ProxyRsp(proto::ProxyRsp::default()).into())
            .unwrap()
            .to_vec();
        bytes.extend_from_slice(b"payload");
        let mut reader = FrameReader::new(bytes.as_slice());
        assert_eq!(reader.read_frame().await.unwrap().kind(), "proxy_rsp");
        let (_, rest) = reader.into_parts();
        assert_eq!(&rest[..], b"payload");

        let truncated = [0u8, 0, 0, 8, 0x5a, 0x06];
        let mut reader = FrameReader::new(&truncated[..]);
        let err = reader.read_frame().await.unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::Frame(FrameError::Truncated {
                    expected: 12,
                    got: 6
                })
            ),
            "{err}"
        );

        let mut reader = FrameReader::new(&[][..]);
        assert!(matches!(
            reader.read_frame().await,
            Err(crate::Error::Frame(FrameError::Closed))
        ));
    }

    fn arb_message() -> impl Strategy<Value = Message> {
        let s = "[a-z0-9]{0,12}";
        prop_oneof![
            (any::<u64>(), any::<u64>()).prop_map(|(s, a)| Payload::Heartbeat(proto::Heartbeat {
                sequence: s,
                acknowledgement: a
            })
            .into()),
            (
                s,
                proptest::option::of(s),
                proptest::option::of(any::<bool>())
            )
                .prop_map(|(id, secret, _)| {
                    Payload::ProxyConnReq(proto::ProxyConnReq {
                        tunnel_id: id.clone(),
                        stream_id: id,
                        secret,
                        source_ip: Some(proto::IpAddress::from(std::net::IpAddr::from([
                            127, 0, 0, 1,
                        ]))),
                        proxy_endpoint: None,
                    })
                    .into()
                }),
            (
                s,
                proptest::option::of(s),
                proptest::option::of(any::<u32>()),
                proptest::collection::vec(s, 0..4)
            )
                .prop_map(|(rid, name, port, geo)| {
                    Payload::OpenTunnelReq(proto::OpenTunnelReq {
                        request_id: rid,
                        tunnel_properties: Some(proto::TunnelProperties {
                            name,
                            port,
                            geoip: geo,
                            publish: Some(false),
                            ..Default::default()
                        }),
                    })
                    .into()
                }),
            (any::<i32>(), proptest::option::of(s)).prop_map(|(code, message)| {
                Payload::StreamRsp(proto::StreamRsp {
                    payload: Some(proto::stream_rsp::Payload::Error(proto::Error {
                        code,
                        message,
                    })),
                })
                .into()
            }),
            Just(Message { payload: None }),
        ]
    }

    proptest! {
        #[test]
        fn roundtrip_in_arbitrary_chunks(msgs in proptest::collection::vec(arb_message(), 1..6), split in 0usize..64) {
            let mut wire = BytesMut::new();
            for m in &msgs { encode_into(m, &mut wire).unwrap(); }
            // Feed the stream in two pieces at an arbitrary split point.
            let split = split.min(wire.len());
            let mut buf = BytesMut::from(&wire[..split]);
            let mut out = Vec::new();
            while let Some(m) = decode(&mut buf).unwrap() { out.push(m); }
            buf.extend_from_slice(&wire[split..]);
            while let Some(m) = decode(&mut buf).unwrap() { out.push(m); }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(out, msgs);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = BytesMut::from(&bytes[..]);
            // Either frames, an incomplete tail, or a typed error; never a panic or an infinite loop.
            for _ in 0..bytes.len() + 1 {
                match decode(&mut buf) {
                    Ok(Some(m)) => {
                        // Whatever decodes re-encodes to an equivalent frame.
                        if let Ok(encoded) = encode(&m) {
                            let mut again = BytesMut::from(&encoded[..]);
                            prop_assert_eq!(decode(&mut again), Ok(Some(m)));
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }

        #[test]
        fn header_bound_is_exact(len in 0u32..200_000) {
            let mut buf = BytesMut::new();
            buf.put_u32(len);
            let r = decode(&mut buf);
            if len as usize > MAX_FRAME_LEN {
                prop_assert_eq!(r, Err(FrameError::TooLarge { len: len as usize }));
            } else if len == 0 {
                prop_assert_eq!(r, Ok(Some(Message { payload: None })));
            } else {
                prop_assert_eq!(r, Ok(None));
            }
        }
    }
}
