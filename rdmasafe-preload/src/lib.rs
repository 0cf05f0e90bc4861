//! `librdmasafe-preload.so`: rdmasafe for programs that cannot be rebuilt.
//!
//! ```sh
//! LD_PRELOAD=/opt/rdmasafe/lib/librdmasafe-preload.so rping -s -a 10.77.0.1
//! ```
//!
//! With the library preloaded, an unmodified program's `rdma_get_cm_event`
//! and `rdma_ack_cm_event` are rdmasafe's copy and free (module `copy`):
//! what `rdmasafe_get_event` / `rdmasafe_event_free` do for a program that
//! renamed the two calls, with the destroy barrier kept and bounded by the
//! ack deadline (RDMASAFE_ACK_DEADLINE_MS, default 1000 ms). librdmacm's
//! own synchronous paths (`rdma_create_ep` ids without a channel:
//! `rdma_get_request`, `ucma_complete` behind `rdma_connect` /
//! `rdma_accept` / ..., `rdma_destroy_id`, `rdma_migrate_id`) call both
//! functions through the PLT too, so they get copies as well.
//!
//! With `RDMASAFE_CHECK=1` (or `fix`) the same library copies nothing and
//! reports event-handling bugs instead (module `check`).
//!
//! How it is wired:
//! * the interposers below are exported unversioned (no version node), so
//!   the loader binds the program's versioned references
//!   (`rdma_get_cm_event@RDMACM_1.0`, `ibv_ack_cq_events@IBVERBS_1.1`, ...)
//!   to them: a definition without a version satisfies any version;
//! * the real functions are found with `dlvsym(RTLD_NEXT, ...)` (module
//!   `real`), and rdmasafe-core's CM code is pointed at them
//!   (`rdmasafe_core::sys::set_cm_event_calls`) before its first use:
//!   inside this library the plain symbols are the interposers, so any call
//!   through them would recurse;
//! * state is set up at the first interposed call (a `ForkOnce`); a line
//!   with what went through is logged at exit (info level, RDMASAFE_LOG);
//! * the fork handlers are registered when the library is loaded (see
//!   `at_load`); a child forked while another thread set the state up
//!   sets it up again (`rdmasafe_core::sys::fork_once`).
//!
//! No panic unwinds into C: each interposer catches panics (`-1` with
//! EIO, or the call passed through). The interposers of calls that wait at
//! a cancellation point (`rdma_get_cm_event`, `rdma_destroy_id`,
//! `rdma_get_request`, `ibv_get_cq_event`, `ibv_destroy_cq`) are `extern "C-unwind"`: a thread
//! cancelled inside one unwinds through it into the program, as through
//! the real function (`rdmasafe_core::sys::cancel`). The drop-in CM calls keep librdmacm's
//! -1/errno convention and leave errno untouched on success; in check mode
//! every call's return value and errno are librdmacm's / libibverbs' own.

#![deny(unsafe_op_in_unsafe_fn)]

mod check;
mod copy;
mod out;
mod real;

use std::os::raw::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

use rdmasafe_core::sys::{self, ibv_comp_channel, ibv_cq, rdma_cm_event, rdma_cm_id, rdma_event_channel, CmEventCalls};

use check::Checker;
use rdmasafe_core::sys::fork_once::ForkOnce;
use real::Real;

enum Mode {
    /// rdmasafe's copies (the default).
    Copy,
    /// Watch, report, copy nothing.
    Check(Box<Checker>),
    /// Every call straight to the real function: copy mode could not be set
    /// up (said on stderr, see `out::setup_error`).
    Pass,
}

struct State {
    real: Real,
    mode: Mode,
}

static STATE: ForkOnce<State> = ForkOnce::new();

