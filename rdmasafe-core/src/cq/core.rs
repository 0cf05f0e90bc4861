//! The loop's state ([`Core`]): its CQs, the changes queued for it, acks
//! to the CQ each event names, reading events in O(1) per event, draining
//! CQs into their handlers (budgets, the loop's own completions filtered
//! out), and teardown. The cycle that drives it is in `cycle`, its timers
//! in `timers`.

use std::collections::{HashSet, VecDeque};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::*;
use std::time::Instant;

use super::control::{Cmd, Done, LoopControl, Shared};
use super::drain::Drains;
use super::entries::{Entries, Entry, Ref};
use super::handle::{LiveChannel, LiveCq};
use super::keepalive::{Keepalives, DEAD_PEER_DRAIN};
use super::options::LoopOptions;
use super::registry;
use super::stats::Bump;
use crate::sys;
use crate::wc::Wc;
use crate::{Error, Result};

/// The loop's state; held by whoever drives the loop (see
/// [`super::control`]).
pub(crate) struct Core {
    pub(super) chan: LiveChannel,
    /// The channel fd's flags before the loop made it non-blocking.
    pub(super) orig_flags: i32,
    pub(super) opts: LoopOptions,
    pub(super) entries: Entries,
    /// CQs to arm and drain (new, or after a stop / an adaptive spin).
    pub(super) unarmed: Vec<Ref>,
    /// CQs whose event was read this cycle.
    pub(super) fired: Vec<Ref>,
    /// CQs that used up their budget with completions left.
    pub(super) ready: VecDeque<Ref>,
    /// `work_ready`'s working copy of `ready` (kept for its storage).
    pub(super) ready_work: Vec<Ref>,
    /// How many CQs are armed and have not fired since.
    pub(super) armed: usize,
    pub(super) wcs: Vec<Wc>,
    /// Adaptive mode: `Some(time of last activity)` while polling.
    pub(super) polling_since: Option<Instant>,
    /// A cycle began and has not returned `Ok` (see `Core::settle`).
    pub(crate) unsettled: bool,
    /// Queued changes are being applied (`apply_queued`): a nested look
    /// (a removal reading the channel) applies none, so the changes apply
    /// in the order queued, each batch whole before the next.
    applying: bool,
    pub(super) keepalives: Keepalives,
    pub(super) drains: Drains,
    pub(super) hook: Option<Box<dyn FnMut() + Send>>,
    pub(super) woke_hook: Option<Box<dyn FnMut() + Send>>,
    pub(super) warned_foreign: HashSet<usize>,
    /// What the timerfd is armed for.
    pub(super) timer_at: Option<Instant>,
    /// Watchdog: when its current period began (None while it does not
    /// count, see `watchdog_counts`). A period that runs out with no CQ
    /// event in it ends in a poll of every CQ; one with an event just
    /// starts the next (see `tick`).
    pub(super) watchdog_from: Option<Instant>,
    /// A CQ event was read in the watchdog's current period (a store per
    /// event instead of a clock read).
    pub(super) event_in_period: bool,
    /// Clock stamps of the cycle in progress (clock reads are system calls
    /// on some VMs: once before a cycle's first handler, once after each).
    pub(super) cycle_start: Option<Instant>,
    pub(super) last_stamp: Option<Instant>,
    /// Torn down (the fd has its own flags back: never read it again).
    pub(super) shut: bool,
    /// Event mode: read the channel before sleeping, or sleep first.
    pub(super) read_first: ReadFirst,
    /// After a read that found an event: read on for more, or not.
    pub(super) read_more: ReadMore,
    /// Learning mode: its model and plan state.
    pub(super) learn: super::learn::Learn,
    /// The loop's own completions (keepalive probes, drain markers) taken
    /// from CQs so far (wrapping): a cycle's count of completions taken,
    /// less these, is what it delivered to handlers.
    pub(super) own_taken: u64,
}

