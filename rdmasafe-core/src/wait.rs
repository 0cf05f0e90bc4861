//! How long a call may wait.

use std::time::Duration;

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
}
