//! The CQ notification loop for C.
//!
//! A loop is run by one thread at a time (`rdmasafe_cq_loop_run` or
//! `rdmasafe_cq_loop_run_once`). Everything else may be called from any
//! thread while it runs, and from inside its callbacks: CQs and keepalives
//! are added and removed, QPs drained, figures read, the loop stopped
//! (`rdmasafe_cq_loop_stop` also from a signal handler). The handle is a
//! value looked up in a table on every call (see `handles`), so a stale
//! handle can never reach a newer loop.

use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::time::Duration;

use rdmasafe_core::cq::{
    self, CqLoop, CqOptions, Keepalive, LoopControl, LoopOptions, Mode, Outcome, MAX_LATENCY_WEIGHT,
};
use rdmasafe_core::sys::{ibv_comp_channel, ibv_cq, ibv_qp, ibv_wc};
use rdmasafe_core::Wait;

use crate::handles::{Entered, NotRemoved, Table};
use crate::{guard, guard_signal_safe};

/// Event mode: arm, sleep until notified, re-arm, drain.
pub const RDMASAFE_MODE_EVENT: c_int = 0;
/// Busy-poll mode: poll continuously, never arm or sleep.
pub const RDMASAFE_MODE_BUSY_POLL: c_int = 1;
/// Adaptive mode: poll while busy and for `adaptive_spin_us` after the
/// last completion handed to a callback, then arm and sleep. The loop's own
/// completions (keepalive probes, drain markers) start or renew no spin.
pub const RDMASAFE_MODE_ADAPTIVE: c_int = 2;
/// Learning adaptive mode: measures its own sleep-to-wake cost and the idle
/// gaps before completions arrive, and picks from them when to sleep and
/// how long to spin (`adaptive_spin_us` is ignored). A wake is priced by
/// the completions it delays (`learn_wake_batch_milli` of the stats). When
/// the plan spins through every recent gap and sets no timer, it spins
/// for one priced wake after the first empty poll: a stream's rare longer
/// gap is spun through, not slept through, and a ping-pong whose round
/// trips are all shorter than a wake spins one wake. No plan spins longer
/// than one priced wake after the last completion. The loop's own
/// completions (keepalive probes, drain markers) are no arrivals: an idle
/// connection's keepalive teaches it nothing.
pub const RDMASAFE_MODE_LEARNING: c_int = 3;

/// Returned (positive) by a change requested from inside one of the loop's
/// callbacks: it takes effect as soon as that callback returns, before the
/// loop calls any other callback (the `_async` variants call back when it
/// is done).
pub const RDMASAFE_PENDING: c_int = 1;

/// `rdmasafe_cq_options.notify`: the loop's default (`solicited_only` of
/// its options).
pub const RDMASAFE_NOTIFY_DEFAULT: c_int = 0;
/// `rdmasafe_cq_options.notify`: arm for every completion.
pub const RDMASAFE_NOTIFY_ALL: c_int = 1;
/// `rdmasafe_cq_options.notify`: arm for solicited completions only:
/// events come for receive completions of messages sent with
/// IBV_SEND_SOLICITED and for errors; the CQ is drained (everything in it)
/// when one comes. Successful send completions raise no event, so a send
/// CQ armed so is drained only then (and before a keepalive probe on its
/// QP is judged overdue: such a keepalive sees its probe's completion only
/// then, a bound after it posted the probe, so it probes about once per
/// period + bound, and declares a peer that died just after answering a
/// probe dead within period + 2 x bound of that answer, not period +
/// bound): size it for the sends in between. Nor, on rxe,
/// does a send queue's flush (its QP moved to the error state): a
/// keepalive that declares the peer dead drains the QP itself, so that
/// flush is delivered; after moving a QP to the error state yourself,
/// `rdmasafe_cq_loop_drain_qp` it (it looks for its markers without an
/// event) to have the flushed sends delivered.
pub const RDMASAFE_NOTIFY_SOLICITED: c_int = 2;

/// Called with each batch of work completions of one CQ (error completions
/// included; never the loop's own keepalive probes and drain markers):
/// `wc[0..n]` is valid only during the call. Runs on the thread that runs
/// the loop. It may call any rdmasafe function on this loop except
/// `rdmasafe_cq_loop_run`, `_run_once` and `_destroy` (-EDEADLK): changes
/// take effect when it returns. It must not block on a thread that waits
/// for this loop (one removing a CQ from it, say), and must not throw a
/// C++ exception or longjmp out (the loop would be left half-way).
pub type rdmasafe_wc_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, wc: *const ibv_wc, n: c_int)>;

/// Called once when an asynchronous change is done: `object` is the CQ of
/// `rdmasafe_cq_loop_remove_cq_async` or the QP of
/// `rdmasafe_cq_loop_drain_qp_async`, `result` 0 or a negative errno. Runs
/// on the thread that runs the loop (or on the caller's, when the loop is
/// idle and the change completes within the call; or, with -ECANCELED, on
/// the thread in `rdmasafe_cq_loop_destroy`, for a change the loop had not
/// finished when it was destroyed). `ibv_destroy_cq` of a removed CQ may be
/// called from it.
pub type rdmasafe_done_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, object: *mut c_void, result: c_int)>;

