//! The CQ notification loop.
//!
//! One loop serves one completion channel and any number of CQs bound to
//! it, each with its own handler. The cycle in event mode:
//!
//! 1. wait in poll() on the channel fd and the loop's wakeup fd;
//! 2. read every ready CQ event (the fd is non-blocking) and count one
//!    pending ack on the CQ the event *names*;
//! 3. for each CQ that fired: re-arm it (`ibv_req_notify_cq`), *then* poll
//!    it until it is empty, handing batches of work completions to its
//!    handler. Re-arming before the final drain closes the window in which
//!    a completion lands after the last empty poll and no event follows;
//! 4. ack in batches (`ibv_ack_cq_events(cq, n)` once a CQ has `ack_batch`
//!    pending), and always everything before stop, removal and drop.
//!
//! Busy-poll mode never arms and never sleeps. Adaptive mode polls while
//! completions keep coming and for `spin` after the last one, then arms,
//! drains once more, and sleeps like event mode.
//!
//! Ownership: the loop does not own the CQs' memory. A CQ must be removed
//! from the loop (or the loop dropped) before the CQ is destroyed, because
//! `ibv_destroy_cq` waits for acks that only the loop can give.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::stats::{Counters, LoopStats};
use crate::sys::{self, ibv_comp_channel, ibv_cq, ibv_wc, Wait, WakeFd};
use crate::verbs::{empty_wc, CompChannel, Cq};
use crate::{Error, Result};

/// How the loop waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Arm, sleep until notified, re-arm, drain. Lowest CPU use.
    Event,
    /// Poll continuously; never arm, never sleep. Lowest latency, one core.
    BusyPoll,
    /// Poll while busy and for `spin` after the last completion, then arm
    /// and sleep until the next event.
    Adaptive {
        /// How long to keep polling after the last completion.
        spin: Duration,
    },
}

/// Options of a loop.
#[derive(Clone, Copy, Debug)]
pub struct LoopOptions {
    /// How to wait.
    pub mode: Mode,
    /// Arm for solicited completions only (`ibv_req_notify_cq(cq, 1)`).
    pub solicited_only: bool,
    /// Work completions per `ibv_poll_cq` call and per handler call (1..=4096).
    pub poll_batch: usize,
    /// CQ events counted on a CQ before one `ibv_ack_cq_events` call
    /// (1..=65536). Pending acks are always flushed before stop, removal
    /// and drop.
    pub ack_batch: u32,
    /// If set: when no event arrived within this time while the app reports
    /// outstanding work ([`LoopControl::set_outstanding`]), poll every CQ
    /// anyway and count it in [`LoopStats::watchdog_polls`].
    pub watchdog: Option<Duration>,
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions { mode: Mode::Event, solicited_only: false, poll_batch: 16, ack_batch: 16, watchdog: None }
    }
}

impl LoopOptions {
    fn check(&self) -> Result<()> {
        let ok = (1..=4096).contains(&self.poll_batch) && (1..=65536).contains(&self.ack_batch);
        if ok {
            Ok(())
        } else {
            Err(Error::new("rdmasafe_cq_loop options", libc::EINVAL))
        }
    }
}

/// Dead-peer detection for one RC QP (see [`CqLoop::add_keepalive`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Probe after the QP has been idle (no successful completion) this long.
    pub period: Duration,
    /// Declare the peer dead when a probe has not completed within this.
    pub bound: Duration,
    /// The wr_id rdmasafe gives its probes. Probe completions are consumed
    /// by the loop, never handed to the app's handler, so pick a value the
    /// app does not use on this QP. rdmasafe keeps at most one probe
    /// outstanding: it needs one free send-queue slot.
    pub wr_id: u64,
}

/// Called once when a keepalive declares a QP's peer dead, after the QP was
/// moved to the error state; gets the QP number.
pub type DeadPeer = Box<dyn FnMut(u32, &LoopControl) + Send>;

struct KaEntry {
    qp: NonNull<sys::ibv_qp>,
    send_cq: *mut ibv_cq,
    qp_num: u32,
    cfg: Keepalive,
    last_activity: Instant,
    probe_sent: Option<Instant>,
    dead: bool,
    on_dead: DeadPeer,
}

/// wr_id of the send-queue marker posted by [`CqLoop::drain_qp`].
pub const DRAIN_SEND_WR_ID: u64 = u64::MAX;
/// wr_id of the receive-queue marker posted by [`CqLoop::drain_qp`].
pub const DRAIN_RECV_WR_ID: u64 = u64::MAX - 1;

struct Shared {
    stop: AtomicBool,
    wake: WakeFd,
    counters: Counters,
    outstanding: AtomicU64,
    /// Set while a handler of this loop runs (for "not from inside a handler").
    in_handler: AtomicBool,
}

/// A handle to a loop usable from any thread, and from inside handlers:
/// stop it, report outstanding work for the watchdog, read its figures.
#[derive(Clone)]
pub struct LoopControl(Arc<Shared>);

