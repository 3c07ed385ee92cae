//! The OpenAPI 3 document of the HTTP API, served at `/api/openapi.json`. Hand-written, and
//! checked against the router by a test (every route is described) and by schemathesis.

use serde_json::{Value, json};

use crate::api::DEFAULT_TTL_SECONDS;
use crate::config::Settings;

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

const POD_NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
const SERVICE_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

fn envelope(data: Value) -> Value {
    json!({
        "type": "object",
        "required": ["code", "msg"],
        "properties": {
            "code": {"type": "integer", "description": "10000 success; 10001 request error; 40001 unauthenticated; 40003 forbidden; 40004 not found; 50003 unavailable"},
            "msg": {"type": "string"},
            "data": data
        }
    })
}

fn errors(extra: &[u16]) -> serde_json::Map<String, Value> {
    let mut responses = serde_json::Map::new();
    let describe = |code: u16| match code {
        400 => "Malformed request or value out of range",
        401 => "No or invalid bearer token",
        403 => "Not allowed (RBAC), or namespace outside --allowed-namespaces",
        404 => "Pod, Service or mapping not found, or the feature is disabled",
        409 => "The pod cannot be mapped now (no IP, not running, terminating)",
        413 => "Request body too large",
        415 => "Unsupported Content-Type",
        502 => "The Kubernetes API server failed",
        _ => "pod-proxier cannot serve the request now",
    };
    for code in [400, 401, 403, 404, 503].iter().chain(extra) {
        responses.insert(
            code.to_string(),
            json!({
                "description": describe(*code),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
            }),
        );
    }
    responses
}

fn with(mut responses: serde_json::Map<String, Value>, code: &str, response: Value) -> Value {
    responses.insert(code.to_owned(), response);
    Value::Object(responses)
}

fn ok(schema: Value) -> Value {
    json!({
        "description": "Success",
        "content": {"application/json": {"schema": envelope(schema)}}
    })
}

