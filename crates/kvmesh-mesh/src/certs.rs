//! The cluster's certificates: one CA, and per node a certificate it signs, valid for both
//! client and server authentication, with the fixed DNS name [`SERVER_NAME`] (every node
//! connects to every other under that name) and the node's own name as a second one.
//! `kvmesh cert --out DIR --nodes a,b,c` writes them; a node loads its own and the CA.
//!
//! A node's `ca.pem` may hold several CA certificates (a bundle): it trusts each of them.
//! That is how a cluster moves to a new CA without a restart: every node trusts both, then
//! takes a certificate of the new one, then trusts the new one alone (README, *Renewing and
//! rotating the mesh's certificates*).

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
    #[error(
        "bad node name {0:?}: use letters, digits, '-', '_' and '.' (1–63 characters), not starting with '.', and not `ca` in any case (the CA's files are ca.pem and ca.key)"
    )]
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
    /// A file `kvmesh cert` would overwrite (a node's pair, or half of a CA).
    #[error(
        "{0} exists: remove it, or write to another --out (the CA in a directory signs the nodes added to it)"
    )]
    Exists(String),
    /// One half of a CA in the directory: nodes cannot be signed by it, and a new CA there
    /// would make nodes the cluster refuses.
    #[error(
        "{dir} has {have} but no {missing}: nodes added to a cluster are signed with its CA's key, so put {missing} beside {have} (as `kvmesh cert` wrote them), or write to another --out for a new cluster"
    )]
    HalfCa {
        /// The directory.
        dir: String,
        /// The file there.
        have: &'static str,
        /// The file missing.
        missing: &'static str,
    },
    /// `ca.key` is not the key of `ca.pem`.
    #[error("{0}: ca.key is not the key of ca.pem")]
    CaMismatch(String),
    /// A node's pair that its peers would refuse: the key is not the certificate's, or the
    /// certificate is not signed by a CA the node trusts (peers trusting the same refuse it).
    #[error("{0}")]
    Unusable(String),
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
        && n != "ca"
}

fn gen_err(e: rcgen::Error) -> CertError {
    CertError::Generate(e.to_string())
}

/// A new CA and a certificate for each node.
pub fn generate(nodes: &[String]) -> Result<ClusterCerts, CertError> {
    let ca_key = KeyPair::generate().map_err(gen_err)?;
    let ca = ca_params()?;
    let ca_cert = ca.self_signed(&ca_key).map_err(gen_err)?;
    sign(nodes, ca_cert.pem(), ca_key)
}

/// The CA's parameters (the same for every cluster: its key is what tells them apart).
fn ca_params() -> Result<CertificateParams, CertError> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "kvmesh cluster CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(ca)
}

/// Certificates for `nodes` signed by an existing CA (as `kvmesh cert` wrote it): nodes
/// added to a running cluster.
pub fn generate_with_ca(
    nodes: &[String],
    ca_pem: &str,
    ca_key_pem: &str,
    origin: &str,
) -> Result<ClusterCerts, CertError> {
    let ca_key =
        KeyPair::from_pem(ca_key_pem).map_err(|_| CertError::Pem(format!("{origin}/ca.key")))?;
    let cas = ca_bundle(ca_pem).map_err(|_| CertError::Pem(format!("{origin}/ca.pem")))?;
    // A CA certificate holds its public key: the key must be one of theirs (in a bundle of
    // the old and the new CA, the one whose key is here signs).
    let public = ca_key.public_key_raw();
    if !cas
        .iter()
        .any(|ca| ca.windows(public.len()).any(|w| w == public))
    {
        return Err(CertError::CaMismatch(origin.to_string()));
    }
    sign(nodes, ca_pem.to_string(), ca_key)
}

fn check_names(nodes: &[String]) -> Result<(), CertError> {
    for (i, n) in nodes.iter().enumerate() {
        // New pairs only: `CA.pem` is `ca.pem` on a case-insensitive file system.
        if !valid_name(n) || n.eq_ignore_ascii_case("ca") {
            return Err(CertError::BadName(n.clone()));
        }
        if nodes[..i].contains(n) {
            return Err(CertError::DuplicateName(n.clone()));
        }
    }
    Ok(())
}

fn sign(nodes: &[String], ca_pem: String, ca_key: KeyPair) -> Result<ClusterCerts, CertError> {
    check_names(nodes)?;
    let ca = ca_params()?;
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
        ca_pem,
        ca_key_pem: ca_key.serialize_pem(),
        nodes: out,
    })
}

