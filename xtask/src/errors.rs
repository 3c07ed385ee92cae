//! `cargo xtask errors`: one rule for the error types of every crate of the workspace.
//!
//! The rule (issue 38): a variant with a cause returns it from `source()` and does not repeat it
//! in its message. Printing the whole chain is the binaries' job (`netkit_runtime::error_chain`);
//! a message that also printed its cause would show it twice there, and a cause kept out of
//! `source()` is lost to callers that walk the chain (`downcast_ref`, retry logic).
//!
//! Every Rust file of every member (`src`, `tests`, `examples`, `benches`, `build.rs`) is parsed
//! with `syn`; each type deriving `Error` (thiserror) is checked variant by variant. A field is a
//! cause when it is marked `#[source]` or `#[from]`, is named `source`, or holds an error: a type
//! named `*Error` (`io::Error`, `kube::Error`, `ConnectError`), `dyn Error`, or a generic bound by
//! `Error`, also inside `Box`, `Arc`, `Rc` or `Option`. A cause must be the source (one of those
//! markers, or the variant is `#[error(transparent)]`), and the `#[error("...")]` format and its
//! arguments must not name it.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use syn::spanned::Spanned as _;
use syn::visit::Visit;

/// Offences still to be fixed, as `crate: Type::Variant` (no file: a module may move). A
/// ratchet, as in `modules.rs`: any other offence fails, and so does a listed one that is gone
/// (take it off). None is left; the list stays for a rule that grows.
const KNOWN: [&str; 0] = [];

pub fn run() -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let mut offences = Vec::new();
    let mut known = Vec::new();
    for member in netkit_testenv::workspace::members(&root)? {
        let mut types = 0;
        let mut variants = 0;
        let mut open = 0;
        let mut failed = 0;
        for file in rust_files(&root.join(&member))? {
            let relative = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .display()
                .to_string();
            let text =
                std::fs::read_to_string(&file).with_context(|| format!("reading {relative}"))?;
            let found = check_source(&text).with_context(|| format!("parsing {relative}"))?;
            types += found.types;
            variants += found.variants;
            for offence in found.offences {
                let key = format!("{member}: {}", offence.item);
                if KNOWN.contains(&key.as_str()) {
                    println!(
                        "open {relative}:{}: {} (known)",
                        offence.line,
                        offence.describe()
                    );
                    known.push(key);
                    open += 1;
                } else {
                    offences.push(format!(
                        "{relative}:{}: {}",
                        offence.line,
                        offence.describe()
                    ));
                    failed += 1;
                }
            }
        }
        let state = if failed > 0 { "FAIL" } else { "ok  " };
        let open = if open > 0 {
            format!(", {open} known offences")
        } else {
            String::new()
        };
        println!("{state} {member}: {types} error types, {variants} variants{open}");
    }
    let gone: Vec<_> = KNOWN
        .iter()
        .filter(|k| !known.iter().any(|f| f.as_str() == **k))
        .collect();
    if !offences.is_empty() {
        bail!(
            "{} error variants break the rule (a cause is returned by source() and not printed \
             in the message; see xtask/src/errors.rs):\n  {}",
            offences.len(),
            offences.join("\n  ")
        );
    }
    if !gone.is_empty() {
        bail!(
            "known offences no longer found: take them off KNOWN (xtask/src/errors.rs): {gone:?}"
        );
    }
    Ok(())
}