/// Whether event mode reads the channel before it sleeps. Reading first
/// costs nothing when the event is already there (no `epoll_wait`: the
/// hand-written loop's one `read()`), and one `read()` that says EAGAIN
/// when it is not; sleeping first costs the `epoll_wait` either way. So:
/// read first while the last read-first attempt found an event; after one
/// that found nothing, sleep first and probe again after 1, 2, 4 ... 64
/// sleeps (the wait doubles with every probe that finds nothing, back to 1
/// after one that finds an event). In steady state a loop that must always
/// sleep makes one probing read per 64 sleeps; one under load whose events
/// are always pending never sleeps.
///
/// The decision is kept twice, by what the cycle before found: its event
/// pending (read first, found) or not (it slept). A ping-pong alternates
/// the two: after a wakeup that slept for the peer's message, the handler's
/// own send completes at once (read first finds it); after that one, the
/// next message takes a round trip (the loop must sleep). One decision for
/// both would read first, and say EAGAIN, before every sleep.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadFirst {
    /// Indexed by whether the last cycle found its event by reading first.
    by_last: [Probe; 2],
    last_found: bool,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Probe {
    on: bool,
    /// Sleeps left before the next probe.
    wait: u32,
    /// The wait after the next probe that finds nothing.
    backoff: u32,
}

impl Probe {
    const NEW: Probe = Probe { on: true, wait: 0, backoff: 1 };
    const MAX_BACKOFF: u32 = 64;

    /// Make the read this time?
    #[inline]
    fn choose(&self) -> bool {
        self.on || self.wait == 0
    }

    /// The read found something (on from now), or nothing (off, and the
    /// next probe after twice the last wait, at most 64).
    #[inline]
    fn outcome(&mut self, found: bool) {
        if found {
            *self = Probe::NEW;
        } else {
            self.on = false;
            self.wait = self.backoff;
            self.backoff = (self.backoff * 2).min(Self::MAX_BACKOFF);
        }
    }

    /// The read was not made: one step closer to the next probe.
    #[inline]
    fn skipped(&mut self) {
        self.wait = self.wait.saturating_sub(1);
    }
}

impl ReadFirst {
    #[cfg(test)]
    pub(super) const MAX_BACKOFF: u32 = Probe::MAX_BACKOFF;

    pub(super) fn new() -> ReadFirst {
        ReadFirst { by_last: [Probe::NEW; 2], last_found: false }
    }

    /// Read before this sleep?
    #[inline]
    pub(super) fn choose(&self) -> bool {
        self.by_last[self.last_found as usize].choose()
    }

    /// A read before a sleep found an event (`true`) or nothing.
    #[inline]
    pub(super) fn outcome(&mut self, found: bool) {
        self.by_last[self.last_found as usize].outcome(found);
        self.last_found = found;
    }

    /// Slept without reading first.
    #[inline]
    pub(super) fn slept(&mut self) {
        self.by_last[self.last_found as usize].skipped();
        self.last_found = false;
    }
}

/// Whether event mode, having read one event after a sleep or a read
/// first, reads the channel again for more before it works what fired.
/// Each arm raises at most one event, so with one CQ firing at a time (a
/// connection among idle ones) the second read only says EAGAIN: a
/// `read()` more per wakeup than the hand-written loop, which reads one
/// event per `ibv_get_cq_event`. So it reads on while such reads found an
/// event, and otherwise probes with [`ReadFirst`]'s back-off (after 1, 2,
/// 4 ... 64 wakeups). An event it does not read now stays in the channel:
/// the next cycle reads it (the fd stays readable, so no sleep waits on
/// it: one that reads first finds it, one that sleeps first pays an
/// `epoll_wait` that returns at once, the cost of a burst of several CQs
/// while reading on is off).
///
/// One outcome per wakeup: a read on that finds an event turns it on, and
/// the reads after it go on to EAGAIN (that last one is no miss); a read
/// on that finds nothing turns it off. Reads that must see every pending
/// event read to EAGAIN: a CQ's removal, the end of a spin, the fairness
/// read of a CQ over its budget, and every read of the modes that poll
/// (adaptive and learning: their spin polls every CQ anyway, and a wake's
/// batch counts what the wake's own cycle found).
pub(super) type ReadMore = Probe;

/// The lists of CQs a cycle works through.
#[derive(Clone, Copy, Debug)]
pub(super) enum List {
    /// New CQs, or CQs to arm again after a stop or an adaptive spin.
    Unarmed,
    /// CQs whose event was read this cycle.
    Fired,
}

