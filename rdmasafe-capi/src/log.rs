//! Logging for C: the library logs through the `log` facade, and this
//! module is the backend a C program gets: a level (RDMASAFE_LOG or
//! `rdmasafe_set_log_level`) and stderr or the app's callback.
//!
//! The backend installs itself at the first call of any export (`guard`).
//! If the process already has a `log` backend (a Rust program that links
//! this crate), that one is kept and receives rdmasafe's messages instead.
//! The callback is called with no lock held, so it may itself call any
//! rdmasafe function, including `rdmasafe_set_log_callback`.

use std::ffi::CString;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Once, RwLock};

use log::{LevelFilter, Log, Metadata, Record};

use crate::guard;

/// Receives each log message: `level` 1 (error) ... 5 (trace), `msg` a
/// NUL-terminated string valid during the call. Called from whichever
/// thread logs (the loop's thread for trace messages about CQ wakeups), so
/// it must be thread-safe. It may call rdmasafe functions (no lock is held;
/// `rdmasafe_cq_loop_destroy` of the loop the logging call is using returns
/// -EDEADLK, and a callback must not wait for a thread that destroys that
/// loop). It may block: a line written by a CM get comes after librdmacm's
/// original event is acked or held, so a callback that waits for a thread
/// in `rdma_destroy_id` of that event's id is released by the ack deadline
/// at the latest; the ack deadline's own line ("held past its ack
/// deadline") is written by a thread of rdmasafe's ("rdmasafe-cm-log")
/// after the ack, so a callback blocked in it holds up no deadline (at most
/// 256 such lines wait for it; more are dropped). A callback that blocks on
/// a loop's thread stalls that loop. It runs with thread cancellation
/// disabled (pthread_setcancelstate): a cancellation that comes while it
/// runs, or that was pending, is acted on at the thread's next
/// cancellation point after the logging call, and a wait in it is not a
/// way out of a cancelled thread.
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

/// Where messages go; `None`: stderr.
static SINK: RwLock<Option<Arc<CSink>>> = RwLock::new(None);
/// True once this module's backend is the process's `log` backend.
static OURS: AtomicBool = AtomicBool::new(false);

struct CLogger;

impl Log for CLogger {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        // Clone the sink out of the lock: the callback runs unlocked.
        let sink = SINK.read().unwrap_or_else(|e| e.into_inner()).clone();
        // stderr's write() and whatever the app's callback does may be
        // cancellation points: a cancellation acted on here would unwind
        // through rdmasafe's frames, which end the process. It waits for
        // the thread's next cancellation point instead.
        let _no_cancel = rdmasafe_core::sys::cancel::CancelDisabled::new();
        match sink {
            Some(s) => {
                // Interior NULs cannot cross: replace them.
                let c = CString::new(r.args().to_string().replace('\0', " ")).unwrap_or_default();
                // SAFETY: the app's callback, with a valid C string for the call.
                unsafe { (s.f)(s.ctx, r.level() as c_int, c.as_ptr()) }
            }
            None => {
                // One write; a closed or broken stderr loses the line
                // instead of panicking (eprintln! would).
                use std::io::Write;
                let _ = std::io::stderr().write_all(format!("rdmasafe[{}]: {}\n", r.level(), r.args()).as_bytes());
            }
        }
    }

    fn flush(&self) {}
}

static LOGGER: CLogger = CLogger;

fn parse(s: &str) -> LevelFilter {
    match s.trim().to_ascii_lowercase().as_str() {
        "error" => LevelFilter::Error,
        "warn" | "warning" => LevelFilter::Warn,
        "info" => LevelFilter::Info,
        "debug" => LevelFilter::Debug,
        "trace" => LevelFilter::Trace,
        _ => LevelFilter::Off,
    }
}

static INSTALLED: Once = Once::new();

/// Installs the backend once (called by every export through `guard`, and
/// by the get calls). Never panics: an attempt that panicked is made again
/// by the next call instead of poisoning every later one.
#[inline]
pub(crate) fn ensure_installed() {
    if !INSTALLED.is_completed() {
        install();
    }
}

