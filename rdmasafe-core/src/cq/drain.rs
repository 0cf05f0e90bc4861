//! Draining a QP before teardown, like the kernel's `ib_drain_qp`: error
//! state, a marker on each queue, done when both markers came back. The
//! markers are the loop's own work requests: they never reach the app.

use std::time::Instant;

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
    done: Done,
}

/// The drains in progress on one loop.
#[derive(Default)]
pub(crate) struct Drains(Vec<Watch>);

impl Drains {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
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
        if let Err(e) = qp.to_error_with_markers(!srq, DRAIN_SEND_WR_ID, DRAIN_RECV_WR_ID) {
            return Err((done, e));
        }
        self.0.push(Watch { qp_num, cqs: (send_cq, recv_cq), send_seen: false, recv_seen: srq, deadline, done });
        Ok(())
    }

    /// Takes out every drain (the loop goes away).
    pub(crate) fn take_all(&mut self) -> Vec<Done> {
        self.0.drain(..).map(|w| w.done).collect()
    }

    /// True (consumed) if `wc` is a marker of a drain in progress.
    pub(crate) fn note(&mut self, wc: &Wc) -> bool {
        let id = wc.wr_id();
        if id != DRAIN_SEND_WR_ID && id != DRAIN_RECV_WR_ID {
            return false;
        }
        for w in &mut self.0 {
            if w.qp_num == wc.qp_num() {
                if id == DRAIN_SEND_WR_ID && !w.send_seen {
                    w.send_seen = true;
                    return true;
                }
                if id == DRAIN_RECV_WR_ID && !w.recv_seen {
                    w.recv_seen = true;
                    return true;
                }
            }
        }
        false
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.0.iter().map(|w| w.deadline).min()
    }

    /// Takes out the drains that are complete (`Ok`) or past their
    /// deadline (`Err(ETIMEDOUT)`), for the caller to finish.
    pub(crate) fn take_finished(&mut self, now: Option<Instant>) -> Vec<(Done, crate::Result<()>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.0.len() {
            let w = &self.0[i];
            let result = if w.send_seen && w.recv_seen {
                Some(Ok(()))
            } else if now.is_some_and(|n| n >= w.deadline) {
                Some(Err(crate::Error::new("rdmasafe drain_qp", libc::ETIMEDOUT)))
            } else {
                None
            };
            match result {
                Some(r) => out.push((self.0.swap_remove(i).done, r)),
                None => i += 1,
            }
        }
        out
    }

    /// Takes out the drains that can no longer finish because `cq` left the
    /// loop (ECANCELED).
    pub(crate) fn take_for_cq(&mut self, cq: usize) -> Vec<(Done, crate::Result<()>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.0.len() {
            if self.0[i].cqs.0 == cq || self.0[i].cqs.1 == cq {
                let w = self.0.swap_remove(i);
                out.push((w.done, Err(crate::Error::new("rdmasafe drain_qp: its CQ left the loop", libc::ECANCELED))));
            } else {
                i += 1;
            }
        }
        out
    }
}