pub(super) fn io_err(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::new(op, e.raw_os_error().unwrap_or(libc::EIO))
}
impl Core {
    pub(super) fn new(chan: LiveChannel, opts: LoopOptions) -> Result<Core> {
        let fd = chan.fd();
        let orig_flags = sys::fd_flags(fd).map_err(io_err("fcntl"))?;
        sys::set_nonblocking(fd).map_err(io_err("fcntl"))?;
        Ok(Core {
            chan,
            orig_flags,
            opts,
            entries: Entries::default(),
            unarmed: Vec::new(),
            fired: Vec::new(),
            ready: VecDeque::new(),
            ready_work: Vec::new(),
            armed: 0,
            wcs: (0..opts.poll_batch).map(|_| Wc::zeroed()).collect(),
            polling_since: None,
            unsettled: false,
            applying: false,
            keepalives: Keepalives::default(),
            drains: Drains::default(),
            hook: None,
            woke_hook: None,
            warned_foreign: HashSet::new(),
            timer_at: None,
            watchdog_from: None,
            event_in_period: false,
            cycle_start: None,
            last_stamp: None,
            shut: false,
            read_first: ReadFirst::new(),
            read_more: ReadMore::NEW,
            learn: super::learn::Learn::with_weight(opts.learn_latency_weight),
            own_taken: 0,
        })
    }

    // ------------------------------------------------------------ changes

    /// Applies every queued change (FIFO). Called while changes are being
    /// applied (a removal reads the channel, which may meet an event for a
    /// CQ whose add is queued), it applies none: the changes queued
    /// meanwhile come after the batch in progress, in order.
    #[inline]
    pub(crate) fn apply_cmds(&mut self, ctl: &LoopControl) {
        if ctl.0.cmds_pending.load(SeqCst) && !self.applying {
            self.apply_queued(ctl);
        }
    }

    #[cold]
    fn apply_queued(&mut self, ctl: &LoopControl) {
        let sh = &*ctl.0;
        self.applying = true;
        // Nothing in `apply` unwinds (a done callback's panic is caught in
        // `Done::finish`); should it all the same, the flag is reset.
        let r = catch_unwind(AssertUnwindSafe(|| {
            while sh.cmds_pending.load(SeqCst) {
                for cmd in sh.take_cmds() {
                    self.apply(ctl, cmd);
                }
            }
        }));
        self.applying = false;
        if let Err(p) = r {
            resume_unwind(p);
        }
    }

    pub(super) fn apply(&mut self, ctl: &LoopControl, cmd: Cmd) {
        let sh = &*ctl.0;
        if self.shut {
            // Queued while the loop was being dropped: never applied, but
            // finished (a caller waiting for it, a done callback, the
            // registry's claim of a CQ that was to be added).
            return Self::cancel(sh, cmd);
        }
        match cmd {
            Cmd::AddCq { cq, opts, handler } => {
                // Markers of drains that timed out, and keepalive probes,
                // still in the CQ when it left a loop (this or another):
                // this loop's now, before the CQ is ever polled here.
                self.drains.adopt(cq.addr());
                self.keepalives.adopt(cq.addr());
                let r = self.entries.insert(Entry::new(cq, opts, handler));
                self.push_unarmed(r);
                sh.counters.cqs_added.bump(1);
                sh.counters.cqs.store(self.entries.len() as u64, Relaxed);
            }
            Cmd::RemoveCq { cq, done } => {
                let r = self.remove_cq(ctl, cq);
                done.finish(sh, r);
            }
            Cmd::AddKeepalive { qp, reg, send_cq, cfg, on_dead } => {
                let qpn = reg.0;
                if self.entries.find(send_cq).is_some() {
                    if !self.keepalives.add(qp, reg.1, cfg, on_dead, Instant::now()) {
                        // Its CmId destroyed the QP before this change was
                        // applied: a keepalive that ended before it began.
                        sh.forget_keepalives(&[reg]);
                    }
                } else {
                    // Its send CQ left the loop (a removal queued before
                    // this change) and the QP may be gone: never touch it.
                    sh.forget_keepalives(&[reg]);
                    log::warn!(
                        target: "rdmasafe",
                        "keepalive for QP {qpn} not started: its send CQ left the loop before the change was applied"
                    );
                }
            }
            Cmd::RemoveKeepalive { reg, done } => {
                self.keepalives.remove(reg);
                done.finish(sh, Ok(()));
            }
            Cmd::Drain { qp, cqs, srq, timeout, done } => {
                if self.entries.find(cqs.0).is_none() || (!srq && self.entries.find(cqs.1).is_none()) {
                    let e = Error::new("rdmasafe drain_qp: a CQ of the QP left the loop first", libc::EINVAL);
                    done.finish(sh, Err(e));
                    return;
                }
                let deadline = sys::deadline_after(Instant::now(), timeout);
                if let Ok((qpn, _, _)) = qp.info() {
                    // The app tears the QP down: its flushed probes are not
                    // a dead peer (even when the drain fails to start, the
                    // QP may be in the error state).
                    self.keepalives.draining(qpn);
                }
                if let Err((done, e)) = self.drains.start(&qp, srq, deadline, done) {
                    done.finish(sh, Err(e));
                }
            }
        }
    }