/// Every `.rs` file of a member's targets, sorted (the output is stable).
fn rust_files(member: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs: Vec<PathBuf> = ["src", "tests", "examples", "benches"]
        .iter()
        .map(|d| member.join(d))
        .filter(|d| d.is_dir())
        .collect();
    if member.join("build.rs").is_file() {
        files.push(member.join("build.rs"));
    }
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// What one file holds.
#[derive(Debug, Default)]
struct Found {
    types: usize,
    variants: usize,
    offences: Vec<Offence>,
}

#[derive(Debug, PartialEq, Eq)]
struct Offence {
    line: usize,
    /// `Type` or `Type::Variant`.
    item: String,
    field: String,
    kind: OffenceKind,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum OffenceKind {
    /// A cause that `source()` does not return.
    HiddenCause,
    /// The message prints a cause.
    PrintsCause,
}

impl Offence {
    fn describe(&self) -> String {
        let (item, field) = (&self.item, &self.field);
        match self.kind {
            OffenceKind::HiddenCause => format!(
                "{item}: field `{field}` holds an error that source() does not return (mark it #[source])"
            ),
            OffenceKind::PrintsCause => format!(
                "{item}: the message prints its cause `{field}` (say what failed at this level; the chain prints the cause)"
            ),
        }
    }
}

fn check_source(text: &str) -> syn::Result<Found> {
    let file = syn::parse_file(text)?;
    let mut visitor = ErrorTypes::default();
    visitor.visit_file(&file);
    Ok(visitor.found)
}

#[derive(Default)]
struct ErrorTypes {
    found: Found,
}

impl<'ast> Visit<'ast> for ErrorTypes {
    fn visit_item_enum(&mut self, item: &'ast syn::ItemEnum) {
        if derives_error(&item.attrs) {
            let generics = error_generics(&item.generics);
            self.found.types += 1;
            for variant in &item.variants {
                self.found.variants += 1;
                let name = format!("{}::{}", item.ident, variant.ident);
                check_variant(
                    &name,
                    &variant.attrs,
                    &variant.fields,
                    &generics,
                    &mut self.found,
                );
            }
        }
        syn::visit::visit_item_enum(self, item);
    }

    fn visit_item_struct(&mut self, item: &'ast syn::ItemStruct) {
        if derives_error(&item.attrs) {
            let generics = error_generics(&item.generics);
            self.found.types += 1;
            self.found.variants += 1;
            let name = item.ident.to_string();
            check_variant(&name, &item.attrs, &item.fields, &generics, &mut self.found);
        }
        syn::visit::visit_item_struct(self, item);
    }
}

/// `#[derive(..., Error)]`, whatever path it is named by (`thiserror::Error`, `Error`).
fn derives_error(attrs: &[syn::Attribute]) -> bool {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("derive"))
        .any(|a| {
            a.parse_args_with(
                syn::punctuated::Punctuated::<syn::Path, syn::Token![,]>::parse_terminated,
            )
            .is_ok_and(|paths| {
                paths
                    .iter()
                    .any(|p| p.segments.last().is_some_and(|s| s.ident == "Error"))
            })
        })
}

/// The type parameters bound by a trait named `Error` (inline or in the `where` clause).
fn error_generics(generics: &syn::Generics) -> Vec<String> {
    let is_error_bound = |bound: &syn::TypeParamBound| match bound {
        syn::TypeParamBound::Trait(t) => t.path.segments.last().is_some_and(|s| s.ident == "Error"),
        _ => false,
    };
    let mut names: Vec<String> = generics
        .type_params()
        .filter(|p| p.bounds.iter().any(is_error_bound))
        .map(|p| p.ident.to_string())
        .collect();
    for predicate in generics.where_clause.iter().flat_map(|w| &w.predicates) {
        if let syn::WherePredicate::Type(t) = predicate
            && t.bounds.iter().any(is_error_bound)
            && let syn::Type::Path(p) = &t.bounded_ty
            && let Some(ident) = p.path.get_ident()
        {
            names.push(ident.to_string());
        }
    }
    names
}

/// Whether a field's type holds an error.
fn is_error_type(ty: &syn::Type, generics: &[String]) -> bool {
    match ty {
        syn::Type::Path(p) => {
            let Some(last) = p.path.segments.last() else {
                return false;
            };
            let name = last.ident.to_string();
            if matches!(name.as_str(), "Box" | "Arc" | "Rc" | "Option") {
                return match &last.arguments {
                    syn::PathArguments::AngleBracketed(args) => args.args.iter().any(|a| {
                        matches!(a, syn::GenericArgument::Type(inner) if is_error_type(inner, generics))
                    }),
                    _ => false,
                };
            }
            name.ends_with("Error") || (p.path.segments.len() == 1 && generics.contains(&name))
        }
        syn::Type::TraitObject(t) => t.bounds.iter().any(|b| {
            matches!(b, syn::TypeParamBound::Trait(t) if t.path.segments.last().is_some_and(|s| s.ident == "Error"))
        }),
        syn::Type::Paren(p) => is_error_type(&p.elem, generics),
        syn::Type::Group(g) => is_error_type(&g.elem, generics),
        syn::Type::Reference(r) => is_error_type(&r.elem, generics),
        _ => false,
    }
}

/// The `#[error(...)]` of a variant: transparent, or its format and its arguments' tokens.
enum Message {
    Transparent,
    Format {
        format: String,
        args: proc_macro2::TokenStream,
    },
}

fn message(attrs: &[syn::Attribute]) -> Option<Message> {
    let attr = attrs.iter().find(|a| a.path().is_ident("error"))?;
    let syn::Meta::List(list) = &attr.meta else {
        return None;
    };
    let tokens = list.tokens.clone();
    if syn::parse2::<syn::Ident>(tokens.clone()).is_ok_and(|i| i == "transparent") {
        return Some(Message::Transparent);
    }
    let parser = |input: syn::parse::ParseStream<'_>| -> syn::Result<Message> {
        let format: syn::LitStr = input.parse()?;
        let args: proc_macro2::TokenStream = input.parse()?;
        Ok(Message::Format {
            format: format.value(),
            args,
        })
    };
    syn::parse::Parser::parse2(parser, tokens).ok()
}

