//! The [`Reconciler`] trait and [`ControllerBuilder`], which wires it to `kube::runtime`.
//!
//! A controller here is only its own logic: implement [`Reconciler`] for a resource type, then
//! describe what else to watch and how to run:
//!
//! * owned kinds ([`ControllerBuilder::owns`]) and related kinds with a mapper
//!   ([`ControllerBuilder::watches`]) trigger reconciles of their owner; owned kinds are also
//!   cached ([`Context::caches`]), and the context's applier reads them there; any other stream
//!   of object references can trigger reconciles too ([`ControllerBuilder::reconcile_on`]);
//! * errors are retried with per-object exponential backoff (with jitter), reset by the next
//!   success; successes are requeued at the resync period, or sooner if the reconciler asks;
//! * at most [`ControllerBuilder::concurrency`] reconciles run at once, never two for one object;
//! * with [`ControllerBuilder::leader_election`], only the Lease holder runs the controller; a
//!   replica that loses the Lease stops reconciling before anyone else can start;
//! * a [`Reconciler::finalizer`] makes [`Reconciler::cleanup`] run before the object disappears;
//! * metrics, readiness (`informers-synced`: the first list has completed; `leadership`) and
//!   Events come for free;
//! * cancelling the shutdown token stops watching, lets in-flight reconciles finish (for at most
//!   [`SHUTDOWN_GRACE`], then cancels them), releases the Lease and returns.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::Api;
use kube::runtime::controller::{Action as KubeAction, Config as ControllerConfig, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::apply::Applier;
use crate::cache::{CachedKind, Caches, JsonStore};
use crate::leader::LeaseConfig;
use crate::leading::{self, Leadership};
use crate::metrics::ControllerMetrics;
use crate::ops::Health;

/// What to do after a successful reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing more until a watched change or the resync period.
    Done,
    /// Reconcile again after this long (capped at the resync period).
    RequeueAfter(Duration),
}

/// One controller's logic. See the [module docs](self).
pub trait Reconciler: Send + Sync + 'static {
    /// The reconciled resource (a namespaced kind).
    type Resource: Resource<DynamicType = (), Scope: kube::core::NamespaceScope>
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned
        + Send
        + Sync
        + 'static;
    /// What reconcile and cleanup fail with.
    type Error: std::error::Error + Send + Sync + 'static;

    /// A finalizer name (e.g. `tunnels.rstream.io/cleanup`); when set, [`Self::cleanup`] runs
    /// before a deleted object disappears.
    fn finalizer(&self) -> Option<&str> {
        None
    }

    /// Makes the world match `object`. Must be idempotent.
    fn reconcile(
        &self,
        object: Arc<Self::Resource>,
        ctx: &Context,
    ) -> impl Future<Output = Result<Action, Self::Error>> + Send;

    /// Undoes what reconcile did, for an object being deleted (only with a finalizer).
    fn cleanup(
        &self,
        object: Arc<Self::Resource>,
        ctx: &Context,
    ) -> impl Future<Output = Result<Action, Self::Error>> + Send {
        let _ = (object, ctx);
        async { Ok(Action::Done) }
    }
}

/// What a reconciler gets besides its object.
#[derive(Clone)]
pub struct Context {
    client: Client,
    applier: Applier,
    caches: Caches,
    recorder: Recorder,
    name: String,
}