    /// A keepalive declared the peer of `qpn` dead: its QP is drained as
    /// `drain_qp` would (error state, markers), with nobody waiting. The
    /// loop then polls the QP's CQs until the markers are back, so the
    /// flushed work reaches the handlers also where the flush raises no
    /// event (a send CQ armed solicited-only, on rxe). The receive queue
    /// gets a marker only when its CQ is in the loop and the QP has no SRQ
    /// (a marker must never reach a CQ the app polls itself). If the drain
    /// cannot start (a full queue), the QP still goes to the error state.
    /// Nothing of this if the app drained the QP itself
    /// ([`super::keepalive::Keepalives::qp_to_drain`]).
    pub(super) fn drain_dead_peer(&mut self, qpn: u32) {
        let Some(qp) = self.keepalives.qp_to_drain(qpn) else { return };
        let Ok((_, _, recv_cq)) = qp.info() else { return }; // its CmId destroyed it
        let recv = self.entries.find(recv_cq).is_some() && qp.has_srq() == Ok(false);
        let deadline = sys::deadline_after(Instant::now(), DEAD_PEER_DRAIN);
        let done = || -> Done {
            Done::Call(Box::new(move |r| {
                if let Err(e) = r {
                    log::debug!(target: "rdmasafe", "keepalive: the drain of dead peer's QP {qpn}: {e}");
                }
            }))
        };
        let started = match self.drains.start(qp, !recv, deadline, done()) {
            Err(_) if recv => self.drains.start(qp, true, deadline, done()),
            r => r,
        };
        if let Err((_, e)) = started {
            log::debug!(target: "rdmasafe", "keepalive: QP {qpn} of a dead peer not drained ({e}): moved to the error state");
            let _ = qp.to_error();
        }
    }

    pub(super) fn remove_cq(&mut self, ctl: &LoopControl, cq: usize) -> Result<()> {
        let sh = &*ctl.0;
        let Some(r) = self.entries.find(cq) else {
            return Err(Error::new("rdmasafe_cq_loop_remove_cq", libc::ENOENT));
        };
        // Events already queued for it: read them now (crediting the other
        // CQs' as usual), so its destroy has nothing left to wait for.
        let _ = self.read_events(ctl, true);
        self.flush(sh, r);
        // (Nothing above applies a queued change, see `apply_cmds`: the
        // entry is still there.)
        let Some(e) = self.entries.remove(r) else {
            return Err(Error::new("rdmasafe_cq_loop_remove_cq", libc::ENOENT));
        };
        if e.armed {
            self.armed -= 1;
        }
        // The markers and probes still to come through it are parked
        // before its claim goes: the loop it may join next (from another
        // thread, once the claim is gone) adopts them.
        let cancelled = self.drains.take_for_cq(cq);
        // Their registrations go before the CQ's claim: once the claim is
        // gone, another thread may add the CQ back and a keepalive on one
        // of these QPs, which must not find the number still taken.
        let gone = self.keepalives.remove_for_cq(cq);
        sh.forget_keepalives(&gone);
        registry::release_cq(cq, sh.id);
        for (done, res) in cancelled {
            done.finish(sh, res);
        }
        sh.counters.cqs_removed.bump(1);
        sh.counters.cqs.store(self.entries.len() as u64, Relaxed);
        drop(e); // the handler goes now: never called again
        Ok(())
    }

    pub(super) fn push_unarmed(&mut self, r: Ref) {
        if let Some(e) = self.entries.get_mut(r) {
            if !e.in_unarmed {
                e.in_unarmed = true;
                self.unarmed.push(r);
            }
        }
    }

    // --------------------------------------------------------------- acks

    pub(super) fn ack(sh: &Shared, cq: &LiveCq, n: u32) {
        if n == 0 {
            return;
        }
        cq.ack(n);
        let c = &sh.counters;
        c.ack_calls.bump(1);
        c.acked_events.bump(n as u64);
        c.unacked.drop_by(n as u64);
    }

    pub(super) fn flush(&mut self, sh: &Shared, r: Ref) {
        if let Some(e) = self.entries.get_mut(r) {
            let n = std::mem::take(&mut e.pending_acks);
            Self::ack(sh, &e.cq, n);
        }
    }

