//! The learning adaptive mode's model ([`super::Mode::Learning`]): what a
//! sleep costs, how long the loop stays idle before completions arrive,
//! and from those the cheapest way to wait. Pure logic, no clock and no
//! system call of its own: `cycle` feeds it measured durations and asks it
//! for a [`Plan`].
//!
//! **What is measured.** `idle`: from the first empty poll after
//! completions to the next completion handed to a handler (the loop's own
//! keepalive probes and drain markers end none; time the app spends
//! outside the loop is not loop idle time: the idle clock starts at the
//! first empty poll the loop makes itself, and an idle time that spans a
//! return to the app, from `process_once` with a wait, the end of
//! `run_for` or of a caller's drive, is no sample). `lateness`: how much later than asked a timed sleep returns (the scheduler's wake-up latency). `overhead`: the
//! CPU a sleep costs around it (re-arm, the wake's `read()` and ack). The
//! block + wake cost `W` is lateness + overhead: what an event wake adds to
//! a completion's latency, and about what a sleep costs in CPU.
//!
//! **How the plan is chosen.** Each way of waiting is priced over the last
//! [`SAMPLES`] idle durations, a microsecond of CPU and a microsecond of
//! added latency counting the same (competitive spinning, extended to a
//! timed window): a plan is `spin` for a while after the last completion;
//! if nothing came, sleep (CQs armed, so an early completion still wakes
//! the loop at the cost `W`); optionally wake on a timer just before
//! `window.0` and spin until `window.1`, then sleep for good. For an idle
//! duration `x` the plan costs
//! - `x` if `x <= spin` (caught spinning),
//! - `spin + W` if it comes while asleep,
//! - `spin + overhead + (x - window.0)` if it comes in the window (the
//!   timer's wake costs CPU but adds no latency),
//! - `spin + overhead + (window.1 - window.0) + W` after the window.
//!
//! With a latency weight `k` ([`super::LoopOptions::learn_latency_weight`],
//! default 1) a microsecond of added latency counts as `k` of CPU: every
//! `W` above is priced `k * W` (the spin and window CPU terms are not), so
//! the plan spins longer and opens wider windows to avoid a wake (the
//! spins of about `W` below become `k * W`), with `k * W` priced at most
//! 10 ms ([`MAX_COST_SAMPLE`]; `W` itself if larger): a weight never makes
//! the loop spin for seconds. The floor for a window's start (at least `W`
//! after the spin, below) is a CPU argument and stays unweighted.
//!
//! A wake also delays every completion that arrives while the loop is
//! waking, not only the first: in a stream, one sleep holds back the
//! dozens that queue up meanwhile. So `W` is also priced `b` times, `b`
//! being the completions handed to handlers in the cycle of a wake from
//! one of the loop's own sleeps, and in the next cycles those a CQ's
//! budget left over (not those that arrive after the wake: a reply's own
//! send completion did not wait for it), averaged over the recent ones ([`Model::wake_batch`],
//! 1 to [`MAX_WAKE_BATCH`]; a solicited-only CQ counts once per wake,
//! however many handler calls its completions take, since its unsolicited
//! completions were not meant to wake the loop; 1 before
//! any such wake, and about 1 for requests that each wait for a reply, so
//! ping-pong, periodic and random single arrivals are priced as without
//! it). A loop embedded in an app's own epoll (driven with
//! [`crate::Wait::None`]) or polled with a zero timeout does not sleep
//! itself and keeps `b` as it is (so does a wait a due deadline cut to 0).
//! The 10 ms bound above holds for `k * b * W`.
//!
//! The plan with the least total over the samples wins, among those whose
//! spin is at most the priced `W` (the bound above): over dense samples
//! just above `W`, catching them all can be cheaper still, but that would
//! let the spin grow past what the options promise (a 23 ms spin at a
//! 10 ms priced wake was seen). Periodic arrivals get a window around the
//! next one (sleep, then poll); random ones get a
//! spin of about `W` or none; a stream (idle durations of a few
//! microseconds) gets a spin that covers them. The samples are only the
//! recent past, and the next gap exceeds all of them about once in
//! [`SAMPLES`] + 1: so a plan that spins through every sample and sets no
//! window spins for the priced `W` after the idle start (the
//! competitive bound: the extra spin costs at most what the wake would, and
//! nothing over the samples). A rare longer gap in a stream is then spun
//! through, not slept through; a ping-pong whose round trips are all
//! shorter than a wake spins about `W` (not only its longest round trip);
//! and when a completion comes after such a raised spin ran out (the stream
//! ended), the plan is searched again at once, so the raised spin is not
//! paid again at the next idle times. Until [`MIN_SAMPLES`] idle durations
//! are known the plan is the classic competitive one: spin for the priced
//! `W`. The search is O(n²) over the sorted samples, redone every
//! [`REFRESH`] samples and after a raised spin ran out.

