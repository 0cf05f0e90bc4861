//! Everything any thread can do to a loop while another thread runs it:
//! [`LoopControl`], and the protocol that makes membership changes work
//! from anywhere.
//!
//! The loop's state ([`super::core::Core`]) sits behind one mutex,
//! held by whoever drives the loop: for the whole of `run`, for one
//! `process_once`, or briefly by a thread that applies a change while
//! nobody drives. A change (add or remove a CQ or a keepalive, drain a QP)
//! is a command queued here. Then:
//!
//! * from inside one of the loop's handlers (the thread that holds the
//!   state): queued only; the loop applies it as soon as that handler
//!   returns, before calling any other handler ([`Outcome::Pending`]);
//! * from any other thread: queued, the loop is woken (its fd becomes
//!   readable), and for a removal or a drain the caller waits until the
//!   command is done (an add returns once it is queued: it cannot fail
//!   then, unless the loop is dropped first, and the loop applies it
//!   before its next cycle, in order with the other changes). If nobody
//!   drives the loop, the caller takes the state and applies the command
//!   itself (for a drain: runs the loop until it is done, or until a thread
//!   wants to run it: then it hands the loop over after its current cycle
//!   and waits for that thread). A live async run counts as somebody (its
//!   handlers stay on its runtime's thread) as long as it shows life: after
//!   2 s without a cycle the caller drives the loop itself. Every holder
//!   of the state lets go through `Held`, which applies what is queued and
//!   looks again after the unlock (`next_timeout` looks again by itself),
//!   and every wait is bounded and re-checked, so a command can never be
//!   left behind.
//!
//! So a remove from another thread waits for the cycle in progress: a
//! handler must never wait for a thread that is removing a CQ of the same
//! loop (use the `_then` variants there, which never block).

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::core::Core;
use super::handle::{LiveCq, LiveQp};
use super::keepalive::{Registration, Registrations};
use super::options::{CqOptions, Keepalive, LoopOptions};
use super::stats::{Bump, Counters, LoopStats};
use super::{registry, DeadPeer, Handler};
use crate::cm::CmId;
use crate::sys::{self, ibv_cq, ibv_qp, Epoll, TimerFd, WakeFd};
use crate::verbs::Cq;
use crate::wc::Wc;
use crate::{Error, Result};

/// How a change requested with [`LoopControl`] went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done when the call returned; for an add from another thread while
    /// a thread drives the loop: queued, which it cannot fail once it is,
    /// unless the loop is dropped first (the loop applies it before its
    /// next cycle, after the changes queued before it and before those
    /// queued after it: the loop's figures count it from then on).
    Done,
    /// Requested from inside one of the loop's handlers: done as soon as
    /// that handler returns, before the loop calls any other handler (the
    /// `_then` variants call back when it is).
    Pending,
}

/// A one-shot result a blocked caller waits for.
#[derive(Default)]
pub(crate) struct Completion(Mutex<Option<Result<()>>>);

/// What to do when a command is done.
pub(crate) enum Done {
    Nothing,
    Wait(Arc<Completion>),
    Call(Box<dyn FnOnce(Result<()>) + Send>),
}

impl Done {
    /// Reports `r`. A done callback that panics is caught and logged at
    /// error level: it runs while the loop applies a batch of changes or
    /// finishes drains (on the loop's thread, or on a caller's that applies
    /// its own change), and unwinding from there would drop the rest of
    /// the batch (changes never applied, their callers waiting for good)
    /// and leave the loop's state marked as held by that thread.
    pub(crate) fn finish(self, sh: &Shared, r: Result<()>) {
        match self {
            Done::Nothing => {
                if let Err(e) = r {
                    log::warn!(target: "rdmasafe", "CQ loop: a change requested from a handler failed: {e}");
                }
            }
            Done::Wait(c) => {
                *c.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                sh.notify();
            }
            Done::Call(f) => call_caught(f, r),
        }
    }
}

/// Calls a done callback with `r`; a panic in it is caught and logged at
/// error level (see [`Done::finish`]; the loop's drop too calls the
/// callbacks of the drains still in progress, which must not unwind out
/// of it).
pub(crate) fn call_caught(f: Box<dyn FnOnce(Result<()>) + Send>, r: Result<()>) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r))) {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string payload".into());
        log::error!(target: "rdmasafe", "CQ loop: a change's done callback panicked ({what}); caught, the loop goes on");
    }
}

/// A change to the loop, applied by whoever holds its state.
pub(crate) enum Cmd {
    AddCq {
        cq: LiveCq,
        opts: CqOptions,
        handler: Handler,
    },
    RemoveCq {
        cq: usize,
        done: Done,
    },
    /// `send_cq`/`cqs` are read when the call is made: the QP itself is
    /// touched only once its CQs are found in the loop.
    AddKeepalive {
        qp: LiveQp,
        reg: Registration,
        send_cq: usize,
        cfg: Keepalive,
        on_dead: DeadPeer,
    },
    RemoveKeepalive {
        reg: Registration,
        done: Done,
    },
    Drain {
        qp: LiveQp,
        cqs: (usize, usize),
        srq: bool,
        timeout: Duration,
        done: Done,
    },
}

