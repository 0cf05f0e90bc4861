//! Async device events for C: copied and acked at once.

use std::os::raw::{c_char, c_int, c_void};
use std::time::{Duration, Instant};

use rdmasafe_core::cq::{AsyncElement, AsyncEventType, AsyncEvents};
use rdmasafe_core::sys::cancel::CancelDisabled;
use rdmasafe_core::sys::ibv_context;
use rdmasafe_core::verbs::DeviceContext;
use rdmasafe_core::Wait;

use crate::guard;

fn neg(e: rdmasafe_core::Error) -> c_int {
    -e.errno()
}

/// The element of an async event is a CQ (`element` = struct ibv_cq *);
/// see `rdmasafe_async_event.element_kind`.
pub const RDMASAFE_ASYNC_CQ: c_int = 1;
/// The element is a QP (`element` = struct ibv_qp *, `qp_num` set).
pub const RDMASAFE_ASYNC_QP: c_int = 2;
/// The element is an SRQ (`struct ibv_srq *`).
pub const RDMASAFE_ASYNC_SRQ: c_int = 3;
/// The element is a WQ (`struct ibv_wq *`).
pub const RDMASAFE_ASYNC_WQ: c_int = 4;
/// The element is a port (`port_num` set).
pub const RDMASAFE_ASYNC_PORT: c_int = 5;
/// The whole device (IBV_EVENT_DEVICE_FATAL).
pub const RDMASAFE_ASYNC_DEVICE: c_int = 6;
/// An event type rdmasafe does not know; `element` is the raw value.
pub const RDMASAFE_ASYNC_UNKNOWN: c_int = 0;

/// A copy of one async event; the original is already acked. Set `size`
/// to `sizeof` the struct before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct rdmasafe_async_event {
    /// In: `sizeof(struct rdmasafe_async_event)` as the caller's header
    /// declares it. Out: the number of bytes the library filled.
    pub size: u32,
    /// `enum ibv_event_type` value (unknown values pass through).
    pub event_type: u32,
    /// One of RDMASAFE_ASYNC_*.
    pub element_kind: c_int,
    /// The CQ / QP / SRQ / WQ pointer (a value: compare, do not free).
    pub element: *mut c_void,
    /// For QP events: the QP number.
    pub qp_num: u32,
    /// For port events: the port number.
    pub port_num: u8,
}

