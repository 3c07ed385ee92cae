//! `bench rstream`'s measurements: the contenders set up around one engine, their throughput and
//! stream setup over the rounds, and the TLS ceiling of one stream, measured.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rstream_client::engine::LocalEngine;

use super::peers::{
    Contender, CpuClocks, Peer, RuntimeThread, SdkPeer, open_tunnel, thread_cpu_seconds,
};
use super::sink::{CMD_DOWNLOAD, CMD_UPLOAD, start_sink, transfer};
use super::{
    CEILING, DIRECT, DOWNLOAD, ENGINE_BUSY, GENERATOR_BUSY, PEER_BUSY, SDK, SDK_UVLOOP, SETUP_P50,
    SETUP_P99, Sizes, TOKEN, TUNNEL, UPLOAD,
};
use crate::bench::proxy::shuffled;
use crate::bench::report::Recorder;
use crate::bench::system::{self, GENERATOR_CPU, RELAY_CPU};
use crate::bench::{Settings, load};

pub(super) async fn measure(
    settings: &Settings,
    sizes: &Sizes,
    engine_thread: &RuntimeThread,
    client_thread: &RuntimeThread,
    python: Option<&Path>,
) -> anyhow::Result<(Recorder, Option<String>)> {
    let sink = start_sink().await?;
    let target = sink.0;
    let engine = engine_thread
        .handle
        .spawn(LocalEngine::builder().token(TOKEN).start())
        .await??;
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-rstream-")
        .tempdir()?;
    let result = async {
        let tunnel = client_thread
            .handle
            .spawn(open_tunnel(
                engine.engine_address(),
                engine.client_tls(),
                target,
            ))
            .await??;
        let ingress = engine
            .ingress_addr(&tunnel.id)
            .context("the published tunnel has no ingress")?;
        let mut sdks = Vec::new();
        let mut sdk_info = None;
        if let Some(python) = python {
            for (name, uvloop) in [(SDK, false), (SDK_UVLOOP, true)] {
                let sdk = SdkPeer::start(python, &engine, dir.path(), target, uvloop).await?;
                let ingress = engine
                    .ingress_addr(&sdk.id)
                    .context("the SDK's tunnel has no ingress")?;
                let info: &mut String = sdk_info.get_or_insert_with(String::new);
                if !info.is_empty() {
                    info.push_str("; ");
                }
                info.push_str(&format!(
                    "{name}: version {}, event loop {}",
                    sdk.version, sdk.event_loop
                ));
                sdks.push((name, ingress, sdk));
            }
        }
        let mut contenders = vec![
            Contender {
                name: DIRECT,
                addr: target,
                peer: Peer::None,
            },
            Contender {
                name: TUNNEL,
                addr: ingress,
                peer: Peer::Thread(client_thread),
            },
        ];
        for (name, addr, sdk) in &sdks {
            contenders.push(Contender {
                name,
                addr: *addr,
                peer: Peer::Process(sdk.child.id()),
            });
        }
        let clocks = CpuClocks {
            engine: engine_thread,
            generator: rustix::thread::gettid().as_raw_nonzero().get(),
        };
        let recorder = measure_contenders(settings, sizes, &contenders, &clocks).await;
        for (_, _, mut sdk) in sdks {
            sdk.check_running()?;
            sdk.stop();
        }
        client_thread.handle.spawn(tunnel.close()).await?;
        anyhow::Ok((recorder?, sdk_info))
    }
    .await;
    engine_thread.handle.spawn(engine.shutdown()).await?;
    sink.1.abort();
    result
}