    /// Acks every pending CQ event now.
    pub(crate) fn flush_all(&mut self, sh: &Shared) {
        for e in self.entries.iter_mut() {
            let n = std::mem::take(&mut e.pending_acks);
            Self::ack(sh, &e.cq, n);
        }
    }

    // ------------------------------------------------------------- events

    /// Reads the ready CQ events: with `all`, every one; without, after the
    /// first only as [`ReadMore`] says (the rest stay in the channel for
    /// the next cycle). Counts an ack on the CQ each names and marks it
    /// fired. An event for a CQ whose add is still queued is credited to
    /// it (unless changes are being applied: see `apply_cmds`); one for a
    /// CQ not in the loop is acked at once, counted and logged (once per
    /// CQ). Returns the events read.
    #[inline(always)]
    pub(super) fn read_events(&mut self, ctl: &LoopControl, all: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let mut read = 0;
        // The read-on decision of this call is still to take (see
        // `ReadMore`): one outcome per call.
        let mut deciding = !all;
        loop {
            // Each arm raises at most one event: once every armed CQ has
            // fired, the read could only say EAGAIN.
            if self.armed == 0 && !self.fired.is_empty() {
                return Ok(read);
            }
            let more = read > 0 && deciding;
            if more && !self.read_more.choose() {
                self.read_more.skipped();
                return Ok(read);
            }
            sh.counters.channel_reads.bump(1);
            let Some(ev) = self.chan.get_event()? else {
                sh.counters.channel_reads_empty.bump(1);
                if more {
                    self.read_more.outcome(false);
                }
                return Ok(read);
            };
            if more {
                self.read_more.outcome(true);
                deciding = false;
            }
            read += 1;
            sh.counters.cq_events.bump(1);
            sh.counters.unacked.bump(1);
            if sh.cmds_pending.load(SeqCst) && self.entries.find(ev.cq_addr()).is_none() {
                self.apply_cmds(ctl);
            }
            let Some((r, e)) = self.entries.find_mut(ev.cq_addr()) else {
                let cq = ev.cq_addr();
                ev.ack();
                sh.counters.unacked.drop_by(1);
                sh.counters.foreign_cq_events.bump(1);
                if self.warned_foreign.insert(cq) {
                    log::warn!(
                        target: "rdmasafe",
                        "CQ loop: an event for CQ {cq:#x}, which is on this loop's channel but not in the loop: \
                         acked, its completions are not handled (add it to the loop)"
                    );
                }
                continue;
            };
            let batch = self.opts.ack_batch;
            e.pending_acks += 1;
            if e.armed {
                e.armed = false;
                self.armed -= 1;
            }
            if !e.in_fired {
                e.in_fired = true;
                self.fired.push(r);
            }
            if e.pending_acks >= batch {
                let n = std::mem::take(&mut e.pending_acks);
                Self::ack(sh, &e.cq, n);
            }
            self.event_in_period = true;
        }
    }

    // ------------------------------------------------------------ draining

    /// Polls `r` until it is empty or its budget is used, handing batches
    /// to its handler. Returns the completions taken from the CQ.
    #[inline]
    pub(super) fn drain(&mut self, ctl: &LoopControl, r: Ref, honor_stop: bool) -> Result<usize> {
        let budget = match self.entries.get(r) {
            Some(e) if e.opts.budget > 0 => e.opts.budget,
            Some(_) => usize::MAX,
            None => return Ok(0),
        };
        self.drain_from(ctl, r, honor_stop, 0, budget)
    }

    /// [`Core::drain`] of a CQ of which this drain took `total` completions
    /// already, of its `budget` (usize::MAX: none).
    #[inline]
    pub(super) fn drain_from(
        &mut self,
        ctl: &LoopControl,
        r: Ref,
        honor_stop: bool,
        mut total: usize,
        budget: usize,
    ) -> Result<usize> {
        let sh = &*ctl.0;
        loop {
            // Looked up again after every handler call (it may remove its CQ).
            let Some(e) = self.entries.get_mut(r) else { return Ok(total) };
            if total >= budget {
                sh.counters.budget_yields.bump(1);
                if !e.in_ready {
                    e.in_ready = true;
                    self.ready.push_back(r);
                }
                return Ok(total);
            }
            // Never more than the budget left (a budget below the poll batch
            // holds too).
            let ask = self.wcs.len().min(budget - total);
            let raw = e.cq.poll(&mut self.wcs[..ask])?;
            if raw == 0 {
                return Ok(total);
            }
            total += raw;
            let n = if self.keepalives.is_empty() && self.drains.is_empty() {
                raw
            } else {
                let cq = e.cq.addr();
                self.filter(sh, cq, raw)
            };
            if n > 0 {
                self.call_handler(ctl, r, n);
            }
            // Fewer than asked: the CQ was empty at that moment (a later
            // completion raises an event: it was armed before this drain).
            if raw < ask || (honor_stop && sh.stop.load(Relaxed)) {
                return Ok(total);
            }
        }
    }