/// Gets one async event of `context`, copies it into `*out` and acks it at
/// once, so no held copy can block a destroy. Waits at most `timeout_ms`
/// (-1 forever, 0 not at all) with poll() on `context->async_fd`, whose
/// mode is not changed. One reader per context. Any handled signal ends
/// the wait with -EINTR, even one whose handler has SA_RESTART (poll() is
/// never restarted); a removed rxe device raises no event.
///
/// A cancellation point while it waits, as `ibv_get_async_event` is: a
/// thread cancelled (pthread_cancel, deferred type) in the wait, or with a
/// cancellation pending when the wait begins, leaves the call by the
/// cancellation (its cleanup handlers run, pthread_join reports
/// PTHREAD_CANCELED) and no event is taken: cancel and join is how to stop
/// a thread waiting with -1. Once an event is there, taking, copying and
/// acking it runs with cancellation deferred.
///
/// Returns 0, -EINVAL (NULL argument, `timeout_ms < -1`, `out->size` not
/// set or over 4096: nothing is read from the fd), -EAGAIN
/// (`timeout_ms == 0`, none), -ETIMEDOUT, -EINTR (a signal), or a
/// negative errno.
///
/// # Safety
/// `context` NULL or a live device context; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdmasafe_async_get(
    context: *mut ibv_context,
    out: *mut rdmasafe_async_event,
    timeout_ms: c_int,
) -> c_int {
    // The checks, before any wait: a bad size loses nothing.
    let fd = guard(
        || Err(-libc::EIO),
        || {
            if context.is_null() || out.is_null() || timeout_ms < -1 {
                return Err(-libc::EINVAL);
            }
            // SAFETY: out is non-NULL and readable for its size field (caller).
            unsafe { crate::abi::check_size(out) }?;
            // SAFETY: context is non-NULL and live (caller).
            Ok(unsafe { (*context).async_fd })
        },
    );
    let fd = match fd {
        Ok(fd) => fd,
        Err(e) => return e,
    };
    let deadline = (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    loop {
        let ms = deadline.map_or(timeout_ms, |d| rdmasafe_core::sys::Wait::until(d).poll_ms());
        // The wait, the cancellation point. SAFETY: this frame holds plain
        // values only across it (fd, deadline, integers) and the export is
        // extern "C-unwind" (rdmasafe_core::sys::cancel).
        let r = unsafe { rdmasafe_core::sys::cancel::poll_readable(fd, ms) };
        if r < 0 {
            return -rdmasafe_core::sys::errno();
        }
        if r == 0 {
            return if timeout_ms == 0 { -libc::EAGAIN } else { -libc::ETIMEDOUT };
        }
        // SAFETY: context and out checked above (caller: live, writable).
        let rc = guard(|| -libc::EIO, || unsafe { take(context, out) });
        // EAGAIN: readable, yet nothing to take (not with one reader per
        // context): wait again for what is left of the timeout.
        if rc != -libc::EAGAIN || timeout_ms == 0 {
            return rc;
        }
    }
}

/// Takes the event that the fd says is there, without another wait, with
/// cancellation deferred (the take's own poll() and read() are
/// cancellation points, and this frame owns values with destructors).
///
/// # Safety
/// `context` non-NULL and live; `out` non-NULL, writable for its size.
unsafe fn take(context: *mut ibv_context, out: *mut rdmasafe_async_event) -> c_int {
    let _no_cancel = CancelDisabled::new();
    // SAFETY: context non-NULL and live (caller).
    let Some(ctx) = (unsafe { DeviceContext::from_raw_checked(context) }) else { return -libc::EINVAL };
    match AsyncEvents::new(&ctx).get(Wait::None) {
        Ok(ev) => {
            let (kind, element, qp_num, port_num) = match ev.element {
                AsyncElement::Cq(p) => (RDMASAFE_ASYNC_CQ, p.cast(), 0, 0),
                AsyncElement::Qp(p, n) => (RDMASAFE_ASYNC_QP, p.cast(), n, 0),
                AsyncElement::Srq(p) => (RDMASAFE_ASYNC_SRQ, p, 0, 0),
                AsyncElement::Wq(p) => (RDMASAFE_ASYNC_WQ, p, 0, 0),
                AsyncElement::Port(n) => (RDMASAFE_ASYNC_PORT, std::ptr::null_mut(), 0, n),
                AsyncElement::Device => (RDMASAFE_ASYNC_DEVICE, std::ptr::null_mut(), 0, 0),
                AsyncElement::Unknown(v) => (RDMASAFE_ASYNC_UNKNOWN, v as *mut c_void, 0, 0),
            };
            let v = rdmasafe_async_event {
                size: 0,
                event_type: ev.event_type.0,
                element_kind: kind,
                element,
                qp_num,
                port_num,
            };
            // SAFETY: out non-NULL; writable for its size (caller).
            match unsafe { crate::abi::write_out(out, &v) } {
                Ok(()) => 0,
                Err(e) => e,
            }
        }
        Err(e) => neg(e),
    }
}

/// The name of an async event type, e.g. "IBV_EVENT_CQ_ERR";
/// "IBV_EVENT_UNKNOWN" for values rdmasafe does not know. Thread-safe.
///
/// Returns a static NUL-terminated string, never NULL.
#[no_mangle]
pub extern "C" fn rdmasafe_async_event_str(event_type: u32) -> *const c_char {
    guard(|| c"IBV_EVENT_UNKNOWN".as_ptr(), || AsyncEventType(event_type).c_name().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_names() {
        // SAFETY: static NUL-terminated strings.
        let s = |v| unsafe { std::ffi::CStr::from_ptr(rdmasafe_async_event_str(v)) }.to_str().unwrap();
        assert_eq!(s(0), "IBV_EVENT_CQ_ERR");
        assert_eq!(s(10), "IBV_EVENT_PORT_ERR");
        assert_eq!(s(1234), "IBV_EVENT_UNKNOWN");
    }

    #[test]
    fn null_context_is_einval() {
        // SAFETY: zeroed plain struct; NULL context is rejected before use.
        let mut ev: rdmasafe_async_event = unsafe { std::mem::zeroed() };
        ev.size = std::mem::size_of::<rdmasafe_async_event>() as u32;
        assert_eq!(unsafe { rdmasafe_async_get(std::ptr::null_mut(), &mut ev, 0) }, -libc::EINVAL);
    }
}
