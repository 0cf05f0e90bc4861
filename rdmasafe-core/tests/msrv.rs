//! The workspace's minimum supported Rust version (`rust-version` in
//! Cargo.toml, 1.85: the oldest toolchain that builds current tokio, see
//! the README) holds for every dependency in Cargo.lock, optional features
//! included: a dependency update that needs a newer compiler fails here,
//! on the host, before a user's older toolchain finds it. (Clippy's
//! `incompatible_msrv` lint checks our own use of std the same way.)

use std::process::Command;

fn version(s: &str) -> (u64, u64, u64) {
    let mut it = s.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0), it.next().unwrap_or(0))
}

#[test]
fn every_dependency_builds_with_the_msrv() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--all-features", "--filter-platform"])
        .arg(target())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let ours = version(env!("CARGO_PKG_RUST_VERSION"));
    assert!(ours >= (1, 85, 0), "rust-version {}", env!("CARGO_PKG_RUST_VERSION"));
    // Only what this platform builds: the resolved nodes, normal and build
    // dependencies of anything reachable (dev-dependencies of dependencies
    // are never built).
    let packages = meta["packages"].as_array().expect("packages");
    let mut checked = 0;
    let mut too_new = Vec::new();
    for node in meta["resolve"]["nodes"].as_array().expect("resolve nodes") {
        let id = node["id"].as_str().unwrap_or("");
        let Some(p) = packages.iter().find(|p| p["id"] == id) else { continue };
        if let Some(v) = p["rust_version"].as_str() {
            checked += 1;
            if version(v) > ours {
                too_new.push(format!("{} {} needs {v}", p["name"], p["version"]));
            }
        }
    }
    println!("{checked} packages declare a rust-version, none above {}", env!("CARGO_PKG_RUST_VERSION"));
    assert!(checked >= 3, "the metadata parse found only {checked} packages with a rust-version");
    assert!(too_new.is_empty(), "dependencies newer than the MSRV: {too_new:?}");
}

/// The host's target triple (the tests run on x86_64 Linux).
fn target() -> String {
    let out = Command::new("rustc").arg("-vV").output().expect("rustc -vV");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("host: ")).expect("host line").to_string()
}
