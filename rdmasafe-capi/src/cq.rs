//! CQ notification loop and async events for C.
//!
//! A loop is driven by one thread at a time (`rdmasafe_cq_loop_run` or
//! `rdmasafe_cq_loop_run_once`); `rdmasafe_cq_loop_stop`,
//! `rdmasafe_cq_loop_stats` and `rdmasafe_cq_loop_set_outstanding` may be
//! called from any thread, including from inside a callback. CQs are added
//! and removed while the loop is not running (stop it first).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rdmasafe_core::cq::{
    self, AsyncElement, AsyncEventType, AsyncEvents, CqLoop, Keepalive, LoopControl, LoopOptions, Mode,
};
use rdmasafe_core::sys::{ibv_comp_channel, ibv_context, ibv_cq, ibv_qp, ibv_wc, Wait};
use rdmasafe_core::verbs::DeviceContext;

use crate::{guard, PtrHash};

/// Event mode: arm, sleep until notified, re-arm, drain.
pub const RDMASAFE_MODE_EVENT: c_int = 0;
/// Busy-poll mode: poll continuously, never arm or sleep.
pub const RDMASAFE_MODE_BUSY_POLL: c_int = 1;
/// Adaptive mode: poll while busy and for `adaptive_spin_us` after the
/// last completion, then arm and sleep.
pub const RDMASAFE_MODE_ADAPTIVE: c_int = 2;

/// Called with each batch of work completions of one CQ (error completions
/// included): `wc[0..n]` is valid only during the call. Runs on the thread
/// that runs the loop. It may call `rdmasafe_cq_loop_stop` (the loop stops
/// after this batch) and post work requests; it must not add or remove CQs,
/// run or destroy the loop.
pub type rdmasafe_wc_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, wc: *const ibv_wc, n: c_int)>;

/// Options of `rdmasafe_cq_loop_create`. Zero-initialise, set `size`, and
/// set what you need: 0 in a field means its default.
/// `struct rdmasafe_cq_loop_options o = { .size = sizeof o };`
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct rdmasafe_cq_loop_options {
    /// `sizeof(struct rdmasafe_cq_loop_options)` as the caller's header
    /// declares it (see "Struct sizes" at the top of this header).
    pub size: u32,
    /// RDMASAFE_MODE_EVENT (default), RDMASAFE_MODE_BUSY_POLL or RDMASAFE_MODE_ADAPTIVE.
    pub mode: c_int,
    /// Non-zero: arm for solicited completions only.
    pub solicited_only: c_int,
    /// Completions per poll and per callback, 1..4096 (default 16).
    pub poll_batch: c_int,
    /// CQ events counted per CQ before one ack call, 1..65536 (default 16).
    pub ack_batch: c_int,
    /// Adaptive mode: microseconds of polling after the last completion
    /// (default 50).
    pub adaptive_spin_us: c_int,
    /// Watchdog: poll anyway after this many ms without an event while
    /// outstanding work is reported (0: off).
    pub watchdog_ms: c_int,
}

/// Figures of a loop (see `rdmasafe_cq_loop_get_stats`). Set `size` to
/// `sizeof` the struct before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct rdmasafe_cq_loop_stats {
    /// In: `sizeof(struct rdmasafe_cq_loop_stats)` as the caller's header
    /// declares it. Out: the number of bytes the library filled.
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    /// Wakeups with something to do.
    pub wakeups: u64,
    /// Wakeups that delivered no completion.
    pub empty_wakeups: u64,
    /// CQ events read from the channel.
    pub cq_events: u64,
    /// Completions delivered (errors included).
    pub completions: u64,
    /// Completions with a status other than IBV_WC_SUCCESS.
    pub error_completions: u64,
    /// ibv_ack_cq_events calls.
    pub ack_calls: u64,
    /// CQ events acked by them.
    pub acked_events: u64,
    /// CQ events read and not acked yet (0 after stop).
    pub unacked_now: u64,
    /// Longest callback, nanoseconds.
    pub longest_handler_ns: u64,
    /// Watchdog polls.
    pub watchdog_polls: u64,
    /// ibv_req_notify_cq calls.
    pub arm_calls: u64,
    /// Keepalive probes posted.
    pub keepalive_probes: u64,
    /// Keepalive probes completed successfully.
    pub keepalive_probes_ok: u64,
    /// Peers declared dead by a keepalive.
    pub keepalive_dead: u64,
    /// Completions per wakeup: bucket 0 counts 0, bucket i counts
    /// [2^(i-1), 2^i), bucket 15 everything from 2^14.
    pub completions_per_wakeup: [u64; 16],
    /// Cycle time in microseconds, same buckets.
    pub cycle_time_us: [u64; 16],
}