/// Options of `rdmasafe_cq_loop_create`. Zero-initialise, set `size`, and
/// set what you need: 0 in a field means its default.
/// `struct rdmasafe_cq_loop_options o = { .size = sizeof o };`
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct rdmasafe_cq_loop_options {
    /// `sizeof(struct rdmasafe_cq_loop_options)` as the caller's header
    /// declares it (see "Struct sizes" at the top of this header, or STRUCT
    /// SIZES in rdmasafe(7)).
    pub size: u32,
    /// RDMASAFE_MODE_EVENT (default), RDMASAFE_MODE_BUSY_POLL,
    /// RDMASAFE_MODE_ADAPTIVE (fixed spin) or RDMASAFE_MODE_LEARNING.
    pub mode: c_int,
    /// Non-zero: arm CQs for solicited completions only (the default of
    /// `rdmasafe_cq_options.notify`).
    pub solicited_only: c_int,
    /// Completions per poll and per callback, 1..4096 (default 16).
    pub poll_batch: c_int,
    /// CQ events counted per CQ before one ack call, 1..65536 (default 16).
    pub ack_batch: c_int,
    /// Adaptive mode: microseconds of polling after the last completion
    /// handed to a callback (default 50). Must be >= 0 in every mode (-EINVAL otherwise).
    /// 0, as in a zeroed struct, is the default (50), like every field's
    /// 0 here: the shortest spin is 1.
    pub adaptive_spin_us: c_int,
    /// Watchdog: poll anyway after this many ms without an event while
    /// outstanding work is reported (0: off). The time runs in periods, one
    /// after the other, while work is reported and the loop waits for
    /// events (not while an adaptive or learning loop spins, nor in
    /// busy-poll mode: they poll every CQ anyway); a period without a CQ
    /// event ends in a poll of every CQ, so the poll comes one to two
    /// periods after the last event, and a new period begins when the
    /// watchdog counts again after a pause. An embedded loop's fd turns
    /// readable, and `rdmasafe_cq_loop_next_timeout_ms` counts down, to
    /// each period's end.
    pub watchdog_ms: c_int,
    /// Non-zero: time callbacks and cycles (`longest_handler_ns`,
    /// `cycle_time_us` of the stats; both stay 0 without). Default 0, off:
    /// timing reads the clock n + 1 times per n callbacks, and where the
    /// clocksource is not the TSC (many VMs) each read is a system call.
    /// Off, the loop reads the clock only for keepalives, the watchdog,
    /// drain and call timeouts, adaptive mode's spin, and learning mode's
    /// measurements (idle times and wake costs).
    pub timing_stats: c_int,
    /// RDMASAFE_MODE_LEARNING only: how many microseconds of CPU one
    /// microsecond of added latency is worth when the loop prices the ways
    /// to wait, 1..1000 (default 1: alike). A wake from sleep adds its
    /// block + wake cost to the latency of each completion that waited for
    /// it; a weight of k prices
    /// that cost k times, so the loop spins longer after completions and
    /// polls in wider windows around periodic arrivals: lower latency for
    /// more CPU. A weighted wake is priced at most 10 ms (its own cost, if
    /// that is more), and the spin after the last completion is never
    /// longer than one priced wake: no weight makes the loop spin for
    /// seconds, but a loop whose recent gaps are all short spins up to that
    /// bound after its last completion (e.g. 10 ms at weight 1000 with a
    /// 25 us wake). A window around periodic arrivals polls as long as
    /// their recent spread. Other modes ignore it, but it must be 0 or in
    /// range in every mode.
    pub learn_latency_weight: c_int,
}

/// Options of one CQ (`rdmasafe_cq_loop_add_cq_ex`). Zero-initialise, set
/// `size`; 0 in a field means its default.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct rdmasafe_cq_options {
    /// `sizeof(struct rdmasafe_cq_options)` as the caller's header declares it.
    pub size: u32,
    /// RDMASAFE_NOTIFY_DEFAULT, RDMASAFE_NOTIFY_ALL or RDMASAFE_NOTIFY_SOLICITED.
    pub notify: c_int,
    /// Completions handled per loop cycle at most (0: no limit). A CQ that
    /// still has completions after its budget is polled again in the next
    /// cycle, without waiting for an event, after the other ready CQs: one
    /// flooding CQ cannot starve the others. One exception: after a
    /// keepalive is added on a QP whose number an older QP's probe may
    /// still come back with, the loop's next tick polls that QP's send CQ
    /// once for all it holds (at most its size), and hands the app's
    /// completions among them to the callback beyond the budget.
    pub budget: c_int,
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
    /// CQ events for CQs on the channel that are not in the loop (acked at
    /// once, logged once per CQ at warn level).
    pub foreign_cq_events: u64,
    /// CQs in the loop now. An add (or remove) made from another thread
    /// is queued and counted here, and in `cqs_added` / `cqs_removed`, once
    /// the loop applied it (its next cycle; a remove from another thread
    /// has been applied when it returns).
    pub cqs: u64,
    /// CQs added since the loop was created (applied adds).
    pub cqs_added: u64,
    /// CQs removed since the loop was created.
    pub cqs_removed: u64,
    /// Times a CQ used up its budget with completions left.
    pub budget_yields: u64,
    /// epoll_wait calls the loop made to sleep. Event mode makes none in a
    /// cycle that finds its CQ event already in the channel when it reads
    /// first; an event a wakeup left in the channel (several CQs fired,
    /// reading on was off: see channel_reads_empty) is read after one that
    /// returns at once when the next cycle sleeps first.
    pub sleeps: u64,
    /// read()s of the completion channel, those that found nothing included.
    pub channel_reads: u64,
    /// Of those, reads that found nothing (EAGAIN): event mode reads
    /// before sleeping while recent cycles found their event pending and
    /// sleeps first otherwise, probing at most once per 64 sleeps in
    /// steady state; it decides separately after a cycle that found its
    /// event pending and after one that slept (a ping-pong alternates
    /// the two). After a read that found an event it reads on for more
    /// only while such reads recently found one, with the same back-off
    /// (one CQ firing among idle ones: no read more than a hand-written
    /// loop's; the probes of the two decisions together: at most a few
    /// reads per 64 wakeups in steady state).
    pub channel_reads_empty: u64,
    /// RDMASAFE_MODE_LEARNING (0 in the other modes): timed wakes of the
    /// plan's window (slept, then polled from just before the next
    /// completion was due).
    pub learn_timer_wakes: u64,
    /// Learning mode: timed sleeps made only to measure the wake-up
    /// latency (one per idle time until it is first measured, then at most
    /// one per 64 idle times without a window).
    pub learn_calibrations: u64,
    /// Learning mode, the current plan: ns of polling after the loop's
    /// first empty poll after completions, before it sleeps.
    pub learn_spin_ns: u64,
    /// Learning mode, the current plan: while asleep, wake on a timer to
    /// poll from this many ns after that first empty poll (0: no window) ...
    pub learn_window_from_ns: u64,
    /// ... until this many ns after it.
    pub learn_window_to_ns: u64,
    /// Learning mode: the measured block + wake cost, ns (wake-up latency
    /// plus the work around a sleep).
    pub learn_wake_cost_ns: u64,
    /// Learning mode: the completions a wake delays, as the plan prices
    /// them, in thousandths (1000: one; 0 before the first plan): the
    /// average, over the recent wakes from the loop's own sleeps, of the
    /// completions handed to callbacks in each wake's cycle, and in the
    /// next cycles those a CQ's budget left over (not those that arrive
    /// after the wake, such as a reply's own send completion; a
    /// solicited-only CQ counts once per wake, however many callback calls
    /// its completions take; a loop driven with a zero timeout, embedded in
    /// the app's own epoll, never sleeps itself and learns none). The plan
    /// prices a wake `learn_wake_cost_ns` times this times `learn_latency_weight`, at most 10 ms (the wake
    /// cost itself if that is more).
    pub learn_wake_batch_milli: u64,
    /// Learning mode: idle times learned from so far (each from the loop's
    /// first empty poll after completions to the next completion handed to
    /// a callback; the loop's own keepalive probes and drain markers end
    /// none, and an idle time that spans a return to the app from
    /// `rdmasafe_cq_loop_run_once` with a timeout other than 0, not one
    /// that returns -EINTR, is none).
    /// The plan comes from the last 32.
    pub learn_idle_samples: u64,
    /// Blocking changes (a drain, a CQ's or a keepalive's removal, from
    /// outside a callback) that ran the loop, callbacks included, on the
    /// calling thread because a thread waiting to run the loop showed no
    /// sign of life for 2 seconds (such a change otherwise waits for that
    /// thread, whose callbacks then run there).
    pub grace_takeovers: u64,
}

