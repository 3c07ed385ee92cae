//! `netkit-pause`: the pod sandbox program, PID 1 of every pod's sandbox container.
//!
//! It holds the pod's namespaces open and does nothing else: it waits for SIGTERM or SIGINT and
//! exits 0, and it reaps any child re-parented to it (as PID 1 of the pod's PID namespace), so
//! zombies never pile up.

use std::process::ExitCode;

use rustix::io::Errno;
use rustix::process::{WaitOptions, wait};
use tokio::signal::unix::{SignalKind, signal};

fn main() -> ExitCode {
    if std::env::args()
        .skip(1)
        .any(|a| a == "--version" || a == "-v")
    {
        println!("netkit-pause {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    // The signal driver lives in the I/O driver; one thread is all a waiting process needs.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("netkit-pause: starting the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("netkit-pause: installing signal handlers: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> std::io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut child = signal(SignalKind::child())?;
    // Children that exited before the handler was installed sent their SIGCHLD to nobody.
    reap();
    loop {
        tokio::select! {
            _ = terminate.recv() => return Ok(()),
            _ = interrupt.recv() => return Ok(()),
            _ = child.recv() => reap(),
        }
    }
}

/// Collects every exited child without blocking. Signals coalesce, so one SIGCHLD may stand for
/// several exits: loop until there is nothing left to collect.
fn reap() {
    loop {
        match wait(WaitOptions::NOHANG) {
            Ok(Some(_)) => {}
            Err(Errno::INTR) => {}
            // None: children remain but none has exited; ECHILD: no children at all.
            Ok(None) | Err(_) => return,
        }
    }
}
