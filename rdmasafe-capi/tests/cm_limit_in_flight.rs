//! `rdmasafe_cm_set_limit` bounds the copies alive when several threads get
//! from one channel at once: a get takes its unit of the bound before it
//! asks librdmacm, so threads blocked inside `rdma_get_cm_event` count.
//! (The check used to count only copies made: with a limit of 2, eight
//! threads blocked in librdmacm's get all passed it and held 8 copies.)
//! librdmacm's two calls are replaced (`set_cm_event_calls`) by a stand-in
//! whose get blocks until the test lets it return an event.

mod standin;

use std::os::raw::c_int;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_set_limit, rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::cm::SyntheticEvent;
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};

/// Gets inside the stand-in's `rdma_get_cm_event`.
static INSIDE: AtomicUsize = AtomicUsize::new(0);
/// Set when the stand-in's gets may return.
static GO: Mutex<bool> = Mutex::new(false);
static GO_CV: Condvar = Condvar::new();

const THREADS: usize = 8;
const LIMIT: u64 = 2;
/// A watchdog, not a timing: what is waited for happens at once or never.
const WATCHDOG: Duration = Duration::from_secs(60);

unsafe extern "C-unwind" fn blocking_get(_ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    INSIDE.fetch_add(1, SeqCst);
    let mut go = GO.lock().unwrap();
    while !*go {
        go = GO_CV.wait(go).unwrap();
    }
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = Box::into_raw(SyntheticEvent::zeroed()).cast() };
    0
}

unsafe extern "C" fn ack(ev: *mut rdma_cm_event) -> c_int {
    // SAFETY: an event blocking_get made, acked once.
    drop(unsafe { Box::from_raw(ev.cast::<SyntheticEvent>()) });
    0
}

#[test]
fn threads_getting_at_once_hold_no_more_than_the_limit() {
    // SAFETY: the stand-in pair behaves as librdmacm's for zeroed events.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: blocking_get, ack }) }.expect("first CM use of this process");
    assert_eq!(rdmasafe_cm_set_limit(LIMIT), 0);
    let (ch, _w) = standin::channel();
    let ch = Box::into_raw(ch) as usize;
    let getters: Vec<_> = (0..THREADS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut ev = null_mut();
                // SAFETY: a live stand-in channel; ev is writable.
                let r = unsafe { rdmasafe_get_event(ch as *mut rdma_event_channel, &mut ev) };
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                (r, errno, ev as usize)
            })
        })
        .collect();
    // Every thread is either inside the stand-in's get or refused.
    let end = Instant::now() + WATCHDOG;
    while getters.iter().filter(|g| g.is_finished()).count() + INSIDE.load(SeqCst) < THREADS {
        assert!(Instant::now() < end, "the getters neither entered librdmacm's get nor returned");
        std::thread::sleep(Duration::from_millis(5));
    }
    let inside = INSIDE.load(SeqCst);
    *GO.lock().unwrap() = true;
    GO_CV.notify_all();
    let results: Vec<_> = getters.into_iter().map(|g| g.join().unwrap()).collect();
    let got: Vec<usize> = results.iter().filter(|r| r.0 == 0).map(|r| r.2).collect();
    let refused = results.iter().filter(|r| r.0 == -1 && r.1 == libc::ENOBUFS).count();
    assert_eq!(inside as u64, LIMIT, "gets that reached librdmacm with a limit of {LIMIT}: {results:?}");
    assert_eq!(got.len() as u64, LIMIT, "copies held with a limit of {LIMIT}: {results:?}");
    assert_eq!(refused, THREADS - LIMIT as usize, "the others were refused with -1/ENOBUFS: {results:?}");
    // Freed, the units come back: the next get passes again.
    for ev in got {
        // SAFETY: copies got above, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev as *mut rdma_cm_event) }, 0);
    }
    let mut ev = null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { rdmasafe_get_event(ch as *mut rdma_event_channel, &mut ev) }, 0);
    // SAFETY: the copy just got.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
}