/// A CQ loop (opaque; the handle is looked up on every call).
pub struct rdmasafe_cq_loop {
    _opaque: [u8; 0],
}

struct CLoop {
    lp: CqLoop,
    ctl: LoopControl,
}

static LOOPS: Table<CLoop> = Table::new();

fn lookup(l: *mut rdmasafe_cq_loop) -> Result<Entered<'static, CLoop>, c_int> {
    LOOPS.enter(l as usize).ok_or(-libc::EINVAL)
}

fn neg(e: rdmasafe_core::Error) -> c_int {
    -e.errno()
}

fn outcome(r: rdmasafe_core::Result<Outcome>) -> c_int {
    match r {
        Ok(Outcome::Done) => 0,
        Ok(Outcome::Pending) => RDMASAFE_PENDING,
        Err(e) => neg(e),
    }
}

fn options(o: Option<&rdmasafe_cq_loop_options>) -> Result<LoopOptions, c_int> {
    let o = o.copied().unwrap_or_default();
    let or = |v: c_int, d: c_int| if v == 0 { d } else { v };
    let (batch, ack, spin, wd) = (or(o.poll_batch, 16), or(o.ack_batch, 16), or(o.adaptive_spin_us, 50), o.watchdog_ms);
    let weight = or(o.learn_latency_weight, 1);
    if batch < 1 || ack < 1 || spin < 0 || wd < 0 || !(1..=MAX_LATENCY_WEIGHT as c_int).contains(&weight) {
        return Err(-libc::EINVAL);
    }
    let mode = match o.mode {
        RDMASAFE_MODE_EVENT => Mode::Event,
        RDMASAFE_MODE_BUSY_POLL => Mode::BusyPoll,
        RDMASAFE_MODE_ADAPTIVE => Mode::Adaptive { spin: Duration::from_micros(spin as u64) },
        RDMASAFE_MODE_LEARNING => Mode::Learning,
        _ => return Err(-libc::EINVAL),
    };
    Ok(LoopOptions {
        mode,
        solicited_only: o.solicited_only != 0,
        poll_batch: batch as usize,
        ack_batch: ack as u32,
        watchdog: (wd > 0).then(|| Duration::from_millis(wd as u64)),
        timing_stats: o.timing_stats != 0,
        learn_latency_weight: weight as u32,
    })
}

fn cq_options(o: &rdmasafe_cq_options, defaults: CqOptions) -> Result<CqOptions, c_int> {
    let solicited_only = match o.notify {
        RDMASAFE_NOTIFY_DEFAULT => defaults.solicited_only,
        RDMASAFE_NOTIFY_ALL => false,
        RDMASAFE_NOTIFY_SOLICITED => true,
        _ => return Err(-libc::EINVAL),
    };
    if o.budget < 0 {
        return Err(-libc::EINVAL);
    }
    Ok(CqOptions { solicited_only, budget: o.budget as usize })
}

/// Creates a loop on `channel` (a completion channel the app created with
/// `ibv_create_comp_channel`, which must outlive the loop). The loop puts
/// the channel's fd in non-blocking mode (its flags are restored by
/// `rdmasafe_cq_loop_destroy`) and is from now on its only reader. `opts`
/// may be NULL for the defaults (event mode).
///
/// Returns 0 and stores the loop in `*out`, or -EINVAL (NULL `channel` or
/// `out`, an option out of range, `opts->size` not set or over 4096),
/// -E2BIG (`opts` has fields this library does not know set), -EBUSY (the
/// channel has a loop already), -EMFILE (4096 loops exist), -ENOMEM, or another negative
/// errno. `*out` is untouched on failure.
///
/// # Safety
/// `channel` NULL or live; `opts` NULL or readable for its `size`; `out`
/// NULL or writable.
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
            let lp = match unsafe { CqLoop::from_raw(chan, opts) } {
                Ok(l) => l,
                Err(e) => return neg(e),
            };
            let ctl = lp.control();
            match LOOPS.insert(Box::new(CLoop { lp, ctl })) {
                Some(h) => {
                    // SAFETY: out checked non-NULL.
                    unsafe { *out = h as *mut rdmasafe_cq_loop };
                    0
                }
                None => -libc::EMFILE,
            }
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

struct CDone {
    f: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int),
    ctx: *mut c_void,
    object: *mut c_void,
}
// SAFETY: as for CCallback.
unsafe impl Send for CDone {}

impl CDone {
    fn boxed(self) -> Box<dyn FnOnce(rdmasafe_core::Result<()>) + Send> {
        Box::new(move |r: rdmasafe_core::Result<()>| {
            let d = self;
            let code = match r {
                Ok(()) => 0,
                Err(e) => neg(e),
            };
            // SAFETY: the app's callback, called once as documented.
            unsafe { (d.f)(d.ctx, d.object, code) }
        })
    }
}

