//! Kubernetes name rules, checked before any API call so bad input gets a precise message. The
//! DNS rules are the framework's ([`netkit_runtime::values`]); port names are ours.

use netkit_runtime::{validate_dns_label, validate_dns_subdomain};

/// A container or Service port name (IANA service name): at most 15 lowercase letters, digits
/// and '-', with at least one letter, no '-' at either end and no "--".
pub fn validate_port_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 15 {
        return Err("a port name must have 1 to 15 characters".to_owned());
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(
            "a port name may contain only lowercase letters, digits and '-' (no '_')".to_owned(),
        );
    }
    if !name.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err("a port name must contain at least one letter".to_owned());
    }
    if name.starts_with('-') || name.ends_with('-') || name.contains("--") {
        return Err("a port name must not start or end with '-' nor contain \"--\"".to_owned());
    }
    Ok(())
}

/// Splits `namespace/pod` and checks both parts.
pub fn parse_pod_name(input: &str) -> Result<(String, String), String> {
    let Some((namespace, pod)) = input.split_once('/') else {
        return Err(format!(
            "pod_name {input:?} must have the form <namespace>/<pod>"
        ));
    };
    validate_dns_label(namespace).map_err(|e| format!("pod_name {input:?}: namespace {e}"))?;
    validate_dns_subdomain(pod).map_err(|e| format!("pod_name {input:?}: pod name {e}"))?;
    Ok((namespace.to_owned(), pod.to_owned()))
}

/// Splits `namespace/service` and checks both parts.
pub fn parse_service_name(input: &str) -> Result<(String, String), String> {
    let Some((namespace, service)) = input.split_once('/') else {
        return Err(format!(
            "service {input:?} must have the form <namespace>/<service>"
        ));
    };
    validate_dns_label(namespace).map_err(|e| format!("service {input:?}: namespace {e}"))?;
    validate_dns_label(service).map_err(|e| format!("service {input:?}: service name {e}"))?;
    Ok((namespace.to_owned(), service.to_owned()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn port_names() {
        for ok in ["debug", "jprofiler-port", "http2", "a"] {
            assert!(validate_port_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "jprofiler_tcp",
            "Debug",
            "-a",
            "a-",
            "a--b",
            "1234",
            "sixteen-chars-xx",
        ] {
            assert!(validate_port_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pod_names() {
        assert_eq!(
            parse_pod_name("default/web-0").unwrap(),
            ("default".into(), "web-0".into())
        );
        for bad in [
            "", "default", "/pod", "ns/", "NS/pod", "ns/Pod", "ns/a/b", "ns/a..b",
        ] {
            assert!(parse_pod_name(bad).is_err(), "{bad}");
        }
    }
}
