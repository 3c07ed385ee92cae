//! The Secrets the manager may read: only those its RstreamConnections name.
//!
//! The manager never lists or caches Secrets: a reconcile reads each Secret it needs by name
//! (`GET`). A change of one must still reconcile its readers promptly (a rotated token rolls the
//! agent), so each named Secret gets a watch of its own, metadata only and narrowed to its name
//! by a field selector (`metadata.name=<name>` in its namespace). The watch starts when a
//! connection first names the Secret and stops when none does; its events go to every
//! subscriber of [`SecretChanges`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::channel::mpsc;
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Secret;
use k8s_reconcile::watch_set::{WatchBackoff, drop_managed_fields};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use crate::api::{RstreamConnection, SecretKeyRef};

/// A Secret by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SecretKey {
    /// Its namespace (the connection's).
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// The names of the Secrets `connection` reads: token, CA, mTLS, proxy credentials and
/// control-plane header values.
pub fn secret_names(connection: &RstreamConnection) -> BTreeSet<&str> {
    let spec = &connection.spec;
    let mut refs: Vec<&SecretKeyRef> = Vec::new();
    refs.extend(spec.token_secret_ref.iter());
    refs.extend(spec.ca_secret_ref.iter());
    if let Some(m) = &spec.mtls {
        refs.push(&m.cert_secret_ref);
        refs.push(&m.key_secret_ref);
        refs.extend(m.ca_secret_ref.iter());
    }
    if let Some(p) = spec.transport.as_ref().and_then(|t| t.proxy.as_ref()) {
        refs.extend(p.username_secret_ref.iter());
        refs.extend(p.password_secret_ref.iter());
    }
    refs.extend(
        spec.control_plane_headers
            .iter()
            .flatten()
            .map(|h| &h.value_secret_ref),
    );
    refs.into_iter().map(|r| r.name.as_str()).collect()
}

/// Whether `name` can be a Secret's name (a DNS subdomain). Other names are never watched: no
/// such Secret can exist (the reconcile's read reports it missing), and a name goes into a field
/// selector, which must not be widened by what a user typed.
fn valid_name(name: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    name.len() <= 253
        && name.chars().all(ok_char)
        && alnum(name.chars().next())
        && alnum(name.chars().last())
}

/// Every Secret that one of `connections` names (and that can exist).
pub fn referenced<'a>(
    connections: impl IntoIterator<Item = &'a RstreamConnection>,
) -> BTreeSet<SecretKey> {
    connections
        .into_iter()
        .flat_map(|c| {
            let namespace = c.namespace().unwrap_or_default();
            secret_names(c)
                .into_iter()
                .filter(|name| valid_name(name))
                .map(move |name| SecretKey {
                    namespace: namespace.clone(),
                    name: name.to_owned(),
                })
        })
        .collect()
}

/// Where the changes of the watched Secrets go: each subscriber gets every one.
#[derive(Clone, Debug, Default)]
pub struct SecretChanges {
    subscribers: Arc<Mutex<Vec<mpsc::UnboundedSender<SecretKey>>>>,
}

impl SecretChanges {
    /// A stream of the Secrets that change from now on (created, modified, deleted, or seen
    /// when their watch starts); it ends when the watches stop.
    pub fn subscribe(&self) -> impl Stream<Item = SecretKey> + Send + use<> {
        let (tx, rx) = mpsc::unbounded();
        if let Ok(mut subscribers) = self.subscribers.lock() {
            subscribers.push(tx);
        }
        rx
    }

    /// Sends `key` to every subscriber; forgets those that are gone (a controller's term ended).
    fn publish(&self, key: &SecretKey) {
        if let Ok(mut subscribers) = self.subscribers.lock() {
            subscribers.retain(|tx| tx.unbounded_send(key.clone()).is_ok());
        }
    }

    /// Ends every subscriber's stream.
    fn close(&self) {
        if let Ok(mut subscribers) = self.subscribers.lock() {
            subscribers.clear();
        }
    }
}

/// The running per-Secret watches.
struct Watches {
    client: Client,
    changes: SecretChanges,
    stop: CancellationToken,
    running: BTreeMap<SecretKey, CancellationToken>,
}

impl Watches {
    /// Starts the watches of `wanted` not running yet and stops those no longer wanted.
    fn sync(&mut self, wanted: BTreeSet<SecretKey>) {
        self.running.retain(|key, stop| {
            let keep = wanted.contains(key);
            if !keep {
                tracing::debug!(namespace = %key.namespace, secret = %key.name, "no connection names this Secret any more; its watch stops");
                stop.cancel();
            }
            keep
        });
        for key in wanted {
            if self.running.contains_key(&key) {
                continue;
            }
            let stop = self.stop.child_token();
            tracing::debug!(namespace = %key.namespace, secret = %key.name, "a connection names this Secret; watching it");
            tokio::spawn(watch_secret(
                self.client.clone(),
                key.clone(),
                self.changes.clone(),
                stop.clone(),
            ));
            self.running.insert(key, stop);
        }
    }

    fn running(&self) -> BTreeSet<SecretKey> {
        self.running.keys().cloned().collect()
    }
}

/// Watches the metadata of Secret `key` alone until `stop`, publishing each of its events.
async fn watch_secret(
    client: Client,
    key: SecretKey,
    changes: SecretChanges,
    stop: CancellationToken,
) {
    // Metadata only: the resourceVersion says that it changed; the reconcile reads the values.
    let api: Api<PartialObjectMeta<Secret>> = Api::namespaced(client, &key.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", key.name));
    let events = watcher::watcher(api, config).backoff(WatchBackoff::default());
    futures::pin_mut!(events);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            event = events.next() => match event {
                None => return,
                // The first list counts too: a Secret created between a reconcile's read and
                // the start of this watch would otherwise go unnoticed.
                Some(Ok(Event::Apply(_) | Event::InitApply(_) | Event::Delete(_))) => {
                    changes.publish(&key);
                }
                Some(Ok(Event::Init | Event::InitDone)) => {}
                Some(Err(error)) => {
                    tracing::warn!(namespace = %key.namespace, secret = %key.name, %error, "watch of a Secret failed, retrying");
                }
            },
        }
    }
}

