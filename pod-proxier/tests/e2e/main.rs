//! End-to-end tests of pod-proxier against a real kube-apiserver, with the binary running as the
//! chart's ServiceAccount bound to the chart's RBAC rules only. Traffic stays on loopback: pods
//! and endpoints are given 127.0.0.x addresses where the tests' own servers listen.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api;
mod haproxy;
mod restart;
mod schemathesis;
mod slow_clients;
#[path = "../support/mod.rs"]
mod support;
mod v1;
mod v2;
