//! Each binary's README flag table must list exactly the flags its `--help` prints, every
//! `cargo run -p <package> --example <name> -- <flags>` a README shows must name an example that
//! exists in that package and flags its `--help` knows, and every binary must follow the one
//! flag convention ([`crate::flag_conventions`]).

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
    let root = netkit_testenv::workspace::root();
    // The release binaries the images ship, built by the same command as the image step (a
    // no-op after it), so this check neither rebuilds them nor checks other builds than users run.
    let status = crate::image::release_build(&crate::image::selected("all")?)
        .arg("--quiet")
        .status()
        .context("running cargo build --release")?;
    if !status.success() {
        bail!("building the release binaries failed");
    }
    let bin_dir = netkit_testenv::workspace::target_dir(&root).join("release");
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
    problems.extend(check_example_commands(&root)?);
    problems.extend(crate::flag_conventions::check(&bin_dir)?);
    if !problems.is_empty() {
        bail!("READMEs out of date:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The READMEs whose `cargo run --example` commands are checked.
const EXAMPLE_READMES: &[&str] = &[
    "README.md",
    "proxy-core/README.md",
    "k8s-reconcile/README.md",
    "rstream-client/README.md",
    "examples/README.md",
];

/// Runs `--help` of every example a README's command names, and checks its flags.
fn check_example_commands(root: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    for readme in EXAMPLE_READMES {
        let text = std::fs::read_to_string(root.join(readme))?;
        for command in example_commands(&text) {
            let dir = root.join(&command.package);
            if !dir
                .join("examples")
                .join(format!("{}.rs", command.example))
                .is_file()
            {
                problems.push(format!(
                    "{readme}: `cargo run -p {} --example {}`: no such example in {}",
                    command.package,
                    command.example,
                    dir.display()
                ));
                continue;
            }
            let help = netkit_testenv::workspace::cargo()
                .args([
                    "run",
                    "--quiet",
                    "-p",
                    &command.package,
                    "--example",
                    &command.example,
                ])
                .args(["--", "--help"])
                .output()
                .with_context(|| format!("running the {} example", command.example))?;
            let known = help_flags(&String::from_utf8_lossy(&help.stdout));
            if !help.status.success() {
                problems.push(format!(
                    "{readme}: example {} --help failed: {}",
                    command.example,
                    String::from_utf8_lossy(&help.stderr).trim()
                ));
                continue;
            }
            let unknown: Vec<_> = command.flags.difference(&known).collect();
            if unknown.is_empty() {
                println!(
                    "ok   {readme}: `cargo run -p {} --example {}` with {:?}",
                    command.package, command.example, command.flags
                );
            } else {
                problems.push(format!(
                    "{readme}: example {} has no flag {unknown:?}",
                    command.example
                ));
            }
        }
    }
    Ok(problems)
}

/// One `cargo run -p <package> --example <name> -- <flags>` of a README.
#[derive(Debug, PartialEq, Eq)]
struct ExampleCommand {
    package: String,
    example: String,
    flags: BTreeSet<String>,
}

/// Every example command of a text, with the long flags after its `--`.
fn example_commands(text: &str) -> Vec<ExampleCommand> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("cargo run -p ") {
        rest = &rest[at + "cargo run -p ".len()..];
        // A command ends at the end of its code span or line.
        let end = rest.find(['`', '\n']).unwrap_or(rest.len());
        let words: Vec<&str> = rest[..end].split_whitespace().collect();
        let (Some(package), Some(&"--example"), Some(example)) =
            (words.first(), words.get(1), words.get(2))
        else {
            continue;
        };
        // Prose about commands (`cargo run -p … --example …`) names no package.
        let is_name = |w: &str| {
            w.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if !is_name(package) || !is_name(example) {
            continue;
        }
        let flags = words
            .iter()
            .skip_while(|w| **w != "--")
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(|w| w.split('=').next().unwrap_or(w).to_owned())
            .collect();
        found.push(ExampleCommand {
            package: (*package).to_owned(),
            example: (*example).to_owned(),
            flags,
        });
    }
    found
}

/// Long flags at the start of clap's option lines (`  -h, --help`, `      --listen-addr <ADDR>`).
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            // `-h, --help`: a short flag before the long one (a ", " later in the description
            // is no short flag).
            let line = match line.as_bytes() {
                [b'-', short, b',', b' ', ..] if short.is_ascii_alphanumeric() => &line[4..],
                _ => line,
            };
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
        let help = "Options:\n      --listen-addr <ADDR>\n          text\n  -h, --help\n  -V, --version\n      --leader-elect\n      --identity <IDENTITY>  Identity file (JSON, private keys inside)\n  -t, --token <T>  A token\n";
        let flags: Vec<_> = help_flags(help).into_iter().collect();
        // A ", " inside a flag's description does not hide the flag.
        assert_eq!(
            flags,
            ["--identity", "--leader-elect", "--listen-addr", "--token"]
        );
        let readme = "# x\n## Flags\n| Flag | Env |\n|---|---|\n| `--listen-addr` | X |\n| `--leader-elect` | Y |\n## Next\n| `--other` |\n";
        let table: Vec<_> = table_flags(readme, "## Flags")
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(table, ["--leader-elect", "--listen-addr"]);
    }

    #[test]
    fn finds_example_commands_and_their_flags() {
        let text = "Run `cargo run -p examples --example tcp_relay -- --listen 1 --upstream=2`\n\
                    cargo run -p rstream-client --example rstream_expose\ncargo run -p x --bin y\n\
                    prose: `cargo run -p … --example …`\n";
        let found = example_commands(text);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].package, "examples");
        assert_eq!(found[0].example, "tcp_relay");
        assert_eq!(
            found[0].flags.iter().collect::<Vec<_>>(),
            ["--listen", "--upstream"]
        );
        assert_eq!(found[1].package, "rstream-client");
        assert!(found[1].flags.is_empty());
    }
}
