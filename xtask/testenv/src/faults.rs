//! Faults a chaos test injects: the API server or etcd stopped, killed, frozen or restarted,
//! and etcd compacted.

use super::*;

/// POSTs a JSON body to etcd's gRPC gateway and parses the JSON answer.
async fn etcd_post(
    etcd_url: &str,
    path: &str,
    body: &str,
) -> Result<serde_json::Value, TestingError> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let io = |context: String| move |cause| TestingError::Io { context, cause };
    let authority = etcd_url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(io(format!("connecting to etcd at {authority}")))?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(io(format!("POST {path} to etcd")))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .map_err(io(format!("reading etcd's answer to {path}")))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, json) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    if !head.starts_with("HTTP/1.1 200") {
        return Err(TestingError::Start(format!(
            "etcd {path}: {}",
            head.lines().next().unwrap_or_default()
        )));
    }
    serde_json::from_str(json)
        .map_err(|e| TestingError::Start(format!("etcd {path}: not JSON ({e}): {json}")))
}

impl ControlPlane {
    /// Stops kube-apiserver with SIGTERM (as a rolling upgrade does), keeps it down for `down`,
    /// starts it again with the same flags, port and etcd, and waits until it is ready. Watches
    /// and connections of clients break; what they do about it is what a chaos test looks at.
    pub async fn restart_apiserver(&self, down: Duration) -> Result<(), TestingError> {
        self.stop_apiserver().await?;
        tokio::time::sleep(down).await;
        self.start_apiserver().await
    }

    /// Stops kube-apiserver with SIGTERM and waits until it has exited (see
    /// [`ControlPlane::start_apiserver`]).
    pub async fn stop_apiserver(&self) -> Result<(), TestingError> {
        self.stop_process("kube-apiserver", rustix::process::Signal::TERM)
            .await
    }

    /// Kills kube-apiserver with SIGKILL, as a crash or an OOM kill does: no graceful end of
    /// in-flight responses, the kernel closes its sockets mid-stream. Start it again with
    /// [`ControlPlane::start_apiserver`].
    pub async fn kill_apiserver(&self) -> Result<(), TestingError> {
        self.stop_process("kube-apiserver", rustix::process::Signal::KILL)
            .await
    }

    /// Starts kube-apiserver again after [`ControlPlane::stop_apiserver`] and waits until it
    /// is ready.
    pub async fn start_apiserver(&self) -> Result<(), TestingError> {
        self.respawn("kube-apiserver")?;
        self.wait_ready(START_TIMEOUT).await
    }

    /// Freezes kube-apiserver with SIGSTOP, as a hung server (a stalled disk, a stopped VM)
    /// behaves: its sockets stay open and accept connections, nothing answers and no watch ends
    /// with an error. Clients notice only by their own timeouts. [`ControlPlane::resume_apiserver`]
    /// thaws it; a dropped control plane kills it frozen or not.
    pub async fn pause_apiserver(&self) -> Result<(), TestingError> {
        self.with_process("kube-apiserver", |p| {
            p.signal(rustix::process::Signal::STOP);
            Ok(())
        })
    }

    /// Thaws kube-apiserver after [`ControlPlane::pause_apiserver`] (SIGCONT) and waits until
    /// it answers as ready again.
    pub async fn resume_apiserver(&self) -> Result<(), TestingError> {
        self.with_process("kube-apiserver", |p| {
            p.signal(rustix::process::Signal::CONT);
            Ok(())
        })?;
        self.wait_ready(START_TIMEOUT).await
    }

    /// Stops etcd with SIGTERM, keeps it down for `down` (the API server answers errors
    /// meanwhile), starts it again on the same data and waits until it answers (and the API
    /// server is ready, unless it is stopped).
    pub async fn restart_etcd(&self, down: Duration) -> Result<(), TestingError> {
        self.stop_process("etcd", rustix::process::Signal::TERM)
            .await?;
        tokio::time::sleep(down).await;
        self.respawn("etcd")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(err) = etcd_post(&self.etcd_url, "/v3/kv/range", r#"{"key":"AA=="}"#).await {
            if Instant::now() > deadline {
                return Err(err);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if self.with_process("kube-apiserver", |p| Ok(p.exited().is_none()))? {
            self.wait_ready(START_TIMEOUT).await?;
        }
        Ok(())
    }

    /// Writes a key of its own to etcd (so the revision passes everything any client has
    /// seen), then compacts etcd's history up to that revision and returns it. A watch that
    /// resumes from an older resourceVersion then gets `410 Gone` and must list again. Do it
    /// while the API server is stopped, or its bookmarks may tell clients the new revision.
    pub async fn compact_etcd(&self) -> Result<i64, TestingError> {
        // etcd's JSON gateway: keys and values are base64.
        let put = r#"{"key":"L2t1YmUtbmV0a2l0L2NoYW9z","value":"Y29tcGFjdA=="}"#;
        let written = etcd_post(&self.etcd_url, "/v3/kv/put", put).await?;
        let revision = written["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse::<i64>().ok())
            .ok_or_else(|| TestingError::Start(format!("etcd put: no revision in {written}")))?;
        let body = serde_json::json!({ "revision": revision.to_string(), "physical": true });
        etcd_post(&self.etcd_url, "/v3/kv/compaction", &body.to_string()).await?;
        Ok(revision)
    }

    async fn stop_process(
        &self,
        name: &str,
        signal: rustix::process::Signal,
    ) -> Result<(), TestingError> {
        self.with_process(name, |p| {
            p.signal(signal);
            Ok(())
        })?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.with_process(name, |p| Ok(p.exited().is_some()))? {
            if Instant::now() > deadline {
                return self.with_process(name, |p| {
                    p.stop();
                    Ok(())
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Starts a stopped server again, under a guardian of its own.
    fn respawn(&self, name: &str) -> Result<(), TestingError> {
        let pid = self.with_process(name, |p| {
            p.respawn()?;
            Ok(p.pid())
        })?;
        let guardian = Guardian::watch(&self.dir, &[pid])?;
        if let Ok(mut guardians) = self.guardians.lock() {
            guardians.push(guardian);
        }
        Ok(())
    }

    fn with_process<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut ServerProcess) -> Result<T, TestingError>,
    ) -> Result<T, TestingError> {
        let mut processes = self
            .processes
            .lock()
            .map_err(|_| TestingError::Start("the process list is poisoned".to_owned()))?;
        let process = processes
            .iter_mut()
            .find(|p| p.name == name)
            .ok_or_else(|| TestingError::Start(format!("no {name} in this control plane")))?;
        f(process)
    }

    /// The process ids of etcd and kube-apiserver, in start order.
    pub fn pids(&self) -> Vec<u32> {
        self.processes
            .lock()
            .map(|p| p.iter().map(ServerProcess::pid).collect())
            .unwrap_or_default()
    }
}