fn add(
    l: *mut rdmasafe_cq_loop,
    cq: *mut ibv_cq,
    opts: Option<&rdmasafe_cq_options>,
    cb: rdmasafe_wc_cb,
    ctx: *mut c_void,
) -> c_int {
    let (Some(cqp), Some(f)) = (NonNull::new(cq), cb) else { return -libc::EINVAL };
    let h = match lookup(l) {
        Ok(h) => h,
        Err(e) => return e,
    };
    let defaults = h.lp.default_cq_options();
    let opts = match opts.map(|o| cq_options(o, defaults)).transpose() {
        Ok(o) => o.unwrap_or(defaults),
        Err(e) => return e,
    };
    let c = CCallback { f, ctx };
    let handler: cq::Handler = Box::new(move |wcs: &[cq::Wc], _ctl: &LoopControl| {
        let c = &c;
        let wcs = cq::Wc::as_raw_slice(wcs);
        // SAFETY: the app's callback, called as documented.
        unsafe { (c.f)(c.ctx, wcs.as_ptr(), wcs.len() as c_int) }
    });
    // SAFETY: cq live until removed (caller's contract, documented).
    outcome(unsafe { h.ctl.add_raw_cq(cqp, opts, handler) })
}

/// Adds `cq` with its callback and the loop's default options, while the
/// loop runs or not, from any thread or from inside a callback. The loop
/// arms the CQ and delivers what it already holds at its next cycle (a
/// loop embedded in the app's epoll has its fd readable for that). The CQ
/// must have been created on this loop's channel and must not be
/// destroyed before it has left the loop (`rdmasafe_cq_loop_remove_cq`,
/// `rdmasafe_cq_loop_destroy_cq`, or the loop destroyed):
/// `ibv_destroy_cq` waits for acks only the loop can give, and the loop
/// would poll freed memory. The add is queued: it is applied at the loop's
/// next cycle (then `cqs` and `cqs_added` of the figures count it), or at
/// once when the loop is idle.
///
/// Returns 0 (or RDMASAFE_PENDING from inside a callback), -EINVAL (NULL
/// argument, unknown loop, CQ not bound to this loop's channel or of
/// another device context), -EBUSY (the CQ is in a loop already, also
/// while its removal from a callback is still pending: add it back after
/// that callback returned).
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
    guard(|| -libc::EIO, || add(cq_loop, cq, None, cb, ctx))
}

/// Like `rdmasafe_cq_loop_add_cq`, with options for this CQ (`opts` may be
/// NULL): which completions arm it (`notify`) and a per-cycle budget.
///
/// Returns as `rdmasafe_cq_loop_add_cq`, and -EINVAL for an option out of
/// range or `opts->size` not set or over 4096, -E2BIG for fields this
/// library does not know set.
///
/// # Safety
/// `cq` NULL or a live CQ; `opts` NULL or readable for its `size`.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_add_cq_ex(
    cq_loop: *mut rdmasafe_cq_loop,
    cq: *mut ibv_cq,
    opts: *const rdmasafe_cq_options,
    cb: rdmasafe_wc_cb,
    ctx: *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let opts = if opts.is_null() {
                None
            } else {
                // SAFETY: readable for its stated size (caller).
                match unsafe { crate::abi::read_in(opts) } {
                    Ok(o) => Some(o),
                    Err(e) => return e,
                }
            };
            add(cq_loop, cq, opts.as_ref(), cb, ctx)
        },
    )
}

/// Removes `cq`, while the loop runs or not: its pending acks are flushed,
/// events already queued for it are read and acked, and its callback will
/// never be called again. From another thread this waits for the loop's
/// current cycle (it never returns while the CQ's callback runs) and
/// returns 0: `ibv_destroy_cq` may follow at once, provided no QP can still
/// raise an event on the CQ (destroy or drain its QPs first; a QP with a
/// keepalive: drain it, or remove its keepalive, before destroying it:
/// see `rdmasafe_cq_loop_add_keepalive`). From inside a
/// callback of this loop it returns RDMASAFE_PENDING: the removal is done
/// when that callback returns (use `rdmasafe_cq_loop_remove_cq_async` or
/// `rdmasafe_cq_loop_destroy_cq` to destroy the CQ then). Keepalives that
/// probe through the CQ stop and are removed (a later
/// `rdmasafe_cq_loop_remove_keepalive` of their QP returns -ENOENT, and
/// adding the CQ back does not restore them: add them again); drains that
/// need it end with -ECANCELED.
///
/// Returns 0, RDMASAFE_PENDING, -EINVAL (NULL, unknown loop), -ENOENT (CQ
/// not in this loop).
///
/// A CQ stays in the loop until its removal is done. A second removal asked
/// meanwhile (twice in one callback, or while a removal from a callback or
/// `rdmasafe_cq_loop_remove_cq_async` is pending) is accepted and then
/// finds the CQ gone: from a callback it returns RDMASAFE_PENDING again and
/// the failure is only logged (a warning); from another thread it returns
/// -ENOENT once the first removal is done.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_remove_cq(cq_loop: *mut rdmasafe_cq_loop, cq: *mut ibv_cq) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if cq.is_null() {
                return -libc::EINVAL;
            }
            match lookup(cq_loop) {
                Ok(h) => outcome(h.ctl.remove_raw_cq(cq)),
                Err(e) => e,
            }
        },
    )
}

/// Removes `cq` without ever blocking: `done(done_ctx, cq, result)` is
/// called once the removal is complete (acks flushed, callback never called
/// again), on the thread that runs the loop, or on the caller's when the
/// loop is idle. `done` may call `ibv_destroy_cq(cq)`.
///
/// Returns 0 (`done` will be called), -EINVAL (NULL `cq` or `done`, unknown
/// loop), -ENOENT (CQ not in this loop; `done` is not called). A removal
/// asked while another removal of the CQ is pending (the CQ is still in the
/// loop) returns 0, and its `done` is called with -ENOENT once the first
/// removal is done.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_remove_cq_async(
    cq_loop: *mut rdmasafe_cq_loop,
    cq: *mut ibv_cq,
    done: rdmasafe_done_cb,
    done_ctx: *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let (false, Some(f)) = (cq.is_null(), done) else { return -libc::EINVAL };
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let d = CDone { f, ctx: done_ctx, object: cq.cast() };
            match h.ctl.remove_raw_cq_then(cq, d.boxed()) {
                Ok(()) => 0,
                Err(e) => neg(e),
            }
        },
    )
}

