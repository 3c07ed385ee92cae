//! Debian packages the tests and benchmarks use, installed with apt-get when missing.

use std::process::Command;

use anyhow::bail;

/// Installs the Debian packages of `purpose` that are missing, as `.ci/run` did before; where
/// that is impossible (not root, not Debian), one line names them and nothing runs.
pub fn install_packages(packages: &[&str], purpose: &str) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|pkg| {
            !Command::new("dpkg")
                .args(["-s", pkg])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let list = missing.join(" ");
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    });
    if !root || Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "{purpose} needs the Debian packages {list}: install them as root (apt-get install {list})"
        );
    }
    eprintln!("installing {list} ({purpose})...");
    let update = Command::new("apt-get").args(["update", "-q"]).status()?;
    let install = Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q"])
        .args(&missing)
        .status()?;
    if !update.success() || !install.success() {
        bail!("apt-get install {list} failed");
    }
    Ok(())
}
