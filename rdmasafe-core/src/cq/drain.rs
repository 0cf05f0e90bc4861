//! Draining a QP before teardown, like the kernel's `ib_drain_qp`: error
//! state, a marker on each queue, done when both markers came back. The
//! markers are the loop's own work requests: they never reach the app, not
//! even when they come back after their drain gave up (a timeout) or after
//! a failed start that had posted one of them: those are remembered as
//! orphans and consumed when they arrive. A QP's markers come back in the
//! order they were posted (per queue), so an orphan is matched before a
//! later drain of the same QP: a drain retried after a timeout is done only
//! when its own markers are back. The price: a marker that never comes
//! back (the CQ overran, or the app polled it itself while it was out of
//! every loop) is waited for by every later drain of that QP, which then
//! times out (ETIMEDOUT; destroy the QP). Orphans of a QP destroyed before
//! its markers came back are forgotten when another QP with its number is
//! drained or one of their CQs joins a loop where such a QP drains (see
//! [`Drains::forget_stale`]); a marker of the destroyed QP still in its
//! CQ after that reaches the handler (it needs a reused QP number).
//!
//! Orphans go with their CQ: when it leaves the loop (removed, or the loop
//! dropped) the markers still to come through it are parked process-wide
//! by the CQ's address, and the loop it is added to next (the same or
//! another) consumes them. So on a QP that was drained, the wr_ids
//! [`DRAIN_SEND_WR_ID`] and [`DRAIN_RECV_WR_ID`] belong to the loop, also
//! after its CQ moved. At most [`MAX_PARKED`] markers are parked (the
//! oldest forgotten first). A destroyed CQ's are forgotten ([`cq_destroyed`]:
//! a Rust `Cq` and `rdmasafe_cq_loop_destroy_cq` say so themselves); a CQ
//! the app destroys itself with markers in it, and a new CQ at the same
//! address, inherit them (it only ever consumes those two wr_ids of those
//! QP numbers).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::control::Done;
use super::handle::LiveQp;
use super::keepalive::LateProbe;
use crate::wc::Wc;

/// wr_id of the send-queue marker posted by a drain.
pub const DRAIN_SEND_WR_ID: u64 = u64::MAX;
/// wr_id of the receive-queue marker posted by a drain.
pub const DRAIN_RECV_WR_ID: u64 = u64::MAX - 1;

pub(crate) struct Watch {
    qp_num: u32,
    /// The QP's address: with `qp_num`, who the markers belong to (see
    /// [`Drains::forget_stale`]).
    qp: usize,
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

impl Watch {
    /// The markers of this drain still to come, as an orphan.
    fn orphan(&self) -> Orphan {
        Orphan { qp_num: self.qp_num, qp: self.qp, cqs: self.cqs, send: !self.send_seen, recv: !self.recv_seen }
    }
}

/// The first look for a drain's markers that raised no event, after its
/// start; each further gap doubles, up to the last.
const POLL_FIRST: Duration = Duration::from_millis(5);
const POLL_LAST: Duration = Duration::from_millis(100);

/// Markers posted by a drain that is over, still to come back.
struct Orphan {
    qp_num: u32,
    qp: usize,
    cqs: (usize, usize),
    send: bool,
    recv: bool,
}

impl Orphan {
    /// Those of these markers that come through `cq`, to park for it.
    fn through(&self, cq: usize) -> Option<Parked> {
        let send = self.send && self.cqs.0 == cq;
        let recv = self.recv && self.cqs.1 == cq;
        (send || recv).then_some(Parked { cq, qp_num: self.qp_num, qp: self.qp, send, recv })
    }
}

/// The drains in progress on one loop, and markers still on their way.
#[derive(Default)]
pub(crate) struct Drains {
    watches: Vec<Watch>,
    orphans: Vec<Orphan>,
}

/// Markers still to come through a CQ that left its loop (removed, or its
/// loop dropped): kept process-wide by the CQ's address, for whichever loop
/// the CQ is added to next (the same or another). Else a late marker would
/// reach the handler the CQ gets there.
#[derive(Debug, PartialEq)]
struct Parked {
    cq: usize,
    qp_num: u32,
    qp: usize,
    send: bool,
    recv: bool,
}

/// At most this many are parked, the oldest dropped first: a CQ that is
/// destroyed and never comes back must not grow memory without bound.
const MAX_PARKED: usize = 1024;

/// The parked markers, and the parked keepalive probes (each at most
/// [`MAX_PARKED`]).
#[derive(Default)]
struct Parking {
    markers: VecDeque<Parked>,
    probes: VecDeque<LateProbe>,
}

/// Appends `p` to `q`, dropping the oldest (returned) when full.
fn bounded_push<T>(q: &mut VecDeque<T>, p: T) -> Option<T> {
    let old = if q.len() >= MAX_PARKED { q.pop_front() } else { None };
    q.push_back(p);
    old
}

/// Takes the items of `q` that `mine` picks out, keeping the others' order.
pub(crate) fn take_where<T>(q: &mut VecDeque<T>, mine: impl Fn(&T) -> bool) -> Vec<T> {
    if !q.iter().any(&mine) {
        return Vec::new();
    }
    let (out, rest): (Vec<T>, Vec<T>) = std::mem::take(q).into_iter().partition(|p| mine(p));
    *q = rest.into();
    out
}

impl Parking {
    /// Parks `p`; returns the oldest, forgotten to make room.
    fn park(&mut self, p: Parked) -> Option<Parked> {
        bounded_push(&mut self.markers, p)
    }

