//! The CQ notification loop: [`CqLoop`], and its state and cycle
//! ([`Core`]).
//!
//! One loop serves one completion channel and any number of CQs bound to
//! it, each with its own handler and options. The cycle in event mode:
//!
//! 1. apply queued changes (CQs added or removed, keepalives, drains);
//! 2. arm each CQ that is new (or was stopped), then drain it (arming
//!    reports nothing about completions that came before it); drain each CQ
//!    that used up its budget last cycle;
//! 3. if that delivered nothing: sleep in `epoll_wait` on the loop's own
//!    epoll fd (the channel, a wake eventfd, a timerfd for deadlines), or,
//!    while recent cycles found their event already in the channel, read
//!    the channel first and sleep only if it is empty (an event already
//!    pending then costs one `read()` and no `epoll_wait`, as in a
//!    hand-written loop; see `LoopStats::sleeps`, `channel_reads_empty`);
//! 4. read the ready CQ events (the fd is non-blocking; after the first, on
//!    to EAGAIN only while such reads recently found more, so a wakeup of
//!    one CQ among idle ones costs one `read()`; an event left in the
//!    channel is read next cycle), count one pending ack on the CQ the
//!    event *names*, found in O(1);
//! 5. for each CQ that fired: re-arm it, *then* drain it, at most its budget
//!    (re-arming before the final drain closes the window in which a
//!    completion lands after the last empty poll and no event follows);
//! 6. ack in batches, and always everything before stop, removal and drop.
//!
//! Per wakeup the work is proportional to the CQs that fired. Busy-poll
//! mode never arms and never sleeps, polling every CQ; adaptive mode polls
//! every CQ while completions keep coming and for `spin` after the last,
//! then arms them all and sleeps like event mode (reading every event in
//! the channel when it wakes: its spin polls every CQ anyway).
//!
//! Ownership: a CQ must leave the loop (removal done, or the loop dropped)
//! before `ibv_destroy_cq`: that destroy waits for acks only the loop can
//! give, and a loop polling a destroyed CQ reads freed memory.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use super::control::{Held, LoopControl, Shared};
use super::core::Core;
use super::handle::LiveChannel;
use super::options::{CqOptions, LoopOptions};
use super::run_state::Refused;
use super::stats::LoopStats;
use super::{registry, Handler};
use crate::sys::{self, ibv_comp_channel, ibv_cq};
use crate::verbs::{CompChannel, Cq};
use crate::wc::Wc;
use crate::Wait;
use crate::{Error, Result};

/// Why [`CqLoop::run_for`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// A stop was requested (and consumed).
    Stopped,
    /// The time was up.
    TimedOut,
}

/// An async run's claim on its loop ([`CqLoop::claim_run`]): held from
/// the run future's first poll until it ends or is dropped, so that no
/// thread's runner call (`run`, `process_once`, `process_ready`,
/// `flush_acks`) slips in between two of its steps (and none of its steps
/// is refused for one). Dropped, the loop is idle again.
#[cfg(feature = "tokio")]
pub(crate) struct RunClaim<'a>(&'a Shared);

#[cfg(feature = "tokio")]
impl Drop for RunClaim<'_> {
    fn drop(&mut self) {
        self.0.run_state.release();
    }
}

/// What one [`CqLoop::process_ready`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Completions delivered to handlers.
    pub delivered: usize,
    /// A stop request ended the call (consumed; every ack flushed).
    pub stopped: bool,
    /// The loop has more to do right away (work of its own, or its fd is
    /// still readable): call again before waiting for the fd. `false`
    /// means an edge-triggered poller may clear the fd's readiness.
    pub more: bool,
}

/// The loop; see the module docs. Thread-safe: it may be run by one thread
/// at a time ([`CqLoop::run`], [`CqLoop::process_once`], or
/// [`CqLoop::spawn`]; a second runner gets EBUSY) and changed from any
/// thread, and from inside its handlers, through [`LoopControl`].
pub struct CqLoop {
    sh: Arc<Shared>,
    chan_fd: RawFd,
}

