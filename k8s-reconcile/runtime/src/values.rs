//! Flag values every binary takes: Go durations and booleans (the original programs' flag
//! syntax), listen addresses in Go's `:8080` form, and Kubernetes names.
//!
//! Each parser returns a [`ValueError`] whose message names the value and says what is wrong, so
//! it works as a clap `value_parser` as it is.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// A flag or configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValueError {
    /// Not a Go duration, or one that makes no sense here.
    #[error("{input:?} is not a usable duration: {reason}")]
    Duration {
        /// The value as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Not a listen address.
    #[error("{input:?} is not an address like :8080, 0.0.0.0:8080 or [::]:8080")]
    ListenAddress {
        /// The value as given.
        input: String,
    },
    /// Not one of the boolean spellings Go's `strconv.ParseBool` takes.
    #[error(
        "{input:?} is not a boolean: use true or false (also 1, 0, t, f, T, F, TRUE, FALSE, True, False)"
    )]
    Bool {
        /// The value as given.
        input: String,
    },
    /// Not a log filter in tracing's `EnvFilter` syntax.
    #[error(
        "{input:?} is not a log level or filter (e.g. info, debug, warn,my_crate=debug): {reason}"
    )]
    LogFilter {
        /// The value as given.
        input: String,
        /// What the filter parser said.
        reason: String,
    },
    /// Not a DNS-1123 label or subdomain. The message is only the rule, as callers name the
    /// value in their own words ("namespace \"x\": ...").
    #[error("{reason}")]
    DnsName {
        /// The name as given.
        name: String,
        /// The rule it breaks.
        reason: String,
    },
    /// Not a qualified name (a label key, an annotation key, a load balancer class).
    #[error("{name:?} is not a qualified name ([prefix/]name): {reason}")]
    QualifiedName {
        /// The name as given.
        name: String,
        /// The rule it breaks.
        reason: String,
    },
}

fn duration_error(input: &str, reason: impl Into<String>) -> ValueError {
    ValueError::Duration {
        input: input.to_owned(),
        reason: reason.into(),
    }
}

/// Parses a Go `time.ParseDuration` string (`30s`, `1m30s`, `1.5h`, `250ms`, `10µs`, `+5s`, `0`).
/// Negative durations are refused: no value here means anything by them.
pub fn parse_duration(input: &str) -> Result<Duration, ValueError> {
    let text = input.trim();
    if text.is_empty() {
        return Err(duration_error(input, "empty"));
    }
    if text.starts_with('-') {
        return Err(duration_error(input, "negative"));
    }
    // Go accepts a leading `+`.
    let text = text.strip_prefix('+').unwrap_or(text);
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = text;
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number == "." {
            return Err(duration_error(input, "expected a number"));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| duration_error(input, format!("{number:?} is not a number")))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let seconds_per_unit = match unit {
            "ns" => 1e-9,
            // Go takes the micro sign (U+00B5) and the Greek mu (U+03BC).
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(duration_error(input, "missing unit (ns, us, ms, s, m, h)")),
            other => return Err(duration_error(input, format!("unknown unit {other:?}"))),
        };
        total += value * seconds_per_unit;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|_| duration_error(input, "out of range"))
}

/// [`parse_duration`], refusing zero.
pub fn parse_positive_duration(input: &str) -> Result<Duration, ValueError> {
    match parse_duration(input)? {
        d if d.is_zero() => Err(duration_error(input, "must be longer than zero")),
        d => Ok(d),
    }
}

/// The value of a duration flag that used to take a bare number of seconds: a Go duration now,
/// with the old form still accepted so existing command lines and manifests keep working.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SecondsOrDuration {
    /// The duration given.
    pub duration: Duration,
    /// Whether it was given in the old form, a bare number of seconds.
    pub bare_seconds: bool,
}

impl SecondsOrDuration {
    /// The warning to log when the old form was used: `flag` takes Go durations now.
    pub fn deprecation(&self, flag: &str) -> Option<String> {
        self.bare_seconds.then(|| {
            let seconds = self.duration.as_secs();
            format!(
                "{flag} {seconds}: a bare number of seconds is deprecated, write {seconds}s \
                 (a Go duration)"
            )
        })
    }
}

/// Parses a Go duration ([`parse_duration`]) or, for flags that once took seconds, a bare
/// whole number of seconds (deprecated: see [`SecondsOrDuration::deprecation`]).
pub fn parse_seconds_or_duration(input: &str) -> Result<SecondsOrDuration, ValueError> {
    let text = input.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        let seconds: u64 = text
            .parse()
            .map_err(|_| duration_error(input, "out of range"))?;
        return Ok(SecondsOrDuration {
            duration: Duration::from_secs(seconds),
            bare_seconds: text != "0",
        });
    }
    Ok(SecondsOrDuration {
        duration: parse_duration(input)?,
        bare_seconds: false,
    })
}

