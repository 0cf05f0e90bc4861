//! Draining a QP before teardown, like the kernel's `ib_drain_qp`: error
//! state, a marker on each queue, done when both markers came back. The
//! markers are the loop's own work requests: they never reach the app, not
//! even when they come back after their drain gave up (a timeout) or after
//! a failed start that had posted one of them: those are remembered as
//! orphans and consumed when they arrive. A QP's markers come back in the
//! order they were posted (per queue), so an orphan is matched before a
//! later drain of the same QP: a drain retried after a timeout is done only
//! when its own markers are back.

use std::time::{Duration, Instant};

use super::control::Done;
use super::handle::LiveQp;
use crate::wc::Wc;

/// wr_id of the send-queue marker posted by a drain.
pub const DRAIN_SEND_WR_ID: u64 = u64::MAX;
/// wr_id of the receive-queue marker posted by a drain.
pub const DRAIN_RECV_WR_ID: u64 = u64::MAX - 1;

pub(crate) struct Watch {
    qp_num: u32,
    cqs: (usize, usize),
    send_seen: bool,
    recv_seen: bool,
    deadline: Instant,
    /// When the loop polls the QP's CQs for the markers without waiting
    /// for an event (see [`Drains::cqs_due`]), and the gap to the next.
    poll_at: Instant,
    poll_gap: Duration,
    done: Done,
}

/// The first look for a drain's markers that raised no event, after its
/// start; each further gap doubles, up to the last.
const POLL_FIRST: Duration = Duration::from_millis(5);
const POLL_LAST: Duration = Duration::from_millis(100);

/// Markers posted by a drain that is over, still to come back.
struct Orphan {
    qp_num: u32,
    cqs: (usize, usize),
    send: bool,
    recv: bool,
}

/// The drains in progress on one loop, and markers still on their way.
#[derive(Default)]
pub(crate) struct Drains {
    watches: Vec<Watch>,
    orphans: Vec<Orphan>,
}

impl Drains {
    /// No drain in progress and no marker on its way (then completions
    /// need not be looked at).
    pub(crate) fn is_empty(&self) -> bool {
        self.watches.is_empty() && self.orphans.is_empty()
    }

    /// A drain in progress (one with a deadline).
    pub(crate) fn in_progress(&self) -> bool {
        !self.watches.is_empty()
    }

    /// Starts draining `qp`: error state and markers (the receive marker
    /// only without an SRQ). The QP's CQs must be in the loop (checked by
    /// the caller).
    pub(crate) fn start(
        &mut self,
        qp: &LiveQp,
        srq: bool,
        deadline: Instant,
        done: Done,
    ) -> std::result::Result<(), (Done, crate::Error)> {
        let (qp_num, send_cq, recv_cq) = match qp.info() {
            Ok(i) => i,
            Err(e) => return Err((done, e)),
        };
        let cqs = (send_cq, recv_cq);
        if let Err((e, recv_posted)) = qp.to_error_with_markers(!srq, DRAIN_SEND_WR_ID, DRAIN_RECV_WR_ID) {
            if recv_posted {
                self.orphans.push(Orphan { qp_num, cqs, send: false, recv: true });
            }
            return Err((done, e));
        }
        let poll_at = crate::sys::deadline_after(Instant::now(), POLL_FIRST);
        self.watches.push(Watch {
            qp_num,
            cqs,
            send_seen: false,
            recv_seen: srq,
            deadline,
            poll_at,
            poll_gap: POLL_FIRST,
            done,
        });
        Ok(())
    }

    /// Takes out every drain (the loop goes away).
    pub(crate) fn take_all(&mut self) -> Vec<Done> {
        self.orphans.clear();
        self.watches.drain(..).map(|w| w.done).collect()
    }