/// What `kvmesh cert --out DIR --nodes ...` does: certificates for `nodes`, signed by the CA
/// already in `dir` (nodes added to a cluster) or by a new one; never overwriting a file.
/// Returns whether the CA was there already.
pub fn add_to_dir(dir: &Path, nodes: &[String]) -> Result<bool, CertError> {
    check_names(nodes)?;
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| CertError::Io {
            path: p.display().to_string(),
            source,
        })
    };
    let existing = match (ca_pem.exists(), ca_key.exists()) {
        (true, true) => true,
        (false, false) => false,
        (true, false) | (false, true) => {
            let (have, missing) = if ca_pem.exists() {
                ("ca.pem", "ca.key")
            } else {
                ("ca.key", "ca.pem")
            };
            return Err(CertError::HalfCa {
                dir: dir.display().to_string(),
                have,
                missing,
            });
        }
    };
    for n in nodes {
        for ext in ["pem", "key"] {
            let f = dir.join(format!("{n}.{ext}"));
            if f.exists() {
                return Err(CertError::Exists(f.display().to_string()));
            }
        }
    }
    if !existing {
        write_dir(dir, &generate(nodes)?)?;
        return Ok(false);
    }
    let certs = generate_with_ca(
        nodes,
        &read(&ca_pem)?,
        &read(&ca_key)?,
        &dir.display().to_string(),
    )?;
    for n in &certs.nodes {
        write(&dir.join(format!("{}.pem", n.name)), &n.cert_pem, false)?;
        write(&dir.join(format!("{}.key", n.name)), &n.key_pem, true)?;
    }
    Ok(true)
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

/// The SHA-256 fingerprint of a certificate (DER), in hex, as `openssl x509 -fingerprint
/// -sha256` prints it without the colons.
pub fn sha256_hex(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One DER element: its tag, its contents and what follows it (`None` when cut short or
/// longer than 4 GiB).
fn der_element(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (digits, rest) = b.split_at_checked(n)?;
        b = rest;
        digits.iter().fold(0usize, |a, &d| a << 8 | usize::from(d))
    };
    let (contents, rest) = b.split_at_checked(len)?;
    Some((tag, contents, rest))
}

/// Days from 1970-01-01 to a civil date (proleptic Gregorian; H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A certificate's end of validity (`notAfter`), in seconds since the Unix epoch; `None` when
/// the DER is not a certificate this reads (it reads what rustls accepted: UTCTime or
/// GeneralizedTime, in UTC).
pub fn not_after(der: &[u8]) -> Option<i64> {
    let (0x30, cert, _) = der_element(der)? else {
        return None;
    };
    let (0x30, tbs, _) = der_element(cert)? else {
        return None;
    };
    // [0] version (optional), serial number, signature algorithm, issuer, then validity.
    let (tag, _, after_version) = der_element(tbs)?;
    let mut rest = if tag == 0xa0 { after_version } else { tbs };
    for _ in 0..3 {
        rest = der_element(rest)?.2;
    }
    let (0x30, validity, _) = der_element(rest)? else {
        return None;
    };
    let (tag, time, _) = der_element(der_element(validity)?.2)?;
    let digits = |t: &[u8]| -> Option<i64> {
        t.iter().try_fold(0i64, |a, &c| {
            c.is_ascii_digit().then(|| a * 10 + i64::from(c - b'0'))
        })
    };
    let (year, t) = match (tag, time.len()) {
        // UTCTime YYMMDDHHMMSSZ: 50–99 are 19xx (RFC 5280).
        (0x17, 13) => {
            let yy = digits(&time[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &time[2..])
        }
        // GeneralizedTime YYYYMMDDHHMMSSZ.
        (0x18, 15) => (digits(&time[..4])?, &time[4..]),
        _ => return None,
    };
    if t[10] != b'Z' {
        return None;
    }
    let f = |i: usize| digits(&t[i..i + 2]);
    let (mo, d, h, mi, sec) = (f(0)?, f(2)?, f(4)?, f(6)?, f(8)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    Some(days_from_civil(year, mo, d) * 86_400 + h * 3_600 + mi * 60 + sec)
}

/// What a node presents and trusts, as operators compare it across routers (a rotation's
/// steps) and alert on (the end of validity).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSummary {
    /// SHA-256 of the node's certificate.
    pub cert_sha256: String,
    /// Its `notAfter`, seconds since the Unix epoch.
    pub cert_not_after: Option<i64>,
    /// SHA-256 of each CA trusted, in `ca.pem`'s order.
    pub cas_sha256: Vec<String>,
}

/// Every certificate of a PEM bundle (at least one; anything else in the text is ignored).
fn ca_bundle(pem: &str) -> Result<Vec<CertificateDer<'static>>, ()> {
    let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|_| ())?;
    if cas.is_empty() { Err(()) } else { Ok(cas) }
}

