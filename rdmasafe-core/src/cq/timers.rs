//! The loop's timers: keepalive, drain and watchdog deadlines, the timerfd
//! an embedding app's epoll wakes at, and what is due now (`tick`).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

use super::control::{LoopControl, Shared};
use super::core::Core;
use super::options::Mode;
use super::stats::Bump;
use crate::sys::{self};
use crate::Result;

impl Core {
    // ---------------------------------------------------------- deadlines

    /// The earliest keepalive / drain / watchdog deadline.
    pub(super) fn next_deadline(&self, sh: &Shared) -> Option<Instant> {
        let mut d = self.keepalives.next_deadline();
        if let Some(x) = self.drains.next_deadline() {
            d = Some(d.map_or(x, |y| y.min(x)));
        }
        if let (Some(t), Some(since)) = (self.opts.watchdog, self.watchdog_since(sh)) {
            let x = sys::deadline_after(since, t);
            d = Some(d.map_or(x, |y| y.min(x)));
        }
        if let Some(x) = self.learn.wake_at {
            d = Some(d.map_or(x, |y| y.min(x)));
        }
        d
    }

    /// Whether the watchdog counts now: it is on, the app reports
    /// outstanding work, and the loop waits for events (not in busy-poll
    /// mode, nor while a polling mode spins: both poll every CQ anyway).
    fn watchdog_counts(&self, sh: &Shared) -> bool {
        self.opts.watchdog.is_some()
            && sh.outstanding.load(Relaxed) > 0
            && self.polling_since.is_none()
            && self.opts.mode != Mode::BusyPoll
    }

    /// When the watchdog's current period began, if it counts now.
    pub(super) fn watchdog_since(&self, sh: &Shared) -> Option<Instant> {
        self.watchdog_from.filter(|_| self.watchdog_counts(sh))
    }

    /// Starts the watchdog's first period if it counts and has none, at a
    /// sleep (`tick` starts it too, at the end of any cycle: the app may
    /// report work while the sleep that consumes its wake-up has begun).
    /// From then on a period follows the last (`tick`), events or not:
    /// reading an event costs no clock read, and a call that delivered
    /// leaves the deadline as it was, for an embedding app's epoll
    /// (`next_timeout`, the timerfd). A time the watchdog does not count
    /// ends its period: it starts afresh when it counts again.
    pub(super) fn watchdog_start(&mut self, sh: &Shared) {
        if self.watchdog_from.is_none() && self.watchdog_counts(sh) {
            self.watchdog_from = Some(Instant::now());
            self.event_in_period = false;
        }
    }

    /// Leaves the loop's fd readable when it has work now (a return to the
    /// app: whoever waits on the fd must call again).
    pub(super) fn wake_if_work(&self, sh: &Shared) {
        if self.has_work_now(sh) {
            sh.wake();
        }
    }

    pub(super) fn has_work_now(&self, sh: &Shared) -> bool {
        !self.unarmed.is_empty()
            || !self.ready.is_empty()
            || !self.fired.is_empty()
            || self.polling_since.is_some()
            // A CQ not armed outside event mode: busy-poll never arms (its
            // CQs are always to poll); adaptive and learning modes left one
            // that fired unarmed (see `event_cycle`): the next cycle arms it.
            || (self.opts.mode != Mode::Event && self.armed < self.entries.len())
            || sh.cmds_pending.load(SeqCst)
    }

