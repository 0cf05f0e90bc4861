//! Logging for C: a level and an optional callback.

use std::ffi::CString;
use std::os::raw::{c_char, c_int, c_void};

use rdmasafe_core::log::{self, Level};

use crate::guard;

/// Receives each log message: `level` 1 (error) ... 5 (trace), `msg` a
/// NUL-terminated string valid during the call. Called from whichever
/// thread logs (the loop's thread for trace messages about CQ wakeups), so
/// it must be thread-safe.
pub type rdmasafe_log_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, level: c_int, msg: *const c_char)>;

struct CSink {
    f: unsafe extern "C" fn(*mut c_void, c_int, *const c_char),
    ctx: *mut c_void,
}
// SAFETY: the app promises (header) that its callback and context may be
// used from any thread.
unsafe impl Send for CSink {}
// SAFETY: as above.
unsafe impl Sync for CSink {}

/// Sets the log level: 0 off, 1 error, 2 warn, 3 info, 4 debug, 5 trace
/// (every CM event copied and every CQ loop wakeup). Overrides the
/// RDMASAFE_LOG environment variable (error|warn|info|debug|trace), which is
/// read at the first log call otherwise. When off, a log site costs one
/// load and a branch. Thread-safe. Returns 0, or -EINVAL for another value.
#[no_mangle]
pub extern "C" fn rdmasafe_set_log_level(level: c_int) -> c_int {
    guard(-libc::EIO, || match log::level_from_i32(level) {
        Some(l) => {
            log::set_level(l);
            0
        }
        None => -libc::EINVAL,
    })
}

/// Sends log messages to `cb(ctx, level, msg)` instead of stderr; NULL `cb`
/// goes back to stderr. Thread-safe; returns 0.
#[no_mangle]
pub extern "C" fn rdmasafe_set_log_callback(cb: rdmasafe_log_cb, ctx: *mut c_void) -> c_int {
    guard(-libc::EIO, || {
        let sink: Option<log::Sink> = cb.map(|f| {
            let s = CSink { f, ctx };
            Box::new(move |l: Level, m: &str| {
                let s = &s; // capture the whole (Send + Sync) struct
                            // Interior NULs cannot cross: replace them.
                let c = CString::new(m.replace('\0', " ")).unwrap_or_default();
                // SAFETY: the app's callback, with a valid C string for the call.
                unsafe { (s.f)(s.ctx, l as c_int, c.as_ptr()) }
            }) as log::Sink
        });
        log::set_sink(sink);
        0
    })
}
