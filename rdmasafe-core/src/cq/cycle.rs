//! The cycle, per mode (see `event_loop` for the steps). Event mode's
//! cycle is `event_cycle`; busy-poll's is `poll_cycle`; adaptive switches
//! between the two.

use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

use super::control::{Completion, LoopControl, Shared, KEY_CHANNEL, KEY_TIMER, KEY_WAKE};
use super::core::{io_err, Core, List};
use super::options::Mode;
use super::stats::Bump;
use crate::sys::{self, Wait};
use crate::Result;

impl Core {
    // -------------------------------------------------------------- cycles

    pub(super) fn begin_cycle(&mut self) {
        self.cycle_start = None;
        self.last_stamp = None;
    }

    pub(super) fn record_wakeup(&mut self, sh: &Shared, n: usize) {
        let c = &sh.counters;
        c.wakeups.bump(1);
        if n == 0 {
            c.empty_wakeups.bump(1);
        }
        c.per_wakeup.record(n as u64);
        if self.opts.timing_stats {
            let us = match (self.cycle_start, self.last_stamp) {
                (Some(a), Some(b)) => b.duration_since(a).as_micros() as u64,
                _ => 0,
            };
            c.cycle_us.record(us);
        }
        log::trace!(target: "rdmasafe", "CQ loop wakeup: {n} completions");
    }

