//! A child forked after the ack-deadline thread started keeps the ack
//! deadline: its own thread starts at its first get with a deadline. The
//! thread does not survive a fork, and the child inherited its state as
//! "running": a copy the child held kept librdmacm's original un-acked
//! for good (under the preload, its `rdma_destroy_id` waited as long as
//! the copy was held, past the deadline; found by an adversarial test).
//! librdmacm's two calls are replaced by the stand-in pair. One test per
//! process: the deadline thread is process-wide.

mod standin;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free};

/// Waits until the stand-in pair counted more than `n` acks, at most
/// `patience`; the count then.
fn acks_above(n: usize, patience: Duration) -> usize {
    let end = Instant::now() + patience;
    while standin::ACKS.load(Relaxed) <= n && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    standin::ACKS.load(Relaxed)
}

#[test]
fn a_child_forked_after_the_deadline_thread_started_keeps_the_deadline() {
    standin::install_calls();
    let (mut ch, w) = standin::channel();
    rdmasafe_cm_set_ack_deadline(20);
    // The parent holds an original past its deadline: the thread runs.
    let ev = standin::get_copy(&mut ch, w);
    assert_eq!(acks_above(0, Duration::from_secs(60)), 1, "the parent's original acked at the deadline");
    // SAFETY: the copy got above, freed once.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);

    // SAFETY: the child runs only the closure below, then _exit (never
    // back into the test harness).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let before = standin::ACKS.load(Relaxed);
            let ev = standin::get_copy(&mut ch, w);
            let after = acks_above(before, Duration::from_secs(20));
            // SAFETY: the copy got above, freed once.
            unsafe { rdmasafe_event_free(ev) };
            if after > before {
                0
            } else {
                1
            }
        }))
        .unwrap_or(2);
        // SAFETY: ends the child without running the parent's exit work.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: our child; status is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child ended by signal: status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's held original acked at the deadline (1: not within 20 s; 2: the child panicked)"
    );
}
