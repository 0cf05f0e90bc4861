//! Who runs the loop, and whether it is going away: one state word, so
//! that a run that starts while the loop is closed (the C API's destroy on
//! another thread) and that close cannot both fail. (With two flags, a run
//! that saw the close's flag and a close that saw the run's flag both gave
//! up: the run said "being destroyed" of a loop that was not.)

#[cfg(loom)]
use loom::sync::atomic::{AtomicU8, Ordering::SeqCst};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};

const IDLE: u8 = 0;
const RUNNING: u8 = 1;
const CLOSED: u8 = 2;

/// Why a run or a close was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// A thread runs the loop (or waits for its state to run it).
    Running,
    /// The loop is closed.
    Closed,
}

/// Idle, running (one runner), or closed for good.
pub(crate) struct RunState(AtomicU8);

impl RunState {
    pub(crate) fn new() -> RunState {
        RunState(AtomicU8::new(IDLE))
    }

    /// A run starts (idle -> running).
    pub(crate) fn claim(&self) -> Result<(), Refused> {
        match self.0.compare_exchange(IDLE, RUNNING, SeqCst, SeqCst) {
            Ok(_) => Ok(()),
            Err(RUNNING) => Err(Refused::Running),
            Err(_) => Err(Refused::Closed),
        }
    }

    /// The run ends (running -> idle; only a claim's holder calls it).
    pub(crate) fn release(&self) {
        let was = self.0.compare_exchange(RUNNING, IDLE, SeqCst, SeqCst);
        debug_assert_eq!(was, Ok(RUNNING), "released without a claim");
    }

    /// Closed for good (idle -> closed); refused while a thread runs it.
    pub(crate) fn close(&self) -> Result<(), Refused> {
        match self.0.compare_exchange(IDLE, CLOSED, SeqCst, SeqCst) {
            Ok(_) => Ok(()),
            Err(RUNNING) => Err(Refused::Running),
            Err(_) => Err(Refused::Closed),
        }
    }

    /// A thread runs the loop (or waits for its state to run it).
    pub(crate) fn is_running(&self) -> bool {
        self.0.load(SeqCst) == RUNNING
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::{Refused, RunState};
    use loom::sync::Arc;

    /// A run that starts while the loop is closed (the C API's destroy on
    /// another thread): one of the two wins, never neither.
    #[test]
    fn a_run_and_a_close_that_race_do_not_both_fail() {
        loom::model(|| {
            let s = Arc::new(RunState::new());
            let s2 = s.clone();
            let t = loom::thread::spawn(move || {
                let r = s2.claim();
                if r.is_ok() {
                    s2.release();
                }
                r
            });
            let c = s.close();
            let r = t.join().unwrap();
            assert!(r.is_ok() || c.is_ok(), "both failed: run {r:?}, close {c:?}");
            // Closed for good: neither a run nor a second close after it.
            if c.is_ok() {
                assert_eq!(s.claim(), Err(Refused::Closed));
                assert_eq!(s.close(), Err(Refused::Closed));
            }
        });
    }
}