impl CqLoop {
    /// A loop on `channel`. The loop puts the channel's fd in non-blocking
    /// mode (restored when the loop is dropped) and from now on is the only
    /// reader of the channel.
    ///
    /// Errors: EINVAL for an option out of its range (see
    /// [`LoopOptions`]), EBUSY if the channel has a loop already, or the
    /// errno of a system call that set the loop up (its epoll, eventfd and
    /// timerfd, `fcntl` of the channel's fd).
    pub fn new(channel: &CompChannel, opts: LoopOptions) -> Result<CqLoop> {
        Self::with_channel(LiveChannel::owned(channel), opts)
    }

    /// A loop on a channel the app owns (the C API).
    ///
    /// # Safety
    /// `chan` must be a live completion channel that outlives the loop.
    pub unsafe fn from_raw(chan: NonNull<ibv_comp_channel>, opts: LoopOptions) -> Result<CqLoop> {
        // SAFETY: forwarded contract.
        Self::with_channel(unsafe { LiveChannel::borrowed(chan) }, opts)
    }

    fn with_channel(chan: LiveChannel, opts: LoopOptions) -> Result<CqLoop> {
        opts.check()?;
        let id = registry::next_loop_id();
        if !registry::claim_channel(chan.addr(), id) {
            return Err(Error::new("rdmasafe_cq_loop_create: the channel already has a loop", libc::EBUSY));
        }
        let (fd, ident) = (chan.fd(), (chan.addr(), chan.context() as usize));
        let built = Core::new(chan, opts).and_then(|core| Shared::new(id, core, fd, ident, opts));
        match built {
            Ok(sh) => Ok(CqLoop { sh: Arc::new(sh), chan_fd: fd }),
            Err(e) => {
                registry::release_channel(ident.0, id);
                Err(e)
            }
        }
    }

    /// The loop's control handle.
    pub fn control(&self) -> LoopControl {
        LoopControl(self.sh.clone())
    }

    /// The loop's figures now.
    pub fn stats(&self) -> LoopStats {
        self.sh.counters.snapshot()
    }

    /// Adds a CQ (kept alive by the loop) with its handler and the loop's
    /// default options; see [`LoopControl::add_cq`].
    pub fn add_cq<F>(&self, cq: &Cq, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        let opts = self.default_cq_options();
        self.control().add_cq(cq, opts, handler).map(|_| ())
    }

    /// Adds a CQ with its own options; see [`LoopControl::add_cq`].
    pub fn add_cq_with<F>(&self, cq: &Cq, opts: CqOptions, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        self.control().add_cq(cq, opts, handler).map(|_| ())
    }

    /// The options a CQ added without its own gets.
    pub fn default_cq_options(&self) -> CqOptions {
        self.sh.opts.cq_defaults()
    }

    /// The options in force.
    pub fn options(&self) -> LoopOptions {
        self.sh.opts
    }

    /// Removes a CQ; see [`LoopControl::remove_cq`].
    pub fn remove_cq(&self, cq: &Cq) -> Result<()> {
        self.control().remove_cq(cq).map(|_| ())
    }

    /// Number of CQs in the loop (changes queued but not applied yet are
    /// not counted).
    pub fn len(&self) -> usize {
        self.sh.counters.cqs.load(Relaxed) as usize
    }

    /// True if the loop has no CQ.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Test hook: called right before the loop sleeps.
    #[doc(hidden)]
    pub fn set_before_sleep_hook(&self, hook: Option<Box<dyn FnMut() + Send>>) {
        self.with_core(|c| c.hook = hook);
    }

    /// Test hook: called when the loop woke for its wake fd, between
    /// consuming the wakeup and clearing its flag.
    #[doc(hidden)]
    pub fn set_woke_hook(&self, hook: Option<Box<dyn FnMut() + Send>>) {
        self.with_core(|c| c.woke_hook = hook);
    }

    /// Runs `f` on the state, waiting for it, and lets go through Held.
    fn with_core(&self, f: impl FnOnce(&mut Core)) {
        let g = self.sh.core.lock().unwrap_or_else(|e| e.into_inner());
        let mut held = Held::new(&self.sh, g, self.control());
        f(held.parts().0);
    }

