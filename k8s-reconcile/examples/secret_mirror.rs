//! A whole controller: next to every Secret it keeps a ConfigMap `<secret>-keys` that lists the
//! Secret's keys (never its values), owned by the Secret so Kubernetes deletes it with it.
//!
//! It talks to whatever cluster `kube::Client::try_default()` finds (`KUBECONFIG`, then
//! `~/.kube/config`, then the in-cluster ServiceAccount) and stops on SIGTERM or Ctrl-C:
//!
//! ```sh
//! cargo run -p k8s-reconcile --example secret_mirror
//! ```

use std::sync::Arc;

use k8s_reconcile::k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_reconcile::kube::{self, Api, ResourceExt as _};
use k8s_reconcile::{Action, Context, ControllerBuilder, Reconciler};

/// The controller's own logic; the framework does the watching, queueing and retrying.
struct Mirror;

impl Reconciler for Mirror {
    type Resource = Secret;
    type Error = k8s_reconcile::Error;

    async fn reconcile(&self, secret: Arc<Secret>, ctx: &Context) -> Result<Action, Self::Error> {
        let mut keys = ConfigMap::default();
        keys.metadata.name = Some(format!("{}-keys", secret.name_any()));
        keys.metadata.namespace = secret.namespace();
        keys.metadata.owner_references =
            k8s_reconcile::apply::controller_owner_ref(secret.as_ref()).map(|owner| vec![owner]);
        let names = secret
            .data
            .iter()
            .flatten()
            .map(|(key, _)| (key.clone(), String::new()));
        keys.data = Some(names.collect());
        // Server-side apply; an unchanged ConfigMap costs no write.
        ctx.applier().apply(&keys).await?;
        Ok(Action::Done)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = kube::Client::try_default().await?;
    let shutdown = k8s_reconcile::ops::shutdown_on_signals()?;
    ControllerBuilder::new(client.clone(), "secret-mirror", Mirror)
        .owns(Api::<ConfigMap>::all(client), Default::default())
        .run(shutdown)
        .await?;
    Ok(())
}