fn init() -> State {
    // Its output (and /proc/self/comm, read for it) may hit cancellation
    // points; it runs inside a panic boundary, which a cancellation must
    // not reach.
    let _no_cancel = rdmasafe_core::sys::cancel::CancelDisabled::new();
    out::install_logger();
    let real = Real::resolve();
    let check = std::env::var("RDMASAFE_CHECK").unwrap_or_default();
    let mut mode = match check_setting(&check) {
        Some(None) => Mode::Copy,
        Some(Some(fix)) => Mode::Check(Box::new(Checker::new(fix))),
        None => {
            out::setup_error(&format!(
                "RDMASAFE_CHECK={check:?} is none of 1, fix, 0 (or on/off, yes/no, true/false, empty): copy mode"
            ));
            Mode::Copy
        }
    };
    if let Mode::Copy = mode {
        let ok = match (real.get_cm_event, real.ack_cm_event) {
            // SAFETY: librdmacm's own two functions, from one library
            // (dlvsym of RTLD_NEXT), callable from any thread.
            (Some(get), Some(ack)) => unsafe { sys::set_cm_event_calls(CmEventCalls { get, ack }) }.is_ok(),
            _ => false,
        };
        if !ok {
            out::setup_error(
                "cannot reach librdmacm's rdma_get_cm_event / rdma_ack_cm_event: CM events pass through uncopied",
            );
            mode = Mode::Pass;
        } else if let Err(v) = rdmasafe_core::cm::ack_deadline_env() {
            out::setup_error(&format!(
                "RDMASAFE_ACK_DEADLINE_MS={v:?} is no number of milliseconds: {}",
                rdmasafe_core::cm::DEFAULT_ACK_DEADLINE.as_millis()
            ));
            // Said: the library, which would read the variable at the first
            // get and warn again, takes the default from here.
            rdmasafe_core::cm::set_ack_deadline(rdmasafe_core::cm::DEFAULT_ACK_DEADLINE);
        }
        if matches!(mode, Mode::Copy) && rdmasafe_core::cm::capacity() == 0 {
            out::setup_error(
                "no address space for CM event copies (ulimit -v too small?): CM events pass through uncopied",
            );
            mode = Mode::Pass;
        }
    }
    let r = FORK_HANDLERS.load(Relaxed);
    if r != 0 {
        out::setup_error(&format!(
            "cannot register the fork handlers (error {r}): a child forked while another thread sets the preload up \
             (or, in check mode, keeps the books) may hang in its first get or ack"
        ));
    }
    let what = match &mode {
        Mode::Copy => format!("copy (ack deadline {} ms)", rdmasafe_core::cm::ack_deadline().as_millis()),
        Mode::Check(c) => c.describe(),
        Mode::Pass => "pass-through".to_string(),
    };
    log::debug!(target: "rdmasafe", "preload [{}]: mode {what}", out::who());
    State { real, mode }
}

/// `RDMASAFE_CHECK`'s value: `Some(None)` copy mode (empty, 0, off, no,
/// false), `Some(Some(fix))` check mode (1, on, yes, true; fix), `None`
/// for anything else (case and surrounding blanks do not matter).
fn check_setting(value: &str) -> Option<Option<bool>> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "off" | "no" | "false" => Some(None),
        "1" | "on" | "yes" | "true" => Some(Some(false)),
        "fix" => Some(Some(true)),
        _ => None,
    }
}

fn state() -> &'static State {
    STATE.get_or_init(init)
}

/// What `pthread_atfork` answered at load (0: the handlers are in).
static FORK_HANDLERS: AtomicI32 = AtomicI32::new(0);

/// At load (a `.init_array` entry, as a C library's
/// `__attribute__((constructor))`): registers the fork handlers. So early,
/// they are registered before those the program registers (only libraries
/// whose constructors ran first come before): their prepare handler runs
/// after the program's (and their child handler before), so a program's
/// own prepare or child handler may make an interposed call. (Registered at
/// the first interposed call, as before, check mode's books were taken
/// when a prepare handler the program had registered earlier made one, and
/// the fork hung.) The handlers take no lock but check mode's books: a
/// set-up under way is made again in the child instead of waited for (see
/// `rdmasafe_core::sys::fork_once`). Takes no arguments (those glibc
/// passes are ignored) and catches every panic. Also makes the message of
/// an internal panic be written with cancellation disabled, so that the
/// [`boundary`] of a call with no cancellation point of its own returns
/// its error also when a cancellation is pending
/// (`rdmasafe_core::sys::cancel::panic_hook_without_cancellation`).
extern "C" fn at_load() {
    let _ = catch_unwind(|| {
        // SAFETY: three functions that take no arguments and catch every
        // panic.
        let r = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
        FORK_HANDLERS.store(r, Relaxed);
    });
    let _ = catch_unwind(rdmasafe_core::sys::cancel::panic_hook_without_cancellation);
}

