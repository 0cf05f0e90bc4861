//! Owned copies of CM events.
//!
//! A [`CmEvent`] is made from a `struct rdma_cm_event` that librdmacm handed
//! out, *before* that event is acked: every field, the private data bytes and
//! the ids' `context` values are copied into a pooled [`Slot`]. After that
//! rdmasafe acks the librdmacm event at once, so the copy depends on nothing
//! librdmacm owns. Holding, queueing or leaking a `CmEvent` cannot block
//! `rdma_destroy_id` and cannot dangle.

use std::fmt;
use std::os::raw::c_void;

use super::pool::{self, Slot};
use super::ConnectRequest;
use crate::sys::{self, rdma_cm_event, rdma_cm_event_type as et, rdma_cm_id};

/// A CM event type, as the raw number librdmacm reports.
///
/// librdmacm adds event types over time, so this is a number with named
/// constants, not a closed enum: a value this crate does not know passes
/// through unchanged ([`EventType::name`] then says `"UNKNOWN"`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventType(pub u32);

macro_rules! event_types {
    ($( $name:ident = $value:expr, )*) => {
        impl EventType {
            $( #[doc = concat!("`RDMA_CM_EVENT_", stringify!($name), "`")]
               pub const $name: EventType = EventType($value); )*

            /// The name without the `RDMA_CM_EVENT_` prefix, e.g.
            /// `"ESTABLISHED"`; `"UNKNOWN"` for a value this crate does not know.
            pub fn name(self) -> &'static str {
                match self {
                    $( EventType::$name => stringify!($name), )*
                    _ => "UNKNOWN",
                }
            }

            /// The full C name, e.g. `"RDMA_CM_EVENT_ESTABLISHED"`, as a
            /// NUL-terminated string (for the C API).
            pub fn c_name(self) -> &'static std::ffi::CStr {
                match self {
                    $( EventType::$name => {
                        const S: &str = concat!("RDMA_CM_EVENT_", stringify!($name), "\0");
                        // A literal with exactly one NUL, at the end.
                        match std::ffi::CStr::from_bytes_with_nul(S.as_bytes()) {
                            Ok(s) => s,
                            Err(_) => c"RDMA_CM_EVENT_UNKNOWN",
                        }
                    } )*
                    _ => c"RDMA_CM_EVENT_UNKNOWN",
                }
            }
        }
    };
}

event_types! {
    ADDR_RESOLVED = et::RDMA_CM_EVENT_ADDR_RESOLVED,
    ADDR_ERROR = et::RDMA_CM_EVENT_ADDR_ERROR,
    ROUTE_RESOLVED = et::RDMA_CM_EVENT_ROUTE_RESOLVED,
    ROUTE_ERROR = et::RDMA_CM_EVENT_ROUTE_ERROR,
    CONNECT_REQUEST = et::RDMA_CM_EVENT_CONNECT_REQUEST,
    CONNECT_RESPONSE = et::RDMA_CM_EVENT_CONNECT_RESPONSE,
    CONNECT_ERROR = et::RDMA_CM_EVENT_CONNECT_ERROR,
    UNREACHABLE = et::RDMA_CM_EVENT_UNREACHABLE,
    REJECTED = et::RDMA_CM_EVENT_REJECTED,
    ESTABLISHED = et::RDMA_CM_EVENT_ESTABLISHED,
    DISCONNECTED = et::RDMA_CM_EVENT_DISCONNECTED,
    DEVICE_REMOVAL = et::RDMA_CM_EVENT_DEVICE_REMOVAL,
    MULTICAST_JOIN = et::RDMA_CM_EVENT_MULTICAST_JOIN,
    MULTICAST_ERROR = et::RDMA_CM_EVENT_MULTICAST_ERROR,
    ADDR_CHANGE = et::RDMA_CM_EVENT_ADDR_CHANGE,
    TIMEWAIT_EXIT = et::RDMA_CM_EVENT_TIMEWAIT_EXIT,
    // Newer rdma-core (not in Debian 12's headers); values from upstream
    // librdmacm/rdma_cma.h.
    ADDRINFO_RESOLVED = 16,
    ADDRINFO_ERROR = 17,
    USER = 18,
    INTERNAL = 19,
}

impl fmt::Debug for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            "UNKNOWN" => write!(f, "UNKNOWN({})", self.0),
            n => f.write_str(n),
        }
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Connection parameters of a CM event (`param.conn`), without the private
/// data (see [`CmEvent::private_data`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnParam {
    /// `responder_resources`
    pub responder_resources: u8,
    /// `initiator_depth`
    pub initiator_depth: u8,
    /// `flow_control`
    pub flow_control: u8,
    /// `retry_count`
    pub retry_count: u8,
    /// `rnr_retry_count`
    pub rnr_retry_count: u8,
    /// `srq`
    pub srq: u8,
    /// `qp_num`
    pub qp_num: u32,
}

