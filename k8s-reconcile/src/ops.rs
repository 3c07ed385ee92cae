//! Operations endpoints every binary serves: `/healthz`, `/readyz`, `/metrics`; and shutdown on
//! SIGTERM.
//!
//! [`Health`] is a set of named readiness checks (e.g. `informers-synced`, `leadership`,
//! `upstream`); `/readyz` answers 200 only while all pass and lists each with its detail, so an
//! operator sees *why* a pod is not ready. `/healthz` answers 200 while the process serves at all.
//! [`Health`] and [`shutdown_on_signals`] need nothing beyond tokio; the server that answers
//! these paths is a binary's (this repository's is `netkit_runtime::ops_server`).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use tokio_util::sync::CancellationToken;

use crate::Error;

/// One readiness check's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Whether it passes.
    pub ok: bool,
    /// Why (shown by `/readyz`).
    pub detail: String,
}

/// Named readiness checks, shared between the parts of a binary.
///
/// [`Health::scoped`] gives a part its own names (`tunnels/leadership`) in the same set, so
/// `/readyz` sees every part's checks at once.
#[derive(Debug, Clone, Default)]
pub struct Health {
    checks: Arc<RwLock<BTreeMap<String, Check>>>,
    /// Prefix of this view's names, `""` or ending in `/`.
    scope: Arc<str>,
}

impl Health {
    /// An empty set (ready until a check is added).
    pub fn new() -> Self {
        Self::default()
    }

    /// A view of the same set whose checks are named `<prefix>/<name>`; its [`Health::ready`],
    /// [`Health::checks`] and [`Health::check`] see only those (under their short names).
    #[must_use]
    pub fn scoped(&self, prefix: &str) -> Self {
        Self {
            checks: Arc::clone(&self.checks),
            scope: format!("{}{prefix}/", self.scope).into(),
        }
    }

    /// Sets the state of check `name`.
    pub fn set(&self, name: &str, ok: bool, detail: impl Into<String>) {
        if let Ok(mut checks) = self.checks.write() {
            checks.insert(
                format!("{}{name}", self.scope),
                Check {
                    ok,
                    detail: detail.into(),
                },
            );
        }
    }

    /// Whether every check (of this view) passes.
    pub fn ready(&self) -> bool {
        self.checks
            .read()
            .map(|c| {
                c.iter()
                    .filter(|(name, _)| name.starts_with(&*self.scope))
                    .all(|(_, check)| check.ok)
            })
            .unwrap_or(false)
    }

    /// A copy of every check (of this view).
    pub fn checks(&self) -> BTreeMap<String, Check> {
        let Ok(checks) = self.checks.read() else {
            return BTreeMap::new();
        };
        checks
            .iter()
            .filter_map(|(name, check)| {
                let short = name.strip_prefix(&*self.scope)?;
                Some((short.to_owned(), check.clone()))
            })
            .collect()
    }

    /// The state of one check.
    pub fn check(&self, name: &str) -> Option<Check> {
        let key = format!("{}{name}", self.scope);
        self.checks.read().ok()?.get(&key).cloned()
    }
}

/// A token cancelled on the first SIGTERM or SIGINT.
pub fn shutdown_on_signals() -> Result<CancellationToken, Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate()).map_err(Error::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(Error::Signal)?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        cancel.cancel();
    });
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_check_passes() {
        let health = Health::new();
        assert!(health.ready());
        health.set("informers-synced", false, "waiting");
        health.set("leadership", true, "leader");
        assert!(!health.ready());
        health.set("informers-synced", true, "synced");
        assert!(health.ready());
        assert_eq!(
            health.check("leadership").map(|c| c.detail),
            Some("leader".to_owned())
        );
    }

    #[test]
    fn a_scoped_view_names_its_checks_and_the_whole_set_sees_them() {
        let health = Health::new();
        let tunnels = health.scoped("tunnels");
        tunnels.set("leadership", false, "follower");
        health.set("upstream", true, "dialable");
        assert!(!tunnels.ready());
        assert!(!health.ready());
        assert_eq!(
            health.check("tunnels/leadership").map(|c| c.detail),
            Some("follower".to_owned())
        );
        assert_eq!(
            tunnels.checks().keys().collect::<Vec<_>>(),
            ["leadership"],
            "a view sees only its own checks"
        );
        let other = health.scoped("connections");
        assert!(other.ready(), "an empty view is ready");
        tunnels.set("leadership", true, "leader");
        assert!(health.ready());
    }
}