    /// Takes out the markers parked for `cq`.
    fn take(&mut self, cq: usize) -> Vec<Parked> {
        take_where(&mut self.markers, |p| p.cq == cq)
    }
}

/// The process's parked markers and probes (touched when a CQ leaves or
/// joins a loop, or a loop goes away: not on a hot path). Nothing logs
/// while it is held (a log callback may call back into rdmasafe).
fn parking() -> MutexGuard<'static, Parking> {
    static P: Mutex<Parking> = Mutex::new(Parking { markers: VecDeque::new(), probes: VecDeque::new() });
    P.lock().unwrap_or_else(|e| e.into_inner())
}

/// Parks keepalive probes still to come through CQs that leave their loop;
/// the loop each CQ joins next consumes them ([`take_probes`]).
pub(crate) fn park_probes(items: Vec<LateProbe>) {
    if items.is_empty() {
        return;
    }
    let forgotten: Vec<LateProbe> = {
        let mut p = parking();
        items.into_iter().filter_map(|i| bounded_push(&mut p.probes, i)).collect()
    };
    for old in forgotten {
        log::debug!(
            target: "rdmasafe",
            "keepalive: {MAX_PARKED} probes parked for CQs out of every loop; forgetting the oldest (QP {}, CQ {:#x})",
            old.qp_num,
            old.cq
        );
    }
}

/// Takes out the keepalive probes parked for `cq` (it joins a loop).
pub(crate) fn take_probes(cq: usize) -> Vec<LateProbe> {
    take_where(&mut parking().probes, |p| p.cq == cq)
}

/// Parks `items`, then (the lock released) says what was forgotten.
fn park_all(items: impl IntoIterator<Item = Parked>) {
    let forgotten: Vec<Parked> = {
        let mut p = parking();
        items.into_iter().filter_map(|i| p.park(i)).collect()
    };
    for old in forgotten {
        log::debug!(
            target: "rdmasafe",
            "drain: {MAX_PARKED} markers parked for CQs out of every loop; forgetting the oldest (QP {}, CQ {:#x})",
            old.qp_num,
            old.cq
        );
    }
}

/// Tells rdmasafe that the app destroys `cq` (out of every loop; call it
/// right before `ibv_destroy_cq`): drain markers and keepalive probes still
/// expected through it go with it, and a new CQ at the same address must
/// not inherit them (see the module doc of drains). Rust `Cq`s and
/// `rdmasafe_cq_loop_destroy_cq` do this themselves; without it a new CQ at
/// the address of a CQ destroyed with markers or probes in it consumes
/// those wr_ids of those QP numbers.
pub fn cq_destroyed(cq: *mut crate::sys::ibv_cq) {
    drop(cq_destroying(cq));
}