/// UD parameters of a CM event (`param.ud`), without the private data.
#[derive(Clone, Copy)]
pub struct UdParam {
    /// Address handle attributes to reach the peer (`struct ibv_ah_attr`).
    pub ah_attr: rdma_sys::ibv_ah_attr,
    /// The peer's QP number.
    pub qp_num: u32,
    /// The peer's Q_Key.
    pub qkey: u32,
}

impl fmt::Debug for UdParam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdParam")
            .field("qp_num", &self.qp_num)
            .field("qkey", &self.qkey)
            .field("dlid", &self.ah_attr.dlid)
            .field("port_num", &self.ah_attr.port_num)
            .field("is_global", &self.ah_attr.is_global)
            .finish()
    }
}

/// Copies a librdmacm event into a pooled slot. Does not ack it.
///
/// # Safety
/// `raw` must be an event returned by `rdma_get_cm_event` (or a value laid
/// out alike) that has not been acked yet: its `id`, if not NULL, and its
/// `listen_id`, if not NULL, must point to live `rdma_cm_id`s, and a
/// non-NULL `param.*.private_data` must be readable for `private_data_len`
/// bytes unless the event is MULTICAST_JOIN / MULTICAST_ERROR (there it is
/// the application's context pointer and is never read).
pub(crate) unsafe fn copy_raw(raw: *const rdma_cm_event) -> Box<Slot> {
    let mut slot = pool::take();
    // SAFETY (whole block): guaranteed by the caller as documented above.
    unsafe {
        let ev = &*raw;
        slot.raw.id = ev.id;
        slot.raw.listen_id = ev.listen_id;
        slot.raw.event = ev.event;
        slot.raw.status = ev.status;
        // The union is plain data; copy both arms' bytes as they are.
        slot.raw.param = std::ptr::read(&ev.param);
        slot.context = if ev.id.is_null() { 0 } else { (*ev.id).context as usize };
        slot.listen_context = if ev.listen_id.is_null() { 0 } else { (*ev.listen_id).context as usize };
        slot.qp_type = if ev.id.is_null() { 0 } else { (*ev.id).qp_type };

        // private_data / private_data_len sit at the same offsets in both
        // arms (checked by sys::tests::layout_matches_c_headers).
        let src = ev.param.conn.private_data;
        let len = ev.param.conn.private_data_len as usize;
        let multicast = matches!(EventType(ev.event), EventType::MULTICAST_JOIN | EventType::MULTICAST_ERROR);
        if !multicast && !src.is_null() {
            // len is a u8, so it always fits the 256-byte inline buffer.
            std::ptr::copy_nonoverlapping(src.cast::<u8>(), slot.data.as_mut_ptr(), len);
            slot.raw.param.conn.private_data = slot.data.as_ptr().cast();
        }
    }
    slot
}

/// An owned copy of one CM event. librdmacm's event was acked before this
/// value existed; dropping it returns its storage to rdmasafe's pool.
///
/// Ids are given as raw pointers and as their `context` value read at copy
/// time. On a channel rdmasafe created ([`super::EventChannel`]), every id's
/// context is its [`super::CmId::token`], so [`CmEvent::token`] routes the
/// event to the connection without touching a pointer.
pub struct CmEvent {
    slot: Option<Box<Slot>>,
    request: Option<ConnectRequest>,
}

// SAFETY: the copy owns all its data; the raw id pointers it carries are only
// values (never dereferenced by CmEvent), like integers.
unsafe impl Send for CmEvent {}
// SAFETY: as above; &CmEvent gives read-only access to owned plain data.
unsafe impl Sync for CmEvent {}

impl CmEvent {
    pub(crate) fn new(slot: Box<Slot>, request: Option<ConnectRequest>) -> CmEvent {
        CmEvent { slot: Some(slot), request }
    }

    fn slot(&self) -> &Slot {
        self.slot.as_deref().expect("CmEvent always holds its slot until dropped")
    }

    /// The event type (unknown values pass through).
    pub fn event_type(&self) -> EventType {
        EventType(self.slot().raw.event)
    }

    /// `status`: 0, or a negative errno / a transport reason (e.g. the IB CM
    /// reject reason for REJECTED).
    pub fn status(&self) -> i32 {
        self.slot().raw.status
    }

    /// The id the event is for, as a raw pointer value (never dereferenced
    /// by rdmasafe after the copy). For CONNECT_REQUEST this is the new id.
    pub fn raw_id(&self) -> *mut rdma_cm_id {
        self.slot().raw.id
    }