/// A CQ loop (opaque).
pub struct rdmasafe_cq_loop {
    /// The loop; `None` once destroyed.
    inner: Mutex<Option<CqLoop>>,
    ctl: LoopControl,
    /// IDLE, RUNNING (run / run_once / drain: may block), SHORT (add,
    /// remove, keepalive, destroy: brief), or DEAD.
    state: AtomicU8,
    /// Id of the thread running the loop now, 0 if none.
    runner: AtomicU64,
    /// The channel's fd (fixed for the loop's life; readable without the lock).
    fd: c_int,
}

const IDLE: u8 = 0;
const RUNNING: u8 = 1;
const SHORT: u8 = 2;
const DEAD: u8 = 3;

fn thread_tag() -> u64 {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as u64 }
}

/// Live loops: every call looks its handle up here first, so a pointer
/// rdmasafe did not hand out, or one already destroyed, is an EINVAL.
fn loops() -> &'static Mutex<HashMap<usize, Arc<rdmasafe_cq_loop>, PtrHash>> {
    static L: OnceLock<Mutex<HashMap<usize, Arc<rdmasafe_cq_loop>, PtrHash>>> = OnceLock::new();
    L.get_or_init(Default::default)
}

fn lookup(l: *mut rdmasafe_cq_loop) -> Result<Arc<rdmasafe_cq_loop>, c_int> {
    loops().lock().unwrap_or_else(|e| e.into_inner()).get(&(l as usize)).cloned().ok_or(-libc::EINVAL)
}

/// Exclusive use of an idle loop; gives the state back when dropped.
struct Entered<'a> {
    h: &'a rdmasafe_cq_loop,
    guard: std::sync::MutexGuard<'a, Option<CqLoop>>,
    release_to: u8,
}

impl Entered<'_> {
    fn lp(&mut self) -> &mut CqLoop {
        self.guard.as_mut().expect("entered loops are not destroyed")
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.h.state.store(self.release_to, SeqCst);
    }
}

/// Takes the loop for an operation of `kind` (RUNNING or SHORT):
/// -EDEADLK from inside one of its callbacks, -EBUSY while another thread
/// runs it, -EINVAL once destroyed. A brief operation of another thread is
/// waited for, never reported as busy.
fn enter(h: &rdmasafe_cq_loop, kind: u8) -> Result<Entered<'_>, c_int> {
    if h.runner.load(SeqCst) == thread_tag() {
        return Err(-libc::EDEADLK);
    }
    loop {
        match h.state.compare_exchange(IDLE, kind, SeqCst, SeqCst) {
            Ok(_) => break,
            Err(RUNNING) => return Err(-libc::EBUSY),
            Err(DEAD) => return Err(-libc::EINVAL),
            Err(_) => std::thread::yield_now(),
        }
    }
    let guard = h.inner.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        h.state.store(DEAD, SeqCst);
        return Err(-libc::EINVAL);
    }
    Ok(Entered { h, guard, release_to: IDLE })
}

