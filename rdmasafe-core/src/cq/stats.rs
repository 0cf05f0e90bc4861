//! Figures of a CQ loop, kept in atomics so any thread can read them while
//! the loop runs.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Number of buckets in each histogram.
pub const BUCKETS: usize = 16;

/// A histogram with power-of-two buckets: bucket 0 counts the value 0,
/// bucket `i` counts values in `[2^(i-1), 2^i)`, the last bucket everything
/// from `2^(BUCKETS-2)` up.
#[derive(Default)]
pub(crate) struct Histogram([AtomicU64; BUCKETS]);

/// Adding to a loop's counters. Only whoever holds the loop's state (its
/// mutex) writes them, so an add needs no atomic read-modify-write (a
/// locked instruction, on x86 a full barrier): a plain load and store,
/// ordered between successive holders by that mutex. Readers load them
/// with `Relaxed` as before and see every value whole.
pub(crate) trait Bump {
    fn bump(&self, n: u64);
    fn drop_by(&self, n: u64);
}

impl Bump for AtomicU64 {
    #[inline]
    fn bump(&self, n: u64) {
        self.store(self.load(Relaxed).wrapping_add(n), Relaxed);
    }

    #[inline]
    fn drop_by(&self, n: u64) {
        self.store(self.load(Relaxed).wrapping_sub(n), Relaxed);
    }
}

impl Histogram {
    /// Only the holder of the loop's state records (see [`Bump`]).
    pub(crate) fn record(&self, v: u64) {
        let i = (u64::BITS - v.leading_zeros()) as usize;
        self.0[i.min(BUCKETS - 1)].bump(1);
    }

    fn snapshot(&self) -> [u64; BUCKETS] {
        std::array::from_fn(|i| self.0[i].load(Relaxed))
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) wakeups: AtomicU64,
    pub(crate) empty_wakeups: AtomicU64,
    pub(crate) cq_events: AtomicU64,
    pub(crate) completions: AtomicU64,
    pub(crate) error_completions: AtomicU64,
    pub(crate) ack_calls: AtomicU64,
    pub(crate) acked_events: AtomicU64,
    pub(crate) unacked: AtomicU64,
    pub(crate) longest_handler_ns: AtomicU64,
    pub(crate) watchdog_polls: AtomicU64,
    pub(crate) arms: AtomicU64,
    pub(crate) keepalive_probes: AtomicU64,
    pub(crate) keepalive_probes_ok: AtomicU64,
    pub(crate) keepalive_dead: AtomicU64,
    pub(crate) foreign_cq_events: AtomicU64,
    pub(crate) cqs: AtomicU64,
    pub(crate) cqs_added: AtomicU64,
    pub(crate) cqs_removed: AtomicU64,
    pub(crate) budget_yields: AtomicU64,
    pub(crate) sleeps: AtomicU64,
    pub(crate) channel_reads: AtomicU64,
    pub(crate) channel_reads_empty: AtomicU64,
    pub(crate) learn_timer_wakes: AtomicU64,
    pub(crate) learn_calibrations: AtomicU64,
    pub(crate) learn_spin_ns: AtomicU64,
    pub(crate) learn_window_from_ns: AtomicU64,
    pub(crate) learn_window_to_ns: AtomicU64,
    pub(crate) learn_wake_cost_ns: AtomicU64,
    pub(crate) learn_wake_batch_milli: AtomicU64,
    pub(crate) learn_idle_samples: AtomicU64,
    pub(crate) grace_takeovers: AtomicU64,
    pub(crate) per_wakeup: Histogram,
    pub(crate) cycle_us: Histogram,
}

