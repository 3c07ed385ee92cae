//! A mapping's life after it is made: restored by a restart, refused after its deadline.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::e2e::pod_proxier_api::http;

/// One mapping as the API lists it: (name, entry port, remaining seconds; V2 has none).
type Listed = (String, i64, Option<i64>);

/// Every mapping the caller sees, V1 and V2; an answer without a list, or a mapping without a
/// name or entry port, is an error (never an empty list).
pub(super) async fn mappings(api: SocketAddr, token: &str) -> anyhow::Result<Vec<Listed>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for path in ["/api/v1/mappings", "/api/v2/mappings"] {
        let answer = loop {
            let got = http(api, "GET", path, Some(token), None).await;
            if let Ok((200, answer)) = got {
                break answer;
            }
            if Instant::now() > deadline {
                bail!("GET {path}: {got:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let list = answer["data"]
            .as_array()
            .with_context(|| format!("GET {path}: no list in {answer}"))?;
        for m in list {
            out.push((
                m["name"]
                    .as_str()
                    .with_context(|| format!("GET {path}: a mapping without a name: {m}"))?
                    .to_owned(),
                m["entry_port"]
                    .as_i64()
                    .with_context(|| format!("GET {path}: a mapping without an entry port: {m}"))?,
                m["remaining_seconds"].as_i64(),
            ));
        }
    }
    out.sort();
    Ok(out)
}

/// Whether `after` (listed `elapsed` after `before`) restored every `expected` (name, entry
/// port): each is in both lists with that port, and a V1 mapping's remaining time did not grow
/// nor drop by more than the time that passed (2 s of rounding allowed); a V2 mapping has none.
pub(super) fn judge_restore(
    expected: &[(String, i64)],
    before: &[Listed],
    after: &[Listed],
    elapsed: Duration,
) -> Result<String, String> {
    if expected.is_empty() {
        return Err("nothing expected: the scenario made no mapping".to_owned());
    }
    let passed = i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX);
    let mut kept = Vec::new();
    for (name, port) in expected {
        let find = |list: &[Listed]| list.iter().find(|(n, _, _)| n == name).cloned();
        let Some((_, port_before, ttl_before)) = find(before) else {
            return Err(format!("{name} was not listed before the restart"));
        };
        let Some((_, port_after, ttl_after)) = find(after) else {
            return Err(format!("{name} is missing after the restart"));
        };
        if port_before != *port || port_after != *port {
            return Err(format!(
                "{name}: entry port {port} expected, {port_before} before and {port_after} after"
            ));
        }
        match (ttl_before, ttl_after) {
            (None, None) => kept.push(format!("{name} on {port}")),
            (Some(b), Some(a)) if a <= b && a + passed + 2 >= b => {
                kept.push(format!(
                    "{name} on {port}, {b} s left -> {a} s after {passed} s"
                ));
            }
            (b, a) => {
                return Err(format!(
                    "{name}: remaining time {b:?} s before, {a:?} s after, {passed} s later"
                ));
            }
        }
    }
    Ok(format!("restored: {}", kept.join("; ")))
}

/// How the entry port met one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    /// A short echo went through intact.
    Answered,
    /// The connection was refused: nothing listens on the port.
    Refused,
    /// The connection was accepted and closed before any byte came back: how pod-proxier's
    /// embedded data plane refuses on a port it keeps (the V1 entry port) with no route.
    Closed,
    /// Anything else (a timeout, a reset, bytes lost): proves neither.
    Other(String),
}

impl Probe {
    /// Refused either way: nothing forwards the port.
    fn refusal(&self) -> bool {
        matches!(self, Self::Refused | Self::Closed)
    }
}

/// One probe, its start and end measured from the moment the mapping was requested.
#[derive(Debug, Clone)]
struct Probed {
    started: Duration,
    ended: Duration,
    outcome: Probe,
}

/// A mapping's TTL in the expiry scenario: long enough that a busy machine probes the port
/// before the deadline.
const EXPIRY_TTL: Duration = Duration::from_secs(10);
/// How long after its deadline the entry port must refuse connections: generous, so a busy
/// machine never fails it; the lateness is reported.
const EXPIRY_BOUND: Duration = Duration::from_secs(10);
/// Refusals in a row, and for how long, that prove the port closed (not a blip).
const REFUSALS: usize = 3;
const REFUSED_FOR: Duration = Duration::from_millis(500);

