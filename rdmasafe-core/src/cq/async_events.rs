//! Async device events: copied, acked at once, handed out with the element
//! they concern.
//!
//! An unacked async event on a CQ, QP, SRQ or WQ blocks that object's
//! destroy, just like an unacked CQ event. [`AsyncEvents`] acks each event
//! the moment it has copied it, so no copy the app holds can block a
//! destroy. One reader per device context: rdmasafe polls the context's
//! async fd before each read and never changes the fd's blocking mode, so
//! of two readers that both saw it readable, the one that finds the event
//! taken blocks in the read until the next event: its wait runs past its
//! timeout, and an [`AsyncThread`]'s stop waits for that event. (The ids
//! librdmacm makes on one device share its context: read each device's
//! async events in one place.)

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::sys::{self, RawAsyncEvent, Wait, WakeFd};
use crate::verbs::DeviceContext;
use crate::{Error, Result};

/// `enum ibv_event_type` as the raw number (unknown values pass through).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AsyncEventType(pub u32);

macro_rules! async_types {
    ($( $name:ident = $v:expr, )*) => {
        impl AsyncEventType {
            $( #[doc = concat!("`IBV_EVENT_", stringify!($name), "`")]
               pub const $name: AsyncEventType = AsyncEventType($v); )*
            /// The name without the `IBV_EVENT_` prefix, `"UNKNOWN"` otherwise.
            pub fn name(self) -> &'static str {
                match self { $( AsyncEventType::$name => stringify!($name), )* _ => "UNKNOWN" }
            }
            /// The C name, e.g. `"IBV_EVENT_CQ_ERR"`, NUL-terminated.
            pub fn c_name(self) -> &'static std::ffi::CStr {
                match self {
                    $( AsyncEventType::$name => {
                        const S: &str = concat!("IBV_EVENT_", stringify!($name), "\0");
                        match std::ffi::CStr::from_bytes_with_nul(S.as_bytes()) {
                            Ok(s) => s,
                            Err(_) => c"IBV_EVENT_UNKNOWN",
                        }
                    } )*
                    _ => c"IBV_EVENT_UNKNOWN",
                }
            }
        }
    };
}

async_types! {
    CQ_ERR = 0, QP_FATAL = 1, QP_REQ_ERR = 2, QP_ACCESS_ERR = 3, COMM_EST = 4, SQ_DRAINED = 5,
    PATH_MIG = 6, PATH_MIG_ERR = 7, DEVICE_FATAL = 8, PORT_ACTIVE = 9, PORT_ERR = 10, LID_CHANGE = 11,
    PKEY_CHANGE = 12, SM_CHANGE = 13, SRQ_ERR = 14, SRQ_LIMIT_REACHED = 15, QP_LAST_WQE_REACHED = 16,
    CLIENT_REREGISTER = 17, GID_CHANGE = 18, WQ_FATAL = 19,
}

impl fmt::Debug for AsyncEventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            "UNKNOWN" => write!(f, "UNKNOWN({})", self.0),
            n => f.write_str(n),
        }
    }
}

/// What an async event concerns. Pointers are values copied out of the
/// event (never dereferenced by rdmasafe after the ack): compare them with
/// your objects to route the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncElement {
    /// A CQ (`struct ibv_cq *`).
    Cq(*mut sys::ibv_cq),
    /// A QP and its number (read before the ack).
    Qp(*mut sys::ibv_qp, u32),
    /// An SRQ (`struct ibv_srq *`).
    Srq(*mut c_void),
    /// A WQ (`struct ibv_wq *`).
    Wq(*mut c_void),
    /// A port number.
    Port(u8),
    /// The whole device.
    Device,
    /// A type this crate does not know: the raw element value.
    Unknown(usize),
}

/// An owned copy of one async event (already acked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The event type.
    pub event_type: AsyncEventType,
    /// What it concerns.
    pub element: AsyncElement,
}

// SAFETY: the pointers are plain values, never followed by rdmasafe.
unsafe impl Send for AsyncEvent {}