/// What the loop shares between the thread that drives it and every
/// other thread.
pub(crate) struct Shared {
    pub(crate) id: u64,
    /// The channel's address and its device context's, fixed for the
    /// loop's life (to check CQs without taking the state).
    chan: (usize, usize),
    pub(crate) opts: LoopOptions,
    /// False once the `CqLoop` is dropped: changes fail with EINVAL.
    pub(crate) alive: AtomicBool,
    pub(crate) core: Mutex<Core>,
    /// Someone runs the loop (`run`, `process_once`, ...: as opposed to a
    /// brief apply or a drive), or it is closed (`CqLoop::try_close`: no
    /// run may start any more).
    pub(crate) run_state: super::run_state::RunState,
    /// Threads waiting in `enter` for the state while a blocking change
    /// drives the loop: that drive hands the loop over after its current
    /// cycle (they run it; the change waits for them).
    pub(crate) wanted: AtomicU32,
    /// `sys::thread_tag` of the thread holding `core`, 0 if none.
    pub(crate) owner: AtomicU64,
    /// `sys::thread_tag` of the thread that last polled an async run of
    /// this loop while that run is alive (before its first poll: the thread
    /// that spawned its task if it is likely to poll it, else
    /// [`NOT_POLLED_YET`]: see `aio::first_driver`),
    /// 0 if none: a blocking change from another thread then waits for
    /// that run to apply and finish it, instead of driving the loop
    /// (running handlers) itself, while the run shows life (see
    /// `DRIVER_GRACE`).
    pub(crate) driver: AtomicU64,
    cmds: Mutex<VecDeque<Cmd>>,
    pub(crate) cmds_pending: AtomicBool,
    changed: Condvar,
    pub(crate) stop: AtomicBool,
    pub(crate) wake: WakeFd,
    pub(crate) wake_set: AtomicBool,
    pub(crate) epoll: Epoll,
    pub(crate) timer: TimerFd,
    pub(crate) counters: Counters,
    pub(crate) outstanding: AtomicU64,
    pub(crate) in_handler: AtomicBool,
    /// The keepalives as the callers see them, so add and remove answer
    /// EBUSY / ENOENT at once.
    keepalives: Mutex<Registrations>,
}

/// `Shared::driver` of a spawned run that no thread has polled yet, whose
/// runtime's threads are not the spawner's: no thread's tag (tags are odd),
/// so that every thread's blocking change waits for the run.
#[cfg(feature = "tokio")]
pub(crate) const NOT_POLLED_YET: u64 = 2;

/// How long a blocking change waits for an async run (or a thread waiting
/// to run the loop) that shows no sign of life before it drives the loop
/// itself. A live run cycles at least every 100 ms while a drain is in
/// progress (the drain's own looks for its markers); the rest is room for
/// a busy machine.
const DRIVER_GRACE: Duration = Duration::from_secs(2);

/// Epoll keys of the loop's fds.
pub(crate) const KEY_CHANNEL: u64 = 0;
pub(crate) const KEY_WAKE: u64 = 1;
pub(crate) const KEY_TIMER: u64 = 2;

impl Shared {
    pub(crate) fn new(id: u64, core: Core, channel_fd: i32, chan: (usize, usize), opts: LoopOptions) -> Result<Shared> {
        let io = |op: &'static str| move |e: std::io::Error| Error::new(op, e.raw_os_error().unwrap_or(libc::EIO));
        let wake = WakeFd::new().map_err(io("eventfd"))?;
        let epoll = Epoll::new().map_err(io("epoll_create1"))?;
        let timer = TimerFd::new().map_err(io("timerfd_create"))?;
        epoll.add(channel_fd, KEY_CHANNEL).map_err(io("epoll_ctl"))?;
        epoll.add(wake.fd(), KEY_WAKE).map_err(io("epoll_ctl"))?;
        epoll.add(timer.fd(), KEY_TIMER).map_err(io("epoll_ctl"))?;
        Ok(Shared {
            id,
            chan,
            opts,
            alive: AtomicBool::new(true),
            core: Mutex::new(core),
            run_state: super::run_state::RunState::new(),
            wanted: AtomicU32::new(0),
            owner: AtomicU64::new(0),
            driver: AtomicU64::new(0),
            cmds: Mutex::new(VecDeque::new()),
            cmds_pending: AtomicBool::new(false),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            wake,
            wake_set: AtomicBool::new(false),
            epoll,
            timer,
            counters: Counters::default(),
            outstanding: AtomicU64::new(0),
            in_handler: AtomicBool::new(false),
            keepalives: Mutex::new(Registrations::default()),
        })
    }

    /// An async run of this loop is (about to be) polled on the calling
    /// thread (`true`), or has ended (`false`): see `driver`. Its end wakes
    /// the blocking changes that waited for it (they drive the loop
    /// themselves from then on).
    #[cfg(feature = "tokio")]
    pub(crate) fn set_driver(&self, polling: bool) {
        self.set_driver_tag(if polling { sys::thread_tag() } else { 0 });
    }

    /// `driver` set to `tag` (0: the run ended, which wakes the blocking
    /// changes that waited for it).
    #[cfg(feature = "tokio")]
    pub(crate) fn set_driver_tag(&self, tag: u64) {
        if self.driver.swap(tag, SeqCst) != tag && tag == 0 {
            self.notify();
        }
    }