impl Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("controller", &self.name)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context for the controller `name`, applying as field manager `field_manager`.
    pub fn new(client: Client, name: &str, field_manager: &str) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: field_manager.to_owned(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Self {
            applier: Applier::new(client.clone(), field_manager),
            caches: Caches::new(),
            client,
            recorder,
            name: name.to_owned(),
        }
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The server-side-apply helper of this controller's field manager; it reads the live
    /// objects of cached kinds from [`Self::caches`].
    pub fn applier(&self) -> &Applier {
        &self.applier
    }

    /// The stores of the kinds the controller owns or watches, filled by its watches (empty for
    /// a context made with [`Self::new`]).
    pub fn caches(&self) -> &Caches {
        &self.caches
    }

    /// Reads from `caches` (and has the applier do so).
    fn with_caches(mut self, caches: Caches) -> Self {
        self.applier = self.applier.with_caches(caches.clone());
        self.caches = caches;
        self
    }

    /// The controller's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records a Kubernetes Event about `object`. Failures are logged, not returned: an Event is
    /// never worth failing a reconcile for.
    pub async fn publish_event<K>(&self, object: &K, warning: bool, reason: &str, note: &str)
    where
        K: Resource<DynamicType = ()>,
    {
        let reference: ObjectReference = object.object_ref(&());
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note.to_owned()),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &reference).await {
            tracing::warn!(controller = %self.name, error = %err, %reason, "could not record Event");
        }
    }
}

/// The changed objects of a watch of `api` (retried with backoff), kept as JSON in a store that
/// joins `caches` (without their `managedFields`).
fn cached_changes<C>(
    api: &Api<C>,
    config: &watcher::Config,
    caches: &mut Caches,
) -> impl Stream<Item = Result<C, watcher::Error>> + Send + 'static
where
    C: CachedKind,
{
    let store = JsonStore::new();
    caches.insert_json::<C>(store.clone());
    watcher::watcher(api.clone(), config.clone())
        .backoff(crate::watch_set::WatchBackoff::default())
        .modify(crate::watch_set::drop_managed_fields)
        .inspect_ok(move |event| store.apply(event))
        .touched_objects()
}

/// Adds one watched kind to a controller (and its store to the caches); kept so that every
/// leadership term builds fresh watches.
type Setup<K> = Arc<dyn Fn(Controller<K>, &mut Caches) -> Controller<K> + Send + Sync>;

/// How long a controller's reconciles may run on after a stop (shutdown or a lost Lease)
/// before they are cancelled; [`ControllerBuilder::run`] gives the Lease release as long again.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Builds and runs a controller; see the [module docs](self).
pub struct ControllerBuilder<R: Reconciler> {
    name: String,
    client: Client,
    reconciler: Arc<R>,
    api: Api<R::Resource>,
    watcher_config: watcher::Config,
    setup: Vec<Setup<R::Resource>>,
    resync: Duration,
    concurrency: u16,
    backoff: (Duration, Duration),
    field_manager: String,
    lease: Option<LeaseConfig>,
    health: Health,
    metrics: Option<ControllerMetrics>,
}