/// [`cq_destroyed`] for a destroy that may fail: what was parked for `cq`
/// is taken out (a new CQ at its address cannot inherit it once the
/// destroy succeeded), and [`LeftWith::destroy_failed`] parks it again
/// for the CQ, which lives on (the loop it joins again consumes its
/// markers and probes, which would otherwise reach its handler).
pub fn cq_destroying(cq: *mut crate::sys::ibv_cq) -> LeftWith {
    let mut p = parking();
    LeftWith { markers: p.take(cq as usize), probes: take_where(&mut p.probes, |x| x.cq == cq as usize) }
}

/// The drain markers and keepalive probes still expected through a CQ
/// being destroyed ([`cq_destroying`]); dropped with a destroy that
/// succeeded.
#[must_use = "dropped once the destroy succeeded, or given back with destroy_failed"]
pub struct LeftWith {
    markers: Vec<Parked>,
    probes: Vec<LateProbe>,
}

impl LeftWith {
    /// The CQ's destroy failed: it still exists, and what was parked for
    /// it is parked again.
    pub fn destroy_failed(self) {
        park_all(self.markers);
        park_probes(self.probes);
    }
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
        let qp_addr = qp.raw() as usize;
        self.forget_stale(qp_num, qp_addr);
        if let Err((e, recv_posted)) = qp.to_error_with_markers(!srq, DRAIN_SEND_WR_ID, DRAIN_RECV_WR_ID) {
            if recv_posted {
                self.orphans.push(Orphan { qp_num, qp: qp_addr, cqs, send: false, recv: true });
            }
            return Err((done, e));
        }
        let poll_at = crate::sys::deadline_after(Instant::now(), POLL_FIRST);
        self.watches.push(Watch {
            qp_num,
            qp: qp_addr,
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

    /// A drain of the QP `qp` with number `qp_num` starts: orphans of that
    /// number but another QP are of a QP that was destroyed before its
    /// markers came back (live QPs of one device have distinct numbers):
    /// matched first (see [`Drains::note`]) they would take this drain's
    /// markers. Forgotten (if one of them is still in its CQ, it then
    /// reaches the handler). A new QP at the old one's address *and* with
    /// its number is not told apart: its drain would then time out.
    fn forget_stale(&mut self, qp_num: u32, qp: usize) {
        let before = self.orphans.len();
        self.orphans.retain(|o| o.qp_num != qp_num || o.qp == qp);
        if self.orphans.len() != before {
            log::debug!(target: "rdmasafe", "drain: markers of a destroyed QP {qp_num} forgotten (a new QP has its number)");
        }
    }

    /// Takes out every drain (the loop goes away); the markers still to
    /// come are parked for the loops their CQs are added to next.
    pub(crate) fn take_all(&mut self) -> Vec<Done> {
        let mut dones = Vec::with_capacity(self.watches.len());
        for w in self.watches.drain(..) {
            if !(w.send_seen && w.recv_seen) {
                self.orphans.push(w.orphan());
            }
            dones.push(w.done);
        }
        let mut items = Vec::new();
        for o in self.orphans.drain(..) {
            items.extend(o.through(o.cqs.0));
            if o.cqs.1 != o.cqs.0 {
                items.extend(o.through(o.cqs.1));
            }
        }
        park_all(items);
        dones
    }

    /// `cq` joins the loop: the markers parked for it when it left a loop
    /// (this one or another) are this loop's to consume.
    /// Markers of a QP destroyed since (a drain in progress is of another
    /// QP with its number) are forgotten, as at a drain's start.
    pub(crate) fn adopt(&mut self, cq: usize) {
        let parked = parking().take(cq);
        for p in parked {
            if self.watches.iter().any(|w| w.qp_num == p.qp_num && w.qp != p.qp) {
                continue;
            }
            self.orphans.push(Orphan { qp_num: p.qp_num, qp: p.qp, cqs: (cq, cq), send: p.send, recv: p.recv });
        }
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
                    let w = self.watches.remove(i); // in start order (see `note`)
                    if !(w.send_seen && w.recv_seen) {
                        self.orphans.push(w.orphan());
                    }
                    out.push((w.done, r));
                }
                None => i += 1,
            }
        }
        out
    }

    /// Takes out the drains that can no longer finish because `cq` left the
    /// loop (ECANCELED). Their markers, and those of drains that are over,
    /// still to come: through `cq`, parked for the loop `cq` is added to
    /// next (see [`Drains::adopt`]); through a CQ that stays in the loop,
    /// orphans of this loop. Neither ever reaches a handler.
    pub(crate) fn take_for_cq(&mut self, cq: usize) -> Vec<(Done, crate::Result<()>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.watches.len() {
            if self.watches[i].cqs.0 == cq || self.watches[i].cqs.1 == cq {
                let w = self.watches.remove(i); // in start order (see `note`)
                self.orphans.push(w.orphan());
                out.push((w.done, Err(crate::Error::new("rdmasafe drain_qp: its CQ left the loop", libc::ECANCELED))));
            } else {
                i += 1;
            }
        }
        // Markers that can only come through `cq` come back with it, to
        // whichever loop it joins next: parked till then.
        let mut items = Vec::new();
        for o in &mut self.orphans {
            if let Some(p) = o.through(cq) {
                o.send &= !p.send;
                o.recv &= !p.recv;
                items.push(p);
            }
        }
        self.orphans.retain(|o| o.send || o.recv);
        if !items.is_empty() {
            park_all(items);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn marker(qp_num: u32, wr_id: u64) -> Wc {
        crate::verbs::wc_of(qp_num, wr_id)
    }

    fn watch(qp_num: u32, deadline: Instant) -> Watch {
        watch_on(qp_num, (1, 2), deadline)
    }

    /// The parked markers are process-wide: a test that parks or adopts
    /// uses CQ addresses no other test uses.
    fn watch_on(qp_num: u32, cqs: (usize, usize), deadline: Instant) -> Watch {
        Watch {
            qp_num,
            qp: 0x9900 + qp_num as usize,
            cqs,
            send_seen: false,
            recv_seen: false,
            deadline,
            poll_at: deadline,
            poll_gap: POLL_FIRST,
            done: Done::Nothing,
        }
    }

    /// Exactly one drain finished, with Ok, and nothing is left to watch.
    fn one_done_and_nothing_left(d: &mut Drains, now: Instant, what: &str) {
        let finished = d.take_finished(Some(now));
        assert_eq!(finished.len(), 1, "{what}");
        assert!(finished[0].1.is_ok(), "{what}");
        assert!(d.is_empty(), "{what}");
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
        one_done_and_nothing_left(&mut d, now, "the retry is done");
    }

    /// A timed-out drain's QP destroyed before its markers came back, and a
    /// new QP with its number drained: the old orphans (matched first) do
    /// not take the new drain's markers. The same QP's orphans stay.
    #[test]
    fn orphans_of_a_destroyed_qp_do_not_take_a_new_qps_markers() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch(7, now));
        assert_eq!(d.take_finished(Some(now)).len(), 1, "timed out, both markers orphans");
        d.forget_stale(7, 0x9900 + 7);
        assert!(!d.is_empty(), "the same QP drained again: its orphans stay");
        let mut new = watch(7, now + Duration::from_secs(60));
        new.qp = 0x4242; // another QP, the old one's number
        d.forget_stale(7, new.qp);
        d.watches.push(new);
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)));
        assert!(d.note(&marker(7, DRAIN_RECV_WR_ID)));
        one_done_and_nothing_left(&mut d, now, "the new QP's drain got its own markers");
    }

    /// A CQ that leaves the loop takes the markers still to come through it
    /// along (parked); whichever loop it joins next consumes them, the one
    /// it left or another. The other queue's marker, whose CQ stays, stays
    /// this loop's.
    #[test]
    fn orphans_go_with_their_cq() {
        let (scq, rcq) = (0x7e57_0010, 0x7e57_0020);
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch_on(7, (scq, rcq), now));
        d.take_finished(Some(now));
        assert!(!d.is_empty());
        assert!(d.take_for_cq(rcq).is_empty());
        assert!(!d.is_empty(), "the send marker still comes through the send CQ");
        assert!(d.take_for_cq(scq).is_empty());
        assert!(d.is_empty(), "both markers left with their CQs");
        // The receive CQ comes back to this loop, the send CQ to another.
        d.adopt(rcq);
        let mut other = Drains::default();
        other.adopt(scq);
        assert!(!d.note(&marker(7, DRAIN_SEND_WR_ID)), "the send marker is not this loop's now");
        assert!(d.note(&marker(7, DRAIN_RECV_WR_ID)), "the late receive marker is the loop's again");
        assert!(other.note(&marker(7, DRAIN_SEND_WR_ID)), "the late send marker is the other loop's");
        assert!(d.is_empty() && other.is_empty());
        d.adopt(rcq);
        other.adopt(scq);
        assert!(d.is_empty() && other.is_empty(), "adopted once");
    }

    /// A drain cancelled because its CQ left (ECANCELED) parks the markers
    /// still to come through that CQ too.
    #[test]
    fn a_drain_cancelled_by_its_cq_leaving_parks_its_markers() {
        let cq = 0x7e57_0030;
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch_on(9, (cq, cq), now + Duration::from_secs(60)));
        assert_eq!(d.take_for_cq(cq).len(), 1);
        assert!(d.is_empty());
        let mut next = Drains::default();
        next.adopt(cq);
        assert!(next.note(&marker(9, DRAIN_RECV_WR_ID)));
        assert!(next.note(&marker(9, DRAIN_SEND_WR_ID)));
        assert!(next.is_empty());
    }

    /// A loop that goes away parks the markers still to come, of its drains
    /// in progress and of those that are over, by CQ.
    #[test]
    fn a_dropped_loop_parks_its_markers() {
        let (scq, rcq, cq) = (0x7e57_0040, 0x7e57_0050, 0x7e57_0060);
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch_on(11, (scq, rcq), now));
        d.take_finished(Some(now));
        d.watches.push(watch_on(12, (cq, cq), now + Duration::from_secs(60)));
        assert_eq!(d.take_all().len(), 1, "the drain in progress ends");
        assert!(d.is_empty());
        let (mut a, mut b, mut c) = (Drains::default(), Drains::default(), Drains::default());
        a.adopt(scq);
        b.adopt(rcq);
        c.adopt(cq);
        assert!(a.note(&marker(11, DRAIN_SEND_WR_ID)) && !a.note(&marker(11, DRAIN_RECV_WR_ID)));
        assert!(b.note(&marker(11, DRAIN_RECV_WR_ID)) && !b.note(&marker(11, DRAIN_SEND_WR_ID)));
        assert!(c.note(&marker(12, DRAIN_SEND_WR_ID)) && c.note(&marker(12, DRAIN_RECV_WR_ID)));
        assert!(a.is_empty() && b.is_empty() && c.is_empty());
    }

    /// A dropped loop parks only what is still to come: a drain whose
    /// markers were both in (not taken out yet) parks nothing.
    #[test]
    fn a_complete_drain_parks_nothing_when_its_loop_goes() {
        let cq = 0x7e57_0110;
        let mut d = Drains::default();
        let mut w = watch_on(7, (cq, cq), Instant::now() + Duration::from_secs(60));
        w.send_seen = true;
        w.recv_seen = true;
        d.watches.push(w);
        assert_eq!(d.take_all().len(), 1);
        assert!(parking().take(cq).is_empty(), "nothing parked for a complete drain");
    }

    /// Markers parked for a CQ of a QP destroyed since: the CQ joins a loop
    /// where another QP with that number drains; they are not adopted
    /// (they would take that drain's markers).
    #[test]
    fn a_stale_parked_marker_is_not_adopted_beside_a_drain_of_its_qp_number() {
        let cq = 0x7e57_0120;
        park_all([Parked { cq, qp_num: 5, qp: 0xdead, send: true, recv: false }]);
        let mut d = Drains::default();
        d.watches.push(watch_on(5, (cq, cq), Instant::now() + Duration::from_secs(60)));
        d.adopt(cq);
        assert!(d.orphans.is_empty(), "the destroyed QP's marker is forgotten");
        assert!(d.note(&marker(5, DRAIN_SEND_WR_ID)));
        assert!(d.watches[0].send_seen, "the running drain got its own marker");
    }

    /// A destroyed CQ's parked markers go with it: a new CQ at its address
    /// inherits nothing.
    #[test]
    fn a_destroyed_cqs_parked_markers_are_forgotten() {
        let cq = 0x7e57_0130;
        park_all([Parked { cq, qp_num: 6, qp: 0xbeef, send: true, recv: true }]);
        cq_destroyed(cq as *mut crate::sys::ibv_cq);
        let mut d = Drains::default();
        d.adopt(cq);
        assert!(d.is_empty());
    }

    /// A CQ whose destroy failed keeps its parked markers and probes (it
    /// lives on, and may join a loop again, which must consume them; found
    /// by a review: `rdmasafe_cq_loop_destroy_cq` dropped them before a
    /// destroy that then failed with EBUSY, and the CQ added again handed
    /// the loop's markers to the app's handler).
    #[test]
    fn a_cq_whose_destroy_failed_keeps_what_was_parked_for_it() {
        let cq = 0x7e57_0140;
        park_all([Parked { cq, qp_num: 7, qp: 0xbee7, send: true, recv: false }]);
        park_probes(vec![LateProbe { qp_num: 7, qp: 0xbee7, wr_id: 0x99, cq }]);
        cq_destroying(cq as *mut crate::sys::ibv_cq).destroy_failed();
        let mut d = Drains::default();
        d.adopt(cq);
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the marker is still the loop's");
        assert_eq!(take_probes(cq).len(), 1, "the probe is still parked for it");
        // A destroy that succeeded takes them along.
        park_probes(vec![LateProbe { qp_num: 7, qp: 0xbee7, wr_id: 0x99, cq }]);
        drop(cq_destroying(cq as *mut crate::sys::ibv_cq));
        assert!(take_probes(cq).is_empty());
    }

    /// Two drains of one QP in progress: the older gets the first marker,
    /// also after a drain in front of them in the list finished.
    #[test]
    fn drains_of_one_qp_keep_their_order() {
        let later = Instant::now() + Duration::from_secs(60);
        let mut d = Drains::default();
        let mut other = watch(9, later);
        other.send_seen = true;
        other.recv_seen = true;
        d.watches.push(other);
        d.watches.push(watch(7, later));
        let mut second = watch(7, later);
        second.qp = 0x7777; // told apart in this test by its address
        d.watches.push(second);
        assert_eq!(d.take_finished(None).len(), 1, "QP 9's drain is done");
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)));
        let first = d.watches.iter().find(|w| w.qp != 0x7777).unwrap();
        assert!(first.send_seen, "the older drain of QP 7 got the first marker");
    }

    /// At most MAX_PARKED markers are parked; the oldest go first.
    #[test]
    fn parked_markers_are_bounded() {
        let mut p = Parking::default();
        for i in 0..MAX_PARKED + 10 {
            p.park(Parked { cq: i, qp_num: 1, qp: 0x9901, send: true, recv: false });
        }
        assert_eq!(p.markers.len(), MAX_PARKED);
        assert!(p.take(5).is_empty(), "one of the oldest: dropped");
        assert_eq!(
            p.take(MAX_PARKED + 9),
            vec![Parked { cq: MAX_PARKED + 9, qp_num: 1, qp: 0x9901, send: true, recv: false }]
        );
        assert_eq!(p.markers.len(), MAX_PARKED - 1);
    }

    #[test]
    fn a_cq_removed_mid_drain_leaves_the_other_queues_marker_to_the_loop() {
        let now = Instant::now();
        let mut d = Drains::default();
        d.watches.push(watch_on(7, (0x7e57_0070, 0x7e57_0080), now + Duration::from_secs(60)));
        let cancelled = d.take_for_cq(0x7e57_0080);
        assert_eq!(cancelled.len(), 1);
        assert_eq!(cancelled[0].1.as_ref().unwrap_err().errno(), libc::ECANCELED);
        assert!(!d.in_progress());
        assert!(d.note(&marker(7, DRAIN_SEND_WR_ID)), "the send marker, flushed on the CQ that stays, is the loop's");
        assert!(d.is_empty());
    }
}
