//! The OpenAPI 3 document of the HTTP API, served at `/api/openapi.json`. Hand-written as data
//! (`openapi.yaml`), with the values that come from flags set here; checked against the router by
//! a test (every route is described) and by schemathesis.

use serde_json::{Value, json};

use crate::settings::Settings;

/// The document, except what [`document`] sets from the flags and the build.
const DOCUMENT: &str = include_str!("openapi.yaml");

/// Where `openapi.yaml` bounds the TTL, which --max-mapping-time sets.
const TTL_MAXIMA: &[&str] = &[
    "/components/schemas/MappingRequest/properties/time/maximum",
    "/components/schemas/MappingFormRequest/properties/time/maximum",
];

/// Every path and method the router serves, for the coverage test.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/"),
    ("get", "/health"),
    ("get", "/api/openapi.json"),
    ("get", "/api/v1/mapping"),
    ("post", "/api/v1/mapping"),
    ("delete", "/api/v1/mapping"),
    ("get", "/api/v1/mappings"),
    ("get", "/api/v2/mappings"),
    ("get", "/api/v2/mapping"),
];

/// The document for `settings` (the TTL bound comes from --max-mapping-time).
pub fn document(settings: &Settings) -> Value {
    // The tests parse the same text, so this never fails in a build that passed them.
    let Ok(mut doc) = serde_yaml_ng::from_str::<Value>(DOCUMENT) else {
        return Value::Null;
    };
    for pointer in TTL_MAXIMA {
        if let Some(maximum) = doc.pointer_mut(pointer) {
            *maximum = json!(settings.policy.max_mapping_time.as_secs());
        }
    }
    if let Some(version) = doc.pointer_mut("/info/version") {
        *version = json!(env!("CARGO_PKG_VERSION"));
    }
    doc
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::Parser as _;

    #[test]
    fn flags_and_defaults_reach_the_document() {
        let settings = crate::config::Cli::try_parse_from([
            "pod-proxier",
            "--plain-http",
            "--enable-v1",
            "--max-mapping-time",
            "777",
        ])
        .unwrap()
        .validate(true)
        .unwrap();
        let doc = document(&settings);
        for pointer in TTL_MAXIMA {
            assert_eq!(doc.pointer(pointer), Some(&json!(777)), "{pointer}");
        }
        let default = "/components/schemas/MappingRequest/properties/time/default";
        assert_eq!(
            doc.pointer(default),
            Some(&json!(crate::pod_mappings::DEFAULT_TTL_SECONDS))
        );
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn every_route_is_described() {
        let settings =
            crate::config::Cli::try_parse_from(["pod-proxier", "--plain-http", "--enable-v1"])
                .unwrap()
                .validate(true)
                .unwrap();
        let doc = document(&settings);
        for (method, path) in ROUTES {
            assert!(
                doc["paths"][path][method].is_object(),
                "{method} {path} is not in the OpenAPI document"
            );
        }
        let described: usize = doc["paths"]
            .as_object()
            .unwrap()
            .values()
            .map(|p| p.as_object().unwrap().len())
            .sum();
        assert_eq!(
            described,
            ROUTES.len(),
            "the document describes a route the router lacks"
        );
    }
}