fn check_variant(
    item: &str,
    attrs: &[syn::Attribute],
    fields: &syn::Fields,
    generics: &[String],
    found: &mut Found,
) {
    let Some(message) = message(attrs) else {
        // No #[error] here: thiserror refuses it, the compiler says so.
        return;
    };
    let (printed, transparent) = match &message {
        Message::Transparent => (Vec::new(), true),
        Message::Format { format, args } => {
            let mut names = format_names(format);
            argument_names(args.clone(), &mut names);
            (names, false)
        }
    };
    for (index, field) in fields.iter().enumerate() {
        let name = field
            .ident
            .as_ref()
            .map_or_else(|| index.to_string(), ToString::to_string);
        let marked = name == "source"
            || field
                .attrs
                .iter()
                .any(|a| a.path().is_ident("source") || a.path().is_ident("from"));
        if !marked && !is_error_type(&field.ty, generics) {
            continue;
        }
        // The field's name (or type), not its doc comment, which spans lines above it.
        let line = field
            .ident
            .as_ref()
            .map_or_else(|| field.ty.span(), syn::Ident::span)
            .start()
            .line;
        let mut offence = |kind| {
            found.offences.push(Offence {
                line,
                item: item.to_owned(),
                field: name.clone(),
                kind,
            });
        };
        if !marked && !transparent {
            offence(OffenceKind::HiddenCause);
        }
        if printed.contains(&name) {
            offence(OffenceKind::PrintsCause);
        }
    }
}

/// The names a format string interpolates (`{cause}`, `{0:?}`); positional `{}` are found in the
/// arguments instead.
fn format_names(format: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
            }
            '{' => {
                let inner: String = chars.by_ref().take_while(|&c| c != '}').collect();
                let name = inner.split(':').next().unwrap_or("").trim();
                if !name.is_empty() {
                    names.push(name.to_owned());
                }
            }
            _ => {}
        }
    }
    names
}

