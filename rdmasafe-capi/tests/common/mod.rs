//! Helpers shared by the host-side integration tests that build C programs
//! and run them in the Soft-RoCE guest.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `<target>/<profile>` of this test binary (`<target>/<profile>/deps/<exe>`),
/// where cargo also puts librdmasafe.so.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(Path::parent).expect("<target>/<profile>/deps/<exe>").to_path_buf()
}

/// One program's output block ("==== BEGIN label" .. "==== END label exit N").
#[derive(Debug, Default)]
pub struct Block {
    pub out: String,
    pub exit: Option<i32>,
}

impl Block {
    pub fn lines(&self) -> impl Iterator<Item = &str> {
        self.out.lines()
    }
    pub fn has(&self, needle: &str) -> bool {
        self.out.contains(needle)
    }
    pub fn count(&self, needle: &str) -> usize {
        self.lines().filter(|l| l.contains(needle)).count()
    }
    /// The first line that starts with `prefix`.
    pub fn line(&self, prefix: &str) -> Option<&str> {
        self.lines().find(|l| l.starts_with(prefix))
    }
    pub fn lines_with(&self, needle: &str) -> Vec<&str> {
        self.lines().filter(|l| l.contains(needle)).collect()
    }
    pub fn last_line(&self) -> &str {
        self.out.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("")
    }
    /// The value of a `measure NAME=VALUE` line.
    pub fn measure(&self, name: &str) -> Option<&str> {
        let key = format!("measure {name}=");
        self.out.lines().find_map(|l| l.strip_prefix(key.as_str()))
    }
    pub fn num(&self, name: &str) -> Option<f64> {
        self.measure(name).and_then(|v| v.trim().parse().ok())
    }
    pub fn fails(&self) -> Vec<&str> {
        self.out.lines().filter(|l| l.starts_with("FAIL")).collect()
    }
}

/// Splits "==== BEGIN label" / "==== END label exit N [(T ms)]" blocks.
pub fn blocks(text: &str) -> BTreeMap<String, Block> {
    let mut map = BTreeMap::new();
    let mut cur: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(label) = line.strip_prefix("==== BEGIN ") {
            cur = Some((label.trim().to_string(), String::new()));
        } else if let Some(rest) = line.strip_prefix("==== END ") {
            let exit =
                rest.rsplit_once(" exit ").and_then(|(_, r)| r.split_whitespace().next()).and_then(|n| n.parse().ok());
            if let Some((label, out)) = cur.take() {
                map.insert(label, Block { out, exit });
            }
        } else if let Some((_, out)) = cur.as_mut() {
            out.push_str(line);
            out.push('\n');
        }
    }
    map
}

/// Runs `cmd`, panicking with its output unless it succeeds.
pub fn run_logged(what: &str, cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// Builds the cdylib the C programs link. Always: `cargo test --test
/// c_programs` compiles only the rlib this test needs, so an existing
/// librdmasafe.so may be stale. A no-op when it is up to date.
pub fn ensure_library(profile: &Path) -> PathBuf {
    build_cdylib(profile, "rdmasafe-capi", "librdmasafe.so")
}

/// `cargo build -p <package>` into this test's target dir and profile;
/// the library `<profile>/<file>` it made.
pub fn build_cdylib(profile: &Path, package: &str, file: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root()).args(["build", "-p", package]);
    if profile.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    if let Some(target) = profile.parent() {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    run_logged(&format!("cargo build -p {package}"), &mut cmd);
    let lib = profile.join(file);
    assert!(lib.exists(), "{} is missing after the build", lib.display());
    lib
}
