//! Helpers for the host-side tests of the test bed itself (binaries whose
//! names do not start with `rxe_`: they run on the host and boot their
//! guests through tests/bed/vm-run and vm-run2).

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Runs `cmd` to its end and prints what it wrote (shown when a test fails).
pub fn run(what: &str, cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    println!(
        "==== {what}: {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
