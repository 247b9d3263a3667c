//! The configuration reference as markdown (`kvmesh config reference`, README's
//! "Configuration reference"), generated from the config structs themselves: every key's
//! default from [`KvmeshConfig::default`] (serialised), its description from the field's doc
//! comment in the struct's source (compiled in), its table from the field's type. Nothing is
//! written twice: a new key with its doc comment appears here by itself.

use crate::KvmeshConfig;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The sources of every struct reachable from [`KvmeshConfig`].
const SOURCES: [&str; 7] = [
    include_str!("lib.rs"),
    include_str!("serve.rs"),
    include_str!("mesh.rs"),
    include_str!("prefix.rs"),
    include_str!("sim.rs"),
    include_str!("../../kvmesh-policy/src/config/mod.rs"),
    include_str!("../../kvmesh-policy/src/config/health.rs"),
];

/// A struct field as its source declares it.
#[derive(Debug, Clone)]
struct Field {
    name: String,
    ty: String,
    doc: String,
}

/// `pub struct Name { /// doc \n pub field: Type, ... }` → fields, per struct name.
fn parse_structs() -> BTreeMap<String, Vec<Field>> {
    let mut out: BTreeMap<String, Vec<Field>> = BTreeMap::new();
    for src in SOURCES {
        let mut current: Option<String> = None;
        let mut doc: Vec<String> = Vec::new();
        for line in src.lines() {
            let t = line.trim();
            if let Some(rest) = t.strip_prefix("pub struct ") {
                if let Some(name) = rest.strip_suffix(" {") {
                    current = Some(name.trim().to_string());
                    out.entry(name.trim().to_string()).or_default();
                }
                doc.clear();
                continue;
            }
            let Some(name) = &current else { continue };
            if t == "}" {
                current = None;
                continue;
            }
            if let Some(d) = t.strip_prefix("///") {
                doc.push(d.trim().to_string());
                continue;
            }
            if let Some(rest) = t.strip_prefix("pub ")
                && let Some((field, ty)) = rest.split_once(':')
                && let Some(ty) = ty.trim().strip_suffix(',')
            {
                out.entry(name.clone()).or_default().push(Field {
                    name: field.trim().to_string(),
                    ty: ty.trim().to_string(),
                    doc: plain(&doc.join(" ")),
                });
            }
            if !t.starts_with("#[") {
                doc.clear();
            }
        }
    }
    out
}

/// Constants a doc comment links to, by value: the reference is read as plain text.
fn constant(name: &str) -> Option<String> {
    match name {
        "MAX_CANDIDATES" => Some(kvmesh_policy::MAX_CANDIDATES.to_string()),
        _ => None,
    }
}

/// A doc comment as plain text: rustdoc's links (`` [`x`] ``, `` [`x`](path) ``) become
/// their code (`` `x` ``), and a linked constant its value (QA: "at most
/// [`MAX_CANDIDATES`]" gave no number).
fn plain(doc: &str) -> String {
    let mut out = String::with_capacity(doc.len());
    let mut rest = doc;
    while let Some(i) = rest.find("[`") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(j) = after.find("`]") else {
            out.push_str(&rest[i..]);
            return out;
        };
        let name = &after[..j];
        let mut tail = &after[j + 2..];
        // An explicit target, `(path)`, is dropped.
        if tail.starts_with('(')
            && let Some(k) = tail.find(')')
        {
            tail = &tail[k + 1..];
        }
        match constant(name) {
            Some(v) => out.push_str(&v),
            None => {
                out.push('`');
                out.push_str(name);
                out.push('`');
            }
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// The element default of a list or map of structs (its entries have no default in the
/// serialised defaults, which hold none).
fn element_default(ty: &str) -> Option<toml::Value> {
    let v = match ty {
        "EngineEntry" => toml::Value::try_from(crate::EngineEntry::default()),
        "DnsEntry" => toml::Value::try_from(crate::DnsEntry::default()),
        "ModelConfig" => toml::Value::try_from(crate::ModelConfig::default()),
        _ => return None,
    };
    v.ok()
}

fn inner<'a>(ty: &'a str, wrapper: &str) -> Option<&'a str> {
    ty.strip_prefix(wrapper)?.strip_suffix('>')
}

fn show(v: Option<&toml::Value>) -> String {
    match v {
        None => "unset".into(),
        Some(toml::Value::String(s)) if s.is_empty() => "`\"\"`".into(),
        Some(v) => format!("`{v}`"),
    }
}

struct Walk<'a> {
    structs: &'a BTreeMap<String, Vec<Field>>,
    out: String,
}

