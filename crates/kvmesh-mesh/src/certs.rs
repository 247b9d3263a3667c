//! The cluster's certificates: one CA, and per node a certificate it signs, valid for both
//! client and server authentication, with the fixed DNS name [`SERVER_NAME`] (every node
//! connects to every other under that name) and the node's own name as a second one.
//! `kvmesh cert --out DIR --nodes a,b,c` writes them; a node loads its own and the CA.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;

/// The DNS name in every node certificate, and the name nodes connect under.
pub const SERVER_NAME: &str = "kvmesh-node";

/// Certificate errors.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// Generation failed.
    #[error("certificate generation: {0}")]
    Generate(String),
    /// A node name that cannot be a file name or a DNS label.
    #[error("bad node name {0:?}: use letters, digits, '-', '_' and '.' (1–63 characters)")]
    BadName(String),
    /// A node name given twice (its second pair would overwrite the first's files).
    #[error("node name {0:?} given twice: each node gets its own pair")]
    DuplicateName(String),
    /// Reading or writing files.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A PEM file that does not hold what it should.
    #[error("{0}: not a PEM certificate or key")]
    Pem(String),
}

/// A node's certificate and key (PEM).
#[derive(Debug, Clone)]
pub struct NodeCert {
    /// The node's name.
    pub name: String,
    /// Its certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

/// A cluster CA and its nodes' certificates (PEM).
#[derive(Debug, Clone)]
pub struct ClusterCerts {
    /// The CA certificate.
    pub ca_pem: String,
    /// The CA key (keep it off the nodes).
    pub ca_key_pem: String,
    /// The nodes'.
    pub nodes: Vec<NodeCert>,
}

fn valid_name(n: &str) -> bool {
    (1..=63).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !n.starts_with('.')
}

fn gen_err(e: rcgen::Error) -> CertError {
    CertError::Generate(e.to_string())
}

/// A new CA and a certificate for each node.
pub fn generate(nodes: &[String]) -> Result<ClusterCerts, CertError> {
    for (i, n) in nodes.iter().enumerate() {
        if !valid_name(n) {
            return Err(CertError::BadName(n.clone()));
        }
        if nodes[..i].contains(n) {
            return Err(CertError::DuplicateName(n.clone()));
        }
    }
    let ca_key = KeyPair::generate().map_err(gen_err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "kvmesh cluster CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(gen_err)?;
    let issuer = Issuer::from_params(&ca, &ca_key);
    let mut out = Vec::with_capacity(nodes.len());
    for n in nodes {
        let key = KeyPair::generate().map_err(gen_err)?;
        let mut p =
            CertificateParams::new(vec![SERVER_NAME.to_string(), n.clone()]).map_err(gen_err)?;
        p.distinguished_name.push(DnType::CommonName, n.as_str());
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = p.signed_by(&key, &issuer).map_err(gen_err)?;
        out.push(NodeCert {
            name: n.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        });
    }
    Ok(ClusterCerts {
        ca_pem: ca_cert.pem(),
        ca_key_pem: ca_key.serialize_pem(),
        nodes: out,
    })
}

fn write(path: &Path, text: &str, secret: bool) -> Result<(), CertError> {
    let io = |source| CertError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::write(path, text).map_err(io)?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    Ok(())
}

/// Writes `DIR/ca.pem`, `DIR/ca.key`, and per node `DIR/<node>.pem`, `DIR/<node>.key` (keys
/// readable by their owner only).
pub fn write_dir(dir: &Path, certs: &ClusterCerts) -> Result<(), CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    write(&dir.join("ca.pem"), &certs.ca_pem, false)?;
    write(&dir.join("ca.key"), &certs.ca_key_pem, true)?;
    for n in &certs.nodes {
        write(&dir.join(format!("{}.pem", n.name)), &n.cert_pem, false)?;
        write(&dir.join(format!("{}.key", n.name)), &n.key_pem, true)?;
    }
    Ok(())
}

/// What a node needs for mutual TLS: the cluster CA, its certificate chain and key.
#[derive(Debug)]
pub struct NodeTls {
    /// The node's name.
    pub name: String,
    /// The cluster CA.
    pub ca: CertificateDer<'static>,
    /// The node's certificate chain.
    pub chain: Vec<CertificateDer<'static>>,
    /// The node's key.
    pub key: PrivateKeyDer<'static>,
}

impl NodeTls {
    /// From PEM text.
    pub fn from_pem(
        name: &str,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self, CertError> {
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())
            .map_err(|_| CertError::Pem("CA certificate".into()))?;
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|_| CertError::Pem(format!("{name} certificate")))?;
        if chain.is_empty() {
            return Err(CertError::Pem(format!("{name} certificate")));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|_| CertError::Pem(format!("{name} key")))?;
        Ok(NodeTls {
            name: name.to_string(),
            ca,
            chain,
            key,
        })
    }

    /// A node's files as `kvmesh cert` wrote them in `dir`.
    pub fn load(dir: &Path, name: &str) -> Result<Self, CertError> {
        if !valid_name(name) {
            return Err(CertError::BadName(name.to_string()));
        }
        let read = |f: String| {
            let p = dir.join(f);
            std::fs::read_to_string(&p).map_err(|source| CertError::Io {
                path: p.display().to_string(),
                source,
            })
        };
        NodeTls::from_pem(
            name,
            &read("ca.pem".into())?,
            &read(format!("{name}.pem"))?,
            &read(format!("{name}.key"))?,
        )
    }

    /// The same node's TLS material of a generated cluster.
    pub fn from_cluster(certs: &ClusterCerts, name: &str) -> Result<Self, CertError> {
        let n = certs
            .nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| CertError::BadName(name.to_string()))?;
        NodeTls::from_pem(name, &certs.ca_pem, &n.cert_pem, &n.key_pem)
    }
}

#[cfg(test)]
mod tests {
    use super::{CertError, generate};

    #[test]
    fn names_must_be_valid_and_distinct() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(matches!(
            generate(&names(&["a", "b", "a"])),
            Err(CertError::DuplicateName(n)) if n == "a"
        ));
        assert!(matches!(
            generate(&names(&["a", "b c"])),
            Err(CertError::BadName(_))
        ));
        assert!(generate(&names(&["a", "b"])).is_ok());
    }
}