    /// Grows with every cycle of the loop (its wakeups and sleeps), for a
    /// caller that waits for somebody else to run it.
    fn progress(&self) -> u64 {
        self.counters.wakeups.load(Relaxed).wrapping_add(self.counters.sleeps.load(Relaxed))
    }

    /// Makes the loop's fd readable (async-signal-safe: an atomic swap and
    /// at most one write).
    pub(crate) fn wake(&self) {
        if !self.wake_set.swap(true, SeqCst) {
            self.wake.wake();
        }
    }

    /// Wakes the callers waiting for a command or for the state.
    pub(crate) fn notify(&self) {
        let _q = self.cmds.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }

    pub(crate) fn take_cmds(&self) -> VecDeque<Cmd> {
        let mut q = self.cmds.lock().unwrap_or_else(|e| e.into_inner());
        self.cmds_pending.store(false, SeqCst);
        std::mem::take(&mut *q)
    }

    fn push(&self, cmd: Cmd) {
        let mut q = self.cmds.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(cmd);
        self.cmds_pending.store(true, SeqCst);
    }

    /// True if the calling thread holds the state (it is inside a handler,
    /// or applying commands).
    pub(crate) fn held_here(&self) -> bool {
        self.owner.load(SeqCst) == sys::thread_tag()
    }

    /// Keepalives that ended in the loop by themselves (see
    /// [`Registrations::forget`]).
    pub(crate) fn forget_keepalives(&self, gone: &[Registration]) {
        self.keepalives.lock().unwrap_or_else(|e| e.into_inner()).forget(gone);
    }
}

/// The loop's state, held: applies queued commands on release, and looks
/// again afterwards, so no command is ever left behind.
pub(crate) struct Held<'a> {
    sh: &'a Shared,
    guard: Option<MutexGuard<'a, Core>>,
    ctl: LoopControl,
    /// Held by a runner (`CqLoop::enter`): the run state goes back to idle
    /// on release, also when a handler's panic unwinds through the loop.
    runner: bool,
}

impl<'a> Held<'a> {
    pub(crate) fn new(sh: &'a Shared, guard: MutexGuard<'a, Core>, ctl: LoopControl) -> Held<'a> {
        sh.owner.store(sys::thread_tag(), SeqCst);
        Held { sh, guard: Some(guard), ctl, runner: false }
    }

    /// Marks this hold as the one of a runner (see `runner`).
    pub(crate) fn into_runner(mut self) -> Held<'a> {
        self.runner = true;
        self
    }

    /// The state and the control, for a cycle.
    pub(crate) fn parts(&mut self) -> (&mut Core, &LoopControl) {
        (self.guard.as_mut().expect("held until dropped"), &self.ctl)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let sh = self.sh;
        if self.runner {
            sh.run_state.release();
        }
        loop {
            if let Some(mut g) = self.guard.take() {
                g.apply_cmds(&self.ctl);
                if g.unsettled {
                    // A cycle ended early (an error, a handler's panic):
                    // the next one arms and drains every CQ, and an app
                    // that waits on the loop's fd must be woken for it.
                    g.settle();
                    sh.wake();
                }
                sh.owner.store(0, SeqCst);
                drop(g);
                // A panic unwinding through the loop (a handler's) poisons
                // the state's mutex, and the loop is consistent after it
                // (see `Core::settle`): clear it, or every `try_lock` from
                // now on (`next_timeout`, a blocking change's driver, a
                // command's submit) would find the state taken for good.
                sh.core.clear_poison();
            }
            sh.notify();
            // A command queued after our last look and before the unlock
            // would wait for a holder that is gone: look again.
            if !sh.cmds_pending.load(SeqCst) {
                return;
            }
            match sh.core.try_lock() {
                Ok(g) => {
                    sh.owner.store(sys::thread_tag(), SeqCst);
                    self.guard = Some(g);
                }
                // Someone else holds it now and will apply it.
                Err(_) => return,
            }
        }
    }
}

/// A handle to a loop usable from any thread, and from inside its
/// handlers: stop it, change its CQs and keepalives, drain QPs, read its
/// figures. Cloning is cheap.
#[derive(Clone)]
pub struct LoopControl(pub(crate) Arc<Shared>);

impl LoopControl {
    /// Asks the loop to stop: `run` returns after the current batch, with
    /// every pending ack flushed. Thread-safe, never blocks, and
    /// async-signal-safe (an atomic store and one write(2); errno kept).
    pub fn stop(&self) {
        self.0.stop.store(true, SeqCst);
        self.0.wake();
    }

    /// Tells the watchdog how much work the app has outstanding (0: none).
    /// From none to some, it wakes the loop (its fd turns readable), so a
    /// loop asleep without a deadline starts its watchdog.
    pub fn set_outstanding(&self, n: u64) {
        if self.0.outstanding.swap(n, SeqCst) == 0 && n > 0 {
            self.0.wake();
        }
    }

    /// The loop's figures now.
    pub fn stats(&self) -> LoopStats {
        self.0.counters.snapshot()
    }

    /// True while one of this loop's handlers is running (on any thread).
    pub fn in_handler(&self) -> bool {
        self.0.in_handler.load(Acquire)
    }

