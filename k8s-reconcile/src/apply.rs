//! Owned objects by server-side apply, with no write when nothing changed.
//!
//! [`Applier::apply`] sends the desired object as a server-side apply patch with one fixed field
//! manager (forcing ownership of the fields it sets). Before writing it reads the live object and
//! skips the write when both
//!
//! * the live object carries the [`APPLIED_HASH_ANNOTATION`] of exactly this desired object (so a
//!   field we stopped setting, which apply would remove, still triggers a write), and
//! * every field of the desired object has the same value in the live object (so an edit by anyone
//!   else is repaired).
//!
//! A steady state therefore costs reads only, and none at all when a cached copy already matches
//! ([`Applier::with_caches`]; a controller's own applier has the caches of the kinds it owns). A
//! cached copy that does not match may only lag the server, so it is read before any write.
//! Desired objects should use the server's canonical forms (e.g. `100m`, not `0.1`, for
//! quantities); a value the server rewrites would otherwise be re-applied on every pass.

use std::collections::BTreeSet;
use std::fmt::Debug;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::core::NamespaceScope;
use kube::core::object::HasStatus;
use kube::{Client, Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use crate::Error;
use crate::cache::{CachedKind, Caches};

/// Annotation holding the hash of the last applied desired object.
pub const APPLIED_HASH_ANNOTATION: &str = "kube-netkit.io/applied-hash";

/// The result of [`Applier::apply`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Applied<K> {
    /// The live object already matched; nothing was written.
    Unchanged(K),
    /// The object was created, or our desired state changed; this is the server's answer.
    Written(K),
    /// Someone else had changed fields we own since our last apply; they were put back. Repeated
    /// repairs mean another controller fights over the object.
    Repaired {
        /// The server's answer.
        object: K,
        /// The other field managers recorded on the object before the repair (who may have
        /// changed it).
        drifted_by: Vec<String>,
    },
}

impl<K> Applied<K> {
    /// The object as the server has it.
    pub fn into_inner(self) -> K {
        match self {
            Self::Unchanged(k) | Self::Written(k) | Self::Repaired { object: k, .. } => k,
        }
    }

    /// Whether a write call was made.
    pub fn written(&self) -> bool {
        !matches!(self, Self::Unchanged(_))
    }

    /// Whether the write undid someone else's change.
    pub fn repaired(&self) -> bool {
        matches!(self, Self::Repaired { .. })
    }

    /// The other field managers of a repaired object (empty otherwise).
    pub fn drifted_by(&self) -> &[String] {
        match self {
            Self::Repaired { drifted_by, .. } => drifted_by,
            _ => &[],
        }
    }
}

/// A live object against the desired one.
enum Live {
    /// Ours, and every desired field holds: nothing to write.
    Matches,
    /// Ours, but someone changed fields we set; the other field managers.
    Drifted(Vec<String>),
    /// Not (yet) what we applied.
    Differs,
}

/// Applies objects with one field manager; see the [module docs](self).
#[derive(Clone)]
pub struct Applier {
    client: Client,
    field_manager: String,
    caches: Caches,
}

impl Debug for Applier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier")
            .field("field_manager", &self.field_manager)
            .finish_non_exhaustive()
    }
}

impl Applier {
    /// An applier writing as `field_manager`.
    pub fn new(client: Client, field_manager: impl Into<String>) -> Self {
        Self {
            client,
            field_manager: field_manager.into(),
            caches: Caches::new(),
        }
    }

    /// Skips the read of a live object when `caches` holds a copy that already matches.
    pub fn with_caches(mut self, caches: Caches) -> Self {
        self.caches = caches;
        self
    }

    /// The field manager name.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// The client used.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Applies `desired` unless the live object already matches it.
    ///
    /// `desired` must be a namespaced object with a name and a namespace.
    pub async fn apply<K>(&self, desired: &K) -> Result<Applied<K>, Error>
    where
        K: CachedKind,
        K::Scope: NamespaceScope,
    {
        let name =
            desired.meta().name.clone().ok_or_else(|| {
                Error::InvalidObject(format!("a {} without a name", K::kind(&())))
            })?;
        let namespace = desired.meta().namespace.clone().ok_or_else(|| {
            Error::InvalidObject(format!("{} {name} has no namespace", K::kind(&())))
        })?;
        let api = self.api_for::<K>(&namespace);
        let mut value = serde_json::to_value(desired).map_err(Error::Serialize)?;
        let hash = content_hash(&value);
        set_annotation(&mut value, APPLIED_HASH_ANNOTATION, &hash)?;

        // A cached copy that matches is enough to skip the write; one that does not may only lag
        // the server (our last write not seen yet), so the server has the final say.
        if let Some(Some(cached)) = self.caches.get::<K>(&namespace, &name)
            && matches!(self.compare(&value, &hash, cached.as_ref())?, Live::Matches)
        {
            return Ok(Applied::Unchanged(K::clone(&cached)));
        }
        let live = api.get_opt(&name).await.map_err(Error::Kube)?;
        let drifted_by = match live {
            Some(live) => match self.compare(&value, &hash, &live)? {
                Live::Matches => return Ok(Applied::Unchanged(live)),
                Live::Drifted(others) => Some(others),
                Live::Differs => None,
            },
            None => None,
        };
        let params = PatchParams::apply(&self.field_manager).force();
        let written = api
            .patch(&name, &params, &Patch::Apply(&value))
            .await
            .map_err(Error::Kube)?;
        Ok(match drifted_by {
            Some(drifted_by) => Applied::Repaired {
                object: written,
                drifted_by,
            },
            None => Applied::Written(written),
        })
    }

