//! A reconciler framework on kube-rs, and a real test control plane.
//!
//! Each controller of this project is only its own logic: it implements [`Reconciler`], and this
//! crate wires it to `kube::runtime` with owned and watched kinds, per-object backoff, resync,
//! concurrency limits, leader election, finalizers, metrics, health and Events. Children are
//! written by server-side apply with a fixed field manager; in a steady state that costs no write
//! and, for the kinds a controller owns, no read either (they come from its watches' caches).
//!
//! # Layout
//!
//! * [`app`]: what every binary builds its process from: logging, flag values, exit codes and
//!   the fatal error chain, the Kubernetes client, the operations servers, and a REST API server
//!   bounded against slow and abusive clients.
//! * [`controller`]: the [`Reconciler`] trait, [`ControllerBuilder`] and the per-reconcile
//!   [`Context`].
//! * [`auth`]: who sent a request and what they may do, asked of the API server (TokenReview,
//!   SubjectAccessReview), as kube-rbac-proxy does.
//! * [`apply`]: [`Applier`], server-side apply that skips unchanged objects; owner references;
//!   pruning by label; status writes guarded by `resourceVersion`.
//! * [`cache`]: reflector stores by kind, which the applier reads instead of the API server.
//! * [`conditions`]: status conditions whose `lastTransitionTime` moves only on a flip.
//! * [`endpointslice`]: EndpointSlices (one per IP family) and skip-mirror Endpoints for a Service.
//! * [`leader`]: Lease-based leader election with client-go's semantics.
//! * [`leading`]: work only the Lease holder does, one term at a time.
//! * [`metrics`]: Prometheus metrics of reconciles and leadership.
//! * [`watch_set`]: a pass over a whole set of watched objects (debounced, resynced).
//! * [`permissions`]: what this process may do itself (SelfSubjectAccessReview), and what it
//!   reports when a narrower role leaves something out.
//! * [`pod`]: Pod spec pieces: `restricted` security contexts, env from Secrets and fields,
//!   Secret files, HTTP probes.
//! * [`ops`]: `/healthz`, `/readyz`, `/metrics` and shutdown on SIGTERM.
//! * [`testing`] (feature `testing`): a real kube-apiserver + etcd for integration tests, with
//!   clients for any identity and kubeconfig files for child processes.
//!
//! # Feature flags
//!
//! * `testing`: the [`testing`] module; pulls in `rcgen` and `tempfile`.
//!
//! # Example
//!
//! A controller that keeps a ConfigMap next to every Secret it watches:
//!
//! ```no_run
//! use std::sync::Arc;
//! use k8s_openapi::api::core::v1::{ConfigMap, Secret};
//! use k8s_reconcile::{Action, Context, ControllerBuilder, Reconciler};
//! use kube::ResourceExt as _;
//!
//! struct Mirror;
//!
//! impl Reconciler for Mirror {
//!     type Resource = Secret;
//!     type Error = k8s_reconcile::Error;
//!
//!     async fn reconcile(&self, secret: Arc<Secret>, ctx: &Context) -> Result<Action, Self::Error> {
//!         let mut cm = ConfigMap::default();
//!         cm.metadata.name = Some(format!("{}-keys", secret.name_any()));
//!         cm.metadata.namespace = secret.namespace();
//!         cm.metadata.owner_references = k8s_reconcile::apply::controller_owner_ref(secret.as_ref())
//!             .map(|r| vec![r]);
//!         let keys = secret.data.iter().flatten().map(|(k, _)| (k.clone(), String::new()));
//!         cm.data = Some(keys.collect());
//!         ctx.applier().apply(&cm).await?;
//!         Ok(Action::Done)
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = kube::Client::try_default().await?;
//! let shutdown = k8s_reconcile::ops::shutdown_on_signals()?;
//! ControllerBuilder::new(client.clone(), "secret-mirror", Mirror)
//!     .owns(kube::Api::<ConfigMap>::all(client), Default::default())
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod app;
pub mod apply;
pub mod auth;
pub mod cache;
pub mod conditions;
pub mod controller;
pub mod endpointslice;
mod error;
pub mod leader;
pub mod leading;
pub mod metrics;
pub mod ops;
pub mod permissions;
pub mod pod;
pub mod watch_set;

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use apply::{Applied, Applier};
pub use controller::{Action, Context, ControllerBuilder, Reconciler};
pub use error::Error;
