//! A steady client: one request every [`PAUSE`], each bounded by [`REQUEST_LIMIT`], with the
//! moment it was sent and how it ended.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use crate::node::check;

/// The pause between two requests.
pub(super) const PAUSE: Duration = Duration::from_millis(50);
/// How long one request may take before it counts as failed (a request to a dead address hangs
/// until then).
pub(super) const REQUEST_LIMIT: Duration = Duration::from_secs(3);

/// Every request a stream sent: when, and why it failed (`None`: answered).
#[derive(Default)]
pub(super) struct Seen {
    pub(super) requests: Vec<(Instant, Option<String>)>,
}

impl Seen {
    /// The failed requests sent at or after `from`.
    pub(super) fn failures_since(&self, from: Instant) -> Vec<&(Instant, Option<String>)> {
        (self.requests.iter())
            .filter(|(at, failure)| *at >= from && failure.is_some())
            .collect()
    }

    /// The requests sent at or after `from` that were answered.
    pub(super) fn answered_since(&self, from: Instant) -> usize {
        (self.requests.iter())
            .filter(|(at, failure)| *at >= from && failure.is_none())
            .count()
    }

    /// Requests sent at or after `from`.
    pub(super) fn sent_since(&self, from: Instant) -> usize {
        self.requests.iter().filter(|(at, _)| *at >= from).count()
    }

    /// What failed from `lost_at` on, and the time from the loss to the start of the last failed
    /// request (the recovery time; zero when nothing failed).
    pub(super) fn tally_since(&self, lost_at: Instant) -> Tally {
        let failed = self.failures_since(lost_at);
        Tally {
            failed: failed.len(),
            sent: self.sent_since(lost_at),
            recovery: failed
                .last()
                .map_or(Duration::ZERO, |(at, _)| at.duration_since(lost_at)),
        }
    }

    /// [`Self::tally_since`] in one line, with the first failure's reason, and the last one's
    /// when there were more (a late failure's reason is what tells its cause).
    pub(super) fn describe_since(&self, lost_at: Instant) -> String {
        let tally = self.tally_since(lost_at);
        let failed = self.failures_since(lost_at);
        let why = |failure: Option<&&(Instant, Option<String>)>| {
            let (at, why) = failure?;
            Some((at.duration_since(lost_at), why.clone()?))
        };
        let reasons = match (
            why(failed.first()),
            why(failed.get(1..).and_then(<[_]>::last)),
        ) {
            (Some((_, first)), Some((at, last))) => format!(
                " (first: {first}; last, sent {:.1}s after the loss: {last})",
                at.as_secs_f64()
            ),
            (Some((_, first)), None) => format!(" (first: {first})"),
            _ => String::new(),
        };
        format!(
            "{} of {} requests from the loss on failed, recovered {:.1}s after the loss{reasons}",
            tally.failed,
            tally.sent,
            tally.recovery.as_secs_f64(),
        )
    }
}

/// One client's count from the loss on.
#[derive(Debug, Clone, Copy)]
pub struct Tally {
    /// Requests that failed.
    pub failed: usize,
    /// Requests sent.
    pub sent: usize,
    /// From the loss to the last failed request.
    pub recovery: Duration,
}

/// `GET path` through `addr` ([`check::http_get_on`]); a failure says how far the request got:
/// no connection (the way in, e.g. a Service's routing, lost the SYN) or connected from a given
/// port without a whole answer (what relays behind it hung). Bounded just under
/// [`REQUEST_LIMIT`], so the step is told before [`steady`] gives up on the request.
pub(super) async fn staged_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let limit = REQUEST_LIMIT.mul_f64(0.95);
    let deadline = tokio::time::Instant::now() + limit;
    let stream = tokio::time::timeout_at(deadline, TcpStream::connect(addr))
        .await
        .map_err(|_| format!("no connection to {addr} within {limit:?}"))?
        .map_err(|e| format!("connect: {e}"))?;
    let from = stream.local_addr().map_or(0, |local| local.port());
    tokio::time::timeout_at(deadline, check::http_get_on(stream, addr, path))
        .await
        .map_err(|_| format!("connected from port {from}, no whole answer within {limit:?}"))?
        .map_err(|why| format!("connected from port {from}, {why}"))
}

/// Runs `request` every [`PAUSE`] until `stop`; a request that errs or takes longer than
/// [`REQUEST_LIMIT`] is a failure.
pub(super) fn steady<F, Fut>(request: F, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Seen>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    tokio::spawn(async move {
        let mut seen = Seen::default();
        while !stop.load(Ordering::SeqCst) {
            let at = Instant::now();
            let failure = match tokio::time::timeout(REQUEST_LIMIT, request()).await {
                Ok(Ok(())) => None,
                Ok(Err(why)) => Some(why),
                Err(_) => Some(format!("no answer within {REQUEST_LIMIT:?}")),
            };
            seen.requests.push((at, failure));
            tokio::time::sleep(PAUSE).await;
        }
        seen
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_and_recovery_count_from_the_loss_on() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let seen = Seen {
            requests: vec![
                (at(0), Some("before".to_owned())),
                (at(100), None),
                (at(200), Some("dead".to_owned())),
                (at(1_200), Some("dead again".to_owned())),
                (at(1_300), None),
            ],
        };
        let lost_at = at(100);
        assert_eq!(seen.failures_since(lost_at).len(), 2);
        assert_eq!(seen.answered_since(lost_at), 2);
        assert_eq!(seen.sent_since(lost_at), 4);
        assert_eq!(
            seen.describe_since(lost_at),
            "2 of 4 requests from the loss on failed, recovered 1.1s after the loss (first: dead; last, sent 1.1s after the loss: dead again)"
        );
        let one = Seen {
            requests: vec![(at(200), Some("dead".to_owned()))],
        };
        assert_eq!(
            one.describe_since(lost_at),
            "1 of 1 requests from the loss on failed, recovered 0.1s after the loss (first: dead)"
        );
    }
}