#[cold]
#[inline(never)]
fn install() {
    let _ = std::panic::catch_unwind(|| {
        INSTALLED.call_once_force(|_| {
            if log::set_logger(&LOGGER).is_ok() {
                OURS.store(true, Relaxed);
                let level = std::env::var("RDMASAFE_LOG").map(|s| parse(&s)).unwrap_or(LevelFilter::Off);
                log::set_max_level(level);
            }
        })
    });
}

fn filter_of(level: c_int) -> Option<LevelFilter> {
    [LevelFilter::Off, LevelFilter::Error, LevelFilter::Warn, LevelFilter::Info, LevelFilter::Debug, LevelFilter::Trace]
        .get(usize::try_from(level).ok()?)
        .copied()
}

/// Sets the log level: 0 off, 1 error, 2 warn, 3 info, 4 debug, 5 trace
/// (every CM event copied and every CQ loop wakeup). Overrides the
/// RDMASAFE_LOG environment variable (error|warn|info|debug|trace), which is
/// read at the first call into the library otherwise. When off, a log site
/// costs one load and a branch. Thread-safe. Returns 0, or -EINVAL for
/// another value.
#[no_mangle]
pub extern "C" fn rdmasafe_set_log_level(level: c_int) -> c_int {
    guard(
        || -libc::EIO,
        || match filter_of(level) {
            Some(l) => {
                if OURS.load(Relaxed) {
                    log::set_max_level(l);
                }
                0
            }
            None => -libc::EINVAL,
        },
    )
}

/// Sends log messages to `cb(ctx, level, msg)` instead of stderr; NULL `cb`
/// goes back to stderr. Thread-safe; may be called from inside the
/// callback. Returns 0.
#[no_mangle]
pub extern "C" fn rdmasafe_set_log_callback(cb: rdmasafe_log_cb, ctx: *mut c_void) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let sink = cb.map(|f| Arc::new(CSink { f, ctx }));
            *SINK.write().unwrap_or_else(|e| e.into_inner()) = sink;
            0
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    static GOT: Mutex<Vec<(c_int, String)>> = Mutex::new(Vec::new());

    thread_local! {
        /// This thread is the test's: the sink is process-wide, and other
        /// tests of this binary log (bad frees, say) while it is installed.
        static MINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    unsafe extern "C" fn collect(_ctx: *mut c_void, level: c_int, msg: *const c_char) {
        if !MINE.get() {
            return;
        }
        // SAFETY: the library passes a valid C string for the call.
        let m = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned();
        GOT.lock().unwrap().push((level, m.clone()));
        if m.contains("reset") {
            // Re-entering the library from the callback must not deadlock.
            assert_eq!(rdmasafe_set_log_callback(None, std::ptr::null_mut()), 0);
        }
    }

    #[test]
    fn levels_parse_and_the_callback_may_reenter() {
        assert_eq!(parse("TRACE"), LevelFilter::Trace);
        assert_eq!(parse("warn"), LevelFilter::Warn);
        assert_eq!(parse("nonsense"), LevelFilter::Off);
        assert_eq!(rdmasafe_set_log_level(6), -libc::EINVAL);
        assert_eq!(rdmasafe_set_log_level(-1), -libc::EINVAL);
        assert_eq!(rdmasafe_set_log_level(2), 0);
        MINE.set(true);
        assert_eq!(rdmasafe_set_log_callback(Some(collect), std::ptr::null_mut()), 0);
        log::error!(target: "rdmasafe", "bad {}", 1);
        log::trace!(target: "rdmasafe", "not shown at warn");
        log::warn!(target: "rdmasafe", "reset from inside");
        log::warn!(target: "rdmasafe", "to stderr now");
        assert_eq!(rdmasafe_set_log_level(0), 0);
        let got = GOT.lock().unwrap().clone();
        assert_eq!(got, [(1, "bad 1".to_string()), (2, "reset from inside".to_string())]);
    }
}
