//! Accept workers: threads with one event loop each (a current-thread runtime), on which the
//! listeners' per-worker sockets accept and their connections run.

use std::io;
use std::num::NonZeroUsize;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Starts `count` threads, each running a current-thread runtime until `stop` is cancelled, and
/// returns their runtimes' handles. The threads are detached: whatever still runs on a runtime
/// when `stop` fires is dropped with it, as when a server's last handle goes away.
pub(super) fn start(count: NonZeroUsize, stop: &CancellationToken) -> io::Result<Vec<Handle>> {
    (0..count.get())
        .map(|index| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("proxy-worker-{index}"))
                .spawn(move || runtime.block_on(stop.cancelled()))?;
            Ok(handle)
        })
        .collect()
}
