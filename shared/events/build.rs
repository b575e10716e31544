//! Embeds every Avro schema of `schemas/` (current) and `schemas/history/<Name>/`
//! (earlier versions, still readable) so that the crate is the one place that
//! knows the wire format and adding a schema file needs no code change here.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

fn avsc_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        fs::read_dir(dir).map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "avsc"));
    files.sort();
    files
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let schemas = manifest.join("../../schemas");
    println!("cargo:rerun-if-changed={}", schemas.display());

    let mut out = String::from(
        "/// (event type, schema JSON) of every current schema.\npub const CURRENT: &[(&str, &str)] = &[\n",
    );
    for file in avsc_files(&schemas) {
        let name = file.file_stem().and_then(|s| s.to_str()).expect("schema file name is UTF-8");
        writeln!(out, "    ({name:?}, include_str!({:?})),", file.display().to_string()).expect("write to string");
    }
    out.push_str("];\n\n/// (event type, version label, schema JSON) of every earlier schema.\npub const HISTORY: &[(&str, &str, &str)] = &[\n");
    let history = schemas.join("history");
    println!("cargo:rerun-if-changed={}", history.display());
    let mut types: Vec<PathBuf> = fs::read_dir(&history)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    types.sort();
    for dir in types {
        println!("cargo:rerun-if-changed={}", dir.display());
        let name = dir.file_name().and_then(|s| s.to_str()).expect("history folder name is UTF-8").to_owned();
        for file in avsc_files(&dir) {
            let label = file.file_stem().and_then(|s| s.to_str()).expect("schema file name is UTF-8");
            writeln!(out, "    ({name:?}, {label:?}, include_str!({:?})),", file.display().to_string())
                .expect("write to string");
        }
    }
    out.push_str("];\n");
    let target = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("schema_files.rs");
    fs::write(target, out).expect("write generated schema list");
}