    /// Takes the loop's own completions (keepalive probes, drain markers)
    /// out of `wcs[..n]`, polled from `cq`, notes activity; returns how
    /// many are left.
    pub(super) fn filter(&mut self, sh: &Shared, cq: usize, n: usize) -> usize {
        // Only keepalives need the time (a drain's markers do not).
        let now = if self.keepalives.is_empty() { None } else { Some(Instant::now()) };
        let mut kept = 0;
        for j in 0..n {
            let wc = &self.wcs[j];
            let mut ours = self.drains.note(wc);
            if let (false, Some(now)) = (ours, now) {
                let (probe, ok) = self.keepalives.note(wc, cq, now);
                ours = probe;
                if probe && ok {
                    sh.counters.keepalive_probes_ok.bump(1);
                }
            }
            if !ours {
                self.wcs.swap(kept, j);
                kept += 1;
            }
        }
        self.own_taken = self.own_taken.wrapping_add((n - kept) as u64);
        kept
    }

    /// Of `n` completions taken since `own_taken` was `own0`, those
    /// delivered to handlers (the loop's own left out).
    #[inline]
    pub(super) fn delivered(&self, own0: u64, n: usize) -> usize {
        n.saturating_sub(self.own_taken.wrapping_sub(own0) as usize)
    }

    #[inline(always)]
    pub(super) fn call_handler(&mut self, ctl: &LoopControl, r: Ref, n: usize) {
        let sh = &*ctl.0;
        let batch = &self.wcs[..n];
        let errors = batch.iter().filter(|w| !w.is_success()).count();
        let c = &sh.counters;
        c.completions.bump(n as u64);
        c.error_completions.bump(errors as u64);
        // Timing statistics: one clock read before a cycle's first handler
        // call, one after each (none at all when they are off).
        let timing = self.opts.timing_stats;
        let t = match (timing, self.last_stamp) {
            (false, _) => None,
            (true, Some(t)) => Some(t),
            (true, None) => {
                let now = Instant::now();
                self.cycle_start.get_or_insert(now);
                Some(now)
            }
        };
        // Called where it is: while it runs, nobody else can touch the
        // loop's state (this thread holds it; the handler's changes are
        // queued, applied below).
        let Some(e) = self.entries.get_mut(r) else { return };
        // Learning mode's count of the completions that waited for a wake:
        // a solicited-only CQ counts once per event cycle (one sleep at
        // most), whatever its handler calls (its unsolicited completions
        // were not meant to wake the loop).
        let l = &mut self.learn;
        if !e.opts.solicited_only {
            l.handed = l.handed.wrapping_add(n as u64);
        } else if e.learn_counted != l.event_cycles {
            e.learn_counted = l.event_cycles;
            l.handed = l.handed.wrapping_add(1);
        }
        let handler = &mut e.handler;
        let wcs = &self.wcs[..n];
        // A figure for `LoopControl::in_handler` only (no other memory is
        // published through it): no full fence per handler call.
        sh.in_handler.store(true, Release);
        let result = catch_unwind(AssertUnwindSafe(|| handler(wcs, ctl)));
        sh.in_handler.store(false, Release);
        if let Some(t) = t {
            let after = Instant::now();
            c.handler_time(after.duration_since(t));
            self.last_stamp = Some(after);
        }
        // Changes the handler asked for take effect now, before any other
        // handler runs (a CQ removed from its own handler is gone here).
        self.apply_cmds(ctl);
        if let Err(p) = result {
            // The loop is consistent (handler back, flags reset): let the
            // panic go on to whoever runs the loop.
            resume_unwind(p);
        }
    }