impl AsyncEvent {
    /// Copies a raw event (before it is acked).
    ///
    /// # Safety
    /// For QP events the element must be a live QP (true until the ack).
    pub(crate) unsafe fn copy(raw: &RawAsyncEvent) -> AsyncEvent {
        let t = AsyncEventType(raw.event_type);
        let p = raw.element;
        let element = match t {
            AsyncEventType::CQ_ERR => AsyncElement::Cq(p.cast()),
            AsyncEventType::QP_FATAL
            | AsyncEventType::QP_REQ_ERR
            | AsyncEventType::QP_ACCESS_ERR
            | AsyncEventType::COMM_EST
            | AsyncEventType::SQ_DRAINED
            | AsyncEventType::PATH_MIG
            | AsyncEventType::PATH_MIG_ERR
            | AsyncEventType::QP_LAST_WQE_REACHED => {
                let qp: *mut sys::ibv_qp = p.cast();
                // SAFETY: live QP until the event is acked (caller).
                let num = if qp.is_null() { 0 } else { unsafe { (*qp).qp_num } };
                AsyncElement::Qp(qp, num)
            }
            AsyncEventType::SRQ_ERR | AsyncEventType::SRQ_LIMIT_REACHED => AsyncElement::Srq(p),
            AsyncEventType::WQ_FATAL => AsyncElement::Wq(p),
            AsyncEventType::PORT_ACTIVE
            | AsyncEventType::PORT_ERR
            | AsyncEventType::LID_CHANGE
            | AsyncEventType::PKEY_CHANGE
            | AsyncEventType::SM_CHANGE
            | AsyncEventType::CLIENT_REREGISTER
            | AsyncEventType::GID_CHANGE => AsyncElement::Port(p as usize as u32 as u8),
            AsyncEventType::DEVICE_FATAL => AsyncElement::Device,
            _ => AsyncElement::Unknown(p as usize),
        };
        AsyncEvent { event_type: t, element }
    }
}

/// Reads a device context's async events: copy, ack, hand out.
pub struct AsyncEvents {
    ctx: DeviceContext,
}

impl AsyncEvents {
    /// For `ctx` (one reader per context: see the module docs); keeps the
    /// context open.
    pub fn new(ctx: &DeviceContext) -> AsyncEvents {
        AsyncEvents { ctx: ctx.clone() }
    }

    /// Waits per `wait` for one event; copies and acks it. ETIMEDOUT /
    /// EAGAIN when none came; EINTR when any handled signal interrupted the
    /// wait (even with SA_RESTART: poll() is never restarted; a removed rxe
    /// device raises no event, so a signal is what stops a reader waiting
    /// forever).
    pub fn get(&self, wait: Wait) -> Result<AsyncEvent> {
        self.get_or_woken(wait, None, false).and_then(|e| e.ok_or(Error::new("ibv_get_async_event", libc::EINTR)))
    }

    /// Like `get`, also returning `Ok(None)` when `wake` became readable;
    /// `retry_eintr`: a signal does not end the wait.
    fn get_or_woken(&self, wait: Wait, wake: Option<&WakeFd>, retry_eintr: bool) -> Result<Option<AsyncEvent>> {
        let wfd = wake.map_or(-1, |w| w.fd());
        let [ready, woke] = sys::poll_readable_ex([self.as_raw_fd(), wfd], wait, retry_eintr)
            .map_err(|e| Error::new("poll", e.raw_os_error().unwrap_or(libc::EIO)))?;
        if woke {
            return Ok(None);
        }
        if !ready {
            let errno = if wait == Wait::None { libc::EAGAIN } else { libc::ETIMEDOUT };
            return Err(Error::new("ibv_get_async_event", errno));
        }
        let mut raw = RawAsyncEvent { element: std::ptr::null_mut(), event_type: 0 };
        // SAFETY: live context; raw has the C layout (checked by a test).
        if unsafe { sys::ibv_get_async_event(self.ctx.raw(), &mut raw) } != 0 {
            return Err(Error::last("ibv_get_async_event"));
        }
        // SAFETY: the event is unacked, so its element is live.
        let ev = unsafe { AsyncEvent::copy(&raw) };
        // SAFETY: acked exactly once, right after the copy.
        unsafe { sys::ibv_ack_async_event(&mut raw) };
        Ok(Some(ev))
    }

