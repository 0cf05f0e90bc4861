//! The preload's check mode at exit, on the host: a program whose signal
//! handler calls `exit` (as many tools' SIGINT handlers do) while the
//! interrupted thread is inside the preload's book-keeping of a CQ event
//! used to hang for good: the exit report waited for the book's lock,
//! which that same thread held (found by an adversarial review: 12 of 20
//! runs hung; without the preload 0 of 20; here the third run hung before
//! the fix). The exit report now gives up on a book that stays locked, and
//! says so. (An exit() from a signal handler is not async-signal-safe: a
//! signal that lands inside malloc can still hang the exit report's own
//! allocations, as it can any exit handler's; this case is the preload's
//! own lock.) libibverbs' CQ event calls
//! are replaced by a stand-in (tests/preload_host/standin_ibv.c); this is
//! the preload's own logic, no RDMA claim rests on it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{build_cdylib, profile_dir, root, run_logged};

/// Builds the preload and the two C files into `<target>/preload-host/`.
fn build() -> (PathBuf, PathBuf, PathBuf) {
    let profile = profile_dir();
    let target = profile.parent().expect("<target>");
    let preload = build_cdylib(&profile, "rdmasafe-preload", "librdmasafe_preload.so");
    let out = target.join("preload-host");
    std::fs::create_dir_all(&out).expect("the output folder");
    let src = root().join("rdmasafe-capi/tests/preload_host");
    let cc = |what: &str, args: &[&Path], extra: &[&str]| {
        let mut cmd = Command::new("cc");
        cmd.args(["-Wall", "-Wextra", "-Werror", "-O2", "-g"]).args(args).args(extra);
        run_logged(what, &mut cmd);
    };
    let standin = out.join("libstandin_ibv.so");
    cc("cc standin_ibv.c", &[&src.join("standin_ibv.c"), Path::new("-o"), &standin], &["-shared", "-fPIC"]);
    let prog = out.join("exit_in_handler");
    cc("cc exit_in_handler.c", &[&src.join("exit_in_handler.c"), Path::new("-o"), &prog], &["-libverbs"]);
    (preload, standin, prog)
}

#[test]
fn exit_from_a_signal_handler_in_check_mode_does_not_hang() {
    let (preload, standin, prog) = build();
    // LD_PRELOAD splits at spaces and colons: a path with either is passed
    // by a link in a plain temporary folder.
    let dir = std::env::temp_dir().join(format!("rdmasafe-preload-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let (p, s) = (dir.join("p.so"), dir.join("s.so"));
    for (link, to) in [(&p, &preload), (&s, &standin)] {
        let _ = std::fs::remove_file(link);
        std::os::unix::fs::symlink(to, link).expect("a link");
    }
    let runs = 20;
    let mut report = Vec::new();
    for run in 1..=runs {
        let mut child = Command::new(&prog)
            .env("LD_PRELOAD", format!("{} {}", p.display(), s.display()))
            .env("RDMASAFE_CHECK", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the program starts");
        // A watchdog, not a timing: the program exits 50 ms in.
        let patience = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait") {
                break Some(st);
            }
            if Instant::now() > patience {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        let skipped = err.contains("stayed locked");
        report.push(format!("run {run}: {status:?}{}", if skipped { ", a book skipped" } else { "" }));
        assert!(status.is_some(), "run {run} of {runs} hung at exit (killed after 30 s); stderr:\n{err}\n{report:?}");
        assert_eq!(status.and_then(|s| s.code()), Some(0), "run {run}: stderr:\n{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", report.join("; "));
}
