//! Runs rstream-client's `LocalEngine` as a process of its own: a test can SIGKILL it under live
//! streams and start it again on the same address with the same certificate, and change the
//! tokens it accepts while it runs.
//!
//! ```text
//! cargo run -p examples --example local_engine -- \
//!     --listen 127.0.0.1:7443 --identity engine.json [--name 10.0.0.1] [--token T]... [--ca-out ca.pem]
//! ```
//!
//! `--identity` is read if the file exists, otherwise generated (with the `--name`s in the server
//! certificate) and written, so a restart serves the same certificate. Without `--token` any
//! token is accepted. Published tunnels get their ingress on `127.0.0.1`.
//!
//! Commands on stdin, one a line: `tokens A B ...` (accept only these from now on, closing the
//! control channels of any other token), `any-token`, `quit`. Events on stdout, one a line,
//! fields separated by spaces (`-` for none):
//!
//! ```text
//! listening 127.0.0.1:7443
//! login cli_3 accepted <token>        (or: login - refused <token>)
//! closed cli_3
//! tunnel tun_4 127.0.0.1:40001        (a published tunnel and its ingress)
//! tunnel-closed tun_4
//! auth <token>...                     (after a tokens command: the policy now in force)
//! ```

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use rstream_client::engine::{EngineAuth, EngineIdentity, LocalEngine};
use tokio::io::AsyncBufReadExt as _;

/// Run a LocalEngine until stdin closes, `quit` or Ctrl-C.
#[derive(Parser, Debug)]
struct Args {
    /// Address to listen on (port 0: any free port; the `listening` line says which).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Identity file (JSON, private keys inside): read if it exists, else generated and written.
    #[arg(long)]
    identity: Option<PathBuf>,
    /// More names (DNS names or IP addresses) for a generated server certificate.
    #[arg(long = "name")]
    names: Vec<String>,
    /// An accepted token (repeatable); none: any token.
    #[arg(long = "token")]
    tokens: Vec<String>,
    /// Write the CA certificate (PEM) clients must trust to this file.
    #[arg(long)]
    ca_out: Option<PathBuf>,
}

fn identity(args: &Args) -> anyhow::Result<EngineIdentity> {
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    let Some(path) = &args.identity else {
        return Ok(EngineIdentity::generate_for(&names)?);
    };
    if path.exists() {
        let json =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        return Ok(EngineIdentity::from_json(&json)?);
    }
    let identity = EngineIdentity::generate_for(&names)?;
    std::fs::write(path, identity.to_json())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(identity)
}

fn auth(tokens: &[String]) -> EngineAuth {
    if tokens.is_empty() {
        EngineAuth::AnyToken
    } else {
        EngineAuth::Tokens(tokens.to_vec())
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let identity = identity(&args)?;
    if let Some(path) = &args.ca_out {
        std::fs::write(path, identity.ca_pem())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let engine = LocalEngine::builder()
        .bind(args.listen)
        .identity(identity)
        .auth(auth(&args.tokens))
        .start()
        .await?;
    say(&format!("listening {}", engine.addr()));

    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut reported = 0usize;
    let mut open = Vec::new();
    let mut tunnels = BTreeMap::new();
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            line = stdin.next_line() => match line? {
                None => break,
                Some(line) => {
                    let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
                    match words.first().map(String::as_str) {
                        Some("tokens") => {
                            engine.set_auth(auth(&words[1..]));
                            say(&format!("auth {}", words[1..].join(" ")));
                        }
                        Some("any-token") => {
                            engine.set_auth(EngineAuth::AnyToken);
                            say("auth");
                        }
                        Some("quit") => break,
                        _ => eprintln!("unknown command {line:?}: tokens A B ..., any-token, quit"),
                    }
                }
            },
            _ = tick.tick() => {}
        }
        // Report what changed: new logins, closed channels, tunnels opened and closed.
        let logins = engine.control_logins();
        for login in &logins[reported..] {
            let id = login.client_id.clone().unwrap_or_else(|| "-".to_owned());
            let token = login.token.clone().unwrap_or_else(|| "-".to_owned());
            let outcome = if login.accepted {
                "accepted"
            } else {
                "refused"
            };
            say(&format!("login {id} {outcome} {token}"));
            open.push(login.accepted);
        }
        reported = logins.len();
        for (i, login) in logins.iter().enumerate() {
            if open[i] && !login.open {
                open[i] = false;
                say(&format!(
                    "closed {}",
                    login.client_id.as_deref().unwrap_or("-")
                ));
            }
        }
        let now: BTreeMap<String, SocketAddr> = engine
            .tunnels()
            .into_iter()
            .filter_map(|t| {
                let id = t.id?;
                let ingress = engine.ingress_addr(&id)?;
                Some((id, ingress))
            })
            .collect();
        for (id, ingress) in &now {
            if tunnels.get(id) != Some(ingress) {
                say(&format!("tunnel {id} {ingress}"));
            }
        }
        for id in tunnels.keys() {
            if !now.contains_key(id) {
                say(&format!("tunnel-closed {id}"));
            }
        }
        tunnels = now;
    }
    engine.shutdown().await;
    Ok(())
}
