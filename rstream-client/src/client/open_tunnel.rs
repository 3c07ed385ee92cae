//! [`Tunnel`]: a tunnel created on a control channel, whose inbound streams are accepted here.

use super::*;

/// A tunnel created on a [`ControlChannel`]: accept its inbound streams with [`Tunnel::accept`].
pub struct Tunnel {
    pub(super) shared: Arc<Shared>,
    pub(super) _life: Arc<Lifetime>,
    pub(super) id: String,
    pub(super) props: proto::TunnelProperties,
    pub(super) rx: mpsc::Receiver<RstreamStream>,
    pub(super) closed: CancellationToken,
}

impl std::fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnel")
            .field("id", &self.id)
            .field("properties", &self.props)
            .finish_non_exhaustive()
    }
}

impl Tunnel {
    /// The engine-assigned tunnel ID.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The properties returned by the engine.
    pub fn properties(&self) -> &proto::TunnelProperties {
        &self.props
    }

    /// The display address (`https://host`, `host:port (tcp)`, `rstrm://name (unpublished)`, ...).
    pub fn forwarding_address(&self) -> Result<String> {
        forwarding_address(&self.props)
    }

    /// Whether the tunnel is closed (closed by us or the engine, or its control channel ended).
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Waits for the next inbound stream. Fails with [`Error::TunnelClosed`] once the tunnel is closed, or
    /// with the control channel's failure.
    pub async fn accept(&mut self) -> Result<RstreamStream> {
        tokio::select! {
            biased;
            _ = self.closed.cancelled() => Err(self.close_reason()),
            stream = self.rx.recv() => stream.ok_or_else(|| self.close_reason()),
        }
    }

    pub(super) fn close_reason(&self) -> Error {
        match self.shared.lock().error.clone() {
            Some(e) if self.shared.closed.is_cancelled() => e,
            _ => Error::TunnelClosed,
        }
    }

    /// Closes the tunnel on the engine.
    pub async fn close(&self) -> Result<()> {
        close_tunnel(&self.shared, &self.id).await
    }

    /// A token cancelled when streams handed to forwarders must be closed (explicit control close or
    /// protocol error; not on a transport loss, when accepted streams survive).
    pub fn hard_close_token(&self) -> CancellationToken {
        self.shared.hard_close.clone()
    }

    /// The control channel this tunnel belongs to.
    pub fn control(&self) -> ControlChannel {
        ControlChannel {
            shared: self.shared.clone(),
            life: self._life.clone(),
        }
    }
}