/// Idle durations kept.
pub(super) const SAMPLES: usize = 32;
/// Idle durations needed before the plan comes from them.
pub(super) const MIN_SAMPLES: usize = 8;
/// New idle durations between two searches.
pub(super) const REFRESH: u32 = 8;
/// Sleeps between two timed sleeps made only to measure the lateness when
/// no plan has used a timer meanwhile.
pub(super) const CALIBRATE_EVERY: u32 = 64;
/// The calibration sleep: the timer asked for this long (ns), from just
/// before the sleep's `epoll_wait` (long enough for arming the timer to be
/// done before it expires, on a slow machine too).
pub(super) const CALIBRATE_NS: u64 = 200_000;
/// The largest latency weight ([`super::LoopOptions::learn_latency_weight`]).
pub const MAX_LATENCY_WEIGHT: u32 = 1000;
/// An event wake's completions count as this many at most
/// ([`Model::wake_batch`]): from there, 32 wakes of single arrivals bring
/// the average under 2, and about 80 back to 1.
pub(super) const MAX_WAKE_BATCH: u64 = 64;
/// Idle durations longer than this (an hour, ns) count as this long.
const MAX_IDLE: u64 = 3_600_000_000_000;
/// A lateness or overhead sample counts as this much at most (10 ms, ns):
/// a machine whose sleep costs more than that is stalled, not slow, and one
/// such sample must not make the loop spin for seconds.
pub(super) const MAX_COST_SAMPLE: u64 = 10_000_000;

/// The learning mode's state in a loop: the model and where the loop is
/// in its plan. Instants are the loop's clock reads.
#[derive(Clone, Debug, Default)]
pub(super) struct Learn {
    pub model: Model,
    /// When the loop's first empty poll after completions was (None while
    /// completions keep coming).
    pub idle_start: Option<std::time::Instant>,
    /// While polling: poll until this long after `idle_start` (ns).
    pub spin_until: u64,
    /// While asleep: the timer the plan (or a calibration) set.
    pub wake_at: Option<std::time::Instant>,
    /// `wake_at` is a calibration's: on its wake, sleep on.
    pub calibrating: bool,
    /// When the loop decided to sleep (for the overhead before the sleep).
    pub decided: Option<std::time::Instant>,
    /// The last sleep's clock reads: just before `epoll_wait`, just after.
    pub slept: Option<(std::time::Instant, std::time::Instant)>,
    /// The last sleep's `epoll_wait` could block (its timeout was not 0:
    /// a zero-timeout wait, asked for or cut to 0 by a due deadline, is a
    /// poll, and what it finds waited for no wake of the loop's).
    pub blocked: bool,
    /// The last sleep was ended by `wake_at`'s timer: the time asked for,
    /// and whether the lateness can be measured from it.
    pub fired: Option<(std::time::Instant, bool)>,
    /// Empty polling passes (the clock is read on some of them).
    pub passes: u32,
    /// Completions handed to handlers so far, a solicited-only CQ's
    /// counting as one per event cycle: the difference over a cycle that
    /// slept (`slept` and `blocked`: not a zero-timeout wait) is what
    /// [`Model::wake_batch`] learns from.
    pub handed: u64,
    /// A wake's batch being counted: `handed` just before the wake's cycle.
    /// Learned at the first empty poll after it, so completions a CQ's
    /// budget left for the next cycles count too.
    pub batch_from: Option<u64>,
    /// The idle time since `idle_start` spans a return to the app
    /// (`Core::leave_to_app`): the app's time is not loop idle time, so
    /// the idle duration it ends is not a sample (the spin and the plan's
    /// timer still run from `idle_start`, or a loop called with a short
    /// wait would never get to sleep).
    pub idle_outside: bool,
    /// Event cycles (each sleeps at most once) begun so far, from 1: a
    /// solicited-only CQ counts once in each
    /// ([`super::entries::Entry::learn_counted`]), however many handler
    /// calls its completions take.
    pub event_cycles: u64,
}

