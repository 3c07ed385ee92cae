//! Images built here for the node (`cargo xtask image` writes them; the node imports them).

use std::path::PathBuf;

/// What was written for one image.
#[derive(Debug, Clone)]
pub struct Built {
    /// The image's short name (`steward-tcp-proxy`).
    pub name: String,
    /// Its full reference, as Pods name it.
    pub reference: String,
    /// The digest of its OCI manifest.
    pub manifest_digest: String,
    /// Its OCI layout directory.
    pub layout: PathBuf,
    /// Its `docker load` tarball, which the node's containerd imports.
    pub tarball: PathBuf,
}