    /// True while a thread runs the loop (`run`, `run_for`,
    /// `process_once`, `process_ready`, `flush_acks`), or waits for its
    /// state to run it (while a blocking change from another thread hands
    /// it over), and while an async run future of it is alive
    /// (`AsyncCqLoop::run`, tokio feature: from its first poll to its end).
    pub fn is_running(&self) -> bool {
        self.0.run_state.is_running()
    }

    /// True if the calling thread is the one driving the loop right now
    /// (it is inside one of the loop's handlers): changes requested here
    /// are [`Outcome::Pending`].
    pub fn on_loop_thread(&self) -> bool {
        self.0.held_here()
    }

    /// Adds a CQ (kept alive by the loop) with its handler and options. The
    /// loop arms it and drains what it already holds before its next sleep.
    /// Never waits for the loop: from another thread while the loop runs
    /// it returns once the add is queued (see [`Outcome::Done`]).
    /// Errors at once: EINVAL (CQ of another channel or device context),
    /// EBUSY (the CQ is in a loop already).
    pub fn add_cq<F>(&self, cq: &Cq, opts: CqOptions, handler: F) -> Result<Outcome>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        self.add_live(LiveCq::owned(cq), opts, Box::new(handler))
    }

    /// Like [`LoopControl::add_cq`] for a CQ the app owns (the C API).
    ///
    /// # Safety
    /// `cq` must be a live CQ that stays alive until it is removed from the
    /// loop (the removal has completed) or the loop is dropped.
    pub unsafe fn add_raw_cq(&self, cq: NonNull<ibv_cq>, opts: CqOptions, handler: Handler) -> Result<Outcome> {
        // SAFETY: forwarded contract.
        self.add_live(unsafe { LiveCq::borrowed(cq) }, opts, handler)
    }

    fn add_live(&self, cq: LiveCq, opts: CqOptions, handler: Handler) -> Result<Outcome> {
        let (cq_chan, cq_ctx) = cq.channel_and_context();
        let (chan, ctx) = self.0.chan;
        if cq_ctx as usize != ctx {
            return Err(Error::new("rdmasafe_cq_loop_add_cq: CQ of another device context", libc::EINVAL));
        }
        if cq_chan as usize != chan {
            return Err(Error::new("rdmasafe_cq_loop_add_cq: CQ not bound to this loop's channel", libc::EINVAL));
        }
        registry::claim_cq(cq.addr(), self.0.id)
            .map_err(|_| Error::new("rdmasafe_cq_loop_add_cq: CQ already in a loop", libc::EBUSY))?;
        let addr = cq.addr();
        let r = self.submit(Cmd::AddCq { cq, opts, handler }, None);
        if r.is_err() {
            // The loop is gone (its drop released its claims before this one).
            registry::release_cq(addr, self.0.id);
        }
        r
    }

    /// Removes a CQ: its pending acks are flushed, the events already
    /// queued for it are read and acked, and its handler is dropped (never
    /// called again). From another thread this waits for the loop's current
    /// cycle (with a live async run: for the run to apply it, or 2 s
    /// without a sign of life) and returns `Done`: `ibv_destroy_cq` may
    /// follow at once (destroy
    /// the QPs that use it first, so no completion raises a new event). From
    /// inside a handler it returns `Pending` (see [`Outcome`]). Keepalives
    /// probing through the CQ stop and are removed (a later
    /// [`LoopControl::remove_keepalive`] of their QP is ENOENT, and adding
    /// the CQ back restores none: add them again); drains using it end with
    /// ECANCELED.
    /// ENOENT if the CQ is not in this loop. The CQ stays in the loop until
    /// its removal is done: a second removal asked meanwhile is accepted
    /// and finds it gone (from a handler: `Pending`, the failure logged as
    /// a warning; from another thread: ENOENT once the first is done; by
    /// [`LoopControl::remove_raw_cq_then`]: `done` with ENOENT).
    pub fn remove_cq(&self, cq: &Cq) -> Result<Outcome> {
        self.remove_raw_cq(cq.raw())
    }

    /// [`LoopControl::remove_cq`] by address (the C API).
    pub fn remove_raw_cq(&self, cq: *mut ibv_cq) -> Result<Outcome> {
        self.check_cq(cq)?;
        let c = Arc::new(Completion::default());
        self.submit(Cmd::RemoveCq { cq: cq as usize, done: self.waiter(&c) }, Some(c))
    }

    /// Removes a CQ without ever blocking; `done` is called (on the loop's
    /// thread, or on the caller's if the loop is idle) once the removal is
    /// complete, with the CQ's acks flushed: `ibv_destroy_cq` may be called
    /// from `done`. Once this returns `Ok`, `done` is called exactly once:
    /// with ECANCELED if the loop is dropped first (on the dropping thread,
    /// or, when the drop raced with this call, on whichever thread held the
    /// loop last: this caller's or another caller's). A panic in `done`
    /// (here and in the other `_then` calls) is caught and logged at error
    /// level; the loop's other changes go on.
    pub fn remove_raw_cq_then(&self, cq: *mut ibv_cq, done: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        self.check_cq(cq)?;
        self.submit_async(Cmd::RemoveCq { cq: cq as usize, done: Done::Call(done) })
    }

    fn check_cq(&self, cq: *mut ibv_cq) -> Result<()> {
        if registry::cq_in(cq as usize, self.0.id) {
            Ok(())
        } else {
            Err(Error::new("rdmasafe_cq_loop_remove_cq: CQ not in this loop", libc::ENOENT))
        }
    }

    /// Registers dead-peer detection for `qp`, an RC QP whose send CQ is in
    /// this loop. While the loop runs, when the QP has had no successful
    /// completion for `cfg.period`, rdmasafe posts a probe: a signaled
    /// zero-length RDMA WRITE (no rkey is checked for zero length; the
    /// peer's application sees nothing). A probe that has not completed
    /// within `cfg.bound` means the peer is dead: rdmasafe drains the QP
    /// (as [`LoopControl::drain_qp`] does, with nobody waiting: the error
    /// state, and markers the loop also polls for, so everything
    /// outstanding flushes to the handler even where the flush raises no
    /// event, as on a send CQ armed [`CqOptions::solicited_only`]; the
    /// receive queue gets a marker only when its CQ is in this loop and
    /// the QP has no SRQ; the markers' wr_ids then belong to the loop on
    /// that QP, as after `drain_qp`), then calls `on_dead` once (a panic in
    /// it goes on to whoever runs the loop, as a handler's does, after the
    /// other peers found dead at the same time had theirs; a keepalive
    /// removed before its `on_dead` runs, by an earlier one of those, say,
    /// gets none, as any removed keepalive, and one added again on a QP
    /// already drained for a dead peer finds it in the error state and
    /// only ends the probing, as below). A timer
    /// decides, not the retry count, so this works whatever `retry_cnt` the
    /// QP has (with 7, rxe retries
    /// forever and reports nothing). A probe that fails with an error status
    /// (e.g. retry exceeded) declares the peer dead at once; a full send
    /// queue (ENOMEM) delays the probe, up to the bound. A QP that is not
    /// connected yet (RESET, INIT, RTR: a keepalive added at
    /// CONNECT_REQUEST, before the accept) is probed once it is in RTS, and
    /// a probe posted before the QP's first success has a bound of at least
    /// twice the QP's ack timeout, also when another request succeeds while
    /// it is out (the peer's QP may drop it, not ready yet). A QP moved
    /// to the error state by something else (a drain, the app's disconnect,
    /// another request's error, each reported by its own completion or
    /// event) ends the probing: a flushed probe, or one the QP refuses in
    /// that state, is not a dead peer; a request of the QP that fails with
    /// retry exceeded (the peer unreachable) is one.
    ///
    /// Errors: EINVAL (zero period or bound, not an RC QP, send CQ not in
    /// this loop), EBUSY (the QP already has a keepalive).
    ///
    /// # Safety
    /// `qp` must be live until [`LoopControl::remove_keepalive`] (or the
    /// removal of its send CQ, or the loop's drop) has completed.
    pub unsafe fn add_keepalive(&self, qp: NonNull<ibv_qp>, cfg: Keepalive, on_dead: DeadPeer) -> Result<Outcome> {
        // SAFETY: live QP (caller).
        self.add_keepalive_live(unsafe { LiveQp::new(qp) }, cfg, on_dead)
    }

    /// [`LoopControl::add_keepalive`] for the QP a [`CmId`] owns: safe,
    /// since the id tells the loop when it destroys the QP (the keepalive
    /// then ends by itself within about a period, `on_dead` dropped, also
    /// after a drain or after the peer was declared dead;
    /// [`LoopControl::remove_keepalive`] first is still the tidy order).
    /// EINVAL if the id has no QP.
    pub fn add_keepalive_id(&self, id: &CmId, cfg: Keepalive, on_dead: DeadPeer) -> Result<Outcome> {
        let qp = id.live_qp().ok_or(Error::new("rdmasafe keepalive: the id has no QP", libc::EINVAL))?;
        self.add_keepalive_live(qp, cfg, on_dead)
    }

    fn add_keepalive_live(&self, qp: LiveQp, cfg: Keepalive, on_dead: DeadPeer) -> Result<Outcome> {
        if cfg.period.is_zero() || cfg.bound.is_zero() {
            return Err(Error::new("rdmasafe keepalive: zero period or bound", libc::EINVAL));
        }
        let (qpn, send_cq, _) = qp.info()?;
        if !qp.is_rc()? {
            // Its probe (an RDMA WRITE) would fail at once: a dead peer.
            return Err(Error::new("rdmasafe keepalive: the QP is not RC", libc::EINVAL));
        }
        if !registry::cq_in(send_cq, self.0.id) {
            return Err(Error::new("rdmasafe keepalive: the QP's send CQ is not in this loop", libc::EINVAL));
        }
        let queued = change_keepalives(
            &self.0.keepalives,
            |k| k.register(qpn),
            |reg| Cmd::AddKeepalive { qp, reg, send_cq, cfg, on_dead },
            |cmd| self.enqueue(cmd),
            |k, reg| k.forget(&[reg]),
        )?;
        if !queued {
            return Err(Error::new("rdmasafe keepalive: QP already registered", libc::EBUSY));
        }
        self.see_applied(None)
    }

    /// Stops dead-peer detection for the QP with this number (ENOENT if it
    /// had none, or its send CQ was removed, which removed it). A probe
    /// still outstanding is consumed when it completes, also after its send
    /// CQ left the loop and joined this or another loop again (kept by CQ
    /// address, as drain markers are).
    pub fn remove_keepalive(&self, qp_num: u32) -> Result<Outcome> {
        let c = Arc::new(Completion::default());
        let done = self.waiter(&c);
        self.remove_keepalive_queued(qp_num, done)?;
        self.see_applied(Some(c))
    }

    /// [`LoopControl::remove_keepalive`] that never blocks: `done` gets the
    /// result once the loop applied the removal, on the thread that runs
    /// the loop (or on the caller's when nobody does). ENOENT at once (and
    /// `done` dropped) if the QP had no keepalive. A panic in `done` is
    /// caught and logged.
    pub fn remove_keepalive_then(&self, qp_num: u32, done: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        self.remove_keepalive_queued(qp_num, Done::Call(done))?;
        self.see_applied(None).map(|_| ())
    }

    /// Unregisters `qp_num` and queues its removal (`done` dropped if it
    /// had no keepalive: ENOENT).
    fn remove_keepalive_queued(&self, qp_num: u32, done: Done) -> Result<()> {
        let queued = change_keepalives(
            &self.0.keepalives,
            |k| k.unregister(qp_num),
            |reg| Cmd::RemoveKeepalive { reg, done },
            |cmd| self.enqueue(cmd),
            // The loop is gone, and its keepalives with it.
            |_, _| {},
        )?;
        if !queued {
            return Err(Error::new("rdmasafe keepalive", libc::ENOENT));
        }
        Ok(())
    }

    /// Drains a QP before teardown, like the kernel's `ib_drain_qp`: moves
    /// it to the error state, posts a marker on its send queue
    /// ([`super::DRAIN_SEND_WR_ID`]) and, unless `srq`, on its receive queue
    /// ([`super::DRAIN_RECV_WR_ID`]), and the loop delivers everything until
    /// both markers come back. The markers are the loop's: they never
    /// reach a handler. Flush completions are in order per queue, so when
    /// the drain is done every request posted before it has completed, and
    /// every CQ event the loop read is acked. A keepalive of the QP stays
    /// registered but probes no more; a probe flushed by the drain is not a
    /// dead peer.
    ///
    /// A drain that ends without its markers (ETIMEDOUT, ECANCELED) leaves
    /// them to the loop: they are consumed whenever they come back, also
    /// after their CQ left the loop and joined it or another loop again
    /// (kept by CQ address, at most 1024 markers). So on a QP that was
    /// drained, the wr_ids [`super::DRAIN_SEND_WR_ID`] and
    /// [`super::DRAIN_RECV_WR_ID`] belong to the loop. A drain retried
    /// after a timeout is done only once its own markers are back (a
    /// queue completes in order: the old drain's come first).
    ///
    /// From another thread this waits (running the loop itself if nobody
    /// does; a live `aio::AsyncCqLoop::run` (feature `tokio`) on another thread
    /// counts as somebody while it cycles: the wait is for it, and it
    /// enforces `timeout`) until done or `timeout` (ETIMEDOUT). From inside
    /// a handler it
    /// starts the drain and returns `Pending`: use
    /// [`LoopControl::drain_qp_then`] to learn when it is done. EINVAL if
    /// the QP's CQs are not in this loop.
    ///
    /// # Safety
    /// `qp` must be a live QP with a free slot on each queue, alive until
    /// the drain is done.
    pub unsafe fn drain_qp(&self, qp: NonNull<ibv_qp>, srq: bool, timeout: Duration) -> Result<Outcome> {
        // SAFETY: live QP (caller).
        self.drain_live(unsafe { LiveQp::new(qp) }, srq, timeout)
    }

    /// [`LoopControl::drain_qp`] for the QP a [`CmId`] owns (no SRQ): safe,
    /// the id's QP is used only while it exists (a drain whose id is
    /// dropped meanwhile ends at its timeout). EINVAL if the id has no QP.
    pub fn drain_id(&self, id: &CmId, timeout: Duration) -> Result<Outcome> {
        let qp = id.live_qp().ok_or(Error::new("rdmasafe drain: the id has no QP", libc::EINVAL))?;
        self.drain_live(qp, false, timeout)
    }

    /// [`LoopControl::drain_qp_then`] for the QP a [`CmId`] owns.
    pub fn drain_id_then(&self, id: &CmId, timeout: Duration, done: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        let qp = id.live_qp().ok_or(Error::new("rdmasafe drain: the id has no QP", libc::EINVAL))?;
        let (qp, cqs) = self.drain_checked(qp, false)?;
        self.submit_async(Cmd::Drain { qp, cqs, srq: false, timeout, done: Done::Call(done) })
    }

    fn drain_live(&self, qp: LiveQp, srq: bool, timeout: Duration) -> Result<Outcome> {
        let (qp, cqs) = self.drain_checked(qp, srq)?;
        let c = Arc::new(Completion::default());
        self.submit(Cmd::Drain { qp, cqs, srq, timeout, done: self.waiter(&c) }, Some(c))
    }

    /// Starts a drain (see [`LoopControl::drain_qp`]) and never blocks:
    /// `done` gets its result, on the thread that runs the loop (or on
    /// the caller's when it finishes at once). ECANCELED if a CQ of the QP
    /// leaves the loop during the drain, or if the loop is dropped first:
    /// then `done` runs on the dropping thread, before the drop returns
    /// (or, when the drop raced with this call, on whichever thread held
    /// the loop last). A panic in `done` is caught and logged.
    ///
    /// # Safety
    /// As for [`LoopControl::drain_qp`], until `done` is called.
    pub unsafe fn drain_qp_then(
        &self,
        qp: NonNull<ibv_qp>,
        srq: bool,
        timeout: Duration,
        done: Box<dyn FnOnce(Result<()>) + Send>,
    ) -> Result<()> {
        // SAFETY: live QP (caller).
        let (qp, cqs) = self.drain_checked(unsafe { LiveQp::new(qp) }, srq)?;
        self.submit_async(Cmd::Drain { qp, cqs, srq, timeout, done: Done::Call(done) })
    }

    fn drain_checked(&self, qp: LiveQp, srq: bool) -> Result<(LiveQp, (usize, usize))> {
        let (_, send_cq, recv_cq) = qp.info()?;
        let ours = |cq| registry::cq_in(cq, self.0.id);
        if !ours(send_cq) || (!srq && !ours(recv_cq)) {
            return Err(Error::new("rdmasafe drain_qp: QP's CQs not in this loop", libc::EINVAL));
        }
        Ok((qp, (send_cq, recv_cq)))
    }

    /// The options [`super::CqLoop::add_cq`] gives a CQ added without its
    /// own (the loop's defaults), for [`LoopControl::add_cq`].
    pub fn default_cq_options(&self) -> CqOptions {
        self.0.opts.cq_defaults()
    }

    /// The options a CQ added without its own gets.
    pub(crate) fn cq_defaults(&self) -> CqOptions {
        self.0.opts.cq_defaults()
    }

    /// How long an app embedding the loop in its own epoll may sleep before
    /// calling `process_once` again even if the loop's fd stays quiet:
    /// `Some(ZERO)` while the loop has work right now (an adaptive loop
    /// still spinning, a CQ over its budget, a CQ just added), the time to
    /// its next keepalive / watchdog / drain deadline, `None` if none. The
    /// fd itself also becomes readable at those deadlines (a timerfd).
    pub fn next_timeout(&self) -> Option<Duration> {
        match self.0.core.try_lock() {
            Ok(c) => {
                let t = c.next_timeout(&self.0);
                drop(c);
                // A change queued meanwhile by a caller that found the state
                // taken (by us) relies on the holder: apply it, as Held does.
                // Passing through the queue's lock orders this look after
                // such a push (as Held's notify does).
                drop(self.0.cmds.lock().unwrap_or_else(|e| e.into_inner()));
                if self.0.cmds_pending.load(SeqCst) {
                    if let Ok(g) = self.0.core.try_lock() {
                        drop(Held::new(&self.0, g, self.clone()));
                    }
                }
                t
            }
            // Being driven right now: call again soon.
            Err(_) => Some(Duration::ZERO),
        }
    }

    fn waiter(&self, c: &Arc<Completion>) -> Done {
        if self.0.held_here() {
            Done::Nothing
        } else {
            Done::Wait(c.clone())
        }
    }

    fn submit_async(&self, cmd: Cmd) -> Result<()> {
        self.submit(cmd, None).map(|_| ())
    }

    /// Queues `cmd`; unless called from inside a handler, makes sure it is
    /// applied (and, with `wait`, done) before returning.
    fn submit(&self, cmd: Cmd, wait: Option<Arc<Completion>>) -> Result<Outcome> {
        if let Some(refused) = self.enqueue(cmd) {
            drop(refused);
            return Err(loop_gone());
        }
        self.see_applied(wait)
    }

    /// Queues `cmd`, or gives it back if the loop is gone.
    fn enqueue(&self, cmd: Cmd) -> Option<Cmd> {
        if !self.0.alive.load(SeqCst) {
            return Some(cmd);
        }
        self.0.push(cmd);
        None
    }

    /// After a command was queued: unless called from inside a handler,
    /// makes sure it is applied (and, with `wait`, done) before returning.
    fn see_applied(&self, wait: Option<Arc<Completion>>) -> Result<Outcome> {
        let sh = &*self.0;
        if sh.held_here() {
            return Ok(Outcome::Pending);
        }
        sh.wake();
        let Some(wait) = wait else {
            // Nothing to wait for: apply at once if nobody drives the loop
            // (else whoever does applies it before its next sleep).
            if let Ok(g) = sh.core.try_lock() {
                drop(Held::new(sh, g, self.clone()));
            }
            return Ok(Outcome::Done);
        };
        let mut q = sh.cmds.lock().unwrap_or_else(|e| e.into_inner());
        // The other side's last sign of life (its cycles), and since when.
        let mut progress = (sh.progress(), std::time::Instant::now());
        loop {
            let done = wait.0.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(r) = done {
                return r.map(|_| Outcome::Done);
            }
            let driver = sh.driver.load(SeqCst);
            let other = (driver != 0 && driver != sys::thread_tag()) || sh.wanted.load(SeqCst) > 0;
            if other {
                // An async run drives the loop on its runtime's thread,
                // which is woken (above), or a thread waits to run it (a
                // non-blocking process_once must not wait for this drain):
                // it applies the change and runs the handlers; its release
                // or end (or the loop's) wakes us. Only while it shows life:
                // a run future alive but not polled (its runtime idle, its
                // task blocked, in this very call perhaps) would be waited
                // for forever. After a grace period without a cycle, this
                // caller drives the loop itself, as when nobody runs it.
                let now = sh.progress();
                if now != progress.0 {
                    progress = (now, std::time::Instant::now());
                }
                if progress.1.elapsed() < DRIVER_GRACE {
                    q = sh.changed.wait_timeout(q, DRIVER_GRACE / 4).unwrap_or_else(|e| e.into_inner()).0;
                    continue;
                }
            }
            match sh.core.try_lock() {
                Ok(g) => {
                    drop(q);
                    // Nobody drives the loop (or whoever should showed no
                    // life for the grace period): apply (and drive, for a
                    // drain) here, then let go through Held (which looks
                    // again).
                    if other {
                        sh.counters.grace_takeovers.bump(1);
                    }
                    let mut held = Held::new(sh, g, self.clone());
                    let (core, ctl) = held.parts();
                    if core.shut {
                        // The loop was dropped after this call queued its
                        // change: nothing will ever apply it.
                        drop(held);
                        return Err(Error::new("rdmasafe CQ loop: the loop is gone", libc::ECANCELED));
                    }
                    core.apply_cmds(ctl);
                    core.drive_until(ctl, &wait);
                    drop(held);
                    q = sh.cmds.lock().unwrap_or_else(|e| e.into_inner());
                    progress = (sh.progress(), std::time::Instant::now());
                }
                // A holder that lets go notifies; bounded all the same, so
                // that no missed wakeup can hang a caller.
                Err(_) => {
                    q = sh.changed.wait_timeout(q, DRIVER_GRACE / 4).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }
}

/// EINVAL: the loop is gone.
fn loop_gone() -> Error {
    Error::new("rdmasafe CQ loop: the loop is gone", libc::EINVAL)
}

/// A change of the keepalive registrations (`change`: the registration
/// added or removed, `None` if the number is taken or not registered) and
/// the loop's command for it (`cmd`), queued (`queue`) before their lock is
/// let go: the loop applies one number's adds and removes in the order
/// they were made. (Queued after letting go, two threads' remove and add
/// of one QP could reach the loop in the other order: it then ran on with
/// a keepalive the app had removed, or lost one it had added.) Ok(false) if
/// `change` found nothing to do; EINVAL if the loop is gone (`queue` gave
/// the command back: `undo` puts the registrations back). Nothing of the
/// app's (a callback in the command) is dropped while the lock is held: its
/// drop may call in again.
fn change_keepalives(
    regs: &Mutex<Registrations>,
    change: impl FnOnce(&mut Registrations) -> Option<Registration>,
    cmd: impl FnOnce(Registration) -> Cmd,
    queue: impl FnOnce(Cmd) -> Option<Cmd>,
    undo: impl FnOnce(&mut Registrations, Registration),
) -> Result<bool> {
    let refused = {
        let mut k = regs.lock().unwrap_or_else(|e| e.into_inner());
        // Returning here drops the lock before `cmd` (a parameter).
        let Some(reg) = change(&mut k) else { return Ok(false) };
        let refused = queue(cmd(reg));
        if refused.is_some() {
            undo(&mut k, reg);
        }
        refused
    };
    match refused {
        None => Ok(true),
        Some(cmd) => {
            drop(cmd);
            Err(loop_gone())
        }
    }
}

impl Completion {
    /// Records the result (the waiter is woken by `Shared::notify`).
    pub(crate) fn set(&self, r: Result<()>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    }

    pub(crate) fn is_done(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keepalive change's command is queued while the registrations are
    /// still held, so the loop gets one QP's adds and removes in the order
    /// they were made (found by a review: queued after letting go, a remove
    /// and an add from two threads reached the loop in the other order,
    /// and it kept a keepalive the app had removed, or lost one it had
    /// added); and a change the loop refuses (it is gone) is undone.
    #[test]
    fn a_keepalive_change_is_queued_before_the_registrations_are_let_go() {
        let regs = Mutex::new(Registrations::default());
        let remove = |reg| Cmd::RemoveKeepalive { reg, done: Done::Nothing };
        let mut queued = Vec::new();
        let mut held_while_queued = Vec::new();
        let r = change_keepalives(
            &regs,
            |k| k.register(5),
            remove,
            |cmd| {
                held_while_queued.push(regs.try_lock().is_err());
                queued.push(cmd);
                None
            },
            |_, _| panic!("nothing to undo"),
        );
        assert_eq!(r.map_err(|e| e.errno()), Ok(true));
        assert_eq!(held_while_queued, [true], "queued while the registrations are held");
        assert_eq!(queued.len(), 1);
        let r = change_keepalives(&regs, |k| k.register(5), remove, |_| panic!("not queued"), |_, _| {});
        assert_eq!(r.map_err(|e| e.errno()), Ok(false), "the number is taken: nothing queued");
        // The loop is gone: the command comes back, the change is undone.
        let r = change_keepalives(&regs, |k| k.register(6), remove, Some, |k, reg| k.forget(&[reg]));
        assert_eq!(r.map_err(|e| e.errno()), Err(libc::EINVAL));
        assert!(regs.lock().unwrap().register(6).is_some(), "the refused add was undone");
    }
}
