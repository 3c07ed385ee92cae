//! Pipes for the splice path: one pool for the whole process, under a budget.
//!
//! Linux charges pipe buffers to the *user* that owns the process, across every process of
//! that user on the machine (`/proc/sys/fs/pipe-user-pages-soft`, 16 384 pages = 64 MiB by
//! default). Past that soft limit an unprivileged process cannot raise a pipe's size
//! (`F_SETPIPE_SZ` fails with `EPERM`) and new pipes shrink to two pages, so a relay that
//! opened a 1 MiB pipe per connection would fall off a cliff after about 32 spliced
//! connections, and take every other process of its user (the same UID in every pod of a
//! node) with it.
//!
//! So pipes are shared instead of owned:
//!
//! * a direction of a connection starts on the buffered path, and borrows a pipe only once it
//!   streams (a read fills a 16 KiB buffer), the way HAProxy's `splice-auto` works;
//! * it returns the pipe, empty, as soon as its socket runs dry, so a pool of a few pipes
//!   serves many bulk connections;
//! * the pipes alive at once (lent and idle) never hold more than the [budget](set_budget)
//!   of pipe buffer bytes, by default a quarter of the user's soft limit; a direction that
//!   finds the budget spent copies through its buffer instead (counted in
//!   [`PipeStats::budget_exhausted`]);
//! * if the kernel refuses a pipe size anyway (other processes of the same user hold the rest
//!   of the limit), the budget is lowered to what this process already holds, once, with a
//!   warning, and the copy carries on buffered.
//!
//! [`stats`] reports the pool; [`PrometheusObserver`](crate::metrics::PrometheusObserver)
//! exports it as `proxy_pipe_*` metrics.

#[cfg(target_os = "linux")]
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The page size pipe buffers are charged in. On systems with larger pages this undercounts
/// the kernel's charge in pages, which only makes the budget more conservative.
const PAGE: usize = 4096;

/// The budget when the user's soft limit cannot be read, or is unlimited: 16 MiB, a quarter
/// of Linux's default soft limit.
pub const FALLBACK_BUDGET: usize = 16 << 20;

/// What the pool holds and how often it said no.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PipeStats {
    /// The budget, in bytes of pipe buffer.
    pub budget_bytes: usize,
    /// Bytes of pipe buffer held by the pipes alive now (lent and idle).
    pub allocated_bytes: usize,
    /// The most bytes of pipe buffer held at once since the start.
    pub peak_allocated_bytes: usize,
    /// Pipes lent to a copy now.
    pub in_use: usize,
    /// Pipes waiting in the pool.
    pub idle: usize,
    /// Pipes opened since the start.
    pub created: u64,
    /// Times a streaming copy wanted a pipe and copied through its buffer because the budget
    /// was spent.
    pub budget_exhausted: u64,
    /// Times the kernel refused to size a pipe (the user's pipe limit was reached by others).
    pub resize_refused: u64,
}

/// The default budget: a quarter of `/proc/sys/fs/pipe-user-pages-soft`, so that four
/// relays running as the same user fit in the limit together, or [`FALLBACK_BUDGET`] when the
/// limit cannot be read or is 0 (unlimited).
pub fn default_budget() -> usize {
    std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok())
        .filter(|pages| *pages > 0)
        .map_or(FALLBACK_BUDGET, |pages| pages.saturating_mul(PAGE) / 4)
}

/// Sets the process-wide pipe budget, in bytes of pipe buffer. `0` turns splicing off: every
/// copy stays buffered. Idle pipes beyond a lowered budget are closed at once; lent ones when
/// they come back.
pub fn set_budget(bytes: usize) {
    let pool = pool();
    pool.budget.store(bytes, Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    pool.trim();
}

/// The process-wide pipe budget, in bytes.
pub fn budget() -> usize {
    pool().budget.load(Ordering::Relaxed)
}

/// A snapshot of the pool.
pub fn stats() -> PipeStats {
    let pool = pool();
    #[cfg(target_os = "linux")]
    let idle = pool.idle_pipes().len();
    #[cfg(not(target_os = "linux"))]
    let idle = 0;
    PipeStats {
        budget_bytes: pool.budget.load(Ordering::Relaxed),
        allocated_bytes: pool.allocated.load(Ordering::Relaxed),
        peak_allocated_bytes: pool.peak.load(Ordering::Relaxed),
        in_use: pool.in_use.load(Ordering::Relaxed),
        idle,
        created: pool.created.load(Ordering::Relaxed),
        budget_exhausted: pool.exhausted.load(Ordering::Relaxed),
        resize_refused: pool.refused.load(Ordering::Relaxed),
    }
}

struct Pool {
    budget: AtomicUsize,
    allocated: AtomicUsize,
    peak: AtomicUsize,
    in_use: AtomicUsize,
    created: AtomicU64,
    exhausted: AtomicU64,
    refused: AtomicU64,
    #[cfg(target_os = "linux")]
    idle: Mutex<Vec<linux::Pipe>>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        budget: AtomicUsize::new(default_budget()),
        allocated: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        in_use: AtomicUsize::new(0),
        created: AtomicU64::new(0),
        exhausted: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        #[cfg(target_os = "linux")]
        idle: Mutex::new(Vec::new()),
    })
}

#[cfg(target_os = "linux")]
pub(crate) use linux::{PooledPipe, take};

#[cfg(target_os = "linux")]
mod linux {
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{MutexGuard, PoisonError};

    use rustix::pipe::{PipeFlags, fcntl_setpipe_size, pipe_with};

