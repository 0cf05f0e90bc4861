//! Under an address-space limit (`ulimit -v`, RLIMIT_AS, as batch
//! schedulers set), copies still work and leave the app its memory: the
//! storage for copies takes at most a sixteenth of the limit. It used to
//! reserve 1 GiB whatever the limit: under about 1 GB every get failed
//! (EIO, a panic message per call), and above it the reservation took the
//! app's headroom. librdmacm's two calls are replaced (`set_cm_event_calls`)
//! by a stand-in: the channel's fd is a non-blocking pipe, each byte in it
//! one ready event. One test per process: the limit is process-wide.

mod standin;

use std::ptr::null_mut;

use rdmasafe::{rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::sys;
use standin::{channel, ready, vm_size};

#[test]
fn copies_work_under_an_address_space_limit_and_leave_the_app_its_memory() {
    standin::install_calls();
    let (mut ch, w) = channel();

    // 768 MiB more than in use now: below the old 1 GiB reservation.
    let headroom: u64 = 768 << 20;
    let limit = vm_size() + headroom;
    standin::set_address_space_limit(limit);

    let cap = rdmasafe_core::cm::capacity();
    assert!(cap > 0, "no storage for copies under a {limit}-byte limit");
    assert!((cap * 512) as u64 <= limit / 16, "{cap} slots take more than a sixteenth of the limit");

    let mut held = Vec::new();
    for k in 0..1000 {
        ready(w);
        let mut ev = null_mut();
        // SAFETY: a live stand-in channel; ev is writable.
        let rc = unsafe { rdmasafe_get_event(&mut *ch, &mut ev) };
        assert_eq!(rc, 0, "get {k}: errno {}", sys::errno_raw());
        held.push(ev);
    }
    // The app still has (most of) its headroom: half of it can be mapped
    // (address space, as the limit counts it; no memory used).
    let half = (headroom / 2) as usize;
    // SAFETY: an anonymous reservation at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            null_mut(),
            half,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "the app lost its headroom to the copies' storage");
    // SAFETY: the mapping just made, unmapped once.
    assert_eq!(unsafe { libc::munmap(p, half) }, 0);
    for ev in held {
        // SAFETY: copies got above, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
}
