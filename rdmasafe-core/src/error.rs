//! One error type for every fallible call: the librdmacm / libibverbs /
//! libc call that failed and the errno it left.

use std::fmt;

/// A failed RDMA or system call: which call, the errno it reported, and
/// optionally what the caller was doing and which verbs object it concerns.
///
/// rdma-core reports errors as `-1` + `errno` (librdmacm, most of libibverbs)
/// or as a positive errno return value (`ibv_post_send`, `ibv_modify_qp`,
/// ...). Both end up here as a positive errno value. The type is `Copy`
/// and allocation-free, so it can be made on any path (a signal-safe stop
/// included).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Error {
    op: &'static str,
    errno: i32,
    context: Option<&'static str>,
    object: usize,
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error for `op` with the given positive errno value.
    pub fn new(op: &'static str, errno: i32) -> Self {
        Error { op, errno, context: None, object: 0 }
    }

    /// An error for `op` carrying the calling thread's current `errno`.
    pub(crate) fn last(op: &'static str) -> Self {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        // A library that returned -1 without setting errno still failed.
        Error::new(op, if errno == 0 { libc::EIO } else { errno })
    }

    /// The same error, saying what the caller was doing ("accepting a
    /// client", ...): printed before the call.
    pub fn context(self, context: &'static str) -> Self {
        Error { context: Some(context), ..self }
    }

    /// The same error, naming the verbs object (its address) it concerns.
    pub fn about<T>(self, object: *const T) -> Self {
        Error { object: object as usize, ..self }
    }

    /// The positive errno value (`libc::EAGAIN`, `libc::ETIMEDOUT`, ...).
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// The call that failed, e.g. `"rdma_resolve_addr"`.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// What the caller was doing, if it said ([`Error::context`]).
    pub fn context_str(&self) -> Option<&'static str> {
        self.context
    }

    /// The address of the verbs object the error concerns, if it names one
    /// (e.g. the CQ of an event [`crate::verbs::CompChannel::get_event`]
    /// was not given).
    pub fn object(&self) -> Option<usize> {
        (self.object != 0).then_some(self.object)
    }

    /// True for "nothing ready now" (EAGAIN / EWOULDBLOCK).
    pub fn is_would_block(&self) -> bool {
        self.errno == libc::EAGAIN || self.errno == libc::EWOULDBLOCK
    }

    /// True when a wait ran out of time (ETIMEDOUT).
    pub fn is_timeout(&self) -> bool {
        self.errno == libc::ETIMEDOUT
    }

    /// True when a signal interrupted a wait (EINTR).
    pub fn is_interrupted(&self) -> bool {
        self.errno == libc::EINTR
    }
}

/// The C library's text for an errno, without the "(os error N)" suffix
/// std adds (we print the number once ourselves).
fn errno_text(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.rfind(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(c) = self.context {
            write!(f, "{c}: ")?;
        }
        write!(f, "{}: {} (errno {})", self.op, errno_text(self.errno), self.errno)?;
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
    /// Keeps the errno (so `io::Error::kind` works) and the text.
    fn from(e: Error) -> Self {
        let kind = std::io::Error::from_raw_os_error(e.errno).kind();
        std::io::Error::new(kind, e)
    }
}

impl From<std::io::Error> for Error {
    /// An OS error keeps its errno; any other I/O error becomes EIO.
    fn from(e: std::io::Error) -> Self {
        Error::new("I/O", e.raw_os_error().unwrap_or(libc::EIO))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_call_and_the_errno_once() {
        let e = Error::new("rdma_connect", libc::EINVAL);
        let s = e.to_string();
        assert_eq!(s, "rdma_connect: Invalid argument (errno 22)");
        assert!(!e.is_timeout() && !e.is_would_block() && !e.is_interrupted());
        assert!(Error::new("x", libc::EAGAIN).is_would_block());
        assert!(Error::new("x", libc::ETIMEDOUT).is_timeout());
        assert!(Error::new("x", libc::EINTR).is_interrupted());
        let t = Error::new("rdma_get_cm_event", libc::ETIMEDOUT).to_string();
        assert_eq!(t.matches("110").count(), 1, "{t}");
    }

    #[test]
    fn context_and_object() {
        let e = Error::new("rdma_accept", libc::ECONNREFUSED).context("accepting a client");
        assert_eq!(e.context_str(), Some("accepting a client"));
        assert!(e.to_string().starts_with("accepting a client: rdma_accept: "), "{e}");
        assert_eq!(e.object(), None);
        let named = Error::new("x", libc::EINVAL).about(0x1234 as *const u8);
        assert_eq!(named.object(), Some(0x1234));
        assert!(named.to_string().ends_with("(errno 22) [object 0x1234]"), "{named}");
    }

    #[test]
    fn io_error_round_trip_keeps_the_errno() {
        let e = Error::new("rdma_connect", libc::ETIMEDOUT);
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
        assert!(io.to_string().contains("rdma_connect"), "{io}");
        let back: Error = std::io::Error::from_raw_os_error(libc::ENOENT).into();
        assert_eq!(back.errno(), libc::ENOENT);
        let other: Error = std::io::Error::other("x").into();
        assert_eq!(other.errno(), libc::EIO);
    }
}
