//! Helpers of the process-level tests: spawn `kvmesh` subcommands on loopback ports, wait for
//! health, run the Python interop scripts.
#![allow(dead_code)]

use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A `kvmesh` child process (sim or serve), killed on drop.
pub struct Proc {
    pub child: Child,
    pub port: u16,
}

impl Proc {
    pub fn start(extra: &[&str]) -> Proc {
        Self::spawn("sim", extra)
    }

    /// Spawns `kvmesh SUBCOMMAND --listen 127.0.0.1:PORT EXTRA…` and waits for /health.
    pub fn spawn(sub: &str, extra: &[&str]) -> Proc {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args([sub, "--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvmesh");
        let mut sim = Proc { child, port };
        sim.wait_healthy();
        sim
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let mut err = String::new();
                if let Some(e) = self.child.stderr.as_mut() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("kvmesh exited early ({status}): {err}");
            }
            if http_status("GET", &format!("{}/health", self.base())) == Some(200) {
                return;
            }
            assert!(Instant::now() < deadline, "kvmesh never became healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Minimal blocking HTTP/1.1 request on loopback; returns the status.
pub fn http_status(method: &str, url: &str) -> Option<u16> {
    use std::io::Write;
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}")))?;
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_whitespace().nth(1)?.parse().ok()
}

pub fn python(script: &str, args: &[&str]) -> String {
    let path = repo_root().join("tests/python").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 not runnable ({e}); run scripts/install-test-deps.sh"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}\n(missing modules? run scripts/install-test-deps.sh)",
        out.status
    );
    stdout
}

/// A response: status, headers (lower-case names) and body.
pub struct Http {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Http {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Minimal blocking HTTP/1.1 request with a body on loopback (bounded by `timeout`).
pub fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
    timeout: Duration,
) -> Option<Http> {
    use std::io::Write;
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}")))?;
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    // Chunked bodies are not decoded: callers read JSON error/ok bodies sent whole.
    Some(Http {
        status,
        headers,
        body: body.to_string(),
    })
}

/// Certificates for routers `a`, `b` and `c` (`kvmesh cert`) in a new temporary directory
/// named after `tag`: the directory.
pub fn certs_abc(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvmesh-{tag}-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "cert",
            "--out",
            dir.to_str().expect("utf8"),
            "--nodes",
            "a,b,c",
        ])
        .output()
        .expect("kvmesh cert");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// Routers `a`, `b` and `c` (`kvmesh serve` with `args`: engines, policy, ...) meshed over
/// loopback with the certificates in `tls` ([`certs_abc`]) as cluster `cluster_id`, `b` and
/// `c` seeded by `a`; each returned once healthy (for `b` and `c`: joined and warm).
pub fn meshed_abc(tls: &std::path::Path, cluster_id: &str, args: &[&str]) -> Vec<Proc> {
    let tls = tls.to_str().expect("utf8");
    let mesh_ports: Vec<u16> = (0..3).map(|_| free_udp_port()).collect();
    let seed = format!("127.0.0.1:{}", mesh_ports[0]);
    ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let listen = format!("127.0.0.1:{}", mesh_ports[i]);
            let mut all = args.to_vec();
            all.extend([
                "--node-id",
                name,
                "--tls-dir",
                tls,
                "--mesh-listen",
                &listen,
                "--cluster-id",
                cluster_id,
            ]);
            if i > 0 {
                all.extend(["--seed", &seed]);
            }
            let t = Instant::now();
            let p = Proc::spawn("serve", &all);
            println!("router {name}: started and ready in {:?}", t.elapsed());
            p
        })
        .collect()
}

/// A free UDP port on loopback (for a mesh address).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("free udp port")
}