/// Maps `pod` for [`EXPIRY_TTL`] and probes the entry port until it has refused for a while
/// (bounded); returns what [`judge_expiry`] says.
pub(super) async fn expiry(
    api: SocketAddr,
    entry: SocketAddr,
    token: &str,
    pod: &str,
) -> anyhow::Result<String> {
    let body = json!({ "pod_name": pod, "time": EXPIRY_TTL.as_secs() }).to_string();
    let sent = Instant::now();
    let (status, answer) = http(api, "POST", "/api/v1/mapping", Some(token), Some(&body)).await?;
    let received = sent.elapsed();
    if status != 200 {
        bail!("POST {status}: {answer}");
    }
    let data = &answer["data"];
    let ttl = data["ttl_seconds"].as_u64();
    let remaining = data["remaining_seconds"].as_i64();
    if ttl != Some(EXPIRY_TTL.as_secs())
        || remaining.is_none_or(|r| r < 1 || r > ttl.map_or(0, |t| t.cast_signed()))
        || data["expires_at"].as_str().is_none()
    {
        bail!(
            "the answer does not confirm a {EXPIRY_TTL:?} mapping (ttl_seconds, remaining_seconds, expires_at): {answer}"
        );
    }
    // The server set the deadline to its clock plus the TTL while handling the request.
    let window = (EXPIRY_TTL, received + EXPIRY_TTL);
    let stop_by = window.1 + EXPIRY_BOUND + Duration::from_secs(5);
    let mut probes: Vec<Probed> = Vec::new();
    while sent.elapsed() < stop_by {
        let started = sent.elapsed();
        let outcome = probe(entry).await;
        probes.push(Probed {
            started,
            ended: sent.elapsed(),
            outcome,
        });
        let refused: Vec<&Probed> = probes
            .iter()
            .rev()
            .take_while(|p| p.outcome.refusal())
            .collect();
        if refused.len() >= REFUSALS
            && refused[0]
                .started
                .saturating_sub(refused[refused.len() - 1].started)
                >= REFUSED_FOR
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    judge_expiry(window, &probes).map_err(|e| anyhow::anyhow!("{e}"))
}

/// One connection to `addr`: a 16-byte echo, a refusal (refused, or closed before any byte came
/// back), or something else.
async fn probe(addr: SocketAddr) -> Probe {
    use std::io::ErrorKind;
    let stream =
        match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
        {
            Err(_) => return Probe::Other("connect timed out after 2 s".to_owned()),
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => return Probe::Refused,
            Ok(Err(e)) => return Probe::Other(format!("connect: {e}")),
            Ok(Ok(stream)) => stream,
        };
    let data: Vec<u8> = (0..16u8).collect();
    let exchange = async {
        let (mut read, mut write) = stream.into_split();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            write.write_all(&sent).await?;
            write.shutdown().await
        });
        let mut back = Vec::new();
        let read = read.read_to_end(&mut back).await;
        (read, back, writer.await)
    };
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
        )
    };
    match tokio::time::timeout(Duration::from_secs(2), exchange).await {
        Err(_) => Probe::Other("no echo within 2 s".to_owned()),
        Ok((Ok(_), back, Ok(Ok(())))) if back == data => Probe::Answered,
        // Closed before a single byte came back.
        Ok((Ok(_), back, _)) if back.is_empty() => Probe::Closed,
        Ok((Err(e), back, _)) if back.is_empty() && closed(&e) => Probe::Closed,
        Ok((read, back, written)) => Probe::Other(format!(
            "{} of 16 bytes back ({read:?}, write {written:?})",
            back.len()
        )),
    }
}

