//! Once every copy the storage can hold is taken, a get fails with ENOMEM;
//! once copies are freed, gets work again. They failed for good: a freed
//! copy's storage waits out a quarantine of 64 copies made since its free,
//! and no copy could be made without storage, so the quarantine never
//! ended (found by a review: ENOMEM after every copy of a full arena was
//! freed, a Dispatcher retrying forever). The storage is made small by an
//! address-space limit (it takes at most a sixteenth of it), set while it
//! is reserved. librdmacm's two calls are replaced by the stand-in pair.
//! One test per process: the storage is process-wide.

mod standin;

use std::ptr::null_mut;

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::sys;
use standin::{channel, ready, vm_size};

#[test]
fn gets_work_again_once_copies_of_a_full_storage_are_freed() {
    standin::install_calls();
    rdmasafe_cm_set_ack_deadline(0); // no original held, no thread
    let (mut ch, w) = channel();
    standin::set_address_space_limit(vm_size() + (64 << 20));
    let cap = rdmasafe_core::cm::capacity(); // reserved now, under the limit
    standin::set_address_space_limit(libc::RLIM_INFINITY);
    assert!(cap > 0 && cap < rdmasafe_core::cm::MAX_SLOTS, "the premise: a storage smaller than the largest: {cap}");
    println!("storage for {cap} copies");
    let get = |ch: &mut sys::rdma_event_channel| {
        let mut ev = null_mut();
        // SAFETY: a live stand-in channel; ev is writable.
        let rc = unsafe { rdmasafe_get_event(ch, &mut ev) };
        (rc, sys::errno_raw(), ev)
    };
    let mut held = Vec::with_capacity(cap);
    for k in 0..cap {
        ready(w);
        let (rc, errno, ev) = get(&mut ch);
        assert_eq!(rc, 0, "get {k} of {cap}: errno {errno}");
        held.push(ev);
    }
    ready(w);
    let (rc, errno, _) = get(&mut ch);
    assert_eq!((rc, errno), (-1, libc::ENOMEM), "every copy taken: ENOMEM");
    for ev in held.drain(..) {
        // SAFETY: copies got above, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
    // The event the refused get left ready, then as many more as fit.
    for k in 0..2 * rdmasafe_core::cm::QUARANTINE {
        if k > 0 {
            ready(w);
        }
        let (rc, errno, ev) = get(&mut ch);
        assert_eq!(rc, 0, "get {k} after every copy was freed: errno {errno}");
        // SAFETY: the copy just got, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
}