struct DestroyCq(*mut ibv_cq);
// SAFETY: a CQ pointer handed from the app to the loop's thread.
unsafe impl Send for DestroyCq {}

/// Removes `cq` from the loop and destroys it, in the only safe order: the
/// removal completes (acks flushed, callback never called again), then
/// `ibv_destroy_cq`. Destroy or drain the QPs that use the CQ first (a QP
/// with a keepalive: drain it, or remove its keepalive, before destroying
/// it: see `rdmasafe_cq_loop_add_keepalive`). From
/// inside a callback of this loop the CQ is removed and destroyed when that
/// callback returns (RDMASAFE_PENDING; a failed destroy is then only
/// logged, at error level, and only with logging on: where its result
/// matters, use `rdmasafe_cq_loop_remove_cq_async` and call
/// `ibv_destroy_cq` in its `done`).
///
/// Returns 0, RDMASAFE_PENDING, -EINVAL (NULL, unknown loop), -ENOENT (CQ
/// not in this loop: nothing destroyed), or the negative errno of
/// `ibv_destroy_cq` (e.g. -EBUSY: a QP still uses the CQ): the CQ has left
/// the loop then all the same (its callback is not called again, its
/// events were acked) and still exists; add it again to have it served.
///
/// # Safety
/// `cq` NULL or a live CQ that nothing but the loop uses any more.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_destroy_cq(cq_loop: *mut rdmasafe_cq_loop, cq: *mut ibv_cq) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if cq.is_null() {
                return -libc::EINVAL;
            }
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            if h.ctl.on_loop_thread() {
                let target = DestroyCq(cq);
                let then = Box::new(move |r: rdmasafe_core::Result<()>| {
                    let t = target;
                    if r.is_ok() {
                        // SAFETY: out of the loop now, and the app's to destroy.
                        let d = unsafe { destroy_left_cq(t.0) };
                        if d != 0 {
                            log::error!(target: "rdmasafe", "rdmasafe_cq_loop_destroy_cq: ibv_destroy_cq: errno {}", -d);
                        }
                    }
                });
                return match h.ctl.remove_raw_cq_then(cq, then) {
                    Ok(()) => RDMASAFE_PENDING,
                    Err(e) => neg(e),
                };
            }
            match h.ctl.remove_raw_cq(cq) {
                Ok(_) => {}
                Err(e) => return neg(e),
            }
            // SAFETY: the CQ left the loop (removal complete); the app's.
            unsafe { destroy_left_cq(cq) }
        },
    )
}

/// `ibv_destroy_cq` of a CQ that left its loop: 0 or a negative errno. The
/// drain markers parked for it go first (a new CQ at its address must not
/// inherit them).
///
/// # Safety
/// `cq` is a live CQ out of every loop that nothing uses any more.
unsafe fn destroy_left_cq(cq: *mut ibv_cq) -> c_int {
    let left = rdmasafe_core::cq::cq_destroying(cq);
    // SAFETY: the caller's contract.
    match unsafe { rdmasafe_core::sys::ibv_destroy_cq(cq) } {
        0 => 0,
        r => {
            // The CQ lives on (e.g. EBUSY: a QP still uses it), and may be
            // added to a loop again: the loop's markers and probes through
            // it stay the loop's.
            left.destroy_failed();
            -r.abs()
        }
    }
}

/// Runs the loop on the calling thread until `rdmasafe_cq_loop_stop`, then
/// acks everything outstanding and returns 0. A stopped loop can be run
/// again, or driven from the app's epoll from then on: the return leaves
/// `rdmasafe_cq_loop_fd` readable when the loop has work left (the CQs
/// the stop left to arm again). Blocks. Signals do not end it (a
/// profiler's SIGPROF is harmless); a signal handler may call
/// `rdmasafe_cq_loop_stop`. Not a cancellation point, unlike the
/// `ibv_get_cq_event` it replaces: a thread cancelled inside it (or in a
/// callback) aborts the process; stop it with `rdmasafe_cq_loop_stop` and
/// join the thread.
///
/// Returns 0, -EINVAL (unknown or destroyed loop), -EBUSY (another thread
/// runs it), -EDEADLK (from a callback), or the negative errno of a failed
/// verbs call.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_run(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || match lookup(cq_loop) {
            Ok(h) => match h.lp.run() {
                Ok(()) => 0,
                Err(e) => neg(e),
            },
            Err(e) => e,
        },
    )
}

/// Waits at most `timeout_ms` (-1 forever, 0 not at all) until completions
/// are delivered to callbacks: cycles until a callback got completions,
/// the time runs out, a stop, or an error; the loop's own work on the way
/// (a keepalive probe, a timer, a CQ just added) does not end the call, so
/// 0 means the time ran out (or a stop). With 0: one cycle, which may
/// deliver nothing. For
/// driving the loop from the app's own epoll: watch `rdmasafe_cq_loop_fd`
/// and call this with 0 whenever it is readable, no priming call needed
/// (see there). A stop requested before the call or during it (from a
/// callback, or by another thread) ends the call with every ack flushed:
/// it returns what it delivered up to then (0 for a stop asked before
/// it); called with 0, it then leaves the fd
/// readable, so that the app's epoll calls again and that call re-arms the
/// CQs the stop disarmed. Besides `timeout_ms`, it may wait for the cycle
/// another thread is in (a blocking `rdmasafe_cq_loop_drain_qp` or
/// `_remove_cq` from another thread runs the loop while nobody does), never
/// for that thread's whole request: the drain hands the loop over after its
/// current cycle and waits for this call instead.
///
/// Returns the number of completions delivered to callbacks (>= 0; the
/// loop's own keepalive probes and drain markers are not counted), -EINTR (a signal
/// handler ran during the wait, even one installed with SA_RESTART: the
/// wait is never restarted, unlike `ibv_get_cq_event`'s read), -EINVAL (unknown loop, `timeout_ms < -1`),
/// -EBUSY (another thread runs it), -EDEADLK (from a callback), or a
/// negative errno.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_run_once(cq_loop: *mut rdmasafe_cq_loop, timeout_ms: c_int) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if timeout_ms < -1 {
                return -libc::EINVAL;
            }
            match lookup(cq_loop) {
                Ok(h) => match h.lp.process_once(Wait::from_millis(timeout_ms as i64)) {
                    Ok(n) => n.min(c_int::MAX as usize) as c_int,
                    Err(e) => neg(e),
                },
                Err(e) => e,
            }
        },
    )
}

