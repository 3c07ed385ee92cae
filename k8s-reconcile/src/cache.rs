//! Reflector stores by kind, so that reads of watched objects come from memory.
//!
//! A controller watches the kinds it owns or is triggered by anyway; [`Caches`] keeps those
//! watches' stores, one per kind, and [`Caches::get`] answers from a store once its first list
//! has completed. The
//! [`Applier`](crate::Applier) of a controller compares the cached copy before anything else, so
//! a steady state costs the API server no reads either.
//!
//! The stores of [`ControllerBuilder::owns`](crate::ControllerBuilder::owns) and
//! [`watches`](crate::ControllerBuilder::watches) are [`JsonStore`]s: each object is kept as its
//! compact JSON text and decoded when read. A typed copy of a Deployment takes about three times
//! the memory of its JSON, in hundreds of small allocations. The price is CPU: every watch event
//! is encoded and every read decoded (a controller reads each child about once per reconcile).
//!
//! An answer may lag the server by the watch's latency. The applier therefore trusts a cached
//! copy only to skip a write, and reads the server before it writes. A reconcile that used a
//! stale copy in any other way is followed by the one its change triggers once the watch
//! delivers it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, PoisonError, RwLock};

use futures::FutureExt as _;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A kind the framework watches, caches (as JSON) and applies: any Kubernetes object type with
/// serde, such as k8s-openapi's; implemented for every type that qualifies.
pub trait CachedKind:
    Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug + Send + Sync + 'static
{
}

impl<K> CachedKind for K where
    K: Resource<DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static
{
}

/// Reflector stores by kind; see the [module docs](self).
#[derive(Clone, Default)]
pub struct Caches {
    stores: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
    json: HashMap<TypeId, JsonStore>,
}

/// A watch's objects as compact JSON text by namespace and name, kept by [`JsonStore::apply`]
/// from the watch's events and decoded on every read; see the [module docs](self).
#[derive(Clone, Default)]
pub struct JsonStore {
    state: Arc<RwLock<JsonState>>,
}

#[derive(Default)]
struct JsonState {
    objects: HashMap<(String, String), Arc<str>>,
    /// A relist in progress: its objects replace the current ones when it is done.
    relisting: Option<HashMap<(String, String), Arc<str>>>,
    /// The first list has completed.
    ready: bool,
}

impl Debug for JsonStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("JsonStore")
            .field("objects", &state.objects.len())
            .field("ready", &state.ready)
            .finish()
    }
}

impl JsonStore {
    /// An empty store, not ready until a first list has been applied.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event of the watch, as a reflector does (a relist replaces the objects once
    /// it is done). An object that cannot be encoded is left out: reads of it go to the server.
    pub fn apply<K: Resource + Serialize>(&self, event: &watcher::Event<K>) {
        let key = |object: &K| (object.namespace().unwrap_or_default(), object.name_any());
        let text = |object: &K| serde_json::to_string(object).ok().map(Arc::<str>::from);
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Apply(object) => match text(object) {
                Some(json) => {
                    state.objects.insert(key(object), json);
                }
                None => {
                    state.objects.remove(&key(object));
                }
            },
            watcher::Event::Delete(object) => {
                state.objects.remove(&key(object));
            }
            watcher::Event::Init => state.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(object) => {
                if let (Some(listed), Some(json)) = (state.relisting.as_mut(), text(object)) {
                    listed.insert(key(object), json);
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = state.relisting.take() {
                    state.objects = listed;
                }
                state.ready = true;
            }
        }
    }

    /// The JSON of `namespace/name`: `Some(None)` when the listed store has no such object,
    /// `None` before the first list.
    fn get(&self, namespace: &str, name: &str) -> Option<Option<Arc<str>>> {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        state.ready.then(|| {
            state
                .objects
                .get(&(namespace.to_owned(), name.to_owned()))
                .cloned()
        })
    }
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

    /// Adds the store of kind `K`, replacing an earlier store (typed or JSON) of that kind.
    pub fn insert<K>(&mut self, store: Store<K>)
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        self.json.remove(&TypeId::of::<K>());
        self.stores.insert(TypeId::of::<K>(), Arc::new(store));
    }

    /// Adds the JSON store of kind `K`, replacing an earlier store (typed or JSON) of that kind.
    pub fn insert_json<K: 'static>(&mut self, store: JsonStore) {
        self.stores.remove(&TypeId::of::<K>());
        self.json.insert(TypeId::of::<K>(), store);
    }

    /// Whether a store of kind `K` is held (synced or not).
    pub fn holds<K: 'static>(&self) -> bool {
        self.stores.contains_key(&TypeId::of::<K>()) || self.json.contains_key(&TypeId::of::<K>())
    }

    /// The object `namespace/name` of kind `K` as the store has it: `Some(None)` when the synced
    /// store has no such object, `None` when no synced store of `K` is held (ask the server).
    /// From a [`JsonStore`] the object is decoded afresh; one that no longer decodes as `K` is
    /// `None` too.
    pub fn get<K>(&self, namespace: &str, name: &str) -> Option<Option<Arc<K>>>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static,
    {
        if let Some(json) = self.json.get(&TypeId::of::<K>()) {
            return match json.get(namespace, name)? {
                Some(text) => serde_json::from_str::<K>(&text)
                    .ok()
                    .map(|k| Some(Arc::new(k))),
                None => Some(None),
            };
        }
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

    #[test]
    fn json_stores_answer_decoded_copies_and_follow_relists() {
        let store = JsonStore::new();
        let mut caches = Caches::new();
        caches.insert_json::<ConfigMap>(store.clone());
        assert!(caches.holds::<ConfigMap>());
        let mut a = configmap("a");
        a.data = Some([("k".to_owned(), "v".to_owned())].into());
        store.apply(&Event::<ConfigMap>::Init);
        store.apply(&Event::InitApply(a.clone()));
        // Mid-list: not ready, so no answer.
        assert!(caches.get::<ConfigMap>("ns", "a").is_none());
        store.apply(&Event::<ConfigMap>::InitDone);
        assert_eq!(
            caches.get::<ConfigMap>("ns", "a").flatten().as_deref(),
            Some(&a)
        );
        assert!(matches!(caches.get::<ConfigMap>("ns", "b"), Some(None)));

        store.apply(&Event::Apply(configmap("b")));
        assert!(caches.get::<ConfigMap>("ns", "b").flatten().is_some());
        store.apply(&Event::Delete(configmap("b")));
        assert!(matches!(caches.get::<ConfigMap>("ns", "b"), Some(None)));

        // A relist replaces everything once done; until then the old objects answer.
        store.apply(&Event::<ConfigMap>::Init);
        store.apply(&Event::InitApply(configmap("c")));
        assert!(caches.get::<ConfigMap>("ns", "a").flatten().is_some());
        store.apply(&Event::<ConfigMap>::InitDone);
        assert!(matches!(caches.get::<ConfigMap>("ns", "a"), Some(None)));
        assert!(caches.get::<ConfigMap>("ns", "c").flatten().is_some());

        // A typed store of the kind replaces the JSON one.
        let (typed, _writer) = reflector::store::<ConfigMap>();
        caches.insert(typed);
        assert!(
            caches.get::<ConfigMap>("ns", "c").is_none(),
            "the typed store is not synced"
        );
    }
}
