//! The cycle, per mode (see `event_loop` for the steps). Event mode's
//! cycle is `event_cycle`; busy-poll's is `poll_cycle`; adaptive switches
//! between the two.

use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

use super::control::{Completion, LoopControl, Shared, KEY_CHANNEL, KEY_TIMER, KEY_WAKE};
use super::core::{io_err, Core, List};
use super::learn::{ns, CALIBRATE_NS};

/// Learning mode reads the clock once per this many empty polling passes.
const CLOCK_EVERY: u32 = 4;
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

    #[inline(always)]
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
        let mut ms: i32 = wait.poll_ms();
        let learning = self.opts.mode == Mode::Learning;
        if learning && self.learn.calibrating && self.learn.wake_at.is_none() {
            // A calibration: timed from now, when the sleep begins (from
            // the decision to sleep, the re-arm and final drain may take
            // longer than the calibration on a slow machine).
            self.learn.wake_at = Some(Instant::now() + Duration::from_nanos(CALIBRATE_NS));
        }
        // Nothing timed (the common case): no deadline to bound the wait,
        // no watchdog to start, the timerfd disarmed already.
        if !self.untimed() {
            ms = self.bound_by_deadline(sh, ms);
        }
        if let Some(h) = self.hook.as_mut() {
            h();
        }
        sh.counters.sleeps.bump(1);
        let before = learning.then(Instant::now);
        let bits = sh.epoll.wait(ms).map_err(io_err("epoll_wait"));
        if let Some(t1) = before {
            let t2 = Instant::now();
            self.learn.slept = Some((t1, t2));
            self.learn.blocked = ms != 0;
            // The plan's (or a calibration's) timer fired: only then is
            // t2 - wake_at its lateness. The sleep must have begun before
            // the time asked for, unless the app's own epoll did the waiting
            // (no wait here: it called when the fd became readable).
            if let (Ok(b), Some(at)) = (&bits, self.learn.wake_at) {
                if b & (1 << KEY_TIMER) != 0 && t2 >= at {
                    self.learn.wake_at = None;
                    self.learn.fired = Some((at, t1 <= at || wait == Wait::None));
                }
            }
        }
        let bits = bits?;
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
            let left = Wait::until(d).poll_ms();
            ms = if ms < 0 { left } else { ms.min(left) };
        }
        ms
    }

    /// One cycle in the loop's mode; the completions delivered.
    pub(super) fn cycle(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        self.cycle_with(ctl, honor_stop, |core| match core.opts.mode {
            Mode::Event => core.event_cycle::<true>(ctl, wait, honor_stop),
            Mode::BusyPoll => core.poll_cycle(ctl, wait, None, honor_stop),
            Mode::Adaptive { spin } => core.adaptive_cycle(ctl, wait, spin, honor_stop),
            Mode::Learning => core.learning_cycle(ctl, wait, honor_stop),
        })
    }

    /// Cycles until a stop (`CqLoop::run`; the stop is left for the caller
    /// to finish). In event mode all in this one frame: no call and no
    /// mode dispatch per cycle (about twenty instructions fewer per
    /// completion of the common wakeup, `tests/bench/cq-callgrind.sh`).
    pub(super) fn run_until_stop(&mut self, ctl: &LoopControl) -> Result<()> {
        let event = self.opts.mode == Mode::Event;
        while !ctl.0.stop.load(SeqCst) {
            let r = if event {
                self.cycle_with(ctl, true, |core| core.event_cycle::<true>(ctl, Wait::Forever, true))
            } else {
                self.cycle(ctl, Wait::Forever, true)
            };
            if let Err(e) = r {
                if e.errno() != libc::EINTR {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// A cycle's frame around `work` (the mode's cycle): queued changes
    /// applied, a stop honoured, and what an earlier cycle that ended early
    /// left undone settled first (see [`Core::settle`]).
    #[inline(always)]
    fn cycle_with(
        &mut self,
        ctl: &LoopControl,
        honor_stop: bool,
        work: impl FnOnce(&mut Core) -> Result<usize>,
    ) -> Result<usize> {
        self.apply_cmds(ctl);
        if honor_stop && ctl.0.stop.load(SeqCst) {
            return Ok(0);
        }
        if self.unsettled {
            self.settle();
        }
        self.unsettled = true;
        let r = work(self);
        match &r {
            // A signal ends only the sleep, which comes after the cycle's
            // work (every CQ armed): nothing was left undone.
            Ok(_) => self.unsettled = false,
            Err(e) if e.errno() == libc::EINTR => self.unsettled = false,
            Err(_) => {}
        }
        r
    }

    /// After a cycle that ended early (an error, or a handler's panic
    /// unwinding through it): what it left undone may leave a CQ unarmed
    /// and on no list (a mode that polls drains what fired without
    /// re-arming it, and the spin that would poll it never started; a
    /// watchdog's poll took CQs off the ready list). So every CQ is armed
    /// and drained again before the loop may sleep: they go on the unarmed
    /// list (worked at the next event cycle's start, or when a spin in
    /// progress ends), and a return to the app leaves the loop's fd
    /// readable for it (`Held`'s drop). O(CQs), only after such a cycle.
    #[cold]
    pub(crate) fn settle(&mut self) {
        self.unsettled = false;
        for i in 0..self.entries.slot_count() {
            if let Some(r) = self.entries.ref_at(i) {
                self.push_unarmed(r);
            }
        }
    }

    /// Arms and drains new CQs, drains CQs over their budget; if that gave
    /// nothing, sleeps, then reads events and drains what fired (re-arming
    /// first when `rearm`).
    /// `EVENT`: the loop is in event mode (`opts.mode == Mode::Event`),
    /// known when compiled so event mode's cycle tests no mode.
    #[inline(always)]
    pub(super) fn event_cycle<const EVENT: bool>(
        &mut self,
        ctl: &LoopControl,
        wait: Wait,
        honor_stop: bool,
    ) -> Result<usize> {
        debug_assert_eq!(EVENT, self.opts.mode == Mode::Event);
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
                if self.read_events(ctl, true)? > 0 {
                    // Events are pending when looked for: the read-first
                    // heuristic hears it too.
                    self.read_first.outcome(true);
                }
            }
            if !self.fired.is_empty() {
                let rearm = self.polling_since.is_none() && EVENT;
                n += self.work_list(ctl, List::Fired, rearm, honor_stop)?;
            }
            n += self.work_ready(ctl, honor_stop)?;
        }
        if n == 0 && !EVENT && self.armed < self.entries.len() {
            // The loop sleeps below, and a mode that polls does not re-arm
            // what fired (it polls it when completions came): a CQ whose
            // event came for completions something else took (an earlier
            // drain, a keepalive's or the watchdog's), or only the loop's
            // own (which start no polling), is unarmed now and on no list,
            // in this cycle (the fairness read above) or from the last
            // one's wake (see `has_work_now`). So a polling mode arms every
            // CQ, and drains it once more, before it sleeps. (O(CQs), only
            // when one is unarmed: every CQ is armed while it sleeps.)
            self.push_all_disarmed();
            n += self.work_list(ctl, List::Unarmed, true, honor_stop)?;
        }
        if n > 0 {
            n += self.tick(ctl, honor_stop)?;
            self.record_wakeup(sh, n);
            return Ok(n);
        }
        // Event mode reads on after a first event only as `ReadMore` says;
        // the modes that poll read every event (see `ReadMore`).
        let all = !EVENT;
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
            let found = self.read_events(ctl, all)? > 0;
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
            self.read_events(ctl, all)?;
        }
        let woke = !self.fired.is_empty();
        let rearm = self.polling_since.is_none() && EVENT;
        let mut n = if !woke {
            0
        } else if rearm && self.fired_is_one() {
            // The common wakeup (see `fast`).
            self.work_fired_one(ctl, honor_stop)?
        } else {
            self.work_list(ctl, List::Fired, rearm, honor_stop)?
        };
        n += self.tick(ctl, honor_stop)?;
        if woke || n > 0 {
            self.record_wakeup(sh, n);
        }
        Ok(n)
    }

    /// Polls every CQ until completions arrive, `wait` runs out, the
    /// adaptive `spin` passes without completions, or a stop / change.
    #[inline(never)]
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
            let n = self.poll_pass(ctl, spin, honor_stop, || Some(Instant::now()))?;
            if let (0, Some(s), Some(since)) = (n, spin, self.polling_since) {
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
            // A pass that delivers restarts the spin from now (read only
            // then, in adaptive mode: its empty passes read the clock
            // anyway), not from this call's start: the spin lasts `spin`
            // after the last completion also when it came late in a call.
            let n = self.poll_pass(ctl, spin, honor_stop, || Some(Instant::now()))?;
            if n > 0 {
                return Ok(n);
            }
            // (A thread waiting to run the loop ends a foreign drive's spin,
            // `honor_stop == false`; a runner never waits for a runner.)
            let handover = !honor_stop && sh.wanted.load(Relaxed) > 0;
            if (honor_stop && sh.stop.load(Relaxed)) || sh.cmds_pending.load(Relaxed) || handover {
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

    /// One pass of [`Core::poll_cycle`]: every CQ polled, the timers
    /// ticked. A pass that handed a completion to a handler (not only the
    /// loop's own: a keepalive probe's or a drain marker's do not renew
    /// it) restarts the spin, from the pass's stamp or else `unstamped()`.
    #[inline(always)]
    fn poll_pass(
        &mut self,
        ctl: &LoopControl,
        spin: Option<Duration>,
        honor_stop: bool,
        unstamped: impl FnOnce() -> Option<Instant>,
    ) -> Result<usize> {
        self.begin_cycle();
        let own0 = self.own_taken;
        let mut n = self.poll_all(ctl, honor_stop)?;
        n += self.tick(ctl, honor_stop)?;
        if n > 0 {
            if spin.is_some() && self.delivered(own0, n) > 0 {
                self.polling_since = self.last_stamp.or_else(unstamped);
            }
            self.record_wakeup(&ctl.0, n);
        }
        Ok(n)
    }

    #[inline(never)]
    pub(super) fn adaptive_cycle(
        &mut self,
        ctl: &LoopControl,
        mut wait: Wait,
        spin: Duration,
        honor_stop: bool,
    ) -> Result<usize> {
        if self.polling_since.is_some() {
            let deadline = Self::deadline_of(wait);
            let n = self.poll_cycle(ctl, wait, Some(spin), honor_stop)?;
            if n > 0 || self.polling_since.is_some() {
                return Ok(n);
            }
            self.end_polling(ctl)?;
            wait = deadline.map_or(wait, Wait::until);
        }
        let own0 = self.own_taken;
        let n = self.event_cycle::<false>(ctl, wait, honor_stop)?;
        if self.delivered(own0, n) > 0 {
            // Woken for completions handed to handlers (or new CQs had
            // some): poll from now on; CQs that fired stay unarmed until
            // the next sleep arms them. A wake that took only the loop's
            // own (a keepalive probe, a drain marker) starts no spin.
            self.polling_since = self.last_stamp.or_else(|| Some(Instant::now()));
        }
        Ok(n)
    }

    /// When a timed `wait` runs out, from now: a spin that ends before it
    /// leaves the sleep after it only the rest (the whole wait again would
    /// make a call with a timeout return up to the spin late).
    fn deadline_of(wait: Wait) -> Option<Instant> {
        match wait {
            Wait::For(d) => Some(sys::deadline_after(Instant::now(), d)),
            _ => None,
        }
    }

    /// Polling ends (adaptive modes): sleep from now on. Events raised
    /// while the loop polled are for completions already delivered: count
    /// them, then arm every CQ that is not armed and drain it once more
    /// (the next `event_cycle` does, from the unarmed list).
    fn end_polling(&mut self, ctl: &LoopControl) -> Result<()> {
        self.read_events(ctl, true)?;
        self.fired.clear();
        for e in self.entries.iter_mut() {
            e.in_fired = false;
        }
        self.push_all_disarmed();
        Ok(())
    }

    fn push_all_disarmed(&mut self) {
        for i in 0..self.entries.slot_count() {
            if let Some(r) = self.entries.ref_at(i) {
                if self.entries.get(r).is_some_and(|e| !e.armed) {
                    self.push_unarmed(r);
                }
            }
        }
    }

    /// [`Mode::Learning`]'s cycle: poll per the plan (after completions,
    /// or in a window a timer woke the loop for), else sleep (with the
    /// plan's timer), then learn from what happened: the idle time before
    /// completions, the wake's lateness, the overhead of the sleep.
    #[inline(never)]
    pub(super) fn learning_cycle(&mut self, ctl: &LoopControl, mut wait: Wait, honor_stop: bool) -> Result<usize> {
        // The loop's own completions (keepalive probes, drain markers) the
        // spin took before it decided to sleep.
        let mut spun = 0;
        if self.polling_since.is_some() {
            let deadline = Self::deadline_of(wait);
            spun = self.learning_spin(ctl, wait, honor_stop)?;
            if self.polling_since.is_some() {
                return Ok(spun);
            }
            self.end_polling(ctl)?;
            wait = deadline.map_or(wait, Wait::until);
            self.plan_sleep();
            self.publish_plan(&ctl.0);
        }
        let handed = self.learn.handed;
        self.learn.event_cycles = self.learn.event_cycles.wrapping_add(1);
        let own0 = self.own_taken;
        let r = self.event_cycle::<false>(ctl, wait, honor_stop);
        // Taken whatever happened: a sleep that ended in an error (EINTR)
        // must not leave a decision or a timer wake for a later sleep to
        // measure against.
        let (slept, decided, fired) = (self.learn.slept.take(), self.learn.decided.take(), self.learn.fired.take());
        let n = r?;
        // Only completions handed to handlers are arrivals: the loop's own
        // came on its own schedule (a keepalive's period), and as arrivals
        // they would teach the loop a window around each probe.
        let arrived = self.delivered(own0, n) > 0;
        let n = n + spun;
        // A CQ's budget left completions of this wake for the next cycles.
        let budget_left = !self.ready.is_empty();
        let l = &mut self.learn;
        if let (Some(t), Some((t1, _))) = (decided, slept) {
            // The work around a sleep: what it took to get from the decision
            // to epoll_wait (the re-arm and final drain), about as much again
            // after the wake (read, ack).
            l.model.overhead_sample(ns(t1.saturating_duration_since(t)).saturating_mul(2));
        }
        if arrived {
            if slept.is_some() && l.blocked {
                // The completions this wake's cycle handed to handlers each
                // waited for the wake (the loop's own keepalive probes and
                // drain markers are not handed; see `Learn::handed`), and so
                // did those a CQ's budget left for the next cycles: the
                // batch runs on until the cycle that leaves no CQ over its
                // budget. Completions that arrive after the wake (a reply's
                // own send completion, posted by the handler) did not wait
                // for it. A zero-timeout wait (Wait::None or a zero
                // Wait::For: an app's epoll drives the loop, or a reactor
                // calls it back to back; or a deadline was due) was no sleep
                // of the loop's: what it found is no wake's batch.
                l.batch_from = Some(handed);
                if !budget_left {
                    l.end_batch();
                }
            }
            let now = match slept {
                // Woken by the completions' event: they came about one
                // wake-up latency before the loop ran again (and not before
                // it went to sleep).
                Some((t1, t2)) => t2.checked_sub(Duration::from_nanos(l.model.lateness())).unwrap_or(t2).max(t1),
                None => Instant::now(),
            };
            Self::end_idle(l, &ctl.0, now);
            l.wake_at = None;
            l.calibrating = false;
            l.spin_until = l.model.plan().spin;
            self.polling_since = Some(now);
            return Ok(n);
        }
        if let (Some((at, measured)), Some((_, t2))) = (fired, slept) {
            if measured {
                l.model.lateness_sample(ns(t2.saturating_duration_since(at)));
            }
            // A calibration's wake: measured, sleep on. The plan's: poll
            // until its window ends.
            let calibration = std::mem::take(&mut l.calibrating);
            let window = l.model.plan().window.filter(|_| !calibration);
            let c = &ctl.0.counters;
            if calibration {
                c.learn_calibrations.bump(1);
            }
            if let Some((_, until)) = window {
                c.learn_timer_wakes.bump(1);
                l.spin_until = until;
            }
            self.publish_plan(&ctl.0);
            if window.is_some() {
                self.polling_since = Some(t2);
                return Ok(n);
            }
        }
        // Nothing arrived (the caller's time ran out, a command came, or
        // only the loop's own completions): the idle time goes on. If the
        // call returns to the app now, the call marks it (`leave_to_app`).
        Ok(n)
    }

    /// The plan and wake cost, for the stats (a few relaxed stores per
    /// sleep).
    fn publish_plan(&self, sh: &Shared) {
        let (m, c) = (&self.learn.model, &sh.counters);
        let p = m.plan();
        let (from, to) = p.window.unwrap_or((0, 0));
        c.learn_spin_ns.store(p.spin, Relaxed);
        c.learn_window_from_ns.store(from, Relaxed);
        c.learn_window_to_ns.store(to, Relaxed);
        c.learn_wake_cost_ns.store(m.wake_cost(), Relaxed);
        c.learn_wake_batch_milli.store(m.wake_batch_256() * 1000 / 256, Relaxed);
    }

    /// Learning mode's poll: until completions arrive, `learn.spin_until`
    /// after the idle start passes, `wait` runs out, or a stop / change.
    /// The clock is read at the first empty pass (the idle start), then
    /// once per [`CLOCK_EVERY`] empty passes (a clock read is a system call
    /// on some VMs: reading it on every pass would slow the polling down),
    /// and when completions come after an idle time; not while completions
    /// keep coming. The loop's own completions (keepalive probes, drain
    /// markers) are taken, counted in the result, and otherwise ignored: the
    /// idle time goes on.
    fn learning_spin(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let mut deadline = None;
        let mut own = 0;
        loop {
            self.begin_cycle();
            let own0 = self.own_taken;
            let mut n = self.poll_all(ctl, honor_stop)?;
            n += self.tick(ctl, honor_stop)?;
            if n > 0 {
                self.record_wakeup(sh, n);
                if self.learn.batch_from.is_some() && self.ready.is_empty() {
                    // The budget's leftovers of the last wake are handed.
                    self.learn.end_batch();
                }
                if self.delivered(own0, n) > 0 {
                    if self.learn.idle_start.is_some() {
                        let now = Instant::now();
                        Self::end_idle(&mut self.learn, sh, now);
                        self.polling_since = Some(now);
                    }
                    self.learn.spin_until = self.learn.model.plan().spin;
                    return Ok(own + n);
                }
                own += n;
            }
            // (A thread waiting to run the loop ends a foreign drive's spin.)
            let handover = !honor_stop && sh.wanted.load(Relaxed) > 0;
            if (honor_stop && sh.stop.load(Relaxed)) || sh.cmds_pending.load(Relaxed) || handover {
                return Ok(own);
            }
            self.learn.passes = self.learn.passes.wrapping_add(1);
            if self.learn.idle_start.is_some() && self.learn.passes % CLOCK_EVERY != 0 && wait != Wait::None {
                std::hint::spin_loop();
                continue;
            }
            if self.learn.idle_start.is_none() {
                // The first empty poll since completions came.
                self.learn.end_batch();
            }
            let now = Instant::now();
            let idle = *self.learn.idle_start.get_or_insert(now);
            if ns(now.saturating_duration_since(idle)) >= self.learn.spin_until {
                self.polling_since = None;
                self.learn.decided = Some(now);
                return Ok(own);
            }
            match wait {
                Wait::None => return Ok(own),
                Wait::For(d) => {
                    let d = *deadline.get_or_insert_with(|| sys::deadline_after(now, d));
                    if now >= d {
                        // Still polling: the next call spins on from the
                        // idle start (see `leave_to_app`).
                        return Ok(own);
                    }
                }
                Wait::Forever => {}
            }
            std::hint::spin_loop();
        }
    }

    /// Completions came at `now`: ends the idle time, counting it in the
    /// stats if it was a sample (see `Learn::end_idle`).
    fn end_idle(l: &mut super::learn::Learn, sh: &Shared, now: Instant) {
        if l.end_idle(now) {
            sh.counters.learn_idle_samples.bump(1);
        }
    }

    /// `process_once`'s cycles: until a handler got completions (returns
    /// how many), `wait` runs out or a stop (0), or an error. The loop's
    /// own work (a keepalive probe, a timer wake, a CQ just added, a
    /// wake-up) ends no call: an app calling again at once would otherwise
    /// see 0 for a timeout that did not happen, and learning mode would
    /// take each such return for the app's time. `Wait::None`: one cycle.
    /// The clock is read only under `Wait::For`: at the start and after a
    /// cycle that delivered nothing.
    pub(super) fn deliver_within(&mut self, ctl: &LoopControl, wait: Wait) -> Result<usize> {
        let deadline = match wait {
            Wait::For(d) => Some(sys::deadline_after(Instant::now(), d)),
            _ => None,
        };
        let mut w = wait;
        loop {
            let own0 = self.own_taken;
            let n = self.cycle(ctl, w, true)?;
            let n = self.delivered(own0, n);
            if n > 0 || wait == Wait::None || ctl.0.stop.load(SeqCst) {
                return Ok(n);
            }
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return Ok(0);
                }
                w = Wait::For(d - now);
            }
        }
    }

    /// The loop returns to the app (`process_once` with a wait, the end of
    /// `run_for`, a caller's drive): an idle time in progress then spans
    /// the app's own time until it calls again, which is no loop idle time,
    /// so it will be no sample (learning mode). The idle start, and the
    /// plan's spin and timer measured from it, are kept: resetting it would
    /// keep a loop called with short waits from ever sleeping, and would
    /// stretch a window the timer wakes the loop for. An app that embeds
    /// the loop (`Wait::None`: it calls when the loop's fd is readable) or
    /// calls it back to back (a zero `Wait::For`) is not away: its idle
    /// times are the loop's; nor is one that calls again after an EINTR.
    pub(super) fn leave_to_app(&mut self) {
        if self.learn.idle_start.is_some() {
            self.learn.idle_outside = true;
        }
    }

    /// Learning mode goes to sleep: set the plan's timer if its window is
    /// still ahead, else (now and then) a short one that measures the
    /// wake-up latency.
    fn plan_sleep(&mut self) {
        let l = &mut self.learn;
        let now = l.decided.unwrap_or_else(Instant::now);
        l.wake_at = None;
        l.calibrating = false;
        if let (Some((from, _)), Some(start)) = (l.model.plan().window, l.idle_start) {
            let early = from.saturating_sub(l.model.lateness());
            let at = start + Duration::from_nanos(early);
            if at > now {
                l.wake_at = Some(at);
            }
        }
        if l.wake_at.is_none() && l.model.calibrate_now() {
            // Timed by `sleep`, from when it begins.
            l.calibrating = true;
        }
    }

    /// Runs cycles (ignoring stop requests, which are for `run`) until `c`
    /// is done: a drain driven by a caller while nobody runs the loop.
    pub(crate) fn drive_until(&mut self, ctl: &LoopControl, c: &Completion) {
        // Until done, or until a thread wants to run the loop (it takes
        // over; the caller then waits for it).
        while !c.is_done() && !self.shut && ctl.0.wanted.load(SeqCst) == 0 {
            if let Err(e) = self.cycle(ctl, Wait::For(Duration::from_millis(100)), false) {
                if e.errno() != libc::EINTR {
                    log::warn!(target: "rdmasafe", "CQ loop: a cycle failed while draining: {e}");
                    std::thread::yield_now();
                }
            }
        }
        // Back to the caller (also when a runner takes the loop over: it
        // may be one that does not cycle, `flush_acks`, and a lost sample
        // costs less than one with the app's time in it).
        self.leave_to_app();
        // An app that embeds the loop waits on its fd, which this drive's
        // sleeps may have drained: if the loop has work (an adaptive loop
        // still polling, with CQs that fired left unarmed) or a stop came
        // meanwhile (this drive does not take it), make the fd readable
        // again, as `process_once` does.
        if !self.shut && (self.has_work_now(&ctl.0) || ctl.0.stop.load(SeqCst)) {
            ctl.0.wake();
        }
    }

    /// A stop seen by `process_once` / `process_ready`: as `finish_stop`,
    /// and, for an app that embeds the loop (`embedded`: it waits on the
    /// loop's fd, not in the loop), the fd is made readable again when the
    /// loop has CQs, since the next call is the one that re-arms them (the
    /// app's epoll would otherwise wait for events that unarmed CQs never
    /// raise).
    pub(super) fn finish_stop_after(&mut self, sh: &Shared, embedded: bool) {
        self.finish_stop(sh);
        if embedded {
            self.wake_if_work(sh);
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
        // The next run's watchdog begins a period of its own.
        self.watchdog_from = None;
        let l = &mut self.learn;
        (l.wake_at, l.idle_start, l.calibrating, l.decided, l.slept, l.fired) = (None, None, false, None, None, None);
        (l.batch_from, l.idle_outside) = (None, false);
        let next = self.next_deadline(sh);
        self.arm_timer(sh, next);
        sh.stop.store(false, SeqCst);
    }
}