impl Walk<'_> {
    /// One table: its scalar keys as rows, then its sub-tables.
    fn table(&mut self, heading: &str, ty: &str, value: Option<&toml::Value>) {
        let Some(fields) = self.structs.get(ty) else {
            return;
        };
        let mut nested = Vec::new();
        let mut rows = String::new();
        for f in fields {
            let v = value.and_then(|v| v.get(&f.name));
            let path = |h: &str| {
                let h = h.trim_start_matches("[[").trim_start_matches('[');
                let h = h.trim_end_matches("]]").trim_end_matches(']');
                format!("{h}.{}", f.name)
            };
            if self.structs.contains_key(&f.ty) {
                nested.push((format!("[{}]", path(heading)), f.ty.clone(), v.cloned()));
            } else if let Some(e) = inner(&f.ty, "Vec<").filter(|e| self.structs.contains_key(*e)) {
                let _ = writeln!(
                    rows,
                    "| `{}` | `[]` | {} (a list of `[[{}]]` tables, below) |",
                    f.name,
                    f.doc.replace('|', "\\|"),
                    path(heading)
                );
                nested.push((
                    format!("[[{}]]", path(heading)),
                    e.to_string(),
                    element_default(e),
                ));
            } else if let Some(e) =
                inner(&f.ty, "BTreeMap<String, ").filter(|e| self.structs.contains_key(*e))
            {
                let _ = writeln!(
                    rows,
                    "| `{}` | `{{}}` | {} (tables `[{}.NAME]`, below) |",
                    f.name,
                    f.doc.replace('|', "\\|"),
                    path(heading)
                );
                nested.push((
                    format!("[{}.NAME]", path(heading)),
                    e.to_string(),
                    element_default(e),
                ));
            } else {
                let _ = writeln!(
                    rows,
                    "| `{}` | {} | {} |",
                    f.name,
                    show(v),
                    f.doc.replace('|', "\\|")
                );
            }
        }
        if !rows.is_empty() {
            let _ = writeln!(self.out, "\n`{heading}`\n");
            let _ = writeln!(self.out, "| key | default | meaning |\n|---|---|---|");
            self.out.push_str(&rows);
        }
        for (h, t, v) in nested {
            self.table(&h, &t, v.as_ref());
        }
    }
}

/// The whole reference, as markdown.
pub fn reference_markdown() -> String {
    let structs = parse_structs();
    let defaults = toml::Value::try_from(KvmeshConfig::default()).ok();
    let mut w = Walk {
        structs: &structs,
        out: String::new(),
    };
    let _ = writeln!(
        w.out,
        "Generated by `kvmesh config reference` from the config structs (defaults from their \
         `Default`, meanings from their doc comments). Every key is optional; a file sets only \
         what differs (`kvmesh config check FILE` loads what the file names — tokenizers, \
         profiles and, when it names the router, its mesh certificates — and prints the \
         effective configuration; what a router's flags may still give, its engines and its \
         `node_id`, it notes rather than refuses)."
    );
    for f in structs.get("KvmeshConfig").into_iter().flatten() {
        let v = defaults.as_ref().and_then(|d| d.get(&f.name));
        w.table(&format!("[{}]", f.name), &f.ty, v);
    }
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of the serialised defaults is in the reference, with a meaning.
    #[test]
    fn every_default_key_is_documented() {
        let md = reference_markdown();
        fn walk(prefix: &str, v: &toml::Value, md: &str) {
            let toml::Value::Table(t) = v else { return };
            for (k, v) in t {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if matches!(v, toml::Value::Table(t) if !t.is_empty()) {
                    walk(&path, v, md);
                } else if matches!(v, toml::Value::Table(_)) && md.contains(&format!("`[{path}]`"))
                {
                    // A table of optional keys, all unset by default: its own section.
                } else {
                    let table = prefix;
                    let start = md
                        .find(&format!("`[{table}]`"))
                        .unwrap_or_else(|| panic!("no table [{table}]"));
                    let section = &md[start..];
                    let end = section[3..].find("\n`[").map_or(section.len(), |e| e + 3);
                    let row = section[..end]
                        .lines()
                        .find(|l| l.starts_with(&format!("| `{k}` |")))
                        .unwrap_or_else(|| panic!("no row for {path}"));
                    let meaning = row.rsplit('|').nth(1).unwrap_or("").trim();
                    assert!(!meaning.is_empty(), "{path} has no doc comment: {row}");
                }
            }
        }
        let d = toml::Value::try_from(KvmeshConfig::default()).expect("defaults");
        walk("", &d, &md);
    }

    /// README's "Configuration reference" is this text, not a copy that drifts.
    #[test]
    fn readme_holds_the_generated_reference() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        let readme = std::fs::read_to_string(path).expect("README.md");
        let (start, end) = (
            "<!-- config-reference:start -->\n",
            "<!-- config-reference:end -->",
        );
        let from = readme.find(start).expect("start marker") + start.len();
        let to = readme.find(end).expect("end marker");
        assert!(
            readme[from..to] == reference_markdown(),
            "README.md's configuration reference is out of date: replace the text between the \
             markers with `kvmesh config reference`"
        );
    }

    /// Doc comments are read as plain text: no rustdoc link is left (QA: "at most
    /// [`MAX_CANDIDATES`]", "[`stable_hash`](crate::stable_hash)").
    #[test]
    fn reference_has_no_rustdoc_links() {
        let md = reference_markdown();
        for leftover in ["[`", "`](", "](crate::"] {
            assert!(!md.contains(leftover), "{leftover} in the reference");
        }
        assert!(md.contains("at most 8."), "candidates' bound, as a number");
        assert_eq!(
            plain("a [`b`](crate::b), [`MAX_CANDIDATES`] and [`c`]."),
            "a `b`, 8 and `c`."
        );
    }

    #[test]
    fn defaults_are_read_from_the_struct() {
        let md = reference_markdown();
        let listen = crate::ServeConfig::default().listen;
        assert!(
            md.contains(&format!("| `listen` | `\"{listen}\"` |")),
            "{md}"
        );
        assert!(md.contains("`[[serve.engines]]`"));
        assert!(md.contains("`[serve.mesh]`"));
    }
}
