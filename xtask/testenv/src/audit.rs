//! The API server's audit log: the policy a control plane starts with, the events read back, and
//! the barrier that makes a read see every request made before it.

use super::*;

pub(super) const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"#;

/// One request as the API server's audit log recorded it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct AuditEvent {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, ...
    pub verb: String,
    /// The request path and query.
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    /// Who made it.
    pub user: AuditUser,
    /// The object, when the request names one.
    #[serde(default)]
    pub object_ref: Option<AuditObjectRef>,
    /// The response code.
    #[serde(default)]
    pub response_status: Option<AuditStatus>,
    /// The client's User-Agent.
    #[serde(default)]
    pub user_agent: Option<String>,
    /// The addresses the request came from.
    #[serde(default, rename = "sourceIPs")]
    pub source_ips: Vec<String>,
}

impl AuditEvent {
    /// Whether the verb changes state (`create`, `update`, `patch`, `delete`, `deletecollection`).
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }
}

/// The user of an [`AuditEvent`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[non_exhaustive]
pub struct AuditUser {
    /// The user name, e.g. `system:serviceaccount:ns:name`.
    #[serde(default)]
    pub username: String,
}

/// The object of an [`AuditEvent`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct AuditObjectRef {
    /// The resource (plural), e.g. `endpointslices`.
    #[serde(default)]
    pub resource: String,
    /// The namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The name.
    #[serde(default)]
    pub name: Option<String>,
    /// The subresource, e.g. `status`.
    #[serde(default)]
    pub subresource: Option<String>,
}

/// The response status of an [`AuditEvent`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[non_exhaustive]
pub struct AuditStatus {
    /// The HTTP status code.
    #[serde(default)]
    pub code: u16,
}

impl ControlPlane {
    /// Every request the API server has handled so far, from its audit log (oldest first).
    pub fn audit_events(&self) -> Result<Vec<AuditEvent>, TestingError> {
        let path = self.dir.join("audit.log");
        let text = std::fs::read_to_string(&path).map_err(|source| TestingError::Io {
            context: format!("reading {}", path.display()),
            cause: source,
        })?;
        Ok(text
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect())
    }

    /// The state-changing requests made by `username` so far.
    ///
    /// The API server logs a request after answering it, so this first waits until a marker request
    /// made now appears in the log: every request answered before the call is then logged too.
    pub async fn writes_by(&self, username: &str) -> Result<Vec<AuditEvent>, TestingError> {
        self.audit_barrier().await?;
        Ok(self
            .audit_events()?
            .into_iter()
            .filter(|e| e.user.username == username && e.is_write())
            .collect())
    }

    /// Every request made by `username` so far, after the same wait as [`Self::writes_by`].
    pub async fn requests_by(&self, username: &str) -> Result<Vec<AuditEvent>, TestingError> {
        self.audit_barrier().await?;
        Ok(self
            .audit_events()?
            .into_iter()
            .filter(|e| e.user.username == username)
            .collect())
    }

    async fn audit_barrier(&self) -> Result<(), TestingError> {
        let n = self.namespaces.fetch_add(1, Ordering::Relaxed);
        let marker = format!("audit-barrier-{n}");
        let api: Api<ServiceAccount> = Api::namespaced(self.client().await?, "default");
        // A 404 is fine: the request is logged all the same.
        let _ = api.get_opt(&marker).await;
        // Generous: the audit log is written in batches, later on a busy machine.
        const AUDIT_WAIT: Duration = Duration::from_secs(60);
        let deadline = Instant::now() + AUDIT_WAIT;
        loop {
            let logged = self.audit_events()?.iter().any(|e| {
                e.object_ref
                    .as_ref()
                    .is_some_and(|o| o.name.as_deref() == Some(marker.as_str()))
            });
            if logged {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(TestingError::Timeout(
                    AUDIT_WAIT,
                    "the audit log to catch up".to_owned(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