    use super::{PAGE, Pool, pool};

    pub(crate) struct Pipe {
        read: OwnedFd,
        write: OwnedFd,
        capacity: usize,
    }

    impl Pool {
        pub(super) fn idle_pipes(&self) -> MutexGuard<'_, Vec<Pipe>> {
            self.idle.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// Closes idle pipes while more than the budget is allocated.
        pub(super) fn trim(&self) {
            let mut idle = self.idle_pipes();
            while self.allocated.load(Ordering::Relaxed) > self.budget.load(Ordering::Relaxed) {
                let Some(pipe) = idle.pop() else { break };
                self.allocated.fetch_sub(pipe.capacity, Ordering::Relaxed);
            }
        }

        /// Reserves `bytes` of the budget; false if they do not fit.
        fn reserve(&self, bytes: usize) -> bool {
            let budget = self.budget.load(Ordering::Relaxed);
            let reserved =
                self.allocated
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |allocated| {
                        allocated
                            .checked_add(bytes)
                            .filter(|total| *total <= budget)
                    });
            if let Ok(before) = reserved {
                self.peak.fetch_max(before + bytes, Ordering::Relaxed);
            }
            reserved.is_ok()
        }
    }

    /// The buffer size the kernel gives a pipe asked for `size` bytes: a power of two of pages.
    fn rounded(size: usize) -> usize {
        size.max(PAGE).checked_next_power_of_two().unwrap_or(size)
    }

    /// A pipe lent by the pool. Goes back to the pool through [`give_back`](Self::give_back)
    /// when the borrower knows it is empty; dropped otherwise (a copy that failed or was
    /// cancelled half way may have left bytes in it), it is closed.
    pub(crate) struct PooledPipe {
        pipe: Option<Pipe>,
        empty: bool,
    }

    impl PooledPipe {
        /// The write end, the read end and the capacity in bytes.
        pub(crate) fn ends(&self) -> Option<(&OwnedFd, &OwnedFd, usize)> {
            self.pipe
                .as_ref()
                .map(|pipe| (&pipe.write, &pipe.read, pipe.capacity))
        }

        /// Returns the pipe, known to be empty, to the pool.
        pub(crate) fn give_back(mut self) {
            self.empty = true;
        }
    }

    impl Drop for PooledPipe {
        fn drop(&mut self) {
            let Some(pipe) = self.pipe.take() else { return };
            let pool = pool();
            pool.in_use.fetch_sub(1, Ordering::Relaxed);
            let within_budget =
                pool.allocated.load(Ordering::Relaxed) <= pool.budget.load(Ordering::Relaxed);
            if self.empty && within_budget {
                pool.idle_pipes().push(pipe);
            } else {
                pool.allocated.fetch_sub(pipe.capacity, Ordering::Relaxed);
            }
        }
    }

    /// Lends a pipe of about `size` bytes: an idle one from the pool, or a new one if the
    /// budget allows. `None` means "copy through the buffer".
    pub(crate) fn take(size: usize) -> Option<PooledPipe> {
        let pool = pool();
        let lend = |pipe| {
            pool.in_use.fetch_add(1, Ordering::Relaxed);
            Some(PooledPipe {
                pipe: Some(pipe),
                empty: false,
            })
        };
        if let Some(pipe) = pool.idle_pipes().pop() {
            return lend(pipe);
        }
        let wanted = rounded(size);
        if !pool.reserve(wanted) {
            pool.exhausted.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        match open(wanted) {
            Ok(pipe) => {
                pool.created.fetch_add(1, Ordering::Relaxed);
                if pipe.capacity != wanted {
                    pool.allocated.fetch_sub(wanted, Ordering::Relaxed);
                    pool.allocated.fetch_add(pipe.capacity, Ordering::Relaxed);
                }
                lend(pipe)
            }
            Err(Open::Pipe(error)) => {
                pool.allocated.fetch_sub(wanted, Ordering::Relaxed);
                tracing::debug!(%error, "cannot open a pipe, copying through a buffer");
                None
            }
            Err(Open::Size(error)) => {
                let held = pool.allocated.fetch_sub(wanted, Ordering::Relaxed) - wanted;
                pool.refused.fetch_add(1, Ordering::Relaxed);
                pool.budget.fetch_min(held, Ordering::Relaxed);
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        size = wanted,
                        budget = held,
                        "the kernel refused a pipe size: other processes of this user hold the \
                         rest of its pipe limit; lowering the pipe budget to what this process \
                         holds and copying through buffers beyond it"
                    );
                }
                None
            }
        }
    }

    enum Open {
        Pipe(rustix::io::Errno),
        Size(rustix::io::Errno),
    }

    fn open(size: usize) -> Result<Pipe, Open> {
        let (read, write) =
            pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC).map_err(Open::Pipe)?;
        let capacity = fcntl_setpipe_size(&write, size).map_err(Open::Size)?;
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn sizes_round_up_to_powers_of_two_of_pages() {
            assert_eq!(rounded(1), PAGE);
            assert_eq!(rounded(PAGE), PAGE);
            assert_eq!(rounded(100_000), 128 << 10);
            assert_eq!(rounded(1 << 20), 1 << 20);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_budget_is_inside_the_soft_limit() {
        let budget = default_budget();
        assert!(budget > 0);
        if let Some(pages) = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
            .ok()
            .and_then(|text| text.trim().parse::<usize>().ok())
            .filter(|pages| *pages > 0)
        {
            assert!(budget <= pages * PAGE / 2, "{budget} vs {pages} pages");
        }
    }
}
