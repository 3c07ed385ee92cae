//! `cargo xtask modules`: no import circles between the modules of a library.
//!
//! Each library's Layout section promises that data flows one way between its modules. This
//! reads every module file of the three libraries, takes each `crate::a::b` and `super::x` path
//! outside comments and test modules, lifts it to the two sibling modules it connects (the
//! children of their nearest common ancestor; a module using its own ancestors or descendants is
//! not an edge), and fails on any strongly connected set of more than one sibling.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::bail;

/// The library crates whose modules are checked.
const LIBRARIES: [&str; 3] = ["proxy-core", "k8s-reconcile", "rstream-client"];

/// A module path inside a crate, e.g. `["engine", "udp"]`.
type ModPath = Vec<String>;

pub fn run() -> anyhow::Result<()> {
    let root = crate::workspace_root();
    let mut circles = Vec::new();
    for library in LIBRARIES {
        let files = module_files(&root.join(library).join("src"))?;
        let found = find_circles(&files);
        if found.is_empty() {
            println!("ok   {library}: {} modules, no import circles", files.len());
        }
        for circle in found {
            circles.push(format!("{library}: {}", circle.join(" <-> ")));
        }
    }
    if !circles.is_empty() {
        bail!("import circles:\n  {}", circles.join("\n  "));
    }
    Ok(())
}

/// Every module file under `src` with its module path and text.
fn module_files(src: &Path) -> anyhow::Result<BTreeMap<ModPath, String>> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let Ok(relative) = path.strip_prefix(src) else {
                continue;
            };
            let mut module: ModPath = relative
                .with_extension("")
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            files.insert(module, std::fs::read_to_string(&path)?);
        }
    }
    Ok(files)
}

/// The circles among sibling modules, each as its modules' paths.
fn find_circles(files: &BTreeMap<ModPath, String>) -> Vec<Vec<String>> {
    let modules: BTreeSet<&ModPath> = files.keys().collect();
    let reexports = reexports(files);
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, text) in files {
        for target in references(from, text) {
            // The longest prefix of the path that is a module of the crate.
            let Some(mut to) = (0..=target.len())
                .rev()
                .map(|n| target[..n].to_vec())
                .find(|p| modules.contains(p))
            else {
                continue;
            };
            // `crate::Error` names the module that defines it, through `pub use error::Error`.
            if let Some(name) = target.get(to.len()) {
                let mut key = to.clone();
                key.push(name.clone());
                if let Some(defined) = reexports.get(&key) {
                    to.clone_from(defined);
                }
            }
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // An ancestor or a descendant: the module tree, not a layer edge.
            }
            edges
                .entry(from[..=common].to_vec())
                .or_default()
                .insert(to[..=common].to_vec());
        }
    }
    strongly_connected(&edges)
        .into_iter()
        .filter(|set| set.len() > 1)
        .map(|set| set.iter().map(|m| m.join("::")).collect())
        .collect()
}

/// `pub use child::{A, B}` / `pub use child::A;` of each module: (module + name) -> the child
/// module that defines the name.
fn reexports(files: &BTreeMap<ModPath, String>) -> BTreeMap<ModPath, ModPath> {
    let mut found = BTreeMap::new();
    for (module, text) in files {
        for statement in text.split(';') {
            let statement = statement.trim();
            let Some(path) = statement
                .strip_prefix("pub use ")
                .map(|p| p.trim_start_matches("self::"))
            else {
                continue;
            };
            let (source, names) = match path.split_once("::{") {
                Some((source, names)) => (source, names.trim_end_matches('}')),
                None => match path.rsplit_once("::") {
                    Some((source, name)) => (source, name),
                    None => continue,
                },
            };
            let mut defined = module.clone();
            defined.extend(source.split("::").map(str::to_owned));
            if !files.contains_key(&defined) {
                continue; // Another crate's item (`pub use kube;`, `proxy_core::...`).
            }
            for name in names.split(',') {
                let name = name.split(" as ").last().unwrap_or(name).trim();
                if !name.is_empty() && name != "self" {
                    let mut key = module.clone();
                    key.push(name.to_owned());
                    found.insert(key, defined.clone());
                }
            }
        }
    }
    found
}