impl Counters {
    pub(crate) fn handler_time(&self, d: Duration) {
        self.longest_handler_ns.fetch_max(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LoopStats {
        LoopStats {
            wakeups: self.wakeups.load(Relaxed),
            empty_wakeups: self.empty_wakeups.load(Relaxed),
            cq_events: self.cq_events.load(Relaxed),
            completions: self.completions.load(Relaxed),
            error_completions: self.error_completions.load(Relaxed),
            ack_calls: self.ack_calls.load(Relaxed),
            acked_events: self.acked_events.load(Relaxed),
            unacked_now: self.unacked.load(Relaxed),
            longest_handler_ns: self.longest_handler_ns.load(Relaxed),
            watchdog_polls: self.watchdog_polls.load(Relaxed),
            arm_calls: self.arms.load(Relaxed),
            keepalive_probes: self.keepalive_probes.load(Relaxed),
            keepalive_probes_ok: self.keepalive_probes_ok.load(Relaxed),
            keepalive_dead: self.keepalive_dead.load(Relaxed),
            foreign_cq_events: self.foreign_cq_events.load(Relaxed),
            cqs: self.cqs.load(Relaxed),
            cqs_added: self.cqs_added.load(Relaxed),
            cqs_removed: self.cqs_removed.load(Relaxed),
            budget_yields: self.budget_yields.load(Relaxed),
            sleeps: self.sleeps.load(Relaxed),
            channel_reads: self.channel_reads.load(Relaxed),
            channel_reads_empty: self.channel_reads_empty.load(Relaxed),
            learn_timer_wakes: self.learn_timer_wakes.load(Relaxed),
            learn_calibrations: self.learn_calibrations.load(Relaxed),
            learn_spin_ns: self.learn_spin_ns.load(Relaxed),
            learn_window_from_ns: self.learn_window_from_ns.load(Relaxed),
            learn_window_to_ns: self.learn_window_to_ns.load(Relaxed),
            learn_wake_cost_ns: self.learn_wake_cost_ns.load(Relaxed),
            learn_wake_batch_milli: self.learn_wake_batch_milli.load(Relaxed),
            learn_idle_samples: self.learn_idle_samples.load(Relaxed),
            grace_takeovers: self.grace_takeovers.load(Relaxed),
            completions_per_wakeup: self.per_wakeup.snapshot(),
            cycle_time_us: self.cycle_us.snapshot(),
        }
    }
}

/// A snapshot of a loop's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoopStats {
    /// Times the loop woke up with something to do (an fd was readable, or
    /// a busy/adaptive poll found completions).
    pub wakeups: u64,
    /// Wakeups that delivered no completion.
    pub empty_wakeups: u64,
    /// CQ events read from the completion channel.
    pub cq_events: u64,
    /// Work completions delivered to handlers (error completions included).
    pub completions: u64,
    /// Of those, completions with a status other than success.
    pub error_completions: u64,
    /// `ibv_ack_cq_events` calls.
    pub ack_calls: u64,
    /// CQ events acked by those calls.
    pub acked_events: u64,
    /// CQ events read and not acked yet (0 after stop).
    pub unacked_now: u64,
    /// Longest single handler call, in nanoseconds (0 unless
    /// [`super::LoopOptions::timing_stats`]).
    pub longest_handler_ns: u64,
    /// Polls made by the watchdog because no event came while the app
    /// reported outstanding work.
    pub watchdog_polls: u64,
    /// `ibv_req_notify_cq` calls.
    pub arm_calls: u64,
    /// Keepalive probes posted.
    pub keepalive_probes: u64,
    /// Keepalive probes that completed successfully.
    pub keepalive_probes_ok: u64,
    /// Peers declared dead by a keepalive.
    pub keepalive_dead: u64,
    /// CQ events read for CQs that are not in the loop (acked at once, and
    /// logged once per CQ at warn level): another CQ on this channel whose
    /// completions nobody handles.
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
    /// Times a CQ used up its per-cycle budget with completions left (it
    /// was polled again in the next cycle).
    pub budget_yields: u64,
    /// `epoll_wait` calls the loop made to sleep (or to look, with no
    /// wait). Event mode makes none in a cycle that finds its CQ event
    /// already in the channel when it reads first; an event a wakeup left
    /// in the channel (several CQs fired, reading on was off: see
    /// `channel_reads_empty`) is read after one that returns at once when
    /// the next cycle sleeps first.
    pub sleeps: u64,
    /// `read()`s of the completion channel (`ibv_get_cq_event` on the
    /// non-blocking fd), those that found nothing included.
    pub channel_reads: u64,
    /// Of those, reads that found nothing (EAGAIN): in event mode the loop
    /// reads before sleeping while recent cycles found their event
    /// pending, and sleeps first otherwise, probing now and then (at most
    /// one read per 64 sleeps in steady state) whether events are pending
    /// again; it decides separately after a cycle that found its event
    /// pending and after one that slept (a ping-pong alternates the two).
    /// After a read that found an event it reads on for more only while
    /// such reads recently found one, with the same back-off (one CQ
    /// firing among idle ones: no read more than the hand-written loop's;
    /// the probes of the two decisions together: at most a few reads per
    /// 64 wakeups in steady state).
    pub channel_reads_empty: u64,
    /// [`super::Mode::Learning`] (all 0 in the other modes): timed wakes
    /// of the plan's window (the loop slept, then polled from just before
    /// the next arrival was due).
    pub learn_timer_wakes: u64,
    /// Learning mode: timed sleeps made only to measure the wake-up
    /// latency (one per idle time until it is first measured, then at most
    /// one per 64 idle times without a window).
    pub learn_calibrations: u64,
    /// Learning mode, the current plan: poll this long (ns) after the
    /// loop's first empty poll after completions before sleeping.
    pub learn_spin_ns: u64,
    /// Learning mode, the current plan: when sleeping, wake on a timer to
    /// poll from this long after that first empty poll (0: no window)...
    pub learn_window_from_ns: u64,
    /// ... until this long after it.
    pub learn_window_to_ns: u64,
    /// Learning mode: the measured block + wake cost (wake-up latency plus
    /// the work around a sleep), ns.
    pub learn_wake_cost_ns: u64,
    /// Learning mode: the completions a wake delays, as the plan prices
    /// them (the average over the recent wakes from the loop's own sleeps
    /// of the completions handed to handlers in each wake's cycle, and in
    /// the next cycles those a CQ's budget left over; not those that
    /// arrive after the wake, such as a reply's own send completion; a
    /// solicited-only CQ counts once per wake, however many handler calls
    /// its completions take; a loop driven with [`crate::Wait::None`] or a
    /// zero timeout learns none), in thousandths (1000: one; 0 before the
    /// first plan). The plan prices a wake `learn_wake_cost_ns` times this
    /// times the latency weight, at most 10 ms (the wake cost itself if
    /// that is more).
    pub learn_wake_batch_milli: u64,
    /// Learning mode: idle times learned from so far (each from the loop's
    /// first empty poll after completions to the next completion handed
    /// to a handler; the loop's own keepalive probes and drain markers end
    /// none, and an idle time that spans a return to the app, from
    /// `process_once` with a wait other than zero (not an EINTR) or the end
    /// of `run_for`, is none). The plan comes from the last 32.
    pub learn_idle_samples: u64,
    /// Blocking changes (a drain, a CQ's or a keepalive's removal, from
    /// outside a handler) that ran the loop on the calling thread, handlers
    /// included, because the async run driving the loop, or a thread
    /// waiting to run it, showed no sign of life (no cycle) for 2 seconds:
    /// an async run whose runtime stalled or stopped polling it. Such a
    /// change otherwise waits for that run, and the handlers run on the
    /// run's thread.
    pub grace_takeovers: u64,
    /// Histogram of completions delivered per wakeup (power-of-two
    /// buckets, see [`BUCKETS`]).
    pub completions_per_wakeup: [u64; BUCKETS],
    /// Histogram of loop cycle times in microseconds (wakeup to done,
    /// sleep excluded; all 0 unless [`super::LoopOptions::timing_stats`]).
    pub cycle_time_us: [u64; BUCKETS],
}

impl LoopStats {
    /// Completions per wakeup, on average (0 without wakeups).
    pub fn completions_per_wakeup_avg(&self) -> f64 {
        if self.wakeups == 0 {
            0.0
        } else {
            self.completions as f64 / self.wakeups as f64
        }
    }

    /// Ack calls per CQ event (0 without events).
    pub fn ack_calls_per_event(&self) -> f64 {
        if self.cq_events == 0 {
            0.0
        } else {
            self.ack_calls as f64 / self.cq_events as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_powers_of_two() {
        let h = Histogram::default();
        for v in [0, 1, 2, 3, 4, 7, 8, 1 << 40] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s[0], 1, "0");
        assert_eq!(s[1], 1, "1");
        assert_eq!(s[2], 2, "2..3");
        assert_eq!(s[3], 2, "4..7");
        assert_eq!(s[4], 1, "8..15");
        assert_eq!(s[BUCKETS - 1], 1, "huge values land in the last bucket");
    }
}
