//! Where the workspace is, and cargo as a shell would run it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (this crate lives two levels below it, in `xtask/testenv`).
pub fn root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .unwrap_or(manifest)
        .to_path_buf()
}

/// The `members` of the workspace manifest at `root`, in its order.
pub fn members(root: &Path) -> std::io::Result<Vec<String>> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .ok_or_else(|| std::io::Error::other("no `members = [...]` in the workspace Cargo.toml"))?;
    Ok(members
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect())
}

/// Cargo's target directory: `CARGO_TARGET_DIR`, else `<root>/target`.
pub fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

/// A `cargo` command for the workspace, as a shell would run it: without what `cargo run` set for
/// the running process (see [`without_run_env`]).
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.current_dir(root());
    without_run_env(&mut cmd);
    cmd
}

/// Drops what `cargo run` sets for the running process (CARGO_PKG_*, CARGO_MANIFEST_DIR, ...) from a
/// nested cargo: ring's build script reruns when those differ, so a build from here would
/// otherwise rebuild ring and everything above it, and the next build from a shell would rebuild
/// them back.
pub fn without_run_env(cmd: &mut Command) {
    const SET_BY_RUN: [&str; 8] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_LINKS",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ];
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_") || SET_BY_RUN.contains(&name.as_ref()) {
            cmd.env_remove(name.as_ref());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(super::root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"), "{manifest}");
    }

    #[test]
    fn the_members_are_read_from_the_manifest() {
        let members = super::members(&super::root()).unwrap();
        for member in ["proxy-core", "k8s-reconcile", "xtask/testenv"] {
            assert!(members.iter().any(|m| m == member), "{members:?}");
        }
    }
}