/// Watches the RstreamConnections of `api` into the returned store and, in step with them, the
/// Secrets they name (see the [module docs](self)), until `stop`.
pub fn spawn(
    client: Client,
    api: Api<RstreamConnection>,
    changes: SecretChanges,
    stop: CancellationToken,
) -> Store<RstreamConnection> {
    let (store, writer) = reflector::store();
    let events = reflector::reflector(
        writer,
        watcher::watcher(api, watcher::Config::default())
            .backoff(WatchBackoff::default())
            .modify(drop_managed_fields),
    );
    let reader = store.clone();
    let mut watches = Watches {
        client,
        changes: changes.clone(),
        stop: stop.clone(),
        running: BTreeMap::new(),
    };
    tokio::spawn(async move {
        futures::pin_mut!(events);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                event = events.next() => match event {
                    None => break,
                    // The store holds the new state once a change or a whole list is in (during
                    // a list it still shows the previous one, so nothing stops meanwhile).
                    Some(Ok(Event::Apply(_) | Event::Delete(_) | Event::InitDone)) => {
                        let state = reader.state();
                        watches.sync(referenced(state.iter().map(AsRef::as_ref)));
                        tracing::trace!(secrets = ?watches.running(), "watched Secrets");
                    }
                    Some(Ok(Event::Init | Event::InitApply(_))) => {}
                    Some(Err(error)) => {
                        tracing::warn!(%error, "watch of RstreamConnections failed, retrying");
                    }
                },
            }
        }
        watches.sync(BTreeSet::new());
        changes.close();
    });
    store
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn connection(namespace: &str, spec: serde_json::Value) -> RstreamConnection {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
            "metadata": {"name": "c", "namespace": namespace}, "spec": spec,
        }))
        .unwrap()
    }

    fn key(namespace: &str, name: &str) -> SecretKey {
        SecretKey {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    #[test]
    fn every_secret_ref_of_a_connection_is_named_once() {
        let c = connection(
            "ns",
            serde_json::json!({
                "engine": "e:443",
                "tokenSecretRef": {"name": "token", "key": "t"},
                "caSecretRef": {"name": "ca", "key": "ca.crt"},
                "mtls": {"certSecretRef": {"name": "tls", "key": "tls.crt"},
                         "keySecretRef": {"name": "tls", "key": "tls.key"},
                         "caSecretRef": {"name": "mtls-ca", "key": "ca.crt"}},
                "transport": {"proxy": {"http": "http://p:3128",
                    "usernameSecretRef": {"name": "proxy", "key": "u"},
                    "passwordSecretRef": {"name": "proxy", "key": "p"}}},
                "controlPlaneHeaders": [{"name": "X-A", "valueSecretRef": {"name": "hdr", "key": "v"}}],
            }),
        );
        assert_eq!(
            secret_names(&c).into_iter().collect::<Vec<_>>(),
            ["ca", "hdr", "mtls-ca", "proxy", "tls", "token"]
        );
    }

    #[test]
    fn referenced_secrets_are_per_namespace_and_skip_impossible_names() {
        let a = connection(
            "one",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": {"name": "creds", "key": "t"}}),
        );
        let b = connection(
            "two",
            serde_json::json!({"engine": "e:443",
                "tokenSecretRef": {"name": "creds", "key": "t"},
                "caSecretRef": {"name": "x,metadata.name!=y", "key": "ca"}}),
        );
        assert_eq!(
            referenced([&a, &b]),
            BTreeSet::from([key("one", "creds"), key("two", "creds")])
        );
        assert!(valid_name("a.b-1"));
        for bad in ["", "-a", "a-", "A", "a b", "a=b", "a,b"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[tokio::test]
    async fn watches_start_for_new_names_and_stop_for_forgotten_ones() {
        // A client that reaches nothing: the watches only retry, which is all this test needs.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let stop = CancellationToken::new();
        let mut watches = Watches {
            client,
            changes: SecretChanges::default(),
            stop: stop.clone(),
            running: BTreeMap::new(),
        };
        watches.sync(BTreeSet::from([key("ns", "a"), key("ns", "b")]));
        let a = watches.running[&key("ns", "a")].clone();
        let b = watches.running[&key("ns", "b")].clone();
        watches.sync(BTreeSet::from([key("ns", "a"), key("other", "c")]));
        assert_eq!(
            watches.running(),
            BTreeSet::from([key("ns", "a"), key("other", "c")])
        );
        assert!(b.is_cancelled(), "the watch of a forgotten Secret stops");
        assert!(!a.is_cancelled(), "a still-named Secret keeps its watch");
        watches.sync(BTreeSet::new());
        assert!(a.is_cancelled());
        assert!(watches.running().is_empty());
        stop.cancel();
    }

    #[tokio::test]
    async fn every_subscriber_gets_each_change_until_it_is_gone() {
        let changes = SecretChanges::default();
        let mut first = Box::pin(changes.subscribe());
        let second = changes.subscribe();
        drop(second);
        changes.publish(&key("ns", "a"));
        assert_eq!(first.next().await, Some(key("ns", "a")));
        assert_eq!(changes.subscribers.lock().unwrap().len(), 1);
        changes.close();
        assert_eq!(first.next().await, None);
    }
}