impl Learn {
    /// Completions came at `now`: ends the idle time (a sample unless it
    /// spanned a return to the app). Returns whether it was one.
    pub(super) fn end_idle(&mut self, now: std::time::Instant) -> bool {
        let outside = std::mem::take(&mut self.idle_outside);
        if let (Some(s), false) = (self.idle_start.take(), outside) {
            self.model.idle(ns(now.saturating_duration_since(s)));
            return true;
        }
        false
    }

    /// The loop's first empty poll after completions: a wake's batch being
    /// counted ends here.
    pub(super) fn end_batch(&mut self) {
        if let Some(from) = self.batch_from.take() {
            self.model.wake_batch(self.handed.wrapping_sub(from));
        }
    }

    /// A loop's learning state, its model pricing latency at `weight`.
    pub(super) fn with_weight(weight: u32) -> Learn {
        Learn { model: Model::with_weight(weight), event_cycles: 1, ..Learn::default() }
    }
}

/// ns in a duration, saturating.
pub(super) fn ns(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// How to wait after the last completion (nanoseconds from the start of
/// idleness).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// Poll until this long after the idle start.
    pub spin: u64,
    /// Then sleep; if set, wake on a timer so as to poll from `.0` (the
    /// timer is set `lateness` earlier) until `.1`, then sleep again.
    pub window: Option<(u64, u64)>,
}

#[derive(Clone, Debug)]
pub(super) struct Model {
    idle: [u64; SAMPLES],
    len: usize,
    next: usize,
    fresh: u32,
    plan: Plan,
    /// EWMA (1/8) of the wake lateness and the sleep overhead, ns.
    lateness: u64,
    overhead: u64,
    lateness_seen: bool,
    /// Sleeps since the lateness was last measured.
    since_lateness: u32,
    /// What a microsecond of added latency costs, in microseconds of CPU
    /// (1..=[`MAX_LATENCY_WEIGHT`]).
    weight: u32,
    /// EWMA (1/8) of the completions an event wake's cycle delivered, in
    /// 1/256ths (256: one), 256..=256 * [`MAX_WAKE_BATCH`]; the fine unit
    /// keeps the rounding of the average below 1/32 of a completion.
    batch256: u64,
    /// The plan's spin was raised to the priced `W` (it spins through
    /// every sample): a longer idle time re-plans at once.
    raised: bool,
}

impl Default for Model {
    fn default() -> Self {
        let mut m = Model {
            idle: [0; SAMPLES],
            len: 0,
            next: 0,
            fresh: 0,
            plan: Plan { spin: 0, window: None },
            // Until measured: a guess of a native machine's costs.
            lateness: 20_000,
            overhead: 5_000,
            lateness_seen: false,
            since_lateness: 0,
            weight: 1,
            batch256: 256,
            raised: false,
        };
        m.plan = m.competitive();
        m
    }
}

fn ewma(old: u64, sample: u64) -> u64 {
    (old * 7 + sample) / 8
}

impl Model {
    /// A model that prices a microsecond of added latency as `weight` of
    /// CPU (clamped to 1..=[`MAX_LATENCY_WEIGHT`]).
    pub(super) fn with_weight(weight: u32) -> Model {
        let mut m = Model { weight: weight.clamp(1, MAX_LATENCY_WEIGHT), ..Model::default() };
        m.plan = m.competitive();
        m
    }

    /// The block + wake cost `W`, ns.
    pub(super) fn wake_cost(&self) -> u64 {
        self.lateness + self.overhead
    }

    pub(super) fn lateness(&self) -> u64 {
        self.lateness
    }

    /// The plan to follow now: the last search's, its spin within the
    /// priced `W` as priced now (it may have fallen since the search, with
    /// the wake batch or the measured costs), and a raised spin (one
    /// priced `W`) following the priced `W` both ways.
    pub(super) fn plan(&self) -> Plan {
        if self.len < MIN_SAMPLES {
            return self.competitive();
        }
        let priced = self.priced_wake_cost();
        Plan { spin: if self.raised { priced } else { self.plan.spin.min(priced) }, ..self.plan }
    }

    /// `W` as the plans price it: `W` times the latency weight and the
    /// completions a wake delays (the recent wakes' average), but never
    /// above [`MAX_COST_SAMPLE`] (10 ms) unless `W` itself is above it: a
    /// weight of 1000 on a 2 ms wake cost must not make the loop spin for
    /// seconds.
    fn priced_wake_cost(&self) -> u64 {
        let w = self.wake_cost().min(MAX_IDLE);
        let times256 = self.weight as u64 * self.batch256;
        w.max((w.saturating_mul(times256) / 256).min(MAX_COST_SAMPLE))
    }

