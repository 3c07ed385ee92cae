//! Who runs where: the node of a Pod, the Pod holding a Lease or a tunnel, and moving that role
//! onto a chosen node by deleting its holder (a graceful stop: another replica takes over, and
//! the replacement comes back on the holder's old node, one replica per node; for a Lease, only
//! once the role moved, its node cordoned meanwhile).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

use crate::e2e::Env;
use crate::node::check;

/// How long a role may take to move, and the replacement to be Ready.
const MOVE_LIMIT: Duration = Duration::from_secs(180);
/// Deletions tried before giving up (each hands the role to another replica).
const ATTEMPTS: usize = 3;

/// The node Pod `name` in `ns` runs on.
pub(super) async fn node_of(client: &kube::Client, ns: &str, name: &str) -> anyhow::Result<String> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get(name)
        .await?
        .spec
        .and_then(|s| s.node_name)
        .with_context(|| format!("Pod {ns}/{name} is not scheduled"))
}

/// The Pod of `selector` in `ns` whose name the holder identity of Lease `lease` starts with
/// (an identity is the Pod name, possibly with a suffix), or `None` while nobody holds it.
pub(super) async fn lease_holder(
    client: &kube::Client,
    ns: &str,
    lease: &str,
    selector: &str,
) -> anyhow::Result<Option<String>> {
    let holder = Api::<Lease>::namespaced(client.clone(), ns)
        .get_opt(lease)
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty());
    let Some(holder) = holder else {
        return Ok(None);
    };
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await?;
    Ok(pods
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .find(|name| holder.starts_with(name.as_str())))
}

/// Deletes the holder of Lease `lease` until the holder is a Pod on `node`, waiting after each
/// deletion for another holder and `replicas` Ready Pods of `selector`; returns the holder.
pub(super) async fn lease_holder_on(
    env: &Env<'_>,
    ns: &str,
    (lease, selector, replicas): (&str, &str, usize),
    node: &str,
) -> anyhow::Result<String> {
    let client = &env.plane.client().await?;
    for _ in 0..ATTEMPTS {
        let holder = wait_for(MOVE_LIMIT, move || async move {
            lease_holder(client, ns, lease, selector).await
        })
        .await
        .with_context(|| format!("a holder of Lease {ns}/{lease}"))?;
        let holder_node = node_of(client, ns, &holder).await?;
        if holder_node == node {
            return Ok(holder);
        }
        // The holder's replacement must not race the replica on `node` for the Lease: it stays
        // Pending while its node is cordoned (one replica per node).
        set_unschedulable(client, &holder_node, true).await?;
        let old = holder.as_str();
        let moved = async {
            delete_and_wait_gone(client, ns, old).await?;
            wait_for(MOVE_LIMIT, move || async move {
                let now = lease_holder(client, ns, lease, selector).await?;
                Ok(now.filter(|now| now != old))
            })
            .await
            .with_context(|| format!("Lease {ns}/{lease} to move from {old}"))
        }
        .await;
        set_unschedulable(client, &holder_node, false).await?;
        moved?;
        check::wait_pods_ready(env.plane, ns, selector, replicas).await?;
    }
    bail!("Lease {ns}/{lease} not held on {node} after {ATTEMPTS} deletions of its holder")
}

/// Deletes the agent of `tunnel` that holds it until the holder runs on `node`, waiting after
/// each deletion for two agents with one holder again; returns the holder and the other agent
/// (the standby), which must run on another node.
pub(super) async fn agent_holder_on(
    env: &Env<'_>,
    ns: &str,
    tunnel: &str,
    node: &str,
) -> anyhow::Result<(String, String)> {
    let client = &env.plane.client().await?;
    let mut deleted: Option<String> = None;
    for _ in 0..ATTEMPTS {
        let skip = deleted.as_deref();
        let (holder, standby) = wait_for(MOVE_LIMIT, move || async move {
            let agents = crate::e2e::rollout::active_agents(client, ns, tunnel).await?;
            let (holders, others): (Vec<_>, Vec<_>) =
                agents.into_iter().partition(|(_, active)| *active == 1);
            Ok(match (&holders[..], &others[..]) {
                ([(holder, _)], [(standby, _)]) if skip != Some(holder.as_str()) => {
                    Some((holder.clone(), standby.clone()))
                }
                _ => None,
            })
        })
        .await
        .with_context(|| format!("two agents of {ns}/{tunnel}, one holding it"))?;
        if node_of(client, ns, &holder).await? == node {
            let standby_node = node_of(client, ns, &standby).await?;
            if standby_node == node {
                bail!("both agents of {ns}/{tunnel} run on {node}");
            }
            return Ok((holder, standby));
        }
        delete_and_wait_gone(client, ns, &holder).await?;
        deleted = Some(holder);
    }
    bail!("the agent holding {ns}/{tunnel} not on {node} after {ATTEMPTS} deletions")
}

/// Cordons (`true`) or uncordons Node `name`.
async fn set_unschedulable(client: &kube::Client, name: &str, on: bool) -> anyhow::Result<()> {
    Api::<Node>::all(client.clone())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "unschedulable": on } })),
        )
        .await
        .with_context(|| format!("Node {name} unschedulable={on}"))?;
    Ok(())
}

/// Deletes Pod `ns/name` and waits until the API server no longer has it: a terminating Pod
/// still reads Ready, and its replacement (on the same node) is not there yet.
async fn delete_and_wait_gone(client: &kube::Client, ns: &str, name: &str) -> anyhow::Result<()> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.delete(name, &DeleteParams::default()).await?;
    wait_for(MOVE_LIMIT, || async {
        Ok(pods.get_opt(name).await?.is_none().then_some(()))
    })
    .await
    .with_context(|| format!("Pod {ns}/{name} to be gone after its deletion"))
}

/// Polls `probe` every 250 ms until it yields a value, for at most `limit`.
pub(super) async fn wait_for<T, F, Fut>(limit: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if started.elapsed() > limit {
            bail!("not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