fn options(o: Option<&rdmasafe_cq_loop_options>) -> Result<LoopOptions, c_int> {
    let o = o.copied().unwrap_or_default();
    let or = |v: c_int, d: c_int| if v == 0 { d } else { v };
    let (batch, ack, spin, wd) = (or(o.poll_batch, 16), or(o.ack_batch, 16), or(o.adaptive_spin_us, 50), o.watchdog_ms);
    if batch < 1 || ack < 1 || spin < 0 || wd < 0 {
        return Err(-libc::EINVAL);
    }
    let mode = match o.mode {
        RDMASAFE_MODE_EVENT => Mode::Event,
        RDMASAFE_MODE_BUSY_POLL => Mode::BusyPoll,
        RDMASAFE_MODE_ADAPTIVE => Mode::Adaptive { spin: Duration::from_micros(spin as u64) },
        _ => return Err(-libc::EINVAL),
    };
    Ok(LoopOptions {
        mode,
        solicited_only: o.solicited_only != 0,
        poll_batch: batch as usize,
        ack_batch: ack as u32,
        watchdog: (wd > 0).then(|| Duration::from_millis(wd as u64)),
    })
}

fn neg(e: rdmasafe_core::Error) -> c_int {
    -e.errno()
}

/// Creates a loop on `channel` (a completion channel the app created with
/// `ibv_create_comp_channel`, which must outlive the loop). The loop puts
/// the channel's fd in non-blocking mode and is from now on its only
/// reader. `opts` may be NULL for the defaults (event mode).
///
/// Returns 0 and stores the loop in `*out`, or -EINVAL (NULL `channel` or
/// `out`, an option out of range), -ENOMEM, or another negative errno.
///
/// # Safety
/// `channel` NULL or live; `opts` NULL or readable; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_create(
    channel: *mut ibv_comp_channel,
    opts: *const rdmasafe_cq_loop_options,
    out: *mut *mut rdmasafe_cq_loop,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let Some(chan) = NonNull::new(channel) else { return -libc::EINVAL };
            if out.is_null() {
                return -libc::EINVAL;
            }
            let opts = if opts.is_null() {
                None
            } else {
                // SAFETY: readable for its stated size (caller).
                match unsafe { crate::abi::read_in(opts) } {
                    Ok(o) => Some(o),
                    Err(e) => return e,
                }
            };
            let opts = match options(opts.as_ref()) {
                Ok(o) => o,
                Err(e) => return e,
            };
            // SAFETY: channel live for the loop's life (caller).
            let l = match unsafe { CqLoop::from_raw(chan, opts) } {
                Ok(l) => l,
                Err(e) => return neg(e),
            };
            let fd = l.as_raw_fd();
            let h = Arc::new(rdmasafe_cq_loop {
                ctl: l.control(),
                inner: Mutex::new(Some(l)),
                state: AtomicU8::new(IDLE),
                runner: AtomicU64::new(0),
                fd,
            });
            let p = Arc::as_ptr(&h) as *mut rdmasafe_cq_loop;
            loops().lock().unwrap_or_else(|e| e.into_inner()).insert(p as usize, h);
            // SAFETY: out checked non-NULL.
            unsafe { *out = p };
            0
        },
    )
}

struct CCallback {
    f: unsafe extern "C" fn(*mut c_void, *const ibv_wc, c_int),
    ctx: *mut c_void,
}
// SAFETY: the callback and its context are the app's; the loop calls them
// only from the thread that runs the loop, as the header documents.
unsafe impl Send for CCallback {}

/// Adds `cq` with its callback. The CQ must have been created on this
/// loop's channel and must not be destroyed before it is removed
/// (`rdmasafe_cq_loop_remove_cq`) or the loop destroyed: `ibv_destroy_cq`
/// waits for acks only the loop can give, and libibverbs cannot be
/// intercepted. Not while the loop runs.
///
/// Returns 0, -EINVAL (NULL argument, unknown loop, CQ not bound to this
/// loop's channel or of another device context), -EBUSY (the CQ is in a
/// loop already, or the loop is running), -EDEADLK (from a callback).
///
/// # Safety
/// `cq` NULL or a live CQ.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_add_cq(
    cq_loop: *mut rdmasafe_cq_loop,
    cq: *mut ibv_cq,
    cb: rdmasafe_wc_cb,
    ctx: *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let (Some(cqp), Some(f)) = (NonNull::new(cq), cb) else { return -libc::EINVAL };
            with_loop(cq_loop, SHORT, |l| {
                let c = CCallback { f, ctx };
                let handler: cq::Handler = Box::new(move |wcs: &[ibv_wc], _ctl: &LoopControl| {
                    let c = &c;
                    // SAFETY: the app's callback, called as documented.
                    unsafe { (c.f)(c.ctx, wcs.as_ptr(), wcs.len() as c_int) }
                });
                // SAFETY: cq live until removed (caller's contract, documented).
                match unsafe { l.add_raw_cq(cqp, handler) } {
                    Ok(()) => 0,
                    Err(e) => neg(e),
                }
            })
        },
    )
}

