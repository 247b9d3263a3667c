//! Helpers shared by the integration tests: locating the upstream Qwen3 files and running the
//! Python reference script `tests/python/render_golden.py`.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const INSTALL_HINT: &str = "the golden tests need python3 with the `jinja2` and `tokenizers` \
     packages: run the project's install script `scripts/install-test-deps.sh` (or \
     `pip install -r tests/python/requirements.txt`)";

/// The workspace root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The crate's bundled `tokenizer_config.json`.
pub fn bundled_config_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer_config.json")
}

/// The upstream Qwen3 files (Hugging Face's `tokenizer.json` format 1.0 and
/// `tokenizer_config.json`, Apache-2.0, see `tests/data/qwen3-upstream/NOTICE`) as a directory:
/// unpacked once from `tests/data/qwen3-upstream` into the system's temp directory (the bundled
/// asset is the converted 2.0 file; these tests load the original and compare the two).
pub fn shared_qwen3_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen3-upstream");
        let gz = std::fs::read(src.join("tokenizer.json.gz")).expect("upstream tokenizer.json.gz");
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json)
            .expect("gunzip upstream tokenizer.json");
        // One directory per content (test binaries run in parallel and may share it); files are
        // written under a unique name and renamed into place, so a reader never sees half.
        let tag = blake3::hash(&json).to_hex()[..16].to_string();
        let dir = std::env::temp_dir().join(format!("kvmesh-qwen3-upstream-{tag}"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = std::fs::read(src.join("tokenizer_config.json")).expect("upstream config");
        for (name, bytes) in [
            ("tokenizer.json", &json),
            ("tokenizer_config.json", &config),
        ] {
            let path = dir.join(name);
            if std::fs::read(&path).is_ok_and(|b| b == *bytes) {
                continue;
            }
            let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
            std::fs::write(&tmp, bytes).expect("write upstream file");
            std::fs::rename(&tmp, &path).expect("rename upstream file");
        }
        dir
    })
    .clone()
}

/// Run `python3 tests/python/render_golden.py ARGS` with `stdin`, returning parsed stdout.
/// Panics with the install hint when python3 or a module is missing.
pub fn run_golden(args: &[&str], stdin: Option<&str>) -> serde_json::Value {
    let script = repo_root().join("tests/python/render_golden.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run python3 ({e}): {INSTALL_HINT}"));
    {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        if let Some(input) = stdin {
            pipe.write_all(input.as_bytes())
                .expect("write to render_golden.py");
        }
    }
    let out = child.wait_with_output().expect("wait for render_golden.py");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("ModuleNotFoundError") || stderr.contains("No module named") {
            panic!("{INSTALL_HINT}\n\npython said:\n{stderr}");
        }
        panic!(
            "render_golden.py {args:?} failed ({}):\n{stderr}",
            out.status
        );
    }
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("render_golden.py printed invalid JSON ({e}); stderr:\n{stderr}")
    })
}

/// Token ids (and decodes) of `texts` according to the Python `tokenizers` package, using the
/// upstream Qwen3 `tokenizer.json`.
pub struct PyEncoding {
    pub ids: Vec<Vec<u32>>,
    pub decoded: Vec<String>,
    pub decoded_skip_special: Vec<String>,
}

pub fn python_encode(texts: &[String], add_special_tokens: bool) -> PyEncoding {
    let tokenizer = shared_qwen3_dir().join("tokenizer.json");
    let input = serde_json::json!({"texts": texts, "add_special_tokens": add_special_tokens});
    let out = run_golden(
        &["encode", "--tokenizer", &tokenizer.to_string_lossy()],
        Some(&input.to_string()),
    );
    let strings = |key: &str| -> Vec<String> {
        out[key]
            .as_array()
            .unwrap_or_else(|| panic!("no {key} in python output"))
            .iter()
            .map(|v| v.as_str().expect("string").to_owned())
            .collect()
    };
    PyEncoding {
        ids: out["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|row| {
                row.as_array()
                    .expect("row")
                    .iter()
                    .map(|v| v.as_u64().expect("id") as u32)
                    .collect()
            })
            .collect(),
        decoded: strings("decoded"),
        decoded_skip_special: strings("decoded_skip_special"),
    }
}

/// A tiny deterministic PRNG (splitmix64) for generating test inputs without extra deps.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A first-difference summary of two strings, for readable assertion messages.
pub fn first_difference(a: &str, b: &str) -> String {
    let at = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or(a.len().min(b.len()));
    let start = a[..at].char_indices().rev().nth(40).map_or(0, |(i, _)| i);
    let tail = |s: &str| {
        s.get(start..)
            .unwrap_or("")
            .chars()
            .take(120)
            .collect::<String>()
    };
    format!(
        "first difference at byte {at}:\n  rust:   {:?}\n  python: {:?}",
        tail(a),
        tail(b)
    )
}