/// Whether `probes` prove the expiry: the port answered in a probe that ended before the
/// earliest possible deadline (`window.0`), and no probe that ended before it was refused (an
/// early expiry); then it refused, the first refusal no later than [`EXPIRY_BOUND`] after the
/// latest possible deadline (`window.1`), and every later probe was refused ([`REFUSALS`] at
/// least, over [`REFUSED_FOR`]); a refusal is [`Probe::Refused`] or [`Probe::Closed`]. A
/// timeout or a lost byte counts as neither answer nor refusal.
fn judge_expiry(window: (Duration, Duration), probes: &[Probed]) -> Result<String, String> {
    let secs = |d: Duration| format!("{:.2}s", d.as_secs_f64());
    let others: Vec<&Probed> = probes
        .iter()
        .filter(|p| matches!(p.outcome, Probe::Other(_)))
        .collect();
    let others_note = match others.first() {
        Some(Probed {
            started,
            outcome: Probe::Other(why),
            ..
        }) => format!(
            "; {} probes neither answered nor refused (first at {}: {why})",
            others.len(),
            secs(*started)
        ),
        _ => String::new(),
    };
    let last_answer = probes
        .iter()
        .filter(|p| p.outcome == Probe::Answered && p.ended <= window.0)
        .map(|p| p.started)
        .max();
    let Some(last_answer) = last_answer else {
        return Err(format!(
            "the entry port never answered before the deadline ({} to {}){others_note}",
            secs(window.0),
            secs(window.1)
        ));
    };
    if let Some(early) = probes
        .iter()
        .find(|p| p.outcome.refusal() && p.ended < window.0)
    {
        return Err(format!(
            "the entry port refused at {} to {}, before the deadline {}: an early expiry{others_note}",
            secs(early.started),
            secs(early.ended),
            secs(window.0)
        ));
    }
    let Some(first) = probes.iter().position(|p| p.outcome.refusal()) else {
        return Err(format!(
            "the entry port was never refused (deadline {} to {}, probed until {}){others_note}",
            secs(window.0),
            secs(window.1),
            secs(probes.last().map_or(Duration::ZERO, |p| p.ended))
        ));
    };
    let refused_at = probes[first].started;
    if probes[first].ended > window.1 + EXPIRY_BOUND {
        return Err(format!(
            "the entry port first refused at {}, {} after the latest deadline {} (bound {EXPIRY_BOUND:?}){others_note}",
            secs(probes[first].ended),
            secs(probes[first].ended - window.1),
            secs(window.1)
        ));
    }
    let rest = &probes[first..];
    if let Some(p) = rest.iter().find(|p| !p.outcome.refusal()) {
        return Err(format!(
            "refused at {}, then {:?} at {}{others_note}",
            secs(refused_at),
            p.outcome,
            secs(p.started)
        ));
    }
    let span = rest.last().map_or(Duration::ZERO, |p| p.started) - refused_at;
    if rest.len() < REFUSALS || span < REFUSED_FOR {
        return Err(format!(
            "only {} refusals over {} after {} (want {REFUSALS} over {REFUSED_FOR:?}){others_note}",
            rest.len(),
            secs(span),
            secs(refused_at)
        ));
    }
    Ok(format!(
        "deadline {} to {} after the POST; {} answers, the last at {}; refused from {}, {} after the latest deadline ({} refusals over {}: {} refused, {} closed before any byte){others_note}",
        secs(window.0),
        secs(window.1),
        probes
            .iter()
            .filter(|p| p.outcome == Probe::Answered)
            .count(),
        secs(last_answer),
        secs(refused_at),
        secs(refused_at.saturating_sub(window.1)),
        rest.len(),
        secs(span),
        rest.iter().filter(|p| p.outcome == Probe::Refused).count(),
        rest.iter().filter(|p| p.outcome == Probe::Closed).count()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Probes every 100 ms from 0 to `until_ms`: answered before `closes_ms`, refused after.
    fn probes(closes_ms: u64, until_ms: u64) -> Vec<Probed> {
        (0..until_ms / 100)
            .map(|i| Probed {
                started: ms(i * 100),
                ended: ms(i * 100 + 20),
                outcome: if i * 100 < closes_ms {
                    Probe::Answered
                } else {
                    Probe::Refused
                },
            })
            .collect()
    }

    const WINDOW: (Duration, Duration) = (Duration::from_secs(3), Duration::from_millis(3050));

    #[test]
    fn expiry_on_time_passes() {
        let verdict = judge_expiry(WINDOW, &probes(3_200, 4_000));
        assert!(verdict.is_ok(), "{verdict:?}");
    }

    #[test]
    fn no_expiry_fails() {
        let verdict = judge_expiry(WINDOW, &probes(u64::MAX, 9_000));
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("never refused")),
            "{verdict:?}"
        );
    }

    #[test]
    fn a_failed_echo_is_not_a_refusal() {
        // The old check took any failed echo for "closed": here a timeout at 0.5 s, and no
        // expiry at all.
        let mut p = probes(u64::MAX, 9_000);
        p[5].outcome = Probe::Other("connect timed out after 2 s".to_owned());
        let verdict = judge_expiry(WINDOW, &p);
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("never refused") && e.contains("timed out")),
            "{verdict:?}"
        );
    }

    #[test]
    fn refusing_before_the_deadline_fails() {
        let verdict = judge_expiry(WINDOW, &probes(1_000, 4_000));
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("early expiry")),
            "{verdict:?}"
        );
        // A refusal in a probe that started before the deadline and ended after it is not
        // early: the port may have closed at the deadline, within the probe.
        let mut p = probes(3_000, 4_000);
        p[29].ended = ms(3_010);
        p[29].outcome = Probe::Refused;
        let verdict = judge_expiry(WINDOW, &p);
        assert!(verdict.is_ok(), "{verdict:?}");
        // The port that never answered proves nothing either (a wrong port).
        let verdict = judge_expiry(WINDOW, &probes(0, 4_000));
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("never answered")),
            "{verdict:?}"
        );
    }

    #[test]
    fn closed_before_any_byte_is_a_refusal_but_a_partial_echo_is_not() {
        let mut p = probes(3_200, 4_000);
        for probe in p.iter_mut().filter(|p| p.outcome == Probe::Refused) {
            probe.outcome = Probe::Closed;
        }
        let verdict = judge_expiry(WINDOW, &p);
        assert!(verdict.is_ok(), "{verdict:?}");
        for probe in p.iter_mut().filter(|p| p.outcome == Probe::Closed) {
            probe.outcome = Probe::Other("8 of 16 bytes back".to_owned());
        }
        let verdict = judge_expiry(WINDOW, &p);
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("never refused")),
            "{verdict:?}"
        );
    }

    #[test]
    fn refusing_late_or_flapping_fails() {
        // 10.45 s after the latest deadline: more than the generous bound.
        let verdict = judge_expiry(WINDOW, &probes(13_500, 15_000));
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("after the latest deadline")),
            "{verdict:?}"
        );
        // 1.25 s late passes: a busy machine is not a failure.
        let verdict = judge_expiry(WINDOW, &probes(4_300, 6_000));
        assert!(verdict.is_ok(), "{verdict:?}");
        let mut p = probes(3_200, 4_000);
        p[35].outcome = Probe::Answered;
        assert!(judge_expiry(WINDOW, &p).is_err());
        // One refusal and nothing after it does not prove the port closed.
        assert!(judge_expiry(WINDOW, &probes(3_200, 3_400)).is_err());
    }

    fn listed(name: &str, port: i64, ttl: Option<i64>) -> Listed {
        (name.to_owned(), port, ttl)
    }

    #[test]
    fn restore_requires_each_mapping_by_name_and_port() {
        let expected = [
            ("v1-entry-8849".to_owned(), 8849),
            ("v2-web".to_owned(), 9000),
        ];
        let before = [
            listed("v1-entry-8849", 8849, Some(100)),
            listed("v2-web", 9000, None),
        ];
        let after = [
            listed("v1-entry-8849", 8849, Some(95)),
            listed("v2-web", 9000, None),
        ];
        let verdict = judge_restore(&expected, &before, &after, Duration::from_secs(5));
        assert!(verdict.is_ok(), "{verdict:?}");
        // Nothing restored: the old `all` over an empty list passed here.
        assert!(judge_restore(&expected, &before, &[], Duration::from_secs(5)).is_err());
        assert!(judge_restore(&expected, &[], &[], Duration::from_secs(5)).is_err());
        assert!(judge_restore(&[], &before, &after, Duration::from_secs(5)).is_err());
        // Another port, a TTL started afresh, or one that lost more than the time passed.
        let moved = [
            listed("v1-entry-8849", 8849, Some(95)),
            listed("v2-web", 9001, None),
        ];
        assert!(judge_restore(&expected, &before, &moved, Duration::from_secs(5)).is_err());
        let reset = [
            listed("v1-entry-8849", 8849, Some(120)),
            listed("v2-web", 9000, None),
        ];
        assert!(judge_restore(&expected, &before, &reset, Duration::from_secs(5)).is_err());
        let lost = [
            listed("v1-entry-8849", 8849, Some(50)),
            listed("v2-web", 9000, None),
        ];
        assert!(judge_restore(&expected, &before, &lost, Duration::from_secs(5)).is_err());
    }
}
