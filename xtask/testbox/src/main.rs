//! `netkit-testbox`: the test workload of the test node's pods.
//!
//! Logs go to stderr; stdout carries only results, one per line, for a test to parse:
//!
//! * `serve`: `listening http=ADDR tcp-echo=ADDR udp-echo=ADDR` once every socket is bound.
//! * `get URL`: the response body.
//! * `resolve NAME`: one IP address per line.
//! * `tcp-check HOST:PORT`: `tcp-check target=.. bytes=N duration_ms=F result=ok|mismatch`.
//! * `udp-check HOST:PORT`: `udp-check target=.. datagrams=N duration_ms=F result=ok`.
//! * `kube`: `namespace NAME` per namespace, `event TYPE NAME` per watch event, then
//!   `kube result=ok namespaces=N events=M`.
//!
//! Every command exits 0 on success and 1 on any failure.

mod check;
mod cluster;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "netkit-testbox",
    version,
    about = "Test workload for the kube-netkit test node"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve HTTP (GET / describes the pod, GET /healthz), a TCP echo and a UDP echo until
    /// SIGTERM or SIGINT.
    Serve(serve::Args),
    /// HTTP/1.1 GET of an http:// URL; prints the body.
    Get(check::GetArgs),
    /// Resolve a name with the system resolver; prints each address.
    Resolve(check::ResolveArgs),
    /// Send pseudo-random bytes to a TCP echo server and check they come back unchanged.
    TcpCheck(check::TcpCheckArgs),
    /// Send datagrams to a UDP echo server and check each comes back unchanged.
    UdpCheck(check::UdpCheckArgs),
    /// List namespaces through the Kubernetes API (in-cluster config in a pod), optionally
    /// holding a watch.
    Kube(cluster::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // One thread: a test workload needs no parallelism, and stays small in memory.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("netkit-testbox: starting the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(args).await,
            Command::Get(args) => check::get(args).await,
            Command::Resolve(args) => check::resolve(args).await,
            Command::TcpCheck(args) => check::tcp_check(args).await,
            Command::UdpCheck(args) => check::udp_check(args).await,
            Command::Kube(args) => cluster::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("netkit-testbox: {error:#}");
            ExitCode::FAILURE
        }
    }
}
