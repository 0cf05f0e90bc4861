//! Thread cancellation (`pthread_cancel`) in the waits of rdmasafe's C
//! calls.
//!
//! librdmacm's `rdma_get_cm_event` and libibverbs' `ibv_get_cq_event` are
//! cancellation points (their `write()` / `read()`), and C programs cancel
//! a thread that waits in them, then join it (a CM or CQ thread at
//! shutdown). glibc carries a cancellation out by unwinding the thread's
//! stack and running the cleanup handlers of the frames it leaves (a
//! "forced unwind"). Rust frames take that only if, at the call that is
//! cancelled, they own nothing with a destructor and catch nothing: a
//! `catch_unwind`, or the abort guard of an `extern "C"` function, ends the
//! process (glibc: "FATAL: exception not rethrown"). So a wait that must
//! stay cancellable is made through this module:
//!
//! * the call is declared `extern "C-unwind"` (it may unwind);
//! * what the caller took for it (a slot of the CM copy arena) is a plain
//!   value, given back by a cleanup handler registered with glibc's
//!   `_pthread_cleanup_push`, the function C's `pthread_cleanup_push` is
//!   built on without exceptions, if the thread is cancelled inside;
//! * every frame up to the C boundary holds only plain values across it,
//!   and the exported function is `extern "C-unwind"`.
//!
//! Everything else rdmasafe does on the app's thread contains no
//! cancellation point, or runs under [`CancelDisabled`] (the log output,
//! which writes to stderr or calls the app's callback; the panic message,
//! see [`panic_hook_without_cancellation`]).

use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr::null_mut;

use super::{rdma_cm_event, rdma_event_channel};

/// glibc's `struct _pthread_cleanup_buffer` (the layout of every glibc
/// since 2.0; a handler is run by the unwinder when the frame holding the
/// buffer is left).
#[repr(C)]
struct CleanupBuffer {
    routine: Option<unsafe extern "C" fn(*mut c_void)>,
    arg: *mut c_void,
    canceltype: c_int,
    prev: *mut CleanupBuffer,
}

/// glibc's `PTHREAD_CANCEL_DISABLE` (`PTHREAD_CANCEL_ENABLE` is 0).
const PTHREAD_CANCEL_DISABLE: c_int = 1;

extern "C" {
    fn _pthread_cleanup_push(buffer: *mut CleanupBuffer, routine: unsafe extern "C" fn(*mut c_void), arg: *mut c_void);
    fn _pthread_cleanup_pop(buffer: *mut CleanupBuffer, execute: c_int);
    fn pthread_setcancelstate(state: c_int, oldstate: *mut c_int) -> c_int;
}