    fn competitive(&self) -> Plan {
        Plan { spin: self.priced_wake_cost(), window: None }
    }

    /// A completion came `ns` after the idle start.
    pub(super) fn idle(&mut self, ns: u64) {
        self.idle[self.next] = ns;
        self.next = (self.next + 1) % SAMPLES;
        self.len = (self.len + 1).min(SAMPLES);
        self.fresh += 1;
        // A raised spin that did not catch this one (a stream ended, say)
        // is not paid again for the next REFRESH idle times: re-plan now.
        let missed = self.raised && ns > self.plan().spin;
        if self.len >= MIN_SAMPLES && (self.fresh >= REFRESH || missed) {
            self.fresh = 0;
            (self.plan, self.raised) = self.search();
        }
    }

    /// A timed sleep returned `ns` after the time it was asked for.
    pub(super) fn lateness_sample(&mut self, ns: u64) {
        let ns = ns.min(MAX_COST_SAMPLE);
        self.lateness = if self.lateness_seen { ewma(self.lateness, ns) } else { ns };
        self.lateness_seen = true;
        self.since_lateness = 0;
    }

    /// An event wake's cycle delivered `n` completions: each of them
    /// waited for the wake (counted 1..=[`MAX_WAKE_BATCH`]).
    pub(super) fn wake_batch(&mut self, n: u64) {
        self.batch256 = ewma(self.batch256, n.clamp(1, MAX_WAKE_BATCH) * 256);
    }

    /// The completions a wake delays, as the plans price it (the recent
    /// wakes' average), in 1/256ths.
    pub(super) fn wake_batch_256(&self) -> u64 {
        self.batch256
    }

    /// A sleep cost `ns` of CPU around it.
    pub(super) fn overhead_sample(&mut self, ns: u64) {
        self.overhead = ewma(self.overhead, ns.min(MAX_COST_SAMPLE));
    }

    /// A sleep without a timer of the plan's: whether to time it anyway
    /// (for [`CALIBRATE_NS`]) to measure the lateness.
    pub(super) fn calibrate_now(&mut self) -> bool {
        self.since_lateness += 1;
        !self.lateness_seen || self.since_lateness >= CALIBRATE_EVERY
    }

    /// The cheapest plan over the samples (see the module's comment).
    /// With it, whether its spin was raised to the priced `W`.
    fn search(&self) -> (Plan, bool) {
        let n = self.len;
        // Signed: a(i) below may be negative. Durations are capped at an
        // hour, so no sum of SAMPLES of them overflows.
        let mut y = [0i64; SAMPLES];
        for (d, &s) in y.iter_mut().zip(&self.idle[..n]) {
            *d = s.min(MAX_IDLE) as i64;
        }
        let y = &mut y[..n];
        y.sort_unstable();
        // prefix sums: p[k] = y[0] + ... + y[k-1]
        let mut p = [0i64; SAMPLES + 1];
        for k in 0..n {
            p[k + 1] = p[k] + y[k];
        }
        // w: the priced wake cost (weighted, at most max(W, 10 ms)); w0:
        // the unweighted one, for the floor of a window's start. Both are
        // at most an hour: SAMPLES of them still fit an i64.
        let (w, w0, c) =
            (self.priced_wake_cost() as i64, self.wake_cost().min(MAX_IDLE) as i64, self.overhead.min(MAX_IDLE) as i64);
        let nn = n as i64;
        let min_inside = n.div_ceil(4);
        // The cost of a plan splits into a part that depends only on the
        // spin (the samples it catches, `i` of them) and one that depends
        // only on the window [y[j], y[k]]:
        //   cost(i, j, k) = a(i) + b(j, k), with
        //   a(i) = p[i] + (n - i) * spin_i - i * W          (spin_i = y[i-1], 0 for i = 0)
        //   b(j, k) = j * W + (k - j + 1) * C + (p[k+1] - p[j]) - (k - j + 1) * y[j]
        //             + (n - k - 1) * (C + y[k] - y[j] + W)
        // and without a window b = n * W. b_best[j]: the best window that
        // starts at y[j] or later.
        // A window must hold a quarter of the samples at least: one around
        // a single sample (the largest, say) would be fitted to the past,
        // not a pattern.
        let mut b_best = [(i64::MAX, 0usize, 0usize); SAMPLES + 1];
        for j in (0..n).rev() {
            let mut best = b_best[j + 1];
            for k in (j + min_inside - 1)..n {
                let inside = (k - j + 1) as i64;
                let after = nn - k as i64 - 1;
                let b = j as i64 * w + inside * c + (p[k + 1] - p[j]) - inside * y[j] + after * (c + y[k] - y[j] + w);
                if b < best.0 {
                    best = (b, j, k);
                }
            }
            b_best[j] = best;
        }
        let mut winner = (i64::MAX, Plan { spin: 0, window: None });
        for i in 0..=n {
            let spin = if i == 0 { 0 } else { y[i - 1] };
            // No spin beyond the priced wake: catching a longer gap can be
            // the cheapest over dense samples above W, but the bound is
            // what the options promise (a weight never buys a longer spin
            // than its priced wake). The samples are sorted: none further.
            if spin > w {
                break;
            }
            let a = p[i] + (nn - i as i64) * spin - i as i64 * w;
            // Without a window.
            let plain = a + nn * w;
            if plain < winner.0 {
                winner = (plain, Plan { spin: spin as u64, window: None });
            }
            // A window must start at least W after the spin ends (a shorter
            // sleep costs more than spinning through it) and after the
            // samples the spin catches.
            let first = y.partition_point(|&v| v < spin + w0).max(i);
            if first < n {
                let (b, j, k) = b_best[first];
                if b != i64::MAX && a + b < winner.0 {
                    winner = (a + b, Plan { spin: spin as u64, window: Some((y[j] as u64, y[k] as u64)) });
                }
            }
        }
        // A plan that spins through every sample never expects to sleep,
        // but the samples are only the recent past: the next gap exceeds
        // their largest about once in SAMPLES + 1, and sleeping through it
        // costs a priced wake. Spinning on up to one priced wake costs no
        // more than that wake would (the competitive bound), and nothing
        // over the samples.
        let mut plan = winner.1;
        let raise = plan.window.is_none() && n > 0 && plan.spin as i64 >= y[n - 1] && (w as u64) > plan.spin;
        if raise {
            plan.spin = w as u64;
        }
        (plan, raise)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(lateness: u64, overhead: u64) -> Model {
        let mut m = Model::default();
        m.lateness_sample(lateness);
        m.overhead = overhead;
        m
    }

    /// A reproducible pseudo-random sequence (an LCG's high bits).
    fn rng(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed >> 33
        }
    }

