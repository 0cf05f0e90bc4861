//! The threads rdmasafe starts on its own block every signal. The CM
//! ack-deadline thread is started by the first get, from whatever app
//! thread gets first, and used to inherit that thread's mask: an app that
//! then blocked SIGTERM in its threads and waited for it with `sigwait`
//! (a daemon's clean shutdown) had the process's SIGTERM delivered to the
//! ack thread instead, whose default action ended the process (found by
//! an adversarial review: exit 143 under rdmasafe, 0 without). librdmacm's
//! two calls are replaced by the stand-in pair. One test per process.

mod standin;

use std::time::{Duration, Instant};

use rdmasafe::rdmasafe_event_free;

/// The blocked-signal mask of each thread of this process whose name
/// starts with "rdmasafe-" (name, mask), from /proc.
fn rdmasafe_threads() -> Vec<(String, u64)> {
    let mut found = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = t.expect("a task").path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else { continue };
        let name = name.trim().to_string();
        if !name.starts_with("rdmasafe-") {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).expect("the task's status");
        let blk = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).expect("a SigBlk line");
        found.push((name, u64::from_str_radix(blk.trim(), 16).expect("SigBlk in hex")));
    }
    found
}

#[test]
fn the_ack_deadline_thread_blocks_every_signal() {
    standin::install_calls();
    let (mut ch, w) = standin::channel();
    // This thread blocks nothing: the mask a lazily started thread copied.
    // SAFETY: a sigset_t filled by sigemptyset; this thread's mask only.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        assert_eq!(libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()), 0);
    }
    let ev = standin::get_copy(&mut ch, w);
    let patience = Instant::now() + Duration::from_secs(60);
    let mut threads = rdmasafe_threads();
    while !threads.iter().any(|t| t.0 == "rdmasafe-ack") && Instant::now() < patience {
        std::thread::sleep(Duration::from_millis(5));
        threads = rdmasafe_threads();
    }
    assert!(threads.iter().any(|t| t.0 == "rdmasafe-ack"), "the get started the ack-deadline thread: {threads:?}");
    let bit = |sig: i32| 1u64 << (sig - 1);
    for (name, mask) in &threads {
        for (sig, what) in [
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGINT, "SIGINT"),
            (libc::SIGHUP, "SIGHUP"),
            (libc::SIGUSR1, "SIGUSR1"),
            (libc::SIGALRM, "SIGALRM"),
            (libc::SIGCHLD, "SIGCHLD"),
            (libc::SIGPIPE, "SIGPIPE"),
        ] {
            assert_ne!(mask & bit(sig), 0, "{name} takes {what}: its blocked mask is {mask:#x}");
        }
    }
    // SAFETY: the copy got above, freed once.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
}
