//! Each binary's README flag table must list exactly the flags its `--help` prints.

use std::collections::BTreeSet;
use std::process::Command;

use anyhow::{Context as _, bail};

/// (binary, README, heading of its flag table).
const TABLES: &[(&str, &str, &str)] = &[
    (
        "steward-tcp-proxy",
        "steward-tcp-proxy/README.md",
        "## Flags",
    ),
    ("pod-proxier", "pod-proxier/README.md", "## Flags"),
    (
        "rstream-operator",
        "rstream-operator/README.md",
        "## Manager flags",
    ),
    (
        "rstream-agent",
        "rstream-operator/README.md",
        "## Agent flags",
    ),
];

pub fn run() -> anyhow::Result<()> {
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(&cargo)
        .current_dir(&root)
        .args([
            "build",
            "--quiet",
            "-p",
            "steward-tcp-proxy",
            "-p",
            "pod-proxier",
            "-p",
            "rstream-operator",
        ])
        .status()?;
    if !status.success() {
        bail!("building the binaries failed");
    }
    let bin_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("debug");
    let mut problems = Vec::new();
    for (binary, readme, heading) in TABLES {
        let help = Command::new(bin_dir.join(binary))
            .arg("--help")
            .output()
            .with_context(|| format!("running {binary} --help"))?;
        let from_help = help_flags(&String::from_utf8_lossy(&help.stdout));
        let text = std::fs::read_to_string(root.join(readme))?;
        let from_table = table_flags(&text, heading)
            .with_context(|| format!("{readme} has no {heading:?} section"))?;
        let undocumented: Vec<_> = from_help.difference(&from_table).collect();
        let stale: Vec<_> = from_table.difference(&from_help).collect();
        if undocumented.is_empty() && stale.is_empty() {
            println!(
                "ok   {readme} ({heading}) lists the {} flags of {binary} --help",
                from_help.len()
            );
        } else {
            problems.push(format!(
                "{readme} ({heading}) vs {binary} --help: missing from the table {undocumented:?}; not in --help {stale:?}"
            ));
        }
    }
    if !problems.is_empty() {
        bail!("flag tables out of date:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// Long flags at the start of clap's option lines (`  -h, --help`, `      --listen-addr <ADDR>`).
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = line
                .strip_prefix("-")
                .and_then(|l| l.split_once(", "))
                .map_or(line, |(_, rest)| rest);
            let flag = line.strip_prefix("--")?;
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!name.is_empty() && name != "help" && name != "version").then(|| format!("--{name}"))
        })
        .collect()
}

/// Flags in the first column of the table under `heading` (`| `--flag` | ...`).
fn table_flags(readme: &str, heading: &str) -> Option<BTreeSet<String>> {
    let start = readme
        .find(&format!("{heading}\n"))
        .or_else(|| readme.find(heading))?;
    let section = &readme[start + heading.len()..];
    let end = section.find("\n#").unwrap_or(section.len());
    Some(
        section[..end]
            .lines()
            .filter_map(|line| {
                let cell = line.strip_prefix('|')?.split('|').next()?.trim();
                let flag = cell.trim_matches('`');
                // A flag, not the `|---|` separator row.
                let name = flag.strip_prefix("--")?;
                name.starts_with(|c: char| c.is_ascii_lowercase())
                    .then(|| format!("--{}", name.split([' ', '=']).next().unwrap_or(name)))
            })
            .filter(|f| f != "--help" && f != "--version")
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_clap_help_and_markdown_tables() {
        let help = "Options:\n      --listen-addr <ADDR>\n          text\n  -h, --help\n  -V, --version\n      --leader-elect\n";
        let flags: Vec<_> = help_flags(help).into_iter().collect();
        assert_eq!(flags, ["--leader-elect", "--listen-addr"]);
        let readme = "# x\n## Flags\n| Flag | Env |\n|---|---|\n| `--listen-addr` | X |\n| `--leader-elect` | Y |\n## Next\n| `--other` |\n";
        let table: Vec<_> = table_flags(readme, "## Flags")
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(table, ["--leader-elect", "--listen-addr"]);
    }
}