    /// How `live` stands against the desired `value` (whose hash is `hash`).
    fn compare<K: Resource + Serialize>(
        &self,
        value: &Value,
        hash: &str,
        live: &K,
    ) -> Result<Live, Error> {
        let ours = live
            .annotations()
            .get(APPLIED_HASH_ANNOTATION)
            .is_some_and(|h| h == hash);
        let live_value = serde_json::to_value(live).map_err(Error::Serialize)?;
        Ok(match (is_subset(value, &live_value), ours) {
            (true, true) => Live::Matches,
            // We applied exactly this before, yet it no longer holds: someone changed it.
            (false, true) => {
                let mut others: Vec<String> = live
                    .meta()
                    .managed_fields
                    .iter()
                    .flatten()
                    .filter_map(|entry| entry.manager.clone())
                    .filter(|manager| *manager != self.field_manager)
                    .collect();
                others.sort();
                others.dedup();
                Live::Drifted(others)
            }
            (_, false) => Live::Differs,
        })
    }

    /// Deletes every object matching `label_selector` in `namespace` whose name is not in `keep`;
    /// returns how many were deleted.
    pub async fn prune<K>(
        &self,
        namespace: &str,
        label_selector: &str,
        keep: &BTreeSet<String>,
    ) -> Result<usize, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: NamespaceScope,
    {
        let api = self.api_for::<K>(namespace);
        let list = api
            .list_metadata(&ListParams::default().labels(label_selector))
            .await
            .map_err(Error::Kube)?;
        let mut deleted = 0;
        for item in list.items {
            let name = item.name_any();
            if keep.contains(&name) {
                continue;
            }
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => deleted += 1,
                // Someone else deleted it first: the goal is reached.
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(Error::Kube(err)),
            }
        }
        Ok(deleted)
    }

    fn api_for<K>(&self, namespace: &str) -> Api<K>
    where
        K: Resource<DynamicType = ()>,
        K::Scope: NamespaceScope,
    {
        Api::all_with(self.client.clone(), &()).constrain(namespace)
    }
}

/// How many times a conflicting status write is retried.
const STATUS_ATTEMPTS: usize = 8;

/// Reads the object, lets `mutate` change a copy of its status and writes it back when it changed:
/// a JSON merge patch of the whole status on the status subresource, guarded by the
/// `resourceVersion` that was read (a concurrent writer's conditions are never lost) and retried
/// on conflict. Returns whether a write happened; a missing object is not an error (`Ok(false)`).
pub async fn update_status<K, S, F>(
    api: &Api<K>,
    name: &str,
    mut mutate: F,
) -> Result<bool, kube::Error>
where
    K: Resource + HasStatus<Status = S> + Clone + DeserializeOwned + Debug,
    S: Default + Clone + PartialEq + Serialize,
    F: FnMut(&K, &mut S),
{
    let mut last_conflict = None;
    for _ in 0..STATUS_ATTEMPTS {
        let Some(live) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let Some(desired) = mutated_status(&live, &mut mutate) else {
            return Ok(false);
        };
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": live.resource_version()},
            "status": desired,
        });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => last_conflict = Some(kube::Error::Api(s)),
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Err(last_conflict
        .unwrap_or_else(|| kube::Error::Service("status update kept conflicting".into())))
}

/// As [`update_status`], first against `current` (the object being reconciled, as the
/// controller's cache has it): no request at all when its status already matches. Otherwise the
/// cache may lag the server, so the write goes through [`update_status`]'s read.
pub async fn update_status_from<K, S, F>(
    api: &Api<K>,
    current: &K,
    mut mutate: F,
) -> Result<bool, kube::Error>
where
    K: Resource + HasStatus<Status = S> + Clone + DeserializeOwned + Debug,
    S: Default + Clone + PartialEq + Serialize,
    F: FnMut(&K, &mut S),
{
    if mutated_status(current, &mut mutate).is_none() {
        return Ok(false);
    }
    update_status(api, &current.name_any(), mutate).await
}