/// What a node needs for mutual TLS: the cluster CAs it trusts, its certificate chain and key.
#[derive(Debug)]
pub struct NodeTls {
    /// The node's name.
    pub name: String,
    /// The CAs it trusts (one, or during a rotation the old and the new).
    pub cas: Vec<CertificateDer<'static>>,
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
        let cas = ca_bundle(ca_pem).map_err(|_| CertError::Pem("CA certificate".into()))?;
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
            cas,
            chain,
            key,
        })
    }

    /// Its fingerprints and end of validity.
    pub fn summary(&self) -> TlsSummary {
        TlsSummary {
            cert_sha256: sha256_hex(&self.chain[0]),
            cert_not_after: not_after(&self.chain[0]),
            cas_sha256: self.cas.iter().map(|c| sha256_hex(c)).collect(),
        }
    }

    /// Checks what peers will check of this node: its key is its certificate's, and the
    /// certificate is signed by one of the CAs it trusts (peers trusting the same CAs verify
    /// it so at every handshake). A pair of a new CA put in before the CA itself, or a key
    /// and certificate of two different pairs, fail here rather than at every peer.
    pub fn check(&self) -> Result<(), CertError> {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let bad = |what: String| CertError::Unusable(format!("{}: {what}", self.name));
        rustls::sign::CertifiedKey::from_der(self.chain.clone(), self.key.clone_key(), &provider)
            .map_err(|e| bad(format!("the key is not the certificate's ({e})")))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in &self.cas {
            roots
                .add(ca.clone())
                .map_err(|e| bad(format!("a CA of ca.pem does not load ({e})")))?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .map_err(|e| bad(e.to_string()))?;
        verifier
            .verify_client_cert(
                &self.chain[0],
                &self.chain[1..],
                rustls::pki_types::UnixTime::now(),
            )
            .map_err(|e| {
                bad(format!(
                    "the certificate does not verify against the CAs of ca.pem ({e}); peers trusting them would refuse it"
                ))
            })?;
        Ok(())
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
    use super::{CertError, NodeTls, generate, generate_with_ca};

    /// In a bundle of the old and the new CA, the CA whose key is given signs; a key of
    /// neither is refused; a node loading the bundle trusts both.
    #[test]
    fn a_bundle_of_cas_signs_with_the_one_whose_key_is_given() {
        let one = |n: &str| vec![n.to_string()];
        let (old, new, other) = (
            generate(&one("a")).expect("old"),
            generate(&one("a")).expect("new"),
            generate(&one("a")).expect("other"),
        );
        let bundle = format!("{}{}", old.ca_pem, new.ca_pem);
        let signed = generate_with_ca(&one("b"), &bundle, &new.ca_key_pem, "d").expect("signs");
        assert_eq!(signed.ca_pem, bundle, "the bundle is kept as it was");
        let b = &signed.nodes[0];
        let tls = NodeTls::from_pem("b", &bundle, &b.cert_pem, &b.key_pem).expect("loads");
        assert_eq!(tls.cas.len(), 2);
        assert!(matches!(
            generate_with_ca(&one("b"), &bundle, &other.ca_key_pem, "d"),
            Err(CertError::CaMismatch(_))
        ));
        assert!(matches!(
            NodeTls::from_pem("b", "no certificate here", &b.cert_pem, &b.key_pem),
            Err(CertError::Pem(_))
        ));
    }

    /// The end of validity as rcgen wrote it: UTCTime before 2050, GeneralizedTime after; and
    /// bytes that are not a certificate give `None`, never a panic.
    #[test]
    fn the_end_of_validity_is_read_from_the_certificate() {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = |y, m, d| {
            let mut p = rcgen::CertificateParams::new(vec!["x".to_string()]).expect("params");
            p.not_after = rcgen::date_time_ymd(y, m, d);
            p.self_signed(&key).expect("cert").der().to_vec()
        };
        assert_eq!(super::not_after(&cert(2030, 6, 1)), Some(1_906_502_400));
        assert_eq!(super::not_after(&cert(2096, 2, 29)), Some(3_981_312_000));
        // `kvmesh cert`'s pairs: rcgen's default, 4096-01-01.
        let c = generate(&["a".to_string()]).expect("certs");
        let tls = NodeTls::from_cluster(&c, "a").expect("a");
        let s = tls.summary();
        assert_eq!(s.cert_not_after, Some(67_090_118_400));
        assert_eq!((s.cert_sha256.len(), s.cas_sha256.len()), (64, 1));
        let der = cert(2030, 6, 1);
        for cut in 0..der.len() {
            let _ = super::not_after(&der[..cut]);
        }
        assert_eq!(super::not_after(b"not a certificate"), None);
    }

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
