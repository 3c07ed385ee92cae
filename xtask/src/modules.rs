//! `cargo xtask modules`: no import circles between the modules of any crate of the workspace.
//!
//! Each crate's Layout promises that data flows one way between its modules. This reads every
//! module file of every workspace member (the library tree when a crate has one, else the
//! binary's), takes each `crate::a::b` and `super::x` path outside comments and test modules,
//! lifts it to the two sibling modules it connects (the children of their nearest common
//! ancestor; a module using its own ancestors or descendants is not an edge), and fails on any
//! strongly connected set of more than one sibling.
//!
//! Glob imports are seen through: a name reached through a module that glob-imports a child
//! (`use control::*`) counts as that child's, and a module that glob-imports its parent
//! (`use super::*`) depends on every glob-imported sibling whose items it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::bail;

/// A module path inside a crate, e.g. `["engine", "udp"]`.
type ModPath = Vec<String>;

pub fn run() -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let mut circles = Vec::new();
    for member in netkit_testenv::workspace::members(&root)? {
        let files = module_files(&root.join(&member).join("src"))?;
        let found = find_circles(&files);
        if found.is_empty() {
            println!("ok   {member}: {} modules, no import circles", files.len());
        }
        circles.extend(
            found
                .into_iter()
                .map(|circle| format!("{member}: {}", circle.join(" <-> "))),
        );
    }
    if !circles.is_empty() {
        bail!("import circles:\n  {}", circles.join("\n  "));
    }
    Ok(())
}

/// Every module file under `src` with its module path and text: the library's tree when the
/// crate has `lib.rs` (its binaries then only use the library), else `main.rs`'s. `src/bin/*` are
/// crate roots of their own that declare no modules.
fn module_files(src: &Path) -> anyhow::Result<BTreeMap<ModPath, String>> {
    let has_library = src.join("lib.rs").is_file();
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                if path != src.join("bin") {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs")
                || (has_library && path == src.join("main.rs"))
            {
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
    let globs = glob_imports(files);
    let defined: BTreeMap<&ModPath, BTreeSet<String>> = files
        .iter()
        .map(|(module, text)| (module, top_level_items(text)))
        .collect();
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, text) in files {
        let mut targets = references(from, text);
        // `use super::*` brings in what the parent glob-imported from its other children: a name
        // one of them defines, used bare here, is a path to it.
        let words = identifiers(without_tests(text));
        for imported in globs.get(from).into_iter().flatten() {
            for sibling in globs.get(imported).into_iter().flatten() {
                if sibling != from
                    && defined
                        .get(sibling)
                        .is_some_and(|items| !items.is_disjoint(&words))
                {
                    targets.push(sibling.clone());
                }
            }
        }
        for target in targets {
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
                } else if let Some(child) = globs.get(&to).into_iter().flatten().find(|child| {
                    child.starts_with(&to) && defined.get(child).is_some_and(|d| d.contains(name))
                }) {
                    // `super::Thing` where the parent has `use child::*`: the child's item.
                    to.clone_from(child);
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
        for statement in statements(text) {
            let statement = statement.as_str();
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

/// The modules each module glob-imports (`use child::*`, `use super::*`, `use crate::a::*`),
/// outside its test module.
fn glob_imports(files: &BTreeMap<ModPath, String>) -> BTreeMap<ModPath, Vec<ModPath>> {
    let mut found: BTreeMap<ModPath, Vec<ModPath>> = BTreeMap::new();
    for (module, text) in files {
        for statement in statements(without_tests(text)) {
            let statement = statement.as_str();
            let Some(path) = statement
                .strip_prefix("pub ")
                .or_else(|| statement.strip_prefix("pub(crate) "))
                .unwrap_or(statement)
                .strip_prefix("use ")
                .and_then(|p| p.strip_suffix("::*"))
            else {
                continue;
            };
            let mut target = module.clone();
            for segment in path.split("::") {
                match segment {
                    "crate" => target.clear(),
                    "self" => {}
                    "super" => target = parent(&target),
                    name => target.push(name.to_owned()),
                }
            }
            if files.contains_key(&target) && &target != module {
                found.entry(module.clone()).or_default().push(target);
            }
        }
    }
    found
}

/// Names of the items a module file defines at its top level (rustfmt puts them in column 0).
fn top_level_items(text: &str) -> BTreeSet<String> {
    const KINDS: [&str; 9] = [
        "fn", "struct", "enum", "trait", "type", "const", "static", "mod", "union",
    ];
    let mut items = BTreeSet::new();
    for line in without_tests(text).lines() {
        if line.starts_with(char::is_whitespace) {
            continue;
        }
        let mut words = line
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty());
        while let Some(word) = words.next() {
            if KINDS.contains(&word) {
                if let Some(name) = words.next() {
                    items.insert(name.to_owned());
                }
                break;
            }
        }
    }
    items
}

/// Every identifier in code, comments dropped.
fn identifiers(code: &str) -> BTreeSet<String> {
    code.lines()
        .flat_map(|line| {
            line.split("//")
                .next()
                .unwrap_or("")
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        })
        .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        .map(str::to_owned)
        .collect()
}

/// The `;`-separated statements of a file on one line each, without comment and attribute lines.
fn statements(text: &str) -> Vec<String> {
    text.split(';')
        .map(|statement| {
            statement
                .lines()
                .map(str::trim)
                .filter(|line| {
                    !line.is_empty() && !line.starts_with("//") && !line.starts_with('#')
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// A module file without its `#[cfg(test)] mod tests`.
fn without_tests(text: &str) -> &str {
    text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text)
}

/// Module paths a file names (`crate::a::b`, `super::x`), outside comments and its test module.
/// `super::` inside an inline `mod name { ... }` is that inline module's parent.
fn references(from: &ModPath, text: &str) -> Vec<ModPath> {
    let code = without_tests(text);
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

    #[test]
    fn glob_imports_are_seen_through() {
        // The parent glues its children with globs; each child takes the parent's glob and names
        // the other's items bare: a circle no path shows.
        let glued = crate_of(&[
            ("", "mod client;"),
            (
                "client",
                "mod control;\nmod tasks;\nuse control::*;\nuse tasks::*;",
            ),
            (
                "client::control",
                "//! Docs.\n\nuse super::*;\n\npub(super) struct Shared;\nfn start() { spawn(writer_task()); }",
            ),
            (
                "client::tasks",
                "use super::*;\n\npub(super) async fn writer_task(s: Shared) {}",
            ),
        ]);
        assert_eq!(find_circles(&glued), [["client::control", "client::tasks"]]);
        // One way only: tasks names control's item, control names nothing of tasks.
        let one_way = crate_of(&[
            ("", "mod client;"),
            (
                "client",
                "mod control;\nmod tasks;\nuse control::*;\nuse tasks::*;",
            ),
            (
                "client::control",
                "use super::*;\n\npub(super) struct Shared;",
            ),
            (
                "client::tasks",
                "use super::*;\n\npub(super) async fn writer_task(s: Shared) {}",
            ),
        ]);
        assert!(find_circles(&one_way).is_empty());
        // `super::Shared` through the parent's `use control::*` is control's.
        let through_parent = crate_of(&[
            ("", "mod client;"),
            ("client", "mod control;\nmod tasks;\nuse control::*;"),
            (
                "client::control",
                "pub(super) struct Shared;\nfn f() { super::tasks::run() }",
            ),
            ("client::tasks", "pub fn run(s: super::Shared) {}"),
        ]);
        assert_eq!(
            find_circles(&through_parent),
            [["client::control", "client::tasks"]]
        );
    }
}