    fn feed(m: &mut Model, xs: impl IntoIterator<Item = u64>) {
        for x in xs {
            m.idle(x);
        }
    }

    /// The plan's cost for one idle duration, as the module's comment
    /// states it (a brute-force check of `search`).
    fn cost(m: &Model, p: Plan, x: u64) -> u64 {
        let (w, c) = (m.priced_wake_cost(), m.overhead);
        if x <= p.spin {
            return x;
        }
        match p.window {
            Some((a, s)) if x >= a && x <= s => p.spin + c + (x - a),
            Some((a, s)) if x > s => p.spin + c + (s - a) + w,
            _ => p.spin + w,
        }
    }

    #[test]
    fn competitive_until_enough_samples() {
        let mut m = model(30_000, 10_000);
        assert_eq!(m.plan(), Plan { spin: 40_000, window: None });
        feed(&mut m, [1_000_000; MIN_SAMPLES - 1]);
        assert_eq!(m.plan(), Plan { spin: 40_000, window: None });
        feed(&mut m, [1_000_000]);
        assert_ne!(m.plan(), Plan { spin: 40_000, window: None });
    }

    #[test]
    fn periodic_arrivals_get_a_window_around_the_next() {
        let mut m = model(30_000, 10_000);
        // 1 ms apart with +-20 us of jitter
        feed(&mut m, (0..SAMPLES as u64).map(|i| 980_000 + (i * 7919) % 40_000));
        let p = m.plan();
        assert_eq!(p.spin, 0, "{p:?}");
        let (a, s) = p.window.expect("a window");
        assert!((980_000..=1_020_000).contains(&a) && (a..=1_020_000).contains(&s), "{p:?}");
    }

    #[test]
    fn a_stream_gets_a_spin_that_covers_its_gaps() {
        let mut m = model(30_000, 10_000);
        feed(&mut m, (0..SAMPLES as u64).map(|i| 500 + i * 100));
        // every gap, and then one priced wake (40 us): a gap longer than
        // the recent ones is spun through (before: 3.6 us, the largest
        // sample, and the next longer gap slept through)
        assert_eq!(m.plan(), Plan { spin: 40_000, window: None });
    }