impl<R: Reconciler> Debug for ControllerBuilder<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerBuilder")
            .field("name", &self.name)
            .field("resync", &self.resync)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl<R: Reconciler> ControllerBuilder<R> {
    /// A controller named `name` (used in metrics, logs and as the default field manager) over
    /// every `R::Resource` the client can see.
    pub fn new(client: Client, name: impl Into<String>, reconciler: R) -> Self {
        let name = name.into();
        Self {
            api: Api::all_with(client.clone(), &()),
            field_manager: name.clone(),
            name,
            client,
            reconciler: Arc::new(reconciler),
            watcher_config: watcher::Config::default(),
            setup: Vec::new(),
            resync: Duration::from_secs(300),
            concurrency: 8,
            backoff: (Duration::from_millis(500), Duration::from_secs(300)),
            lease: None,
            health: Health::new(),
            metrics: None,
        }
    }

    /// Watch the resource in one namespace only.
    pub fn namespaced(mut self, namespace: &str) -> Self {
        self.api = self.api.constrain(namespace);
        self
    }

    /// Narrow the main watch (labels, fields).
    pub fn watcher_config(mut self, config: watcher::Config) -> Self {
        self.watcher_config = config;
        self
    }

    /// Reconcile the owner (by controller ownerReference) when an object of `api` changes. The
    /// watched objects are kept in [`Context::caches`]: the applier reads them there.
    pub fn owns<C>(mut self, api: Api<C>, config: watcher::Config) -> Self
    where
        C: CachedKind,
    {
        self.setup.push(Arc::new(move |c, caches| {
            c.owns_stream(cached_changes(&api, &config, caches))
        }));
        self
    }

    /// Reconcile what `mapper` names when an object of `api` changes. As with [`Self::owns`],
    /// the watched objects are kept in [`Context::caches`], so a reconciler reads them there
    /// instead of asking the API server on every resync (the price is their memory: watch
    /// Secrets in the namespaces that hold the ones you need, not the whole cluster, where that
    /// is known).
    pub fn watches<C, F>(mut self, api: Api<C>, config: watcher::Config, mapper: F) -> Self
    where
        C: CachedKind,
        F: Fn(C) -> Vec<ObjectRef<R::Resource>> + Send + Sync + 'static,
    {
        let mapper = Arc::new(mapper);
        self.setup.push(Arc::new(move |c, caches| {
            let mapper = Arc::clone(&mapper);
            c.watches_stream(cached_changes(&api, &config, caches), move |obj| {
                mapper(obj)
            })
        }));
        self
    }

    /// Also reconcile the objects that `triggers` names, for changes no watch of this builder
    /// sees: objects read by name through narrow watches of their own, or an external system.
    /// `triggers` is called at the start of every run (each leadership term builds fresh
    /// watches), and the stream it returns is dropped when that run ends; a stream that ends
    /// only stops this source of reconciles. Nothing is cached (unlike [`Self::watches`]).
    pub fn reconcile_on<S, F>(mut self, triggers: F) -> Self
    where
        F: Fn() -> S + Send + Sync + 'static,
        S: Stream<Item = ObjectRef<R::Resource>> + Send + 'static,
    {
        self.setup
            .push(Arc::new(move |c, _caches| c.reconcile_on(triggers())));
        self
    }

    /// How often every object is reconciled even without changes (default 5 minutes).
    pub fn resync(mut self, period: Duration) -> Self {
        self.resync = period;
        self
    }

    /// At most this many reconciles at once (default 8; 0 means unbounded).
    pub fn concurrency(mut self, limit: u16) -> Self {
        self.concurrency = limit;
        self
    }

    /// Retry delays after errors: doubling from `min` up to `max` (default 500 ms to 5 min).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = (min, max);
        self
    }

    /// The server-side-apply field manager (default: the controller's name).
    pub fn field_manager(mut self, manager: impl Into<String>) -> Self {
        self.field_manager = manager.into();
        self
    }

    /// Only reconcile while holding this Lease.
    pub fn leader_election(mut self, lease: LeaseConfig) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Readiness checks to update (`informers-synced`, `leadership`).
    pub fn health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    /// Record reconcile metrics.
    pub fn metrics(mut self, metrics: ControllerMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Runs until `shutdown` is cancelled, then gives in-flight reconciles and the Lease release
    /// [`SHUTDOWN_GRACE`] to finish: with the API server unreachable they could otherwise hold a
    /// terminating Pod until the kubelet kills it.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let work = self.run_until(shutdown.clone());
        tokio::pin!(work);
        tokio::select! {
            result = &mut work => result,
            () = async {
                shutdown.cancelled().await;
                // The term's own grace, then as long again for the Lease release.
                tokio::time::sleep(2 * SHUTDOWN_GRACE).await;
            } => {
                tracing::warn!(
                    grace = ?SHUTDOWN_GRACE,
                    "in-flight reconciles or the Lease release did not finish after shutdown; stopping anyway"
                );
                Ok(())
            }
        }
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), Error> {
        if self.backoff.0.is_zero() || self.backoff.0 > self.backoff.1 {
            return Err(Error::InvalidConfig(
                "backoff: min must be positive and at most max".to_owned(),
            ));
        }
        if self.resync.is_zero() {
            return Err(Error::InvalidConfig(
                "resync period must be positive".to_owned(),
            ));
        }
        let Some(lease) = self.lease.clone() else {
            self.health
                .set("leadership", true, "leader election disabled");
            self.run_while_leading(shutdown).await;
            return Ok(());
        };
        let leadership = Leadership {
            name: self.name.clone(),
            health: self.health.clone(),
            metrics: self.metrics.clone(),
        };
        let client = self.client.clone();
        let this = Arc::new(self);
        leading::run_while_leading(client, lease, &leadership, shutdown, move |stop| {
            let this = Arc::clone(&this);
            async move { this.run_while_leading(stop).await }
        })
        .await
    }

    /// Runs the kube-runtime controller until `stop` is cancelled.
    async fn run_while_leading(&self, stop: CancellationToken) {
        // The main watch as kube-runtime's `Controller::new` makes it, but retried with backoff
        // and without `managedFields` in the store (they can be larger than the rest of a
        // small object, and no reconcile reads them).
        let (store, writer) = reflector::store();
        let main = reflector::reflector(
            writer,
            watcher::watcher(self.api.clone(), self.watcher_config.clone())
                .backoff(crate::watch_set::WatchBackoff::default())
                .modify(crate::watch_set::drop_managed_fields),
        )
        .applied_objects();
        let mut controller = Controller::for_stream(main, store)
            .with_config(ControllerConfig::default().concurrency(self.concurrency))
            .trigger_backoff(crate::watch_set::WatchBackoff::default());
        // A fresh set of watches (and caches) per term: rebuild from the recorded setup steps.
        let mut caches = Caches::new();
        for step in &self.setup {
            controller = step(controller, &mut caches);
        }
        let store = controller.store();
        let health = self.health.clone();
        // Only the first list gates readiness: a replica that has served does not turn unready
        // while a later term (after a lost Lease, say) lists again.
        let synced_before = health.check("informers-synced").is_some_and(|c| c.ok);
        health.set(
            "informers-synced",
            synced_before,
            if synced_before {
                "listing again for a new term"
            } else {
                "waiting for the first list"
            },
        );
        let synced = tokio::spawn(async move {
            // The store's readiness signal wakes only its most recent waiter, and the controller
            // itself waits on it too: poll with a short timeout so our waiter re-registers.
            loop {
                match tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready())
                    .await
                {
                    Ok(Ok(())) => {
                        health.set("informers-synced", true, "synced");
                        break;
                    }
                    Ok(Err(err)) => {
                        tracing::warn!(error = %err, "informer store closed before it was ready");
                        break;
                    }
                    Err(_elapsed) => {
                        tracing::debug!("informer store not ready yet");
                        continue;
                    }
                }
            }
        });
        let state = Arc::new(RunState {
            reconciler: Arc::clone(&self.reconciler),
            ctx: Context::new(self.client.clone(), &self.name, &self.field_manager)
                .with_caches(caches),
            api: self.api.clone(),
            failures: Mutex::new(HashMap::new()),
            resync: self.resync,
            backoff: self.backoff,
            metrics: self.metrics.clone(),
        });
        let stop_signal = stop.clone();
        let run = controller
            .graceful_shutdown_on(async move { stop_signal.cancelled().await })
            .run(reconcile_one::<R>, error_policy::<R>, state)
            .for_each(|result| async move {
                if let Err(err) = result {
                    tracing::debug!(error = %err, "controller event");
                }
            });
        tokio::pin!(run);
        // A term must end for the next one (or the Lease release) to start: past the grace,
        // dropping the controller cancels whatever reconcile still waits on the API server.
        tokio::select! {
            () = &mut run => {}
            () = async {
                stop.cancelled().await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } => {
                tracing::warn!(
                    controller = %self.name,
                    grace = ?SHUTDOWN_GRACE,
                    "reconciles still running after the stop; cancelled"
                );
            }
        }
        synced.abort();
    }
}

