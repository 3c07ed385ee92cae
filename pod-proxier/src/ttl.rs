//! Mapping deadlines: [`Deadline`], the one form a TTL takes once a request is read, from the
//! PortMapping's `expiresAt` to the forwarding timer, the leader's sweep and the API's answers.

use std::fmt;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Milliseconds since the Unix epoch, now (the clock of the V2 port quarantine).
pub fn now_millis() -> i64 {
    Timestamp::now().as_millisecond()
}

/// When a mapping ends, at millisecond precision. Written in `expiresAt` as RFC 3339 in UTC
/// (`2026-01-02T03:04:05.678Z`), the text the API answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Timestamp);

impl Deadline {
    /// `ttl` after `now` (the latest representable time, if that is later still).
    pub fn after(now: Timestamp, ttl: Duration) -> Self {
        Self::truncated(now.checked_add(ttl).unwrap_or(Timestamp::MAX))
    }

    /// `time` without its sub-millisecond part.
    fn truncated(time: Timestamp) -> Self {
        Self(Timestamp::from_millisecond(time.as_millisecond()).unwrap_or(time))
    }

    /// Whether the deadline has come at `now`: a mapping ends at its deadline.
    pub fn has_passed(self, now: Timestamp) -> bool {
        self.0 <= now
    }

    /// The time left at `now`, zero once passed.
    pub fn remaining(self, now: Timestamp) -> Duration {
        let millis = self.0.as_millisecond() - now.as_millisecond();
        Duration::from_millis(u64::try_from(millis).unwrap_or(0))
    }

    /// The whole seconds left at `now`, rounded up; zero once passed.
    pub fn remaining_seconds(self, now: Timestamp) -> i64 {
        ((self.0.as_millisecond() - now.as_millisecond()).max(0) + 999) / 1000
    }
}

impl fmt::Display for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for Deadline {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Deadline {
    /// Parses RFC 3339. The CRD's schema (a plain string, kept so existing objects stay valid)
    /// lets a hand-edited object hold anything: such a deadline is logged and counts as passed,
    /// so the mapping never forwards forever by accident, and one bad object does not stop the
    /// whole list of PortMappings from being read.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        match text.parse::<Timestamp>() {
            Ok(time) => Ok(Self::truncated(time)),
            Err(err) => {
                tracing::error!(expires_at = %text, error = %err, "a PortMapping's expiresAt is not an RFC 3339 time: the mapping counts as expired");
                Ok(Self(Timestamp::UNIX_EPOCH))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn deadlines_keep_the_text_of_expires_at() {
        let now = Timestamp::from_millisecond(1_700_000_000_000).unwrap();
        let deadline = Deadline::after(now, Duration::from_millis(60_123));
        assert_eq!(deadline.to_string(), "2023-11-14T22:14:20.123Z");
        let json = serde_json::to_string(&deadline).unwrap();
        assert_eq!(json, r#""2023-11-14T22:14:20.123Z""#);
        assert_eq!(serde_json::from_str::<Deadline>(&json).unwrap(), deadline);
        assert_eq!(deadline.remaining_seconds(now), 61);
        assert_eq!(deadline.remaining(now), Duration::from_millis(60_123));
        assert!(!deadline.has_passed(now));
        let at_deadline = Timestamp::from_millisecond(1_700_000_060_123).unwrap();
        assert!(deadline.has_passed(at_deadline));
        assert_eq!(deadline.remaining(at_deadline), Duration::ZERO);
        // Sub-millisecond digits are dropped, as the millisecond form always did.
        let precise: Deadline = serde_json::from_str(r#""2023-11-14T22:14:20.123456Z""#).unwrap();
        assert_eq!(precise, deadline);
    }

    #[test]
    fn an_unreadable_deadline_counts_as_passed() {
        let deadline: Deadline = serde_json::from_str(r#""next tuesday""#).unwrap();
        assert!(deadline.has_passed(Timestamp::UNIX_EPOCH));
    }
}
