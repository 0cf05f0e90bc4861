//! The plain Makefiles from a checkout whose path has spaces in it (what a
//! user's "My Projects/rdmasafe" or a CI workspace gives): tests/c,
//! tests/faults, tests/bench and examples-c build from a copy of their
//! sources in such a path, against a librdmasafe in such a path, into such
//! a path, both with LIBDIR/OUT given and with the defaults from
//! CARGO_TARGET_DIR; tests/consumer/make builds through pkg-config
//! against an install prefix in such a path. Each program gets the
//! library's folder as its rpath, spaces and all.
//!
//! Host only: nothing here needs RDMA. (The programs' runs in the guest,
//! and `tests/all.sh` from such a checkout, are the other tests' part.)

mod common;

use common::{profile_dir, root};

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed ({}): {cmd:?}\n{text}", out.status);
    text
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            // build output of a run from the source tree, if any
            if e.file_name() != "build" {
                copy_tree(&src, &dst);
            }
        } else {
            fs::copy(&src, &dst).unwrap();
        }
    }
}

/// The rpath / runpath folders of a binary.
fn rpaths(bin: &Path) -> Vec<String> {
    let out = Command::new("readelf").arg("-d").arg(bin).output().expect("readelf");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once("Library runpath: [").or_else(|| l.split_once("Library rpath: [")))
        .flat_map(|(_, r)| r.trim_end_matches(']').split(':').map(String::from).collect::<Vec<_>>())
        .collect()
}

struct Tree(PathBuf);
impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn makefiles_build_in_paths_with_spaces() {
    // librdmasafe.so and .a (cargo test builds only the rlib for this test)
    let profile = profile_dir();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
    let mut build = Command::new(cargo);
    build.current_dir(root()).args(["build", "-p", "rdmasafe-capi"]);
    if profile.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    build.env("CARGO_TARGET_DIR", profile.parent().unwrap());
    run("cargo build -p rdmasafe-capi", &mut build);

    let t = Tree(PathBuf::from(format!("/tmp/rdmasafe paths {}", std::process::id())));
    let _ = fs::remove_dir_all(&t.0);
    let src = t.0.join("my checkout/rdmasafe");
    for d in ["include", "tests/c", "tests/faults", "tests/bench", "tests/consumer", "examples-c", "docs/migration"] {
        copy_tree(&root().join(d), &src.join(d));
    }
    let lib = t.0.join("lib dir");
    fs::create_dir_all(&lib).unwrap();
    for f in ["librdmasafe.so", "librdmasafe.a"] {
        fs::copy(profile.join(f), lib.join(f)).unwrap();
    }

    // LIBDIR and OUT given
    let want: [(&str, &[&str]); 4] = [
        ("tests/c", &["cm_capi_test", "cq_loop_test"]),
        ("tests/faults", &["fault_node", "fault_devremove", "fault_storm", "fault_overrun", "leak_cycles"]),
        ("tests/bench", &["cm_storm_rdmasafe", "cm_storm_raw", "cq_pingpong_rdmasafe", "allocount.so", "cpurun"]),
        ("examples-c", &["messenger_server", "messenger_client", "rdmasafe_rdma_server", "rdmasafe_rdma_client"]),
    ];
    for (dir, progs) in want {
        let out = t.0.join("out dir").join(dir.replace('/', " "));
        let make = || {
            let mut m = Command::new("make");
            m.arg("-C")
                .arg(src.join(dir))
                .arg(format!("LIBDIR={}", lib.display()))
                .arg(format!("OUT={}", out.display()))
                .env_remove("CARGO_TARGET_DIR")
                .env_remove("MAKEFLAGS");
            m
        };
        run(&format!("make -C {dir}"), &mut make());
        for p in progs {
            let bin = out.join(p);
            assert!(bin.is_file(), "make -C {dir} built {}", bin.display());
            if !p.ends_with(".so") && *p != "cpurun" && !p.ends_with("_raw") {
                assert!(
                    rpaths(&bin).iter().any(|r| Path::new(r) == lib),
                    "{dir}/{p}: rpath {:?} names {}",
                    rpaths(&bin),
                    lib.display()
                );
            }
        }
        // make reads its targets and prerequisites right: a second run has
        // nothing to do
        let again = run(&format!("make -C {dir} (again)"), &mut make());
        assert!(
            again.contains("Nothing to be done") || again.contains("is up to date"),
            "make -C {dir} rebuilt up-to-date programs:\n{again}"
        );
    }

    // the defaults: TARGET_DIR from CARGO_TARGET_DIR, LIBDIR <target>/debug,
    // OUT <target>/c
    let target = t.0.join("target dir");
    fs::create_dir_all(target.join("debug")).unwrap();
    fs::copy(profile.join("librdmasafe.so"), target.join("debug/librdmasafe.so")).unwrap();
    run(
        "make -C tests/c with CARGO_TARGET_DIR",
        Command::new("make")
            .arg("-C")
            .arg(src.join("tests/c"))
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("MAKEFLAGS"),
    );
    assert!(target.join("c/cq_loop_test").is_file(), "built into $CARGO_TARGET_DIR/c");
    assert!(rpaths(&target.join("c/cq_loop_test")).iter().any(|r| Path::new(r) == target.join("debug")));

    // the consumer Makefile, through pkg-config, against a prefix with spaces
    let prefix = t.0.join("pre fix");
    fs::create_dir_all(prefix.join("lib/pkgconfig")).unwrap();
    fs::create_dir_all(prefix.join("include")).unwrap();
    for f in ["librdmasafe.so", "librdmasafe.a"] {
        fs::copy(profile.join(f), prefix.join("lib").join(f)).unwrap();
    }
    fs::copy(root().join("include/rdmasafe.h"), prefix.join("include/rdmasafe.h")).unwrap();
    let native = fs::read_to_string(root().join("rdmasafe-capi/abi/native-static-libs.txt")).unwrap();
    let pc = fs::read_to_string(root().join("cmake/rdmasafe.pc.in"))
        .unwrap()
        .replace("@pc_to_prefix@", "../..")
        .replace("@pc_libdir@", "lib")
        .replace("@pc_includedir@", "include")
        .replace("@PROJECT_VERSION@", env!("CARGO_PKG_VERSION"))
        .replace("@native_libs@", native.trim());
    fs::write(prefix.join("lib/pkgconfig/rdmasafe.pc"), pc).unwrap();
    let out = t.0.join("consumer out");
    run(
        "make -C tests/consumer/make",
        Command::new("make")
            .arg("-C")
            .arg(src.join("tests/consumer/make"))
            .arg(format!("OUT={}", out.display()))
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
            .env_remove("MAKEFLAGS"),
    );
    let want_lib = fs::canonicalize(prefix.join("lib")).unwrap();
    for p in ["cm_server_after", "cq_rank_after", "cq_rank_after_static", "cxx_consumer"] {
        let bin = out.join(p);
        assert!(bin.is_file(), "the consumer Makefile built {}", bin.display());
        if p != "cq_rank_after_static" {
            let r = rpaths(&bin);
            assert!(
                r.iter().any(|r| fs::canonicalize(r).ok().as_ref() == Some(&want_lib)),
                "{p}: rpath {r:?} names the prefix's lib/"
            );
        }
    }
}