impl LoopControl {
    /// Asks the loop to stop: `run` returns after the current batch, with
    /// every pending ack flushed. Thread-safe, never blocks.
    pub fn stop(&self) {
        self.0.stop.store(true, SeqCst);
        self.0.wake.wake();
    }

    /// Tells the watchdog how much work the app has outstanding (0: none).
    pub fn set_outstanding(&self, n: u64) {
        self.0.outstanding.store(n, Relaxed);
    }

    /// The loop's figures now.
    pub fn stats(&self) -> LoopStats {
        self.0.counters.snapshot()
    }

    /// True while one of this loop's handlers is running (on any thread).
    pub fn in_handler(&self) -> bool {
        self.0.in_handler.load(SeqCst)
    }
}

/// A CQ's handler: gets each batch of work completions (error completions
/// included, never dropped) and the loop's control.
pub type Handler = Box<dyn FnMut(&[ibv_wc], &LoopControl) + Send>;

struct Entry {
    cq: NonNull<ibv_cq>,
    _keep: Option<Cq>,
    handler: Handler,
    pending_acks: u32,
    armed: bool,
    fired: bool,
}

/// CQs currently in some loop: the same CQ in two loops is refused.
fn registry() -> &'static Mutex<HashSet<usize>> {
    static R: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// Completion channels that have a loop: a channel has one reader.
fn channels() -> &'static Mutex<HashSet<usize>> {
    static C: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Markers of a drain in progress: (qp_num, send seen, recv seen).
struct DrainWatch {
    qp_num: u32,
    send: bool,
    recv: bool,
}

/// The loop; see the module docs. Driven by `&mut self` from one thread
/// ([`CqLoop::run`], [`CqLoop::process_once`], or [`CqLoop::spawn`]);
/// controlled from anywhere through [`LoopControl`].
pub struct CqLoop {
    chan: NonNull<ibv_comp_channel>,
    _chan_keep: Option<CompChannel>,
    entries: Vec<Entry>,
    opts: LoopOptions,
    ctl: LoopControl,
    wcs: Vec<ibv_wc>,
    /// Adaptive mode: `Some(time of last activity)` while polling.
    polling_since: Option<Instant>,
    drain: Option<DrainWatch>,
    keepalives: Vec<KaEntry>,
    hook: Option<Box<dyn FnMut() + Send>>,
    /// Clock reads are system calls on some VMs (hpet): the loop reads the
    /// clock once before a cycle's first handler and once after each
    /// handler, and reuses those stamps for the cycle time.
    cycle_start: Option<Instant>,
    last_stamp: Option<Instant>,
}

// SAFETY: the raw CQ / channel pointers are only used by the thread that
// holds `&mut CqLoop`; libibverbs allows these calls from any thread.
unsafe impl Send for CqLoop {}

fn io_err(op: &'static str, e: std::io::Error) -> Error {
    Error::new(op, e.raw_os_error().unwrap_or(libc::EIO))
}

impl CqLoop {
    /// A loop on `channel`. The loop puts the channel's fd in non-blocking
    /// mode and from now on is the only reader of the channel.
    pub fn new(channel: &CompChannel, opts: LoopOptions) -> Result<CqLoop> {
        // SAFETY: the CompChannel is live, and kept alive by the loop.
        let mut l = unsafe { Self::from_raw(NonNull::new(channel.raw()).expect("live channel"), opts)? };
        l._chan_keep = Some(channel.clone());
        Ok(l)
    }

    /// A loop on a channel the app owns (the C API).
    ///
    /// # Safety
    /// `chan` must be a live completion channel that outlives the loop.
    pub unsafe fn from_raw(chan: NonNull<ibv_comp_channel>, opts: LoopOptions) -> Result<CqLoop> {
        opts.check()?;
        if !channels().lock().unwrap_or_else(|e| e.into_inner()).insert(chan.as_ptr() as usize) {
            return Err(Error::new("rdmasafe_cq_loop_create: the channel already has a loop", libc::EBUSY));
        }
        // SAFETY: forwarded contract.
        let l = unsafe { Self::from_raw_registered(chan, opts) };
        if l.is_err() {
            channels().lock().unwrap_or_else(|e| e.into_inner()).remove(&(chan.as_ptr() as usize));
        }
        l
    }

    /// # Safety
    /// As for `from_raw`; the channel is registered already.
    unsafe fn from_raw_registered(chan: NonNull<ibv_comp_channel>, opts: LoopOptions) -> Result<CqLoop> {
        // SAFETY: chan is live (caller's contract).
        let fd = unsafe { (*chan.as_ptr()).fd };
        sys::set_nonblocking(fd).map_err(|e| io_err("fcntl", e))?;
        let wake = WakeFd::new().map_err(|e| io_err("eventfd", e))?;
        let shared = Shared {
            stop: AtomicBool::new(false),
            wake,
            counters: Counters::default(),
            outstanding: AtomicU64::new(0),
            in_handler: AtomicBool::new(false),
        };
        Ok(CqLoop {
            chan,
            _chan_keep: None,
            entries: Vec::new(),
            opts,
            ctl: LoopControl(Arc::new(shared)),
            wcs: (0..opts.poll_batch).map(|_| empty_wc()).collect(),
            polling_since: None,
            drain: None,
            keepalives: Vec::new(),
            hook: None,
            cycle_start: None,
            last_stamp: None,
        })
    }