/// Module paths a file names (`crate::a::b`, `super::x`), outside comments and its test module.
/// `super::` inside an inline `mod name { ... }` is that inline module's parent.
fn references(from: &ModPath, text: &str) -> Vec<ModPath> {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let mut found = Vec::new();
    // Inline modules open at this point: (name, brace depth before it).
    let mut inline: Vec<(String, i64)> = Vec::new();
    let mut depth: i64 = 0;
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        if let Some(name) = inline_module(line) {
            inline.push((name, depth));
        }
        let mut here = from.clone();
        here.extend(inline.iter().map(|(name, _)| name.clone()));
        for (prefix, base) in [("crate::", Vec::new()), ("super::", parent(&here))] {
            let mut rest = line;
            while let Some(at) = rest.find(prefix) {
                // A word before the prefix (e.g. `my_crate::`) means another crate.
                let before = rest[..at].chars().last();
                rest = &rest[at + prefix.len()..];
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                    continue;
                }
                let mut path = base.clone();
                path.extend(
                    rest.split("::")
                        .map(|seg| {
                            seg.chars()
                                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                                .collect::<String>()
                        })
                        .take_while(|seg| !seg.is_empty()),
                );
                found.push(path);
            }
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        while inline.last().is_some_and(|(_, open)| depth <= *open) {
            inline.pop();
        }
    }
    found
}

/// The name of an inline module a line opens (`pub mod name {`).
fn inline_module(line: &str) -> Option<String> {
    let at = line.find("mod ")?;
    if at > 0 && !line[..at].ends_with(' ') {
        return None;
    }
    let rest = line[at + 4..].trim_start();
    let name: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty() && rest[name.len()..].trim_start().starts_with('{')).then_some(name)
}

fn parent(module: &ModPath) -> ModPath {
    module[..module.len().saturating_sub(1)].to_vec()
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<ModPath, usize>,
        low: BTreeMap<ModPath, usize>,
        stack: Vec<ModPath>,
        on_stack: BTreeSet<ModPath>,
        next: usize,
        out: Vec<Vec<ModPath>>,
    }
    fn visit(s: &mut State<'_>, v: &ModPath) {
        s.index.insert(v.clone(), s.next);
        s.low.insert(v.clone(), s.next);
        s.next += 1;
        s.stack.push(v.clone());
        s.on_stack.insert(v.clone());
        for w in s.edges.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v.clone(), low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v.clone(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut set = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = &w == v;
                set.push(w);
                if done {
                    break;
                }
            }
            set.sort();
            s.out.push(set);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_of(files: &[(&str, &str)]) -> BTreeMap<ModPath, String> {
        files
            .iter()
            .map(|(path, text)| {
                let module = if path.is_empty() {
                    Vec::new()
                } else {
                    path.split("::").map(str::to_owned).collect()
                };
                (module, (*text).to_owned())
            })
            .collect()
    }

    #[test]
    fn a_circle_between_siblings_is_found_and_a_one_way_flow_is_not() {
        let circle = crate_of(&[
            ("", "pub mod a; pub mod b; pub mod c;"),
            ("a", "use crate::b::Thing;"),
            ("b", "pub struct Thing(crate::c::X);"),
            ("c", "fn f() -> crate::a::Y { todo!() }"),
        ]);
        assert_eq!(find_circles(&circle), [["a", "b", "c"]]);
        let one_way = crate_of(&[
            ("", "pub mod a; pub mod b;"),
            (
                "a",
                "use crate::b::Thing; // crate::a::nothing in a comment",
            ),
            (
                "b",
                "/// [`crate::a::A`] in docs\npub struct Thing;\n#[cfg(test)]\nmod tests { use crate::a::A; }",
            ),
        ]);
        assert!(find_circles(&one_way).is_empty());
    }

    #[test]
    fn nested_siblings_are_compared_under_their_parent() {
        let files = crate_of(&[
            ("", "pub mod engine; pub mod frame;"),
            ("engine", "mod server; mod udp; use crate::frame::F;"),
            ("engine::server", "use super::udp::start;"),
            ("engine::udp", "use super::server::leg; use super::*;"),
            ("frame", ""),
        ]);
        assert_eq!(find_circles(&files), [["engine::server", "engine::udp"]]);
    }

    #[test]
    fn a_root_reexport_counts_as_its_defining_module() {
        let files = crate_of(&[
            (
                "",
                "pub mod error; pub mod frame;\npub use error::{Error, Result};",
            ),
            (
                "error",
                "pub enum Error { Frame(crate::frame::FrameError) }",
            ),
            ("frame", "fn read() -> crate::Result<()> { Ok(()) }"),
        ]);
        assert_eq!(find_circles(&files), [["error", "frame"]]);
        let inline = crate_of(&[
            ("", "pub mod error; pub mod proto;\npub use error::Error;"),
            ("error", "use crate::proto::Code;"),
            (
                "proto",
                "pub struct Error;\npub mod rsp {\n    pub enum P { E(super::Error) }\n}\n",
            ),
        ]);
        assert!(
            find_circles(&inline).is_empty(),
            "super:: in an inline module is its parent"
        );
    }
}
