//! The double-free quarantine of `rdmasafe_event_free`, through the C
//! calls, in a process of its own (the free list starts empty, as in a
//! program's first copies). librdmacm's two calls are replaced
//! (`set_cm_event_calls`) by a stand-in that hands out one synthetic event,
//! or fails with EAGAIN as a non-blocking channel with nothing ready does.
//!
//! The header's promise: "A freed copy's storage is handed out again only
//! after at least 64 other copies were got since its free (gets that fail
//! do not count), so a stale pointer freed a second time within that
//! window is always EINVAL".

use std::os::raw::c_int;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

use rdmasafe::{rdmasafe_event_free, rdmasafe_event_get_contexts, rdmasafe_get_event};
use rdmasafe_core::cm::{SyntheticEvent, QUARANTINE};
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};

static EVENT: AtomicUsize = AtomicUsize::new(0);
/// The stand-in fails its gets with EAGAIN while set.
static EMPTY: AtomicBool = AtomicBool::new(false);

unsafe extern "C-unwind" fn fake_get(_ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    if EMPTY.load(Relaxed) {
        sys::set_errno(libc::EAGAIN);
        return -1;
    }
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = EVENT.load(Relaxed) as *mut rdma_cm_event };
    0
}

unsafe extern "C" fn fake_ack(_ev: *mut rdma_cm_event) -> c_int {
    0
}

/// A channel pointer the stand-in never reads (rdmasafe passes it through).
fn channel() -> *mut rdma_event_channel {
    std::ptr::NonNull::<rdma_event_channel>::dangling().as_ptr()
}

fn get() -> *mut rdma_cm_event {
    let mut ev = null_mut();
    // SAFETY: channel is passed through to the stand-in only.
    assert_eq!(unsafe { rdmasafe_get_event(channel(), &mut ev) }, 0);
    ev
}

fn free(ev: *mut rdma_cm_event) -> c_int {
    // SAFETY: any pointer value is checked before use.
    unsafe { rdmasafe_event_free(ev) }
}

fn alive(ev: *mut rdma_cm_event) -> bool {
    let (mut c, mut l) = (null_mut(), null_mut());
    // SAFETY: as above.
    unsafe { rdmasafe_event_get_contexts(ev, &mut c, &mut l) == 0 }
}

/// One test: the cases need the free list in a known order (the first one
/// an empty free list), so they run in sequence.
#[test]
fn stale_free_within_the_quarantine_is_einval() {
    let e = SyntheticEvent::zeroed();
    EVENT.store(Box::into_raw(e) as usize, Relaxed);
    // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for this
    // one event (no id, no private data), from any thread.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
        .expect("first CM use of this process");

    // 1. QUARANTINE + 1 copies freed in a row, then one get: the first
    // freed copy's storage must not come back (it did when reuse waited
    // for QUARANTINE free slots behind it rather than copies made).
    let copies: Vec<_> = (0..=QUARANTINE).map(|_| get()).collect();
    for &c in &copies {
        assert_eq!(free(c), 0);
    }
    let fresh = get();
    sys::set_errno(0);
    assert_eq!(free(copies[0]), -1, "a stale free with no copy made since its free");
    assert_eq!(sys::errno_raw(), libc::EINVAL);
    assert!(alive(fresh), "the stale free freed the newer copy");
    assert_eq!(free(fresh), 0);

    // 2. Failed gets (EAGAIN) hand no copy out, so they do not shorten the
    // window either: after a free, k failed gets and QUARANTINE - 1 copies
    // never bring the freed storage back, for every k up to twice the
    // window (a free list that failed gets cycled brings it to the front
    // for one k of these at least, whatever its length then).
    for k in 0..=2 * QUARANTINE + 1 {
        let p = get();
        assert_eq!(free(p), 0);
        EMPTY.store(true, Relaxed);
        for _ in 0..k {
            let mut ev = null_mut();
            // SAFETY: channel is passed through to the stand-in only.
            assert_eq!(unsafe { rdmasafe_get_event(channel(), &mut ev) }, -1);
            assert_eq!(sys::errno_raw(), libc::EAGAIN);
        }
        EMPTY.store(false, Relaxed);
        let held: Vec<_> = (0..QUARANTINE - 1).map(|_| get()).collect();
        assert!(
            !held.contains(&p),
            "storage handed out again after {k} failed gets and fewer than {QUARANTINE} copies"
        );
        sys::set_errno(0);
        assert_eq!(free(p), -1, "a stale free after {k} failed gets");
        assert_eq!(sys::errno_raw(), libc::EINVAL);
        for h in held {
            assert_eq!(free(h), 0, "the stale free freed a newer copy");
        }
    }
}