/// The document for `settings` (the TTL bound comes from --max-mapping-time).
pub fn document(settings: &Settings) -> Value {
    let max = settings.max_mapping_time.as_secs();
    let pod_name_param = json!({
        "name": "pod_name", "in": "query", "required": true,
        "description": "<namespace>/<pod>",
        "schema": {"type": "string", "pattern": POD_NAME_PATTERN, "maxLength": 317}
    });
    let mapping_request = json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["pod_name"],
        "properties": {
            "pod_name": {"type": "string", "pattern": POD_NAME_PATTERN, "maxLength": 317, "description": "<namespace>/<pod>"},
            "time": {"type": "integer", "minimum": 1, "maximum": max, "default": DEFAULT_TTL_SECONDS, "description": "TTL in seconds; posting again for the same pod sets a new deadline"},
            "close_connections": {"type": "boolean", "default": false, "description": "Close established connections when this mapping replaces another or ends"}
        }
    });
    let form_request = json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["pod_name"],
        "properties": {
            "pod_name": {"type": "string", "pattern": POD_NAME_PATTERN},
            "time": {"type": "integer", "minimum": 1, "maximum": max},
            "close_connections": {"type": "boolean"}
        }
    });
    let bearer = json!([{"bearer": []}]);
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "pod-proxier",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "TTL-managed TCP mappings to Pods (V1) and published Service ports (V2). Every answer is the envelope {code, msg, data} with a matching HTTP status."
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "A Kubernetes token (TokenReview); access is checked with SubjectAccessReview: create pods/portforward for V1, get services for V2"}
            },
            "schemas": {
                "Error": envelope(json!({"type": "string", "description": "What was looked for, when something was not found"})),
                "Mapping": {
                    "type": "object",
                    "required": ["name", "kind", "entry_port", "upstreams", "close_connections"],
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"type": "string", "enum": ["pod", "service"]},
                        "pod_name": {"type": "string"},
                        "service": {"type": "string"},
                        "port_name": {"type": "string"},
                        "target_port": {"type": "integer"},
                        "entry_port": {"type": "integer", "description": "The port to connect to"},
                        "upstreams": {"type": "array", "items": {"type": "string"}},
                        "expires_at": {"type": "string", "format": "date-time"},
                        "remaining_seconds": {"type": "integer"},
                        "close_connections": {"type": "boolean"},
                        "requested_by": {"type": "string"},
                        "replaced": {"type": "string", "nullable": true, "description": "POST only: the pod this mapping replaced"},
                        "ttl_seconds": {"type": "integer", "description": "POST only"}
                    }
                },
                "MappingRequest": mapping_request,
                "MappingFormRequest": form_request
            }
        },
        "paths": {
            "/": {"get": {
                "summary": "Banner", "operationId": "banner",
                "responses": {"200": {"description": "A line of text", "content": {"text/plain": {"schema": {"type": "string"}}}}}
            }},
            "/health": {"get": {
                "summary": "Liveness (as the original)", "operationId": "health",
                "responses": {"200": ok(json!({"type": "string", "enum": ["pong"]}))}
            }},
            "/api/openapi.json": {"get": {
                "summary": "This document", "operationId": "openapi",
                "responses": {"200": {"description": "OpenAPI 3 document", "content": {"application/json": {"schema": {"type": "object"}}}}}
            }},
            "/api/v1/mapping": {
                "post": {
                    "summary": "Map a pod to the V1 entry port for a TTL (replaces any other mapping; for the same pod, sets a new deadline)",
                    "operationId": "createMapping",
                    "security": bearer,
                    "requestBody": {"required": true, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/MappingRequest"}},
                        "application/x-www-form-urlencoded": {"schema": {"$ref": "#/components/schemas/MappingFormRequest"}}
                    }},
                    "responses": with(errors(&[409, 413, 415, 502]), "200", ok(json!({"$ref": "#/components/schemas/Mapping"})))
                },
                "get": {
                    "summary": "Whether the pod exists, and its mapping if it is mapped",
                    "operationId": "getMapping",
                    "security": bearer,
                    "parameters": [pod_name_param.clone()],
                    "responses": with(errors(&[502]), "200", ok(json!({"type": "object", "properties": {"pod_name": {"type": "string"}, "mapped": {"type": "boolean"}}})))
                },
                "delete": {
                    "summary": "End the pod's mapping now; the entry port refuses connections again",
                    "operationId": "deleteMapping",
                    "security": bearer,
                    "parameters": [pod_name_param, {
                        "name": "close_connections", "in": "query", "required": false,
                        "schema": {"type": "boolean", "default": false}
                    }],
                    "responses": with(errors(&[409, 502]), "200", ok(json!({"type": "object", "properties": {"pod_name": {"type": "string"}, "entry_port": {"type": "integer"}, "mapped": {"type": "boolean"}}})))
                }
            },
            "/api/v1/mappings": {"get": {
                "summary": "The current V1 mappings the caller may port-forward to",
                "operationId": "listMappings",
                "security": bearer,
                "responses": with(errors(&[502]), "200", ok(json!({"type": "array", "items": {"$ref": "#/components/schemas/Mapping"}})))
            }},
            "/api/v2/mappings": {"get": {
                "summary": "The published Service ports the caller may get",
                "operationId": "listServiceMappings",
                "security": bearer,
                "parameters": [{"name": "namespace", "in": "query", "required": false, "schema": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}}],
                "responses": with(errors(&[502]), "200", ok(json!({"type": "array", "items": {"$ref": "#/components/schemas/Mapping"}})))
            }},
            "/api/v2/mapping": {"get": {
                "summary": "The published port of one Service",
                "operationId": "getServiceMapping",
                "security": bearer,
                "parameters": [{"name": "service", "in": "query", "required": true, "description": "<namespace>/<service>", "schema": {"type": "string", "pattern": SERVICE_PATTERN, "maxLength": 127}}],
                "responses": with(errors(&[502]), "200", ok(json!({"$ref": "#/components/schemas/Mapping"})))
            }}
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::Parser as _;

    #[test]
    fn every_route_is_described() {
        let settings = crate::config::Cli::try_parse_from(["pod-proxier", "--enable-v1"])
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
