//! The material of a CA rotation (`do = "rotate_ca"`): the three steps of README's
//! *Renewing and rotating the mesh's certificates*, as directories each router's own link is
//! swapped to, the way Kubernetes swaps a mounted Secret (all files at once, by a rename).
//!
//! - phase 0: the first CA and its pairs (what `kvmesh cert` wrote for the lab);
//! - phase 1: `ca.pem` holds both CAs, the pairs unchanged;
//! - phase 2: both CAs, each router's pair signed by the second CA;
//! - phase 3: the second CA alone, its pairs.
//!
//! Each phase is compatible with the one before and the one after it, so the routers may take
//! them one by one, in any order within a phase.

use crate::client;
use crate::run::wait_every;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a router may take to read a phase (it reads its files every `RELOAD_MS`).
const TAKE_WITHIN: Duration = Duration::from_secs(10);

/// How often a router is asked whether it took a phase.
const POLL: Duration = Duration::from_millis(20);

/// The routers' `serve.mesh.tls_reload_ms` in a lab that rotates its CA.
pub const RELOAD_MS: u64 = 200;

/// What each phase is, for the step's log.
pub const PHASES: [&str; 4] = [
    "the first CA",
    "both CAs trusted",
    "pairs of the second CA",
    "the first CA dropped",
];

/// The phase directories of a lab and the routers' links to them.
pub struct Rotation {
    dir: PathBuf,
}

fn io(what: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", what.display())
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| io(path, e))
}

impl Rotation {
    /// Writes the phase directories under `dir/rotation` from `old` and `new` (each as `kvmesh
    /// cert --out` writes it for `nodes`) and points every node's link at phase 0.
    pub fn prepare(dir: &Path, old: &Path, new: &Path, nodes: &[String]) -> Result<Self, String> {
        let r = Rotation {
            dir: dir.join("rotation"),
        };
        let (old_ca, new_ca) = (read(&old.join("ca.pem"))?, read(&new.join("ca.pem"))?);
        let bundle = format!("{}\n{}", old_ca.trim_end(), new_ca);
        let phases: [(&str, &Path); 4] = [
            (&old_ca, old),
            (&bundle, old),
            (&bundle, new),
            (&new_ca, new),
        ];
        for (k, (ca, pairs)) in phases.into_iter().enumerate() {
            let d = r.phase_dir(k);
            std::fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
            std::fs::write(d.join("ca.pem"), ca).map_err(|e| io(&d, e))?;
            for node in nodes {
                for ext in ["pem", "key"] {
                    let from = pairs.join(format!("{node}.{ext}"));
                    let to = d.join(format!("{node}.{ext}"));
                    std::fs::copy(&from, &to).map_err(|e| io(&from, e))?;
                }
            }
        }
        for node in nodes {
            r.publish(node, 0)?;
        }
        Ok(r)
    }

    fn phase_dir(&self, phase: usize) -> PathBuf {
        self.dir.join(format!("phase-{phase}"))
    }

    /// The directory a router is given as `--tls-dir`: a link to its current phase.
    pub fn link(&self, node: &str) -> PathBuf {
        self.dir.join(node)
    }

    /// Points `node`'s link at `phase`, by a rename: the router reads either the old
    /// directory or the new one, never half of each.
    pub fn publish(&self, node: &str, phase: usize) -> Result<(), String> {
        let tmp = self.dir.join(format!(".{node}.next"));
        let _ = std::fs::remove_file(&tmp);
        // Relative, as the link sits beside its target: the lab's directory may be relative.
        std::os::unix::fs::symlink(format!("phase-{phase}"), &tmp).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, self.link(node)).map_err(|e| io(&tmp, e))
    }
}

/// A router's `"tls"` of `/admin/cluster` (Null when it does not answer).
fn tls_of(addr: SocketAddr) -> serde_json::Value {
    client::get_json(addr, "/admin/cluster")["tls"].clone()
}

fn short(v: &serde_json::Value) -> String {
    v.as_str()
        .map_or("?".into(), |s| s.chars().take(8).collect())
}