    /// True (consumed) if `wc` is a marker of a drain, in progress or over.
    /// A queue completes in posting order, so a QP's markers come back in
    /// the order their drains posted them: an orphan's (a drain that is
    /// over) before the marker of a drain of the same QP started after it
    /// (the app retried after a timeout). Orphans are matched first: else
    /// the old marker would finish the new drain before the work posted
    /// between the two drains was flushed.
    pub(crate) fn note(&mut self, wc: &Wc) -> bool {
        let send = match wc.wr_id() {
            DRAIN_SEND_WR_ID => true,
            DRAIN_RECV_WR_ID => false,
            _ => return false,
        };
        if let Some(i) = self.orphans.iter().position(|o| o.qp_num == wc.qp_num() && if send { o.send } else { o.recv })
        {
            let o = &mut self.orphans[i];
            if send {
                o.send = false;
            } else {
                o.recv = false;
            }
            if !o.send && !o.recv {
                self.orphans.swap_remove(i);
            }
            return true;
        }
        for w in &mut self.watches {
            if w.qp_num == wc.qp_num() {
                let seen = if send { &mut w.send_seen } else { &mut w.recv_seen };
                if !*seen {
                    *seen = true;
                    return true;
                }
            }
        }
        false
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.watches.iter().map(|w| w.deadline.min(w.poll_at)).min()
    }

    /// The CQs to poll now for markers still missing: a flushed completion
    /// need not raise an event (rxe raises none for a send queue's flush on
    /// a CQ armed solicited-only), so each drain looks by itself, a few ms
    /// after its start and then at growing gaps, until its markers are in.
    pub(crate) fn cqs_due(&mut self, now: Instant) -> Vec<usize> {
        let mut cqs = Vec::new();
        for w in self.watches.iter_mut().filter(|w| now >= w.poll_at) {
            if !w.send_seen {
                cqs.push(w.cqs.0);
            }
            if !w.recv_seen {
                cqs.push(w.cqs.1);
            }
            w.poll_gap = (w.poll_gap * 2).min(POLL_LAST);
            w.poll_at = crate::sys::deadline_after(now, w.poll_gap);
        }
        cqs.sort_unstable();
        cqs.dedup();
        cqs
    }

    /// Takes out the drains that are complete (`Ok`) or past their
    /// deadline (`Err(ETIMEDOUT)`, their missing markers kept as orphans),
    /// for the caller to finish.
    pub(crate) fn take_finished(&mut self, now: Option<Instant>) -> Vec<(Done, crate::Result<()>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.watches.len() {
            let w = &self.watches[i];
            let result = if w.send_seen && w.recv_seen {
                Some(Ok(()))
            } else if now.is_some_and(|n| n >= w.deadline) {
                Some(Err(crate::Error::new("rdmasafe drain_qp", libc::ETIMEDOUT)))
            } else {
                None
            };
            match result {
                Some(r) => {
                    let w = self.watches.swap_remove(i);
                    if !(w.send_seen && w.recv_seen) {
                        self.orphans.push(Orphan {
                            qp_num: w.qp_num,
                            cqs: w.cqs,
                            send: !w.send_seen,
                            recv: !w.recv_seen,
                        });
                    }
                    out.push((w.done, r));
                }
                None => i += 1,
            }
        }
        out
    }