    /// Takes the state for running: EBUSY if someone runs the loop, a
    /// short wait if a thread is applying a change.
    fn enter(&self) -> Result<Held<'_>> {
        self.claim()?;
        Ok(self.take_state().into_runner())
    }

    /// Claims the loop for an async run's whole life (`AsyncCqLoop::run`):
    /// from then on other runners are refused (EBUSY) until the claim is
    /// dropped, and the run's steps take the state with
    /// [`CqLoop::process_ready_claimed`].
    #[cfg(feature = "tokio")]
    pub(crate) fn claim_run(&self) -> Result<RunClaim<'_>> {
        self.claim()?;
        Ok(RunClaim(&self.sh))
    }

    /// The run state idle -> running, with the errors of `enter`.
    fn claim(&self) -> Result<()> {
        let sh = &*self.sh;
        if sh.held_here() {
            return Err(Error::new("rdmasafe_cq_loop_run: from inside one of its handlers", libc::EDEADLK));
        }
        // Claimed before the state: a second runner is refused at once, and
        // never waits for the first (whose call may last as long as its
        // wait), also when it comes while the first takes the state. One
        // state word with try_close: of a run and a close at once, one wins.
        match sh.run_state.claim() {
            Ok(()) => {}
            Err(Refused::Running) => {
                return Err(Error::new("rdmasafe_cq_loop_run: another thread runs the loop", libc::EBUSY))
            }
            Err(Refused::Closed) => {
                return Err(Error::new("rdmasafe_cq_loop_run: the loop is being destroyed", libc::EINVAL))
            }
        }
        Ok(())
    }

    /// Takes the state (the run state claimed by the caller).
    fn take_state(&self) -> Held<'_> {
        let sh = &*self.sh;
        let g = match sh.core.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // A brief apply, or a blocking change driving the loop
                // (a drain): that one lets go after its current cycle
                // (woken from its sleep for it) and waits for us instead.
                sh.wanted.fetch_add(1, SeqCst);
                sh.wake();
                let g = sh.core.lock().unwrap_or_else(|e| e.into_inner());
                sh.wanted.fetch_sub(1, SeqCst);
                g
            }
        };
        Held::new(sh, g, self.control())
    }

    /// True while a thread runs the loop (`run`, `run_for`,
    /// `process_once`, `process_ready`, `flush_acks`), or waits for its
    /// state to run it (while a blocking change from another thread hands
    /// it over), and while an async run future of it is alive
    /// (`AsyncCqLoop::run`, tokio feature: from its first poll to its end).
    pub fn is_running(&self) -> bool {
        self.sh.run_state.is_running()
    }

    /// Marks the loop as going away: from now on `run`, `run_for`,
    /// `process_once`, `process_ready` and `flush_acks` fail (EINVAL), and
    /// the loop is shut down at once, as its drop does: a blocking change
    /// in progress on another thread (a drain that drives the loop itself,
    /// nobody running it) ends with ECANCELED instead of running on to its
    /// timeout, and later changes fail. EBUSY (and nothing changes) while
    /// a thread runs it or waits for its state to run it
    /// ([`CqLoop::is_running`]), EDEADLK from inside one of its handlers.
    /// Of a run that starts and this, at once, one wins. For an owner that
    /// must know nobody runs the loop before it drops it (the C API's
    /// destroy, which then waits for the calls in flight).
    pub fn try_close(&self) -> Result<()> {
        let sh = &*self.sh;
        if sh.held_here() {
            return Err(Error::new("rdmasafe_cq_loop_destroy: from inside one of its handlers", libc::EDEADLK));
        }
        match sh.run_state.close() {
            Ok(()) => {
                self.shut();
                Ok(())
            }
            Err(Refused::Running) => {
                Err(Error::new("rdmasafe_cq_loop_destroy: another thread runs the loop", libc::EBUSY))
            }
            Err(Refused::Closed) => Err(Error::new("rdmasafe_cq_loop_destroy: destroyed already", libc::EINVAL)),
        }
    }

    fn leave(&self, held: Held<'_>) {
        drop(held); // the run state back to idle
    }

    /// Runs cycles until [`LoopControl::stop`]; then flushes every pending
    /// ack and returns. The stop request is consumed: the loop can run
    /// again, or be driven from the app's epoll from then on (the return
    /// leaves [`CqLoop::as_raw_fd`] readable when the loop has work left:
    /// the CQs the stop left to arm again). Signals do not end it (a
    /// profiler's SIGPROF is harmless); a signal handler may call stop. EBUSY if another thread runs the loop,
    /// EDEADLK from inside one of its handlers.
    pub fn run(&self) -> Result<()> {
        let mut held = self.enter()?;
        let r = {
            let (core, ctl) = held.parts();
            let r = core.run_until_stop(ctl);
            core.finish_stop(&ctl.0);
            // The stop left every CQ to be armed by the next call: an app
            // that goes on by waiting on the loop's fd is woken for it.
            core.wake_if_work(&ctl.0);
            r
        };
        self.leave(held);
        r
    }

    /// Like [`CqLoop::run`], for at most `timeout`: returns
    /// [`RunEnd::Stopped`] after a stop (consumed, as `run` does) or
    /// [`RunEnd::TimedOut`] when the time is up; either way with every
    /// pending ack flushed, and the fd readable if the loop has work left
    /// (an adaptive spin in progress, CQs to arm again), as `run` leaves
    /// it. `Duration::MAX` is as good as forever.
    pub fn run_for(&self, timeout: Duration) -> Result<RunEnd> {
        let deadline = sys::deadline_after(Instant::now(), timeout);
        let mut held = self.enter()?;
        let r = {
            let (core, ctl) = held.parts();
            let r = loop {
                if ctl.0.stop.load(SeqCst) {
                    core.finish_stop(&ctl.0);
                    break Ok(RunEnd::Stopped);
                }
                let now = Instant::now();
                if now >= deadline {
                    break Ok(RunEnd::TimedOut);
                }
                if let Err(e) = core.cycle(ctl, Wait::For(deadline - now), true) {
                    if e.errno() != libc::EINTR {
                        break Err(e);
                    }
                }
            };
            core.flush_all(&ctl.0);
            core.leave_to_app();
            // Time up in a spin, or a stop: as `run`.
            core.wake_if_work(&ctl.0);
            r
        };
        self.leave(held);
        r
    }

    /// Waits per `wait` until completions are delivered to handlers, then
    /// returns how many (the loop's own keepalive probes and drain markers
    /// are not counted). Cycles until a handler got completions, the wait
    /// runs out (returns 0), a stop (0), or an error: the loop's own work
    /// on the way (a keepalive probe, a timer, a CQ just added) does not
    /// end the call. EINTR when a signal interrupted the wait. With
    /// `Wait::None` (or a zero `Wait::For`): one cycle, which never waits
    /// (it may deliver nothing).
    /// For embedding in
    /// the app's own epoll: watch [`CqLoop::as_raw_fd`] (readable whenever
    /// the loop has work: a CQ event, a CQ just added, a stop, a due
    /// deadline, an adaptive spin or a CQ over its budget in progress; after
    /// a call that a handler's panic or an error ended, the CQs to arm
    /// again) and
    /// call `process_once(Wait::None)` when it is readable; no priming call
    /// is needed.
    ///
    /// A stop requested while the app drives the loop this way, before a
    /// call or during it (from a handler, or by another thread), ends that
    /// call with every ack flushed and the request consumed: it returns
    /// what it delivered up to then (0 for a stop asked before it), and
    /// the next call runs normally. Called with
    /// `Wait::None` (an app that embeds the loop), that call leaves the fd
    /// readable when the loop has CQs: the stop disarmed them, and the next
    /// call, which the app's epoll then makes, arms them again. (With a
    /// wait, the next call arms them before it waits.)
    pub fn process_once(&self, wait: Wait) -> Result<usize> {
        let mut held = self.enter()?;
        // Called when the fd is readable, or back to back (a reactor).
        let embedded = wait == Wait::None || wait == Wait::For(Duration::ZERO);
        let r = {
            let (core, ctl) = held.parts();
            if ctl.0.stop.load(SeqCst) {
                core.finish_stop_after(&ctl.0, embedded);
                Ok(0)
            } else {
                let r = core.deliver_within(ctl, wait);
                // A signal's EINTR: the app calls again at once, as a rule.
                if !embedded && !matches!(&r, Err(e) if e.errno() == libc::EINTR) {
                    core.leave_to_app();
                }
                if ctl.0.stop.load(SeqCst) {
                    core.finish_stop_after(&ctl.0, embedded);
                } else {
                    // Keep the fd readable: the app's epoll must call again.
                    core.wake_if_work(&ctl.0);
                }
                r
            }
        };
        self.leave(held);
        r
    }

    /// One cycle that never waits, for an edge-triggered poller (mio,
    /// tokio's `AsyncFd`, an epoll with `EPOLLET`) that watches
    /// [`CqLoop::as_raw_fd`]: call it when the fd was reported readable,
    /// and again while [`Progress::more`] says so. Once it reports
    /// `more == false` the fd has nothing ready, so the poller may clear
    /// its readiness: any later work (a CQ event, a change or a stop from
    /// another thread, a deadline of the loop's timer) makes the fd
    /// readable anew, which an edge-triggered poller reports as a new
    /// edge.
    ///
    /// A stop request ends the call at once, as in
    /// [`CqLoop::process_once`] (every ack flushed, the request consumed),
    /// and is reported in [`Progress::stopped`]. EINTR from the wait is
    /// reported as `more` (call again), never as an error.
    pub fn process_ready(&self) -> Result<Progress> {
        let held = self.enter()?;
        self.ready_step(held)
    }

    /// [`CqLoop::process_ready`] by the holder of a run's claim.
    #[cfg(feature = "tokio")]
    pub(crate) fn process_ready_claimed(&self, _claim: &RunClaim<'_>) -> Result<Progress> {
        self.ready_step(self.take_state())
    }

    fn ready_step(&self, mut held: Held<'_>) -> Result<Progress> {
        let r = {
            let (core, ctl) = held.parts();
            let sh = &*ctl.0;
            if sh.stop.load(SeqCst) {
                core.finish_stop_after(sh, true);
                Ok(Progress { delivered: 0, stopped: true, more: false })
            } else {
                match core.deliver_within(ctl, Wait::None) {
                    Err(e) if e.errno() != libc::EINTR => Err(e),
                    r => {
                        let delivered = *r.as_ref().unwrap_or(&0);
                        if sh.stop.load(SeqCst) {
                            core.finish_stop_after(sh, true);
                            Ok(Progress { delivered, stopped: true, more: false })
                        } else {
                            // Work the loop knows of, or anything its epoll
                            // holds (read by the next cycle).
                            let more = r.is_err()
                                || core.has_work_now(sh)
                                || sys::poll_readable([sh.epoll.fd()], Wait::None).map_or(true, |[ready]| ready);
                            Ok(Progress { delivered, stopped: false, more })
                        }
                    }
                }
            }
        };
        self.leave(held);
        r
    }

    /// How long an embedding app may wait before the next `process_once`;
    /// see [`LoopControl::next_timeout`].
    pub fn next_timeout(&self) -> Option<Duration> {
        self.control().next_timeout()
    }

    /// An async run of this loop is polled on the calling thread (`true`),
    /// or has ended (`false`): see `Shared::driver`. Its end wakes the
    /// blocking changes that waited for it (they drive the loop themselves
    /// from then on).
    #[cfg(feature = "tokio")]
    pub(crate) fn set_async_driver(&self, polling: bool) {
        self.sh.set_driver(polling);
    }

    /// Acks every pending CQ event now.
    pub fn flush_acks(&self) -> Result<()> {
        let held = self.enter()?;
        self.flush_held(held);
        Ok(())
    }

    /// [`CqLoop::flush_acks`] by the holder of a run's claim.
    #[cfg(feature = "tokio")]
    pub(crate) fn flush_acks_claimed(&self, _claim: &RunClaim<'_>) {
        self.flush_held(self.take_state());
    }

    fn flush_held(&self, mut held: Held<'_>) {
        let (core, ctl) = held.parts();
        core.flush_all(&ctl.0);
        self.leave(held);
    }

    /// Starts a thread that runs the loop, optionally pinned to `cpu`.
    /// [`LoopThread::stop`] stops it and gives the loop back.
    pub fn spawn(self, cpu: Option<usize>) -> Result<LoopThread> {
        super::thread::spawn(self, cpu)
    }

    /// Like [`CqLoop::spawn`], pinned to the first CPU of the NUMA node the
    /// device `ctx` sits on; unpinned when the device reports no node
    /// (Soft-RoCE, single-node machines). Returns the thread and the CPU.
    pub fn spawn_near(self, ctx: &crate::verbs::DeviceContext) -> Result<(LoopThread, Option<usize>)> {
        let cpu = sys::device_numa_cpus(&ctx.name()).and_then(|c| c.first().copied());
        Ok((self.spawn(cpu)?, cpu))
    }

    /// Blocking drain; see [`LoopControl::drain_qp`].
    ///
    /// # Safety
    /// As for [`LoopControl::drain_qp`].
    pub unsafe fn drain_qp(&self, qp: NonNull<sys::ibv_qp>, srq: bool, timeout: Duration) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.control().drain_qp(qp, srq, timeout) }.map(|_| ())
    }

    /// Dead-peer detection; see [`LoopControl::add_keepalive`].
    ///
    /// # Safety
    /// As for [`LoopControl::add_keepalive`].
    pub unsafe fn add_keepalive(
        &self,
        qp: NonNull<sys::ibv_qp>,
        cfg: super::Keepalive,
        on_dead: super::DeadPeer,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.control().add_keepalive(qp, cfg, on_dead) }.map(|_| ())
    }

    /// Blocking drain of the QP `id` owns; see [`LoopControl::drain_id`].
    pub fn drain_id(&self, id: &crate::cm::CmId, timeout: Duration) -> Result<()> {
        self.control().drain_id(id, timeout).map(|_| ())
    }

    /// Dead-peer detection for the QP `id` owns; see
    /// [`LoopControl::add_keepalive_id`].
    pub fn add_keepalive_id(
        &self,
        id: &crate::cm::CmId,
        cfg: super::Keepalive,
        on_dead: super::DeadPeer,
    ) -> Result<()> {
        self.control().add_keepalive_id(id, cfg, on_dead).map(|_| ())
    }

    /// Stops dead-peer detection; see [`LoopControl::remove_keepalive`].
    pub fn remove_keepalive(&self, qp_num: u32) -> Result<()> {
        self.control().remove_keepalive(qp_num).map(|_| ())
    }

    /// Adds a CQ the app owns (the C API).
    ///
    /// # Safety
    /// As for [`LoopControl::add_raw_cq`].
    pub unsafe fn add_raw_cq(&self, cq: NonNull<ibv_cq>, opts: CqOptions, handler: Handler) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.control().add_raw_cq(cq, opts, handler) }.map(|_| ())
    }
}