    /// The loop's control handle.
    pub fn control(&self) -> LoopControl {
        self.ctl.clone()
    }

    /// The loop's figures now.
    pub fn stats(&self) -> LoopStats {
        self.ctl.stats()
    }

    /// The options in force.
    pub fn options(&self) -> LoopOptions {
        self.opts
    }

    /// Adds a CQ (kept alive by the loop) with its handler.
    pub fn add_cq<F>(&mut self, cq: &Cq, handler: F) -> Result<()>
    where
        F: FnMut(&[ibv_wc], &LoopControl) + Send + 'static,
    {
        // SAFETY: the Cq is live and kept alive by the entry.
        unsafe { self.add_entry(NonNull::new(cq.raw()).expect("live CQ"), Some(cq.clone()), Box::new(handler)) }
    }

    /// Adds a CQ the app owns (the C API).
    ///
    /// # Safety
    /// `cq` must be a live CQ that stays alive until it is removed from the
    /// loop or the loop is dropped.
    pub unsafe fn add_raw_cq(&mut self, cq: NonNull<ibv_cq>, handler: Handler) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.add_entry(cq, None, handler) }
    }

    /// # Safety
    /// `cq` live while in the loop.
    unsafe fn add_entry(&mut self, cq: NonNull<ibv_cq>, keep: Option<Cq>, handler: Handler) -> Result<()> {
        // SAFETY: cq and the channel are live.
        let (cq_chan, cq_ctx, chan_ctx) =
            unsafe { ((*cq.as_ptr()).channel, (*cq.as_ptr()).context, (*self.chan.as_ptr()).context) };
        if cq_ctx != chan_ctx {
            return Err(Error::new("rdmasafe_cq_loop_add_cq: CQ of another device context", libc::EINVAL));
        }
        if cq_chan != self.chan.as_ptr() {
            return Err(Error::new("rdmasafe_cq_loop_add_cq: CQ not bound to this loop's channel", libc::EINVAL));
        }
        if !registry().lock().unwrap_or_else(|e| e.into_inner()).insert(cq.as_ptr() as usize) {
            return Err(Error::new("rdmasafe_cq_loop_add_cq: CQ already in a loop", libc::EBUSY));
        }
        self.entries.push(Entry { cq, _keep: keep, handler, pending_acks: 0, armed: false, fired: false });
        Ok(())
    }

    /// Removes a CQ: flushes its pending acks and forgets it. Any event for
    /// it read later is acked at once. After this returns the app may
    /// destroy the CQ. ENOENT if the CQ is not in this loop; EBUSY while a
    /// keepalive probes through it (remove the keepalive first: without
    /// the CQ the loop would no longer see its probes complete and would
    /// declare a live peer dead).
    pub fn remove_cq(&mut self, cq: *mut ibv_cq) -> Result<()> {
        if self.keepalives.iter().any(|k| k.send_cq == cq) {
            return Err(Error::new("rdmasafe_cq_loop_remove_cq: a keepalive uses this CQ", libc::EBUSY));
        }
        let i = self
            .entries
            .iter()
            .position(|e| e.cq.as_ptr() == cq)
            .ok_or(Error::new("rdmasafe_cq_loop_remove_cq", libc::ENOENT))?;
        self.flush_entry(i);
        let e = self.entries.swap_remove(i);
        registry().lock().unwrap_or_else(|e| e.into_inner()).remove(&(e.cq.as_ptr() as usize));
        Ok(())
    }

    /// Number of CQs in the loop.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if the loop has no CQ.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Test hook: called after the loop's last empty poll, right before it
    /// sleeps (event mode, and adaptive mode's sleep phase).
    #[doc(hidden)]
    pub fn set_before_sleep_hook(&mut self, hook: Option<Box<dyn FnMut() + Send>>) {
        self.hook = hook;
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while the loop is.
        unsafe { (*self.chan.as_ptr()).fd }
    }

    fn ack(&self, cq: NonNull<ibv_cq>, n: u32) {
        if n == 0 {
            return;
        }
        // SAFETY: n events were read for this CQ and not acked; the CQ is
        // live (in the loop, or its destroy is waiting for exactly this ack).
        unsafe { sys::ibv_ack_cq_events(cq.as_ptr(), n) };
        let c = &self.ctl.0.counters;
        c.ack_calls.fetch_add(1, Relaxed);
        c.acked_events.fetch_add(n as u64, Relaxed);
        c.unacked.fetch_sub(n as u64, Relaxed);
    }

    fn flush_entry(&mut self, i: usize) {
        let (cq, n) = (self.entries[i].cq, std::mem::take(&mut self.entries[i].pending_acks));
        self.ack(cq, n);
    }

    /// Acks every pending CQ event now.
    pub fn flush_acks(&mut self) {
        for i in 0..self.entries.len() {
            self.flush_entry(i);
        }
    }

    fn arm(&self, cq: NonNull<ibv_cq>) -> Result<()> {
        self.ctl.0.counters.arms.fetch_add(1, Relaxed);
        // SAFETY: live CQ.
        match unsafe { sys::ibv_req_notify_cq(cq.as_ptr(), self.opts.solicited_only as i32) } {
            0 => Ok(()),
            r => Err(Error::new("ibv_req_notify_cq", r)),
        }
    }

    /// Polls entry `i` until it is empty, handing batches to its handler.
    fn drain_entry(&mut self, i: usize) -> Result<usize> {
        let mut total = 0;
        loop {
            let cq = self.entries[i].cq;
            // SAFETY: live CQ; wcs has poll_batch entries.
            let n = unsafe { sys::ibv_poll_cq(cq.as_ptr(), self.wcs.len() as i32, self.wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(Error::new("ibv_poll_cq", -n));
            }
            let n = n as usize;
            if n == 0 {
                break;
            }
            let n = if self.keepalives.is_empty() { n } else { self.keepalive_filter(n) };
            if n == 0 {
                continue;
            }
            let batch = &self.wcs[..n];
            let errors = batch.iter().filter(|w| w.status != sys::ibv_wc_status::IBV_WC_SUCCESS).count();
            if let Some(d) = self.drain.as_mut() {
                for w in batch.iter().filter(|w| w.qp_num == d.qp_num) {
                    d.send |= w.wr_id == DRAIN_SEND_WR_ID;
                    d.recv |= w.wr_id == DRAIN_RECV_WR_ID;
                }
            }
            let c = &self.ctl.0.counters;
            c.completions.fetch_add(n as u64, Relaxed);
            c.error_completions.fetch_add(errors as u64, Relaxed);
            // One clock read per handler call: the previous stamp (taken
            // after the previous handler, or at the cycle's first batch)
            // starts this one, so a handler's time includes the user-space
            // poll that fetched its batch.
            let t = match self.last_stamp {
                Some(t) => t,
                None => {
                    let now = Instant::now();
                    self.cycle_start.get_or_insert(now);
                    now
                }
            };
            self.ctl.0.in_handler.store(true, SeqCst);
            (self.entries[i].handler)(batch, &self.ctl);
            self.ctl.0.in_handler.store(false, SeqCst);
            let after = Instant::now();
            c.handler_time(after.duration_since(t));
            self.last_stamp = Some(after);
            total += n;
            // Fewer than asked: the CQ was empty at that moment. In event
            // mode it was re-armed before this drain, so a later completion
            // raises an event; in polling modes the next cycle polls again.
            if n < self.wcs.len() || self.ctl.0.stop.load(Relaxed) {
                break;
            }
        }
        Ok(total)
    }

    fn drain_all(&mut self) -> Result<usize> {
        let mut n = 0;
        for i in 0..self.entries.len() {
            n += self.drain_entry(i)?;
        }
        Ok(n)
    }

    /// Arms every CQ not armed yet, then drains it (completions that came
    /// before the arm raise no event).
    fn arm_and_drain_unarmed(&mut self) -> Result<usize> {
        let mut n = 0;
        for i in 0..self.entries.len() {
            if !self.entries[i].armed {
                self.arm(self.entries[i].cq)?;
                self.entries[i].armed = true;
                n += self.drain_entry(i)?;
            }
        }
        Ok(n)
    }

    /// Reads every ready CQ event; counts acks on the CQ each names and
    /// marks it fired. Events for CQs not in the loop are acked at once.
    fn read_events(&mut self) -> Result<()> {
        // Each arm raises at most one event, so once every CQ that was armed
        // has fired nothing more can be queued: skip the read that would
        // only return EAGAIN. (With none armed, read until EAGAIN.)
        let mut armed = self.entries.iter().filter(|e| e.armed).count();
        loop {
            if armed == 0 && self.entries.iter().any(|e| e.fired) {
                return Ok(());
            }
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: live channel (non-blocking fd); out-pointers valid.
            if unsafe { sys::ibv_get_cq_event(self.chan.as_ptr(), &mut cq, &mut ctx) } != 0 {
                let err = Error::last("ibv_get_cq_event");
                return match err.errno() {
                    libc::EAGAIN => Ok(()),
                    libc::EINTR => continue,
                    _ => Err(err),
                };
            }
            let c = &self.ctl.0.counters;
            c.cq_events.fetch_add(1, Relaxed);
            c.unacked.fetch_add(1, Relaxed);
            let Some(cq) = NonNull::new(cq) else { continue };
            match self.entries.iter().position(|e| e.cq == cq) {
                Some(i) => {
                    let e = &mut self.entries[i];
                    if e.armed {
                        armed -= 1;
                    }
                    e.pending_acks += 1;
                    e.fired = true;
                    e.armed = false;
                    if e.pending_acks >= self.opts.ack_batch {
                        self.flush_entry(i);
                    }
                }
                // Removed earlier (or never added): ack now so its destroy
                // cannot hang.
                None => self.ack(cq, 1),
            }
        }
    }

    fn wait_fds(&mut self, wait: Wait) -> Result<(bool, bool, bool)> {
        let mut wait = wait;
        let watchdog = match self.opts.watchdog {
            Some(t) if self.ctl.0.outstanding.load(Relaxed) > 0 => {
                wait = match wait {
                    Wait::For(d) if d <= t => wait,
                    Wait::None => wait,
                    _ => Wait::For(t),
                };
                true
            }
            _ => false,
        };
        wait = self.keepalive_wait(wait);
        if let Some(h) = self.hook.as_mut() {
            h();
        }
        let [ch, woke] = sys::poll_readable([self.fd(), self.ctl.0.wake.fd()], wait).map_err(|e| io_err("poll", e))?;
        if woke {
            self.ctl.0.wake.drain();
        }
        Ok((ch, woke, watchdog && !ch && !woke))
    }

    /// Starts a cycle's clock bookkeeping (no clock read).
    fn begin_cycle(&mut self) {
        self.cycle_start = None;
        self.last_stamp = None;
    }

    fn record_wakeup(&mut self, n: usize) {
        let c = &self.ctl.0.counters;
        c.wakeups.fetch_add(1, Relaxed);
        if n == 0 {
            c.empty_wakeups.fetch_add(1, Relaxed);
        }
        c.per_wakeup.record(n as u64);
        // Cycle time from the first batch to the end of the last handler
        // (0 for an empty wakeup): no extra clock read.
        if let (Some(a), Some(b)) = (self.cycle_start, self.last_stamp) {
            c.cycle_us.record(b.duration_since(a).as_micros() as u64);
        } else {
            c.cycle_us.record(0);
        }
        log::trace!(target: "rdmasafe", "CQ loop wakeup: {n} completions");
    }

    /// One cycle: wait per `wait`, then handle what arrived. Returns the
    /// number of completions delivered (0 on timeout or stop). For
    /// embedding in the app's own epoll: watch the completion channel's fd
    /// and call `process_once(Wait::None)` when it is readable (event mode).
    ///
    /// A stop requested while the app drives the loop this way ends the
    /// call at once: this call returns 0 with every ack flushed and the
    /// request consumed, and the next call runs normally.
    pub fn process_once(&mut self, wait: Wait) -> Result<usize> {
        if self.ctl.0.stop.load(SeqCst) {
            self.finish_stop();
            return Ok(0);
        }
        self.cycle(wait)
    }

    fn cycle(&mut self, wait: Wait) -> Result<usize> {
        let n = match self.opts.mode {
            Mode::Event => self.event_cycle(wait),
            Mode::BusyPoll => self.poll_cycle(wait, None),
            Mode::Adaptive { spin } => self.adaptive_cycle(wait, spin),
        }?;
        if !self.keepalives.is_empty() {
            self.keepalive_tick()?;
        }
        Ok(n)
    }

    fn event_cycle(&mut self, wait: Wait) -> Result<usize> {
        self.begin_cycle();
        let n = self.arm_and_drain_unarmed()?;
        if n > 0 {
            self.record_wakeup(n);
            return Ok(n);
        }
        self.sleep_and_handle(wait, true)
    }

    /// Sleeps on the fds, then reads events and drains the CQs that fired,
    /// re-arming each before its drain when `rearm`.
    fn sleep_and_handle(&mut self, wait: Wait, rearm: bool) -> Result<usize> {
        let (ch, _woke, watchdog_due) = self.wait_fds(wait)?;
        self.begin_cycle();
        if watchdog_due {
            self.ctl.0.counters.watchdog_polls.fetch_add(1, Relaxed);
            let n = self.drain_all()?;
            if n > 0 {
                self.record_wakeup(n);
            }
            return Ok(n);
        }
        if !ch {
            return Ok(0);
        }
        self.read_events()?;
        let mut n = 0;
        for i in 0..self.entries.len() {
            if std::mem::take(&mut self.entries[i].fired) {
                if rearm {
                    self.arm(self.entries[i].cq)?;
                    self.entries[i].armed = true;
                }
                n += self.drain_entry(i)?;
            }
        }
        self.record_wakeup(n);
        Ok(n)
    }

    /// Polls every CQ until completions arrive, `wait` runs out, the
    /// adaptive `spin` passes without completions, or stop.
    fn poll_cycle(&mut self, wait: Wait, spin: Option<Duration>) -> Result<usize> {
        let deadline = match wait {
            Wait::For(d) => Some(Instant::now() + d),
            Wait::None => Some(Instant::now()),
            Wait::Forever => None,
        };
        // Only a deadline, an adaptive spin limit or a keepalive needs the
        // clock while spinning; plain busy polling reads it only when it
        // delivers completions.
        let timed = deadline.is_some() || spin.is_some() || !self.keepalives.is_empty();
        let idle_from = match (self.polling_since, timed) {
            (Some(t), _) => Some(t),
            (None, true) => Some(Instant::now()),
            (None, false) => None,
        };
        loop {
            self.begin_cycle();
            let n = self.drain_all()?;
            if n > 0 {
                self.polling_since = self.last_stamp;
                self.record_wakeup(n);
                return Ok(n);
            }
            if self.ctl.0.stop.load(Relaxed) {
                return Ok(0);
            }
            if timed {
                let now = Instant::now();
                if spin.is_some_and(|s| idle_from.is_some_and(|f| now.duration_since(f) >= s)) {
                    self.polling_since = None;
                    return Ok(0);
                }
                if deadline.is_some_and(|d| now >= d) || self.keepalive_due(now) {
                    return Ok(0);
                }
            }
            std::hint::spin_loop();
        }
    }

    fn adaptive_cycle(&mut self, wait: Wait, spin: Duration) -> Result<usize> {
        if self.polling_since.is_some() {
            let n = self.poll_cycle(wait, Some(spin))?;
            if n > 0 || self.polling_since.is_some() {
                return Ok(n);
            }
            // Idle for `spin`: go to sleep. Events raised while we polled
            // are for completions already delivered: read and count them
            // now (no empty wakeup later), then arm everything again below.
            self.read_events()?;
            for e in &mut self.entries {
                e.armed = false;
                e.fired = false;
            }
        }
        self.begin_cycle();
        let n = self.arm_and_drain_unarmed()?;
        if n > 0 {
            self.polling_since = self.last_stamp;
            self.record_wakeup(n);
            return Ok(n);
        }
        // Woken: drain what fired without re-arming and poll from now on;
        // CQs that fired stay unarmed until the next sleep arms them.
        let n = self.sleep_and_handle(wait, false)?;
        if n > 0 {
            self.polling_since = self.last_stamp;
        }
        Ok(n)
    }

    /// Registers dead-peer detection for `qp` (an RC QP whose send CQ is in
    /// this loop). While the loop runs, when the QP has had no successful
    /// completion for `cfg.period`, rdmasafe posts a probe: a signaled
    /// zero-length RDMA WRITE (no rkey is checked for zero length; the
    /// peer's application sees nothing). A probe that has not completed
    /// within `cfg.bound` means the peer is dead: rdmasafe moves the QP to
    /// the error state, so everything outstanding flushes to the handler,
    /// and calls `on_dead` once. A timer decides, not the retry count, so
    /// this works whatever `retry_cnt` the QP has (with 7, rxe retries
    /// forever and reports nothing). A probe that fails with an error status
    /// (e.g. retry exceeded) declares the peer dead at once.
    ///
    /// Errors: EINVAL (zero period or bound, send CQ not in this loop),
    /// EBUSY (the QP already has a keepalive).
    ///
    /// # Safety
    /// `qp` must be live until [`CqLoop::remove_keepalive`] or the loop is
    /// dropped.
    pub unsafe fn add_keepalive(&mut self, qp: NonNull<sys::ibv_qp>, cfg: Keepalive, on_dead: DeadPeer) -> Result<()> {
        if cfg.period.is_zero() || cfg.bound.is_zero() {
            return Err(Error::new("rdmasafe keepalive: zero period or bound", libc::EINVAL));
        }
        // SAFETY: live QP (caller).
        let (send_cq, qp_num) = unsafe { ((*qp.as_ptr()).send_cq, (*qp.as_ptr()).qp_num) };
        if !self.entries.iter().any(|e| e.cq.as_ptr() == send_cq) {
            return Err(Error::new("rdmasafe keepalive: the QP's send CQ is not in this loop", libc::EINVAL));
        }
        if self.keepalives.iter().any(|k| k.qp_num == qp_num) {
            return Err(Error::new("rdmasafe keepalive: QP already registered", libc::EBUSY));
        }
        self.keepalives.push(KaEntry {
            qp,
            send_cq,
            qp_num,
            cfg,
            last_activity: Instant::now(),
            probe_sent: None,
            dead: false,
            on_dead,
        });
        Ok(())
    }

    /// Stops dead-peer detection for the QP with this number (ENOENT if it
    /// had none). A probe still outstanding completes to the handler.
    pub fn remove_keepalive(&mut self, qp_num: u32) -> Result<()> {
        let i = self
            .keepalives
            .iter()
            .position(|k| k.qp_num == qp_num)
            .ok_or(Error::new("rdmasafe keepalive", libc::ENOENT))?;
        self.keepalives.swap_remove(i);
        Ok(())
    }

    /// Notes activity and takes probe completions out of `wcs[..n]`;
    /// returns how many completions remain for the handler.
    fn keepalive_filter(&mut self, n: usize) -> usize {
        let now = Instant::now();
        let mut kept = 0;
        for j in 0..n {
            let (qpn, wr_id, ok) =
                (self.wcs[j].qp_num, self.wcs[j].wr_id, self.wcs[j].status == sys::ibv_wc_status::IBV_WC_SUCCESS);
            let mut probe = false;
            if let Some(k) = self.keepalives.iter_mut().find(|k| k.qp_num == qpn) {
                if ok {
                    k.last_activity = now;
                }
                if wr_id == k.cfg.wr_id && k.probe_sent.is_some() {
                    probe = true;
                    k.probe_sent = None;
                    if ok {
                        self.ctl.0.counters.keepalive_probes_ok.fetch_add(1, Relaxed);
                    } else if !k.dead {
                        // Retry exceeded or the like: the timer need not wait.
                        k.probe_sent = Some(now - k.cfg.bound);
                    }
                }
            }
            if !probe {
                self.wcs.swap(kept, j);
                kept += 1;
            }
        }
        kept
    }

    fn keepalive_deadline(&self) -> Option<Instant> {
        self.keepalives
            .iter()
            .filter(|k| !k.dead)
            .map(|k| match k.probe_sent {
                Some(t) => t + k.cfg.bound,
                None => k.last_activity + k.cfg.period,
            })
            .min()
    }

    fn keepalive_due(&self, now: Instant) -> bool {
        self.keepalive_deadline().is_some_and(|d| now >= d)
    }

    fn keepalive_wait(&self, wait: Wait) -> Wait {
        let Some(d) = self.keepalive_deadline() else { return wait };
        let left = d.saturating_duration_since(Instant::now());
        match wait {
            Wait::None => Wait::None,
            Wait::For(w) if w <= left => wait,
            _ => Wait::For(left),
        }
    }

    /// Posts due probes and declares peers dead whose probe is overdue.
    fn keepalive_tick(&mut self) -> Result<()> {
        let now = Instant::now();
        for i in 0..self.keepalives.len() {
            let k = &mut self.keepalives[i];
            if k.dead {
                continue;
            }
            let overdue = k.probe_sent.is_some_and(|t| now.duration_since(t) >= k.cfg.bound);
            if !overdue && k.probe_sent.is_none() && now.duration_since(k.last_activity) >= k.cfg.period {
                // SAFETY: live QP (add_keepalive's contract).
                match unsafe { sys::post_zero_length_write(k.qp.as_ptr(), k.cfg.wr_id) } {
                    Ok(()) => {
                        k.probe_sent = Some(now);
                        self.ctl.0.counters.keepalive_probes.fetch_add(1, Relaxed);
                        continue;
                    }
                    // The QP cannot even take a probe: treat as dead.
                    Err(_) => k.probe_sent = Some(now - k.cfg.bound),
                }
            }
            let k = &mut self.keepalives[i];
            if k.probe_sent.is_some_and(|t| now.duration_since(t) >= k.cfg.bound) {
                k.dead = true;
                // SAFETY: live QP; the error state flushes outstanding work.
                let _ = unsafe { sys::qp_to_error(k.qp.as_ptr()) };
                self.ctl.0.counters.keepalive_dead.fetch_add(1, Relaxed);
                log::warn!(target: "rdmasafe", "keepalive: peer of QP {} declared dead", k.qp_num);
                let qpn = k.qp_num;
                let ctl = self.ctl.clone();
                (self.keepalives[i].on_dead)(qpn, &ctl);
            }
        }
        Ok(())
    }

    /// Runs cycles until [`LoopControl::stop`]; then flushes every pending
    /// ack and returns. The stop request is consumed: the loop can run
    /// again.
    pub fn run(&mut self) -> Result<()> {
        let r = (|| {
            while !self.ctl.0.stop.load(SeqCst) {
                self.cycle(Wait::Forever)?;
            }
            Ok(())
        })();
        self.finish_stop();
        r
    }

    /// Flushes acks, forgets arm state (the next run re-arms and drains, so
    /// completions left in a CQ at stop are delivered then) and clears the
    /// stop request.
    fn finish_stop(&mut self) {
        // The stop's wakeup may not have been read (the loop was not in
        // poll()): consume it so the next wait is not cut short.
        self.ctl.0.wake.drain();
        self.flush_acks();
        for e in &mut self.entries {
            e.armed = false;
        }
        self.polling_since = None;
        self.ctl.0.stop.store(false, SeqCst);
    }

    /// Starts a thread that runs the loop, optionally pinned to `cpu`.
    /// [`LoopThread::stop`] stops it and gives the loop back.
    pub fn spawn(mut self, cpu: Option<usize>) -> Result<LoopThread> {
        let ctl = self.control();
        let t = std::thread::Builder::new()
            .name("rdmasafe-cq".into())
            .spawn(move || {
                let pinned = cpu.map(sys::pin_current_thread).transpose();
                let r = pinned.map_err(|e| io_err("sched_setaffinity", e)).and_then(|_| self.run());
                (self, r)
            })
            .map_err(|e| io_err("pthread_create", e))?;
        Ok(LoopThread { ctl, thread: t })
    }

    /// Like [`CqLoop::spawn`], pinned to the first CPU of the NUMA node the
    /// device `ctx` sits on; unpinned when the device reports no node
    /// (Soft-RoCE, single-node machines). Returns the thread and the CPU
    /// chosen.
    pub fn spawn_near(self, ctx: &crate::verbs::DeviceContext) -> Result<(LoopThread, Option<usize>)> {
        let cpu = sys::device_numa_cpus(&ctx.name()).and_then(|c| c.first().copied());
        Ok((self.spawn(cpu)?, cpu))
    }

    /// Drains a QP before teardown, like the kernel's `ib_drain_qp`: moves
    /// it to the error state, posts a marker on its send queue
    /// ([`DRAIN_SEND_WR_ID`]) and, unless `srq`, on its receive queue
    /// ([`DRAIN_RECV_WR_ID`]), then runs the loop until both flush
    /// completions were delivered (to the handlers, like every completion)
    /// or `timeout` passes (ETIMEDOUT). Flush completions are in order per
    /// queue, so when this returns every request posted before it has
    /// completed. The QP's CQs must be in this loop (EINVAL otherwise).
    /// Returns with every CQ event the loop read acked (whatever
    /// `ack_batch`), as teardown follows.
    ///
    /// # Safety
    /// `qp` must be a live QP with a free slot on each queue.
    pub unsafe fn drain_qp(&mut self, qp: NonNull<sys::ibv_qp>, srq: bool, timeout: Duration) -> Result<()> {
        // SAFETY: live QP (caller's contract).
        let (send_cq, recv_cq, qp_num) =
            unsafe { ((*qp.as_ptr()).send_cq, (*qp.as_ptr()).recv_cq, (*qp.as_ptr()).qp_num) };
        let ours = |cq| self.entries.iter().any(|e| e.cq.as_ptr() == cq);
        if !ours(send_cq) || (!srq && !ours(recv_cq)) {
            return Err(Error::new("rdmasafe drain_qp: QP's CQs not in this loop", libc::EINVAL));
        }
        // SAFETY: live QP; marker WRs without buffers.
        unsafe { sys::qp_to_error_and_post_markers(qp.as_ptr(), !srq, DRAIN_SEND_WR_ID, DRAIN_RECV_WR_ID)? };
        self.drain = Some(DrainWatch { qp_num, send: false, recv: srq });
        let deadline = Instant::now() + timeout;
        let result = loop {
            if self.drain.as_ref().is_some_and(|d| d.send && d.recv) {
                break Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Err(Error::new("rdmasafe drain_qp", libc::ETIMEDOUT));
            }
            // Markers may already sit in a CQ that is armed and quiet: poll
            // directly as well as waiting for events.
            self.begin_cycle();
            let n = self.drain_all()?;
            if n > 0 {
                self.record_wakeup(n);
                continue;
            }
            let wait = Wait::For(left.min(Duration::from_millis(10)));
            match self.opts.mode {
                Mode::Event => self.event_cycle(wait)?,
                _ => self.poll_cycle(wait, None)?,
            };
        };
        self.drain = None;
        // A drain precedes teardown: leave no ack pending, whatever ack_batch.
        self.flush_acks();
        result
    }
}