    /// Waits per `wait` (bounded by the next deadline) on the loop's epoll
    /// fd. Returns the ready keys as bits (0 on timeout).
    pub(super) fn sleep(&mut self, ctl: &LoopControl, wait: Wait) -> Result<u64> {
        let sh = &*ctl.0;
        let mut ms: i32 = match wait {
            Wait::None => 0,
            Wait::Forever => -1,
            Wait::For(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
        };
        // Nothing timed (the common case): no deadline to bound the wait,
        // no watchdog to start, the timerfd disarmed already.
        if !self.untimed() {
            ms = self.bound_by_deadline(sh, ms);
        }
        if let Some(h) = self.hook.as_mut() {
            h();
        }
        sh.counters.sleeps.bump(1);
        let bits = sh.epoll.wait(ms).map_err(io_err("epoll_wait"))?;
        if bits & (1 << KEY_WAKE) != 0 {
            // Drain first, then clear: a waker that comes in between sees
            // the flag still set and does not write, and what it queued is
            // looked at after this sleep. The other order can eat its write
            // while the flag stays set, and no later wake() would ever write.
            sh.wake.drain();
            if let Some(h) = self.woke_hook.as_mut() {
                h();
            }
            sh.wake_set.store(false, SeqCst);
        }
        if bits & (1 << KEY_TIMER) != 0 {
            sh.timer.drain();
            self.timer_at = None;
        }
        Ok(bits)
    }

    /// Starts the watchdog, keeps the timerfd armed for the next deadline
    /// and bounds a wait of `ms` (-1: none) by it.
    #[inline(never)]
    fn bound_by_deadline(&mut self, sh: &Shared, mut ms: i32) -> i32 {
        self.watchdog_start(sh);
        let deadline = self.next_deadline(sh);
        self.arm_timer(sh, deadline);
        if let Some(d) = deadline {
            let left =
                d.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            ms = if ms < 0 { left } else { ms.min(left) };
        }
        ms
    }

    /// One cycle in the loop's mode; the completions delivered.
    pub(super) fn cycle(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        self.apply_cmds(ctl);
        if honor_stop && ctl.0.stop.load(SeqCst) {
            return Ok(0);
        }
        match self.opts.mode {
            Mode::Event => self.event_cycle(ctl, wait, honor_stop),
            Mode::BusyPoll => self.poll_cycle(ctl, wait, None, honor_stop),
            Mode::Adaptive { spin } => self.adaptive_cycle(ctl, wait, spin, honor_stop),
            Mode::Learning => self.adaptive_cycle(ctl, wait, Duration::from_micros(50), honor_stop),
        }
    }

    /// Arms and drains new CQs, drains CQs over their budget; if that gave
    /// nothing, sleeps, then reads events and drains what fired (re-arming
    /// first when `rearm`).
    pub(super) fn event_cycle(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        self.begin_cycle();
        let mut n = if self.unarmed.is_empty() { 0 } else { self.work_list(ctl, List::Unarmed, true, honor_stop)? };
        // Whether the channel was read (non-blocking) in this cycle already.
        let mut read_now = false;
        if !self.ready.is_empty() {
            // A CQ is over its budget: before it gets another one, serve
            // the CQs that fired meanwhile (a non-blocking read), so a CQ
            // that keeps refilling cannot keep the others' events unread.
            // (Nothing armed: no event can be due, no read.)
            if self.armed > 0 {
                read_now = true;
                if self.read_events(ctl)? > 0 {
                    // Events are pending when looked for: the read-first
                    // heuristic hears it too.
                    self.read_first.outcome(true);
                }
            }
            if !self.fired.is_empty() {
                let rearm = self.polling_since.is_none() && self.opts.mode == Mode::Event;
                n += self.work_list(ctl, List::Fired, rearm, honor_stop)?;
            }
            n += self.work_ready(ctl, honor_stop)?;
        }
        if n > 0 {
            n += self.tick(ctl, honor_stop)?;
            self.record_wakeup(sh, n);
            return Ok(n);
        }
        let bits = if self.has_work_now(sh) {
            1 << KEY_CHANNEL
        } else if read_now {
            // The fairness read above just emptied the channel: a second
            // read now would only say EAGAIN (and count against reading
            // first). Sleep.
            self.sleep(ctl, wait)?
        } else if self.armed > 0 && self.read_first.choose() {
            // Read first: an event already in the channel costs the one
            // read the hand-written loop makes, and no epoll_wait.
            let found = self.read_events(ctl)? > 0;
            self.read_first.outcome(found);
            if found {
                0
            } else {
                self.sleep(ctl, wait)?
            }
        } else {
            if self.armed > 0 {
                self.read_first.slept();
            }
            self.sleep(ctl, wait)?
        };
        self.begin_cycle();
        self.apply_cmds(ctl);
        if bits & (1 << KEY_CHANNEL) != 0 {
            self.read_events(ctl)?;
        }
        let woke = !self.fired.is_empty();
        let rearm = self.polling_since.is_none() && self.opts.mode == Mode::Event;
        let mut n = if woke { self.work_list(ctl, List::Fired, rearm, honor_stop)? } else { 0 };
        n += self.tick(ctl, honor_stop)?;
        if woke || n > 0 {
            self.record_wakeup(sh, n);
        }
        Ok(n)
    }

    /// Polls every CQ until completions arrive, `wait` runs out, the
    /// adaptive `spin` passes without completions, or a stop / change.
    pub(super) fn poll_cycle(
        &mut self,
        ctl: &LoopControl,
        wait: Wait,
        spin: Option<Duration>,
        honor_stop: bool,
    ) -> Result<usize> {
        let sh = &*ctl.0;
        if wait == Wait::None {
            // One pass, no clock.
            self.begin_cycle();
            let mut n = self.poll_all(ctl, honor_stop)?;
            n += self.tick(ctl, honor_stop)?;
            if n > 0 {
                if spin.is_some() {
                    self.polling_since = self.last_stamp.or_else(|| Some(Instant::now()));
                }
                self.record_wakeup(sh, n);
            } else if let (Some(s), Some(since)) = (spin, self.polling_since) {
                if Instant::now().saturating_duration_since(since) >= s {
                    self.polling_since = None;
                }
            }
            return Ok(n);
        }
        // Only a deadline, a spin limit or a timer needs the clock; plain
        // busy polling never reads it (timing statistics aside).
        let timed = matches!(wait, Wait::For(_)) || spin.is_some() || self.next_deadline(sh).is_some();
        let start = timed.then(Instant::now);
        let deadline = match (wait, start) {
            (Wait::For(d), Some(start)) => Some(sys::deadline_after(start, d)),
            _ => None,
        };
        let idle_from = self.polling_since.or(start);
        loop {
            self.begin_cycle();
            let mut n = self.poll_all(ctl, honor_stop)?;
            n += self.tick(ctl, honor_stop)?;
            if n > 0 {
                if spin.is_some() {
                    self.polling_since = self.last_stamp.or(start);
                }
                self.record_wakeup(sh, n);
                return Ok(n);
            }
            if (honor_stop && sh.stop.load(Relaxed)) || sh.cmds_pending.load(Relaxed) {
                return Ok(0);
            }
            if timed {
                let now = Instant::now();
                if let (Some(s), Some(idle)) = (spin, idle_from) {
                    if now.saturating_duration_since(idle) >= s {
                        self.polling_since = None;
                        return Ok(0);
                    }
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(0);
                }
            }
            std::hint::spin_loop();
        }
    }

    pub(super) fn adaptive_cycle(
        &mut self,
        ctl: &LoopControl,
        wait: Wait,
        spin: Duration,
        honor_stop: bool,
    ) -> Result<usize> {
        if self.polling_since.is_some() {
            let n = self.poll_cycle(ctl, wait, Some(spin), honor_stop)?;
            if n > 0 || self.polling_since.is_some() {
                return Ok(n);
            }
            // Idle for `spin`: sleep from now on. Events raised while we
            // polled are for completions already delivered: count them, then
            // arm every CQ that is not armed and drain it once more.
            self.read_events(ctl)?;
            self.fired.clear();
            for e in self.entries.iter_mut() {
                e.in_fired = false;
            }
            for i in 0..self.entries.slot_count() {
                if let Some(r) = self.entries.ref_at(i) {
                    if self.entries.get(r).is_some_and(|e| !e.armed) {
                        self.push_unarmed(r);
                    }
                }
            }
        }
        let n = self.event_cycle(ctl, wait, honor_stop)?;
        if n > 0 {
            // Woken (or new CQs had completions): poll from now on; CQs
            // that fired stay unarmed until the next sleep arms them.
            self.polling_since = self.last_stamp.or_else(|| Some(Instant::now()));
        }
        Ok(n)
    }

    /// Runs cycles (ignoring stop requests, which are for `run`) until `c`
    /// is done: a drain driven by a caller while nobody runs the loop.
    pub(crate) fn drive_until(&mut self, ctl: &LoopControl, c: &Completion) {
        while !c.is_done() && !self.shut {
            if let Err(e) = self.cycle(ctl, Wait::For(Duration::from_millis(100)), false) {
                if e.errno() != libc::EINTR {
                    log::warn!(target: "rdmasafe", "CQ loop: a cycle failed while draining: {e}");
                    std::thread::yield_now();
                }
            }
        }
    }

    /// After a stop: flush acks, forget arm state (the next run re-arms and
    /// drains, so completions left in a CQ at stop are delivered then),
    /// consume the stop request and its wakeup.
    pub(super) fn finish_stop(&mut self, sh: &Shared) {
        sh.wake.drain(); // then clear the flag: see `sleep`
        sh.wake_set.store(false, SeqCst);
        self.flush_all(sh);
        for r in self.entries.refs() {
            if let Some(e) = self.entries.get_mut(r) {
                e.armed = false;
            }
            self.push_unarmed(r);
        }
        self.armed = 0;
        self.polling_since = None;
        sh.stop.store(false, SeqCst);
    }
}
