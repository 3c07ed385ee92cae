//! A reconciler framework on kube-rs, and a real test control plane.
//!
//! Each controller of this project is only its own logic: it implements [`Reconciler`], and this
//! crate wires it to `kube::runtime` with owned and watched kinds, per-object backoff, resync,
//! concurrency limits, leader election, finalizers, metrics, health and Events. Children are
//! written by server-side apply with a fixed field manager; in a steady state that costs no write
//! and, for the kinds a controller owns or watches, no read either (they come from its watches'
//! caches).
//!
//! # Layout
//!
//! * [`controller`]: the [`Reconciler`] trait, [`ControllerBuilder`] and the per-reconcile
//!   [`Context`].
//! * [`auth`]: who sent a request and what they may do, asked of the API server (TokenReview,
//!   SubjectAccessReview), as kube-rbac-proxy does.
//! * [`apply`]: [`Applier`], server-side apply that skips unchanged objects; owner references;
//!   pruning by label; status writes guarded by `resourceVersion`.
//! * [`cache`]: stores by kind (typed reflector stores, or compact JSON for the kinds a
//!   controller owns or watches), which the applier reads instead of the API server.
//! * [`conditions`]: status conditions whose `lastTransitionTime` moves only on a flip.
//! * [`endpointslice`]: EndpointSlices (one per IP family) and skip-mirror Endpoints for a Service.
//! * [`leader`]: Lease-based leader election with client-go's semantics.
//! * [`leading`]: work only the Lease holder does, one term at a time.
//! * [`metrics`]: Prometheus metrics of reconciles and leadership.
//! * [`watch_set`]: a pass over a whole set of watched objects (debounced, resynced).
//! * [`peers`]: the peer check: which replicas of a binary still answer, known within seconds
//!   of a node's loss.
//! * [`permissions`]: what this process may do itself (SelfSubjectAccessReview), and what it
//!   reports when a narrower role leaves something out.
//! * [`pod`]: Pod spec pieces: `restricted` security contexts, env from Secrets and fields,
//!   Secret files, HTTP probes.
//! * [`ops`]: readiness checks and shutdown on SIGTERM.
//!
//! What a binary builds around its controllers (flags, logging, the server of `/healthz`,
//! `/readyz` and `/metrics`, a REST API server, exit codes) is not here: this repository's
//! binaries take it from their own unpublished crate, `netkit-runtime`
//! (`k8s-reconcile/runtime`), so a user of this library pulls no CLI parser and no web stack.
//!
//! # Kubernetes versions
//!
//! This crate never chooses a Kubernetes version: like every library on
//! [`k8s-openapi`](k8s_openapi), it leaves that to the final binary, which enables one version
//! feature on its own `k8s-openapi` dependency (e.g. `features = ["v1_35"]`). Supported: 1.33 to
//! 1.37, every version `k8s-openapi` 0.29 offers (`earliest` to `latest`). The workspace CI builds
//! an outside crate on `earliest` (1.33) and one on `v1_35` against this crate and runs the
//! example below in each against a real API server (`cargo xtask consumers`). Its own binaries
//! and tests use 1.37.
//!
//! `kube` and `k8s-openapi` are re-exported ([`kube`], [`k8s_openapi`]), so a user can name their
//! types without matching versions by hand; the binary still lists `k8s-openapi` itself to pick
//! the version.
//!
//! # Errors
//!
//! A variant with a cause returns it from `source()` and does not repeat it in its message, which
//! says only what failed at its own level ("cannot listen on 0.0.0.0:80", not "...: address in
//! use"). That is the convention of the Rust ecosystem, so a caller can walk or downcast the
//! chain, and a program that prints every cause in turn shows each one once; printing the chain
//! is the binary's job (`netkit_runtime::error_chain` does it for this workspace's).
//!
//! # Feature flags
//!
//! * `rustls-tls` (default): kube's client uses rustls with the `ring` provider, which needs no C
//!   toolchain. Turn default features off to choose kube's TLS stack yourself.
//!
//! kube's `unstable-runtime` feature is always on: [`ControllerBuilder::owns`] uses
//! `Controller::owns_stream`, so each owned kind is watched once and that watch fills the cache
//! the [`Applier`] reads.
//!
//! # Testing
//!
//! The workspace's tests run against a real kube-apiserver and etcd (and a real node) started by
//! its unpublished test-environment crate, `netkit-testenv` (`xtask/testenv` in the repository);
//! nothing of it ships in this crate.
//!
//! # Example
//!
//! A whole controller, the crate's `secret_mirror` example: next to every Secret it keeps a
//! ConfigMap listing the Secret's keys. In `Cargo.toml`: `k8s-reconcile`, `k8s-openapi` with the
//! version feature of your cluster, and `tokio` with `macros` and `rt-multi-thread`.
//!
#![doc = concat!("```no_run\n", include_str!("../examples/secret_mirror.rs"), "```")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

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
pub mod peers;
pub mod permissions;
pub mod pod;
pub mod watch_set;

/// The Kubernetes API types this crate is built on (the version is the final binary's choice).
pub use k8s_openapi;
/// The kube-rs version this crate is built on, so users name types without matching versions.
pub use kube;

pub use apply::{Applied, Applier};

// The README's code blocks are compiled as doctests, so its example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
pub use controller::{Action, Context, ControllerBuilder, Reconciler};
pub use error::Error;
