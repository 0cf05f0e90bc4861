//! A log line written while an event is being copied comes after
//! librdmacm's original is acked or held: a log callback that waits for
//! that original's ack (in a real program: a callback that takes an app
//! lock which another thread holds while it is in `rdma_destroy_id` of the
//! event's id) is then released by the ack deadline. A line written
//! before the hold would wait forever: nothing knows of the original yet.
//!
//! Both lines of the get path: "copied CM event" (trace), and the "CM
//! event copies are held" warning (warn, at 4096 copies alive). librdmacm's
//! two calls are replaced (`set_cm_event_calls`) by a stand-in: the
//! channel's fd is a non-blocking pipe, each byte in it is one ready event,
//! each event a fresh allocation, and the stand-in ack records it.

mod standin;

use std::collections::HashSet;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_set_log_callback, rdmasafe_set_log_level};
use rdmasafe_core::cm::SyntheticEvent;
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};
use standin::{channel, get_copy, take_ready};

/// The original the stand-in get handed out last.
static LAST: AtomicUsize = AtomicUsize::new(0);
static ACKED: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
static ACK_CV: Condvar = Condvar::new();
/// What the log callback saw: (the awaited line, the original was acked in time).
static SEEN: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());
/// The line the callback waits on ("" while it should not wait).
static AWAIT: Mutex<&str> = Mutex::new("");

/// Far beyond the ack deadline (50 ms) plus the reaper's period: reaching
/// it means the original was never going to be acked.
const WATCHDOG: Duration = Duration::from_secs(30);

unsafe extern "C-unwind" fn fake_get(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: ch is the test's channel.
    if !unsafe { take_ready(ch) } {
        return -1; // errno is read()'s
    }
    let e = Box::into_raw(SyntheticEvent::zeroed()) as usize;
    LAST.store(e, SeqCst);
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = e as *mut rdma_cm_event };
    0
}

unsafe extern "C" fn fake_ack(ev: *mut rdma_cm_event) -> c_int {
    let mut a = ACKED.lock().unwrap();
    assert!(a.get_or_insert_with(HashSet::new).insert(ev as usize), "an original acked twice");
    ACK_CV.notify_all();
    0
}

unsafe extern "C" fn log_cb(_ctx: *mut c_void, _level: c_int, msg: *const c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    let want = *AWAIT.lock().unwrap();
    if want.is_empty() || !msg.contains(want) {
        return;
    }
    let original = LAST.load(SeqCst);
    let end = Instant::now() + WATCHDOG;
    let mut a = ACKED.lock().unwrap();
    while !a.get_or_insert_with(HashSet::new).contains(&original) && Instant::now() < end {
        a = ACK_CV.wait_timeout(a, Duration::from_millis(100)).unwrap().0;
    }
    let acked = a.as_ref().unwrap().contains(&original);
    drop(a);
    SEEN.lock().unwrap().push((msg, acked));
}

fn seen_once(line: &str) {
    let seen = std::mem::take(&mut *SEEN.lock().unwrap());
    assert_eq!(seen.len(), 1, "the callback saw the {line:?} line once: {seen:?}");
    assert!(
        seen[0].1,
        "the log callback waited {WATCHDOG:?} for the original of the event being copied: it was logged \
         before the original was held, so no deadline could ack it ({:?})",
        seen[0].0
    );
}

#[test]
fn a_log_line_of_the_get_path_comes_after_the_hold() {
    // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for
    // zeroed events (no id, no private data), from any thread.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
        .expect("first CM use of this process");
    assert!(rdmasafe_cm_set_ack_deadline(50) >= 0);
    let (mut ch, w) = channel();
    assert_eq!(rdmasafe_set_log_callback(Some(log_cb), null_mut()), 0);

    // The trace line of every copy.
    *AWAIT.lock().unwrap() = "copied CM event";
    assert_eq!(rdmasafe_set_log_level(5), 0);
    let ev = get_copy(&mut ch, w);
    assert_eq!(rdmasafe_set_log_level(0), 0);
    *AWAIT.lock().unwrap() = "";
    seen_once("copied CM event");
    // SAFETY: the copy just got.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);

    // The warning at 4096 copies held: warn level only (the trace line of
    // each copy is off), and the callback waits only on that line.
    *AWAIT.lock().unwrap() = "CM event copies are held";
    assert_eq!(rdmasafe_set_log_level(2), 0);
    let held: Vec<_> = (0..4096).map(|_| get_copy(&mut ch, w)).collect();
    assert_eq!(rdmasafe_set_log_level(0), 0);
    *AWAIT.lock().unwrap() = "";
    seen_once("CM event copies are held");
    for ev in held {
        // SAFETY: copies got above, freed once.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
}
