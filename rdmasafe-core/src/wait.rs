//! How long a call may wait.

use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// How long a wait may last: the `timeout` of every call that can block
/// ([`crate::cm::EventChannel::get_timeout`], [`crate::cq::CqLoop::process_once`],
/// [`crate::verbs::CompChannel::get_event`], ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Do not wait at all.
    None,
    /// Wait at most this long (saturating: `Duration::MAX` is as good as
    /// forever, never a panic).
    For(Duration),
    /// Wait until ready.
    Forever,
}

impl Wait {
    /// Maps the C convention (`< 0` forever, `0` no wait, `> 0` milliseconds).
    pub fn from_millis(ms: i64) -> Wait {
        match ms {
            m if m < 0 => Wait::Forever,
            0 => Wait::None,
            m => Wait::For(Duration::from_millis(m as u64)),
        }
    }

    /// As `poll(2)`'s or `epoll_wait(2)`'s timeout: `-1` forever, `0` no
    /// wait, else the milliseconds rounded up from the nanoseconds (a
    /// remainder of 0.4 ms, or of 400 ns, must not become a busy 0) and
    /// capped at `c_int::MAX`.
    pub fn poll_ms(self) -> c_int {
        match self {
            Wait::None => 0,
            Wait::Forever => -1,
            Wait::For(d) => poll_ms_of(d),
        }
    }

    /// The wait left until `deadline` (none once it passed).
    pub fn until(deadline: Instant) -> Wait {
        Wait::from(deadline.saturating_duration_since(Instant::now()))
    }
}

/// [`Wait::poll_ms`] of `Wait::For(d)`. Out of line on purpose: inlined,
/// the compiler computed it (a 128-bit division, whose library routine
/// branches on its operand) before it looked at the variant, so for
/// `Wait::None` it ran on the unset bytes where a `For` keeps its
/// duration. Harmless, but valgrind's memcheck reports it ("Conditional
/// jump or move depends on uninitialised value(s)") in every program that
/// makes a batch get on a blocking-mode channel: a call is not computed
/// ahead.
#[inline(never)]
fn poll_ms_of(d: Duration) -> c_int {
    d.as_nanos().div_ceil(1_000_000).min(c_int::MAX as u128) as c_int
}

impl From<Duration> for Wait {
    fn from(d: Duration) -> Wait {
        if d.is_zero() {
            Wait::None
        } else {
            Wait::For(d)
        }
    }
}

impl From<Option<Duration>> for Wait {
    /// `None` waits forever (the convention of `epoll_wait`'s -1).
    fn from(d: Option<Duration>) -> Wait {
        d.map_or(Wait::Forever, Wait::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions() {
        assert_eq!(Wait::from_millis(-1), Wait::Forever);
        assert_eq!(Wait::from_millis(0), Wait::None);
        assert_eq!(Wait::from_millis(5), Wait::For(Duration::from_millis(5)));
        assert_eq!(Wait::from(Duration::ZERO), Wait::None);
        assert_eq!(Wait::from(None), Wait::Forever);
        assert_eq!(Wait::from(Some(Duration::from_secs(1))), Wait::For(Duration::from_secs(1)));
    }

    #[test]
    fn poll_ms_rounds_up_and_saturates() {
        assert_eq!(Wait::None.poll_ms(), 0);
        assert_eq!(Wait::Forever.poll_ms(), -1);
        assert_eq!(Wait::For(Duration::from_micros(400)).poll_ms(), 1);
        assert_eq!(Wait::For(Duration::from_micros(1000)).poll_ms(), 1);
        assert_eq!(Wait::For(Duration::from_micros(1001)).poll_ms(), 2);
        assert_eq!(Wait::For(Duration::from_nanos(1)).poll_ms(), 1);
        assert_eq!(Wait::For(Duration::MAX).poll_ms(), c_int::MAX);
        assert_eq!(Wait::until(Instant::now()).poll_ms(), 0);
        let far = Wait::until(Instant::now() + Duration::from_secs(5)).poll_ms();
        assert!((1..=5_000).contains(&far), "{far}");
    }
}
