//! Event mode's common wakeup in one frame.
//!
//! Most event-mode wakeups find one CQ fired, no keepalive and no drain
//! whose completions need filtering out. For those, `event_cycle` calls
//! [`Core::work_fired_one`] instead of the general walk of the fired list
//! (`work_list` → `work_refs` → `work_one` → `drain`): the same steps in
//! the same order, with the same counters and the same handling of errors
//! and panics, without a working copy of the list, a frame per step or a
//! lookup of the CQ per step. A first poll that returns all it asked for
//! (the poll batch, or the budget when that is smaller) hands the rest of
//! the drain to the general `drain_from`, which keeps the budget; anything
//! else the general walk does for one CQ is done here the same way, down
//! to the list marks of a CQ queued again after an error (the loop's tests
//! run through both: one CQ fired takes this path, several the general
//! one).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::*;

use super::control::LoopControl;
use super::core::Core;
use super::stats::Bump;
use crate::Result;

impl Core {
    /// Whether the fired list may take [`Core::work_fired_one`]: exactly
    /// one CQ, and none of the loop's own completions to filter out.
    #[inline]
    pub(super) fn fired_is_one(&self) -> bool {
        self.fired.len() == 1 && self.keepalives.is_empty() && self.drains.is_empty()
    }

    /// `work_list(List::Fired, arm = true)` for a fired list of one CQ
    /// ([`Core::fired_is_one`]): re-arm it, then drain it into its
    /// handler, at most its budget. The list is emptied first (a CQ that
    /// fires while the handler runs lands in it for the next cycle, as
    /// with the general walk). An error or a handler's panic queues the
    /// CQ to be armed and drained again in the next cycle.
    #[inline]
    pub(super) fn work_fired_one(&mut self, ctl: &LoopControl, honor_stop: bool) -> Result<usize> {
        let sh = &*ctl.0;
        let r = self.fired[0];
        self.fired.clear();
        let Some(e) = self.entries.get_mut(r) else { return Ok(0) };
        e.in_unarmed = false;
        e.in_fired = false;
        if !e.armed {
            e.armed = true;
            self.armed += 1;
        }
        sh.counters.arms.bump(1);
        let budget = if e.opts.budget > 0 { e.opts.budget } else { usize::MAX };
        let ask = self.wcs.len().min(budget);
        let polled = e.cq.arm(e.opts.solicited_only).and_then(|()| e.cq.poll(&mut self.wcs[..ask]));
        let raw = match polled {
            Ok(0) => return Ok(0),
            Ok(raw) => raw,
            Err(err) => {
                self.requeue(&[r], true);
                return Err(err);
            }
        };
        let rest = catch_unwind(AssertUnwindSafe(|| {
            self.call_handler(ctl, r, raw);
            // Fewer than asked: empty at that moment (a later completion
            // raises an event, the CQ was armed before the poll).
            if raw < ask || (honor_stop && sh.stop.load(Relaxed)) {
                Ok(raw)
            } else {
                self.drain_from(ctl, r, honor_stop, raw, budget)
            }
        }));
        match rest {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(err)) => {
                self.requeue(&[r], true);
                Err(err)
            }
            Err(p) => {
                self.requeue(&[r], true);
                resume_unwind(p)
            }
        }
    }
}