/// Per-run state handed to kube-runtime.
struct RunState<R: Reconciler> {
    reconciler: Arc<R>,
    ctx: Context,
    api: Api<R::Resource>,
    failures: Mutex<HashMap<ObjectRef<R::Resource>, u32>>,
    resync: Duration,
    backoff: (Duration, Duration),
    metrics: Option<ControllerMetrics>,
}

impl<R: Reconciler> RunState<R> {
    /// An API handle that can write `object`: the main handle may watch every namespace, and such a
    /// handle can only list and watch a namespaced kind.
    fn api_for(&self, object: &R::Resource) -> Api<R::Resource> {
        self.api
            .clone()
            .constrain(&object.namespace().unwrap_or_default())
    }
}

/// Errors of one reconcile, as kube-runtime sees them.
#[derive(Debug, thiserror::Error)]
enum ReconcileFailure<E: std::error::Error + 'static> {
    #[error(transparent)]
    Reconciler(E),
    #[error(transparent)]
    Framework(Error),
}

async fn reconcile_one<R: Reconciler>(
    object: Arc<R::Resource>,
    state: Arc<RunState<R>>,
) -> Result<KubeAction, ReconcileFailure<R::Error>> {
    let started = Instant::now();
    let key = ObjectRef::from_obj(object.as_ref());
    let resync = state.resync;
    let to_kube = move |action: Action| match action {
        Action::Done => KubeAction::requeue(resync),
        Action::RequeueAfter(after) => KubeAction::requeue(after.min(resync)),
    };
    let result = match state.reconciler.finalizer() {
        None => state
            .reconciler
            .reconcile(object, &state.ctx)
            .await
            .map(to_kube)
            .map_err(ReconcileFailure::Reconciler),
        Some(name) => {
            let api = state.api_for(object.as_ref());
            // Adding the finalizer is a JSON patch whose `test` op compares `/metadata/finalizers`
            // with the object given; a stale one from the store (our own earlier add not yet seen
            // by the watch, say) fails that test and the API server answers 422 Invalid. So the
            // add starts from the live object.
            let object = match live_for_finalizer(&api, object, name).await {
                Ok(Some(object)) => object,
                Ok(None) => return Ok(KubeAction::await_change()),
                Err(err) => {
                    return Err(ReconcileFailure::Framework(Error::Finalizer(Box::new(err))));
                }
            };
            let reconciler = Arc::clone(&state.reconciler);
            let ctx = state.ctx.clone();
            finalizer(&api, name, object, |event| async move {
                match event {
                    FinalizerEvent::Apply(obj) => reconciler.reconcile(obj, &ctx).await,
                    FinalizerEvent::Cleanup(obj) => reconciler.cleanup(obj, &ctx).await,
                }
                .map(to_kube)
            })
            .await
            .or_else(|err| match err {
                // The object changed between our read and the patch (its finalizers no longer
                // what the `test` op expects): the API server's answer to a stale object, not a
                // failure. The change's watch event reconciles it again; the requeue is a net.
                kube::runtime::finalizer::Error::AddFinalizer(kube::Error::Api(status))
                    if status.code == 422 || status.code == 409 =>
                {
                    tracing::debug!(
                        controller = %state.ctx.name,
                        code = status.code,
                        message = %status.message,
                        "finalizer not added yet: the object changed since it was read; reconciling again"
                    );
                    Ok(KubeAction::requeue(STALE_FINALIZER_RETRY))
                }
                other => Err(other),
            })
            .map_err(|err| match err {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => {
                    ReconcileFailure::Reconciler(e)
                }
                other => ReconcileFailure::Framework(Error::Finalizer(Box::new(other))),
            })
        }
    };
    if let Some(metrics) = &state.metrics {
        metrics.observe(&state.ctx.name, result.is_ok(), started.elapsed());
    }
    if result.is_ok() {
        // Success resets this object's backoff.
        if let Ok(mut failures) = state.failures.lock() {
            failures.remove(&key);
        }
    }
    result
}