/// Removes `cq`: acks its pending events and forgets it; events for it read
/// later are acked at once. Afterwards the app may destroy the CQ. Not
/// while the loop runs.
///
/// Returns 0, -EINVAL (NULL, unknown loop), -ENOENT (CQ not in this loop),
/// -EBUSY (running, or a keepalive probes through this CQ: remove the
/// keepalive first), -EDEADLK (from a callback).
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_remove_cq(cq_loop: *mut rdmasafe_cq_loop, cq: *mut ibv_cq) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if cq.is_null() {
                return -libc::EINVAL;
            }
            with_loop(cq_loop, SHORT, |l| match l.remove_cq(cq) {
                Ok(()) => 0,
                Err(e) => neg(e),
            })
        },
    )
}

/// Looks the loop up, takes it for an operation of `kind` (see `enter`)
/// and runs `f` on it. A RUNNING operation marks this thread as the loop's
/// runner, so calls from inside its callbacks get -EDEADLK.
fn with_loop(cq_loop: *mut rdmasafe_cq_loop, kind: u8, f: impl FnOnce(&mut CqLoop) -> c_int) -> c_int {
    let h = match lookup(cq_loop) {
        Ok(h) => h,
        Err(e) => return e,
    };
    let mut e = match enter(&h, kind) {
        Ok(e) => e,
        Err(err) => return err,
    };
    if kind == RUNNING {
        h.runner.store(thread_tag(), SeqCst);
    }
    let r = f(e.lp());
    if kind == RUNNING {
        h.runner.store(0, SeqCst);
    }
    r
}

/// Runs the loop on the calling thread until `rdmasafe_cq_loop_stop`, then
/// acks everything outstanding and returns 0. A stopped loop can be run
/// again. Blocks.
///
/// Returns 0, -EINVAL (unknown loop), -EBUSY (another thread runs it),
/// -EDEADLK (from a callback), or the negative errno of a failed verbs call.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_run(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || {
            with_loop(cq_loop, RUNNING, |l| match l.run() {
                Ok(()) => 0,
                Err(e) => neg(e),
            })
        },
    )
}

/// One cycle: waits at most `timeout_ms` (-1 forever, 0 not at all), then
/// delivers what arrived. For driving the loop from the app's own epoll:
/// watch `rdmasafe_cq_loop_fd` and call this with 0 when it is readable.
///
/// Returns the number of completions delivered (>= 0), -EINVAL (unknown
/// loop, `timeout_ms < -1`), -EBUSY, -EDEADLK, or a negative errno.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_run_once(cq_loop: *mut rdmasafe_cq_loop, timeout_ms: c_int) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if timeout_ms < -1 {
                return -libc::EINVAL;
            }
            with_loop(cq_loop, RUNNING, |l| match l.process_once(Wait::from_millis(timeout_ms as i64)) {
                Ok(n) => n.min(c_int::MAX as usize) as c_int,
                Err(e) => neg(e),
            })
        },
    )
}

/// The completion channel's fd (readable when a CQ event is ready), for the
/// app's own poll/epoll. Returns the fd (>= 0) or -EINVAL. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_fd(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || match lookup(cq_loop) {
            Ok(h) => h.fd,
            Err(e) => e,
        },
    )
}

/// Asks the loop to stop; `rdmasafe_cq_loop_run` returns after the current
/// batch with every ack flushed. Thread-safe, callable from a callback,
/// never blocks. Returns 0 or -EINVAL.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_stop(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || match lookup(cq_loop) {
            Ok(h) => {
                h.ctl.stop();
                0
            }
            Err(e) => e,
        },
    )
}

