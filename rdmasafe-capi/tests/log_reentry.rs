//! The log callback may call rdmasafe functions (the header's promise for
//! `rdmasafe_log_cb`): here, at trace level, the callback that receives
//! "copied CM event" calls `rdmasafe_get_events` on a second channel while
//! the outer `rdmasafe_get_events` is still copying. librdmacm's two calls
//! are replaced (`set_cm_event_calls`) by a stand-in: a channel's fd is a
//! non-blocking pipe, and each byte in it is one ready event.

mod standin;

use std::os::raw::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::*};

use rdmasafe::{rdmasafe_event_free, rdmasafe_get_events, rdmasafe_set_log_callback, rdmasafe_set_log_level};
use rdmasafe_core::cm::SyntheticEvent;
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};
use standin::{channel, ready, take_ready};

static EVENT: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C-unwind" fn fake_get(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: ch is one of the test's channels.
    if !unsafe { take_ready(ch) } {
        return -1; // errno is read()'s: EAGAIN when nothing is ready
    }
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = EVENT.load(Relaxed) as *mut rdma_cm_event };
    0
}

unsafe extern "C" fn fake_ack(_ev: *mut rdma_cm_event) -> c_int {
    0
}

static INNER: AtomicUsize = AtomicUsize::new(0);
static INNER_RESULT: AtomicI32 = AtomicI32::new(i32::MIN);
static INNER_ERRNO: AtomicI32 = AtomicI32::new(0);

unsafe extern "C" fn log_cb(_ctx: *mut c_void, _level: c_int, msg: *const c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy();
    let ch = INNER.swap(0, SeqCst); // once, and not from the inner call's own log line
    if ch == 0 || !msg.contains("copied CM event") {
        if ch != 0 {
            INNER.store(ch, SeqCst);
        }
        return;
    }
    let mut evs = [null_mut(); 2];
    sys::set_errno(0);
    // SAFETY: a live stand-in channel; evs has room for 2.
    let r = unsafe { rdmasafe_get_events(ch as *mut rdma_event_channel, evs.as_mut_ptr(), 2, 0) };
    INNER_ERRNO.store(sys::errno_raw(), SeqCst);
    INNER_RESULT.store(r, SeqCst);
    for e in evs.iter().take(r.max(0) as usize) {
        // SAFETY: copies handed out just now.
        assert_eq!(unsafe { rdmasafe_event_free(*e) }, 0);
    }
}

#[test]
fn get_events_from_the_log_callback() {
    let e = SyntheticEvent::zeroed();
    EVENT.store(Box::into_raw(e) as usize, Relaxed);
    // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for this
    // one event (no id, no private data), from any thread.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
        .expect("first CM use of this process");
    let (mut outer, w1) = channel();
    let (mut inner, w2) = channel();
    ready(w1);
    ready(w2);
    INNER.store(&mut *inner as *mut rdma_event_channel as usize, SeqCst);
    assert_eq!(rdmasafe_set_log_callback(Some(log_cb), null_mut()), 0);
    assert_eq!(rdmasafe_set_log_level(5), 0);
    let mut evs = [null_mut(); 2];
    // SAFETY: a live stand-in channel; evs has room for 2.
    let r = unsafe { rdmasafe_get_events(&mut *outer, evs.as_mut_ptr(), 2, 0) };
    assert_eq!(rdmasafe_set_log_level(0), 0);
    assert_eq!(r, 1, "the outer get_events");
    assert_eq!(INNER_RESULT.load(SeqCst), 1, "get_events from the log callback (errno {})", INNER_ERRNO.load(SeqCst));
    // SAFETY: the outer call's copy.
    assert_eq!(unsafe { rdmasafe_event_free(evs[0]) }, 0);
}
