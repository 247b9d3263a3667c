//! Regenerates `assets/qwen3/tokenizer.json.gz` from an upstream `tokenizer.json`.
//!
//! ```text
//! cargo run --release -p kvmesh-tokenize --example build_bundled_asset -- \
//!     /work/shared/tokenizers/qwen3/tokenizer.json crates/kvmesh-tokenize/assets/qwen3/tokenizer.json.gz
//! ```
//!
//! The file is canonicalized to the `"version": "2.0"` format (so start-up skips the
//! conversion), written as compact JSON and gzipped at the best compression level.

use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(src), Some(dst)) = (args.next(), args.next()) else {
        return Err("usage: build_bundled_asset <tokenizer.json> <out.json.gz>".into());
    };
    let text = std::fs::read_to_string(&src)?;
    let canonical = tokenizers::canonicalize_str(&text)?;
    // canonicalize_str pretty-prints; store compact to keep the embedded blob small.
    let value: serde_json::Value = serde_json::from_str(&canonical)?;
    let compact = serde_json::to_string(&value)?;
    // Sanity: the reader must accept what we ship.
    tokenizers::from_json(&compact).map_err(|e| e.to_string())?;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(compact.as_bytes())?;
    let gz = enc.finish()?;
    std::fs::write(&dst, &gz)?;
    eprintln!(
        "{src}: {} bytes -> canonical compact {} bytes -> gzip {} bytes at {dst}",
        text.len(),
        compact.len(),
        gz.len()
    );
    Ok(())
}
