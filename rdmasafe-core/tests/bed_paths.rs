//! The Soft-RoCE test bed from any checkout: a job whose working directory,
//! command and files lie under /tmp (which the guest replaces by a fresh
//! tmpfs), in a path with spaces, still runs there with them, in one guest
//! (tests/bed/vm-run) and in two (tests/bed/vm-run2); what lies next to
//! them under /tmp stays hidden, and the guest's own /tmp stays writable.
//!
//! A fresh clone under /tmp, or a CI workspace there, depends on exactly
//! this. The binary runs on the host (its name does not start with `rxe_`)
//! and boots its guests itself.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::host::{repo, run, stdout};

/// A folder under /tmp (not $TMPDIR: /tmp is what the guest masks), with
/// spaces in its name, removed at the end.
struct TmpTree(PathBuf);

impl TmpTree {
    fn new(tag: &str) -> TmpTree {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let p = PathBuf::from(format!("/tmp/rdmasafe bed {tag} {}-{nanos}", std::process::id()));
        fs::create_dir_all(&p).unwrap();
        TmpTree(p)
    }
}

impl Drop for TmpTree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `work dir/` with `data file.txt` and `tools dir/my cat` (a copy of the
/// host's cat: a binary that exists nowhere else), and a sibling
/// `not shared/` that the guest must not see.
fn populate(t: &Path) -> (PathBuf, String) {
    let work = t.join("work dir");
    fs::create_dir_all(work.join("tools dir")).unwrap();
    fs::create_dir_all(t.join("not shared")).unwrap();
    fs::write(t.join("not shared/secret"), "hidden\n").unwrap();
    let text = format!("written on the host in {}\n", work.display());
    fs::write(work.join("data file.txt"), &text).unwrap();
    fs::copy("/bin/cat", work.join("tools dir/my cat")).unwrap();
    (work, text)
}

/// One guest, the job's working directory and binary under /tmp.
#[test]
fn vm_run_from_a_tmp_folder_with_spaces() {
    let t = TmpTree::new("vm-run");
    let (work, text) = populate(&t.0);
    let vm_run = repo().join("tests/bed/vm-run");

    // Relative command and file, in a working directory under /tmp.
    let out = run(
        "vm-run from the /tmp folder",
        Command::new(&vm_run).current_dir(&work).args([
            "--timeout",
            "600",
            "--",
            "./tools dir/my cat",
            "data file.txt",
        ]),
    );
    assert_eq!(out.status.code(), Some(0), "the job ran in the /tmp working directory");
    assert_eq!(stdout(&out), text, "the binary there printed the file there");

    // The guest's view: only what the job needs is shared; /tmp is the
    // guest's own (writable) otherwise; the job's exit status comes back.
    let guest_file = format!("/tmp/rdmasafe-bed-guest-{}", std::process::id());
    let script = format!(
        "set -u; pwd; \
         [[ -e {q}/'not shared/secret' ]] && echo sibling-visible; \
         touch {guest_file} && echo tmp-writable; \
         ! touch 'data file.txt' 2>/dev/null && echo shared-read-only; \
         exit 7",
        q = shell_quote(t.0.to_str().unwrap())
    );
    let out = run(
        "vm-run bash -c (the guest's view)",
        Command::new(&vm_run).current_dir(&work).args(["--timeout", "600", "--", "bash", "-c", &script]),
    );
    let s = stdout(&out);
    assert_eq!(out.status.code(), Some(7), "the job's exit status");
    assert!(s.starts_with(&format!("{}\n", work.display())), "the job ran in its working directory: {s:?}");
    assert!(!s.contains("sibling-visible"), "a host folder the job does not need stayed hidden: {s:?}");
    assert!(s.contains("tmp-writable"), "the guest's /tmp is its own and writable: {s:?}");
    assert!(s.contains("shared-read-only"), "the shared folder is read-only, as the host root: {s:?}");
    assert!(!Path::new(&guest_file).exists(), "what the guest wrote to its /tmp is not on the host");

    // Absolute command and file under /tmp, started from another folder.
    let out = run(
        "vm-run with absolute /tmp paths from the repo",
        Command::new(&vm_run)
            .current_dir(repo())
            .args(["--timeout", "600", "--"])
            .arg(work.join("tools dir/my cat"))
            .arg(work.join("data file.txt")),
    );
    assert_eq!(out.status.code(), Some(0), "the command named by its /tmp path ran");
    assert_eq!(stdout(&out), text);
}

/// Two guests, both jobs in a working directory under /tmp.
#[test]
fn vm_run2_from_a_tmp_folder_with_spaces() {
    let t = TmpTree::new("vm-run2");
    let (work, text) = populate(&t.0);
    let out = run(
        "vm-run2 from the /tmp folder",
        Command::new(repo().join("tests/bed/vm-run2")).current_dir(&work).args([
            "--timeout",
            "600",
            "--a",
            "'./tools dir/my cat' 'data file.txt'",
            "--b",
            "'./tools dir/my cat' 'data file.txt'; exit 5",
        ]),
    );
    let s = stdout(&out);
    let stderr = common::host::stderr(&out);
    for g in ['a', 'b'] {
        let lines: String =
            s.lines().filter_map(|l| l.strip_prefix(&format!("[{g}] "))).map(|l| format!("{l}\n")).collect();
        assert_eq!(lines, text, "guest {g} ran its job in the /tmp working directory");
    }
    assert!(stderr.contains("[bed2] status a=0 b=5"), "both jobs ran, their statuses came back");
    assert_eq!(out.status.code(), Some(5), "vm-run2 exits with b's status");
}

/// Single quotes for bash.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
