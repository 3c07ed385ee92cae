//! `cargo xtask loc`: each binary's own logic in lines, the measure of "thin binaries".
//!
//! Counts the non-blank lines of `<crate>/src/**/*.rs` that are not `//` comments (doc comments
//! included), leaving out every item under `#[cfg(test)]`. Braces are matched per line, which
//! holds for rustfmt-formatted code.

use std::path::Path;

use anyhow::Context as _;

/// The binaries and their goals (issue "One home for the plumbing").
const BINARIES: [(&str, usize); 3] = [
    ("steward-tcp-proxy", 1_300),
    ("pod-proxier", 3_000),
    ("rstream-operator", 3_000),
];

pub fn run() -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    for (name, goal) in BINARIES {
        let lines = count_dir(&root.join(name).join("src"))?;
        let verdict = if lines <= goal { "ok" } else { "over" };
        println!("{name:<20} {lines:>6} lines of own logic (goal <= {goal}: {verdict})");
    }
    Ok(())
}

fn count_dir(dir: &Path) -> anyhow::Result<usize> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            total += count_dir(&path)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            total += count_source(&text);
        }
    }
    Ok(total)
}

/// Lines of logic in one file.
fn count_source(text: &str) -> usize {
    let mut lines = text.lines();
    let mut count = 0;
    while let Some(line) = lines.next() {
        let line = line.trim();
        if line.starts_with("#[cfg(test)]") {
            skip_item(&mut lines);
        } else if !line.is_empty() && !line.starts_with("//") {
            count += 1;
        }
    }
    count
}

/// Skips the item after an attribute: up to the line where its braces close (or its `;`).
fn skip_item<'a>(lines: &mut impl Iterator<Item = &'a str>) {
    let mut depth = 0i64;
    let mut opened = false;
    for line in lines {
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        opened |= line.contains('{');
        if (opened && depth <= 0) || (!opened && line.trim_end().ends_with(';')) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_logic_not_comments_blanks_or_tests() {
        let source = "//! crate docs\n\
                      use std::io;\n\
                      \n\
                      /// docs\n\
                      fn a() {\n    // why\n    let x = 1;\n}\n\
                      #[cfg(test)]\nmod tests {\n    #[test]\n    fn t() {\n        assert!(true);\n    }\n}\n\
                      #[cfg(test)]\nuse std::fmt;\n\
                      fn b() {}\n";
        // use, fn a() {, let, }, fn b
        assert_eq!(count_source(source), 5);
    }
}
