//! heaptrack (Debian's package) for a bench's child process: its preload library records every
//! allocation of the process into a raw file; [`analyse`] turns that into the heap at its peak,
//! by function, and heaptrack_print's list of the biggest consumers.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

/// heaptrack's preload library and interpreter, from Debian's `heaptrack` package.
const PRELOAD: &str = "/usr/lib/heaptrack/libheaptrack_preload.so";
const INTERPRET: &str = "/usr/lib/heaptrack/libexec/heaptrack_interpret";
/// Makes `cmd` record its heap into `raw` (heaptrack's preload library, no wrapper process, so
/// the bench's child is the program itself and stops as it does).
pub fn record_into(cmd: &mut Command, raw: &Path) {
    cmd.env("LD_PRELOAD", PRELOAD)
        .env("DUMP_HEAPTRACK_OUTPUT", raw);
}

/// Reads a finished record: heaptrack_print's biggest peak consumers (one backtrace each) and the
/// peak by function ([`peak_by_function`]); `work` holds the intermediate files.
pub fn analyse(raw: &Path, work: &Path) -> anyhow::Result<(String, String)> {
    let data = work.join("heaptrack.data");
    let status = Command::new(INTERPRET)
        .stdin(std::fs::File::open(raw).with_context(|| format!("opening {}", raw.display()))?)
        .stdout(std::fs::File::create(&data)?)
        .status()
        .context("running heaptrack_interpret")?;
    if !status.success() {
        bail!("heaptrack_interpret exited with {status}");
    }
    let stacks = work.join("peak.stacks");
    let print = |args: &[&str]| -> anyhow::Result<String> {
        let printed = Command::new("heaptrack_print")
            .arg("--file")
            .arg(&data)
            .args(args)
            .output()
            .context("running heaptrack_print")?;
        if !printed.status.success() {
            bail!(
                "heaptrack_print exited with {}: {}",
                printed.status,
                String::from_utf8_lossy(&printed.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&printed.stdout).into_owned())
    };
    let peaks = print(&[
        "--print-peaks=1",
        "--print-allocators=0",
        "--print-temporary=0",
        "--print-leaks=0",
        "--peak-limit=8",
        "--sub-peak-limit=1",
    ])?;
    print(&[
        "--print-peaks=0",
        "--print-allocators=0",
        "--print-temporary=0",
        "--print-leaks=0",
        "--flamegraph-cost-type=peak",
        &format!("--print-flamegraph={}", stacks.display()),
    ])?;
    let folded = std::fs::read_to_string(&stacks)
        .with_context(|| format!("reading {}", stacks.display()))?;
    Ok((peaks, peak_by_function(&folded, 45)))
}

/// The frames of heaptrack's folded stacks (`frame;frame;... bytes`, peak cost) that name this
/// project's code, kube's, k8s-openapi's, serde's and the runtime's, with the bytes of the
/// heap's peak allocated under each (a frame counted once per stack): the `limit` biggest, as a
/// table with each one's share of the peak.
fn peak_by_function(folded: &str, limit: usize) -> String {
    const OF_INTEREST: [&str; 10] = [
        "rstream_operator",
        "k8s_reconcile",
        "kube_runtime",
        "kube_client",
        "k8s_openapi",
        "serde_json",
        "serde_yaml",
        "hyper",
        "rustls",
        "tokio::runtime",
    ];
    let mut by_frame: BTreeMap<String, u64> = BTreeMap::new();
    let mut total = 0u64;
    for line in folded.lines() {
        let Some((stack, bytes)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(bytes) = bytes.parse::<u64>() else {
            continue;
        };
        total += bytes;
        let mut seen = std::collections::BTreeSet::new();
        for frame in stack.split(';').map(readable_symbol) {
            if OF_INTEREST.iter().any(|k| frame.contains(k)) && seen.insert(frame.clone()) {
                *by_frame.entry(frame).or_default() += bytes;
            }
        }
    }
    let mut rows: Vec<(String, u64)> = by_frame.into_iter().collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut table = format!(
        "peak heap {:.1} MiB\n\n| MiB | share | function |\n|---:|---:|---|\n",
        total as f64 / 1048576.0
    );
    for (frame, bytes) in rows.into_iter().take(limit) {
        let _ = writeln!(
            table,
            "| {:.2} | {:.0} % | `{frame}` |",
            bytes as f64 / 1048576.0,
            100.0 * bytes as f64 / total.max(1) as f64
        );
    }
    table
}

/// A legacy-mangled Rust symbol as heaptrack prints it, made readable: the escapes decoded, the
/// hash suffix dropped.
fn readable_symbol(symbol: &str) -> String {
    let mut text = symbol.trim().to_owned();
    for (from, to) in [
        ("$LT$", "<"),
        ("$GT$", ">"),
        ("$u20$", " "),
        ("$C$", ","),
        ("$RF$", "&"),
        ("$BP$", "*"),
        ("$u7b$", "{"),
        ("$u7d$", "}"),
        ("$u5b$", "["),
        ("$u5d$", "]"),
        ("$u27$", "'"),
        ("..", "::"),
    ] {
        text = text.replace(from, to);
    }
    let text = text.strip_prefix('_').unwrap_or(&text).to_owned();
    match text.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            head.to_owned()
        }
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_read_as_rust_paths() {
        assert_eq!(
            readable_symbol(
                "_$LT$rstream_operator..api..RstreamTunnel$u20$as$u20$core..clone..Clone$GT$::clone::h8762e871c33c4fe6"
            ),
            "<rstream_operator::api::RstreamTunnel as core::clone::Clone>::clone"
        );
        assert_eq!(readable_symbol("main"), "main");
    }

    #[test]
    fn peak_bytes_count_once_per_stack_under_each_frame() {
        let folded = "main;k8s_reconcile::a;k8s_reconcile::a;serde_json::b 3145728\n\
                      main;k8s_reconcile::a 1048576\n\
                      main;libc 1048576\n\
                      not a stack\n";
        let table = peak_by_function(folded, 10);
        assert!(table.starts_with("peak heap 5.0 MiB"), "{table}");
        let rows: Vec<&str> = table.lines().filter(|l| l.contains('`')).collect();
        assert_eq!(
            rows,
            [
                "| 4.00 | 80 % | `k8s_reconcile::a` |",
                "| 3.00 | 60 % | `serde_json::b` |"
            ]
        );
    }
}
