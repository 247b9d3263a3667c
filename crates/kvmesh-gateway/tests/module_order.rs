//! The gateway's modules import each other one way only: each module's `crate::…` paths name
//! only modules before it in [`ORDER`] (leaves first), so there is no import cycle.
//! ARCHITECTURE.md ("The gateway's modules") gives the same order.

use std::path::Path;

/// Leaves first; a module may import only modules listed before it.
const ORDER: [&str; 21] = [
    "clock", "upstream", "tasks", "hops", "cors", "recent", "memo", "sse", "prefix", "engine",
    "registry", "metrics", "gateway", "models", "ingest", "track", "probe", "cluster", "proxy",
    "admin", "status",
];

#[test]
fn modules_import_only_modules_listed_before_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let mut declared: Vec<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")
                .and_then(|m| m.strip_suffix(';'))
                .map(str::to_string)
        })
        .collect();
    declared.sort();
    let mut listed: Vec<String> = ORDER.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(declared, listed, "ORDER must list exactly lib.rs's modules");
    let order: Vec<String> = ORDER.iter().map(|s| s.to_string()).collect();
    for (pos, m) in order.iter().enumerate() {
        // A module's submodules (src/<m>/*.rs) import on its behalf.
        let mut text = std::fs::read_to_string(src.join(format!("{m}.rs"))).expect("module file");
        for f in rust_files(&src.join(m)) {
            text.push_str(&std::fs::read_to_string(f).expect("submodule file"));
        }
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                let name: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if name.is_empty() {
                    continue; // crate::Type re-exported at the root
                }
                let Some(dep) = order.iter().position(|o| *o == name) else {
                    panic!("{m}.rs imports crate::{name}, which is not a module of lib.rs");
                };
                assert!(
                    dep < pos,
                    "{m}.rs imports crate::{name}, declared after it: imports must point to \
                     modules declared earlier in lib.rs (order: {order:?})"
                );
            }
        }
    }
}

#[test]
fn no_module_uses_a_root_re_export() {
    // `crate::Gateway` and the like would import the root, which imports every module.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for p in rust_files(&src) {
        if p.file_name().is_some_and(|n| n == "lib.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&p).expect("file");
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                let next = code[i + 7..].chars().next();
                assert!(
                    !next.is_some_and(|c| c.is_ascii_uppercase()),
                    "{}: `{}` uses a root re-export",
                    p.display(),
                    line.trim()
                );
            }
        }
    }
}

/// The `.rs` files under `dir` (recursively; none when it does not exist).
fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in rd {
        let p = entry.expect("entry").path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}
