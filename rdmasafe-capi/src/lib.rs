//! The C ABI of rdmasafe (`librdmasafe.so`, `librdmasafe.a`,
//! `include/rdmasafe.h`).
//!
//! A thin layer over `rdmasafe-core`: argument checks, the panic boundary
//! (`guard`) that every export goes through, and the mapping from Rust
//! errors to the two C conventions (librdmacm's -1/errno for the drop-in CM
//! calls, a negative errno return for everything else).

#![deny(unsafe_op_in_unsafe_fn)]
// Exported types carry their C names (rdmasafe_cq_loop, ...).
#![allow(non_camel_case_types)]

mod abi;
mod async_events;
mod cm;
mod cq;
#[doc(hidden)]
pub mod fuzzing;
mod handles;
mod log;

pub use abi::*;
pub use async_events::*;
pub use cm::*;
pub use cq::*;
pub use log::*;

use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs an export's body; a panic becomes `on_panic()` instead of
/// unwinding into C (which would be undefined behaviour). The panic value
/// is only computed on a panic (it may set errno). Every export goes
/// through here, which is also where the C log backend is installed.
#[inline(always)]
pub(crate) fn guard<T>(on_panic: impl FnOnce() -> T, f: impl FnOnce() -> T) -> T {
    log::ensure_installed();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            log_panic();
            on_panic()
        }
    }
}

#[cold]
#[inline(never)]
fn log_panic() {
    ::log::error!(target: "rdmasafe", "internal panic caught at the C boundary");
}

/// The panic boundary of the async-signal-safe exports: no logger set-up
/// (a `Once` that a signal could interrupt half-way), nothing but
/// `catch_unwind`, which costs nothing unless a panic happens.
pub(crate) fn guard_signal_safe<T>(on_panic: impl FnOnce() -> T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| on_panic())
}

/// The boundary of the drop-in CM calls, which keep librdmacm's -1/errno
/// convention exactly: `Ok(v)` returns `v` with errno as it was when the
/// call began (whatever the library's own system calls left in it);
/// `Err(e)` sets errno to `e` and returns -1; a panic is -1 with EIO.
#[inline(always)]
pub(crate) fn guard_errno(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    // One lookup of the thread's errno slot for the save and the restore.
    let slot = rdmasafe_core::sys::errno_slot();
    // SAFETY: the calling thread's own errno, read and written only by it.
    let saved = unsafe { *slot };
    guard(
        || fail_errno(libc::EIO),
        || match f() {
            Ok(v) => {
                // SAFETY: as above (same thread: f ran on it).
                unsafe { *slot = saved };
                v
            }
            Err(e) => fail_errno(e),
        },
    )
}

/// For the -1/errno functions: sets errno and returns -1.
pub(crate) fn fail_errno(errno: c_int) -> c_int {
    rdmasafe_core::sys::set_errno(errno);
    -1
}

/// At load (a `.init_array` entry, as a C library's
/// `__attribute__((constructor))`): a fork child handler that forgets a
/// set-up of rdmasafe's CM copy storage another thread had under way, and
/// takes back and mends that storage's locks and free lists
/// (`rdmasafe_core::cm::after_fork_in_child`). rdmasafe registers one at
/// that storage's first use too, but glibc runs only the handlers
/// registered when a fork began, and a thread may begin the set-up while a
/// fork is under way. Registered here, it is in every fork's list. Takes
/// no arguments (those glibc passes are ignored), catches every panic;
/// without memory to register it, the first-use one is all there is.
/// Also makes the panic message of an internal panic be written with
/// cancellation disabled, so that the panic boundary ([`guard`]) of a call
/// with no cancellation point of its own returns its error also when a
/// cancellation is pending
/// (`rdmasafe_core::sys::cancel::panic_hook_without_cancellation`).
extern "C" fn at_load() {
    /// The child handler.
    unsafe extern "C" fn child() {
        // SAFETY: a fork child handler.
        let _ = std::panic::catch_unwind(|| unsafe { rdmasafe_core::cm::after_fork_in_child() });
    }
    let _ = std::panic::catch_unwind(|| rdmasafe_core::sys::at_fork_child(child));
    let _ = std::panic::catch_unwind(rdmasafe_core::sys::cancel::panic_hook_without_cancellation);
}

#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

#[cfg(test)]
mod tests {
    use super::*;

    /// An internal panic on a thread with a cancellation pending, in a call
    /// with no cancellation point of its own: the boundary returns its
    /// error (the panic message is written with cancellation disabled), and
    /// the cancellation stays pending. Before, the message's write to
    /// stderr acted on the cancellation in the middle of the panic and the
    /// process aborted. In a child process (see the helper).
    #[test]
    fn a_panic_with_a_cancellation_pending_returns_the_boundarys_error() {
        // Any first-use set-up of the boundary (the log backend) done before
        // the cancellation is asked for.
        assert_eq!(guard(|| -1, || 0), 0);
        rdmasafe_core::sys::cancel::check_panic_boundary_under_cancellation(
            "tests::a_panic_with_a_cancellation_pending_returns_the_boundarys_error",
            || guard(|| -libc::EIO, || -> c_int { panic!("a deliberate panic of a test") }),
        );
    }
}