/// `object`'s status as `mutate` leaves it, or `None` when it did not change.
fn mutated_status<K, S, F>(object: &K, mutate: &mut F) -> Option<S>
where
    K: HasStatus<Status = S>,
    S: Default + Clone + PartialEq,
    F: FnMut(&K, &mut S),
{
    let current = object.status().cloned().unwrap_or_default();
    let mut desired = current.clone();
    mutate(object, &mut desired);
    (desired != current).then_some(desired)
}

/// Delete parameters that delete only `resource_version` of the object (the version that was
/// read): a concurrent change (an extension, a retarget) makes the delete fail with 409 instead
/// of being lost.
pub fn delete_unchanged(resource_version: Option<String>) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            resource_version,
            uid: None,
        }),
        ..DeleteParams::default()
    }
}

/// A controller owner reference to `owner` (`controller: true`, `blockOwnerDeletion: true`), for
/// the children it owns. `None` when the owner has no name or uid yet.
pub fn controller_owner_ref<K>(owner: &K) -> Option<OwnerReference>
where
    K: Resource<DynamicType = ()>,
{
    owner.controller_owner_ref(&())
}

/// A stable hash of a JSON value (hex SHA-256 of its serialization).
pub fn content_hash(value: &Value) -> String {
    let mut hasher = Sha256::new();
    hasher.update(value.to_string().as_bytes());
    hex::encode(&hasher.finalize()[..16])
}

fn set_annotation(value: &mut Value, key: &str, val: &str) -> Result<(), Error> {
    let metadata = value
        .as_object_mut()
        .and_then(|o| {
            o.entry("metadata")
                .or_insert_with(|| Value::Object(Default::default()))
                .as_object_mut()
        })
        .ok_or_else(|| Error::InvalidObject("metadata is not an object".to_owned()))?;
    let annotations = metadata
        .entry("annotations")
        .or_insert_with(|| Value::Object(Default::default()));
    if annotations.is_null() {
        *annotations = Value::Object(Default::default());
    }
    annotations
        .as_object_mut()
        .ok_or_else(|| Error::InvalidObject("annotations are not an object".to_owned()))?
        .insert(key.to_owned(), Value::String(val.to_owned()));
    Ok(())
}

/// Whether every field set in `want` has the same value in `have`. Lists must have the same length
/// and match element by element; an empty list, map or `null` in `want` matches an absent field
/// (the server omits them).
pub fn is_subset(want: &Value, have: &Value) -> bool {
    match (want, have) {
        (Value::Null, _) => true,
        (Value::Object(w), Value::Object(h)) => w.iter().all(|(k, wv)| match h.get(k) {
            Some(hv) => is_subset(wv, hv),
            None => is_empty(wv),
        }),
        (Value::Object(w), Value::Null) => w.values().all(is_empty),
        (Value::Array(w), Value::Array(h)) => {
            w.len() == h.len() && w.iter().zip(h).all(|(wv, hv)| is_subset(wv, hv))
        }
        (Value::Array(w), Value::Null) => w.is_empty(),
        (Value::Number(w), Value::Number(h)) => w.as_f64() == h.as_f64(),
        (w, h) => w == h,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_empty),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn subset_ignores_server_added_fields_and_empty_values() {
        let want = json!({"metadata": {"name": "a", "labels": {}}, "spec": {"ports": [{"port": 80}], "x": null}});
        let have = json!({"metadata": {"name": "a", "uid": "u"}, "spec": {"ports": [{"port": 80, "protocol": "TCP"}]}});
        assert!(is_subset(&want, &have));
    }

    #[test]
    fn subset_detects_changed_values_and_list_lengths() {
        let want = json!({"spec": {"ports": [{"port": 80}]}});
        assert!(!is_subset(
            &want,
            &json!({"spec": {"ports": [{"port": 81}]}})
        ));
        assert!(!is_subset(
            &want,
            &json!({"spec": {"ports": [{"port": 80}, {"port": 81}]}})
        ));
        assert!(!is_subset(&want, &json!({"spec": {}})));
        assert!(!is_subset(&json!({"a": "x"}), &json!({"a": "y"})));
    }

    #[test]
    fn hash_changes_with_content() {
        let a = content_hash(&json!({"a": 1}));
        assert_eq!(a, content_hash(&json!({"a": 1})));
        assert_ne!(a, content_hash(&json!({"a": 2})));
    }

    #[test]
    fn annotation_is_added_to_objects_without_metadata_annotations() {
        let mut v = json!({"metadata": {"name": "x", "annotations": null}});
        set_annotation(&mut v, "k", "v").unwrap_or_default();
        assert_eq!(v["metadata"]["annotations"]["k"], "v");
        let mut bad = json!("not an object");
        assert!(set_annotation(&mut bad, "k", "v").is_err());
    }
}