/// The loop's own epoll fd, for the app's poll/epoll: readable whenever
/// the loop has work (a CQ event; a CQ just added; a stop; a due
/// keepalive, watchdog or drain deadline; an adaptive loop still polling;
/// a CQ left over its budget; after a call that ended with an error other
/// than -EINTR, the CQs to arm again). Call `rdmasafe_cq_loop_run_once(l, 0)`
/// when it is. Watch it level-triggered (no EPOLLET): a call may leave
/// work for the next (a CQ over its budget, an adaptive loop still
/// polling), and the fd stays readable for it, which an edge-triggered
/// epoll does not report again (it may then sleep with completions
/// waiting). Not the completion channel's fd. Thread-safe.
///
/// Returns the fd (>= 0) or -EINVAL.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_fd(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || match lookup(cq_loop) {
            Ok(h) => std::os::fd::AsRawFd::as_raw_fd(&h.lp),
            Err(e) => e,
        },
    )
}

/// For an app that embeds the loop: stores in `*timeout_ms` how long it may
/// wait before calling `rdmasafe_cq_loop_run_once` again even if the fd
/// stays quiet: 0 while the loop has work right now, the milliseconds to
/// its next keepalive / watchdog / drain deadline (rounded up), or -1 if
/// none (ready to pass to epoll_wait). Thread-safe.
///
/// Returns 0, or -EINVAL (unknown loop, NULL `timeout_ms`).
///
/// # Safety
/// `timeout_ms` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_next_timeout_ms(
    cq_loop: *mut rdmasafe_cq_loop,
    timeout_ms: *mut c_int,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if timeout_ms.is_null() {
                return -libc::EINVAL;
            }
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let v = rdmasafe_core::sys::Wait::from(h.ctl.next_timeout()).poll_ms();
            // SAFETY: checked non-NULL.
            unsafe { *timeout_ms = v };
            0
        },
    )
}

/// Asks the loop to stop: `rdmasafe_cq_loop_run` returns after the current
/// batch with every ack flushed. A loop driven by `_run_once` finishes the
/// stop within the call in progress (a stop asked from a callback, or by
/// another thread during the call: the call flushes every ack before it
/// returns), or else in its next call; a call after that runs the loop
/// normally again. A stop asked while no thread runs the loop is kept:
/// the next `rdmasafe_cq_loop_run` flushes and returns 0 at once.
/// Thread-safe, callable from a callback, never
/// blocks, and async-signal-safe: it takes no lock and leaves errno as it
/// was, so a signal handler may call it. No cancellation point: a thread
/// with a cancellation pending may call it (the wake is a raw system call).
///
/// Returns 0 or -EINVAL.
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_stop(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard_signal_safe(
        || -libc::EIO,
        || {
            rdmasafe_core::sys::keeping_errno(|| match LOOPS.enter_signal_safe(cq_loop as usize) {
                Some(h) => {
                    h.ctl.stop();
                    0
                }
                None => -libc::EINVAL,
            })
        },
    )
}

/// Reports how much work the app has outstanding (for the watchdog). From
/// none to some, it wakes the loop (its fd turns readable: an embedding app
/// calls `rdmasafe_cq_loop_run_once`, after which
/// `rdmasafe_cq_loop_next_timeout_ms` has the watchdog's deadline), so a
/// loop asleep without a deadline starts its watchdog. Thread-safe.
/// Returns 0 or -EINVAL.
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

/// Reads the loop's figures into `*out` (set `out->size` first) without
/// stopping it. Thread-safe, takes no lock.
///
/// Returns 0, or -EINVAL (unknown loop, NULL `out`, `out->size` not set or
/// over 4096).
///
/// # Safety
/// `out` NULL or writable for its `size`.
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
                foreign_cq_events: s.foreign_cq_events,
                cqs: s.cqs,
                cqs_added: s.cqs_added,
                cqs_removed: s.cqs_removed,
                budget_yields: s.budget_yields,
                sleeps: s.sleeps,
                channel_reads: s.channel_reads,
                channel_reads_empty: s.channel_reads_empty,
                learn_timer_wakes: s.learn_timer_wakes,
                learn_calibrations: s.learn_calibrations,
                learn_spin_ns: s.learn_spin_ns,
                learn_window_from_ns: s.learn_window_from_ns,
                learn_window_to_ns: s.learn_window_to_ns,
                learn_wake_cost_ns: s.learn_wake_cost_ns,
                learn_wake_batch_milli: s.learn_wake_batch_milli,
                learn_idle_samples: s.learn_idle_samples,
                grace_takeovers: s.grace_takeovers,
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
/// the error state, posts marker work requests (wr_id UINT64_MAX on the
/// send queue, UINT64_MAX - 1 on the receive queue unless `use_srq`), and
/// the loop delivers every completion until both markers come back (it
/// also polls the QP's CQs for them, a few ms after the start and then at
/// growing gaps: a flushed completion need not raise an event, e.g. a send
/// CQ armed RDMASAFE_NOTIFY_SOLICITED on rxe). The
/// markers never reach a callback. Then every request posted before has
/// completed, and every CQ event the loop read is acked. A keepalive of
/// the QP stays registered (remove it as usual) but sends no more probes,
/// and a probe flushed by the drain is not a dead peer. The QP's CQs must
/// be in this loop.
///
/// A drain that ends without its markers (-ETIMEDOUT, -ECANCELED) leaves
/// them to the loop: they are consumed whenever they come back, also after
/// their CQ left the loop and was added to it or another loop again (kept
/// by CQ address, at most 1024 markers). So on a QP that was drained, the
/// wr_ids UINT64_MAX and UINT64_MAX - 1 belong to the loop (a CQ destroyed
/// with `rdmasafe_cq_loop_destroy_cq` takes its markers along; after
/// `ibv_destroy_cq` of your own, a new CQ at the same address inherits
/// them). A drain retried after a timeout is done only once its own markers
/// are back (a queue completes in order: the old drain's come first), so a
/// marker that never comes back (the CQ overran) makes every later drain of
/// that QP time out. On Linux 6.1's rxe a receive posted to a QP already in
/// the error state was seen never to complete, so a retry without
/// `use_srq` can time out there.
///
/// From another thread this blocks up to `timeout_ms`
/// (> 0), running the loop itself when nobody runs it; from inside a
/// callback it starts the drain and returns RDMASAFE_PENDING (use
/// `rdmasafe_cq_loop_drain_qp_async` to be told when it is done).
///
/// Returns 0, RDMASAFE_PENDING, -EINVAL (NULL, unknown loop, CQs not in the
/// loop, `timeout_ms <= 0`; also a CQ of the QP that left the loop
/// between the call and the drain's start), -ETIMEDOUT, -ECANCELED (a CQ
/// of the QP left the loop while the drain ran, or the loop was destroyed
/// meanwhile), or the negative errno of a verbs call.
///
/// # Safety
/// `qp` NULL or a live QP with a free slot on each queue, alive until the
/// drain is done.
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
            match lookup(cq_loop) {
                Ok(h) => {
                    let timeout = Duration::from_millis(timeout_ms as u64);
                    // SAFETY: qp live until the drain is done (caller).
                    outcome(unsafe { h.ctl.drain_qp(qp, use_srq != 0, timeout) })
                }
                Err(e) => e,
            }
        },
    )
}

