//! The demo's child processes: built once, started in their own process groups with their output
//! in log files, stopped with SIGTERM then SIGKILL, and watched by a guardian shell so that none
//! outlives the demo even if it is killed.

use std::collections::HashMap;
use std::fs::File;
use std::future::Future;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rustix::process::{Pid, Signal};
use tokio::io::AsyncBufReadExt as _;

/// Reads pids from stdin; when stdin closes without `done` (the demo died), kills them and removes
/// the work directory. Ignores the terminal's signals so that a Ctrl-C cannot stop it first.
const GUARDIAN_SCRIPT: &str = r#"trap '' INT TERM HUP
dir=$1
pids=
while read -r line; do
  [ "$line" = done ] && exit 0
  pids="$pids $line"
done
[ -n "$pids" ] && kill -KILL $pids 2>/dev/null
rm -rf "$dir"
"#;

/// How long children get to exit after SIGTERM before they are killed.
const GRACE: Duration = Duration::from_secs(10);

/// The executables the demo runs, by binary name.
pub struct Binaries(HashMap<String, PathBuf>);

impl Binaries {
    pub fn get(&self, name: &str) -> anyhow::Result<&Path> {
        self.0
            .get(name)
            .map(PathBuf::as_path)
            .with_context(|| format!("cargo did not report building {name}"))
    }
}

/// `cargo build` of the binaries' packages (debug profile), its output in `log`; the executables'
/// paths come from cargo's JSON messages, so any target directory works.
pub async fn build(packages: &[&str], log: &Path) -> anyhow::Result<Binaries> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = tokio::process::Command::new(cargo);
    command.current_dir(crate::workspace_root()).args([
        "build",
        "--bins",
        "--message-format=json-render-diagnostics",
    ]);
    for package in packages {
        command.args(["-p", package]);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(log).with_context(|| format!("creating {}", log.display()))?)
        // Its own process group, so that stopping the demo mid-build also stops the compilers.
        .process_group(0)
        .spawn()
        .context("starting cargo build")?;
    let mut group = KillGroupOnDrop(child.id().and_then(pid_of));
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut executables = HashMap::new();
    while let Some(line) = lines.next_line().await? {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if let (Some(name), Some(path)) = (
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) {
            executables.insert(name.to_owned(), PathBuf::from(path));
        }
    }
    let status = child.wait().await?;
    group.disarm();
    if !status.success() {
        bail!(
            "cargo build failed ({status}); last lines of {}:\n{}",
            log.display(),
            log_tail(log, 30)
        );
    }
    Ok(Binaries(executables))
}

struct Running {
    name: String,
    child: Child,
    log: PathBuf,
}

/// The running children and their guardian.
pub struct Processes {
    dir: PathBuf,
    running: Vec<Running>,
    guardian: Child,
    guardian_stdin: Option<ChildStdin>,
}

impl Processes {
    /// Starts the guardian of `dir` (the demo's work directory, where the logs go).
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        let mut guardian = Command::new("sh")
            .arg("-c")
            .arg(GUARDIAN_SCRIPT)
            .arg("kube-netkit-demo-guardian")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the guardian shell (sh)")?;
        let guardian_stdin = guardian.stdin.take();
        Ok(Self {
            dir: dir.to_owned(),
            running: Vec::new(),
            guardian,
            guardian_stdin,
        })
    }

    /// Starts `command` as `name`, in its own process group (a terminal's Ctrl-C reaches only the
    /// demo, which then stops the children in order), its output in `<dir>/<name>.log`.
    pub fn spawn(&mut self, name: &str, command: &mut Command) -> anyhow::Result<PathBuf> {
        let log = self.dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = command
            // Plain text logs: they go to files.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        if let Some(stdin) = self.guardian_stdin.as_mut() {
            writeln!(stdin, "{}", child.id()).context("telling the guardian a pid")?;
        }
        self.running.push(Running {
            name: name.to_owned(),
            child,
            log: log.clone(),
        });
        Ok(log)
    }

    /// Fails, with the tail of its log, if a child has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        for process in &mut self.running {
            if let Some(status) = process.child.try_wait()? {
                bail!(
                    "{} exited with {status}; last lines of {}:\n{}",
                    process.name,
                    process.log.display(),
                    log_tail(&process.log, 20)
                );
            }
        }
        Ok(())
    }

    /// The last lines of every child's log, on stderr, before the logs are removed.
    pub fn print_log_tails(&self) {
        for process in &self.running {
            eprintln!(
                "--- last lines of {} ({}):\n{}",
                process.name,
                process.log.display(),
                log_tail(&process.log, 15)
            );
        }
    }

    /// SIGTERM to every child (last started first), then SIGKILL to those still running after
    /// the grace period. Returns the names of the children that had to be killed.
    pub async fn stop_all(&mut self) -> Vec<String> {
        for process in self.running.iter().rev() {
            terminate(&process.child);
        }
        let deadline = Instant::now() + GRACE;
        while Instant::now() < deadline && !self.all_exited() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut killed = Vec::new();
        for mut process in self.running.drain(..).rev() {
            if matches!(process.child.try_wait(), Ok(None)) {
                killed.push(process.name);
                let _ = process.child.kill();
            }
            let _ = process.child.wait();
        }
        killed
    }

    /// Polls `check` every 100 ms until it returns `Some`; fails after `timeout`, naming `what`, or
    /// as soon as a child exits (the likely cause, with its log).
    pub async fn wait_for<T, F, Fut>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut check: F,
    ) -> anyhow::Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = anyhow::Result<Option<T>>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            self.ensure_running()
                .with_context(|| format!("while waiting for {what}"))?;
            if let Some(value) = check().await? {
                return Ok(value);
            }
            if Instant::now() >= deadline {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn all_exited(&mut self) -> bool {
        self.running
            .iter_mut()
            .all(|p| !matches!(p.child.try_wait(), Ok(None)))
    }

    /// After [`Self::stop_all`]: the guardian has nothing left to do.
    pub fn release_guardian(&mut self) {
        if let Some(mut stdin) = self.guardian_stdin.take() {
            let _ = stdin.write_all(b"done\n");
        }
        let _ = self.guardian.wait();
    }
}

/// Kills a process group when dropped (a cancelled build), unless disarmed.
struct KillGroupOnDrop(Option<Pid>);

impl KillGroupOnDrop {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for KillGroupOnDrop {
    fn drop(&mut self) {
        if let Some(group) = self.0 {
            // An error means the group is already gone.
            let _ = rustix::process::kill_process_group(group, Signal::KILL);
        }
    }
}

fn pid_of(id: u32) -> Option<Pid> {
    i32::try_from(id).ok().and_then(Pid::from_raw)
}

fn terminate(child: &Child) {
    if let Some(pid) = pid_of(child.id()) {
        // An error means it has already exited.
        let _ = rustix::process::kill_process(pid, Signal::TERM);
    }
}

/// The last `lines` lines of a log file, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