#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

/// The outer panic boundary of an interposer: `on_panic()` instead of an
/// unwind into C. (The real functions are C and never unwind.)
fn boundary<T>(on_panic: impl FnOnce() -> T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            log::error!(target: "rdmasafe", "preload: internal panic caught at the C boundary");
            on_panic()
        }
    }
}

fn fail(errno: c_int) -> c_int {
    sys::set_errno(errno);
    -1
}

/// librdmacm's convention for the copy-mode calls: `Ok(v)` returns `v`
/// with errno as it was on entry; `Err(e)` is -1 with errno `e`.
fn errno_convention(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    let saved = sys::errno_raw();
    match f() {
        Ok(v) => {
            sys::set_errno(saved);
            v
        }
        Err(e) => fail(e),
    }
}

/// Interposes librdmacm's `rdma_get_cm_event`: in copy mode the event is
/// rdmasafe's copy (see `rdmasafe_get_event`); in check mode librdmacm's
/// own, watched.
///
/// A cancellation point, as librdmacm's: a thread cancelled while it waits
/// unwinds from the wait through this function into the program. So it is
/// "C-unwind", and it holds plain values only and catches nothing across
/// the wait (`rdmasafe_core::sys::cancel`); the panic boundary is around
/// the work before and after it.
///
/// # Safety
/// As `rdma_get_cm_event`.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    let Some(st) = boundary(|| None, || Some(state())) else {
        return fail(libc::EIO);
    };
    match (&st.mode, st.real.get_cm_event) {
        // SAFETY: the program's arguments, as rdma_get_cm_event takes them;
        // every frame on the way holds plain values.
        (Mode::Copy, _) => errno_convention(|| unsafe { copy::get(channel, event) }),
        // SAFETY: as above.
        (Mode::Check(c), Some(real)) => unsafe { c.get_cm_event(real, channel, event) },
        // SAFETY: as above.
        (Mode::Pass, Some(real)) => unsafe { real(channel, event) },
        (_, None) => fail(libc::ENOSYS),
    }
}

/// Interposes librdmacm's `rdma_ack_cm_event`: in copy mode it frees the
/// copy (see `rdmasafe_event_free`, but NULL is -1/EINVAL as with
/// librdmacm); in check mode it acks librdmacm's event, watched.
///
/// # Safety
/// As `rdma_ack_cm_event`; any pointer value is checked before use.
#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    boundary(
        || fail(libc::EIO),
        || {
            let st = state();
            match (&st.mode, st.real.ack_cm_event) {
                (Mode::Copy, _) => errno_convention(|| copy::ack(event)),
                // SAFETY: the program's argument, as rdma_ack_cm_event takes it.
                (Mode::Check(c), Some(real)) => unsafe { c.ack_cm_event(real, event) },
                // SAFETY: as above.
                (Mode::Pass, Some(real)) => unsafe { real(event) },
                (_, None) => fail(libc::ENOSYS),
            }
        },
    )
}

/// Interposes librdmacm's `rdma_destroy_id`: passed through; check mode
/// notes the destroy in progress (to name one that waits for an event).
///
/// # Safety
/// As `rdma_destroy_id`.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    // A cancellation point (librdmacm waits on a condition variable for
    // the id's events): "C-unwind", plain values across the call, as
    // rdma_get_cm_event above.
    let Some(st) = boundary(|| None, || Some(state())) else {
        return fail(libc::EIO);
    };
    match (&st.mode, st.real.destroy_id) {
        // SAFETY: the program's argument, as rdma_destroy_id takes it.
        (Mode::Check(c), Some(real)) => unsafe { c.destroy_id(real, id) },
        // SAFETY: as above.
        (_, Some(real)) => unsafe { real(id) },
        (_, None) => fail(libc::ENOSYS),
    }
}