    /// Takes out the drains that can no longer finish because `cq` left the
    /// loop (ECANCELED); forgets markers that can only come through it.
    /// A marker still expected on the queue whose CQ stays in the loop
    /// becomes an orphan: it never reaches that CQ's handler.
    pub(crate) fn take_for_cq(&mut self, cq: usize) -> Vec<(Done, crate::Result<()>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.watches.len() {
            if self.watches[i].cqs.0 == cq || self.watches[i].cqs.1 == cq {
                let w = self.watches.swap_remove(i);
                self.orphans.push(Orphan { qp_num: w.qp_num, cqs: w.cqs, send: !w.send_seen, recv: !w.recv_seen });
                out.push((w.done, Err(crate::Error::new("rdmasafe drain_qp: its CQ left the loop", libc::ECANCELED))));
            } else {
                i += 1;
            }
        }
        // Markers that could only come through `cq` never come now.
        for o in &mut self.orphans {
            if o.cqs.0 == cq {
                o.send = false;
            }
            if o.cqs.1 == cq {
                o.recv = false;
            }
        }
        self.orphans.retain(|o| o.send || o.recv);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn marker(qp_num: u32, wr_id: u64) -> Wc {
        let mut wc = crate::verbs::empty_wc();
        let raw = &mut Wc::as_raw_slice_mut(std::slice::from_mut(&mut wc))[0];
        raw.qp_num = qp_num;
        raw.wr_id = wr_id;
        wc
    }

    fn watch(qp_num: u32, deadline: Instant) -> Watch {
        Watch {
            qp_num,
            cqs: (1, 2),
            send_seen: false,
            recv_seen: false,
            deadline,
            poll_at: deadline,
            poll_gap: POLL_FIRST,
            done: Done::Nothing,
        }
    }

    #[test]
    fn markers_of_a_timed_out_drain_are_consumed_when_they_come_back() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch(7, now));
        assert!(d.note(&marker(7, DRAIN_RECV_WR_ID)), "the receive marker in time");
        let finished = d.take_finished(Some(now + Duration::from_millis(1)));
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0].1.as_ref().unwrap_err().errno(), libc::ETIMEDOUT);
        assert!(!d.in_progress() && !d.is_empty(), "the send marker is still on its way");
        assert!(!d.note(&marker(8, DRAIN_SEND_WR_ID)), "another QP's wr_id is the app's");
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the late send marker is the loop's");
        assert!(!d.note(&marker(7, DRAIN_SEND_WR_ID)), "only once");
        assert!(d.is_empty());
    }

    /// A drain of QP 7 timed out with its send marker still on its way; the
    /// app drains QP 7 again. The old marker comes back first (a queue
    /// completes in order): it is the orphan's, and the new drain is done
    /// only with its own marker (else it would be done before the work
    /// posted between the two drains was flushed).
    #[test]
    fn a_retried_drain_is_not_credited_with_the_old_drains_marker() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch(7, now));
        assert!(d.note(&marker(7, DRAIN_RECV_WR_ID)));
        assert_eq!(d.take_finished(Some(now)).len(), 1, "the first drain timed out");
        let later = now + Duration::from_secs(60);
        d.watches.push(watch(7, later));
        assert!(d.note(&marker(7, DRAIN_RECV_WR_ID)), "the retry's receive marker");
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the first drain's send marker: the loop's");
        assert!(d.take_finished(Some(now)).is_empty(), "the retry still waits for its own send marker");
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the retry's send marker");
        let finished = d.take_finished(Some(now));
        assert_eq!(finished.len(), 1);
        assert!(finished[0].1.is_ok(), "the retry is done");
        assert!(d.is_empty());
    }

    #[test]
    fn orphans_go_with_their_cq() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch(7, now));
        d.take_finished(Some(now));
        assert!(!d.is_empty());
        assert!(d.take_for_cq(2).is_empty());
        assert!(!d.is_empty(), "the send marker still comes through CQ 1");
        assert!(!d.note(&marker(7, DRAIN_RECV_WR_ID)), "the receive marker's CQ is gone: forgotten");
        assert!(d.take_for_cq(1).is_empty());
        assert!(d.is_empty(), "markers that can only come through a removed CQ are forgotten");
    }

    #[test]
    fn a_cq_removed_mid_drain_leaves_the_other_queues_marker_to_the_loop() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch(7, now + Duration::from_secs(60)));
        let cancelled = d.take_for_cq(2);
        assert_eq!(cancelled.len(), 1);
        assert_eq!(cancelled[0].1.as_ref().unwrap_err().errno(), libc::ECANCELED);
        assert!(!d.in_progress());
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the send marker, flushed on CQ 1, is the loop's");
        assert!(d.is_empty());
    }
}