    /// The listening id of a CONNECT_REQUEST, NULL otherwise.
    pub fn raw_listen_id(&self) -> *mut rdma_cm_id {
        self.slot().raw.listen_id
    }

    /// `id->context` at copy time.
    pub fn context(&self) -> usize {
        self.slot().context
    }

    /// `listen_id->context` at copy time (0 without a listen id).
    pub fn listen_context(&self) -> usize {
        self.slot().listen_context
    }

    /// The token of the id this event is for (on rdmasafe-created channels,
    /// the id's context *is* its token). `None` for context 0.
    pub fn token(&self) -> Option<super::IdToken> {
        super::IdToken::from_context(self.context())
    }

    /// The token of the listening id of a CONNECT_REQUEST.
    pub fn listen_token(&self) -> Option<super::IdToken> {
        super::IdToken::from_context(self.listen_context())
    }

    /// Private data as received, empty if none. Its length is what the
    /// transport reports, which is the transport's padded maximum, not what
    /// the peer sent (on RoCE with RDMA_PS_TCP: 56 bytes on CONNECT_REQUEST,
    /// 196 on ESTABLISHED): carry your own length inside the data.
    /// Always empty for MULTICAST_JOIN / MULTICAST_ERROR (see
    /// [`CmEvent::multicast_context`]).
    pub fn private_data(&self) -> &[u8] {
        let s = self.slot();
        // SAFETY: conn and ud share the layout of private_data /
        // private_data_len; reading the pointer value is reading plain data.
        let (ptr, len) = unsafe { (s.raw.param.conn.private_data, s.raw.param.conn.private_data_len) };
        if ptr.is_null() || self.multicast_context().is_some() {
            &[]
        } else {
            &s.data[..len as usize]
        }
    }

    /// For MULTICAST_JOIN / MULTICAST_ERROR: the context pointer the app
    /// gave `rdma_join_multicast`, unchanged and never dereferenced.
    pub fn multicast_context(&self) -> Option<*mut c_void> {
        match self.event_type() {
            // SAFETY: plain pointer value in the union, read, not followed.
            EventType::MULTICAST_JOIN | EventType::MULTICAST_ERROR => {
                Some(unsafe { self.slot().raw.param.ud.private_data } as *mut c_void)
            }
            _ => None,
        }
    }

    /// True if librdmacm filled `param.ud` (the id's QP type is UD), false
    /// if it filled `param.conn`.
    pub fn is_ud(&self) -> bool {
        self.slot().qp_type == sys::ibv_qp_type::IBV_QPT_UD
    }

    /// The `param.conn` values (meaningful when `!is_ud()`).
    pub fn conn_param(&self) -> ConnParam {
        // SAFETY: reading plain integers out of a union of plain data.
        let c = unsafe { self.slot().raw.param.conn };
        ConnParam {
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            flow_control: c.flow_control,
            retry_count: c.retry_count,
            rnr_retry_count: c.rnr_retry_count,
            srq: c.srq,
            qp_num: c.qp_num,
        }
    }

    /// The `param.ud` values (meaningful when `is_ud()`).
    pub fn ud_param(&self) -> UdParam {
        // SAFETY: reading plain data out of a union of plain data.
        let u = unsafe { self.slot().raw.param.ud };
        UdParam { ah_attr: u.ah_attr, qp_num: u.qp_num, qkey: u.qkey }
    }

    /// The C view of the copy. Its private data pointer points into this
    /// value and is valid while it lives.
    pub fn as_raw(&self) -> &rdma_cm_event {
        &self.slot().raw
    }

    /// For CONNECT_REQUEST on an rdmasafe-created channel: takes ownership of
    /// the new id so the app can accept it. If the app never takes it, the
    /// request is rejected and the new id destroyed when the event drops.
    pub fn take_request(&mut self) -> Option<ConnectRequest> {
        self.request.take()
    }

    /// Hands the copy to C: the returned pointer is a `struct rdma_cm_event`
    /// that stays valid until [`CmEvent::from_raw`] takes it back. A pending
    /// connect request owned by this event is rejected first (C callers own
    /// their ids; events for C never carry one).
    pub fn into_raw(mut self) -> *mut rdma_cm_event {
        drop(self.request.take());
        let slot = self.slot.take().expect("CmEvent holds its slot");
        Box::into_raw(slot).cast()
    }