/// How soon an object whose finalizer add met a changed object is reconciled again (its watch
/// event usually comes first).
const STALE_FINALIZER_RETRY: Duration = Duration::from_secs(1);

/// The object to hand kube-runtime's finalizer helper: `object` itself when it already carries
/// `finalizer` or is being deleted (no patch follows), otherwise the live object read from the
/// API server (`None`: it is gone), so the add's `test` op compares against what the server
/// holds, not a cached copy that may be a version behind.
pub(crate) async fn live_for_finalizer<K>(
    api: &Api<K>,
    object: Arc<K>,
    finalizer: &str,
) -> Result<Option<Arc<K>>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let has = object.finalizers().iter().any(|f| f == finalizer);
    if has || object.meta().deletion_timestamp.is_some() {
        return Ok(Some(object));
    }
    Ok(api.get_opt(&object.name_any()).await?.map(Arc::new))
}

fn error_policy<R: Reconciler>(
    object: Arc<R::Resource>,
    error: &ReconcileFailure<R::Error>,
    state: Arc<RunState<R>>,
) -> KubeAction {
    let key = ObjectRef::from_obj(object.as_ref());
    let attempt = state
        .failures
        .lock()
        .map(|mut failures| {
            let count = failures.entry(key).or_insert(0);
            *count = count.saturating_add(1);
            *count
        })
        .unwrap_or(1);
    let delay = backoff_delay(
        state.backoff.0,
        state.backoff.1,
        attempt,
        &object.name_any(),
    );
    tracing::warn!(
        controller = %state.ctx.name,
        object = %object.name_any(),
        namespace = object.namespace().unwrap_or_default(),
        attempt,
        retry_in = ?delay,
        error = %crate::error::chain(error),
        "reconcile failed"
    );
    KubeAction::requeue(delay)
}

