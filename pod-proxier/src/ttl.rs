//! Mapping deadlines: a PortMapping's `expiresAt` as milliseconds, and whether it has passed.

use k8s_openapi::jiff::Timestamp;

use crate::crd::PortMapping;

/// Milliseconds since the Unix epoch, now.
pub fn now_millis() -> i64 {
    Timestamp::now().as_millisecond()
}

/// RFC 3339 text of a millisecond timestamp.
pub fn format_millis(millis: i64) -> String {
    Timestamp::from_millisecond(millis)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "invalid".to_owned())
}

/// Milliseconds of an RFC 3339 timestamp.
pub fn parse_millis(text: &str) -> Option<i64> {
    text.parse::<Timestamp>().ok().map(|t| t.as_millisecond())
}

/// The expiry of a mapping, in milliseconds; `None` for mappings without TTL.
pub fn expiry_millis(mapping: &PortMapping) -> Option<i64> {
    mapping.spec.expires_at.as_deref().and_then(parse_millis)
}

/// Whether `mapping` has a TTL that has run out at `now`.
pub fn is_expired(mapping: &PortMapping, now: i64) -> bool {
    match (&mapping.spec.expires_at, expiry_millis(mapping)) {
        (None, _) => false,
        (Some(_), Some(deadline)) => deadline <= now,
        // An unreadable deadline counts as over: never forward forever by accident.
        (Some(_), None) => true,
    }
}
