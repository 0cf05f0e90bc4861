//! A stand-in for librdmacm's event channel, for host tests that replace
//! librdmacm's two event calls (`sys::set_cm_event_calls`): a channel's fd
//! is a non-blocking pipe's read end, and each byte in the pipe is one
//! ready event.
#![allow(dead_code)]

use std::os::raw::c_int;

use rdmasafe_core::sys::rdma_event_channel;

/// A stand-in channel and its pipe's write end.
pub fn channel() -> (Box<rdma_event_channel>, c_int) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two fds.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
    (Box::new(rdma_event_channel { fd: fds[0] }), fds[1])
}

/// Makes one more event ready on the channel whose write end is `w`.
pub fn ready(w: c_int) {
    // SAFETY: w is a pipe's write end; one byte from a live buffer.
    assert_eq!(unsafe { libc::write(w, b"e".as_ptr().cast(), 1) }, 1);
}

/// For a stand-in get: takes one ready event off `ch`; false (errno is
/// read()'s: EAGAIN when nothing is ready) if there is none.
///
/// # Safety
/// `ch` must be a live stand-in channel.
pub unsafe fn take_ready(ch: *mut rdma_event_channel) -> bool {
    let mut b = 0u8;
    // SAFETY: ch is live (caller); b is one writable byte.
    unsafe { libc::read((*ch).fd, (&mut b as *mut u8).cast(), 1) == 1 }
}

/// Makes one event ready on `ch` (write end `w`) and gets its copy with
/// `rdmasafe_get_event` (asserting success).
pub fn get_copy(ch: &mut rdma_event_channel, w: c_int) -> *mut rdmasafe_core::sys::rdma_cm_event {
    ready(w);
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live stand-in channel; ev is writable.
    assert_eq!(unsafe { rdmasafe::rdmasafe_get_event(ch, &mut ev) }, 0);
    ev
}
