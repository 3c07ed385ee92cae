//! A reconciler framework on kube-rs, and a real test control plane.
//!
//! # Layout
//!
//! * [`testing`] (feature `testing`): a real kube-apiserver + etcd for integration tests, with
//!   clients for any identity and kubeconfig files for child processes.
//!
//! # Feature flags
//!
//! * `testing`: the [`testing`] module; pulls in `rcgen` and `tempfile`.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
