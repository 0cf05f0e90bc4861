//! The ack deadline's log line ("held past its ack deadline") never holds
//! up the deadline: a log callback that blocks until another held
//! original is acked by its deadline (in a real program: a callback that
//! takes an app lock which a thread in `rdma_destroy_id` holds, waiting for
//! an event of that id) is released by that ack. The reaper used to write
//! the line itself, before its ack: such a callback stopped every deadline
//! of the process, and its destroy never returned.
//! librdmacm's two calls are replaced (`set_cm_event_calls`) by a stand-in:
//! each byte in the channel's pipe is one ready event, each event a fresh
//! allocation, and the stand-in ack records it.

mod standin;

use std::collections::HashSet;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_set_log_callback, rdmasafe_set_log_level};
use rdmasafe_core::cm::SyntheticEvent;
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};
use standin::{channel, get_copy, take_ready};

/// The originals the stand-in get handed out, in order.
static GOT: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static ACKED: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
static ACK_CV: Condvar = Condvar::new();
/// Per deadline line the callback saw: were both originals acked before
/// the watchdog.
static SEEN: Mutex<Vec<bool>> = Mutex::new(Vec::new());

/// Far beyond the ack deadline (50 ms) plus the reaper's period: reaching
/// it means the second original was never going to be acked.
const WATCHDOG: Duration = Duration::from_secs(30);

unsafe extern "C-unwind" fn fake_get(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: ch is the test's channel.
    if !unsafe { take_ready(ch) } {
        return -1; // errno is read()'s
    }
    let e = Box::into_raw(SyntheticEvent::zeroed()) as usize;
    GOT.lock().unwrap().push(e);
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

/// Both originals acked (the second one is got after the first line).
fn both_acked(a: &Option<HashSet<usize>>) -> bool {
    let got = GOT.lock().unwrap();
    got.len() == 2 && got.iter().all(|e| a.as_ref().is_some_and(|a| a.contains(e)))
}

unsafe extern "C" fn log_cb(_ctx: *mut c_void, _level: c_int, msg: *const c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    if !msg.contains("held past its ack deadline") {
        return;
    }
    let end = Instant::now() + WATCHDOG;
    let mut a = ACKED.lock().unwrap();
    while !both_acked(&a) && Instant::now() < end {
        a = ACK_CV.wait_timeout(a, Duration::from_millis(100)).unwrap().0;
    }
    let ok = both_acked(&a);
    drop(a);
    SEEN.lock().unwrap().push(ok);
}

#[test]
fn a_log_callback_blocked_on_the_deadline_line_does_not_stop_the_deadlines() {
    // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for
    // zeroed events (no id, no private data), from any thread.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
        .expect("first CM use of this process");
    assert!(rdmasafe_cm_set_ack_deadline(50) >= 0);
    let (mut ch, w) = channel();
    assert_eq!(rdmasafe_set_log_callback(Some(log_cb), null_mut()), 0);
    assert_eq!(rdmasafe_set_log_level(4), 0); // debug: the deadline's lines
    let first = get_copy(&mut ch, w);
    // The first deadline line's callback waits for the second original,
    // which is got only now, and acked by its own deadline.
    let end = Instant::now() + WATCHDOG;
    while SEEN.lock().unwrap().is_empty() && ACKED.lock().unwrap().as_ref().is_none_or(|a| a.is_empty()) {
        assert!(Instant::now() < end, "the first copy's deadline never came");
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = get_copy(&mut ch, w);
    while SEEN.lock().unwrap().len() < 2 {
        assert!(Instant::now() < end + WATCHDOG, "the deadline lines never came");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(rdmasafe_set_log_level(0), 0);
    let seen = SEEN.lock().unwrap().clone();
    assert_eq!(
        seen,
        [true, true],
        "a callback of the deadline line waited {WATCHDOG:?} for the other original's deadline ack"
    );
    for ev in [first, second] {
        // SAFETY: copies got above, freed once (their originals are acked).
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
}