/// Parses a boolean as Go's `strconv.ParseBool` does: `1`, `t`, `T`, `TRUE`, `true`, `True`,
/// `0`, `f`, `F`, `FALSE`, `false`, `False`. Nothing else, not even surrounding spaces.
pub fn parse_go_bool(input: &str) -> Result<bool, ValueError> {
    match input {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(ValueError::Bool {
            input: input.to_owned(),
        }),
    }
}

/// `host:port`, `[v6]:port`, or `:port`, which like Go's `:8080` means every interface of both
/// families: it parses to `[::]:port`, and binding `[::]` is dual-stack (see
/// `proxy_core::socket::bind_listener`, which also falls back to `0.0.0.0` on hosts without
/// IPv6). `0.0.0.0:port` stays IPv4 only.
pub fn parse_listen_addr(input: &str) -> Result<SocketAddr, ValueError> {
    let text = input.trim();
    let refused = || ValueError::ListenAddress {
        input: input.to_owned(),
    };
    if let Some(port) = text.strip_prefix(':') {
        let port: u16 = port.parse().map_err(|_| refused())?;
        return Ok(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port));
    }
    text.parse().map_err(|_| refused())
}

/// What [`parse_optional_listen_addr`] returns: a listen address, or `None` for off. A type
/// alias, so a clap field of this type takes `0` as a value (clap treats a field spelled
/// `Option<...>` as a flag that may be absent instead).
pub type OptionalListenAddr = Option<SocketAddr>;

/// [`parse_listen_addr`], where `0` or an empty value turns the listener off (`None`), as
/// controller-runtime's bind-address flags do.
pub fn parse_optional_listen_addr(input: &str) -> Result<OptionalListenAddr, ValueError> {
    match input.trim() {
        "" | "0" => Ok(None),
        _ => parse_listen_addr(input).map(Some),
    }
}

fn dns_error(name: &str, reason: impl Into<String>) -> ValueError {
    ValueError::DnsName {
        name: name.to_owned(),
        reason: reason.into(),
    }
}