/// `min * 2^(attempt-1)`, capped at `max`, with up to 10 % jitter derived from the object and
/// attempt (deterministic, so tests can reason about it, yet spread across objects).
pub fn backoff_delay(min: Duration, max: Duration, attempt: u32, seed: &str) -> Duration {
    let exponent = attempt.saturating_sub(1).min(32);
    let base = min.saturating_mul(2u32.saturating_pow(exponent)).min(max);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (seed, attempt).hash(&mut hasher);
    let jitter_permille = std::hash::Hasher::finish(&hasher) % 100;
    let jitter = base.mul_f64(jitter_permille as f64 / 1000.0);
    (base + jitter).min(max)
}

#[cfg(test)]
mod stale_finalizer_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{ObjectMeta, PostParams};

    const FINALIZER: &str = "netkit.test/stale";

    #[derive(Debug, thiserror::Error)]
    #[error("never")]
    struct Never;

    struct Counting(Mutex<u32>);

    impl Reconciler for Counting {
        type Resource = ConfigMap;
        type Error = Never;
        fn finalizer(&self) -> Option<&str> {
            Some(FINALIZER)
        }
        async fn reconcile(&self, _: Arc<ConfigMap>, _: &Context) -> Result<Action, Never> {
            *self.0.lock().unwrap() += 1;
            Ok(Action::Done)
        }
    }

    /// The store's copy of an object, read before our own finalizer add reached the watch: the
    /// API server refuses kube-runtime's add (its JSON patch `test` of `/metadata/finalizers`
    /// fails: 422 Invalid, the error CI logged). A reconcile given that copy adds nothing twice,
    /// fails nothing and runs the reconciler with the live object.
    #[tokio::test]
    async fn a_stale_copy_without_the_finalizer_reconciles_without_a_422() {
        let plane = netkit_testenv::ControlPlane::shared().await.unwrap();
        let client = plane.client().await.unwrap();
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
        let name = format!("stale-finalizer-{}", rand_suffix());
        let created = api
            .create(
                &PostParams::default(),
                &ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        ..ObjectMeta::default()
                    },
                    ..ConfigMap::default()
                },
            )
            .await
            .unwrap();
        let stale = Arc::new(created);
        let state = Arc::new(RunState {
            reconciler: Arc::new(Counting(Mutex::new(0))),
            ctx: Context::new(client.clone(), "stale-test", "stale-test"),
            api: api.clone(),
            failures: Mutex::new(HashMap::new()),
            resync: Duration::from_secs(300),
            backoff: (Duration::from_millis(10), Duration::from_secs(1)),
            metrics: None,
        });
        // The first reconcile adds the finalizer (the server's object moves on).
        reconcile_one(Arc::clone(&stale), Arc::clone(&state))
            .await
            .unwrap();
        let live = api.get(&name).await.unwrap();
        assert_eq!(live.finalizers(), [FINALIZER.to_owned()]);

        // kube-runtime's add from the stale copy is what the API server refuses with 422.
        let refused = finalizer(&api, FINALIZER, Arc::clone(&stale), |_| async {
            Ok::<_, Never>(KubeAction::await_change())
        })
        .await
        .unwrap_err();
        assert!(
            matches!(&refused, kube::runtime::finalizer::Error::AddFinalizer(kube::Error::Api(s)) if s.code == 422),
            "{refused:?}"
        );

        // A reconcile triggered with the stale copy: no error, the reconciler ran, and the
        // finalizer is on the object once.
        let action = reconcile_one(Arc::clone(&stale), Arc::clone(&state)).await;
        assert!(action.is_ok(), "{:?}", action.err());
        assert_eq!(*state.reconciler.0.lock().unwrap(), 1);
        let live = api.get(&name).await.unwrap();
        assert_eq!(live.finalizers(), [FINALIZER.to_owned()]);

        // Cleaned up: remove the finalizer, delete.
        api.patch(
            &name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
        api.delete(&name, &Default::default()).await.unwrap();
    }

    fn rand_suffix() -> u32 {
        std::process::id() ^ (Instant::now().elapsed().subsec_nanos())
    }
}

