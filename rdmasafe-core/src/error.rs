//! One error type for every fallible call: the librdmacm / libibverbs /
//! libc call that failed and the errno it left.

use std::fmt;

/// A failed RDMA or system call: which call, and the errno it reported.
///
/// rdma-core reports errors as `-1` + `errno` (librdmacm, most of libibverbs)
/// or as a positive errno return value (`ibv_post_send`, `ibv_modify_qp`,
/// ...). Both end up here as a positive errno value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Error {
    op: &'static str,
    errno: i32,
    object: usize,
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error for `op` with the given positive errno value.
    pub fn new(op: &'static str, errno: i32) -> Self {
        Error { op, errno, object: 0 }
    }

    /// The same error, naming the verbs object (its address) it concerns.
    pub fn about<T>(self, object: *const T) -> Self {
        Error { object: object as usize, ..self }
    }

    /// The address of the verbs object the error concerns, if it names one
    /// (e.g. the CQ of an event [`crate::verbs::CompChannel::get_event`]
    /// was not given).
    pub fn object(&self) -> Option<usize> {
        (self.object != 0).then_some(self.object)
    }

    /// An error for `op` carrying the calling thread's current `errno`.
    pub(crate) fn last(op: &'static str) -> Self {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        // A library that returned -1 without setting errno still failed.
        Error::new(op, if errno == 0 { libc::EIO } else { errno })
    }

    /// The positive errno value (`libc::EAGAIN`, `libc::ETIMEDOUT`, ...).
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// The call that failed, e.g. `"rdma_resolve_addr"`.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// True for "nothing ready now" (EAGAIN / EWOULDBLOCK).
    pub fn is_would_block(&self) -> bool {
        self.errno == libc::EAGAIN || self.errno == libc::EWOULDBLOCK
    }

    /// True when a wait ran out of time (ETIMEDOUT).
    pub fn is_timeout(&self) -> bool {
        self.errno == libc::ETIMEDOUT
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = std::io::Error::from_raw_os_error(self.errno);
        write!(f, "{}: {} (errno {})", self.op, text, self.errno)?;
        if let Some(o) = self.object() {
            write!(f, " [object {o:#x}]")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        std::io::Error::from_raw_os_error(e.errno)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_call_and_the_errno() {
        let e = Error::new("rdma_connect", libc::EINVAL);
        let s = e.to_string();
        assert!(s.starts_with("rdma_connect: "), "{s}");
        assert!(s.ends_with("(errno 22)"), "{s}");
        assert!(!e.is_timeout() && !e.is_would_block());
        assert!(Error::new("x", libc::EAGAIN).is_would_block());
        assert!(Error::new("x", libc::ETIMEDOUT).is_timeout());
        let io: std::io::Error = e.into();
        assert_eq!(io.raw_os_error(), Some(libc::EINVAL));
        assert_eq!(e.object(), None);
        let named = e.about(0x1234 as *const u8);
        assert_eq!(named.object(), Some(0x1234));
        assert!(named.to_string().ends_with("(errno 22) [object 0x1234]"), "{named}");
    }
}