/// Interposes librdmacm's `rdma_get_request`: passed through. In copy
/// mode the get it makes inside (through the interposed
/// `rdma_get_cm_event`) is marked as librdmacm's own
/// (`rdmasafe_core::cm::CopyDestination::Librdmacm`): `rdma_get_request`
/// keeps the connect request as the new id's current event until
/// `rdma_accept` (or the new id's destroy) acks it, so a request held past
/// the ack deadline there (an rsockets or `rdma_create_ep` server that
/// sets up for longer) is acked with an info line, not the warning meant
/// for a program's late free.
///
/// # Safety
/// As `rdma_get_request`.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdma_get_request(listen: *mut rdma_cm_id, id: *mut *mut rdma_cm_id) -> c_int {
    // A cancellation point (its get waits): "C-unwind", plain values across
    // the call, as rdma_get_cm_event above. The mark is saved and restored
    // (a nested call from a signal handler keeps the outer one's); a thread
    // cancelled inside, or a siglongjmp out of the wait, leaves it set: that
    // thread's later late frees would then be told at info level, not warn.
    let Some(st) = boundary(|| None, || Some(state())) else {
        return fail(libc::EIO);
    };
    let Some(real) = st.real.get_request else {
        return fail(libc::ENOSYS);
    };
    let prev = matches!(st.mode, Mode::Copy).then(|| copy::in_get_request(true));
    // SAFETY: the program's arguments, as rdma_get_request takes them.
    let r = unsafe { real(listen, id) };
    if let Some(p) = prev {
        copy::in_get_request(p);
    }
    r
}

/// Interposes libibverbs' `ibv_get_cq_event`: passed through; check mode
/// counts the event for its CQ.
///
/// # Safety
/// As `ibv_get_cq_event`.
#[no_mangle]
pub unsafe extern "C-unwind" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // A cancellation point (libibverbs' read()): "C-unwind", plain values
    // across the call, as rdma_get_cm_event above.
    let Some(st) = boundary(|| None, || Some(state())) else {
        return fail(libc::EIO);
    };
    match (&st.mode, st.real.get_cq_event) {
        // SAFETY: the program's arguments, as ibv_get_cq_event takes them.
        (Mode::Check(c), Some(real)) => unsafe { c.get_cq_event(real, channel, cq, cq_context) },
        // SAFETY: as above.
        (_, Some(real)) => unsafe { real(channel, cq, cq_context) },
        (_, None) => fail(libc::ENOSYS),
    }
}

/// Interposes libibverbs' `ibv_ack_cq_events`: passed through; check mode
/// checks the acks against the CQ's events (and with `fix` passes on no
/// more than it got).
///
/// # Safety
/// As `ibv_ack_cq_events`.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    boundary(
        || (),
        || {
            let st = state();
            match (&st.mode, st.real.ack_cq_events) {
                // SAFETY: the program's arguments, as ibv_ack_cq_events takes them.
                (Mode::Check(c), Some(real)) => unsafe { c.ack_cq_events(real, cq, nevents) },
                // SAFETY: as above.
                (_, Some(real)) => unsafe { real(cq, nevents) },
                (_, None) => log::error!(target: "rdmasafe", "preload: no ibv_ack_cq_events to pass the ack to"),
            }
        },
    )
}

/// Interposes libibverbs' `ibv_destroy_cq`: passed through; check mode
/// reports unacked events first (and with `fix` acks them).
///
/// # Safety
/// As `ibv_destroy_cq`.
#[no_mangle]
pub unsafe extern "C-unwind" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    // A cancellation point (libibverbs waits on a condition variable for
    // the CQ's events to be acked): "C-unwind", plain values across the
    // call, as rdma_get_cm_event above.
    let Some(st) = boundary(|| None, || Some(state())) else {
        return libc::EIO;
    };
    match (&st.mode, st.real.destroy_cq) {
        // SAFETY: the program's argument, as ibv_destroy_cq takes it.
        (Mode::Check(c), Some(real)) => unsafe { c.destroy_cq(real, st.real.ack_cq_events, cq) },
        // SAFETY: as above.
        (_, Some(real)) => unsafe { real(cq) },
        // ibv_destroy_cq returns an errno value, not -1.
        (_, None) => libc::ENOSYS,
    }
}

