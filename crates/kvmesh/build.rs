//! The commit the binary is built from, for `kvmesh bench`'s reports when it runs outside a
//! checkout (`KVMESH_BUILD_COMMIT`; empty when not built from one).

fn main() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=KVMESH_BUILD_COMMIT={commit}");
    // Again when HEAD moves (a commit, a checkout).
    let git = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.git");
    for p in ["HEAD", "refs/heads", "packed-refs"] {
        if git.join(p).exists() {
            println!("cargo:rerun-if-changed={}", git.join(p).display());
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