    /// Takes back a copy handed out by [`CmEvent::into_raw`].
    ///
    /// # Safety
    /// `raw` must come from `into_raw` and not have been taken back before.
    pub unsafe fn from_raw(raw: *mut rdma_cm_event) -> CmEvent {
        // SAFETY: Slot is repr(C) with the C event first, and raw came from
        // Box::into_raw of a Slot (caller's contract).
        let slot = unsafe { Box::from_raw(raw.cast::<Slot>()) };
        CmEvent { slot: Some(slot), request: None }
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // A connect request not taken is rejected + destroyed by its own Drop.
        drop(self.request.take());
        if let Some(slot) = self.slot.take() {
            pool::give(slot);
        }
    }
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("type", &self.event_type())
            .field("status", &self.status())
            .field("id", &self.raw_id())
            .field("context", &self.context())
            .field("private_data_len", &self.private_data().len())
            .finish()
    }
}

/// Builds a copy from a synthetic event, for tests and fuzzing of the copy
/// path without a kernel. Ids in `raw` must be NULL or point to live
/// `rdma_cm_id` values; see [`copy_raw`].
///
/// # Safety
/// As for [`copy_raw`].
#[doc(hidden)]
pub unsafe fn copy_synthetic(raw: *const rdma_cm_event) -> CmEvent {
    // SAFETY: forwarded contract.
    CmEvent::new(unsafe { copy_raw(raw) }, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeroed_event() -> rdma_cm_event {
        // SAFETY: plain C data; zero is valid.
        unsafe { std::mem::zeroed() }
    }

    #[test]
    fn unknown_types_pass_through() {
        let t = EventType(4242);
        assert_eq!(t.name(), "UNKNOWN");
        assert_eq!(format!("{t:?}"), "UNKNOWN(4242)");
        assert_eq!(EventType::ESTABLISHED.name(), "ESTABLISHED");
        assert_eq!(EventType::ESTABLISHED.c_name().to_str().unwrap(), "RDMA_CM_EVENT_ESTABLISHED");
        assert_eq!(EventType::INTERNAL.0, 19);
    }

    #[test]
    fn names_match_librdmacm() {
        for v in 0..16u32 {
            // SAFETY: rdma_event_str returns a static string for any value.
            let c = unsafe { std::ffi::CStr::from_ptr(rdma_sys::rdma_event_str(v)) };
            assert_eq!(EventType(v).c_name(), c, "type {v}");
        }
    }

    #[test]
    fn copy_owns_private_data_and_keeps_multicast_context() {
        // SAFETY: zeroed rdma_cm_id is plain data; we only set context.
        let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
        id.context = 0x1234 as *mut c_void;
        let mut bytes = [0u8; 256];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        let mut ev = zeroed_event();
        ev.id = &mut id;
        ev.event = EventType::ESTABLISHED.0;
        ev.status = 0;
        ev.param.conn.private_data = bytes.as_ptr().cast();
        ev.param.conn.private_data_len = 196;
        ev.param.conn.qp_num = 77;
        // SAFETY: ev points at live data as copy_raw requires.
        let copy = unsafe { copy_synthetic(&ev) };
        bytes.fill(0xee); // the source changes: the copy must not
        assert_eq!(copy.private_data().len(), 196);
        assert!(copy.private_data().iter().enumerate().all(|(i, b)| *b == i as u8));
        assert_eq!(copy.context(), 0x1234);
        assert_eq!(copy.conn_param().qp_num, 77);
        let p = copy.as_raw();
        // SAFETY: reading the pointer value.
        let dp = unsafe { p.param.conn.private_data } as usize;
        let own = copy.private_data().as_ptr() as usize;
        assert_eq!(dp, own, "C view points into the copy's own storage");

        let mut mc = zeroed_event();
        mc.id = &mut id;
        mc.event = EventType::MULTICAST_JOIN.0;
        mc.param.ud.private_data = 0xdead_beef_usize as *const c_void; // never read
        mc.param.ud.private_data_len = 200;
        mc.param.ud.qkey = 0x11;
        // SAFETY: as above; the multicast pointer is not dereferenced.
        let copy = unsafe { copy_synthetic(&mc) };
        assert_eq!(copy.multicast_context(), Some(0xdead_beef_usize as *mut c_void));
        assert!(copy.private_data().is_empty());
        assert_eq!(copy.ud_param().qkey, 0x11);
    }

    #[test]
    fn raw_round_trip_keeps_the_copy() {
        let mut ev = zeroed_event();
        ev.event = 999;
        ev.status = -110;
        // SAFETY: no ids, no private data.
        let copy = unsafe { copy_synthetic(&ev) };
        let raw = copy.into_raw();
        // SAFETY: raw came from into_raw just above.
        let back = unsafe { CmEvent::from_raw(raw) };
        assert_eq!(back.event_type(), EventType(999));
        assert_eq!(back.status(), -110);
        assert!(back.private_data().is_empty());
    }
}