impl AsRawFd for CqLoop {
    /// The loop's own epoll fd: readable whenever the loop has work (see
    /// [`CqLoop::process_once`]). Not the completion channel's fd.
    fn as_raw_fd(&self) -> RawFd {
        self.sh.epoll.fd()
    }
}

impl AsFd for CqLoop {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the epoll fd lives as long as the loop's shared state,
        // which self keeps.
        unsafe { BorrowedFd::borrow_raw(self.sh.epoll.fd()) }
    }
}

impl CqLoop {
    /// The completion channel's fd (readable when a CQ event is ready);
    /// for embedding, watch [`CqLoop::as_raw_fd`] instead.
    pub fn channel_fd(&self) -> RawFd {
        self.chan_fd
    }
}

impl CqLoop {
    /// Tears the state down (at drop, or at a successful `try_close`):
    /// every CQ can be destroyed after this, and later changes through a
    /// control fail. Idempotent.
    fn shut(&self) {
        // Controls may outlive the loop (a handler may even hold one).
        self.sh.alive.store(false, SeqCst);
        // A blocking change of another thread that drives the loop (a
        // drain) hands it over after its current cycle, and gets ECANCELED.
        self.sh.wanted.fetch_add(1, SeqCst);
        self.sh.wake();
        let mut c = self.sh.core.lock().unwrap_or_else(|e| e.into_inner());
        self.sh.wanted.fetch_sub(1, SeqCst);
        c.shutdown();
        // Let go through Held: changes queued by calls that raced with this
        // (they passed the `alive` check first) are finished with
        // ECANCELED, also those queued while it lets go; and callers
        // blocked in a change are woken (they see ECANCELED).
        drop(Held::new(&self.sh, c, self.control()));
    }
}

