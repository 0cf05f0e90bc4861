//! What a loop and each of its CQs can be told.

use std::time::Duration;

use crate::{Error, Result};

/// How the loop waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Arm, sleep until notified, re-arm, drain. Lowest CPU use. Per wakeup
    /// the work is proportional to the CQs that fired, not to how many the
    /// loop serves.
    Event,
    /// Poll every CQ continuously; never arm, never sleep. Lowest latency,
    /// one core; each cycle polls every CQ (O(CQs served)).
    BusyPoll,
    /// Poll every CQ while busy and for `spin` after the last completion
    /// handed to a handler, then arm and sleep until the next event
    /// (polling phase: O(CQs)). The loop's own completions (keepalive
    /// probes, drain markers) start or renew no spin.
    Adaptive {
        /// How long to keep polling after the last completion handed to a
        /// handler.
        spin: Duration,
    },
    /// Adaptive mode that learns when to spin: it measures its own
    /// sleep-to-wake cost and the idle gaps before completions arrive, and
    /// from the recent gaps picks, each time it goes idle, the cheapest of
    /// sleeping at once, spinning for a while, or sleeping until just before
    /// the next arrival is due and spinning from then (periodic traffic).
    /// A wake is priced by the completions it delays (the average over the
    /// recent wakes from the loop's own sleeps of the completions handed to
    /// handlers in each wake's cycle, and in the next cycles those a CQ's
    /// budget left over, not those that arrive after the wake, such as a
    /// reply's own send completion; a solicited-only CQ counts once per
    /// wake, however many handler calls its completions take; a loop driven
    /// with [`crate::Wait::None`] or a zero timeout never sleeps itself and
    /// learns none, [`crate::cq::LoopStats::learn_wake_batch_milli`]). When the plan
    /// spins through every recent gap and sets no timer, it spins for one
    /// priced wake after the first empty poll: a stream's rare longer gap
    /// is spun through, not slept through, and a ping-pong whose round
    /// trips are all shorter than a wake spins one wake. No plan spins
    /// longer than one priced wake (as priced now) after the last
    /// completion. The loop's own completions (keepalive probes, drain
    /// markers) are no arrivals: they end no idle gap and count in no wake,
    /// so an idle connection's keepalive teaches the loop nothing.
    /// The CQs stay armed while it sleeps on a timer, so an early completion
    /// still wakes it. Reads the clock at the first empty poll after
    /// completions, once per 4 empty polling passes after that (every pass
    /// when driven with [`crate::Wait::None`]), when completions come after
    /// an idle time (not while they keep coming), and around each sleep. A
    /// single measured cost counts for at most 10 ms. A microsecond of CPU
    /// and one of added latency count alike, unless
    /// [`LoopOptions::learn_latency_weight`] says otherwise.
    Learning,
}

/// Options of a loop.
#[derive(Clone, Copy, Debug)]
pub struct LoopOptions {
    /// How to wait.
    pub mode: Mode,
    /// The default of [`CqOptions::solicited_only`] for CQs added without
    /// options of their own.
    pub solicited_only: bool,
    /// Work completions per `ibv_poll_cq` call and per handler call (1..=4096).
    pub poll_batch: usize,
    /// CQ events counted on a CQ before one `ibv_ack_cq_events` call
    /// (1..=65536). Pending acks are always flushed before stop, removal
    /// and drop.
    pub ack_batch: u32,
    /// If set: when no event arrived within this time while the app reports
    /// outstanding work ([`super::LoopControl::set_outstanding`]), poll every
    /// CQ anyway and count it in [`super::LoopStats::watchdog_polls`]. The
    /// time runs in periods, one after the other, while the watchdog
    /// counts: work reported, and the loop waiting for events (not while a
    /// polling mode spins, nor in [`super::Mode::BusyPoll`]: they poll
    /// every CQ anyway). A period that saw no CQ event ends in the poll,
    /// so the poll comes one to two periods after the last event (reading
    /// an event costs no clock read, and the loop's deadline,
    /// [`super::LoopControl::next_timeout`], stays the period's end); when
    /// the watchdog counts again after a time it did not (no work
    /// reported, a spin, a stop), a new period begins.
    pub watchdog: Option<Duration>,
    /// Time each handler call and each cycle, for
    /// [`super::LoopStats::longest_handler_ns`] and
    /// [`super::LoopStats::cycle_time_us`] (both stay 0 when off).
    ///
    /// **Off by default.** Timing reads the clock once before a cycle's
    /// first handler call and once after each call (n + 1 reads per n
    /// calls). On a machine whose clocksource is the TSC that is a vDSO call
    /// of some tens of nanoseconds; on a VM whose clocksource is not (hpet,
    /// acpi_pm, some clouds' kvm-clock or xen set-ups) every read is a
    /// system call, which would double the system calls of an event-mode
    /// wakeup. With it off the loop reads the clock only for what needs a
    /// time: keepalives, the watchdog, drain and call timeouts, adaptive
    /// mode's spin, and learning mode's measurements (see
    /// [`Mode::Learning`]).
    pub timing_stats: bool,
    /// [`Mode::Learning`] only: how many microseconds of CPU one
    /// microsecond of added latency is worth when the loop prices the ways
    /// to wait (1..=1000, default 1: alike). A wake from sleep adds its
    /// block + wake cost to the latency of each completion that waited for
    /// it; with a weight of `k` that cost is priced `k` times, so the loop
    /// spins longer after completions and polls in wider windows around
    /// periodic arrivals: lower latency for more CPU. A weighted wake is
    /// priced at most 10 ms (its own cost, if that is more), and the spin
    /// after the last completion is never longer than one priced wake: no
    /// weight makes the loop spin for seconds, but a loop whose recent gaps
    /// are all short spins up to that bound after its last completion
    /// (e.g. 10 ms at weight 1000 with a 25 us wake, see
    /// [`Mode::Learning`]). A window around periodic arrivals polls as
    /// long as their recent spread. Other modes ignore it, but it must be
    /// in range in every mode.
    pub learn_latency_weight: u32,
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions {
            mode: Mode::Event,
            solicited_only: false,
            poll_batch: 16,
            ack_batch: 16,
            watchdog: None,
            timing_stats: false,
            learn_latency_weight: 1,
        }
    }
}