/// The field names the extra format arguments use: bare (`cause.len()`) or thiserror's `.0` and
/// `.cause` forms.
fn argument_names(tokens: proc_macro2::TokenStream, names: &mut Vec<String>) {
    use proc_macro2::TokenTree;
    let mut after_dot = false;
    for token in tokens {
        let dot = matches!(&token, TokenTree::Punct(p) if p.as_char() == '.');
        match token {
            TokenTree::Ident(ident) => names.push(ident.to_string()),
            TokenTree::Literal(literal) if after_dot => {
                // `.0` (a tuple field); `.0.1` lexes as one float literal.
                let text = literal.to_string();
                names.push(text.split('.').next().unwrap_or("").to_owned());
            }
            TokenTree::Group(group) => argument_names(group.stream(), names),
            _ => {}
        }
        after_dot = dot;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// Each offence as `line Type::Variant.field Kind`.
    fn offences(text: &str) -> Vec<String> {
        check_source(text)
            .expect("parses")
            .offences
            .into_iter()
            .map(|o| format!("{} {}.{} {:?}", o.line, o.item, o.field, o.kind))
            .collect()
    }

    #[test]
    fn a_type_that_keeps_the_rule_passes() {
        let text = r#"
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind { addr: SocketAddr, #[source] cause: io::Error },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("reading {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid object: {0}")]
    Invalid(String),
    #[error("engine error {code}: {message}")]
    Engine { code: EngineErrorCode, message: String },
    #[error("invalid response: {reason}")]
    Response { reason: String, #[source] cause: Option<Arc<dyn std::error::Error + Send + Sync>> },
    #[error("wrapped")]
    Wrapped(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

#[derive(Debug, thiserror::Error)]
#[error("starting")]
struct Outer(#[source] std::io::Error);

#[derive(Debug, Clone)]
enum NotAnError { Io(std::io::Error) }
"#;
        let found = check_source(text).expect("parses");
        assert_eq!(found.offences, Vec::new());
        assert_eq!((found.types, found.variants), (2, 8));
    }

    #[test]
    fn a_message_that_prints_its_source_is_an_offence() {
        let text = r#"
#[derive(Debug, thiserror::Error)]
enum E {
    #[error("cannot start the accept workers: {0}")]
    Workers(#[source] io::Error),
    #[error("decoding: {0:?}")]
    Decode(#[from] serde_yaml_ng::Error),
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}
"#;
        assert_eq!(
            offences(text),
            [
                "5 E::Workers.0 PrintsCause",
                "7 E::Decode.0 PrintsCause",
                "9 E::Read.source PrintsCause",
            ]
        );
    }

    #[test]
    fn a_cause_kept_from_source_is_an_offence() {
        let text = r#"
#[derive(Debug, Error)]
pub enum Error {
    #[error("Kubernetes API call failed")]
    Kube(kube::Error),
    #[error("operations server on {addr}: {cause}")]
    Serve { addr: SocketAddr, cause: std::io::Error },
    #[error("all {tried} healthy targets failed")]
    AllFailed { tried: usize, last: Box<ConnectError> },
    #[error("metrics TLS ({what}): {}", chain(cause.as_ref()))]
    Tls { what: String, cause: Box<dyn std::error::Error + Send + Sync> },
}
"#;
        assert_eq!(
            offences(text),
            [
                "5 Error::Kube.0 HiddenCause",
                "7 Error::Serve.cause HiddenCause",
                "7 Error::Serve.cause PrintsCause",
                "9 Error::AllFailed.last HiddenCause",
                "11 Error::Tls.cause HiddenCause",
                "11 Error::Tls.cause PrintsCause",
            ]
        );
    }

    #[test]
    fn structs_generics_nested_modules_and_dot_arguments_are_seen() {
        let text = r#"
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("starting: {0}")]
    struct Repeats(#[source] std::io::Error);
}
#[derive(Debug, thiserror::Error)]
enum Failure<E: std::error::Error + 'static> {
    #[error(transparent)]
    Reconciler(E),
    #[error("reconciler failed")]
    Hidden(E),
    #[error("{}", .0)]
    Dotted(#[source] ValueError),
}
"#;
        assert_eq!(
            offences(text),
            [
                "5 Repeats.0 PrintsCause",
                "12 Failure::Hidden.0 HiddenCause",
                "14 Failure::Dotted.0 PrintsCause",
            ]
        );
    }

    #[test]
    fn format_names_skip_escapes_and_specs() {
        assert_eq!(
            format_names("{{literal}} {a} {b:?} {0:>4} {} {{{c}}}"),
            vec!["a", "b", "0", "c"]
        );
    }
}
