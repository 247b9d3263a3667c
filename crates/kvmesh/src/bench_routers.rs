//! `kvmesh bench --routers N[:mesh|:no-mesh]` (repeatable): the router contenders of a run
//! and their names.

use kvmesh_config::PolicyKind;

/// `--routers N[:mesh|:no-mesh]`: a router count and whether they mesh (`None`: as
/// `--no-mesh` says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterSpec {
    /// Routers.
    pub n: u32,
    /// Meshed, independent, or as the global flag says.
    pub mesh: Option<bool>,
}

pub fn parse(v: &str) -> Result<RouterSpec, String> {
    let (n, mesh) = match v.split_once(':') {
        None => (v, None),
        Some((n, "mesh")) => (n, Some(true)),
        Some((n, "no-mesh")) => (n, Some(false)),
        Some((_, m)) => {
            return Err(format!(
                "`{m}`: expected `mesh` or `no-mesh` after the colon"
            ));
        }
    };
    let n = n
        .trim()
        .parse::<u32>()
        .map_err(|e| format!("`{n}`: not a router count ({e})"))?;
    if n > 64 {
        return Err(format!("{n} routers: at most 64 on one machine"));
    }
    Ok(RouterSpec { n, mesh })
}

/// The (routers, meshed) of each contender group, in the order given, duplicates dropped;
/// `default_n` without `--routers`; a bare count meshes unless `no_mesh`; one router never
/// meshes.
pub fn resolve(specs: &[RouterSpec], default_n: u32, no_mesh: bool) -> Vec<(u32, bool)> {
    let default = [RouterSpec {
        n: default_n,
        mesh: None,
    }];
    let specs = if specs.is_empty() {
        &default[..]
    } else {
        specs
    };
    let mut out: Vec<(u32, bool)> = Vec::new();
    for r in specs {
        let v = (r.n, r.n > 1 && r.mesh.unwrap_or(!no_mesh));
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// A kvmesh contender's name in reports: `precise`, `precise x3 mesh`, `precise x3 no-mesh`.
pub fn contender_name(policy: PolicyKind, routers: u32, mesh: bool) -> String {
    match routers {
        0 => "direct (no router)".into(),
        1 => policy.as_str().to_string(),
        n => format!(
            "{} x{n} {}",
            policy.as_str(),
            if mesh { "mesh" } else { "no-mesh" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_specs_parse_and_refuse_clearly() {
        assert_eq!(parse("3"), Ok(RouterSpec { n: 3, mesh: None }));
        assert_eq!(
            parse("3:mesh"),
            Ok(RouterSpec {
                n: 3,
                mesh: Some(true)
            })
        );
        assert_eq!(
            parse("8:no-mesh"),
            Ok(RouterSpec {
                n: 8,
                mesh: Some(false)
            })
        );
        assert!(parse("3:meshed").unwrap_err().contains("meshed"));
        assert!(parse("x").unwrap_err().contains("not a router count"));
        assert!(parse("65").is_err());
    }

    #[test]
    fn specs_resolve_in_order_without_duplicates_and_one_router_never_meshes() {
        let spec = |n, mesh| RouterSpec { n, mesh };
        assert_eq!(resolve(&[], 1, false), [(1, false)]);
        assert_eq!(resolve(&[], 3, true), [(3, false)]);
        assert_eq!(
            resolve(
                &[
                    spec(1, Some(true)),
                    spec(3, None),
                    spec(3, Some(false)),
                    spec(3, Some(true))
                ],
                1,
                false
            ),
            [(1, false), (3, true), (3, false)]
        );
        assert_eq!(resolve(&[spec(3, None)], 1, true), [(3, false)]);
    }
}
