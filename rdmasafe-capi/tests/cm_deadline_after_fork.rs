//! A child forked after the ack-deadline thread started keeps the ack
//! deadline: its own thread starts at its first get with a deadline. The
//! thread does not survive a fork, and the child inherited its state as
//! "running": a copy the child held kept librdmacm's original un-acked
//! for good (under the preload, its `rdma_destroy_id` waited as long as
//! the copy was held, past the deadline; found by an adversarial test).
//! librdmacm's two calls are replaced by the stand-in pair. One test per
//! process: the deadline thread is process-wide.

mod standin;

#[test]
fn a_child_forked_after_the_deadline_thread_started_keeps_the_deadline() {
    standin::forked_child_keeps_the_deadline();
    assert_eq!(standin::NO_WIPE_LINES.load(std::sync::atomic::Ordering::Relaxed), 0, "the wipe-on-fork page was used");
}
