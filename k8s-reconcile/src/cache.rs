//! Reflector stores by kind, so that reads of watched objects come from memory.
//!
//! A controller watches the kinds it owns or is triggered by anyway; [`Caches`] keeps those
//! watches' stores, one per kind, and [`Caches::get`] answers from a store once its first list
//! has completed. The
//! [`Applier`](crate::Applier) of a controller compares the cached copy before anything else, so
//! a steady state costs the API server no reads either.
//!
//! An answer may lag the server by the watch's latency. The applier therefore trusts a cached
//! copy only to skip a write, and reads the server before it writes. A reconcile that used a
//! stale copy in any other way is followed by the one its change triggers once the watch
//! delivers it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;

use futures::FutureExt as _;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

/// Reflector stores by kind; see the [module docs](self).
#[derive(Clone, Default)]
pub struct Caches {
    stores: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("kinds", &self.stores.len())
            .finish()
    }
}

impl Caches {
    /// No stores: every read goes to the API server.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the store of kind `K`, replacing an earlier one of the same kind.
    pub fn insert<K>(&mut self, store: Store<K>)
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        self.stores.insert(TypeId::of::<K>(), Arc::new(store));
    }

    /// Whether a store of kind `K` is held (synced or not).
    pub fn holds<K: 'static>(&self) -> bool {
        self.stores.contains_key(&TypeId::of::<K>())
    }

    /// The object `namespace/name` of kind `K` as the store has it: `Some(None)` when the synced
    /// store has no such object, `None` when no synced store of `K` is held (ask the server).
    pub fn get<K>(&self, namespace: &str, name: &str) -> Option<Option<Arc<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let store = self
            .stores
            .get(&TypeId::of::<K>())?
            .downcast_ref::<Store<K>>()?;
        // Ready once the first list has landed; before that, absence means nothing.
        match store.wait_until_ready().now_or_never() {
            Some(Ok(())) => Some(store.get(&ObjectRef::new(name).within(namespace))),
            _ => None,
        }
    }

    /// The object `namespace/name` from the synced store of `K`, or else read through `api`
    /// (scoped to `namespace`).
    pub async fn get_or_read<K>(
        &self,
        api: &Api<K>,
        namespace: &str,
        name: &str,
    ) -> Result<Option<K>, kube::Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        match self.get::<K>(namespace, name) {
            Some(cached) => Ok(cached.map(|object| K::clone(&object))),
            None => api.get_opt(name).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use kube::api::ObjectMeta;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;

    fn configmap(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    #[test]
    fn answers_only_from_a_synced_store_of_the_kind() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let mut caches = Caches::new();
        caches.insert(store);
        assert!(caches.holds::<ConfigMap>());
        assert!(!caches.holds::<Secret>());
        // Not listed yet: no answer, whatever the store holds.
        assert!(caches.get::<ConfigMap>("ns", "a").is_none());

        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(configmap("a")));
        writer.apply_watcher_event(&Event::InitDone);
        let found = caches.get::<ConfigMap>("ns", "a");
        assert_eq!(
            found.flatten().and_then(|cm| cm.metadata.name.clone()),
            Some("a".to_owned())
        );
        assert!(matches!(caches.get::<ConfigMap>("ns", "b"), Some(None)));
        assert!(matches!(caches.get::<ConfigMap>("other", "a"), Some(None)));
        // A kind without a store: ask the server.
        assert!(caches.get::<Secret>("ns", "a").is_none());
    }
}