#[cfg(test)]
mod reconcile_on_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{ObjectMeta, PostParams};

    #[derive(Debug, thiserror::Error)]
    #[error("never")]
    struct Never;

    /// Counts its reconciles.
    struct Counting(Arc<Mutex<u32>>);

    impl Reconciler for Counting {
        type Resource = ConfigMap;
        type Error = Never;
        async fn reconcile(&self, _: Arc<ConfigMap>, _: &Context) -> Result<Action, Never> {
            *self.0.lock().unwrap() += 1;
            Ok(Action::Done)
        }
    }

    /// An object reference sent on the trigger stream reconciles that object again, with no
    /// change to it and long before the resync period.
    #[tokio::test]
    async fn a_trigger_stream_reconciles_the_objects_it_names() {
        let plane = netkit_testenv::ControlPlane::shared().await.unwrap();
        let client = plane.client().await.unwrap();
        let ns = plane.create_namespace("reconcile-on").await.unwrap();
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        api.create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("watched".to_owned()),
                    ..ObjectMeta::default()
                },
                ..ConfigMap::default()
            },
        )
        .await
        .unwrap();
        let count = Arc::new(Mutex::new(0));
        let (tx, rx) = futures::channel::mpsc::unbounded();
        // One run here (no leader election): the factory hands out the one receiver.
        let rx = Mutex::new(Some(rx));
        let stop = CancellationToken::new();
        let run = ControllerBuilder::new(client, "reconcile-on", Counting(Arc::clone(&count)))
            .namespaced(&ns)
            .resync(Duration::from_secs(3600))
            .reconcile_on(move || {
                rx.lock()
                    .unwrap()
                    .take()
                    .map(|rx| rx.boxed())
                    .unwrap_or_else(|| futures::stream::empty().boxed())
            })
            .run(stop.clone());
        let run = tokio::spawn(run);
        let reconciles = || *count.lock().unwrap();
        netkit_testenv::eventually("the first reconcile", Duration::from_secs(30), || async {
            reconciles() >= 1
        })
        .await;
        // Nothing else reconciles it (no change, resync an hour away) but the trigger.
        let before = reconciles();
        tx.unbounded_send(ObjectRef::<ConfigMap>::new("watched").within(&ns))
            .unwrap();
        netkit_testenv::eventually(
            "a reconcile from the trigger stream",
            Duration::from_secs(30),
            || async { reconciles() > before },
        )
        .await;
        stop.cancel();
        run.await.unwrap().unwrap();
    }
}