    #[test]
    fn a_wake_is_priced_by_the_completions_that_waited_for_it() {
        // a stream on a slow machine: gaps of ~20 us, W 340 us
        let mut m = model(300_000, 40_000);
        feed(&mut m, (0..SAMPLES as u64).map(|i| 15_000 + i * 300));
        assert_eq!(m.plan().spin, 340_000, "one wake, one completion each");
        // wakes that each found 16 completions: a wake holds back 16
        for _ in 0..64 {
            m.wake_batch(16);
        }
        // the average (in 1/256ths) ends less than 1/32 short of 16
        let priced = m.priced_wake_cost();
        assert!((16 * 340_000 - 340_000 / 32..=16 * 340_000).contains(&priced), "{priced}");
        // the plan is refreshed by new samples
        feed(&mut m, (0..REFRESH as u64).map(|i| 15_000 + i * 300));
        assert_eq!(m.plan().spin, priced, "{:?}", m.plan());
        // at most MAX_WAKE_BATCH, and the 10 ms bound
        for _ in 0..64 {
            m.wake_batch(100_000);
        }
        assert_eq!(m.priced_wake_cost(), MAX_COST_SAMPLE);
        // single arrivals again: from the largest average, under two
        // completions within 32 wakes, one within 80
        for _ in 0..32 {
            m.wake_batch(1);
        }
        assert!(m.wake_batch_256() < 2 * 256, "{}", m.wake_batch_256());
        for _ in 32..80 {
            m.wake_batch(1);
        }
        assert_eq!(m.priced_wake_cost(), 340_000);
        // a count of 0 counts as one
        m.wake_batch(0);
        assert_eq!(m.priced_wake_cost(), 340_000);
    }

    #[test]
    fn the_batch_moves_the_search_itself() {
        // a stream's gaps of 0.5-3.5 us and one of 60 us; W 40 us
        let xs: Vec<u64> = (0..SAMPLES as u64).map(|i| if i == 7 { 60_000 } else { 500 + i * 100 }).collect();
        let mut one = model(30_000, 10_000);
        feed(&mut one, xs.iter().copied());
        // a wake costs 40 us: sleeping through the 60 us gap is cheaper
        assert!(one.plan().spin < 60_000, "{:?}", one.plan());
        let mut sixteen = model(30_000, 10_000);
        for _ in 0..64 {
            sixteen.wake_batch(16);
        }
        feed(&mut sixteen, xs.iter().copied());
        // a wake delays 16 completions: spin through it (and on, to one
        // priced wake)
        let p = sixteen.plan();
        assert!(p.spin >= 60_000 && p.window.is_none(), "{p:?}");
        assert_eq!(p.spin, sixteen.priced_wake_cost());
    }

    #[test]
    fn a_raised_spin_that_missed_replans_at_once() {
        let mut m = model(30_000, 10_000);
        feed(&mut m, (0..SAMPLES as u64).map(|i| 500 + i * 100));
        assert_eq!(m.plan().spin, 40_000, "raised to one wake");
        // the stream ends: the next completion comes 100 ms later. The
        // raised spin is not paid again for the next REFRESH idle times
        // (before: 40 us after each of them).
        feed(&mut m, [100_000_000]);
        assert!(m.plan().spin < 40_000, "{:?}", m.plan());
        // a plan that was not raised waits for REFRESH samples as before
        let p = m.plan();
        feed(&mut m, [200_000_000]);
        assert_eq!(m.plan(), p);
    }