    /// Starts a thread that hands every async event (copied, acked) to `f`.
    /// The thread ends by itself, with `Ok`, after the device is gone: after
    /// it delivered IBV_EVENT_DEVICE_FATAL (a device that failed; a
    /// removed rxe device reports nothing: stop the thread),
    /// or when reading fails with EIO / ENODEV; it keeps the context open
    /// until then (see [`DeviceContext`]). A panic of `f` ends the thread
    /// too ([`AsyncThread::stop`] then reports EIO). The thread inherits
    /// the calling thread's signal mask.
    pub fn spawn<F>(self, mut f: F) -> Result<AsyncThread>
    where
        F: FnMut(AsyncEvent) + Send + 'static,
    {
        let wake = Arc::new(WakeFd::new().map_err(|e| Error::new("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?);
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (wake.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("rdmasafe-async".into())
            .spawn(move || {
                while !s.load(SeqCst) {
                    match self.get_or_woken(Wait::Forever, Some(&w), true) {
                        Ok(Some(ev)) => {
                            let fatal = ev.event_type == AsyncEventType::DEVICE_FATAL;
                            f(ev);
                            if fatal {
                                return Ok(());
                            }
                        }
                        Ok(None) => {}
                        Err(e) if matches!(e.errno(), libc::EIO | libc::ENODEV) => return Ok(()),
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            })
            .map_err(|e| Error::new("pthread_create", e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
        Ok(AsyncThread { wake, stop, thread: Some(thread) })
    }
}

impl AsRawFd for AsyncEvents {
    /// The context's async fd (readable when an event is ready).
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: live context.
        unsafe { (*self.ctx.raw()).async_fd }
    }
}

impl AsFd for AsyncEvents {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the context (and its async fd) stays open while self holds it.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

/// A thread delivering async events; stops (and joins) on drop.
pub struct AsyncThread {
    wake: Arc<WakeFd>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl AsyncThread {
    /// Stops and joins the thread; returns the error it ended on, if any
    /// (EIO: the callback panicked). From the thread's own callback (an
    /// app that tears its device state down there): EDEADLK, since the
    /// thread cannot wait for itself; it ends once the callback returns.
    /// Dropping the handle there does the same, silently.
    pub fn stop(mut self) -> Result<()> {
        self.stop_join()
    }

    fn stop_join(&mut self) -> Result<()> {
        self.stop.store(true, SeqCst);
        self.wake.wake();
        match self.thread.take() {
            // Joining itself would fail (and std's join panics on that).
            Some(t) if t.thread().id() == std::thread::current().id() => {
                Err(Error::new("AsyncThread::stop: from its own callback", libc::EDEADLK))
            }
            Some(t) => t.join().unwrap_or(Err(Error::new("rdmasafe-async thread panicked", libc::EIO))),
            None => Ok(()),
        }
    }
}

impl Drop for AsyncThread {
    fn drop(&mut self) {
        let _ = self.stop_join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_libibverbs() {
        use rdma_sys::ibv_event_type as T;
        assert_eq!(AsyncEventType::CQ_ERR.0, T::IBV_EVENT_CQ_ERR as u32);
        assert_eq!(AsyncEventType::PORT_ERR.0, T::IBV_EVENT_PORT_ERR as u32);
        assert_eq!(AsyncEventType::QP_LAST_WQE_REACHED.0, T::IBV_EVENT_QP_LAST_WQE_REACHED as u32);
        assert_eq!(AsyncEventType::WQ_FATAL.0, T::IBV_EVENT_WQ_FATAL as u32);
        assert_eq!(format!("{:?}", AsyncEventType(77)), "UNKNOWN(77)");
    }

    #[test]
    fn copy_routes_by_type_and_keeps_unknown_values() {
        let port = RawAsyncEvent { element: 2usize as *mut c_void, event_type: 10 };
        // SAFETY: a port event's element is a number, not followed.
        let ev = unsafe { AsyncEvent::copy(&port) };
        assert_eq!(ev.element, AsyncElement::Port(2));
        assert_eq!(ev.event_type, AsyncEventType::PORT_ERR);
        let odd = RawAsyncEvent { element: 0x1234usize as *mut c_void, event_type: 999 };
        // SAFETY: unknown types are never followed.
        let ev = unsafe { AsyncEvent::copy(&odd) };
        assert_eq!(ev.element, AsyncElement::Unknown(0x1234));
        let cq = RawAsyncEvent { element: 0x40usize as *mut c_void, event_type: 0 };
        // SAFETY: CQ pointers are not followed.
        assert_eq!(unsafe { AsyncEvent::copy(&cq) }.element, AsyncElement::Cq(0x40usize as *mut _));
    }
}
