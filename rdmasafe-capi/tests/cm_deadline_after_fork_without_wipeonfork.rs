//! As `cm_deadline_after_fork`, on a kernel without `MADV_WIPEONFORK`
//! (before 4.14; here a seccomp filter of the test's thread, which makes
//! the first CM call, refuses it): the deadline thread's
//! state then lives in a static, which a `pthread_atfork` child handler
//! clears. Without that handler the child inherited the state as "running"
//! and its held original was never acked (the test's child: not within
//! 20 s). One test per process: the deadline thread is process-wide.

mod standin;

#[test]
fn without_wipe_on_fork_a_child_still_keeps_the_deadline() {
    standin::refuse_wipe_on_fork();
    standin::forked_child_keeps_the_deadline();
    assert_eq!(
        standin::NO_WIPE_LINES.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the fallback was taken (the state's first use was on this thread)"
    );
}
