//! `cargo xtask chart-readme [--check]`: each chart's README values table, generated from the
//! comments of its values.yaml.
//!
//! A key's description is the comment block right above it (a leading `-- ` is dropped, as
//! helm-docs writes them). Every leaf value must have one: a value nobody explained is an error.
//! A map whose keys carry no description of their own (`resources`, `nodeSelector`, ...) is one
//! row with its whole default. The table sits between `<!-- values:start -->` and
//! `<!-- values:end -->` in `<crate>/chart/README.md`; `--check` (run by `cargo xtask charts`)
//! fails when it is stale.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use serde_yaml_ng::Value;

const START: &str = "<!-- values:start -->";
const END: &str = "<!-- values:end -->";

#[derive(clap::Args)]
pub struct Args {
    /// Do not write; fail if a table is stale.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let mut stale = Vec::new();
    for chart in netkit_testenv::charts::CHARTS {
        let dir = root.join(chart).join("chart");
        let values = std::fs::read_to_string(dir.join("values.yaml"))?;
        let table = values_table(&values).with_context(|| format!("{chart}/chart/values.yaml"))?;
        let readme_path: PathBuf = dir.join("README.md");
        let readme = std::fs::read_to_string(&readme_path)
            .with_context(|| format!("reading {}", readme_path.display()))?;
        let updated =
            splice(&readme, &table).with_context(|| format!("{}", readme_path.display()))?;
        if updated == readme {
            println!(
                "ok   {chart}/chart/README.md: values table up to date ({} rows)",
                table.lines().count() - 2
            );
        } else if args.check {
            stale.push(readme_path.display().to_string());
        } else {
            std::fs::write(&readme_path, updated)?;
            println!("wrote {}", readme_path.display());
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale values table (run `cargo xtask chart-readme`):\n  {}",
            stale.join("\n  ")
        );
    }
    Ok(())
}

/// `readme` with the text between the markers replaced by `table`.
fn splice(readme: &str, table: &str) -> anyhow::Result<String> {
    let (head, rest) = readme
        .split_once(START)
        .with_context(|| format!("no {START} marker"))?;
    let (_, tail) = rest
        .split_once(END)
        .with_context(|| format!("no {END} marker"))?;
    Ok(format!("{head}{START}\n{table}{END}{tail}"))
}

/// Descriptions by dotted key path, read from the comment block above each key.
fn descriptions(values: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut pending: Vec<String> = Vec::new();
    for line in values.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            pending.clear();
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix('#') {
            let comment = comment.trim();
            pending.push(comment.strip_prefix("-- ").unwrap_or(comment).to_owned());
            continue;
        }
        if trimmed.starts_with('-') {
            pending.clear();
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            pending.clear();
            continue;
        };
        let key = key.trim().trim_matches('"').to_owned();
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, key));
        let path = stack
            .iter()
            .map(|(_, k)| k.as_str())
            .collect::<Vec<_>>()
            .join(".");
        let text = pending.join(" ").trim().to_owned();
        if !text.is_empty() {
            out.insert(path, text);
        }
        pending.clear();
    }
    out
}

/// The Markdown table of every value of `values` (a values.yaml), its header included.
pub fn values_table(values: &str) -> anyhow::Result<String> {
    let described = descriptions(values);
    let tree: Value = serde_yaml_ng::from_str(values)?;
    let mut rows = Vec::new();
    let mut undocumented = Vec::new();
    collect("", &tree, &described, &mut rows, &mut undocumented)?;
    if !undocumented.is_empty() {
        bail!(
            "values without a comment above them: {}",
            undocumented.join(", ")
        );
    }
    let mut table = "| Key | Default | Description |\n|---|---|---|\n".to_owned();
    for (key, default, description) in rows {
        table.push_str(&format!(
            "| `{key}` | `{}` | {} |\n",
            default.replace('|', "\\|"),
            description.replace('|', "\\|")
        ));
    }
    Ok(table)
}

fn collect(
    path: &str,
    value: &Value,
    described: &BTreeMap<String, String>,
    rows: &mut Vec<(String, String, String)>,
    undocumented: &mut Vec<String>,
) -> anyhow::Result<()> {
    let prefix = format!("{path}.");
    let children_described =
        path.is_empty() || described.keys().any(|k| k.starts_with(prefix.as_str()));
    if let Value::Mapping(map) = value
        && !map.is_empty()
        && children_described
    {
        for (key, child) in map {
            let key = key.as_str().context("a values key that is not a string")?;
            let child_path = if path.is_empty() {
                key.to_owned()
            } else {
                format!("{path}.{key}")
            };
            collect(&child_path, child, described, rows, undocumented)?;
        }
        return Ok(());
    }
    match described.get(path) {
        Some(description) => rows.push((
            path.to_owned(),
            serde_json::to_string(value)?,
            description.clone(),
        )),
        None => undocumented.push(path.to_owned()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const VALUES: &str = "\
# -- Replicas of the proxy.
replicaCount: 2
image:
  # -- Where the image lives.
  repository: ghcr.io/x/y
  # -- Empty: the chart's appVersion.
  tag: \"\"

# -- Requests and limits of the container.
resources:
  requests:
    cpu: 10m
";

    #[test]
    fn every_value_is_a_row_with_its_comment() {
        let table = values_table(VALUES).unwrap();
        assert_eq!(
            table,
            "| Key | Default | Description |\n|---|---|---|\n\
             | `replicaCount` | `2` | Replicas of the proxy. |\n\
             | `image.repository` | `\"ghcr.io/x/y\"` | Where the image lives. |\n\
             | `image.tag` | `\"\"` | Empty: the chart's appVersion. |\n\
             | `resources` | `{\"requests\":{\"cpu\":\"10m\"}}` | Requests and limits of the container. |\n"
        );
    }

    #[test]
    fn a_value_without_a_comment_is_an_error() {
        let err = values_table("# -- documented\na: 1\n\nb: 2\n").unwrap_err();
        assert!(err.to_string().contains(": b"), "{err}");
    }

    #[test]
    fn a_stale_table_is_replaced_between_the_markers() {
        let readme = format!("# x\n{START}\nold\n{END}\nafter\n");
        assert_eq!(
            splice(&readme, "new\n").unwrap(),
            format!("# x\n{START}\nnew\n{END}\nafter\n")
        );
    }
}