    #[test]
    fn long_random_gaps_are_slept_through() {
        let mut m = model(30_000, 10_000);
        // exponential-ish, mean ~2 ms, no two alike: no window pays
        let mut x = 0x2545_f491_4f6c_dd1du64;
        feed(
            &mut m,
            (0..SAMPLES).map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let u = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
                (-(1.0 - u).ln() * 2_000_000.0) as u64 + 100_000
            }),
        );
        let p = m.plan();
        assert!(p.spin < 100_000, "{p:?}");
    }

    #[test]
    fn short_replies_then_periodic_requests_get_both() {
        // a server: its send completes ~20 us after the request came, the
        // next request ~1 ms later
        let mut m = model(60_000, 10_000);
        feed(&mut m, (0..SAMPLES as u64).map(|i| if i % 2 == 0 { 18_000 + i * 100 } else { 990_000 + i * 500 }));
        let p = m.plan();
        assert!(p.spin >= 18_000 && p.spin <= 21_000, "{p:?}");
        let (a, s) = p.window.expect("a window");
        assert!(a >= 990_000 && s <= 1_010_000, "{p:?}");
    }

    #[test]
    fn the_plan_is_the_cheapest_of_all_plans_over_the_samples() {
        let mut rnd = rng(7);
        for round in 0..400 {
            let mut m = model(rnd() % 50_000 + 1, rnd() % 20_000 + 1);
            // every other round with a latency weight of 2..=20
            // (every tenth round 1000)
            m.weight = match round % 10 {
                9 => MAX_LATENCY_WEIGHT,
                r if r % 2 == 0 => 1,
                _ => (rnd() % 19 + 2) as u32,
            };
            // and wakes that found 1..=100 completions (every third round: none)
            if round % 3 != 0 {
                for _ in 0..8 {
                    m.wake_batch(rnd() % 100 + 1);
                }
            }
            let spread = [1_000u64, 50_000, 2_000_000][round % 3];
            let xs: Vec<u64> = (0..SAMPLES).map(|_| rnd() % spread + rnd() % 3 * spread).collect();
            feed(&mut m, xs.iter().copied());
            let total = |p: Plan| xs.iter().map(|&x| cost(&m, p, x)).sum::<u64>();
            let got = total(m.plan());
            // a plan that spins through every sample spins one priced wake
            // (the samples are all within it: the spin is capped)
            let largest = xs.iter().copied().max().unwrap();
            let p = m.plan();
            assert!(p.spin <= m.priced_wake_cost(), "round {round}: {p:?}");
            if p.window.is_none() && p.spin >= largest {
                assert_eq!(p.spin, m.priced_wake_cost(), "round {round}");
            }
            // every plan the search may pick from: spins and windows at
            // sample values
            let mut cands = vec![0];
            cands.extend(xs.iter().copied());
            for &spin in cands.iter().filter(|&&s| s <= m.priced_wake_cost()) {
                assert!(got <= total(Plan { spin, window: None }), "round {round}");
                for &a in &xs {
                    for &s in &xs {
                        let inside = xs.iter().filter(|&&x| x >= a && x <= s).count();
                        if a >= spin + m.wake_cost() && s >= a && inside >= SAMPLES / 4 {
                            assert!(got <= total(Plan { spin, window: Some((a, s)) }), "round {round}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_latency_weight_catches_more_arrivals_without_a_wake() {
        // send completions ~30 us after the last completion, and replies
        // spread over 150..1,900 us; a wake costs 100 us. Weight 1 spins
        // for the sends and sleeps through most replies; weight 8 prices a
        // wake 800 us and polls for more of them.
        let xs: Vec<u64> = (0..SAMPLES as u64)
            .map(|i| if i % 2 == 0 { 30_000 + i * 100 } else { 150_000 + (i * 7919 % 16) * 115_000 })
            .collect();
        let mut light = model(80_000, 20_000);
        feed(&mut light, xs.iter().copied());
        let mut heavy = model(80_000, 20_000);
        heavy.weight = 8;
        feed(&mut heavy, xs.iter().copied());
        let (l, h) = (light.plan(), heavy.plan());
        assert!(l.spin < 150_000 && l.spin >= 30_000, "{l:?}");
        let caught =
            |p: Plan| xs.iter().filter(|&&x| x <= p.spin || p.window.is_some_and(|(a, s)| x >= a && x <= s)).count();
        assert!(caught(h) > caught(l), "{l:?} {h:?}");
        // before any sample, the competitive spin is the priced W
        assert_eq!(Model::with_weight(4).plan().spin, 4 * Model::default().wake_cost());
        assert_eq!(Model::with_weight(0).plan(), Model::default().plan(), "0 counts as 1");
    }

    #[test]
    fn a_latency_weight_never_prices_a_wake_above_10_ms() {
        // a 2 ms wake cost at weight 1000 would be a 2 s spin
        let mut m = Model::with_weight(1000);
        m.lateness_sample(2_000_000);
        assert_eq!(m.plan().spin, MAX_COST_SAMPLE);
        // arrivals 1 s apart: no spin through them
        feed(&mut m, [1_000_000_000; SAMPLES]);
        assert!(m.plan().spin <= MAX_COST_SAMPLE, "{:?}", m.plan());
        // a wake cost above the cap is priced as itself, as with weight 1
        let mut slow = Model::with_weight(1000);
        slow.lateness_sample(MAX_COST_SAMPLE);
        assert_eq!(slow.plan().spin, MAX_COST_SAMPLE + slow.overhead);
    }

    #[test]
    fn a_raised_spin_follows_the_priced_wake_up_between_searches() {
        // a stream: raised to one priced wake (40 us)
        let mut m = model(30_000, 10_000);
        feed(&mut m, (0..SAMPLES as u64).map(|i| 500 + i * 100));
        assert_eq!(m.plan().spin, 40_000);
        // the wake cost rises before the next search: the raised spin is
        // one priced wake as priced now (before: 40 us until the search)
        for _ in 0..20 {
            m.lateness_sample(200_000);
        }
        let priced = m.priced_wake_cost();
        assert!(priced > 150_000, "{priced}");
        feed(&mut m, (0..(REFRESH as u64 - 1)).map(|i| 500 + i * 100));
        assert_eq!(m.plan().spin, priced);
    }

    #[test]
    fn no_plan_spins_longer_than_the_priced_wake() {
        // A slow machine's wake of 5.5 ms, priced 10 ms at weight 1000;
        // half the gaps under 5 us, half spread over 1..26 ms, one after
        // the other. Over such samples catching long gaps too is at times
        // the cheapest: an adversarial test saw spins up to 25.8 ms (117
        // plans of 20,000 above 10 ms), this sequence up to 23.0 ms. The
        // spin stays within the priced wake, as documented.
        let mut rnd = rng(11);
        let mut m = Model::with_weight(MAX_LATENCY_WEIGHT);
        m.lateness_sample(4_500_000);
        m.overhead = 1_000_000;
        let priced = m.priced_wake_cost();
        assert_eq!(priced, MAX_COST_SAMPLE);
        let mut longest = 0;
        for i in 0..20_000 {
            feed(&mut m, [if i % 2 == 0 { rnd() % 5_000 } else { 1_000_000 + rnd() % 25_000_000 }]);
            longest = longest.max(m.plan().spin);
        }
        assert!(longest <= priced, "{longest}");
        assert!(longest > 1_000_000, "the cases catch some long gaps: {longest}");
    }

    #[test]
    fn the_spin_follows_the_priced_wake_down_between_searches() {
        // a stream whose wakes each found 16: spin 16 wakes (640 us)
        let mut m = model(30_000, 10_000);
        for _ in 0..64 {
            m.wake_batch(16);
        }
        feed(&mut m, (0..SAMPLES as u64).map(|i| 500 + i * 100));
        assert_eq!(m.plan().spin, m.priced_wake_cost());
        assert!(m.plan().spin > 600_000, "{:?}", m.plan());
        // wakes that find one each: the priced wake falls to 40 us before
        // the next search, and the spin with it (before: 640 us until
        // REFRESH more idle times came)
        for _ in 0..80 {
            m.wake_batch(1);
        }
        assert_eq!(m.priced_wake_cost(), 40_000);
        assert_eq!(m.plan().spin, 40_000);
    }

    #[test]
    fn a_latency_weight_widens_the_window_over_jittered_arrivals() {
        // arrivals 1.0..1.6 ms after the idle start, spread evenly; W 300 us
        let xs = (0..SAMPLES as u64).map(|i| 1_000_000 + i * 600_000 / SAMPLES as u64);
        let mut light = model(250_000, 50_000);
        feed(&mut light, xs.clone());
        let mut heavy = model(250_000, 50_000);
        heavy.weight = 8;
        feed(&mut heavy, xs);
        let (l, h) = (light.plan().window.expect("a window"), heavy.plan().window.expect("a window"));
        assert!(h.0 <= l.0 && h.1 >= l.1 && h.1 - h.0 > l.1 - l.0, "{l:?} {h:?}");
        assert_eq!(h.0, 1_000_000, "weight 8 polls from the first arrival on: {h:?}");
    }

    #[test]
    fn no_single_cost_sample_counts_for_more_than_10_ms() {
        let mut m = Model::default();
        m.lateness_sample(50_000_000);
        assert_eq!(m.lateness(), MAX_COST_SAMPLE);
        for _ in 0..100 {
            m.overhead_sample(u64::MAX);
        }
        assert!(m.wake_cost() <= 2 * MAX_COST_SAMPLE, "{}", m.wake_cost());
    }

    #[test]
    fn lateness_is_measured_then_averaged_and_recalibrated() {
        let mut m = Model::default();
        assert!(m.calibrate_now(), "nothing measured yet");
        m.lateness_sample(80_000);
        assert_eq!(m.lateness(), 80_000);
        m.lateness_sample(0);
        assert_eq!(m.lateness(), 70_000);
        let due = (0..CALIBRATE_EVERY).filter(|_| m.calibrate_now()).count();
        assert_eq!(due, 1);
    }
}
