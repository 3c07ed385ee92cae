//! What the steward integration tests share: the binary as a child process, the proxy Service
//! and the published `default/kubernetes` addresses.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use netkit_testenv::ControlPlane;

pub const BIN: &str = env!("CARGO_BIN_EXE_steward-tcp-proxy");

pub fn free_port() -> u16 {
    netkit_testenv::fixtures::free_port().unwrap()
}

pub fn apiserver_addr(plane: &ControlPlane) -> String {
    plane.server_url().trim_start_matches("https://").to_owned()
}

/// A steward-tcp-proxy child process, killed on drop.
pub struct Proxy {
    pub child: Child,
    pub listen: SocketAddr,
    pub health: SocketAddr,
    pub metrics: SocketAddr,
    pub log: PathBuf,
}

impl Proxy {
    pub fn start(kubeconfig: &Path, upstream: &str, extra: &[&str]) -> Self {
        Self::start_with(kubeconfig, upstream, extra, &[], None)
    }

    /// `env` is added to the child's environment; `listen`, when given, is the text of
    /// `--listen-addr`, `--health-addr` and `--metrics-addr` (the fields then hold their 127.0.0.1
    /// forms).
    pub fn start_with(
        kubeconfig: &Path,
        upstream: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        listen: Option<[&str; 3]>,
    ) -> Self {
        let [listen, health, metrics] = match listen {
            // "0" (a server turned off) has no port.
            Some(texts) => texts.map(|t| {
                let port = t
                    .rsplit_once(':')
                    .map_or(0, |(_, p)| p.parse::<u16>().unwrap());
                (t.to_owned(), SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            }),
            None => [(); 3].map(|()| {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
                (addr.to_string(), addr)
            }),
        };
        let log = tempfile::Builder::new()
            .prefix("steward-log-")
            .tempfile()
            .unwrap()
            .into_temp_path()
            .keep()
            .unwrap();
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--upstream-addr={upstream}"))
            .arg(format!("--listen-addr={}", listen.0))
            .arg(format!("--health-addr={}", health.0))
            .arg(format!("--metrics-addr={}", metrics.0))
            .args(extra)
            .env_remove("KUBECONFIG")
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env("RUST_LOG", "info")
            // These tests are not about who may scrape: plain HTTP to anyone (a test's flag or
            // env entry overrides it).
            .env("STEWARD_METRICS_SECURE", "false")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap();
        Self {
            child,
            listen: listen.1,
            health: health.1,
            metrics: metrics.1,
            log,
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn get(&self, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        let code = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
        Some((code, body))
    }

    pub async fn readyz(&self) -> Option<(u16, String)> {
        self.get(self.health, "/readyz").await
    }

    pub async fn metrics_text(&self) -> String {
        self.get(self.metrics, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default()
    }

    pub fn terminate(&self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Whether the exposition has exactly this sample line.
pub fn metric_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

pub async fn create_proxy_service(client: &kube::Client, ns: &str) -> Service {
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "proxy", "namespace": ns},
        "spec": {"ports": [{"name": "https", "port": 6443, "targetPort": 16443}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap()
}

/// The addresses and port of `default/kubernetes` as the slice says.
pub async fn published(client: &kube::Client) -> Option<(Vec<String>, i32)> {
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await
        .unwrap()?;
    let addresses = slice
        .endpoints
        .unwrap_or_default()
        .into_iter()
        .flat_map(|e| e.addresses)
        .collect();
    let port = slice.ports.unwrap_or_default().first()?.port?;
    Some((addresses, port))
}

/// An admin client whose server URL is the proxy.
pub async fn client_through(plane: &ControlPlane, proxy: SocketAddr) -> kube::Client {
    let text = std::fs::read_to_string(plane.kubeconfig_path()).unwrap();
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.cluster_url = format!("https://{proxy}").parse().unwrap();
    kube::Client::try_from(config).unwrap()
}

/// A test CA for the proxy's serving certificate.
pub struct Ca {
    pub issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pub pem: String,
}

impl Ca {
    pub fn new() -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "steward test CA");
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A serving certificate for 127.0.0.1 whose common name is `name`.
    pub fn leaf(&self, name: &str) -> (String, String) {
        self.leaf_for("127.0.0.1", name)
    }

    /// A serving certificate for `san` (a DNS name or an IP) whose common name is `name`.
    pub fn leaf_for(&self, san: &str, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![san.to_owned()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// The plane every test but the fight shares: no built-in endpoint reconciler.
static PLANE: tokio::sync::OnceCell<ControlPlane> = tokio::sync::OnceCell::const_new();
/// Tests that write `default/kubernetes` take turns.
pub static KUBERNETES_ENDPOINTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub async fn plane() -> &'static ControlPlane {
    PLANE
        .get_or_init(|| async {
            ControlPlane::builder()
                .apiserver_arg("--endpoint-reconciler-type=none")
                .start()
                .await
                .unwrap()
        })
        .await
}

/// The name of the next object added on a watch (bookmarks are skipped).
pub async fn next_added(
    events: &mut (
             impl futures::Stream<
        Item = Result<kube::api::WatchEvent<k8s_openapi::api::core::v1::ConfigMap>, kube::Error>,
    > + Unpin
         ),
    timeout: std::time::Duration,
) -> String {
    tokio::time::timeout(timeout, async {
        loop {
            match futures::TryStreamExt::try_next(events)
                .await
                .unwrap()
                .expect("the watch stays open")
            {
                kube::api::WatchEvent::Added(cm) => return kube::ResourceExt::name_any(&cm),
                kube::api::WatchEvent::Bookmark(_) => continue,
                other => panic!("unexpected watch event {other:?}"),
            }
        }
    })
    .await
    .expect("an ADDED event in time")
}