impl Drop for CqLoop {
    fn drop(&mut self) {
        self.shut();
        registry::release_loop(self.sh.id);
        self.sh.core.lock().unwrap_or_else(|e| e.into_inner()).release_channel();
    }
}

/// A loop running on its own thread. Dropping it stops the loop and waits
/// for the thread (the loop is dropped with it), as [`LoopThread::stop`]
/// does without giving the loop back; dropped from one of the loop's own
/// handlers, it only asks the loop to stop (the thread ends after the
/// handler returns).
#[must_use = "dropping a LoopThread stops its loop and waits for the thread"]
pub struct LoopThread {
    pub(crate) ctl: LoopControl,
    /// Taken by `stop` or `drop`.
    pub(crate) thread: Option<std::thread::JoinHandle<(CqLoop, Result<()>)>>,
}

impl LoopThread {
    /// The loop's control handle.
    pub fn control(&self) -> LoopControl {
        self.ctl.clone()
    }

    /// Stops the loop, waits for the thread, and gives the loop back (it
    /// can be run again). The error is the one `run` ended with, if any.
    /// From one of the loop's own handlers: EDEADLK (the thread cannot wait
    /// for itself); the loop is asked to stop, and it ends with its thread
    /// once the handler returns.
    pub fn stop(mut self) -> Result<CqLoop> {
        self.ctl.stop();
        let thread = self.thread.take().expect("the thread is taken only by stop or drop");
        if thread.thread().id() == std::thread::current().id() || self.ctl.0.held_here() {
            // The thread cannot wait for itself, nor for a loop thread that
            // waits for the state this thread holds (a handler run by a
            // drain's drive): the loop stops, and goes with its thread.
            let_go(thread);
            return Err(Error::new("LoopThread::stop: from inside one of its handlers", libc::EDEADLK));
        }
        let (l, r) = thread.join().map_err(|_| Error::new("rdmasafe-cq thread panicked", libc::EIO))?;
        // If a handler had stopped the loop already, `run` consumed that
        // request and ours is left over: the loop we give back is not
        // running, so no stop request may linger (the next run would
        // return at once).
        l.sh.stop.store(false, SeqCst);
        r.map(|_| l)
    }
}

