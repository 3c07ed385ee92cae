//! Child processes that never outlive the test binary.
//!
//! A test binary may end in ways that run no destructor (a `static` control plane, `process::exit`,
//! a panic in another thread, SIGKILL). So every server process is watched by a tiny guardian shell
//! whose stdin is a pipe from this process: the kernel closes that pipe however this process ends, the
//! guardian's `read` returns, and it kills the servers and removes their directory.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use super::TestingError;

/// Kills the pids given after the directory, then removes the directory. It ignores SIGINT and
/// SIGTERM so that a Ctrl-C in a terminal cannot stop it before it has cleaned up.
const GUARDIAN_SCRIPT: &str = r#"trap '' INT TERM HUP
dir=$1; shift
read -r _ || true
kill -KILL "$@" 2>/dev/null
rm -rf --one-file-system "$dir"
"#;

/// Runs under `flock`: says when it holds the lock, then runs a teardown script once its owner
/// is gone (see [`Guardian::teardown`]). The lock is released only when the teardown has ended.
const TEARDOWN_GUARDIAN_SCRIPT: &str = r#"trap '' INT TERM HUP
echo locked
read -r _ || true
exec sh "$1" >/dev/null 2>&1
"#;

/// A server process with its output captured in a log file.
pub(crate) struct ServerProcess {
    pub(crate) name: &'static str,
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
    // Kept to start it again the same way (see `respawn`).
    program: PathBuf,
    args: Vec<String>,
}

impl ServerProcess {
    /// Starts `program` in its own process group (so a terminal's Ctrl-C reaches only the owner,
    /// which then stops it in order), stdout and stderr going to `<dir>/<name>.log`.
    pub(crate) fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        dir: &Path,
    ) -> Result<Self, TestingError> {
        let log = dir.join(format!("{name}.log"));
        let child = Self::start(program, args, &log)?;
        Ok(Self {
            name,
            child,
            log,
            program: program.to_owned(),
            args: args.to_vec(),
        })
    }

    /// Starts the process again with the same program and arguments after it has exited (see
    /// [`ServerProcess::signal`]), its output appended to the same log.
    pub(crate) fn respawn(&mut self) -> Result<(), TestingError> {
        self.child = Self::start(&self.program, &self.args, &self.log)?;
        Ok(())
    }

    /// Sends `signal` to the process; an error means it is already gone.
    pub(crate) fn signal(&self, signal: rustix::process::Signal) {
        let pid = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }

    fn start(program: &Path, args: &[String], log: &Path) -> Result<Child, TestingError> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| TestingError::Io {
                context: format!("opening {}", log.display()),
                cause: source,
            })?;
        let err = out.try_clone().map_err(|source| TestingError::Io {
            context: format!("duplicating {}", log.display()),
            cause: source,
        })?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|source| TestingError::Io {
                context: format!("starting {}", program.display()),
                cause: source,
            })?;
        Ok(child)
    }

    /// The pid of the running process.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited; with the tail of its log when it has.
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(format!(
                "{} exited with {status}; last lines of {}:\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log, 12)
            )),
            Ok(None) => None,
            Err(err) => Some(format!("{} cannot be waited for: {err}", self.name)),
        }
    }

    /// Kills and reaps the process.
    pub(crate) fn stop(&mut self) {
        // Errors mean it is already gone, which is what we want.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The guardian of a set of server processes and their directory.
pub(crate) struct Guardian {
    // Held, never written: its closing is the signal.
    stdin: Option<ChildStdin>,
    child: Child,
}

impl Guardian {
    pub(crate) fn watch(dir: &Path, pids: &[u32]) -> Result<Self, TestingError> {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(GUARDIAN_SCRIPT)
            .arg("kube-netkit-guardian")
            .arg(dir)
            .args(pids.iter().map(u32::to_string))
            .stdout(Stdio::null());
        Self::spawn(command)
    }

    /// A guardian that holds the machine-wide `lock` (waiting up to `wait` for it) and runs
    /// `script` (an idempotent teardown) when released or when this process ends, for state that
    /// killing processes does not undo: mounts, network namespaces, routes. Returns once the lock
    /// is held; since the guardian holds it until its teardown has run, the next holder never
    /// overlaps a teardown still in progress.
    pub(crate) fn teardown(
        script: &Path,
        lock: &Path,
        wait: std::time::Duration,
    ) -> Result<Self, TestingError> {
        use std::io::BufRead as _;
        let mut command = Command::new("flock");
        command
            .arg("--wait")
            .arg(wait.as_secs().to_string())
            .arg(lock)
            .args([
                "sh",
                "-c",
                TEARDOWN_GUARDIAN_SCRIPT,
                "kube-netkit-node-guardian",
            ])
            .arg(script)
            .stdout(Stdio::piped());
        let mut guardian = Self::spawn(command)?;
        let mut line = String::new();
        if let Some(stdout) = guardian.child.stdout.take() {
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        }
        if line.trim() != "locked" {
            let _ = guardian.child.kill();
            let _ = guardian.child.wait();
            return Err(TestingError::NodeUnavailable(format!(
                "another test node held {} for {wait:?}",
                lock.display()
            )));
        }
        Ok(guardian)
    }

    fn spawn(mut command: Command) -> Result<Self, TestingError> {
        let mut child = command
            .stdin(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| TestingError::Io {
                context: "starting the guardian shell (sh)".to_owned(),
                cause: source,
            })?;
        let stdin = child.stdin.take();
        Ok(Self { stdin, child })
    }

    /// Lets the guardian do its work now and waits for it.
    pub(crate) fn release(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"stop\n");
        }
        let _ = self.child.wait();
    }
}

/// A free TCP port on 127.0.0.1 for a server this module starts (see
/// [`crate::fixtures::free_port`] for why it is not the kernel's pick).
pub(crate) fn free_port() -> Result<u16, TestingError> {
    crate::fixtures::free_port().map_err(|source| TestingError::Io {
        context: "finding a free port".to_owned(),
        cause: source,
    })
}

/// The last `lines` lines of a log file, for error messages.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
