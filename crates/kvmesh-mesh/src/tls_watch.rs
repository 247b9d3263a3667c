//! A node's certificate files, watched: `ca.pem` (one CA or a bundle), `<pair>.pem` and
//! `<pair>.key` in the TLS directory. [`TlsWatch::check`] reads them again and says whether
//! they changed since the last look, and what they hold now. The node's shell calls it on a
//! timer and gives what loads and passes [`NodeTls::check`] (what peers will verify) to
//! [`crate::transport::Transport::reload_tls`]: a certificate
//! renewed in place (cert-manager, a Kubernetes Secret updated, files copied by hand) or a CA
//! rotated is taken without a restart. Files that do not load are reported once per change
//! and leave the transport as it was.

use crate::certs::{CertError, NodeTls};
use std::path::{Path, PathBuf};

/// Watches one node's certificate files.
#[derive(Debug)]
pub struct TlsWatch {
    dir: PathBuf,
    pair: String,
    name: String,
    /// A hash of what the files held (or of how reading them failed) at the last look.
    seen: [u8; 32],
}

impl TlsWatch {
    /// The files of `pair` (as `kvmesh cert` names them) in `dir`, for the node `name`: the
    /// watch and what the files hold now.
    pub fn new(dir: &Path, pair: &str, name: &str) -> (TlsWatch, Result<NodeTls, CertError>) {
        let mut w = TlsWatch {
            dir: dir.to_path_buf(),
            pair: pair.to_string(),
            name: name.to_string(),
            seen: [0; 32],
        };
        w.seen = w.fingerprint();
        let loaded = w.load();
        (w, loaded)
    }

    /// The files again: `None` when they hold what they held at the last look (whether that
    /// loaded or not), else what they hold now.
    pub fn check(&mut self) -> Option<Result<NodeTls, CertError>> {
        let seen = self.fingerprint();
        if seen == self.seen {
            return None;
        }
        self.seen = seen;
        Some(self.load())
    }

    /// A hash of what the files hold, or of how reading each failed.
    fn fingerprint(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        for f in [
            "ca.pem".to_string(),
            format!("{}.pem", self.pair),
            format!("{}.key", self.pair),
        ] {
            match std::fs::read(self.dir.join(&f)) {
                Ok(b) => {
                    h.update(&(b.len() as u64).to_le_bytes());
                    h.update(&b);
                }
                Err(e) => {
                    h.update(&u64::MAX.to_le_bytes());
                    h.update(format!("{:?}", e.kind()).as_bytes());
                }
            }
        }
        *h.finalize().as_bytes()
    }

    /// What the files hold, checked as peers will check it.
    fn load(&self) -> Result<NodeTls, CertError> {
        let mut t = NodeTls::load(&self.dir, &self.pair)?;
        t.check()?;
        t.name = self.name.clone();
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::TlsWatch;
    use crate::certs::{generate, write_dir};

    #[test]
    fn a_change_is_reported_once_and_what_does_not_load_too() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tls-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = generate(&["a".to_string()]).expect("certs");
        write_dir(&dir, &first).expect("write");
        let (mut w, loaded) = TlsWatch::new(&dir, "a", "node-1");
        let t = loaded.expect("loads");
        assert_eq!((t.name.as_str(), t.cas.len()), ("node-1", 1));
        assert!(w.check().is_none(), "nothing changed");

        // The old CA and a new one, in one file.
        let second = generate(&["a".to_string()]).expect("certs");
        let bundle = format!("{}{}", first.ca_pem, second.ca_pem);
        std::fs::write(dir.join("ca.pem"), &bundle).expect("write");
        let t = w.check().expect("changed").expect("loads");
        assert_eq!(t.cas.len(), 2);
        assert!(w.check().is_none(), "reported once");

        // A key cut short: reported once, not again until it changes.
        std::fs::write(dir.join("a.key"), "-----BEGIN PRIVATE KEY-----\nAAA").expect("write");
        assert!(w.check().expect("changed").is_err());
        assert!(w.check().is_none());
        std::fs::remove_file(dir.join("a.key")).expect("rm");
        assert!(
            w.check().expect("changed").is_err(),
            "a file gone is a change"
        );
        std::fs::write(dir.join("a.key"), &first.nodes[0].key_pem).expect("write");
        assert!(w.check().expect("changed").is_ok());
        // A key of another pair: refused.
        std::fs::write(dir.join("a.key"), &second.nodes[0].key_pem).expect("write");
        let e = w.check().expect("changed").expect_err("mismatched key");
        assert!(e.to_string().contains("not the certificate's"), "{e}");
        // The new CA's pair while ca.pem holds the old CA alone: refused.
        std::fs::write(dir.join("ca.pem"), &first.ca_pem).expect("write");
        std::fs::write(dir.join("a.pem"), &second.nodes[0].cert_pem).expect("write");
        let e = w.check().expect("changed").expect_err("untrusted pair");
        assert!(e.to_string().contains("does not verify"), "{e}");
        std::fs::write(dir.join("ca.pem"), &bundle).expect("write");
        assert!(w.check().expect("changed").is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
