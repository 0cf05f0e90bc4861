//! The log callback may call rdmasafe functions (the header's promise for
//! `rdmasafe_log_cb`), `rdmasafe_cq_loop_destroy` included: from a log line
//! of a call that is still using the same loop (here the "struct size
//! field" error of `rdmasafe_cq_loop_get_stats`), the destroy cannot wait
//! for that call, which waits for the callback: it is -EDEADLK, and the
//! loop lives on (it used to spin forever). The loop runs on a stand-in
//! completion channel (a pipe): nothing here needs RDMA.

use std::os::raw::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc;
use std::time::Duration;

use rdmasafe::{
    rdmasafe_cq_loop, rdmasafe_cq_loop_create, rdmasafe_cq_loop_destroy, rdmasafe_cq_loop_get_stats,
    rdmasafe_cq_loop_stats, rdmasafe_set_log_callback, rdmasafe_set_log_level,
};
use rdmasafe_core::sys::ibv_comp_channel;

static LOOP: AtomicUsize = AtomicUsize::new(0);
static INNER: AtomicI32 = AtomicI32::new(i32::MIN);

unsafe extern "C" fn log_cb(_ctx: *mut c_void, _level: c_int, msg: *const c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy();
    let l = LOOP.swap(0, SeqCst); // once
    if l != 0 && msg.contains("size") {
        INNER.store(rdmasafe_cq_loop_destroy(l as *mut rdmasafe_cq_loop), SeqCst);
    } else if l != 0 {
        LOOP.store(l, SeqCst);
    }
}

#[test]
fn destroying_a_loop_from_a_log_line_of_a_call_on_it_is_edeadlk() {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two fds.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: a zeroed ibv_comp_channel is a valid value of the C struct;
    // the loop only uses its fd.
    let mut ch: Box<ibv_comp_channel> = Box::new(unsafe { std::mem::zeroed() });
    ch.fd = fds[0];
    let mut l: *mut rdmasafe_cq_loop = null_mut();
    // SAFETY: a channel whose fd is live; default options; out writable.
    assert_eq!(unsafe { rdmasafe_cq_loop_create(&mut *ch, std::ptr::null(), &mut l) }, 0);
    let h = l as usize;
    LOOP.store(h, SeqCst);
    assert_eq!(rdmasafe_set_log_callback(Some(log_cb), null_mut()), 0);
    assert_eq!(rdmasafe_set_log_level(1), 0); // errors
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: zeroed is a valid stats struct; size 0 is the bad input.
        let mut st: rdmasafe_cq_loop_stats = unsafe { std::mem::zeroed() };
        st.size = 0;
        // SAFETY: st is writable.
        let r = unsafe { rdmasafe_cq_loop_get_stats(h as *mut rdmasafe_cq_loop, &mut st) };
        let _ = tx.send(r);
    });
    // A watchdog, not a timing: the call returns at once or never.
    let outer =
        rx.recv_timeout(Duration::from_secs(60)).expect("get_stats hung: its log callback's destroy waits for it");
    assert_eq!(rdmasafe_set_log_level(0), 0);
    assert_eq!(outer, -libc::EINVAL, "size 0");
    assert_eq!(INNER.load(SeqCst), -libc::EDEADLK, "the destroy from the log callback");
    assert_eq!(rdmasafe_cq_loop_destroy(l), 0, "the loop lived on and is destroyed now");
    assert_eq!(rdmasafe_cq_loop_destroy(l), -libc::EINVAL);
    // SAFETY: the pipe's fds, closed once.
    unsafe { libc::close(fds[0]) };
    unsafe { libc::close(fds[1]) };
}
