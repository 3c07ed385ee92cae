//! `bench rstream`'s sink and its length-prefixed protocol (upload, download, ping), and the
//! generator's transfers through a contender to it, checked end to end.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);
const BULK_CHUNK: usize = 256 * 1024;

/// Sink commands (a byte, then a big-endian u64 length for the transfers).
pub(super) const CMD_UPLOAD: u8 = b'U';
pub(super) const CMD_DOWNLOAD: u8 = b'D';
/// The byte `load::setup_latency` sends and expects back.
const CMD_PING: u8 = b'P';

/// The sink: length-prefixed upload and download, and ping. Returns its address and task.
pub(super) async fn start_sink() -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                // A failed connection only matters to the client, which reports it.
                let _ = serve(stream).await;
            });
        }
    });
    Ok((addr, task))
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    match stream.read_u8().await? {
        CMD_UPLOAD => {
            let length = stream.read_u64().await?;
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut received = 0u64;
            while received < length {
                match stream.read(&mut buf).await? {
                    0 => break,
                    n => received += n as u64,
                }
            }
            stream.write_u64(received).await?;
            // Wait for the client to close.
            let _ = stream.read(&mut buf).await;
            Ok(())
        }
        CMD_DOWNLOAD => {
            let length = stream.read_u64().await?;
            send_zeros(&mut stream, length).await?;
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
            Ok(())
        }
        CMD_PING => stream.write_u8(CMD_PING).await,
        _ => Ok(()),
    }
}

async fn send_zeros(stream: &mut TcpStream, mut length: u64) -> std::io::Result<()> {
    let buf = vec![0u8; BULK_CHUNK];
    while length > 0 {
        let n = length.min(BULK_CHUNK as u64) as usize;
        stream.write_all(&buf[..n]).await?;
        length -= n as u64;
    }
    Ok(())
}

/// Moves `length` bytes over one connection to `target`, checked end to end.
pub(super) async fn transfer(
    target: SocketAddr,
    command: u8,
    length: u64,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let run = async {
        let mut stream = TcpStream::connect(target).await?;
        stream.set_nodelay(true)?;
        stream.write_u8(command).await?;
        stream.write_u64(length).await?;
        if command == CMD_UPLOAD {
            send_zeros(&mut stream, length).await?;
            let received = stream.read_u64().await.context("reading the count")?;
            ensure!(received == length, "sink received {received} of {length}");
        } else {
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut received = 0u64;
            while received < length {
                match stream.read(&mut buf).await? {
                    0 => bail!("received {received} of {length} bytes"),
                    n => received += n as u64,
                }
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(TRANSFER_TIMEOUT, run)
        .await
        .context("transfer timed out")??;
    Ok(started.elapsed())
}