/// Reports how much work the app has outstanding (for the watchdog).
/// Thread-safe. Returns 0 or -EINVAL.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_set_outstanding(cq_loop: *mut rdmasafe_cq_loop, n: u64) -> c_int {
    guard(
        || -libc::EIO,
        || match lookup(cq_loop) {
            Ok(h) => {
                h.ctl.set_outstanding(n);
                0
            }
            Err(e) => e,
        },
    )
}

/// Reads the loop's figures into `*out` without stopping it. Thread-safe.
/// Returns 0 or -EINVAL.
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_get_stats(
    cq_loop: *mut rdmasafe_cq_loop,
    out: *mut rdmasafe_cq_loop_stats,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if out.is_null() {
                return -libc::EINVAL;
            }
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let s = h.ctl.stats();
            let v = rdmasafe_cq_loop_stats {
                size: 0,
                reserved: 0,
                wakeups: s.wakeups,
                empty_wakeups: s.empty_wakeups,
                cq_events: s.cq_events,
                completions: s.completions,
                error_completions: s.error_completions,
                ack_calls: s.ack_calls,
                acked_events: s.acked_events,
                unacked_now: s.unacked_now,
                longest_handler_ns: s.longest_handler_ns,
                watchdog_polls: s.watchdog_polls,
                arm_calls: s.arm_calls,
                keepalive_probes: s.keepalive_probes,
                keepalive_probes_ok: s.keepalive_probes_ok,
                keepalive_dead: s.keepalive_dead,
                completions_per_wakeup: s.completions_per_wakeup,
                cycle_time_us: s.cycle_time_us,
            };
            // SAFETY: out checked non-NULL; writable for its stated size (caller).
            match unsafe { crate::abi::write_out(out, &v) } {
                Ok(()) => 0,
                Err(e) => e,
            }
        },
    )
}

/// Drains `qp` before teardown (like the kernel's ib_drain_qp): moves it to
/// the error state, posts marker work requests (wr_id UINT64_MAX on the send
/// queue, UINT64_MAX - 1 on the receive queue unless `use_srq`), and runs
/// the loop until both flush completions were delivered to the callbacks.
/// Then every request posted before has completed, and every CQ event the
/// loop read is acked. The QP's CQs must be in
/// this loop. Blocks up to `timeout_ms` (> 0). Not while the loop runs.
///
/// Returns 0, -EINVAL (NULL, unknown loop, CQs not in the loop,
/// `timeout_ms <= 0`), -ETIMEDOUT, -EBUSY, -EDEADLK, or a negative errno.
///
/// # Safety
/// `qp` NULL or a live QP with a free slot on each queue.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_drain_qp(
    cq_loop: *mut rdmasafe_cq_loop,
    qp: *mut ibv_qp,
    use_srq: c_int,
    timeout_ms: c_int,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let Some(qp) = NonNull::new(qp) else { return -libc::EINVAL };
            if timeout_ms <= 0 {
                return -libc::EINVAL;
            }
            with_loop(cq_loop, RUNNING, |l| {
                // SAFETY: qp live (caller).
                match unsafe { l.drain_qp(qp, use_srq != 0, Duration::from_millis(timeout_ms as u64)) } {
                    Ok(()) => 0,
                    Err(e) => neg(e),
                }
            })
        },
    )
}

/// Called once when a keepalive declares the peer of `qp` dead (after the
/// QP was moved to the error state). Runs on the loop's thread; it may call
/// `rdmasafe_cq_loop_stop`, not add/remove/run/destroy.
pub type rdmasafe_dead_peer_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, qp: *mut ibv_qp, qp_num: u32)>;

struct CDeadPeer {
    f: unsafe extern "C" fn(*mut c_void, *mut ibv_qp, u32),
    ctx: *mut c_void,
    qp: *mut ibv_qp,
}
// SAFETY: called only on the loop's thread, as documented.
unsafe impl Send for CDeadPeer {}

