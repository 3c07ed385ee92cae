//! The transport options of an RstreamConnection that reach the agent: which ones it cannot
//! honour, and the HTTP proxy it dials through. The manager checks a connection with them (its
//! `Ready` and its tunnels' `Accepted` name what is refused); the agent checks its file with the
//! same functions before it connects.

use std::collections::BTreeMap;

use rstream_client::HttpProxy;

use crate::api::{BindMode, BindSpec, DnsSpec, IpFamily, TransportMode};

/// The transport options the agent cannot honour, each as `transport.<field>: why`. The manager
/// refuses a connection using any of them (its `Ready` and its tunnels' `Accepted` name them);
/// the agent refuses to start with them rather than ignore them.
pub fn unsupported_transport(
    mode: Option<TransportMode>,
    use_quic: Option<bool>,
    bind: Option<&BindSpec>,
    ip_family: Option<IpFamily>,
    dns: Option<&DnsSpec>,
    mptcp: Option<bool>,
) -> Vec<String> {
    let mut refused = Vec::new();
    let set = |v: &Option<String>| v.as_deref().is_some_and(|v| !v.trim().is_empty());
    if mode == Some(TransportMode::Quic) {
        refused.push("transport.mode: quic is not supported (QUIC transport is out of scope); use auto or tls".to_owned());
    }
    if use_quic == Some(true) {
        refused.push(
            "transport.useQuic: QUIC transport is not supported; remove it or set it to false"
                .to_owned(),
        );
    }
    if let Some(bind) = bind {
        if bind.mode == Some(BindMode::Interface) || set(&bind.interface) {
            refused.push("transport.bind.interface: binding engine connections to an interface is not supported".to_owned());
        }
        if let Some(address) = bind
            .address
            .as_deref()
            .map(str::trim)
            .filter(|a| !a.is_empty())
        {
            match address.parse::<std::net::IpAddr>() {
                Err(_) => refused.push(format!(
                    "transport.bind.address: '{address}' is not an IP address"
                )),
                Ok(ip)
                    if matches!(
                        (ip_family, ip.is_ipv4()),
                        (Some(IpFamily::Ipv4), false) | (Some(IpFamily::Ipv6), true)
                    ) =>
                {
                    refused.push(format!(
                        "transport.bind.address: '{address}' is not of the family transport.ipFamily asks for"
                    ));
                }
                Ok(_) => {}
            }
        }
    }
    if let Some(dns) = dns {
        if set(&dns.override_) {
            refused.push("transport.dns.override: a DNS server override is not supported (the system resolver is used)".to_owned());
        }
        if dns.tls == Some(true) {
            refused.push("transport.dns.tls: DNS over TLS is not supported".to_owned());
        }
        if dns.dnssec == Some(true) {
            refused.push("transport.dns.dnssec: DNSSEC validation is not supported".to_owned());
        }
    }
    if mptcp == Some(true) {
        refused.push("transport.mptcp: Multipath TCP is not supported".to_owned());
    }
    refused
}

/// The HTTP proxy of `transport.proxy`: its URL, credentials (either replaces the URL's) and
/// extra headers. Errors name the field.
pub fn http_proxy(
    url: Option<&str>,
    username: Option<&str>,
    password: Option<&str>,
    headers: Option<&BTreeMap<String, String>>,
) -> Result<HttpProxy, String> {
    let url = url
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .ok_or_else(|| "transport.proxy.http: the proxy URL is required".to_owned())?;
    let mut proxy: HttpProxy = url
        .parse()
        .map_err(|e| format!("transport.proxy.http: {e}"))?;
    if username.is_some() || password.is_some() {
        let user = username.unwrap_or_default();
        if user.is_empty() {
            return Err("transport.proxy.passwordSecretRef needs usernameSecretRef too".to_owned());
        }
        proxy = proxy.with_basic_auth(user, password.unwrap_or_default());
    }
    for (name, value) in headers.into_iter().flatten() {
        proxy = proxy
            .with_header(name, value)
            .map_err(|e| format!("transport.proxy.headers: {e}"))?;
    }
    Ok(proxy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn honoured_transport_values_are_not_refused() {
        let dns = DnsSpec {
            server_name: Some("dns.example.io".into()),
            tls: Some(false),
            dnssec: Some(false),
            ..DnsSpec::default()
        };
        let bind = BindSpec {
            mode: Some(BindMode::Address),
            ..BindSpec::default()
        };
        let refused = unsupported_transport(
            Some(TransportMode::Tls),
            Some(false),
            Some(&bind),
            Some(IpFamily::Auto),
            Some(&dns),
            Some(false),
        );
        assert!(refused.is_empty(), "{refused:?}");
        let refused = unsupported_transport(
            Some(TransportMode::Quic),
            Some(true),
            None,
            None,
            None,
            Some(true),
        );
        assert_eq!(refused.len(), 3, "{refused:?}");
        // bind.address and ipFamily are honoured when they agree.
        let bind = |a: &str| BindSpec {
            address: Some(a.into()),
            ..BindSpec::default()
        };
        for (address, family, ok) in [
            ("10.0.0.7", Some(IpFamily::Ipv4), true),
            ("fd00::7", Some(IpFamily::Ipv6), true),
            ("fd00::7", None, true),
            ("fd00::7", Some(IpFamily::Ipv4), false),
            ("eth0", None, false),
        ] {
            let refused =
                unsupported_transport(None, None, Some(&bind(address)), family, None, None);
            assert_eq!(refused.is_empty(), ok, "{address} {family:?}: {refused:?}");
        }
    }

    #[test]
    fn proxy_settings_are_checked_and_named() {
        let proxy = http_proxy(
            Some("http://p.internal:3128"),
            Some("alice"),
            Some("pw"),
            None,
        )
        .unwrap();
        assert!(proxy.has_credentials());
        assert_eq!(proxy.to_string(), "http://p.internal:3128");
        for (url, user, password, field) in [
            (None, None, None, "transport.proxy.http"),
            (Some("socks5://p:1080"), None, None, "transport.proxy.http"),
            (Some("http://p:3128"), None, Some("pw"), "usernameSecretRef"),
        ] {
            let err = http_proxy(url, user, password, None).unwrap_err();
            assert!(err.contains(field), "{err}");
        }
        let headers = BTreeMap::from([("Bad Name".to_owned(), "v".to_owned())]);
        let err = http_proxy(Some("http://p:3128"), None, None, Some(&headers)).unwrap_err();
        assert!(err.contains("transport.proxy.headers"), "{err}");
    }
}