impl Drop for LoopThread {
    fn drop(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.ctl.stop();
        // From inside one of the loop's handlers (on its thread, or on a
        // thread whose drain drives the loop) joining would deadlock: the
        // stop ends the thread once the handler returns.
        if t.thread().id() == std::thread::current().id() || self.ctl.0.held_here() {
            let_go(t);
        } else {
            let _ = t.join();
        }
    }
}

/// A loop thread that cannot be waited for here (see `LoopThread::stop`):
/// it ends by itself. On the loop's own thread, its handle just goes (the
/// thread drops the loop when it ends). On a thread that holds the loop's
/// state, the loop must not be dropped here (its drop takes the state):
/// a helper thread waits for the loop thread and drops the loop; if no
/// thread can be made, the loop is leaked rather than deadlocked on.
fn let_go(t: std::thread::JoinHandle<(CqLoop, Result<()>)>) {
    if t.thread().id() == std::thread::current().id() {
        return;
    }
    let t = std::sync::Arc::new(std::sync::Mutex::new(Some(t)));
    let t2 = t.clone();
    let spawned = sys::spawn_signals_blocked("rdmasafe-cq-end", move || {
        if let Some(t) = t2.lock().unwrap_or_else(|e| e.into_inner()).take() {
            drop(t.join());
        }
    });
    if spawned.is_err() {
        std::mem::forget(t.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}
