//! Child processes that never outlive the test binary.
//!
//! A test binary may end in ways that run no destructor (a `static` control plane, `process::exit`,
//! a panic in another thread, SIGKILL). So every server process is watched by a tiny guardian shell
//! whose stdin is a pipe from this process: the kernel closes that pipe however this process ends, the
//! guardian's `read` returns, and it kills the servers and removes their directory.

use std::fs::File;
use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
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
rm -rf "$dir"
"#;

/// A server process with its output captured in a log file.
pub(crate) struct ServerProcess {
    pub(crate) name: &'static str,
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
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
        let out = File::create(&log).map_err(|source| TestingError::Io {
            context: format!("creating {}", log.display()),
            source,
        })?;
        let err = out.try_clone().map_err(|source| TestingError::Io {
            context: format!("duplicating {}", log.display()),
            source,
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
                source,
            })?;
        Ok(Self { name, child, log })
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
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(GUARDIAN_SCRIPT)
            .arg("kube-netkit-guardian")
            .arg(dir)
            .args(pids.iter().map(u32::to_string))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| TestingError::Io {
                context: "starting the guardian shell (sh)".to_owned(),
                source,
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

/// A free TCP port on 127.0.0.1 (the kernel picks it; the tiny race with other programs binding it
/// before the server does is accepted, as envtest does).
pub(crate) fn free_port() -> Result<u16, TestingError> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|source| TestingError::Io {
            context: "finding a free port".to_owned(),
            source,
        })?;
    let port = listener
        .local_addr()
        .map_err(|source| TestingError::Io {
            context: "finding a free port".to_owned(),
            source,
        })?
        .port();
    Ok(port)
}

/// The last `lines` lines of a log file, for error messages.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
