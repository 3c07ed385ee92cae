//! `cargo xtask audit`: every crate of `Cargo.lock` against the RustSec advisory database.
//!
//! cargo-audit (pinned, installed with `cargo install` into the cache) runs offline against a
//! local copy of the database: `--db DIR`, or `NETKIT_ADVISORY_DB`, or `../shared/advisory-db`
//! next to the checkout. Any advisory fails the run, unmaintained and yanked crates included
//! (`--deny warnings`).
//!
//! Not a step of `cargo xtask test`: the database is a git repository (rustsec/advisory-db) and
//! this workplace reaches package registries only, none of which ships it, so a fresh CI machine
//! cannot get a snapshot; and a snapshot is not ours to commit. When one is placed in
//! `../shared/advisory-db`, this task runs without arguments.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The cargo-audit release used (`cargo install --locked`).
const CARGO_AUDIT_VERSION: &str = "0.22.2";

#[derive(clap::Args)]
pub struct Args {
    /// A local clone of the RustSec advisory database (default: NETKIT_ADVISORY_DB, then
    /// ../shared/advisory-db).
    #[arg(long, env = "NETKIT_ADVISORY_DB")]
    db: Option<PathBuf>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let db = match &args.db {
        Some(db) => db.clone(),
        None => root.join("../shared/advisory-db"),
    };
    if !db.join("crates").is_dir() {
        bail!(
            "no advisory database at {}: pass --db (or NETKIT_ADVISORY_DB) with a clone of \
             the RustSec advisory-db repository; no package registry ships one, so this cannot \
             fetch it",
            db.display()
        );
    }
    let audit = ensure_cargo_audit()?;
    eprintln!("==> cargo audit of Cargo.lock against {}", db.display());
    let status = Command::new(&audit)
        .current_dir(&root)
        .args([
            "audit",
            "--no-fetch",
            "--stale",
            "--deny",
            "warnings",
            "--db",
        ])
        .arg(&db)
        .arg("--file")
        .arg(root.join("Cargo.lock"))
        .status()
        .with_context(|| format!("running {}", audit.display()))?;
    if !status.success() {
        bail!("cargo audit found advisories (see above)");
    }
    Ok(())
}

/// The pinned cargo-audit, built once into the cache.
fn ensure_cargo_audit() -> anyhow::Result<PathBuf> {
    let dir = netkit_testenv::fixtures::cache_dir(&format!("cargo-audit-{CARGO_AUDIT_VERSION}"));
    let binary = dir.join("bin/cargo-audit");
    if binary.is_file() {
        return Ok(binary);
    }
    eprintln!("installing cargo-audit {CARGO_AUDIT_VERSION} with cargo (a few minutes, once)...");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "install",
            "--locked",
            "cargo-audit",
            "--version",
            CARGO_AUDIT_VERSION,
        ])
        .arg("--root")
        .arg(&dir)
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .context("running cargo install")?;
    if !status.success() || !Path::new(&binary).is_file() {
        bail!("cargo install cargo-audit {CARGO_AUDIT_VERSION} failed");
    }
    Ok(binary)
}