/// Dead-peer detection for `qp`, an RC QP whose send CQ is in this loop.
/// While the loop runs, when the QP has had no successful completion for
/// `period_ms`, rdmasafe posts a probe (a signaled zero-length RDMA WRITE
/// with wr_id `probe_wr_id`, using one send-queue slot; the peer's
/// application sees nothing). If a probe has not completed within
/// `bound_ms`, or fails, the peer is declared dead: the QP is moved to the
/// error state (outstanding work flushes to the callbacks) and `on_dead` is
/// called once. A timer decides, so this works whatever retry_cnt the QP
/// has. Probe completions are never passed to the CQ callback: pick a
/// `probe_wr_id` the app does not use on this QP. The QP must stay alive
/// until `rdmasafe_cq_loop_remove_keepalive` or the loop is destroyed.
/// Not while the loop runs.
///
/// Returns 0, -EINVAL (NULL, unknown loop, `period_ms` or `bound_ms` <= 0,
/// send CQ not in this loop), -EBUSY (already registered, or running),
/// -EDEADLK (from a callback).
///
/// # Safety
/// `qp` NULL or a live QP.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_add_keepalive(
    cq_loop: *mut rdmasafe_cq_loop,
    qp: *mut ibv_qp,
    period_ms: c_int,
    bound_ms: c_int,
    probe_wr_id: u64,
    on_dead: rdmasafe_dead_peer_cb,
    ctx: *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let (Some(qpp), Some(f), true) = (NonNull::new(qp), on_dead, period_ms > 0 && bound_ms > 0) else {
                return -libc::EINVAL;
            };
            with_loop(cq_loop, SHORT, |l| {
                let cfg = Keepalive {
                    period: Duration::from_millis(period_ms as u64),
                    bound: Duration::from_millis(bound_ms as u64),
                    wr_id: probe_wr_id,
                };
                let cb = CDeadPeer { f, ctx, qp };
                let on_dead: cq::DeadPeer = Box::new(move |qpn, _| {
                    let cb = &cb;
                    // SAFETY: the app's callback, called as documented.
                    unsafe { (cb.f)(cb.ctx, cb.qp, qpn) }
                });
                // SAFETY: qp live until removed (caller's contract, documented).
                match unsafe { l.add_keepalive(qpp, cfg, on_dead) } {
                    Ok(()) => 0,
                    Err(e) => neg(e),
                }
            })
        },
    )
}

/// Stops dead-peer detection for `qp`. Not while the loop runs.
/// Returns 0, -EINVAL, -ENOENT (no keepalive for it), -EBUSY, -EDEADLK.
///
/// # Safety
/// `qp` NULL or a live QP.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_remove_keepalive(cq_loop: *mut rdmasafe_cq_loop, qp: *mut ibv_qp) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if qp.is_null() {
                return -libc::EINVAL;
            }
            with_loop(cq_loop, SHORT, |l| {
                // SAFETY: live QP (caller).
                let qpn = unsafe { (*qp).qp_num };
                match l.remove_keepalive(qpn) {
                    Ok(()) => 0,
                    Err(e) => neg(e),
                }
            })
        },
    )
}

/// Destroys the loop: acks every pending CQ event and every event still in
/// the channel, so afterwards each of its CQs can be destroyed. Does not
/// destroy the CQs or the channel (the app's). The pointer is invalid after.
///
/// Returns 0, -EINVAL (NULL or unknown loop, e.g. destroyed twice), -EBUSY
/// (another thread runs it: stop it first), -EDEADLK (from its callback).
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_destroy(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let mut e = match enter(&h, SHORT) {
                Ok(e) => e,
                Err(err) => return err,
            };
            // Out of the registry first (new calls get EINVAL), then the loop
            // is dropped here, on this thread: its acks are done when this
            // returns. Calls that looked the handle up earlier find it DEAD.
            loops().lock().unwrap_or_else(|e| e.into_inner()).remove(&(cq_loop as usize));
            e.release_to = DEAD;
            drop(e.guard.take());
            0
        },
    )
}