    /// Arms (if `arm`) and drains every CQ of the `which` list, emptying
    /// it. The list's storage is kept for its next use (no allocation per
    /// cycle).
    #[inline]
    pub(super) fn work_list(&mut self, ctl: &LoopControl, which: List, arm: bool, honor_stop: bool) -> Result<usize> {
        let mut list = std::mem::take(self.list_mut(which));
        let r = self.work_refs(ctl, &list, arm, true, honor_stop);
        list.clear();
        // A CQ pushed meanwhile (a requeue, a handler's add) keeps its new
        // list; the old storage is kept when the slot is still empty.
        let slot = self.list_mut(which);
        if slot.is_empty() && slot.capacity() < list.capacity() {
            *slot = list;
        }
        r
    }

    fn list_mut(&mut self, which: List) -> &mut Vec<Ref> {
        match which {
            List::Unarmed => &mut self.unarmed,
            List::Fired => &mut self.fired,
        }
    }

    #[inline]
    fn work_refs(
        &mut self,
        ctl: &LoopControl,
        list: &[Ref],
        arm: bool,
        listed: bool,
        honor_stop: bool,
    ) -> Result<usize> {
        let mut n = 0;
        for (i, &r) in list.iter().enumerate() {
            let step = catch_unwind(AssertUnwindSafe(|| self.work_one(ctl, r, arm, listed, honor_stop)));
            match step {
                Ok(Ok(k)) => n += k,
                // A verbs error or a handler's panic ends the list here: the
                // CQs not done yet (this one included) are armed and drained
                // in the next cycle, never left marked as listed.
                Ok(Err(e)) => {
                    self.requeue(&list[i..], listed);
                    return Err(e);
                }
                Err(p) => {
                    self.requeue(&list[i..], listed);
                    resume_unwind(p);
                }
            }
        }
        Ok(n)
    }

    /// `listed`: `r` came from the unarmed or fired list (not the ready one).
    #[inline]
    fn work_one(&mut self, ctl: &LoopControl, r: Ref, arm: bool, listed: bool, honor_stop: bool) -> Result<usize> {
        let Some(e) = self.entries.get_mut(r) else { return Ok(0) };
        if listed {
            e.in_unarmed = false;
            e.in_fired = false;
        }
        if arm {
            let solicited = e.opts.solicited_only;
            if !e.armed {
                e.armed = true;
                self.armed += 1;
            }
            ctl.0.counters.arms.bump(1);
            e.cq.arm(solicited)?;
        }
        self.drain(ctl, r, honor_stop)
    }

    /// CQs a cycle could not finish: armed and drained in the next one
    /// (their list marks cleared first, so `push_unarmed` takes them).
    pub(super) fn requeue(&mut self, refs: &[Ref], listed: bool) {
        for &r in refs {
            if listed {
                if let Some(e) = self.entries.get_mut(r) {
                    e.in_unarmed = false;
                    e.in_fired = false;
                }
            }
            self.push_unarmed(r);
        }
    }

    /// Drains the CQs over their budget once more (not re-armed: they
    /// were not re-armed when they went over). Their in_unarmed/in_fired
    /// marks are left alone. The working copy's storage is kept (no
    /// allocation per cycle).
    pub(super) fn work_ready(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        if self.ready.is_empty() {
            return Ok(0);
        }
        let mut list = std::mem::take(&mut self.ready_work);
        list.extend(self.ready.drain(..));
        for &r in &list {
            if let Some(e) = self.entries.get_mut(r) {
                e.in_ready = false;
            }
        }
        let r = self.work_refs(ctl, &list, false, false, honor_stop);
        list.clear();
        self.ready_work = list;
        r
    }

    /// Polls every CQ once (busy-poll and adaptive's spin: O(CQs)).
    pub(super) fn poll_all(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let mut n = 0;
        // By slot index, allocating nothing (a handler may add or remove
        // CQs meanwhile: a removed one is skipped, a new one in a slot not
        // visited yet is polled too).
        // The ready list is emptied first, not after: a CQ that this poll
        // leaves over its budget goes back on it (with its flag set) and is
        // polled again next cycle, as the budget promises.
        for r in self.ready.drain(..) {
            if let Some(e) = self.entries.get_mut(r) {
                e.in_ready = false;
            }
        }
        for i in 0..self.entries.slot_count() {
            let Some(r) = self.entries.ref_at(i) else { continue };
            n += self.drain(ctl, r, honor_stop)?;
        }
        Ok(n)
    }
}