/// At exit (and only if an interposer ran): the info-level line of what
/// went through, and check mode's exit reports. With thread cancellation
/// disabled: a thread with a cancellation pending may call `exit`, and
/// the line's and the reports' system calls (reading `/proc/self/comm`,
/// waiting for a book) are cancellation points, where glibc's forced
/// unwind would meet this catch_unwind and abort the process.
extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        let _no_cancel = rdmasafe_core::sys::cancel::CancelDisabled::new();
        let Some(st) = STATE.get() else { return };
        match &st.mode {
            Mode::Copy => log::info!(target: "rdmasafe", "{}", copy::exit_line()),
            Mode::Check(c) => c.at_exit(),
            Mode::Pass => log::info!(target: "rdmasafe", "preload exit [{}]: mode=pass", out::who()),
        }
    });
}

thread_local! {
    /// The state was set up when this thread's fork began (its prepare
    /// handler ran). No destructor: usable in any fork.
    static SET_AT_FORK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `fork`'s prepare handler: in check mode, see `Checker::before_fork`.
extern "C" fn before_fork() {
    let _ = catch_unwind(|| {
        let st = STATE.get();
        SET_AT_FORK.with(|s| s.set(st.is_some()));
        if let Some(State { mode: Mode::Check(c), .. }) = st {
            c.before_fork();
        }
    });
}

/// `fork`'s parent handler: in check mode, see `Checker::after_fork`.
extern "C" fn after_fork_parent() {
    let _ = catch_unwind(|| {
        if let Some(State { mode: Mode::Check(c), .. }) = STATE.get() {
            c.after_fork();
        }
    });
}

/// `fork`'s child handler: in check mode, see `Checker::after_fork`; a
/// set-up (of the state, or of check mode's report file) that another
/// thread of the parent had under way is forgotten, to be made again here
/// (`rdmasafe_core::sys::fork_once`). So is a state set up after the
/// prepare handler ran (by another thread, which may then have entered
/// check mode's books, which that handler did not take: the child would
/// inherit them locked).
extern "C" fn after_fork_child() {
    let _ = catch_unwind(|| {
        // rdmasafe's own (its CM copies' storage): this handler is in
        // every fork's list, registered at load.
        // SAFETY: a fork child handler.
        unsafe { rdmasafe_core::cm::after_fork_in_child() };
        if let Some(State { mode: Mode::Check(c), .. }) = STATE.get() {
            c.after_fork();
        }
        // SAFETY: as above.
        unsafe {
            STATE.after_fork_in_child(!SET_AT_FORK.with(|s| s.get()));
            out::after_fork_in_child();
        }
    });
}

/// Runs `at_exit` when the process exits (after the program's own atexit
/// handlers, before librdmacm's and libibverbs' destructors: they are this
/// library's dependencies). A `.fini_array` entry, as a C library's
/// `__attribute__((destructor))`: the function takes no arguments and
/// catches every panic.
#[used]
#[link_section = ".fini_array"]
static AT_EXIT: extern "C" fn() = at_exit;

#[cfg(test)]
mod tests {
    use super::{boundary, check_setting};

    /// An internal panic on a thread with a cancellation pending: the
    /// interposer's boundary returns its error instead of the process
    /// aborting (the panic message is written with cancellation disabled).
    /// In a child process (see the helper).
    #[test]
    fn a_panic_with_a_cancellation_pending_returns_the_boundarys_error() {
        rdmasafe_core::sys::cancel::check_panic_boundary_under_cancellation(
            "tests::a_panic_with_a_cancellation_pending_returns_the_boundarys_error",
            || boundary(|| -libc::EIO, || -> i32 { panic!("a deliberate panic of a test") }),
        );
    }

    #[test]
    fn rdmasafe_check_values() {
        for v in ["", " ", "0", "off", "OFF", "no", "false", " False "] {
            assert_eq!(check_setting(v), Some(None), "{v:?}: copy mode");
        }
        for v in ["1", "on", "yes", "true", "TRUE", " 1\n"] {
            assert_eq!(check_setting(v), Some(Some(false)), "{v:?}: check mode");
        }
        assert_eq!(check_setting("fix"), Some(Some(true)));
        assert_eq!(check_setting(" FIX "), Some(Some(true)));
        for v in ["2", "maybe", "fixx", "o n"] {
            assert_eq!(check_setting(v), None, "{v:?}: refused");
        }
    }
}
