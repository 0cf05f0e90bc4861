//! librdmacm's and libibverbs' real functions, found with
//! `dlvsym(RTLD_NEXT, name, version)`: the definitions that come after this
//! library in the loader's search order, at the version a program built
//! against rdma-core binds (`RDMACM_1.0`, `IBVERBS_1.1`).
//!
//! Inside this library the plain symbols (`rdma_get_cm_event`, ...) are its
//! own interposers, so every call into librdmacm / libibverbs for these seven
//! functions goes through the pointers found here, never through the
//! symbol. (rdmasafe-core's CM code is pointed at them with
//! `rdmasafe_core::sys::set_cm_event_calls`.)

use std::ffi::CStr;
use std::os::raw::{c_int, c_uint, c_void};

use rdmasafe_core::sys::{ibv_comp_channel, ibv_cq, rdma_cm_event, rdma_cm_id, rdma_event_channel};

/// glibc's `RTLD_NEXT` (`((void *) -1l)` in `<dlfcn.h>`; the libc crate
/// does not define it for Linux).
const RTLD_NEXT: *mut c_void = -1isize as *mut c_void;

// The calls that wait at a cancellation point (a write(), a read(), a
// condition variable) are declared "C-unwind": a thread cancelled inside
// one unwinds through the interposer into the program (see
// rdmasafe_core::sys::cancel).

/// `rdma_get_cm_event`
pub(crate) type GetCmEvent = unsafe extern "C-unwind" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int;
/// `rdma_ack_cm_event`
pub(crate) type AckCmEvent = unsafe extern "C" fn(*mut rdma_cm_event) -> c_int;
/// `rdma_destroy_id`
pub(crate) type DestroyId = unsafe extern "C-unwind" fn(*mut rdma_cm_id) -> c_int;
/// `rdma_get_request`
pub(crate) type GetRequest = unsafe extern "C-unwind" fn(*mut rdma_cm_id, *mut *mut rdma_cm_id) -> c_int;
/// `ibv_get_cq_event`
pub(crate) type GetCqEvent =
    unsafe extern "C-unwind" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
/// `ibv_ack_cq_events`
pub(crate) type AckCqEvents = unsafe extern "C" fn(*mut ibv_cq, c_uint);
/// `ibv_destroy_cq`
pub(crate) type DestroyCq = unsafe extern "C-unwind" fn(*mut ibv_cq) -> c_int;

/// The real functions; `None` where the loader has no such definition
/// after this library (the interposer then fails with ENOSYS).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Real {
    pub get_cm_event: Option<GetCmEvent>,
    pub ack_cm_event: Option<AckCmEvent>,
    pub destroy_id: Option<DestroyId>,
    pub get_request: Option<GetRequest>,
    pub get_cq_event: Option<GetCqEvent>,
    pub ack_cq_events: Option<AckCqEvents>,
    pub destroy_cq: Option<DestroyCq>,
}

/// The next definition of `name` at `version` (or, if the next library
/// has no symbol versions, its only one).
fn next(name: &CStr, version: &CStr) -> *mut c_void {
    // SAFETY: dlvsym / dlsym with NUL-terminated names and the RTLD_NEXT
    // pseudo-handle only look symbols up; they return NULL when not found.
    unsafe {
        let p = libc::dlvsym(RTLD_NEXT, name.as_ptr(), version.as_ptr());
        if p.is_null() {
            libc::dlsym(RTLD_NEXT, name.as_ptr())
        } else {
            p
        }
    }
}

macro_rules! lookup {
    ($name:literal, $version:literal, $ty:ty) => {{
        let p = next($name, $version);
        if p.is_null() {
            log::error!(
                target: "rdmasafe",
                "preload: no {} after librdmasafe-preload.so in the loader's search order ({:?})",
                $name.to_string_lossy(),
                $version
            );
            None
        } else {
            // SAFETY: the symbol is librdmacm's / libibverbs' function of
            // that name at that version, whose C prototype is `$ty` (the
            // ABI the version name stands for). A function pointer and a
            // data pointer have the same size and representation here.
            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    }};
}

impl Real {
    /// Looks the seven functions up (a few dlvsym calls, once per process).
    pub(crate) fn resolve() -> Real {
        Real {
            get_cm_event: lookup!(c"rdma_get_cm_event", c"RDMACM_1.0", GetCmEvent),
            ack_cm_event: lookup!(c"rdma_ack_cm_event", c"RDMACM_1.0", AckCmEvent),
            destroy_id: lookup!(c"rdma_destroy_id", c"RDMACM_1.0", DestroyId),
            get_request: lookup!(c"rdma_get_request", c"RDMACM_1.0", GetRequest),
            get_cq_event: lookup!(c"ibv_get_cq_event", c"IBVERBS_1.1", GetCqEvent),
            ack_cq_events: lookup!(c"ibv_ack_cq_events", c"IBVERBS_1.1", AckCqEvents),
            destroy_cq: lookup!(c"ibv_destroy_cq", c"IBVERBS_1.1", DestroyCq),
        }
    }
}