impl Core {
    /// Ends a change that a dropped loop will never apply: ECANCELED to
    /// whoever waits for it; an added CQ's claim released, its handler
    /// dropped.
    #[cold]
    fn cancel(sh: &Shared, cmd: Cmd) {
        let gone = || Error::new("rdmasafe CQ loop: the loop is gone", libc::ECANCELED);
        match cmd {
            Cmd::AddCq { cq, .. } => registry::release_cq(cq.addr(), sh.id),
            Cmd::AddKeepalive { reg, .. } => sh.forget_keepalives(&[reg]),
            Cmd::RemoveCq { done, .. } | Cmd::RemoveKeepalive { done, .. } | Cmd::Drain { done, .. } => {
                done.finish(sh, Err(gone()))
            }
        }
    }

    /// The loop goes away: ack every pending event, read and ack whatever
    /// is still in the channel (so no CQ destroy waits), drop the handlers
    /// (which may hold the loop's control: no cycle is left), end the
    /// drains, give the fd its flags back. Idempotent.
    pub(super) fn shutdown(&mut self) {
        if self.shut {
            return;
        }
        self.shut = true;
        for e in self.entries.iter_mut() {
            e.cq.ack(std::mem::take(&mut e.pending_acks));
        }
        while let Ok(Some(ev)) = self.chan.get_event() {
            match self.entries.find(ev.cq_addr()).and_then(|r| self.entries.get(r)) {
                Some(e) => e.cq.ack(1),
                None => ev.ack(),
            }
        }
        for r in self.entries.refs() {
            drop(self.entries.remove(r));
        }
        self.unarmed.clear();
        self.fired.clear();
        self.ready.clear();
        self.armed = 0;
        for done in self.drains.take_all() {
            let gone = || Error::new("rdmasafe drain_qp: the loop is gone", libc::ECANCELED);
            match done {
                // Caught: a panic would unwind out of the loop's drop,
                // leaving its channel claimed and its state poisoned.
                Done::Call(f) => super::control::call_caught(f, Err(gone())),
                // A caller blocked in drain_qp: the owner of the loop wakes
                // it (`Shared::notify`) once this returns.
                Done::Wait(c) => c.set(Err(gone())),
                Done::Nothing => {}
            }
        }
        self.keepalives.park_all();
        self.keepalives = Keepalives::default();
        let _ = sys::set_fd_flags(self.chan.fd(), self.orig_flags);
    }

    /// After [`Core::shutdown`] and once the loop's claims are released
    /// (no new loop on a channel at the same address is refused meanwhile):
    /// lets go of the channel, so that a control the app keeps does not
    /// keep the device context open.
    pub(super) fn release_channel(&mut self) {
        debug_assert!(self.shut);
        self.chan.release();
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::ReadFirst;

    /// One wakeup whose channel has an event (`found`) or not: reads first
    /// or sleeps first as `rf` decides. Returns whether it read first.
    fn wakeup(rf: &mut ReadFirst, found: bool) -> bool {
        let read = rf.choose();
        if read {
            rf.outcome(found);
        } else {
            rf.slept();
        }
        read
    }

    /// A ping-pong's wakeups alternate: pending (read first finds it), then
    /// one that must sleep (read first would say EAGAIN). Each kind learns
    /// its own decision; the one that must sleep probes only as backed off.
    #[test]
    fn read_first_learns_alternating_wakeups() {
        let mut rf = ReadFirst::new();
        let (mut pending_sleeps, mut eagain) = (0, 0);
        for round in 0..200 {
            // pending: reading first finds the event
            if !wakeup(&mut rf, true) && round >= 8 {
                pending_sleeps += 1;
            }
            // must sleep: reading first finds nothing
            if wakeup(&mut rf, false) && round >= 8 {
                eagain += 1;
            }
        }
        assert_eq!(pending_sleeps, 0, "a pending wakeup never sleeps first");
        // the back-off's ramp (1, 2, 4 ... 64: 7 probes), then one per 64
        assert!(eagain <= 7 + 192 / ReadFirst::MAX_BACKOFF as usize, "{eagain} EAGAIN reads in 192 rounds");
    }

    /// Always pending: always read first; never pending: one probe per
    /// MAX_BACKOFF sleeps in steady state.
    #[test]
    fn read_first_backs_off_only_where_it_misses() {
        let mut rf = ReadFirst::new();
        for _ in 0..100 {
            assert!(wakeup(&mut rf, true));
        }
        let mut rf = ReadFirst::new();
        let mut probes = 0;
        for i in 0..1000 {
            if wakeup(&mut rf, false) && i >= 200 {
                probes += 1;
            }
        }
        assert!((12..=13).contains(&probes), "{probes} probes in 800 sleeps (one per 64)");
    }
}