/// What an async event concerns (`rdmasafe_async_event.element_kind`).
pub const RDMASAFE_ASYNC_CQ: c_int = 1;
/// The element is a QP (`element` = struct ibv_qp *, `qp_num` set).
pub const RDMASAFE_ASYNC_QP: c_int = 2;
/// The element is an SRQ (`struct ibv_srq *`).
pub const RDMASAFE_ASYNC_SRQ: c_int = 3;
/// The element is a WQ (`struct ibv_wq *`).
pub const RDMASAFE_ASYNC_WQ: c_int = 4;
/// The element is a port (`port_num` set).
pub const RDMASAFE_ASYNC_PORT: c_int = 5;
/// The whole device (IBV_EVENT_DEVICE_FATAL).
pub const RDMASAFE_ASYNC_DEVICE: c_int = 6;
/// An event type rdmasafe does not know; `element` is the raw value.
pub const RDMASAFE_ASYNC_UNKNOWN: c_int = 0;

/// A copy of one async event; the original is already acked. Set `size`
/// to `sizeof` the struct before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct rdmasafe_async_event {
    /// In: `sizeof(struct rdmasafe_async_event)` as the caller's header
    /// declares it. Out: the number of bytes the library filled.
    pub size: u32,
    /// `enum ibv_event_type` value (unknown values pass through).
    pub event_type: u32,
    /// One of RDMASAFE_ASYNC_*.
    pub element_kind: c_int,
    /// The CQ / QP / SRQ / WQ pointer (a value: compare, do not free).
    pub element: *mut c_void,
    /// For QP events: the QP number.
    pub qp_num: u32,
    /// For port events: the port number.
    pub port_num: u8,
}

/// Gets one async event of `context`, copies it into `*out` and acks it at
/// once, so no held copy can block a destroy. Waits at most `timeout_ms`
/// (-1 forever, 0 not at all) with poll() on `context->async_fd`, whose
/// mode is not changed. One reader per context.
///
/// Returns 0, -EINVAL (NULL argument, `timeout_ms < -1`), -EAGAIN
/// (`timeout_ms == 0`, none), -ETIMEDOUT, or a negative errno.
///
/// # Safety
/// `context` NULL or a live device context; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_async_get(
    context: *mut ibv_context,
    out: *mut rdmasafe_async_event,
    timeout_ms: c_int,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if out.is_null() || timeout_ms < -1 {
                return -libc::EINVAL;
            }
            // Before an event is taken (and acked): a bad size loses nothing.
            // SAFETY: out is non-NULL and readable for its size field (caller).
            if let Err(e) = unsafe { crate::abi::check_size(out) } {
                return e;
            }
            // SAFETY: context NULL or live (caller).
            let Some(ctx) = (unsafe { DeviceContext::from_raw_checked(context) }) else { return -libc::EINVAL };
            match AsyncEvents::new(&ctx).get(Wait::from_millis(timeout_ms as i64)) {
                Ok(ev) => {
                    let (kind, element, qp_num, port_num) = match ev.element {
                        AsyncElement::Cq(p) => (RDMASAFE_ASYNC_CQ, p.cast(), 0, 0),
                        AsyncElement::Qp(p, n) => (RDMASAFE_ASYNC_QP, p.cast(), n, 0),
                        AsyncElement::Srq(p) => (RDMASAFE_ASYNC_SRQ, p, 0, 0),
                        AsyncElement::Wq(p) => (RDMASAFE_ASYNC_WQ, p, 0, 0),
                        AsyncElement::Port(n) => (RDMASAFE_ASYNC_PORT, std::ptr::null_mut(), 0, n),
                        AsyncElement::Device => (RDMASAFE_ASYNC_DEVICE, std::ptr::null_mut(), 0, 0),
                        AsyncElement::Unknown(v) => (RDMASAFE_ASYNC_UNKNOWN, v as *mut c_void, 0, 0),
                    };
                    let v = rdmasafe_async_event {
                        size: 0,
                        event_type: ev.event_type.0,
                        element_kind: kind,
                        element,
                        qp_num,
                        port_num,
                    };
                    // SAFETY: out checked non-NULL; writable for its size (caller).
                    match unsafe { crate::abi::write_out(out, &v) } {
                        Ok(()) => 0,
                        Err(e) => e,
                    }
                }
                Err(e) => neg(e),
            }
        },
    )
}

