//! The `helm upgrade` to a next chart version whose CRD adds a field.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use rstream_operator::api::RstreamConnection;
use serde_json::json;

use crate::e2e::Env;

use super::{CRDS, RELEASE};

/// The RstreamConnection that lives through the CRD upgrade and the uninstall.
pub(super) const SURVIVOR: &str = "survivor";
/// The optional spec field the next chart version's RstreamConnection CRD adds.
pub(super) const NEW_FIELD: &str = "e2eUpgradeNote";
/// The name `helm repo add` gives the repository of the next chart version.
const NEXT_REPO: &str = "kube-netkit-next";

/// Installs with the released chart an RstreamConnection, shows the API server prunes
/// [`NEW_FIELD`] from it, upgrades the release to [`next_chart`] from a repository of its own,
/// and shows the CRD now holds the field, the API server keeps it, and the RstreamConnection is
/// the same object (same uid). Ok is the detail; any failed claim is an error naming it.
pub(super) async fn crd_upgrade(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let conns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<RstreamConnection>(&()),
    );
    let created = conns
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
                "metadata": { "name": SURVIVOR },
                "spec": {
                    "engine": "engine.invalid:443",
                    "tokenSecretRef": { "name": "absent", "key": "token" },
                },
            }))?,
        )
        .await?;
    let uid = created.metadata.uid.clone().context("no uid")?;
    let note = |value: &str| Patch::Merge(json!({ "spec": { NEW_FIELD: value } }));
    let before = conns
        .patch(SURVIVOR, &PatchParams::default(), &note("before"))
        .await?;
    if !before.data["spec"][NEW_FIELD].is_null() {
        bail!("the released CRD already keeps spec.{NEW_FIELD}: the scenario proves nothing");
    }

    let dir = tempfile::tempdir()?;
    let version = next_chart(env, dir.path())?;
    let server = crate::charts::Server::start(&dir.path().join("repo"))?;
    env.repo.add(&env.helm, NEXT_REPO, &server.url())?;
    let upgraded = Instant::now();
    env.helm(&[
        "upgrade",
        RELEASE,
        &format!("{NEXT_REPO}/{RELEASE}"),
        "--version",
        &version,
        "-n",
        ns,
        "--reuse-values",
        "--wait",
        "--timeout",
        "120s",
    ])
    .await?;
    let took = upgraded.elapsed();

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get(CRDS[0]).await?;
    let in_schema = crd.spec.versions.iter().any(|v| {
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| s.properties.as_ref())
            .and_then(|p| p.get("spec"))
            .and_then(|s| s.properties.as_ref())
            .is_some_and(|p| p.contains_key(NEW_FIELD))
    });
    let keep = crd
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("helm.sh/resource-policy"))
        .cloned();
    if !in_schema {
        bail!(
            "after helm upgrade to {version} the CRD {} has no spec.{NEW_FIELD}",
            CRDS[0]
        );
    }
    // The API server serves a changed CRD schema a moment after storing it.
    let schema_wait = Instant::now();
    let deadline = schema_wait + Duration::from_secs(60);
    let read_back = loop {
        conns
            .patch(SURVIVOR, &PatchParams::default(), &note("after"))
            .await?;
        let read = conns.get(SURVIVOR).await?;
        if read.data["spec"][NEW_FIELD] == "after" || Instant::now() > deadline {
            break read;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    if read_back.data["spec"][NEW_FIELD] != "after" {
        bail!("the CRD lists spec.{NEW_FIELD}, but the API server still prunes it");
    }
    if read_back.metadata.uid.as_deref() != Some(uid.as_str()) {
        bail!(
            "RstreamConnection {SURVIVOR} was replaced (uid {uid} -> {:?})",
            read_back.metadata.uid
        );
    }
    Ok(format!(
        "before: spec.{NEW_FIELD} pruned; helm upgrade to chart {version} from {NEXT_REPO} in {took:.1?}; \
         after: the CRD's schema lists it, a patch with it reads back {NEW_FIELD}={} (served {:.1?} after the upgrade), \
         RstreamConnection {SURVIVOR} keeps uid {uid}; CRD helm.sh/resource-policy={keep:?}",
        read_back.data["spec"][NEW_FIELD],
        schema_wait.elapsed()
    ))
}

/// The next release of the chart, made from the packaged one: its version one patch on, its
/// RstreamConnection CRD with one more optional spec field, [`NEW_FIELD`] (written by the same
/// codegen as the chart's own templates), packaged and indexed in `<out>/repo`. Returns the
/// version.
fn next_chart(env: &Env<'_>, out: &std::path::Path) -> anyhow::Result<String> {
    let packaged = env
        .repo
        .charts
        .iter()
        .find(|c| c.name == RELEASE)
        .context("rstream-operator is not in the repository")?;
    let src = out.join("src");
    std::fs::create_dir_all(&src)?;
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&packaged.archive)
        .arg("-C")
        .arg(&src)
        .status()?;
    if !status.success() {
        bail!("tar -xzf {} failed", packaged.archive.display());
    }
    let chart = src.join(RELEASE);
    let (major_minor, patch) = packaged
        .version
        .rsplit_once('.')
        .context("chart version is not x.y.z")?;
    let version = format!("{major_minor}.{}", patch.parse::<u64>()? + 1);
    let chart_yaml = std::fs::read_to_string(chart.join("Chart.yaml"))?;
    let current = format!("version: {}\n", packaged.version);
    if !chart_yaml.contains(&current) {
        bail!("Chart.yaml has no line {current:?}");
    }
    std::fs::write(
        chart.join("Chart.yaml"),
        chart_yaml.replace(&current, &format!("version: {version}\n")),
    )?;

    let mut crd = <RstreamConnection as kube::CustomResourceExt>::crd();
    let spec = crd
        .spec
        .versions
        .iter_mut()
        .filter_map(|v| v.schema.as_mut()?.open_api_v3_schema.as_mut())
        .filter_map(|s| s.properties.as_mut()?.get_mut("spec"))
        .next()
        .context("the RstreamConnection CRD has no spec schema")?;
    spec.properties.get_or_insert_with(Default::default).insert(
        NEW_FIELD.to_owned(),
        JSONSchemaProps {
            type_: Some("string".to_owned()),
            description: Some("Added by the next chart version (e2e CRD upgrade).".to_owned()),
            ..JSONSchemaProps::default()
        },
    );
    let file = format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural);
    let template = chart.join("templates/crds").join(&file);
    if !template.is_file() {
        bail!("the packaged chart has no template {}", template.display());
    }
    std::fs::write(
        template,
        crate::charts::chart_template(&serde_yaml_ng::to_string(&crd)?, "rstream-operator.labels")?,
    )?;
    let repo = out.join("repo");
    std::fs::create_dir_all(&repo)?;
    crate::charts::package_dir(&env.helm, &chart, &repo)?;
    crate::charts::index(&env.helm, &repo)?;
    Ok(version)
}
