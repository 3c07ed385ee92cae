//! The node cut off from the API server for 30 s (nftables in the node's namespace drop every
//! packet between the node and the API server's port, as a broken link does):
//! - while pod-proxier serves mappings: the data plane keeps relaying what it already knows (new
//!   connections, and one connection held open through the V1 entry across the whole cut), the
//!   API says it cannot check credentials instead of hanging, and the API and kubelet's lease
//!   converge when the link returns. The Node's Ready condition is reported, not claimed: the
//!   cut is shorter than the node-monitor grace period, so it cannot turn NotReady;
//! - under steward, whose upstream is the API server itself (so there is nothing to relay during
//!   the cut): when the link returns, clients through `kubernetes.default` reach the API server
//!   through steward again and `default/kubernetes` still names the steward Pods.
//!
//! Restarts are counted by each chart's restart watch across its whole run: none may happen.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::api::Api;

use super::pod_proxier_api::{http_within, tcp_echo};
use super::{ChartReport, Env, url_port};
use crate::node::{NODE_NAME, check};

/// A scenario this module records (its chart lists it).
pub const POD_PROXIER_CUT: &str = "node cut off from the API server for 30 s (nftables in the node's namespace): V1 and V2 mappings keep relaying, a connection held open through the V1 entry echoes before, during and after the cut, the API answers 503 instead of hanging, and after the link returns the API and kubelet's lease converge";
/// A scenario this module records (its chart lists it).
pub const STEWARD_CUT: &str = "node cut off from the API server for 30 s (nftables in the node's namespace) under steward: when the link returns, clients through kubernetes.default reach the API server through steward again and default/kubernetes still names the steward Pods";
/// How long the link stays cut: more than the API's request timeout (10 s) and a token's cache
/// life (10 s), so the API must meet the cut; less than the node-monitor grace period (50 s),
/// so the Node's Ready condition is only observed.
pub(crate) const CUT: Duration = Duration::from_secs(30);
/// How often the data plane is tried during the cut.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(2);
/// How long the client waits for the API during the cut: its own request timeout (10 s) plus room.
const API_WAIT: Duration = Duration::from_secs(25);
/// After the link returns, how long kubelet and pod-proxier have to converge.
pub(crate) const CONVERGE_LIMIT: Duration = Duration::from_secs(60);

/// What pod-proxier serves when the link is cut.
pub struct Served<'a> {
    /// pod-proxier's API (its Service).
    pub api: SocketAddr,
    /// A token the API accepts for `GET /api/v1/mappings`.
    pub token: &'a str,
    /// A V1 mapping's entry port (its Service), relaying to a TCP echo.
    pub entry: SocketAddr,
    /// The V1 mapping's Pod (`namespace/name`), mapped again first so it outlives the cut.
    pub pod: String,
    /// A V2 mapping's entry port (its Service), relaying to the HTTP workload.
    pub v2: SocketAddr,
}

impl Served<'_> {
    /// The status of `GET /api/v1/mappings`, which needs the API server (token and access
    /// reviews); waits up to [`API_WAIT`].
    async fn list_mappings(&self) -> anyhow::Result<u16> {
        let get = http_within(
            self.api,
            "GET",
            "/api/v1/mappings",
            Some(self.token),
            None,
            API_WAIT,
        );
        Ok(get.await?.0)
    }
}

/// Cuts the link for `CUT` and records the scenario.
pub async fn pod_proxier(env: &Env<'_>, report: &mut ChartReport, served: &Served<'_>) {
    let started = Instant::now();
    let outcome = cut_and_converge(env, served).await;
    report.record(
        POD_PROXIER_CUT,
        outcome.as_ref().is_ok_and(|o| o.passed()),
        started,
        match outcome {
            Ok(outcome) => outcome.describe(),
            Err(e) => format!("{e:#}"),
        },
    );
}