impl LoopOptions {
    pub(crate) fn check(&self) -> Result<()> {
        let ok = (1..=4096).contains(&self.poll_batch)
            && (1..=65536).contains(&self.ack_batch)
            && (1..=super::learn::MAX_LATENCY_WEIGHT).contains(&self.learn_latency_weight);
        if ok {
            Ok(())
        } else {
            Err(Error::new("rdmasafe_cq_loop options", libc::EINVAL))
        }
    }

    /// The options a CQ added without its own gets.
    pub(crate) fn cq_defaults(&self) -> CqOptions {
        CqOptions { solicited_only: self.solicited_only, budget: 0 }
    }
}

/// Options of one CQ in a loop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqOptions {
    /// Arm this CQ for solicited completions only
    /// (`ibv_req_notify_cq(cq, 1)`): events come only for receive
    /// completions of messages sent with IBV_SEND_SOLICITED, and for
    /// errors. The CQ is drained when such an event comes (everything in it
    /// then, unsolicited completions included) and, for a QP with a
    /// keepalive, before a probe is judged overdue (a keepalive whose send
    /// CQ is armed so sees its probe's completion only then, a `bound`
    /// after it posted the probe: it probes about once per `period` +
    /// `bound`, and declares a peer that died just after answering a probe
    /// dead within `period` + 2 × `bound` of that answer, not `period` +
    /// `bound`). Successful send
    /// completions raise no event: a send CQ armed so is only drained by
    /// those, so size it for the sends between two of them. Nor, on rxe,
    /// does a send queue's flush (its QP moved to the error state): a
    /// keepalive that declares the peer dead drains the QP itself, so that
    /// flush is delivered; after moving a QP to the error state yourself,
    /// drain it ([`super::LoopControl::drain_qp`], which looks for its
    /// markers without waiting for an event) to have the flushed sends
    /// delivered.
    pub solicited_only: bool,
    /// Completions handled per cycle at most (0: no limit). A CQ that still
    /// has completions after its budget is polled again in the next cycle,
    /// without waiting for an event, after every other CQ that is ready had
    /// its turn: one flooding CQ cannot starve the others. One exception:
    /// after a keepalive is added on a QP whose number an older QP's
    /// probe may still come back with, the loop's next tick polls that
    /// QP's send CQ once for all it holds (at most its size), and hands
    /// the app's completions among them to the handler beyond the budget.
    pub budget: usize,
}

/// Dead-peer detection for one RC QP (see [`super::LoopControl::add_keepalive`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Probe after the QP has been idle (no successful completion) this long.
    pub period: Duration,
    /// Declare the peer dead when a probe has not completed within this.
    pub bound: Duration,
    /// The wr_id rdmasafe gives its probes. Probe completions are consumed
    /// by the loop, never handed to the app's handler (also one still out
    /// when the send CQ leaves the loop: it is consumed by the loop the CQ
    /// joins next, as drain markers are), so pick a value the app never
    /// uses in its own work requests (one value for all keepalives is
    /// simplest). A probe still out when its keepalive ends is looked for
    /// by QP number, wr_id and CQ, as its completion may still come (rxe,
    /// for one, leaves a destroyed QP's completions in the CQ): also among
    /// the completions of a new QP that got the number, until the loop has
    /// polled the send CQ of a keepalive added on that QP (at its next
    /// tick, through that CQ; through another CQ, until it comes).
    /// rdmasafe keeps at most one probe
    /// outstanding: it needs one free send-queue slot (when the queue is
    /// full the probe is retried until the bound, not counted as a death).
    pub wr_id: u64,
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
        assert!(LoopOptions { learn_latency_weight: 0, ..Default::default() }.check().is_err());
        assert!(LoopOptions { learn_latency_weight: 1001, ..Default::default() }.check().is_err());
        assert!(LoopOptions { learn_latency_weight: 1000, ..Default::default() }.check().is_ok());
        let o = LoopOptions { solicited_only: true, ..Default::default() };
        assert_eq!(o.cq_defaults(), CqOptions { solicited_only: true, budget: 0 });
    }
}