    pub(crate) fn next_timeout(&self, sh: &Shared) -> Option<Duration> {
        if self.has_work_now(sh) || sh.stop.load(SeqCst) {
            return Some(Duration::ZERO);
        }
        self.next_deadline(sh).map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Keeps the timerfd armed for the next deadline (an embedding app's
    /// epoll wakes at it).
    pub(super) fn arm_timer(&mut self, sh: &Shared, at: Option<Instant>) {
        if at != self.timer_at {
            let after = at.map(|a| a.saturating_duration_since(Instant::now()));
            if sh.timer.set(after).is_ok() {
                self.timer_at = at;
            }
        }
    }

    /// Nothing timed at all (the common case): no keepalive, no drain, no
    /// watchdog, and the timerfd is disarmed already. Then `tick` has
    /// nothing to do, and a sleep needs no deadline.
    #[inline(always)]
    pub(super) fn untimed(&self) -> bool {
        self.keepalives.is_empty()
            && self.drains.is_empty()
            && self.opts.watchdog.is_none()
            && self.timer_at.is_none()
            && self.learn.wake_at.is_none()
    }

    /// Keepalive probes and deaths, finished and timed-out drains, the
    /// watchdog: whatever is due now.
    #[inline]
    pub(super) fn tick(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        if self.untimed() {
            return Ok(0);
        }
        self.tick_timed(ctl, honor_stop)
    }

    #[inline(never)]
    fn tick_timed(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        // The watchdog's period: none while it does not count, a first one
        // from now when it counts again (see `watchdog_start`).
        let start_watchdog = if self.watchdog_counts(sh) {
            self.watchdog_from.is_none()
        } else {
            self.watchdog_from = None;
            false
        };
        let timed =
            start_watchdog || self.watchdog_from.is_some() || !self.keepalives.is_empty() || self.drains.in_progress();
        let now = timed.then(Instant::now);
        if start_watchdog {
            self.watchdog_from = now;
            self.event_in_period = false;
        }
        let mut n = 0;
        if let Some(now) = now {
            if !self.keepalives.is_empty() {
                // A sweep (see `Keepalives::add`): each CQ polled for what
                // it held when the sweep began (at most its capacity; a
                // poll that stops short found it empty), whatever its
                // budget or a stop (a rare, bounded poll).
                let (sweep, gen) = self.keepalives.sweep_begin();
                for &cq in &sweep {
                    if let Some((r, e)) = self.entries.find_mut(cq) {
                        let bound = e.cq.capacity().saturating_add(self.wcs.len());
                        n += self.drain_from(ctl, r, false, 0, bound)?;
                    }
                }
                if !sweep.is_empty() {
                    self.keepalives.sweep_end(&sweep, gen);
                }
                for cq in self.keepalives.send_cqs_due(now) {
                    if let Some(r) = self.entries.find(cq) {
                        n += self.drain(ctl, r, honor_stop)?;
                    }
                }
                let (posted, dead, destroyed) = self.keepalives.tick(now);
                sh.counters.keepalive_probes.bump(posted);
                sh.forget_keepalives(&destroyed);
                // Every dead peer's QP drained before any on_dead, which
                // may destroy its QP or remove another's keepalive.
                for &(qpn, _) in &dead {
                    self.drain_dead_peer(qpn);
                }
                // Every dead peer's on_dead runs, also after another one's
                // panic (a peer is declared dead once: a callback skipped
                // would never run); the first panic then goes on to whoever
                // runs the loop, as a handler's does.
                let mut panicked = None;
                for reg in dead {
                    sh.counters.keepalive_dead.bump(1);
                    if let Some(f) = self.keepalives.on_dead(reg) {
                        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(reg.0, ctl))) {
                            panicked.get_or_insert(p);
                        }
                        // Its changes take effect now, as a handler's do:
                        // a CQ it removed is not polled (the watchdog below,
                        // a later on_dead's) and its handler never runs.
                        self.apply_cmds(ctl);
                    }
                }
                if let Some(p) = panicked {
                    resume_unwind(p);
                }
            }
            if let (Some(t), Some(since)) = (self.opts.watchdog, self.watchdog_since(sh)) {
                if now.saturating_duration_since(since) >= t {
                    // A period ran out: the next begins now, and a poll of
                    // every CQ only if it saw no event (so the poll comes
                    // one to two periods after the last event).
                    self.watchdog_from = Some(now);
                    if !std::mem::take(&mut self.event_in_period) {
                        sh.counters.watchdog_polls.bump(1);
                        n += self.poll_all(ctl, honor_stop)?;
                    }
                }
            }
        }
        if self.drains.in_progress() {
            if let Some(now) = now {
                // Markers that raised no event: looked for by polling.
                for cq in self.drains.cqs_due(now) {
                    if let Some(r) = self.entries.find(cq) {
                        n += self.drain(ctl, r, honor_stop)?;
                    }
                }
            }
            let finished = self.drains.take_finished(now);
            if !finished.is_empty() {
                // A drain precedes teardown: leave no ack pending.
                self.flush_all(sh);
                for (done, r) in finished {
                    done.finish(sh, r);
                }
            }
        }
        let next = self.next_deadline(sh);
        self.arm_timer(sh, next);
        Ok(n)
    }
}