#[derive(Debug, Default)]
struct Outcome {
    echoes: (usize, usize),
    /// Round trips on the connection held through the V1 entry during the cut: (ok, of), and
    /// the first failure.
    held_during: (usize, usize),
    held_error: Option<String>,
    /// Its round trip after the link returned.
    held_after: Option<Result<(), String>>,
    v2_answers: (usize, usize),
    /// The API's answer during the cut: status, and how long it took.
    api_during: Option<(u16, Duration)>,
    api_error: Option<String>,
    node_ready_during: bool,
    /// From the link's return to the first `200` of the API.
    api_back_after: Option<Duration>,
    /// From the link's return to kubelet renewing its lease.
    lease_back_after: Option<Duration>,
}

impl Outcome {
    fn passed(&self) -> bool {
        let all = |(ok, of): (usize, usize)| of > 0 && ok == of;
        all(self.echoes)
            && all(self.v2_answers)
            && all(self.held_during)
            && matches!(self.held_after, Some(Ok(())))
            && matches!(self.api_during, Some((503, took)) if took < API_WAIT)
            && self.api_back_after.is_some()
            && self.lease_back_after.is_some()
    }

    fn describe(&self) -> String {
        let api_during = match (&self.api_during, &self.api_error) {
            (Some((status, took)), _) => format!("{status} after {took:.1?}"),
            (None, Some(e)) => format!("no answer: {e}"),
            (None, None) => "not asked".to_owned(),
        };
        let after = |d: Option<Duration>| {
            d.map(|d| format!("{d:.1?}"))
                .unwrap_or_else(|| format!("not within {CONVERGE_LIMIT:?}"))
        };
        let held_after = match &self.held_after {
            Some(Ok(())) => "echoed".to_owned(),
            Some(Err(e)) => format!("failed: {e}"),
            None => "not tried".to_owned(),
        };
        format!(
            "during the cut: V1 echo {}/{}, held V1 connection {}/{} round trips{}, V2 answers {}/{}, API (GET /api/v1/mappings) {api_during}, Node Ready throughout (observed; the cut is shorter than the grace period): {}; after the link returned: held connection {held_after}, API 200 after {}, kubelet's lease renewed after {}",
            self.echoes.0,
            self.echoes.1,
            self.held_during.0,
            self.held_during.1,
            self.held_error
                .as_ref()
                .map(|e| format!(" (first failure: {e})"))
                .unwrap_or_default(),
            self.v2_answers.0,
            self.v2_answers.1,
            self.node_ready_during,
            after(self.api_back_after),
            after(self.lease_back_after),
        )
    }
}

