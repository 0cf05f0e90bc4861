//! The first CM call of a process short of address space (RLIMIT_AS
//! 64 KiB above what it uses) fails with ENOMEM or works, and takes
//! nothing it does not hand out: it never aborts. Setting up the copies'
//! storage allocated the free list's ring (128 KiB) with an allocation
//! that aborts on failure: SIGABRT, "memory allocation of 131072 bytes
//! failed" (found by an adversarial test). librdmacm's two calls are
//! replaced by the stand-in pair. The limit and the storage are
//! process-wide: a process of its own, whose main thread makes the call
//! (`harness = false`: a test thread's malloc arena has room reserved up
//! front, which the limit does not bound).

mod standin;

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free};

fn main() {
    standin::install_calls();
    // No deadline: the get needs no thread (whose stack would not fit
    // either) and goes straight to the storage's setup.
    rdmasafe_cm_set_ack_deadline(0);
    let (mut ch, w) = standin::channel();
    standin::ready(w);
    let (rc, errno, ev) = standin::get_with_headroom(&mut ch, 64 << 10);
    if rc == 0 {
        // SAFETY: the copy just got, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    } else {
        assert_eq!((rc, errno), (-1, libc::ENOMEM), "the first get under the limit");
        // SAFETY: a live stand-in channel.
        assert!(unsafe { standin::take_ready(&mut *ch) }, "the refused get left its event ready");
    }
    println!("the_first_cm_call_short_of_address_space_never_aborts: get -> {rc} (errno {errno}): ok");
}
