//! A get that would hold librdmacm's original (an ack deadline is set, as
//! by default) but cannot start the thread that keeps the deadline fails
//! with ENOMEM and leaves the event ready; the next get, once the thread
//! can start, keeps the deadline. It used to return the copy with the
//! original held and no thread: `rdma_destroy_id` of its id then waited
//! for the free however long that took, past the deadline the docs
//! promise (found by an adversarial test, under an address-space limit
//! that left no room for the thread's stack). librdmacm's two calls are
//! replaced by the stand-in pair. One test per process: the limit and the
//! deadline thread are process-wide.

mod standin;

use std::ptr::null_mut;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_reserve, rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::sys;

#[test]
fn a_get_that_cannot_start_the_deadline_thread_fails_and_takes_nothing() {
    standin::install_calls();
    let (mut ch, w) = standin::channel();
    assert!(rdmasafe_cm_reserve(64) >= 1, "storage for copies, made before the limit");
    assert_eq!(rdmasafe_cm_set_ack_deadline(50), 1000, "the default deadline (none set yet)");
    standin::ready(w);
    // 1 MiB above what the process uses: no room for a thread's 2 MiB stack
    // (glibc would reuse a cached stack of an exited thread: none has
    // exited in this process before this get).
    let (rc, errno, _) = standin::get_with_headroom(&mut ch, 1 << 20);
    assert_eq!((rc, errno), (-1, libc::ENOMEM), "the get that could not start the deadline thread");
    assert_eq!(standin::ACKS.load(Relaxed), 0, "nothing was taken, so nothing acked");

    // The event is still ready; now the thread starts and keeps the
    // deadline: the original is acked without a free.
    let mut ev = null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { rdmasafe_get_event(&mut *ch, &mut ev) }, 0, "errno {}", sys::errno_raw());
    let patience = Instant::now() + Duration::from_secs(60);
    while standin::ACKS.load(Relaxed) == 0 && Instant::now() < patience {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(standin::ACKS.load(Relaxed), 1, "the original acked at the deadline, the copy still held");
    // SAFETY: the copy got above, freed once.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    assert_eq!(standin::ACKS.load(Relaxed), 1, "acked once");
}
