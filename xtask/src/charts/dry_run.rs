//! `cargo xtask charts`' server-side dry run: every rendered object applied to a fresh control
//! plane, the Pods of Deployments judged by Pod Security, and the Pods it must refuse refused.

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};
use netkit_testenv::ControlPlane;

use super::cases::RESTRICTED;

/// A chart rendered with values Pod Security must refuse: (what, namespace, YAML, message).
pub(super) type Refused<'a> = (String, &'a str, String, &'a str);

pub(super) async fn dry_run_all(
    rendered: &[(String, &str, String)],
    refused: &[Refused<'_>],
) -> anyhow::Result<()> {
    let plane = ControlPlane::builder().start().await?;
    let client = plane.client().await?;
    // CRDs are installed for real, so the custom resources of the charts and samples validate.
    let mut crds: Vec<CustomResourceDefinition> = rstream_operator::crds();
    crds.push(serde_yaml_ng::from_str(&pod_proxier::crd::crd_yaml()?)?);
    plane.install_crds(&crds).await?;
    let discovery = Discovery::new(client.clone()).run().await?;
    let params = PatchParams::apply("xtask-charts").force().dry_run();
    for ns in RESTRICTED {
        ensure_namespace(&client, ns).await?;
        let api: Api<Namespace> = Api::all(client.clone());
        let label = serde_json::json!({ "metadata": { "labels": {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        }}});
        api.patch(ns, &PatchParams::default(), &Patch::Merge(&label))
            .await?;
    }
    let mut pods_checked = 0;
    let mut total = 0;
    for (what, default_namespace, yaml) in rendered {
        let mut count = 0;
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            if value.is_null() {
                continue;
            }
            let object: DynamicObject = serde_json::from_value(value)
                .with_context(|| format!("{what}: an object that is not a Kubernetes object"))?;
            let types = object
                .types
                .clone()
                .context("object without apiVersion/kind")?;
            let gvk = GroupVersionKind::try_from(&types)?;
            let (resource, caps) = discovery
                .resolve_gvk(&gvk)
                .with_context(|| format!("{what}: the API server does not serve {gvk:?}"))?;
            let name = object
                .metadata
                .name
                .clone()
                .context("object without a name")?;
            let api: Api<DynamicObject> = match caps.scope {
                Scope::Cluster => Api::all_with(client.clone(), &resource),
                Scope::Namespaced => {
                    let ns = object
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| (*default_namespace).to_owned());
                    ensure_namespace(&client, &ns).await?;
                    Api::namespaced_with(client.clone(), &ns, &resource)
                }
            };
            api.patch(&name, &params, &Patch::Apply(&object))
                .await
                .with_context(|| format!("{what}: the API server refused {} {name}", types.kind))?;
            count += 1;
            let ns = object
                .metadata
                .namespace
                .as_deref()
                .unwrap_or(default_namespace);
            if types.kind == "Deployment" && RESTRICTED.contains(&ns) {
                pod_of_template(&client, ns, &object)
                    .await
                    .with_context(|| {
                        format!(
                            "{what}: Pod Security restricted refused the Pod of Deployment {name}"
                        )
                    })?;
                pods_checked += 1;
            }
        }
        println!("ok   {what}: {count} objects accepted (server-side dry run)");
        total += count;
    }
    for (what, ns, yaml, message) in refused {
        let mut seen = false;
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            if value["kind"] != "Deployment" {
                continue;
            }
            let object: DynamicObject = serde_json::from_value(value)?;
            match pod_of_template(&client, ns, &object).await {
                Ok(()) => bail!("{what}: Pod Security restricted in {ns} accepted its Pod"),
                Err(err) if format!("{err:#}").contains(message) => {
                    println!("ok   {what}: Pod Security restricted refuses its Pod ({message})");
                    seen = true;
                }
                Err(err) => bail!("{what}: refused without naming {message:?}: {err:#}"),
            }
        }
        if !seen {
            bail!("{what}: no Deployment rendered");
        }
    }
    println!(
        "charts: {total} rendered objects accepted by kube-apiserver {}; {pods_checked} Pods of Deployments accepted under Pod Security restricted",
        netkit_testenv::KUBERNETES_VERSION
    );
    Ok(())
}

/// Dry-run creates a Pod of `deployment`'s template in `ns`: Pod Security admission judges Pods.
async fn pod_of_template(
    client: &kube::Client,
    ns: &str,
    deployment: &DynamicObject,
) -> anyhow::Result<()> {
    let name = deployment.metadata.name.clone().unwrap_or_default();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": format!("{name}-pod-security"), "namespace": ns },
        "spec": deployment.data["spec"]["template"]["spec"],
    }))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(
        &PostParams {
            dry_run: true,
            ..PostParams::default()
        },
        &pod,
    )
    .await?;
    Ok(())
}

async fn ensure_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.to_owned());
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}
