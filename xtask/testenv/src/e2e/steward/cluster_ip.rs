//! `endpointMode=cluster-ip`: what a client through `kubernetes.default` reaches, and its verdict.

use crate::node;

/// What the `endpointMode=cluster-ip` scenario saw.
#[derive(Debug)]
pub(super) struct ClusterIpRun {
    /// `default/kubernetes` held steward's ClusterIP (or why not).
    pub(super) published: Result<(), String>,
    /// The in-cluster client's log, or how its Job failed.
    pub(super) client: Result<String, String>,
    /// A TCP connect from the host to `10.96.0.1:443` ([`tcp_connect`]).
    pub(super) host_tcp: String,
    /// steward's `proxy_connections_total` before and after both clients.
    pub(super) conns: (f64, f64),
}

/// The expected outcome of `endpointMode=cluster-ip`, today: steward publishes its ClusterIP and
/// kube-proxy does not route a ClusterIP used as an endpoint, so the in-cluster client is still
/// waiting when its Job's deadline ends it, the host's connect does not connect, and no
/// connection reaches steward. Any other outcome fails, naming what changed (kube-proxy now
/// routing it is news: steward's README and this expectation must change with it).
pub(super) fn cluster_ip_verdict(run: &ClusterIpRun) -> Result<String, String> {
    if let Err(e) = &run.published {
        return Err(format!("steward did not publish its ClusterIP: {e}"));
    }
    let routed = |what: &str| {
        format!(
            "kube-proxy ROUTES a ClusterIP used as an endpoint ({what}): not what steward's README says"
        )
    };
    if run.host_tcp == "connected" {
        return Err(routed("the host's TCP connect to 10.96.0.1:443 connected"));
    }
    if run.conns.1 > run.conns.0 {
        return Err(routed(&format!(
            "steward counted {} new connections",
            run.conns.1 - run.conns.0
        )));
    }
    match &run.client {
        Ok(log) if log.contains("kube result=ok") => {
            Err(routed("the in-cluster client listed namespaces"))
        }
        Ok(log) => Err(format!(
            "the in-cluster client's Job completed without a result: {log}"
        )),
        // Still waiting for its connection when the Job's deadline ended it: not routed.
        Err(e) if e.contains("(DeadlineExceeded)") => Ok(format!(
            "as expected: not routed (the in-cluster client was still connecting at its Job's deadline, the host's connect: {}, no connection reached steward)",
            run.host_tcp
        )),
        // Failed on its own: only a connection error of its own proves the same.
        Err(e) if e.contains("kube: API server") && e.contains("listing namespaces") => {
            Ok(format!(
                "as expected: not routed (the in-cluster client failed to connect, the host's connect: {}, no connection reached steward)",
                run.host_tcp
            ))
        }
        Err(e) => Err(format!(
            "the in-cluster client failed, but not by waiting for a connection: {e}"
        )),
    }
}

/// kube-proxy's NAT rules for `default/kubernetes` in the node's network namespace, for a
/// failure report.
pub(super) fn kubernetes_nat_rules() -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", node::NETNS, "iptables-save", "-t", "nat"])
        .output();
    match out {
        Ok(out) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("default/kubernetes"))
            .collect::<Vec<_>>()
            .join(" | "),
        Err(err) => format!("iptables-save: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_routed() -> ClusterIpRun {
        ClusterIpRun {
            published: Ok(()),
            client: Err(
                "Job lister-cluster-ip failed (DeadlineExceeded): Job lister-cluster-ip has no Pod"
                    .to_owned(),
            ),
            host_tcp: "timed out after 2 s".to_owned(),
            conns: (0.0, 0.0),
        }
    }

    #[test]
    fn cluster_ip_passes_only_on_the_expected_outcome() {
        let verdict = cluster_ip_verdict(&not_routed());
        assert!(verdict.is_ok(), "{verdict:?}");
        // The client failing by itself while trying to connect proves the same.
        let mut run = not_routed();
        run.client = Err("Job x failed (BackoffLimitExceeded): its log: kube: API server https://10.96.0.1:443\nError: listing namespaces: ... connect timed out".to_owned());
        assert!(cluster_ip_verdict(&run).is_ok());
    }

    #[test]
    fn cluster_ip_fails_when_anything_routes_or_proves_nothing() {
        // Publishing alone passed the old check.
        let mut run = not_routed();
        run.published = Err("default/kubernetes not as cluster-ip says".to_owned());
        assert!(cluster_ip_verdict(&run).is_err());
        // kube-proxy routing it, seen by any of the three.
        let mut run = not_routed();
        run.host_tcp = "connected".to_owned();
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        let mut run = not_routed();
        run.conns = (4.0, 5.0);
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        let mut run = not_routed();
        run.client = Ok("namespace default\nkube result=ok namespaces=9 events=0".to_owned());
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        // A client that failed for another reason (no image, RBAC) proves nothing about routing.
        let mut run = not_routed();
        run.client = Err(
            "Job x failed (BackoffLimitExceeded): its log: Error: in-cluster config".to_owned(),
        );
        assert!(cluster_ip_verdict(&run).is_err());
    }
}