async fn measure_contenders(
    settings: &Settings,
    sizes: &Sizes,
    contenders: &[Contender<'_>],
    clocks: &CpuClocks<'_>,
) -> anyhow::Result<Recorder> {
    let mut recorder = Recorder::default();
    let bytes = sizes.bulk_bytes;
    eprintln!(
        "rstream: throughput, {} rounds of {} contenders and the cipher ceiling",
        settings.rounds,
        contenders.len()
    );
    for round in 0..settings.rounds {
        for (direction, metric) in [(CMD_UPLOAD, UPLOAD), (CMD_DOWNLOAD, DOWNLOAD)] {
            // The ceiling takes a turn like a contender (index len).
            for index in shuffled(contenders.len() + 1) {
                let Some(contender) = contenders.get(index) else {
                    let rate = tls_ceiling(sizes.cipher_time, direction == CMD_UPLOAD)?;
                    recorder.record(metric, CEILING, rate);
                    continue;
                };
                let engine_before = clocks.engine.cpu_seconds()?;
                let generator_before = thread_cpu_seconds(clocks.generator)?;
                let peer_before = contender.peer.cpu_seconds()?;
                let elapsed = transfer(contender.addr, direction, bytes)
                    .await
                    .with_context(|| {
                        format!(
                            "{} through {}, round {}",
                            metric.name,
                            contender.name,
                            round + 1
                        )
                    })?;
                let wall = elapsed.as_secs_f64();
                recorder.record(metric, contender.name, bytes as f64 * 8.0 / wall / 1e9);
                let busy = |before: f64, after: f64| (after - before) / wall * 100.0;
                recorder.record(
                    GENERATOR_BUSY,
                    contender.name,
                    busy(generator_before, thread_cpu_seconds(clocks.generator)?),
                );
                if let (Some(before), Some(after)) = (peer_before, contender.peer.cpu_seconds()?) {
                    recorder.record(
                        ENGINE_BUSY,
                        contender.name,
                        busy(engine_before, clocks.engine.cpu_seconds()?),
                    );
                    recorder.record(PEER_BUSY, contender.name, busy(before, after));
                }
            }
        }
    }
    eprintln!("rstream: stream setup");
    for _ in 0..settings.rounds {
        for index in shuffled(contenders.len()) {
            let contender = &contenders[index];
            let histogram = load::setup_latency(contender.addr, sizes.setup_count)
                .await
                .with_context(|| format!("stream setup through {}", contender.name))?;
            let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1_000.0;
            recorder.record(SETUP_P50, contender.name, us(0.5));
            recorder.record(SETUP_P99, contender.name, us(0.99));
        }
    }
    Ok(recorder)
}

/// The TLS ceiling of one stream, measured: one TLS 1.3 connection over loopback TCP with rustls
/// (ring, TLS13_AES_256_GCM_SHA384, the suite the tunnel negotiates) on both ends, the server on
/// the engine's CPU and the client on the peer's, as the tunnel's TLS leg runs. Upload: the
/// server sends (the engine seals what the generator uploads), download: the client sends.
/// Plaintext moves one way in 256 KiB writes for `length`; returns Gbit/s of plaintext
/// received, from the first byte to close_notify.
fn tls_ceiling(length: Duration, upload: bool) -> anyhow::Result<f64> {
    use std::sync::Arc;

    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    let cert = certified.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384],
        ..rustls::crypto::ring::default_provider()
    });
    let server_config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)?,
    );
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert)?;
    let client_config = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    let addr = listener.local_addr()?;

    // Either end: sends for `length`, or reads to close_notify and returns the rate.
    let run_end = move |tls: &mut dyn ReadWrite, send: bool| -> anyhow::Result<f64> {
        if send {
            let buf = vec![0u8; 256 * 1024];
            let started = Instant::now();
            while started.elapsed() < length {
                tls.write_all(&buf)?;
            }
            tls.flush()?;
            Ok(0.0)
        } else {
            let mut buf = vec![0u8; 256 * 1024];
            let mut received = 0u64;
            let mut first = None;
            loop {
                let n = tls.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                first.get_or_insert_with(Instant::now);
                received += n as u64;
            }
            let seconds = first.map_or(0.0, |f: Instant| f.elapsed().as_secs_f64());
            anyhow::ensure!(seconds > 0.0, "no plaintext arrived");
            Ok(received as f64 * 8.0 / seconds / 1e9)
        }
    };
    std::thread::scope(|scope| {
        let server = std::thread::Builder::new()
            .name("bench-tls-server".to_owned())
            .spawn_scoped(scope, || -> anyhow::Result<f64> {
                if system::can_pin() {
                    system::pin_current_thread(GENERATOR_CPU)?;
                }
                let (tcp, _) = listener.accept()?;
                tcp.set_nodelay(true)?;
                let connection = rustls::ServerConnection::new(server_config.clone())?;
                let mut tls = rustls::StreamOwned::new(connection, tcp);
                let rate = run_end(&mut tls, upload)?;
                if upload {
                    close_sending_end(&mut tls)?;
                }
                Ok(rate)
            })?;
        let client = std::thread::Builder::new()
            .name("bench-tls-client".to_owned())
            .spawn_scoped(scope, || -> anyhow::Result<f64> {
                if system::can_pin() {
                    system::pin_current_thread(RELAY_CPU)?;
                }
                let tcp = std::net::TcpStream::connect(addr)?;
                tcp.set_nodelay(true)?;
                let name = rustls::pki_types::ServerName::try_from("localhost")?;
                let connection = rustls::ClientConnection::new(client_config.clone(), name)?;
                let mut tls = rustls::StreamOwned::new(connection, tcp);
                let rate = run_end(&mut tls, !upload)?;
                if !upload {
                    close_sending_end(&mut tls)?;
                }
                Ok(rate)
            })?;
        let joined = |handle: std::thread::ScopedJoinHandle<'_, anyhow::Result<f64>>| {
            handle
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a TLS thread panicked")))
        };
        let (server, client) = (joined(server)?, joined(client)?);
        Ok(if upload { client } else { server })
    })
}

/// Ends the sending side of the ceiling's stream: close_notify, then FIN, then whatever the peer
/// still sent (session tickets the sender never read) is drained until the peer closes. Closing
/// a socket with unread bytes resets the connection, and the reset would reach the receiver
/// before the last records.
fn close_sending_end<C, S>(
    tls: &mut rustls::StreamOwned<C, std::net::TcpStream>,
) -> anyhow::Result<()>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<S>>,
    S: rustls::SideData,
{
    use std::io::Write as _;
    tls.conn.send_close_notify();
    tls.flush()?;
    tls.sock.shutdown(std::net::Shutdown::Write)?;
    std::io::copy(&mut tls.sock, &mut std::io::sink())?;
    Ok(())
}

/// Both ends of the ceiling's TLS stream.
trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}