/// Starts a drain (see `rdmasafe_cq_loop_drain_qp`) and never blocks:
/// `done(done_ctx, qp, result)` is called once with its result (0,
/// -ETIMEDOUT, -ECANCELED, -EINVAL when a CQ of the QP left the loop
/// before the drain started, ...) on the thread that runs the loop; the
/// drain makes progress as the loop runs. -ECANCELED: a CQ of the QP left
/// the loop during the drain, or the loop was destroyed first (then `done`
/// runs on the thread in `rdmasafe_cq_loop_destroy`, before it returns).
///
/// Returns 0 (`done` will be called), -EINVAL (NULL `qp` or `done`, unknown
/// loop, CQs not in the loop, `timeout_ms <= 0`; `done` is not called).
///
/// # Safety
/// `qp` NULL or a live QP with a free slot on each queue, alive until
/// `done` is called.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cq_loop_drain_qp_async(
    cq_loop: *mut rdmasafe_cq_loop,
    qp: *mut ibv_qp,
    use_srq: c_int,
    timeout_ms: c_int,
    done: rdmasafe_done_cb,
    done_ctx: *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let (Some(qpp), Some(f), true) = (NonNull::new(qp), done, timeout_ms > 0) else { return -libc::EINVAL };
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let d = CDone { f, ctx: done_ctx, object: qp.cast() };
            let timeout = Duration::from_millis(timeout_ms as u64);
            // SAFETY: qp live until done is called (caller).
            match unsafe { h.ctl.drain_qp_then(qpp, use_srq != 0, timeout, d.boxed()) } {
                Ok(()) => 0,
                Err(e) => neg(e),
            }
        },
    )
}

/// Called once when a keepalive declares the peer of `qp` dead (after the
/// QP was moved to the error state). Runs on the loop's thread; like a
/// completion callback, it may change the loop (not run or destroy it).
pub type rdmasafe_dead_peer_cb = Option<unsafe extern "C" fn(ctx: *mut c_void, qp: *mut ibv_qp, qp_num: u32)>;

struct CDeadPeer {
    f: unsafe extern "C" fn(*mut c_void, *mut ibv_qp, u32),
    ctx: *mut c_void,
    qp: *mut ibv_qp,
}
// SAFETY: called only on the loop's thread, as documented.
unsafe impl Send for CDeadPeer {}

/// Dead-peer detection for `qp`, an RC QP whose send CQ is in this loop,
/// while the loop runs or not, from any thread or a callback. While the
/// loop runs, when the QP has had no successful completion for
/// `period_ms`, rdmasafe posts a probe (a signaled zero-length RDMA WRITE
/// with wr_id `probe_wr_id`, using one send-queue slot; the peer's
/// application sees nothing; a full send queue delays it, up to the
/// bound). If a probe has not completed within `bound_ms`, or fails with
/// an error status other than a flush, the peer is declared dead: the QP
/// is drained as by `rdmasafe_cq_loop_drain_qp`, with nobody waiting (the
/// error state, and markers the loop also polls for, so outstanding work
/// flushes to the callbacks even where the flush raises no event, as on a
/// send CQ armed `RDMASAFE_NOTIFY_SOLICITED`; the receive queue gets a
/// marker only when its CQ is in this loop and the QP has no SRQ; the
/// markers' wr_ids then belong to the loop on that QP, as after a drain),
/// then `on_dead` is called once (a keepalive removed before its `on_dead`
/// runs, by the `on_dead` of another peer found dead at the same time,
/// say, gets none, as any removed keepalive; one added again on a QP
/// already drained for a dead peer finds it in the error state and only
/// ends the probing, as below). A QP not connected
/// yet (a keepalive added at CONNECT_REQUEST, before `rdma_accept`) is
/// probed once it is in RTS,
/// and a probe posted before the QP's first success has a bound of at
/// least twice the QP's ack timeout, also when another request succeeds
/// while it is out (the peer's QP may not be ready yet: it drops the
/// probe, which is sent again after that timeout). A QP moved to the error
/// state by something else (a drain, the app's `rdma_disconnect`, another
/// request's error, each reported by its own completion or event) ends the
/// probing without a dead peer, except a request of the QP that fails with
/// IBV_WC_RETRY_EXC_ERR (the peer unreachable): a dead peer. A timer
/// decides, so this works whatever retry_cnt the QP has. Probe completions
/// are never passed to the CQ callback (one still out when the send CQ
/// leaves the loop is consumed by the loop it joins next, as drain markers
/// are): pick a `probe_wr_id` the app never uses in its own work requests
/// (one value for all keepalives is simplest). A probe still out when its
/// keepalive ends is looked for by QP number, wr_id and CQ, as its
/// completion may still come (rxe, for one, leaves a destroyed QP's
/// completions in the CQ): also among the completions of a new QP that got
/// the number, until the loop has polled the send CQ of a keepalive added
/// on that QP (at its next tick, through that CQ; through another CQ, until
/// it comes). The QP must stay
/// alive until
/// `rdmasafe_cq_loop_remove_keepalive` returns, its send CQ leaves the
/// loop, or the loop is destroyed; or until its drain
/// (`rdmasafe_cq_loop_drain_qp`) or its peer's death (`on_dead`) has been
/// reported, after which the keepalive no longer touches it. Destroying
/// the QP first (e.g. `rdma_destroy_qp` at DISCONNECTED, then removing
/// its CQ) is a use after free: until then the loop queries the QP and
/// posts its probes on it.
///
/// Returns 0 (or RDMASAFE_PENDING from a callback), -EINVAL (NULL, unknown
/// loop, `period_ms` or `bound_ms` <= 0, not an RC QP, send CQ not in this
/// loop), -EBUSY (the QP has a keepalive already).
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
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
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
            outcome(unsafe { h.ctl.add_keepalive(qpp, cfg, on_dead) })
        },
    )
}

