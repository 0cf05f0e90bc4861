//! The CMake build links librdmasafe.so itself (`cc -shared` over the
//! static library, with the version script): that link must take the
//! linker flags a distribution or a user passes, as CMake's own shared
//! library links do, so hardening such as `-Wl,-z,relro,-z,now` is not
//! silently dropped.
//!
//! `relink_honours_ldflags_and_cmake_shared_linker_flags` configures three
//! fresh build trees (examples off; the cargo part reuses the workspace
//! target directory, so an up-to-date release build costs nothing) and
//! builds only the libraries:
//! - `LDFLAGS=-Wl,-z,relro,-z,now` in the environment at configure time:
//!   the .so has BIND_NOW (`readelf -d`) and GNU_RELRO (`readelf -l`);
//! - `-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-z,relro,-z,now`: the same;
//! - no flags: no BIND_NOW (so the flags above made the difference), and
//!   still GNU_RELRO (the toolchain's default is kept); that tree then
//!   reconfigured with the flags and rebuilt is relinked (BIND_NOW).
//!
//! The trees are removed when the test passes.
//!
//! Runs on the host, no RDMA device needed.

mod common;

use common::{profile_dir, root};

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const HARDENING: &str = "-Wl,-z,relro,-z,now";

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {cmd:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Configures a fresh build tree (LDFLAGS is read at the first configure
/// only), builds the libraries, returns the path of librdmasafe.so.X.Y.Z.
fn build(name: &str, ldflags: Option<&str>, defs: &[String]) -> PathBuf {
    let target = profile_dir().parent().unwrap().to_path_buf();
    let dir = target.join("link-flags").join(name);
    if dir.exists() {
        fs::remove_dir_all(&dir).unwrap();
    }
    let mut cfg = Command::new("cmake");
    cfg.arg("-S")
        .arg(root())
        .arg("-B")
        .arg(&dir)
        .arg(format!("-DRDMASAFE_CARGO_TARGET_DIR={}", target.display()))
        .arg("-DRDMASAFE_BUILD_EXAMPLES=OFF")
        .args(defs)
        .env_remove("LDFLAGS");
    if let Some(f) = ldflags {
        cfg.env("LDFLAGS", f);
    }
    run(&format!("cmake configure ({name})"), &mut cfg);
    run(
        &format!("cmake --build ({name})"),
        Command::new("cmake").arg("--build").arg(&dir).args(["--target", "rdmasafe_libs", "-j", "2"]),
    );
    let so = dir.join(format!("librdmasafe.so.{}", env!("CARGO_PKG_VERSION")));
    assert!(so.is_file(), "{name}: no {}", so.display());
    so
}

/// (BIND_NOW set in the dynamic section, a GNU_RELRO segment)
fn hardening(so: &Path) -> (bool, bool) {
    let dynamic = run("readelf -d", Command::new("readelf").arg("-d").arg(so));
    let bind_now = dynamic.lines().any(|l| {
        l.contains("(BIND_NOW)")
            || (l.contains("(FLAGS)") && l.contains("BIND_NOW"))
            || (l.contains("(FLAGS_1)") && l.split_whitespace().any(|w| w == "NOW"))
    });
    let segments = run("readelf -lW", Command::new("readelf").arg("-lW").arg(so));
    let relro = segments.lines().any(|l| l.trim_start().starts_with("GNU_RELRO"));
    (bind_now, relro)
}

#[test]
fn relink_honours_ldflags_and_cmake_shared_linker_flags() {
    let from_env = hardening(&build("ldflags", Some(HARDENING), &[]));
    let from_cache = hardening(&build("cmake-flags", None, &[format!("-DCMAKE_SHARED_LINKER_FLAGS={HARDENING}")]));
    let default_so = build("default", None, &[]);
    let default = hardening(&default_so);
    // the same tree reconfigured with the flags: the library is relinked
    let dir = default_so.parent().unwrap().to_path_buf();
    run(
        "cmake reconfigure (default + flags)",
        Command::new("cmake")
            .arg("-S")
            .arg(root())
            .arg("-B")
            .arg(&dir)
            .arg(format!("-DCMAKE_SHARED_LINKER_FLAGS={HARDENING}")),
    );
    run(
        "cmake --build (default + flags)",
        Command::new("cmake").arg("--build").arg(&dir).args(["--target", "rdmasafe_libs", "-j", "2"]),
    );
    let reconfigured = hardening(&default_so);
    println!(
        "[link_flags] (BIND_NOW, GNU_RELRO): LDFLAGS {from_env:?}, CMAKE_SHARED_LINKER_FLAGS {from_cache:?}, \
         default {default:?}, default reconfigured with the flags {reconfigured:?}"
    );
    let mut problems = Vec::new();
    if from_env != (true, true) {
        problems
            .push(format!("LDFLAGS={HARDENING} at configure time: BIND_NOW {}, GNU_RELRO {}", from_env.0, from_env.1));
    }
    if from_cache != (true, true) {
        problems.push(format!(
            "-DCMAKE_SHARED_LINKER_FLAGS={HARDENING}: BIND_NOW {}, GNU_RELRO {}",
            from_cache.0, from_cache.1
        ));
    }
    if default.0 {
        problems.push("the default build has BIND_NOW: the test cannot tell the flags apart from the default".into());
    }
    if !default.1 {
        problems.push("the default build lost GNU_RELRO".into());
    }
    if reconfigured != (true, true) {
        problems.push(format!(
            "a default tree reconfigured with -DCMAKE_SHARED_LINKER_FLAGS={HARDENING} and rebuilt: BIND_NOW {}, \
             GNU_RELRO {} (not relinked?)",
            reconfigured.0, reconfigured.1
        ));
    }
    assert!(problems.is_empty(), "librdmasafe.so linker flags:\n  {}", problems.join("\n  "));
    // Passed: the three trees (over 200 MB, two static libraries each) go;
    // a failure leaves them for a look.
    let trees = dir.parent().expect("<target>/link-flags");
    fs::remove_dir_all(trees).unwrap_or_else(|e| panic!("remove {}: {e}", trees.display()));
}
