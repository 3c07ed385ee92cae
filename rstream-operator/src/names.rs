//! Names and labels of the objects created per tunnel, as the original operator derives them (so an
//! upgrade adopts the existing children instead of creating a second set).

use std::collections::BTreeMap;

/// Finalizer on every RstreamTunnel.
pub const FINALIZER: &str = "tunnels.rstream.io/finalizer";
/// Pod-template annotation whose change restarts the agent.
pub const CONFIG_HASH_ANNOTATION: &str = "rstream.io/config-hash";
/// Value of `app.kubernetes.io/managed-by` on every child.
pub const MANAGED_BY: &str = "rstream-operator";
/// Key of the agent configuration in its ConfigMap.
pub const CONFIG_KEY: &str = "config.yaml";
/// Where the agent ConfigMap is mounted.
pub const CONFIG_DIR: &str = "/etc/rstream-agent";
/// Where the mTLS material is mounted.
pub const MTLS_DIR: &str = "/var/run/rstream/mtls";
/// Where the engine CA of `spec.caSecretRef` is mounted (as `ca.crt`).
pub const ENGINE_CA_DIR: &str = "/var/run/rstream/engine-ca";
/// Env var holding the token.
pub const TOKEN_ENV: &str = "RSTREAM_AUTHENTICATION_TOKEN";
/// Env var holding the agent pod's name.
pub const POD_NAME_ENV: &str = "RSTREAM_AGENT_POD_NAME";
/// Env var holding the agent pod's namespace.
pub const POD_NAMESPACE_ENV: &str = "RSTREAM_AGENT_POD_NAMESPACE";
/// Env var holding the proxy user name.
pub const PROXY_USERNAME_ENV: &str = "RSTREAM_PROXY_USERNAME";
/// Env var holding the proxy password.
pub const PROXY_PASSWORD_ENV: &str = "RSTREAM_PROXY_PASSWORD";

/// A DNS label: trimmed, lowercase, every run of other characters turned into one `-`, no `-` at
/// either end, `rstream` when nothing is left.
pub fn dns_label(input: &str) -> String {
    let mut out = String::with_capacity(input.len());
    let mut dash = false;
    for c in input.trim().chars().flat_map(char::to_lowercase) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            if dash && !out.is_empty() {
                out.push('-');
            }
            dash = false;
            out.push(c);
        } else {
            dash = true;
        }
    }
    if out.is_empty() {
        "rstream".to_owned()
    } else {
        out
    }
}

/// FNV-1a 32-bit.
pub fn fnv32a(input: &str) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for b in input.bytes() {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// Base name of a tunnel's children: `rstream-<tunnel>` as a DNS label, `-`, and the FNV-32a of the
/// tunnel UID (or `<ns>/<name>` without one) as 8 hex digits; at most 63 characters.
pub fn base_name(namespace: &str, name: &str, uid: Option<&str>) -> String {
    let seed = match uid {
        Some(uid) if !uid.is_empty() => uid.to_owned(),
        _ => format!("{namespace}/{name}"),
    };
    let suffix = format!("{:08x}", fnv32a(&seed));
    let mut label = dns_label(&format!("rstream-{name}"));
    if label.len() + 1 + suffix.len() > 63 {
        label.truncate(54);
        while label.ends_with('-') {
            label.pop();
        }
    }
    format!("{label}-{suffix}")
}

/// Default rstream tunnel name: DNS label of `<namespace>-<name>`.
pub fn default_tunnel_name(namespace: &str, name: &str) -> String {
    dns_label(&format!("{namespace}-{name}"))
}

/// The labels of every child; `component` is `config`, `agent-rbac` or `agent`.
pub fn child_labels(
    base: &str,
    component: &str,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), MANAGED_BY.to_owned()),
        ("app.kubernetes.io/instance".to_owned(), base.to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            component.to_owned(),
        ),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
        ("app.kubernetes.io/part-of".to_owned(), "rstream".to_owned()),
        ("rstream.io/tunnel-name".to_owned(), name.to_owned()),
        (
            "rstream.io/tunnel-namespace".to_owned(),
            namespace.to_owned(),
        ),
    ]);
    if let Some(uid) = uid.filter(|u| !u.is_empty()) {
        labels.insert("rstream.io/tunnel-uid".to_owned(), uid.to_owned());
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        assert_eq!(dns_label("  Demo__Web.1 "), "demo-web-1");
        assert_eq!(dns_label("--a--"), "a");
        assert_eq!(dns_label("!!!"), "rstream");
        assert_eq!(default_tunnel_name("demo", "web"), "demo-web");
    }

    #[test]
    fn fnv_matches_the_reference_vectors() {
        assert_eq!(fnv32a(""), 0x811c_9dc5);
        assert_eq!(fnv32a("a"), 0xe40c_292c);
        assert_eq!(fnv32a("foobar"), 0xbf9c_f968);
    }

    #[test]
    fn base_names_are_stable_and_short() {
        let a = base_name("demo", "web", Some("uid-1"));
        assert_eq!(a, format!("rstream-web-{:08x}", fnv32a("uid-1")));
        assert_eq!(
            base_name("demo", "web", None),
            format!("rstream-web-{:08x}", fnv32a("demo/web"))
        );
        let long = base_name("demo", &"x".repeat(80), Some("u"));
        assert!(long.len() <= 63, "{long}");
        assert!(long.starts_with("rstream-xxx"));
        // A cut that ends on a dash loses the dash.
        let dashed = base_name(
            "demo",
            &format!("{}-{}", "a".repeat(45), "b".repeat(30)),
            None,
        );
        assert!(!dashed.contains("--"), "{dashed}");
        assert!(dashed.len() <= 63);
    }
}