/// Stops dead-peer detection for `qp`; a probe still outstanding is
/// consumed when it completes (also after its send CQ left the loop and
/// joined this or another loop again: probes are kept by CQ address, as
/// drain markers are, see `rdmasafe_cq_loop_drain_qp`). Any thread, or a
/// callback.
///
/// Returns 0 (or RDMASAFE_PENDING from a callback), -EINVAL (NULL, unknown
/// loop), -ENOENT (no keepalive for it: never added, removed already, or
/// removed with its send CQ by `rdmasafe_cq_loop_remove_cq`).
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
            match lookup(cq_loop) {
                // SAFETY: live QP (caller).
                Ok(h) => outcome(h.ctl.remove_keepalive(unsafe { (*qp).qp_num })),
                Err(e) => e,
            }
        },
    )
}

/// Destroys the loop: acks every pending CQ event and every event still in
/// the channel, drops the callbacks, restores the channel fd's flags, so
/// that afterwards each of its CQs can be destroyed. A drain still in
/// progress ends with -ECANCELED: the `done` of
/// `rdmasafe_cq_loop_drain_qp_async` is called on this thread before this
/// returns, and a `rdmasafe_cq_loop_drain_qp` blocked on another thread
/// returns -ECANCELED (it is not waited for to its timeout). Does not
/// destroy the CQs or the channel (the app's). The handle is invalid
/// afterwards: every later call with it (destroy included) returns
/// -EINVAL, even if a new loop is created at the same time.
///
/// Calls on this loop in progress on other threads (`get_stats`, say) are
/// waited for; those that change the loop fail (-EINVAL, a blocked one
/// -ECANCELED) once the destroy began. A log callback must not wait for a
/// thread that destroys the loop.
///
/// Returns 0, -EINVAL (unknown or already destroyed loop), -EBUSY (another
/// thread runs it, or is about to: stop it first), -EDEADLK (from one of its callbacks, or
/// from a log callback while this thread is inside another call on this
/// loop: nothing is destroyed).
#[no_mangle]
pub extern "C" fn rdmasafe_cq_loop_destroy(cq_loop: *mut rdmasafe_cq_loop) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let h = match lookup(cq_loop) {
                Ok(h) => h,
                Err(e) => return e,
            };
            // Before try_close, which would mark the loop as going away.
            if h.nested() {
                return -libc::EDEADLK;
            }
            if let Err(e) = h.lp.try_close() {
                return neg(e);
            }
            match LOOPS.remove(h) {
                // Dropped here, on this thread: its acks are done when this returns.
                Ok(obj) => {
                    drop(obj);
                    0
                }
                Err(NotRemoved::Nested) => -libc::EDEADLK,
                Err(NotRemoved::Gone) => -libc::EINVAL,
            }
        },
    )
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
            let mut s = rdmasafe_cq_loop_stats {
                size: std::mem::size_of::<rdmasafe_cq_loop_stats>() as u32,
                ..Default::default()
            };
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
            let mut t = 7;
            assert_eq!(rdmasafe_cq_loop_next_timeout_ms(p, &mut t), -libc::EINVAL);
            assert_eq!(t, 7);
        }
    }

    #[test]
    fn options_map_and_reject_out_of_range() {
        assert_eq!(options(None).unwrap().mode, Mode::Event);
        assert!(!options(None).unwrap().timing_stats, "timing off by default");
        let t = rdmasafe_cq_loop_options { timing_stats: 1, ..Default::default() };
        assert!(options(Some(&t)).unwrap().timing_stats);
        let o = rdmasafe_cq_loop_options { mode: RDMASAFE_MODE_ADAPTIVE, adaptive_spin_us: 7, ..Default::default() };
        assert_eq!(options(Some(&o)).unwrap().mode, Mode::Adaptive { spin: Duration::from_micros(7) });
        assert_eq!(options(None).unwrap().learn_latency_weight, 1, "0: the default, 1");
        let w =
            rdmasafe_cq_loop_options { mode: RDMASAFE_MODE_LEARNING, learn_latency_weight: 8, ..Default::default() };
        assert_eq!(options(Some(&w)).unwrap().learn_latency_weight, 8);
        for bad in [
            rdmasafe_cq_loop_options { mode: 9, ..Default::default() },
            rdmasafe_cq_loop_options { poll_batch: -1, ..Default::default() },
            rdmasafe_cq_loop_options { ack_batch: -5, ..Default::default() },
            rdmasafe_cq_loop_options { watchdog_ms: -1, ..Default::default() },
            rdmasafe_cq_loop_options { learn_latency_weight: -1, ..Default::default() },
            rdmasafe_cq_loop_options { learn_latency_weight: 1001, ..Default::default() },
        ] {
            assert_eq!(options(Some(&bad)).err(), Some(-libc::EINVAL));
        }
        let d = CqOptions { solicited_only: true, budget: 0 };
        let all = rdmasafe_cq_options { notify: RDMASAFE_NOTIFY_ALL, budget: 8, ..Default::default() };
        assert_eq!(cq_options(&all, d), Ok(CqOptions { solicited_only: false, budget: 8 }));
        let def = rdmasafe_cq_options::default();
        assert_eq!(cq_options(&def, d), Ok(d));
        assert_eq!(cq_options(&rdmasafe_cq_options { notify: 3, ..Default::default() }, d), Err(-libc::EINVAL));
        assert_eq!(cq_options(&rdmasafe_cq_options { budget: -1, ..Default::default() }, d), Err(-libc::EINVAL));
    }
}