impl AsRawFd for CqLoop {
    /// The completion channel's fd: readable when a CQ event is ready.
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl AsFd for CqLoop {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel outlives the loop (it is kept or the app's
        // contract), so its fd is open while self is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl Drop for CqLoop {
    fn drop(&mut self) {
        // Ack every pending event, then read and ack whatever is still in
        // the channel (events of CQs armed earlier), so no CQ destroy waits.
        self.flush_acks();
        let _ = self.read_events();
        self.flush_acks();
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        for e in &self.entries {
            reg.remove(&(e.cq.as_ptr() as usize));
        }
        channels().lock().unwrap_or_else(|e| e.into_inner()).remove(&(self.chan.as_ptr() as usize));
    }
}

/// A loop running on its own thread.
pub struct LoopThread {
    ctl: LoopControl,
    thread: std::thread::JoinHandle<(CqLoop, Result<()>)>,
}

impl LoopThread {
    /// The loop's control handle.
    pub fn control(&self) -> LoopControl {
        self.ctl.clone()
    }

    /// Stops the loop, waits for the thread, and gives the loop back (it
    /// can be run again). The error is the one `run` ended with, if any.
    pub fn stop(self) -> Result<CqLoop> {
        self.ctl.stop();
        let (l, r) = self.thread.join().map_err(|_| Error::new("rdmasafe-cq thread panicked", libc::EIO))?;
        r.map(|_| l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        assert!(LoopOptions::default().check().is_ok());
        assert!(LoopOptions { poll_batch: 0, ..Default::default() }.check().is_err());
        assert!(LoopOptions { poll_batch: 5000, ..Default::default() }.check().is_err());
        assert!(LoopOptions { ack_batch: 0, ..Default::default() }.check().is_err());
    }
}
