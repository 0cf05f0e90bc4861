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
//!    epoll fd (the channel, a wake eventfd, a timerfd for deadlines);
//! 4. read every ready CQ event (the fd is non-blocking), count one pending
//!    ack on the CQ the event *names*, found in O(1);
//! 5. for each CQ that fired: re-arm it, *then* drain it, at most its budget
//!    (re-arming before the final drain closes the window in which a
//!    completion lands after the last empty poll and no event follows);
//! 6. ack in batches, and always everything before stop, removal and drop.
//!
//! Per wakeup the work is proportional to the CQs that fired. Busy-poll
//! mode never arms and never sleeps, polling every CQ; adaptive mode polls
//! every CQ while completions keep coming and for `spin` after the last,
//! then arms them all and sleeps like event mode.
//!
//! Ownership: a CQ must leave the loop (removal done, or the loop dropped)
//! before `ibv_destroy_cq`: that destroy waits for acks only the loop can
//! give, and a loop polling a destroyed CQ reads freed memory.

use std::collections::{HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use super::control::{Cmd, Completion, Done, Held, LoopControl, Shared, KEY_CHANNEL, KEY_TIMER, KEY_WAKE};
use super::drain::Drains;
use super::entries::{Entries, Entry, Ref};
use super::handle::{LiveChannel, LiveCq};
use super::keepalive::Keepalives;
use super::options::{CqOptions, LoopOptions, Mode};
use super::stats::LoopStats;
use super::{registry, Handler};
use crate::sys::{self, ibv_comp_channel, ibv_cq, ibv_wc, Wait};
use crate::verbs::{empty_wc, CompChannel, Cq};
use crate::{Error, Result};

/// The loop's state; held by whoever drives the loop (see
/// [`super::control`]).
pub(crate) struct Core {
    chan: LiveChannel,
    /// The channel fd's flags before the loop made it non-blocking.
    orig_flags: i32,
    opts: LoopOptions,
    entries: Entries,
    /// CQs to arm and drain (new, or after a stop / an adaptive spin).
    unarmed: Vec<Ref>,
    /// CQs whose event was read this cycle.
    fired: Vec<Ref>,
    /// CQs that used up their budget with completions left.
    ready: VecDeque<Ref>,
    /// How many CQs are armed and have not fired since.
    armed: usize,
    wcs: Vec<ibv_wc>,
    /// Adaptive mode: `Some(time of last activity)` while polling.
    polling_since: Option<Instant>,
    keepalives: Keepalives,
    drains: Drains,
    hook: Option<Box<dyn FnMut() + Send>>,
    warned_foreign: HashSet<usize>,
    /// What the timerfd is armed for.
    timer_at: Option<Instant>,
    /// Watchdog: when an event or a watchdog poll last happened.
    last_event: Option<Instant>,
    /// Clock stamps of the cycle in progress (clock reads are system calls
    /// on some VMs: once before a cycle's first handler, once after each).
    cycle_start: Option<Instant>,
    last_stamp: Option<Instant>,
    /// Torn down (the fd has its own flags back: never read it again).
    shut: bool,
}

fn io_err(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::new(op, e.raw_os_error().unwrap_or(libc::EIO))
}

impl Core {
    fn new(chan: LiveChannel, opts: LoopOptions) -> Result<Core> {
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
            armed: 0,
            wcs: (0..opts.poll_batch).map(|_| empty_wc()).collect(),
            polling_since: None,
            keepalives: Keepalives::default(),
            drains: Drains::default(),
            hook: None,
            warned_foreign: HashSet::new(),
            timer_at: None,
            last_event: None,
            cycle_start: None,
            last_stamp: None,
            shut: false,
        })
    }

    // ------------------------------------------------------------ changes

    /// Applies every queued change (FIFO).
    pub(crate) fn apply_cmds(&mut self, ctl: &LoopControl) {
        let sh = &*ctl.0;
        while sh.cmds_pending.load(SeqCst) {
            for cmd in sh.take_cmds() {
                self.apply(ctl, cmd);
            }
        }
    }

    fn apply(&mut self, ctl: &LoopControl, cmd: Cmd) {
        let sh = &*ctl.0;
        match cmd {
            Cmd::AddCq { cq, opts, handler } => {
                let r = self.entries.insert(Entry::new(cq, opts, handler));
                self.push_unarmed(r);
                sh.counters.cqs_added.fetch_add(1, Relaxed);
                sh.counters.cqs.store(self.entries.len() as u64, Relaxed);
            }
            Cmd::RemoveCq { cq, done } => {
                let r = self.remove_cq(ctl, cq);
                done.finish(sh, r);
            }
            Cmd::AddKeepalive { qp, cfg, on_dead } => self.keepalives.add(qp, cfg, on_dead, Instant::now()),
            Cmd::RemoveKeepalive { qp_num, done } => {
                self.keepalives.remove(qp_num);
                done.finish(sh, Ok(()));
            }
            Cmd::Drain { qp, srq, timeout, done } => {
                let deadline = sys::deadline_after(Instant::now(), timeout);
                if let Err((done, e)) = self.drains.start(&qp, srq, deadline, done) {
                    done.finish(sh, Err(e));
                }
            }
        }
    }

    fn remove_cq(&mut self, ctl: &LoopControl, cq: usize) -> Result<()> {
        let sh = &*ctl.0;
        let Some(r) = self.entries.find(cq) else {
            return Err(Error::new("rdmasafe_cq_loop_remove_cq", libc::ENOENT));
        };
        // Events already queued for it: read them now (crediting the other
        // CQs' as usual), so its destroy has nothing left to wait for.
        let _ = self.read_events(ctl);
        self.flush(sh, r);
        let e = self.entries.remove(r).expect("found above");
        if e.armed {
            self.armed -= 1;
        }
        registry::release_cq(cq, sh.id);
        let gone = self.keepalives.remove_for_cq(cq);
        sh.forget_keepalives_of(&gone);
        for (done, res) in self.drains.take_for_cq(cq) {
            done.finish(sh, res);
        }
        sh.counters.cqs_removed.fetch_add(1, Relaxed);
        sh.counters.cqs.store(self.entries.len() as u64, Relaxed);
        drop(e); // the handler goes now: never called again
        Ok(())
    }

    fn push_unarmed(&mut self, r: Ref) {
        if let Some(e) = self.entries.get_mut(r) {
            if !e.in_unarmed {
                e.in_unarmed = true;
                self.unarmed.push(r);
            }
        }
    }

    // --------------------------------------------------------------- acks

    fn ack(sh: &Shared, cq: &LiveCq, n: u32) {
        if n == 0 {
            return;
        }
        cq.ack(n);
        let c = &sh.counters;
        c.ack_calls.fetch_add(1, Relaxed);
        c.acked_events.fetch_add(n as u64, Relaxed);
        c.unacked.fetch_sub(n as u64, Relaxed);
    }

    fn flush(&mut self, sh: &Shared, r: Ref) {
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

    /// Reads every ready CQ event; counts an ack on the CQ each names and
    /// marks it fired. An event for a CQ whose add is still queued is
    /// credited to it; one for a CQ not in the loop is acked at once,
    /// counted and logged (once per CQ).
    fn read_events(&mut self, ctl: &LoopControl) -> Result<()> {
        let sh = &*ctl.0;
        loop {
            // Each arm raises at most one event: once every armed CQ has
            // fired, the read could only say EAGAIN.
            if self.armed == 0 && !self.fired.is_empty() {
                return Ok(());
            }
            let Some(ev) = self.chan.get_event()? else { return Ok(()) };
            sh.counters.cq_events.fetch_add(1, Relaxed);
            sh.counters.unacked.fetch_add(1, Relaxed);
            let mut found = self.entries.find(ev.cq_addr());
            if found.is_none() && sh.cmds_pending.load(SeqCst) {
                self.apply_cmds(ctl);
                found = self.entries.find(ev.cq_addr());
            }
            let Some(r) = found else {
                let cq = ev.cq_addr();
                ev.ack();
                sh.counters.unacked.fetch_sub(1, Relaxed);
                sh.counters.foreign_cq_events.fetch_add(1, Relaxed);
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
            let e = self.entries.get_mut(r).expect("found above");
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
                self.flush(sh, r);
            }
            self.last_event = None;
        }
    }

    // ------------------------------------------------------------ draining

    /// Polls `r` until it is empty or its budget is used, handing batches
    /// to its handler. Returns the completions taken from the CQ.
    fn drain(&mut self, ctl: &LoopControl, r: Ref, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let budget = match self.entries.get(r) {
            Some(e) if e.opts.budget > 0 => e.opts.budget,
            Some(_) => usize::MAX,
            None => return Ok(0),
        };
        let mut total = 0;
        loop {
            let Some(e) = self.entries.get(r) else { return Ok(total) };
            let raw = e.cq.poll(&mut self.wcs)?;
            if raw == 0 {
                return Ok(total);
            }
            total += raw;
            let n = if self.keepalives.is_empty() && self.drains.is_empty() { raw } else { self.filter(sh, raw) };
            if n > 0 {
                self.call_handler(ctl, r, n);
            }
            // Fewer than asked: the CQ was empty at that moment (a later
            // completion raises an event: it was armed before this drain).
            if raw < self.wcs.len() || (honor_stop && sh.stop.load(Relaxed)) || self.entries.get(r).is_none() {
                return Ok(total);
            }
            if total >= budget {
                sh.counters.budget_yields.fetch_add(1, Relaxed);
                if let Some(e) = self.entries.get_mut(r) {
                    if !e.in_ready {
                        e.in_ready = true;
                        self.ready.push_back(r);
                    }
                }
                return Ok(total);
            }
        }
    }

    /// Takes the loop's own completions (keepalive probes, drain markers)
    /// out of `wcs[..n]`, notes activity; returns how many are left.
    fn filter(&mut self, sh: &Shared, n: usize) -> usize {
        let now = Instant::now();
        let mut kept = 0;
        for j in 0..n {
            let wc = &self.wcs[j];
            let mut ours = self.drains.note(wc);
            if !ours && !self.keepalives.is_empty() {
                let (probe, ok) = self.keepalives.note(wc, now);
                ours = probe;
                if probe && ok {
                    sh.counters.keepalive_probes_ok.fetch_add(1, Relaxed);
                }
            }
            if !ours {
                self.wcs.swap(kept, j);
                kept += 1;
            }
        }
        kept
    }

    fn call_handler(&mut self, ctl: &LoopControl, r: Ref, n: usize) {
        let sh = &*ctl.0;
        let batch = &self.wcs[..n];
        let errors = batch.iter().filter(|w| w.status != sys::ibv_wc_status::IBV_WC_SUCCESS).count();
        let c = &sh.counters;
        c.completions.fetch_add(n as u64, Relaxed);
        c.error_completions.fetch_add(errors as u64, Relaxed);
        let t = match self.last_stamp {
            Some(t) => t,
            None => {
                let now = Instant::now();
                self.cycle_start.get_or_insert(now);
                now
            }
        };
        let Some(mut handler) = self.entries.get_mut(r).and_then(|e| e.handler.take()) else { return };
        sh.in_handler.store(true, SeqCst);
        let result = catch_unwind(AssertUnwindSafe(|| handler(&self.wcs[..n], ctl)));
        sh.in_handler.store(false, SeqCst);
        let after = Instant::now();
        c.handler_time(after.duration_since(t));
        self.last_stamp = Some(after);
        if let Some(e) = self.entries.get_mut(r) {
            e.handler = Some(handler);
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

    fn work_list(&mut self, ctl: &LoopControl, list: Vec<Ref>, arm: bool, honor_stop: bool) -> Result<usize> {
        let mut n = 0;
        for r in list {
            let Some(e) = self.entries.get_mut(r) else { continue };
            e.in_unarmed = false;
            e.in_fired = false;
            if arm {
                let solicited = e.opts.solicited_only;
                if !e.armed {
                    e.armed = true;
                    self.armed += 1;
                }
                ctl.0.counters.arms.fetch_add(1, Relaxed);
                e.cq.arm(solicited)?;
            }
            n += self.drain(ctl, r, honor_stop)?;
        }
        Ok(n)
    }

    fn work_ready(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let mut n = 0;
        for _ in 0..self.ready.len() {
            let Some(r) = self.ready.pop_front() else { break };
            match self.entries.get_mut(r) {
                Some(e) => e.in_ready = false,
                None => continue,
            }
            n += self.drain(ctl, r, honor_stop)?;
        }
        Ok(n)
    }

    /// Polls every CQ once (busy-poll and adaptive's spin: O(CQs)).
    fn poll_all(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let mut n = 0;
        for r in self.entries.refs() {
            if let Some(e) = self.entries.get_mut(r) {
                e.in_ready = false;
            }
            n += self.drain(ctl, r, honor_stop)?;
        }
        self.ready.clear();
        Ok(n)
    }

    // ---------------------------------------------------------- deadlines

    /// The earliest keepalive / drain / watchdog deadline.
    fn next_deadline(&self, sh: &Shared) -> Option<Instant> {
        let mut d = self.keepalives.next_deadline();
        if let Some(x) = self.drains.next_deadline() {
            d = Some(d.map_or(x, |y| y.min(x)));
        }
        if let (Some(t), Some(since)) = (self.opts.watchdog, self.watchdog_since(sh)) {
            let x = sys::deadline_after(since, t);
            d = Some(d.map_or(x, |y| y.min(x)));
        }
        d
    }

    /// Since when the watchdog counts (no event since), if it is on and the
    /// app reports outstanding work.
    fn watchdog_since(&self, sh: &Shared) -> Option<Instant> {
        self.last_event.filter(|_| self.opts.watchdog.is_some() && sh.outstanding.load(Relaxed) > 0)
    }

    /// Starts the watchdog's count at the first sleep after an event.
    fn watchdog_start(&mut self, sh: &Shared) {
        if self.last_event.is_none() && self.opts.watchdog.is_some() && sh.outstanding.load(Relaxed) > 0 {
            self.last_event = Some(Instant::now());
        }
    }

    fn has_work_now(&self, sh: &Shared) -> bool {
        !self.unarmed.is_empty()
            || !self.ready.is_empty()
            || !self.fired.is_empty()
            || self.polling_since.is_some()
            || (self.opts.mode == Mode::BusyPoll && self.entries.len() > 0)
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
    fn arm_timer(&mut self, sh: &Shared, at: Option<Instant>) {
        if at != self.timer_at {
            let after = at.map(|a| a.saturating_duration_since(Instant::now()));
            if sh.timer.set(after).is_ok() {
                self.timer_at = at;
            }
        }
    }

    /// Keepalive probes and deaths, finished and timed-out drains, the
    /// watchdog: whatever is due now.
    fn tick(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let timed = !self.keepalives.is_empty() || !self.drains.is_empty() || self.watchdog_since(sh).is_some();
        let now = timed.then(Instant::now);
        let mut n = 0;
        if let Some(now) = now {
            if !self.keepalives.is_empty() {
                let (posted, dead) = self.keepalives.tick(now);
                sh.counters.keepalive_probes.fetch_add(posted, Relaxed);
                for (qpn, _qp) in dead {
                    sh.counters.keepalive_dead.fetch_add(1, Relaxed);
                    if let Some(f) = self.keepalives.on_dead(qpn) {
                        f(qpn, ctl);
                    }
                }
            }
            if let (Some(t), Some(since)) = (self.opts.watchdog, self.watchdog_since(sh)) {
                if now.saturating_duration_since(since) >= t {
                    sh.counters.watchdog_polls.fetch_add(1, Relaxed);
                    self.last_event = Some(now);
                    n += self.poll_all(ctl, honor_stop)?;
                }
            }
        }
        if !self.drains.is_empty() {
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

    // -------------------------------------------------------------- cycles

    fn begin_cycle(&mut self) {
        self.cycle_start = None;
        self.last_stamp = None;
    }

    fn record_wakeup(&mut self, sh: &Shared, n: usize) {
        let c = &sh.counters;
        c.wakeups.fetch_add(1, Relaxed);
        if n == 0 {
            c.empty_wakeups.fetch_add(1, Relaxed);
        }
        c.per_wakeup.record(n as u64);
        if let (Some(a), Some(b)) = (self.cycle_start, self.last_stamp) {
            c.cycle_us.record(b.duration_since(a).as_micros() as u64);
        } else {
            c.cycle_us.record(0);
        }
        log::trace!(target: "rdmasafe", "CQ loop wakeup: {n} completions");
    }

    /// Waits per `wait` (bounded by the next deadline) on the loop's epoll
    /// fd. Returns the ready keys as bits (0 on timeout).
    fn sleep(&mut self, ctl: &LoopControl, wait: Wait) -> Result<u64> {
        let sh = &*ctl.0;
        self.watchdog_start(sh);
        let deadline = self.next_deadline(sh);
        self.arm_timer(sh, deadline);
        let mut ms: i32 = match wait {
            Wait::None => 0,
            Wait::Forever => -1,
            Wait::For(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
        };
        if let Some(d) = deadline {
            let left =
                d.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            ms = if ms < 0 { left } else { ms.min(left) };
        }
        if let Some(h) = self.hook.as_mut() {
            h();
        }
        let bits = sh.epoll.wait(ms).map_err(io_err("epoll_wait"))?;
        if bits & (1 << KEY_WAKE) != 0 {
            sh.wake_set.store(false, SeqCst);
            sh.wake.drain();
        }
        if bits & (1 << KEY_TIMER) != 0 {
            sh.timer.drain();
            self.timer_at = None;
        }
        Ok(bits)
    }

    /// One cycle in the loop's mode; the completions delivered.
    fn cycle(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        self.apply_cmds(ctl);
        if honor_stop && ctl.0.stop.load(SeqCst) {
            return Ok(0);
        }
        match self.opts.mode {
            Mode::Event => self.event_cycle(ctl, wait, honor_stop),
            Mode::BusyPoll => self.poll_cycle(ctl, wait, None, honor_stop),
            Mode::Adaptive { spin } => self.adaptive_cycle(ctl, wait, spin, honor_stop),
        }
    }

    /// Arms and drains new CQs, drains CQs over their budget; if that gave
    /// nothing, sleeps, then reads events and drains what fired (re-arming
    /// first when `rearm`).
    fn event_cycle(&mut self, ctl: &LoopControl, wait: Wait, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        self.begin_cycle();
        let unarmed = std::mem::take(&mut self.unarmed);
        let mut n = self.work_list(ctl, unarmed, true, honor_stop)?;
        n += self.work_ready(ctl, honor_stop)?;
        if n > 0 {
            n += self.tick(ctl, honor_stop)?;
            self.record_wakeup(sh, n);
            return Ok(n);
        }
        let bits = if self.has_work_now(sh) { 1 << KEY_CHANNEL } else { self.sleep(ctl, wait)? };
        self.begin_cycle();
        self.apply_cmds(ctl);
        if bits & (1 << KEY_CHANNEL) != 0 {
            self.read_events(ctl)?;
        }
        let fired = std::mem::take(&mut self.fired);
        let woke = !fired.is_empty();
        let rearm = self.polling_since.is_none() && self.opts.mode == Mode::Event;
        let mut n = self.work_list(ctl, fired, rearm, honor_stop)?;
        n += self.tick(ctl, honor_stop)?;
        if woke || n > 0 {
            self.record_wakeup(sh, n);
        }
        Ok(n)
    }

    /// Polls every CQ until completions arrive, `wait` runs out, the
    /// adaptive `spin` passes without completions, or a stop / change.
    fn poll_cycle(&mut self, ctl: &LoopControl, wait: Wait, spin: Option<Duration>, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let start = Instant::now();
        let deadline = match wait {
            Wait::For(d) => Some(sys::deadline_after(start, d)),
            Wait::None => Some(start),
            Wait::Forever => None,
        };
        // Only a deadline, a spin limit or a timer needs the clock while
        // spinning; plain busy polling reads it when it delivers.
        let timed = deadline.is_some() || spin.is_some() || self.next_deadline(sh).is_some();
        let idle_from = self.polling_since.unwrap_or(start);
        loop {
            self.begin_cycle();
            let mut n = self.poll_all(ctl, honor_stop)?;
            n += self.tick(ctl, honor_stop)?;
            if n > 0 {
                self.polling_since = self.last_stamp.or(Some(start));
                self.record_wakeup(sh, n);
                return Ok(n);
            }
            if (honor_stop && sh.stop.load(Relaxed)) || sh.cmds_pending.load(Relaxed) {
                return Ok(0);
            }
            if timed {
                let now = Instant::now();
                if spin.is_some_and(|s| now.saturating_duration_since(idle_from) >= s) {
                    self.polling_since = None;
                    return Ok(0);
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(0);
                }
            }
            std::hint::spin_loop();
        }
    }

    fn adaptive_cycle(&mut self, ctl: &LoopControl, wait: Wait, spin: Duration, honor_stop: bool) -> Result<usize> {
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
            for r in self.entries.refs() {
                if self.entries.get(r).is_some_and(|e| !e.armed) {
                    self.push_unarmed(r);
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
        while !c.is_done() {
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
    fn finish_stop(&mut self, sh: &Shared) {
        sh.wake_set.store(false, SeqCst);
        sh.wake.drain();
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

impl Core {
    /// The loop goes away: ack every pending event, read and ack whatever
    /// is still in the channel (so no CQ destroy waits), drop the handlers
    /// (which may hold the loop's control: no cycle is left), end the
    /// drains, give the fd its flags back. Idempotent.
    fn shutdown(&mut self) {
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
            if let Done::Call(f) = done {
                f(Err(Error::new("rdmasafe drain_qp: the loop is gone", libc::ECANCELED)));
            }
        }
        self.keepalives = Keepalives::default();
        let _ = sys::set_fd_flags(self.chan.fd(), self.orig_flags);
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.shutdown();
    }
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
        F: FnMut(&[ibv_wc], &LoopControl) + Send + 'static,
    {
        let opts = self.default_cq_options();
        self.control().add_cq(cq, opts, handler).map(|_| ())
    }

    /// Adds a CQ with its own options; see [`LoopControl::add_cq`].
    pub fn add_cq_with<F>(&self, cq: &Cq, opts: CqOptions, handler: F) -> Result<()>
    where
        F: FnMut(&[ibv_wc], &LoopControl) + Send + 'static,
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
        if let Ok(mut c) = self.sh.core.lock() {
            c.hook = hook;
        }
    }

    /// Takes the state for running: EBUSY if someone runs the loop, a
    /// short wait if a thread is applying a change.
    fn enter(&self) -> Result<Held<'_>> {
        let sh = &*self.sh;
        if sh.held_here() {
            return Err(Error::new("rdmasafe_cq_loop_run: from inside one of its handlers", libc::EDEADLK));
        }
        let g = match sh.core.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                if sh.running.load(SeqCst) {
                    return Err(Error::new("rdmasafe_cq_loop_run: another thread runs the loop", libc::EBUSY));
                }
                sh.core.lock().unwrap_or_else(|e| e.into_inner())
            }
        };
        if sh.running.swap(true, SeqCst) {
            return Err(Error::new("rdmasafe_cq_loop_run: another thread runs the loop", libc::EBUSY));
        }
        // Paired with try_close (both SeqCst): either it sees `running`, or
        // this sees `closing`.
        if sh.closing.load(SeqCst) {
            sh.running.store(false, SeqCst);
            return Err(Error::new("rdmasafe_cq_loop_run: the loop is being destroyed", libc::EINVAL));
        }
        Ok(Held::new(sh, g, self.control()).into_runner())
    }

    /// True while a thread runs the loop (`run` / `process_once`).
    pub fn is_running(&self) -> bool {
        self.sh.running.load(SeqCst)
    }

    /// Marks the loop as going away: from now on `run` and `process_once`
    /// fail (EINVAL). EBUSY (and nothing changes) while a thread runs it,
    /// EDEADLK from inside one of its handlers. For an owner that must
    /// know nobody runs the loop before it drops it (the C API's destroy).
    pub fn try_close(&self) -> Result<()> {
        let sh = &*self.sh;
        if sh.held_here() {
            return Err(Error::new("rdmasafe_cq_loop_destroy: from inside one of its handlers", libc::EDEADLK));
        }
        if sh.closing.swap(true, SeqCst) {
            return Err(Error::new("rdmasafe_cq_loop_destroy: destroyed already", libc::EINVAL));
        }
        if sh.running.load(SeqCst) {
            sh.closing.store(false, SeqCst);
            return Err(Error::new("rdmasafe_cq_loop_destroy: another thread runs the loop", libc::EBUSY));
        }
        Ok(())
    }

    fn leave(&self, held: Held<'_>) {
        drop(held); // clears `running`
    }

    /// Runs cycles until [`LoopControl::stop`]; then flushes every pending
    /// ack and returns. The stop request is consumed: the loop can run
    /// again. Signals do not end it (a profiler's SIGPROF is harmless); a
    /// signal handler may call stop. EBUSY if another thread runs the loop,
    /// EDEADLK from inside one of its handlers.
    pub fn run(&self) -> Result<()> {
        let mut held = self.enter()?;
        let r = {
            let (core, ctl) = held.parts();
            let mut r = Ok(());
            while !ctl.0.stop.load(SeqCst) {
                if let Err(e) = core.cycle(ctl, Wait::Forever, true) {
                    if e.errno() != libc::EINTR {
                        r = Err(e);
                        break;
                    }
                }
            }
            core.finish_stop(&ctl.0);
            r
        };
        self.leave(held);
        r
    }

    /// One cycle: waits per `wait` (bounded by the loop's next deadline),
    /// then delivers what arrived; returns the completions delivered (0 on
    /// timeout). EINTR when a signal interrupted the wait. For embedding in
    /// the app's own epoll: watch [`CqLoop::as_raw_fd`] (readable whenever
    /// the loop has work: a CQ event, a CQ just added, a stop, a due
    /// deadline, an adaptive spin or a CQ over its budget in progress) and
    /// call `process_once(Wait::None)` when it is readable; no priming call
    /// is needed.
    ///
    /// A stop requested while the app drives the loop this way ends the
    /// call at once: it returns 0 with every ack flushed and the request
    /// consumed, and the next call runs normally.
    pub fn process_once(&self, wait: Wait) -> Result<usize> {
        let mut held = self.enter()?;
        let r = {
            let (core, ctl) = held.parts();
            if ctl.0.stop.load(SeqCst) {
                core.finish_stop(&ctl.0);
                Ok(0)
            } else {
                let r = core.cycle(ctl, wait, true);
                if ctl.0.stop.load(SeqCst) {
                    core.finish_stop(&ctl.0);
                } else if core.has_work_now(&ctl.0) {
                    // Keep the fd readable: the app's epoll must call again.
                    ctl.0.wake();
                }
                r
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

    /// Acks every pending CQ event now.
    pub fn flush_acks(&self) -> Result<()> {
        let mut held = self.enter()?;
        let (core, ctl) = held.parts();
        core.flush_all(&ctl.0);
        self.leave(held);
        Ok(())
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

impl Drop for CqLoop {
    fn drop(&mut self) {
        // Controls may outlive the loop (a handler may even hold one): tear
        // the state down now, so every CQ can be destroyed after this, and
        // make later changes through a control fail.
        self.sh.alive.store(false, SeqCst);
        let mut c = self.sh.core.lock().unwrap_or_else(|e| e.into_inner());
        c.shutdown();
        drop(c);
        registry::release_loop(self.sh.id);
    }
}

/// A loop running on its own thread.
pub struct LoopThread {
    pub(crate) ctl: LoopControl,
    pub(crate) thread: std::thread::JoinHandle<(CqLoop, Result<()>)>,
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
        // If a handler had stopped the loop already, `run` consumed that
        // request and ours is left over: the loop we give back is not
        // running, so no stop request may linger (the next run would
        // return at once).
        l.sh.stop.store(false, SeqCst);
        r.map(|_| l)
    }
}