fn label_chars_ok(label: &str) -> bool {
    label
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A DNS-1123 label: namespaces, Service names.
pub fn validate_dns_label(name: &str) -> Result<(), ValueError> {
    if name.is_empty() {
        return Err(dns_error(name, "must not be empty"));
    }
    if name.len() > 63 {
        return Err(dns_error(
            name,
            format!("must be at most 63 characters (has {})", name.len()),
        ));
    }
    if !label_chars_ok(name) {
        return Err(dns_error(
            name,
            "may contain only lowercase letters, digits and '-'",
        ));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(dns_error(name, "must start and end with a letter or digit"));
    }
    Ok(())
}

/// A qualified name as the API server checks label keys, annotation keys and load balancer
/// classes: an optional DNS-1123 subdomain prefix and `/`, then a name of at most 63 letters,
/// digits, `-`, `_` or `.` that starts and ends with a letter or digit. `prefix_required` (a
/// `loadBalancerClass`) refuses one without a prefix.
pub fn validate_qualified_name(name: &str, prefix_required: bool) -> Result<(), ValueError> {
    let error = |reason: String| ValueError::QualifiedName {
        name: name.to_owned(),
        reason,
    };
    let short = match name.split_once('/') {
        Some((prefix, short)) => {
            validate_dns_subdomain(prefix).map_err(|e| error(format!("its prefix {e}")))?;
            short
        }
        None if prefix_required => {
            return Err(error("needs a DNS prefix, e.g. example.com/".into()));
        }
        None => name,
    };
    if !is_qualified_name_part(short) {
        return Err(error(
            "the name must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit".into(),
        ));
    }
    Ok(())
}

/// The name part of a qualified name, which is also the rule for a label value (when not empty).
pub fn is_qualified_name_part(name: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(ok)
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// A DNS-1123 subdomain: Pod names.
pub fn validate_dns_subdomain(name: &str) -> Result<(), ValueError> {
    if name.is_empty() {
        return Err(dns_error(name, "must not be empty"));
    }
    if name.len() > 253 {
        return Err(dns_error(
            name,
            format!("must be at most 253 characters (has {})", name.len()),
        ));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(dns_error(
                name,
                "must not contain empty dot-separated parts",
            ));
        }
        if !label_chars_ok(label) {
            return Err(dns_error(
                name,
                "may contain only lowercase letters, digits, '-' and '.'",
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(dns_error(
                name,
                "each dot-separated part must start and end with a letter or digit",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_or_duration_takes_both_and_flags_the_old_form() {
        let go = parse_seconds_or_duration("90s").unwrap();
        assert_eq!(go.duration, Duration::from_secs(90));
        assert_eq!(go.deprecation("--drain-timeout"), None);
        let bare = parse_seconds_or_duration("30").unwrap();
        assert_eq!(bare.duration, Duration::from_secs(30));
        let warning = bare.deprecation("--drain-timeout").unwrap();
        assert!(warning.contains("write 30s"), "{warning}");
        // Zero needs no unit in Go either.
        assert!(!parse_seconds_or_duration("0").unwrap().bare_seconds);
        for bad in ["", "1.5", "-3", "3x", "99999999999999999999999"] {
            assert!(parse_seconds_or_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn durations_in_go_syntax() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(
            parse_duration("2h45m0.5s"),
            Ok(Duration::from_millis(9_900_500))
        );
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("+0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("+5s"), Ok(Duration::from_secs(5)));
        for micro in ["10us", "10µs", "10μs"] {
            assert_eq!(
                parse_duration(micro),
                Ok(Duration::from_micros(10)),
                "{micro}"
            );
        }
    }

    #[test]
    fn durations_go_refuses_and_negatives_are_refused() {
        for bad in [
            "",
            "30",
            "5",
            "s",
            "1x",
            "3d",
            "-5s",
            "1..2s",
            "1e3s",
            "ten seconds",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse_positive_duration("0s").is_err());
        assert_eq!(parse_positive_duration("1s"), Ok(Duration::from_secs(1)));
    }

    #[test]
    fn listen_addresses() {
        // Go's `:8080`: every interface of both families.
        assert_eq!(
            parse_listen_addr(":8080"),
            Ok(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 8080)))
        );
        assert_eq!(
            parse_listen_addr("0.0.0.0:8080"),
            Ok(SocketAddr::from(([0, 0, 0, 0], 8080)))
        );
        assert_eq!(
            parse_listen_addr("127.0.0.1:9"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 9)))
        );
        assert!(parse_listen_addr("[::]:6443").is_ok_and(|a| a.is_ipv6()));
        for bad in ["nope", ":x", "0", "1.2.3.4"] {
            assert!(parse_listen_addr(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_optional_listen_addr("0"), Ok(None));
        assert_eq!(parse_optional_listen_addr(""), Ok(None));
        assert_eq!(
            parse_optional_listen_addr(":1"),
            Ok(Some(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 1))))
        );
    }

    #[test]
    fn booleans_in_go_syntax() {
        for yes in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_go_bool(yes), Ok(true), "{yes}");
        }
        for no in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_go_bool(no), Ok(false), "{no}");
        }
        for bad in ["", "maybe", "yes", "no", "on", "tRUE", " true", "2"] {
            assert!(parse_go_bool(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(
            parse_go_bool("maybe").map_err(|e| e.to_string()),
            Err("\"maybe\" is not a boolean: use true or false (also 1, 0, t, f, T, F, TRUE, FALSE, True, False)".to_owned())
        );
    }

    #[test]
    fn dns_names() {
        for ok in ["a", "kube-system", &"a".repeat(63)] {
            assert!(validate_dns_label(ok).is_ok(), "{ok}");
        }
        for bad in ["", "A", "a_b", "-a", "a-", "a.b", &"a".repeat(64)] {
            assert!(validate_dns_label(bad).is_err(), "{bad}");
        }
        assert!(validate_dns_subdomain("web-0.example").is_ok());
        for bad in ["", "a..b", "a.-b", "Pod"] {
            assert!(validate_dns_subdomain(bad).is_err(), "{bad}");
        }
        let message = validate_dns_label("Bad_Name").map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err("may contain only lowercase letters, digits and '-'".to_owned())
        );
    }

    #[test]
    fn qualified_names() {
        for ok in [
            "app",
            "app.kubernetes.io/name",
            "example.com/Edge_1.x",
            &"a".repeat(63),
        ] {
            assert!(validate_qualified_name(ok, false).is_ok(), "{ok}");
        }
        assert!(validate_qualified_name("tunnels.rstream.io/rstream", true).is_ok());
        for bad in [
            "",
            "/a",
            "a/",
            "-a",
            "a-",
            "a b",
            "Example.com/a",
            "a..b/c",
            &"a".repeat(64),
        ] {
            assert!(validate_qualified_name(bad, false).is_err(), "{bad}");
        }
        let message = validate_qualified_name("rstream", true).map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err("\"rstream\" is not a qualified name ([prefix/]name): needs a DNS prefix, e.g. example.com/".to_owned())
        );
        assert!(is_qualified_name_part("v1.2_x") && !is_qualified_name_part("_x"));
    }
}