async fn cut_and_converge(env: &Env<'_>, served: &Served<'_>) -> anyhow::Result<Outcome> {
    let node = env.plane.node().context("the control plane has no node")?;
    let port = url_port(env.plane.server_url())?;
    let client = env.plane.client().await?;
    let body = serde_json::json!({ "pod_name": served.pod, "time": 300 }).to_string();
    let (status, answer) = http_within(
        served.api,
        "POST",
        "/api/v1/mapping",
        Some(served.token),
        Some(&body),
        API_WAIT,
    )
    .await?;
    anyhow::ensure!(
        status == 200 && answer["data"]["extended"] == true,
        "extending the V1 mapping before the cut: {status} {answer}"
    );
    // One connection through the V1 entry to the Pod's echo, open from before the cut until
    // after it.
    let mut held = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(served.entry),
    )
    .await
    .context("connecting to the V1 entry before the cut: timed out")?
    .context("connecting to the V1 entry before the cut")?;
    round_trip(&mut held, 0)
        .await
        .map_err(|e| anyhow::anyhow!("the held connection before the cut: {e}"))?;
    node.cut_apiserver_link(port)?;
    let cut_at = Instant::now();
    // Whatever happens below, the link comes back.
    let during = during_cut(&client, served, &mut held, cut_at).await;
    let restored = node.restore_apiserver_link();
    let (returned_at, returned) = (Instant::now(), k8s_openapi::jiff::Timestamp::now());
    restored?;
    let mut outcome = during?;
    outcome.held_after = Some(round_trip(&mut held, usize::MAX).await);

    // Converged: the API checks credentials again, and kubelet renews its lease.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let deadline = returned_at + CONVERGE_LIMIT;
    while Instant::now() < deadline
        && (outcome.api_back_after.is_none() || outcome.lease_back_after.is_none())
    {
        if outcome.api_back_after.is_none()
            && let Ok(200) = served.list_mappings().await
        {
            outcome.api_back_after = Some(returned_at.elapsed());
        }
        if outcome.lease_back_after.is_none() {
            let renewed = leases
                .get(NODE_NAME)
                .await?
                .spec
                .and_then(|s| s.renew_time)
                .map(|t| t.0);
            // The API server shares this machine's clock.
            if renewed.is_some_and(|t| t > returned) {
                outcome.lease_back_after = Some(returned_at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(outcome)
}

/// The cut's [`CUT`]: the data plane probed every [`PROBE_EVERY`], the API asked once, the Node's
/// Ready condition read from the API server (which the host still reaches).
async fn during_cut(
    client: &kube::Client,
    served: &Served<'_>,
    held: &mut tokio::net::TcpStream,
    cut_at: Instant,
) -> anyhow::Result<Outcome> {
    let mut outcome = Outcome {
        node_ready_during: true,
        ..Outcome::default()
    };
    let api = async {
        // Past a cached token's life, so the API has to ask the API server.
        tokio::time::sleep(Duration::from_secs(11)).await;
        let asked = Instant::now();
        (served.list_mappings().await, asked.elapsed())
    };
    let probes = async {
        let nodes: Api<NodeObject> = Api::all(client.clone());
        let (mut echoes, mut answers, mut ready) = ((0, 0), (0, 0), true);
        let (mut held_ok, mut held_error) = ((0, 0), None);
        while cut_at.elapsed() < CUT {
            echoes.1 += 1;
            echoes.0 += usize::from(tcp_echo(served.entry, 4096).await.is_ok());
            held_ok.1 += 1;
            match round_trip(held, held_ok.1).await {
                Ok(()) => held_ok.0 += 1,
                Err(e) => {
                    held_error.get_or_insert(format!("{e} at {:.1?}", cut_at.elapsed()));
                }
            }
            answers.1 += 1;
            answers.0 += usize::from(check::http_get(served.v2, "/").await.is_ok());
            let node = nodes.get(NODE_NAME).await?;
            ready &= node
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            tokio::time::sleep(PROBE_EVERY).await;
        }
        anyhow::Ok((echoes, answers, ready, held_ok, held_error))
    };
    let ((answer, took), probed) = tokio::join!(api, probes);
    let (echoes, answers, ready, held_ok, held_error) = probed?;
    outcome.held_during = held_ok;
    outcome.held_error = held_error;
    outcome.echoes = echoes;
    outcome.v2_answers = answers;
    outcome.node_ready_during = ready;
    match answer {
        Ok(status) => outcome.api_during = Some((status, took)),
        Err(e) => outcome.api_error = Some(format!("{e:#} after {took:.1?}")),
    }
    Ok(outcome)
}

/// One echo round trip of a numbered line on the held connection, within 10 s.
async fn round_trip(stream: &mut tokio::net::TcpStream, n: usize) -> Result<(), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let line = format!("held connection, round trip {n}\n");
    let exchange = async {
        stream.write_all(line.as_bytes()).await?;
        let mut back = vec![0; line.len()];
        stream.read_exact(&mut back).await?;
        std::io::Result::Ok(back)
    };
    match tokio::time::timeout(Duration::from_secs(10), exchange).await {
        Err(_) => Err("no echo within 10 s".to_owned()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(back)) if back == line.as_bytes() => Ok(()),
        Ok(Ok(back)) => Err(format!("echoed {:?}", String::from_utf8_lossy(&back))),
    }
}