extern "C-unwind" {
    /// libc's `poll`, which a cancellation may unwind.
    #[link_name = "poll"]
    fn poll_unwinding(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int;
}

/// `poll()` for readability of one fd (`timeout_ms` as poll's), a
/// cancellation point: returns poll's result (1 readable or error/hangup,
/// 0 timeout, -1 with errno).
///
/// # Safety
/// The callers' frames hold nothing to drop across the call and catch
/// nothing, up to an `extern "C-unwind"` C boundary (module doc).
#[inline]
pub unsafe fn poll_readable(fd: c_int, timeout_ms: c_int) -> c_int {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the call; the caller's contract covers
    // the unwind.
    unsafe { poll_unwinding(&mut p, 1, timeout_ms) }
}

/// `call()` with `on_cancel(arg)` run if the thread is cancelled inside it
/// (a cleanup handler, `_pthread_cleanup_push`); not run otherwise.
///
/// # Safety
/// `on_cancel(arg)` must be sound to call while `call` runs (`arg` lives
/// in a caller's frame), must not unwind, and undoes what the caller did
/// for the call; `call` holds plain values only (no destructor, no
/// `catch_unwind`) across its cancellation points, and so do the callers'
/// frames, as for [`poll_readable`]; `call` must not unwind but by a
/// thread cancellation (a panic would skip the pop below and leave glibc a
/// handler in a dead frame).
#[inline(always)]
pub unsafe fn call_with_cleanup<R>(
    on_cancel: unsafe extern "C" fn(*mut c_void),
    arg: *mut c_void,
    call: impl FnOnce() -> R,
) -> R {
    let mut buf = CleanupBuffer { routine: None, arg: null_mut(), canceltype: 0, prev: null_mut() };
    // SAFETY: buf lives in this frame until the pop below, or until the
    // unwinder leaves this frame, which is when glibc runs the handler
    // (and unlinks it).
    unsafe { _pthread_cleanup_push(&mut buf, on_cancel, arg) };
    let r = call();
    // SAFETY: the buffer pushed above, still the innermost one (a call
    // that pushes its own pops it before it returns).
    unsafe { _pthread_cleanup_pop(&mut buf, 0) };
    r
}

/// `rdma_get_cm_event` (through the table, [`super::get_cm_event`]) with
/// `on_cancel(arg)` run if the thread is cancelled inside it.
///
/// # Safety
/// As `rdma_get_cm_event` for `channel` and `event`; as
/// [`call_with_cleanup`] for the rest.
#[inline(always)]
pub unsafe fn get_cm_event_with_cleanup(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
    on_cancel: unsafe extern "C" fn(*mut c_void),
    arg: *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { call_with_cleanup(on_cancel, arg, || super::get_cm_event(channel, event)) }
}

/// Wraps the panic hook of the calling library's copy of the Rust
/// standard library so that it runs with cancellation disabled
/// ([`CancelDisabled`]). The default hook writes to stderr, a cancellation
/// point: a `pthread_cancel` pending when an internal panic happened was
/// acted on there, in the middle of the panic, and the forced unwind ended
/// the process at the panic boundary (`FATAL: exception not rethrown`)
/// instead of the boundary returning its documented error. With this, a
/// call that has no cancellation point of its own (such as
/// `rdmasafe_cq_loop_stop`, documented as callable with a cancellation
/// pending) returns that error, and the cancellation stays pending for the
/// thread's next cancellation point. A cancellation point met while the
/// panic unwinds (a destructor that closes an fd, say) still ends the
/// process, as one anywhere inside such a call does (the C API's
/// conventions).
///
/// For the load-time constructors of librdmasafe and the preload. In a C
/// program each of those `cdylib`s has its own standard library, so no
/// hook of the program's is touched; a Rust program that links
/// `rdmasafe-capi` as a library gets its own standard library's hook
/// wrapped at load (the hook it had still runs; a later `set_hook`
/// replaces the wrapper). Once per process.
pub fn panic_hook_without_cancellation() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let _off = CancelDisabled::new();
            previous(info)
        }));
    });
}

/// Test support for the C boundaries of librdmasafe and the preload (not
/// part of the API): checks that `boundary_panics`, a call of a boundary
/// around a body that panics with the message `"a deliberate panic of a
/// test"`, returns `-EIO` on a thread with a cancellation pending, with
/// the message written to stderr. Called from the unit test named `test`
/// (its path, for `--exact`), which this runs again as a child process
/// (that test alone, output not captured, so that the message goes to
/// stderr as in a C program); the child does the call and exits with
/// status 42 if the boundary returned `-EIO`. Panics (fails the test)
/// otherwise: a child killed by SIGABRT is a boundary that let the
/// cancellation end the process.
#[doc(hidden)]
pub fn check_panic_boundary_under_cancellation(test: &str, boundary_panics: impl FnOnce() -> c_int) {
    const CHILD: &str = "RDMASAFE_TEST_PANIC_CHILD";
    if std::env::var_os(CHILD).is_some() {
        // SAFETY: a deferred cancellation of this thread, left pending.
        // From here on only the boundary under test and _exit run on it;
        // _exit is no cancellation point, so no forced unwind crosses the
        // test's frames unless the boundary lets one.
        assert_eq!(unsafe { libc::pthread_cancel(libc::pthread_self()) }, 0);
        let r = boundary_panics();
        // SAFETY: as above.
        unsafe { libc::_exit(if r == -libc::EIO { 42 } else { 1 }) }
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(42), "the child: {:?} (a signal: it aborted), stderr: {stderr}", out.status);
    assert!(stderr.contains("a deliberate panic of a test"), "the message was written: {stderr}");
}

/// Cancellation disabled for the calling thread while the value lives
/// (`pthread_setcancelstate`), restored to what it was when dropped: a
/// `pthread_cancel` meanwhile stays pending and is acted on at the
/// thread's next cancellation point after that.
/// The value belongs to the thread that made it (not `Send`).
#[must_use]
pub struct CancelDisabled(c_int, PhantomData<*const ()>);

impl CancelDisabled {
    /// Disables cancellation. Touches no errno.
    #[inline]
    #[allow(clippy::new_without_default)] // a guard with an effect: no Default
    pub fn new() -> CancelDisabled {
        let mut old = 0;
        // SAFETY: a valid state constant and a writable int.
        unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut old) };
        CancelDisabled(old, PhantomData)
    }
}

impl Drop for CancelDisabled {
    #[inline]
    fn drop(&mut self) {
        let mut was = 0;
        // SAFETY: the state read in new(), a writable int.
        unsafe { pthread_setcancelstate(self.0, &mut was) };
    }
}
