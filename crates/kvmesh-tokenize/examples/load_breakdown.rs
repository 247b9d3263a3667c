//! Prints where the start-up time of the bundled tokenizer goes.
//! `cargo run --release -p kvmesh-tokenize --example load_breakdown [upstream tokenizer.json]`
use std::io::Read;
use std::time::Instant;

fn main() {
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/qwen3/tokenizer.json.gz"
    ))
    .expect("asset");
    for _ in 0..2 {
        let t = Instant::now();
        let mut json = String::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut json)
            .expect("gunzip");
        let t_gz = t.elapsed();
        let t = Instant::now();
        let p = tokenizers::from_json(&json).expect("from_json");
        let t_read = t.elapsed();
        let t = Instant::now();
        let tok = kvmesh_tokenize::Tokenizer::load_bundled().expect("load");
        let t_all = t.elapsed();
        let t = Instant::now();
        let _ = tok.token_to_id("Ġworld");
        let t_index = t.elapsed();
        drop(p);
        println!(
            "gunzip {t_gz:?}  from_json(canonical) {t_read:?}  load_bundled total {t_all:?}  first token_to_id index {t_index:?}"
        );
    }
    if let Some(path) = std::env::args().nth(1) {
        let t = Instant::now();
        let tok = kvmesh_tokenize::Tokenizer::from_path(std::path::Path::new(&path)).expect("load");
        println!(
            "from_path({path}) incl. 1.0 -> 2.0 conversion: {:?}",
            t.elapsed()
        );
        drop(tok);
    }
}
