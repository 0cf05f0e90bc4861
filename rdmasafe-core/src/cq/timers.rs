//! The loop's timers: keepalive, drain and watchdog deadlines, the timerfd
//! an embedding app's epoll wakes at, and what is due now (`tick`).

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

    /// Since when the watchdog counts (no event since), if it is on and the
    /// app reports outstanding work.
    pub(super) fn watchdog_since(&self, sh: &Shared) -> Option<Instant> {
        self.last_event.filter(|_| self.opts.watchdog.is_some() && sh.outstanding.load(Relaxed) > 0)
    }

    /// Starts the watchdog's count at a sleep if nothing started it since
    /// the last event (`tick` starts it at the end of the cycle that read
    /// the event; this covers outstanding work reported since).
    pub(super) fn watchdog_start(&mut self, sh: &Shared) {
        if self.last_event.is_none() && self.opts.watchdog.is_some() && sh.outstanding.load(Relaxed) > 0 {
            self.last_event = Some(Instant::now());
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
        // In event mode the watchdog counts from the end of the cycle that
        // read the last event (reading one stops the count): a call that
        // delivered may return to an embedding app without sleeping, and
        // the deadline armed below is what wakes its epoll. (The modes
        // that poll come back for more after a delivery, and start it
        // when they sleep.)
        let start_watchdog = self.opts.mode == Mode::Event
            && self.last_event.is_none()
            && self.opts.watchdog.is_some()
            && sh.outstanding.load(Relaxed) > 0;
        let timed = start_watchdog
            || !self.keepalives.is_empty()
            || self.drains.in_progress()
            || self.watchdog_since(sh).is_some();
        let now = timed.then(Instant::now);
        if start_watchdog {
            self.last_event = now;
        }
        let mut n = 0;
        if let Some(now) = now {
            if !self.keepalives.is_empty() {
                for cq in self.keepalives.send_cqs_due(now) {
                    if let Some(r) = self.entries.find(cq) {
                        n += self.drain(ctl, r, honor_stop)?;
                    }
                }
                let (posted, dead, destroyed) = self.keepalives.tick(now);
                sh.counters.keepalive_probes.bump(posted);
                sh.forget_keepalives_of(&destroyed);
                // Every dead peer's QP drained before any on_dead, which
                // may destroy its QP or remove another's keepalive.
                for &qpn in &dead {
                    self.drain_dead_peer(qpn);
                }
                for qpn in dead {
                    sh.counters.keepalive_dead.bump(1);
                    if let Some(f) = self.keepalives.on_dead(qpn) {
                        f(qpn, ctl);
                        // Its changes take effect now, as a handler's do:
                        // a CQ it removed is not polled (the watchdog below,
                        // a later on_dead's) and its handler never runs.
                        self.apply_cmds(ctl);
                    }
                }
            }
            if let (Some(t), Some(since)) = (self.opts.watchdog, self.watchdog_since(sh)) {
                if now.saturating_duration_since(since) >= t {
                    sh.counters.watchdog_polls.bump(1);
                    self.last_event = Some(now);
                    n += self.poll_all(ctl, honor_stop)?;
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
