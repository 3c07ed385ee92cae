//! Exposes a local TCP port as a published rstream TCP tunnel, reconnecting as needed.
//!
//! ```text
//! cargo run -p examples --example rstream_expose -- \
//!     --engine HOST:PORT --token "$RSTREAM_AUTHENTICATION_TOKEN" --target 127.0.0.1:8080 [--insecure | --ca-file ca.pem]
//! ```

use std::path::PathBuf;

use clap::Parser;
use rstream_client::supervisor::{Supervisor, SupervisorConfig, SupervisorState};
use rstream_client::tls::TlsOptions;
use rstream_client::tunnel::TunnelOptions;
use rstream_client::{Client, forward};

/// Expose a local port through an rstream engine.
#[derive(Parser, Debug)]
struct Args {
    /// Engine address (host:port).
    #[arg(long, env = "RSTREAM_ENGINE")]
    engine: String,
    /// Authentication token.
    #[arg(long, env = "RSTREAM_AUTHENTICATION_TOKEN")]
    token: String,
    /// Local TCP target.
    #[arg(long, default_value = "127.0.0.1:8080")]
    target: String,
    /// Optional tunnel name.
    #[arg(long)]
    name: Option<String>,
    /// Trust this PEM CA bundle instead of the system roots.
    #[arg(long, conflicts_with = "insecure")]
    ca_file: Option<PathBuf>,
    /// Skip certificate verification (local engines only).
    #[arg(long)]
    insecure: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut tls = TlsOptions::new().insecure_skip_verify(args.insecure);
    if let Some(ca) = &args.ca_file {
        tls = tls.ca_file(ca)?;
    }
    let client = Client::builder()
        .engine(&args.engine)
        .token(&args.token)
        .tls(tls)
        .build()?;
    let mut options = TunnelOptions::tcp();
    if let Some(name) = &args.name {
        options = options.name(name);
    }
    let mut supervisor = Supervisor::spawn(client, options, SupervisorConfig::default());
    let mut states = supervisor.watch();
    tokio::spawn(async move {
        while states.changed().await.is_ok() {
            match &*states.borrow() {
                SupervisorState::Connecting { attempt } => {
                    eprintln!("connecting (attempt {attempt})")
                }
                SupervisorState::Online {
                    forwarding_address, ..
                } => {
                    eprintln!("online: {forwarding_address} -> forwarding to the local target")
                }
                SupervisorState::Disconnected { error, retry_in } => {
                    eprintln!("disconnected: {error}; retrying in {retry_in:?}")
                }
                SupervisorState::Stopped { error } => eprintln!("stopped: {error:?}"),
                _ => {}
            }
        }
    });
    tokio::select! {
        r = forward::forward(&mut supervisor, &args.target) => r?,
        _ = tokio::signal::ctrl_c() => eprintln!("shutting down"),
    }
    supervisor.shutdown().await;
    Ok(())
}
