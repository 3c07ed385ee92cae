//! A dynamic port mapper driven by commands on standard input:
//!
//! ```text
//! map 9001 127.0.0.1:8080             # listen on 9001, forward to 127.0.0.1:8080
//! map 9001 127.0.0.1:8081             # retarget: new connections go to 8081, open ones stay
//! map 9001 127.0.0.1:8082 close       # retarget and close the open connections
//! map 9002 10.0.0.1:80,10.0.0.2:80    # several targets: round-robin, health checks
//! unmap 9001                          # stop listening, drain, close
//! list
//! quit
//! ```
//!
//! ```text
//! cargo run -p examples --example port_mapper -- --bind-ip 127.0.0.1
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use proxy_core::metrics::NoopObserver;
use proxy_core::relay::Route;
use proxy_core::server::{ExistingConnections, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::upstream::{HealthCheck, TargetAddr, Upstream, UpstreamSet};
use tokio::io::{AsyncBufReadExt, BufReader};

/// Map local ports to upstream targets, controlled from stdin.
#[derive(Debug, Parser)]
struct Args {
    /// Address the mapped ports listen on.
    #[arg(long, default_value = "127.0.0.1")]
    bind_ip: IpAddr,
    /// How long open connections may finish after `unmap` or `quit`, in seconds.
    #[arg(long, default_value_t = 5)]
    drain_secs: u64,
}

/// A mapping's health-check task, stopped when the mapping is retargeted or removed.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Mapper {
    server: ProxyServer,
    bind_ip: IpAddr,
    drain: Duration,
    health_checks: HashMap<u16, AbortOnDrop>,
}

impl Mapper {
    fn upstream(&mut self, port: u16, targets: &str) -> anyhow::Result<Upstream> {
        let targets: Vec<TargetAddr> = targets
            .split(',')
            .map(|t| t.parse())
            .collect::<Result<_, _>>()
            .context("targets")?;
        self.health_checks.remove(&port);
        if targets.len() == 1 {
            return Ok(Upstream::Target(
                targets.into_iter().next().context("one target")?,
            ));
        }
        let set = Arc::new(UpstreamSet::new(targets)?.with_health_check(HealthCheck::default())?);
        let cancel = self.server.cancellation_token().child_token();
        if let Some(task) = set.spawn_health_checks(cancel) {
            self.health_checks.insert(port, AbortOnDrop(task));
        }
        Ok(Upstream::Set(set))
    }

    async fn run(&mut self, line: &str) -> anyhow::Result<bool> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] => {}
            ["map", port, targets, rest @ ..] => {
                let port: u16 = port.parse().context("port")?;
                let existing = match rest {
                    [] => ExistingConnections::Keep,
                    ["close"] => ExistingConnections::Close,
                    _ => bail!("usage: map PORT TARGET[,TARGET...] [close]"),
                };
                let addr = SocketAddr::new(self.bind_ip, port);
                let route = Route::new(format!("port-{port}"), self.upstream(port, targets)?);
                if self.server.listeners().iter().any(|l| l.local_addr == addr) {
                    self.server.set_route(addr, route, existing)?;
                    println!("retargeted {addr} -> {targets}");
                } else {
                    self.server.add_listener(ListenerConfig::new(addr, route))?;
                    println!("mapped {addr} -> {targets}");
                }
            }
            ["unmap", port] => {
                let port: u16 = port.parse().context("port")?;
                self.health_checks.remove(&port);
                let report = self
                    .server
                    .remove_listener(SocketAddr::new(self.bind_ip, port), self.drain)
                    .await?;
                println!(
                    "unmapped {port}: {} finished, {} closed",
                    report.finished, report.forced
                );
            }
            ["list"] => {
                for listener in self.server.listeners() {
                    let connections = self.server.connections(listener.local_addr)?;
                    let (up, down) = connections.iter().fold((0, 0), |(u, d), c| {
                        (u + c.counters.to_upstream(), d + c.counters.to_client())
                    });
                    println!(
                        "{} -> {} ({} open, {up} B up, {down} B down in open connections)",
                        listener.local_addr, listener.upstream, listener.active_connections
                    );
                }
            }
            ["quit"] => return Ok(false),
            _ => bail!("commands: map PORT TARGET[,TARGET...] [close] | unmap PORT | list | quit"),
        }
        Ok(true)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let server = ProxyServer::new(ServerConfig::default(), Arc::new(NoopObserver))?;
    let mut mapper = Mapper {
        server: server.clone(),
        bind_ip: args.bind_ip,
        drain: Duration::from_secs(args.drain_secs),
        health_checks: HashMap::new(),
    };
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        match mapper.run(&line).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(error) => eprintln!("error: {error:#}"),
        }
    }
    let report = server.shutdown(mapper.drain).await;
    println!(
        "stopped: {} finished, {} closed",
        report.finished, report.forced
    );
    Ok(())
}
