//! Who a test acts as: [`Identity`], kubeconfig files and clients for each.

use super::*;

/// Who a client or kubeconfig acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Identity {
    /// `admin` in `system:masters`: bypasses RBAC.
    Admin,
    /// A user authenticated by a client certificate (CN = name, O = group).
    User {
        /// The user name.
        name: String,
        /// An optional group.
        group: Option<String>,
    },
    /// A ServiceAccount authenticated by a real token from the TokenRequest API, so it has exactly
    /// the groups a pod's token would have (`system:serviceaccounts`, `system:serviceaccounts:<ns>`).
    /// The ServiceAccount is created if it does not exist.
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

impl Identity {
    /// A user with no group.
    pub fn user(name: impl Into<String>) -> Self {
        Self::User {
            name: name.into(),
            group: None,
        }
    }

    /// A ServiceAccount.
    pub fn service_account(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self::ServiceAccount {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn file_stem(&self) -> String {
        let raw = match self {
            Self::Admin => "admin".to_owned(),
            Self::User { name, .. } => format!("user-{name}"),
            Self::ServiceAccount { namespace, name } => format!("sa-{namespace}-{name}"),
        };
        raw.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
}

/// Builds a client from kubeconfig text (JSON or YAML).
async fn client_from_kubeconfig(text: &str) -> Result<Client, TestingError> {
    let kubeconfig = Kubeconfig::from_yaml(text).map_err(|e| TestingError::Client(e.into()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| TestingError::Client(e.into()))?;
    Client::try_from(config).map_err(|e| TestingError::Client(e.into()))
}

impl ControlPlane {
    /// A kubeconfig for the admin user, for kubectl and for child processes.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// An admin client (`system:masters`).
    pub async fn client(&self) -> Result<Client, TestingError> {
        client_from_kubeconfig(&self.admin_kubeconfig_text()?).await
    }

    /// A client acting as `identity`; a ServiceAccount is created if missing and gets a fresh token.
    pub async fn client_as(&self, identity: &Identity) -> Result<Client, TestingError> {
        let text = self.kubeconfig_text(identity).await?;
        client_from_kubeconfig(&text).await
    }

    /// Writes a kubeconfig acting as `identity` into [`Self::dir`] and returns its path.
    pub async fn kubeconfig_as(&self, identity: &Identity) -> Result<PathBuf, TestingError> {
        let text = self.kubeconfig_text(identity).await?;
        let path = self
            .dir
            .join(format!("kubeconfig-{}.yaml", identity.file_stem()));
        std::fs::write(&path, text).map_err(|source| TestingError::Io {
            context: format!("writing {}", path.display()),
            cause: source,
        })?;
        Ok(path)
    }

    async fn kubeconfig_text(&self, identity: &Identity) -> Result<String, TestingError> {
        let user = match identity {
            Identity::Admin => return self.admin_kubeconfig_text(),
            Identity::User { name, group } => {
                self.cert_user(&self.pki.client_cert(name, group.as_deref())?)
            }
            Identity::ServiceAccount { namespace, name } => {
                let token = self.service_account_token(namespace, name).await?;
                serde_json::json!({ "token": token })
            }
        };
        Ok(self.kubeconfig_json(user).to_string())
    }

    /// Writes `<dir>/<user>.kubeconfig` with a client certificate for `user` in `group`.
    pub(super) fn write_cert_kubeconfig(
        &self,
        dir: &Path,
        user: &str,
        group: Option<&str>,
    ) -> Result<PathBuf, TestingError> {
        let pair = self.pki.client_cert(user, group)?;
        let text = self.kubeconfig_json(self.cert_user(&pair)).to_string();
        let path = dir.join(format!("{}.kubeconfig", user.replace(':', "-")));
        std::fs::write(&path, text).map_err(|source| TestingError::Io {
            context: format!("writing {}", path.display()),
            cause: source,
        })?;
        Ok(path)
    }

    pub(super) fn admin_kubeconfig_text(&self) -> Result<String, TestingError> {
        let admin = self.pki.client_cert("admin", Some("system:masters"))?;
        Ok(self.kubeconfig_json(self.cert_user(&admin)).to_string())
    }

    async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<String, TestingError> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client().await?, namespace);
        let mut sa = ServiceAccount::default();
        sa.metadata.name = Some(name.to_owned());
        match api.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(source) => {
                return Err(TestingError::Kube {
                    context: format!("creating ServiceAccount {namespace}/{name}"),
                    cause: source,
                });
            }
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(24 * 3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let token = api
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(|source| TestingError::Kube {
                context: format!("requesting a token for ServiceAccount {namespace}/{name}"),
                cause: source,
            })?;
        token
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| TestingError::Config("TokenRequest returned no token".to_owned()))
    }

    fn cert_user(&self, pair: &PemPair) -> serde_json::Value {
        serde_json::json!({
            "client-certificate-data": BASE64.encode(&pair.cert),
            "client-key-data": BASE64.encode(&pair.key),
        })
    }

    fn kubeconfig_json(&self, user: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{
                "name": "kube-netkit-test",
                "cluster": {
                    "server": self.server,
                    "certificate-authority-data": BASE64.encode(&self.pki.serving_ca),
                },
            }],
            "users": [{ "name": "user", "user": user }],
            "contexts": [{
                "name": "kube-netkit-test",
                "context": { "cluster": "kube-netkit-test", "user": "user", "namespace": "default" },
            }],
            "current-context": "kube-netkit-test",
        })
    }
}