/// Runs the three phases: each phase published to every node (a stopped router starts on the
/// newest), and each running router's reload awaited before the next router's turn. Then
/// checks that every running router trusts one CA, the same, not the first, and offers a new
/// certificate. Returns the step's note (each router's certificate fingerprint before → after,
/// how long each phase took).
pub fn rotate(
    rot: &Rotation,
    nodes: &[String],
    running: &[(usize, SocketAddr)],
) -> Result<String, String> {
    let before: Vec<serde_json::Value> = running.iter().map(|&(_, a)| tls_of(a)).collect();
    let mut took = Vec::new();
    for (phase, what) in PHASES.iter().enumerate().skip(1) {
        let t = Instant::now();
        for node in nodes {
            let Some(&(_, addr)) = running.iter().find(|(i, _)| format!("r{i}") == *node) else {
                rot.publish(node, phase)?;
                continue;
            };
            let reloads = |v: &serde_json::Value| v["reloads"].as_u64();
            let was = reloads(&tls_of(addr)).ok_or(format!("{node}: no tls in /admin/cluster"))?;
            rot.publish(node, phase)?;
            let mut now = serde_json::Value::Null;
            let taken = wait_every(TAKE_WITHIN, POLL, || {
                now = tls_of(addr);
                reloads(&now).is_some_and(|r| r > was)
            });
            if taken.is_none() {
                return Err(format!(
                    "{node} did not take phase {phase} ({what}) within {} s: reload failures {}",
                    TAKE_WITHIN.as_secs(),
                    now["reload_failures"]
                ));
            }
        }
        // The mesh held through the phase: each running router still lists every other.
        for &(i, addr) in running {
            let members = || {
                client::get_json(addr, "/admin/cluster")["members"]
                    .as_array()
                    .map_or(0, Vec::len)
            };
            if wait_every(TAKE_WITHIN, POLL, || members() + 1 >= running.len()).is_none() {
                return Err(format!("r{i} lost members in phase {phase} ({what})"));
            }
        }
        took.push(format!("{what} {} ms", t.elapsed().as_millis()));
    }
    let first_ca = &before.first().ok_or("no router running")?["cas_sha256"][0];
    let mut certs = Vec::new();
    let mut cas = None;
    for (&(i, addr), was) in running.iter().zip(&before) {
        let now = tls_of(addr);
        let trusted = now["cas_sha256"].as_array().cloned().unwrap_or_default();
        if trusted.len() != 1 || trusted[0] == *first_ca {
            return Err(format!("r{i} trusts {trusted:?} after the rotation"));
        }
        if cas.get_or_insert(trusted.clone()) != &trusted {
            return Err(format!("r{i} trusts another CA than the routers before it"));
        }
        if now["cert_sha256"] == was["cert_sha256"] {
            return Err(format!("r{i} offers the certificate it had before"));
        }
        certs.push(format!(
            "r{i} {}→{}",
            short(&was["cert_sha256"]),
            short(&now["cert_sha256"])
        ));
    }
    Ok(format!(
        "phases: {}; CA {}→{}; certificates {}",
        took.join(", "),
        short(first_ca),
        short(&cas.unwrap_or_default()[0]),
        certs.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair_dir(base: &Path, name: &str, tag: &str) -> PathBuf {
        let d = base.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("ca.pem"), format!("CA {tag}\n")).unwrap();
        for node in ["r0", "r1"] {
            std::fs::write(d.join(format!("{node}.pem")), format!("cert {node} {tag}")).unwrap();
            std::fs::write(d.join(format!("{node}.key")), format!("key {node} {tag}")).unwrap();
        }
        d
    }

    #[test]
    fn each_phase_holds_what_readme_says_and_a_link_moves_alone() {
        let base = std::env::temp_dir().join(format!("kvmesh-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (old, new) = (pair_dir(&base, "old", "A"), pair_dir(&base, "new", "B"));
        let nodes = vec!["r0".to_string(), "r1".to_string()];
        let r = Rotation::prepare(&base, &old, &new, &nodes).unwrap();
        let at = |node: &str, file: &str| read(&r.link(node).join(file)).unwrap();
        assert_eq!(
            (at("r0", "ca.pem"), at("r1", "r1.pem")),
            ("CA A\n".into(), "cert r1 A".into())
        );
        let want = [
            ("CA A\nCA B\n", "cert r0 A", "key r0 A"),
            ("CA A\nCA B\n", "cert r0 B", "key r0 B"),
            ("CA B\n", "cert r0 B", "key r0 B"),
        ];
        for (k, (ca, cert, key)) in want.into_iter().enumerate() {
            r.publish("r0", k + 1).unwrap();
            assert_eq!(at("r0", "ca.pem"), ca, "phase {}", k + 1);
            assert_eq!(
                (at("r0", "r0.pem"), at("r0", "r0.key")),
                (cert.into(), key.into())
            );
            // The other router's link has not moved.
            assert_eq!(at("r1", "ca.pem"), "CA A\n");
        }
        let _ = std::fs::remove_dir_all(&base);
    }
}