/// The name of an async event type, e.g. "IBV_EVENT_CQ_ERR";
/// "IBV_EVENT_UNKNOWN" for values rdmasafe does not know. Never NULL,
/// static. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_async_event_str(event_type: u32) -> *const c_char {
    guard(|| c"IBV_EVENT_UNKNOWN".as_ptr(), || AsyncEventType(event_type).c_name().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_destroyed_loops_are_einval() {
        let mut fake = [0u8; 64];
        let p = fake.as_mut_ptr().cast::<rdmasafe_cq_loop>();
        assert_eq!(rdmasafe_cq_loop_stop(p), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_run(p), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_run_once(p, 0), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_destroy(p), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_destroy(std::ptr::null_mut()), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_fd(p), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_set_outstanding(p, 1), -libc::EINVAL);
        assert_eq!(rdmasafe_cq_loop_remove_cq(p, std::ptr::null_mut()), -libc::EINVAL);
        // SAFETY: NULL and fake pointers are rejected before use.
        unsafe {
            let mut s = rdmasafe_cq_loop_stats::default();
            assert_eq!(rdmasafe_cq_loop_get_stats(p, &mut s), -libc::EINVAL);
            assert_eq!(rdmasafe_cq_loop_get_stats(p, std::ptr::null_mut()), -libc::EINVAL);
            let mut out = std::ptr::null_mut();
            assert_eq!(rdmasafe_cq_loop_create(std::ptr::null_mut(), std::ptr::null(), &mut out), -libc::EINVAL);
            assert_eq!(rdmasafe_cq_loop_add_cq(p, std::ptr::null_mut(), None, std::ptr::null_mut()), -libc::EINVAL);
            assert_eq!(rdmasafe_cq_loop_drain_qp(p, std::ptr::null_mut(), 0, 10), -libc::EINVAL);
            assert_eq!(
                rdmasafe_cq_loop_add_keepalive(p, std::ptr::null_mut(), 1, 1, 0, None, std::ptr::null_mut()),
                -libc::EINVAL
            );
            assert_eq!(rdmasafe_cq_loop_remove_keepalive(p, std::ptr::null_mut()), -libc::EINVAL);
            let mut ev = std::mem::zeroed();
            assert_eq!(rdmasafe_async_get(std::ptr::null_mut(), &mut ev, 0), -libc::EINVAL);
        }
    }

    #[test]
    fn options_map_and_reject_out_of_range() {
        assert_eq!(options(None).unwrap().mode, Mode::Event);
        let o = rdmasafe_cq_loop_options { mode: RDMASAFE_MODE_ADAPTIVE, adaptive_spin_us: 7, ..Default::default() };
        assert_eq!(options(Some(&o)).unwrap().mode, Mode::Adaptive { spin: Duration::from_micros(7) });
        for bad in [
            rdmasafe_cq_loop_options { mode: 9, ..Default::default() },
            rdmasafe_cq_loop_options { poll_batch: -1, ..Default::default() },
            rdmasafe_cq_loop_options { ack_batch: -5, ..Default::default() },
            rdmasafe_cq_loop_options { watchdog_ms: -1, ..Default::default() },
        ] {
            assert_eq!(options(Some(&bad)).err(), Some(-libc::EINVAL));
        }
    }

    #[test]
    fn async_names() {
        // SAFETY: static NUL-terminated strings.
        let s = |v| unsafe { std::ffi::CStr::from_ptr(rdmasafe_async_event_str(v)) }.to_str().unwrap();
        assert_eq!(s(0), "IBV_EVENT_CQ_ERR");
        assert_eq!(s(10), "IBV_EVENT_PORT_ERR");
        assert_eq!(s(1234), "IBV_EVENT_UNKNOWN");
    }
}
