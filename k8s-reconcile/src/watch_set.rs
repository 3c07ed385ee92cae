//! Reconciling a whole set of objects at once, for logic that cannot work one object at a time
//! (allocating ports from one range to every Service, say).
//!
//! A [`WatchSet`] holds reflector stores of several kinds and namespaces; [`WatchSet::next_pass`]
//! returns when a pass over them is due: once every watch has listed (before that, an absent
//! object would look deleted), then after each burst of changes (debounced) and at least every
//! resync period.
//!
//! ```no_run
//! # async fn demo(client: kube::Client, stop: tokio_util::sync::CancellationToken) {
//! use std::time::Duration;
//! use k8s_openapi::api::core::v1::Service;
//! use k8s_reconcile::watch_set::WatchSet;
//!
//! let mut watches = WatchSet::new(Duration::from_secs(600), Duration::from_millis(50));
//! let services = watches.watch(kube::Api::<Service>::all(client), Default::default());
//! while watches.next_pass(&stop).await {
//!     println!("{} Services", services.state().len());
//! }
//! # }
//! ```
//!
//! [`spawn_store`] is the one-kind case without passes: a store that a background watch keeps
//! filled, for lookups from a mapper or a reconciler.

use std::fmt::Debug;
use std::hash::Hash;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::{BoxStream, SelectAll};
use kube::Resource;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// Clears an object's `managedFields` before a store keeps it: a reader of the cache compares
/// specs and labels, never field ownership (the [`Applier`](crate::Applier) reads the server when
/// it needs that), and the field sets are often the larger part of an object.
pub fn drop_managed_fields<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// A store of `api`'s objects kept filled by a watch (retried with [`WatchBackoff`]) until `stop`;
/// their `managedFields` are dropped ([`drop_managed_fields`]).
pub fn spawn_store<K>(api: Api<K>, config: watcher::Config, stop: CancellationToken) -> Store<K>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    let events = reflector::reflector(
        writer,
        watcher::watcher(api, config)
            .backoff(WatchBackoff::default())
            .modify(drop_managed_fields),
    )
    .for_each(|event| {
        if let Err(err) = event {
            tracing::warn!(error = %err, "watch failed, retrying");
        }
        futures::future::ready(())
    });
    tokio::spawn(async move {
        tokio::select! {
            () = stop.cancelled() => {}
            () = events => {}
        }
    });
    store
}

/// Reflector stores over several watches, and when a pass over all of them is due.
pub struct WatchSet {
    /// Each watch yields whether an event was its initial list's end.
    streams: SelectAll<BoxStream<'static, Result<bool, watcher::Error>>>,
    /// How many watches have finished their initial list.
    listed: usize,
    resync: Duration,
    debounce: Duration,
    resync_timer: Pin<Box<Sleep>>,
    /// When the pass for the changes seen so far is due.
    pending: Option<Instant>,
}

impl WatchSet {
    /// An empty set whose passes run `debounce` after a change (changes within that window share
    /// one pass) and at least every `resync`.
    pub fn new(resync: Duration, debounce: Duration) -> Self {
        Self {
            streams: SelectAll::new(),
            listed: 0,
            resync,
            debounce,
            resync_timer: Box::pin(tokio::time::sleep(resync)),
            pending: None,
        }
    }

    /// Watches `api` with `config` (retried with [`WatchBackoff`]) and returns the store it fills.
    pub fn watch<K>(&mut self, api: Api<K>, config: watcher::Config) -> Store<K>
    where
        K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    {
        let (store, writer) = reflector::store();
        self.streams.push(
            reflector::reflector(
                writer,
                watcher::watcher(api, config).backoff(WatchBackoff::default()),
            )
            .map(|event| event.map(|e| matches!(e, Event::InitDone)))
            .boxed(),
        );
        store
    }

    /// Waits until a pass is due (true), or until `stop` or the end of every watch (false).
    pub async fn next_pass(&mut self, stop: &CancellationToken) -> bool {
        loop {
            let pending = self.pending;
            let debounced = async {
                match pending {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return false,
                event = self.streams.next() => match event {
                    Some(Ok(init_done)) => {
                        if init_done {
                            self.listed += 1;
                        }
                        let debounce = self.debounce;
                        self.pending.get_or_insert_with(|| Instant::now() + debounce);
                    }
                    Some(Err(err)) => tracing::warn!(error = %err, "watch failed, retrying"),
                    None => return false,
                },
                () = self.resync_timer.as_mut() => {
                    self.resync_timer.as_mut().reset(Instant::now() + self.resync);
                    self.pending = Some(Instant::now());
                }
                () = debounced => {
                    self.pending = None;
                    if self.listed >= self.streams.len() {
                        return true;
                    }
                }
            }
        }
    }
}

/// How a broken watch is retried: 100 ms, doubling, at most 1 s apart, back to 100 ms once a watch
/// works again.
///
/// kube-runtime's default (client-go's) grows to 30 s, so after a 5 s API server restart a
/// controller could stay blind for several more seconds; the 1 s cap bounds that to one second,
/// at the cost of one cheap failed request per watch and second while the API server is gone.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(1);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (delay * 2).min(Self::MAX);
        Some(delay)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_backoff_doubles_to_one_second_and_resets() {
        use kube::runtime::utils::Backoff as _;
        let mut backoff = WatchBackoff::default();
        let first: Vec<u128> = backoff.by_ref().take(6).map(|d| d.as_millis()).collect();
        assert_eq!(first, [100, 200, 400, 800, 1000, 1000]);
        backoff.reset();
        assert_eq!(backoff.next(), Some(Duration::from_millis(100)));
    }
}
