//! Owned copies of CM events.
//!
//! A [`CmEvent`] is made from a `struct rdma_cm_event` that librdmacm handed
//! out, *before* that event is acked: every field, the private data bytes and
//! the ids' `context` values are copied into a slot of rdmasafe's own
//! storage, so the copy depends on nothing librdmacm owns: its private data
//! can never dangle. When librdmacm's original is acked depends on the
//! channel (see [`super::ack_deadline`]): at once on an
//! [`super::EventChannel`], so holding a copy never blocks `rdma_destroy_id`;
//! when the copy is freed or a deadline passes on an app channel
//! ([`super::ChannelRef`], the C API), which keeps the barrier librdmacm
//! programs rely on, bounded.

use std::fmt;
use std::os::raw::c_void;

use super::pool::SlotBox;
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

/// Copies a librdmacm event into `slot`. Does not ack it.
///
/// `param` is copied byte for byte. Only when its first word points into
/// librdmacm's own buffer for the event (`struct cma_event`: the event is
/// followed by `private_data[RDMA_MAX_PRIVATE_DATA]`, the layout of every
/// rdma-core since v1) are the bytes copied into the slot and the pointer
/// rewritten to them. Anything else in that word passes through untouched:
/// MULTICAST_JOIN / MULTICAST_ERROR's context pointer of the app, USER's
/// `param.arg` cookie (rdma-core v60), what later event types may put there.
/// Bytes of the slot past the private data read 0, as in librdmacm's
/// zeroed event. Returns the copies alive now: pass it to
/// [`super::pool::warn_if_many_held`] once the original is acked or held.
///
/// # Safety
/// `raw` must be an event returned by `rdma_get_cm_event` (or laid out
/// alike, see [`SyntheticEvent`]) that has not been acked yet: its `id`, if
/// not NULL, and its `listen_id`, if not NULL, must point to live
/// `rdma_cm_id`s, and the buffer after the event must be readable for
/// `private_data_len` bytes when `private_data` points there.
#[inline]
pub(crate) unsafe fn copy_raw(raw: *const rdma_cm_event, slot: &mut SlotBox) -> u64 {
    // SAFETY (whole block): guaranteed by the caller as documented above.
    unsafe {
        let ev = &*raw;
        let c = slot.raw_mut();
        c.id = ev.id;
        c.listen_id = ev.listen_id;
        c.event = ev.event;
        c.status = ev.status;
        // The union is plain data; copy both arms' bytes as they are.
        c.param = std::ptr::read(&ev.param);
        let context = if ev.id.is_null() { 0 } else { (*ev.id).context as usize };
        let listen_context = if ev.listen_id.is_null() { 0 } else { (*ev.listen_id).context as usize };
        slot.set_contexts(context, listen_context);
        slot.set_qp_type(if ev.id.is_null() { 0 } else { (*ev.id).qp_type });

        // private_data / private_data_len sit at the same offsets in both
        // arms (checked by sys::tests::layout_matches_c_headers).
        let inline = raw.cast::<u8>().add(std::mem::size_of::<rdma_cm_event>());
        let src = ev.param.conn.private_data.cast::<u8>();
        if !src.is_null() && src == inline {
            // len is a u8, so it always fits the 256-byte buffer.
            let len = ev.param.conn.private_data_len as usize;
            let own = slot.set_data(std::slice::from_raw_parts(src, len));
            slot.raw_mut().param.conn.private_data = own.cast();
        } else {
            slot.clear_data();
        }
    }
    slot.mark_copied()
}

/// An owned copy of one CM event, in storage rdmasafe owns. Dropping it
/// frees that storage (and acks librdmacm's original if it was still held,
/// see [`super::ack_deadline`]).
///
/// Ids are given as raw pointers and as their `context` value read at copy
/// time. On a channel rdmasafe created ([`super::EventChannel`]), every id's
/// context is its [`super::CmId::token`], so [`CmEvent::token`] routes the
/// event to the connection without touching a pointer.
pub struct CmEvent {
    slot: Option<SlotBox>,
    request: Option<ConnectRequest>,
}

// SAFETY: the copy owns all its data; the raw id pointers it carries are only
// values (never dereferenced by CmEvent), like integers.
unsafe impl Send for CmEvent {}
// SAFETY: as above; &CmEvent gives read-only access to owned plain data.
unsafe impl Sync for CmEvent {}

impl CmEvent {
    pub(crate) fn new(slot: SlotBox, request: Option<ConnectRequest>) -> CmEvent {
        CmEvent { slot: Some(slot), request }
    }

    fn slot(&self) -> &SlotBox {
        self.slot.as_ref().expect("CmEvent always holds its slot until dropped")
    }

    /// The event type (unknown values pass through).
    pub fn event_type(&self) -> EventType {
        EventType(self.slot().raw().event)
    }

    /// `status`: 0, or a negative errno / a transport reason (e.g. the IB CM
    /// reject reason for REJECTED).
    pub fn status(&self) -> i32 {
        self.slot().raw().status
    }

    /// The id the event is for, as a raw pointer value (never dereferenced
    /// by rdmasafe after the copy). For CONNECT_REQUEST this is the new id.
    pub fn raw_id(&self) -> *mut rdma_cm_id {
        self.slot().raw().id
    }

    /// The listening id of a CONNECT_REQUEST, NULL otherwise.
    pub fn raw_listen_id(&self) -> *mut rdma_cm_id {
        self.slot().raw().listen_id
    }

    /// `id->context` at copy time.
    pub fn context(&self) -> usize {
        self.slot().context()
    }

    /// `listen_id->context` at copy time (0 without a listen id).
    pub fn listen_context(&self) -> usize {
        self.slot().listen_context()
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

    /// True if the C view's private data pointer points into this copy
    /// (librdmacm's event carried private data bytes).
    fn owns_private_data(&self) -> bool {
        let s = self.slot();
        // SAFETY: reading a pointer value out of a union of plain data.
        let p = unsafe { s.raw().param.conn.private_data };
        !p.is_null() && p.cast::<u8>() == s.data().as_ptr()
    }

    /// Private data as received, empty if none. Its length is what the
    /// transport reports, which is the transport's padded maximum, not what
    /// the peer sent (on RoCE with RDMA_PS_TCP: 56 bytes on CONNECT_REQUEST,
    /// 196 on ESTABLISHED): carry your own length inside the data.
    /// Always empty for MULTICAST_JOIN / MULTICAST_ERROR (see
    /// [`CmEvent::multicast_context`]) and for any event whose `param` does
    /// not carry librdmacm's private data (see [`CmEvent::param_word`]).
    pub fn private_data(&self) -> &[u8] {
        if !self.owns_private_data() {
            return &[];
        }
        let s = self.slot();
        // SAFETY: reading an integer out of a union of plain data.
        let len = unsafe { s.raw().param.conn.private_data_len };
        &s.data()[..len as usize]
    }

    /// For MULTICAST_JOIN / MULTICAST_ERROR: the context pointer the app
    /// gave `rdma_join_multicast`, unchanged and never dereferenced.
    pub fn multicast_context(&self) -> Option<*mut c_void> {
        match self.event_type() {
            EventType::MULTICAST_JOIN | EventType::MULTICAST_ERROR => Some(self.param_word() as *mut c_void),
            _ => None,
        }
    }

    /// The first 8 bytes of `param` as a number, unless they are the
    /// private data pointer rdmasafe rewrote into its copy (then 0). This
    /// is `param.arg` of RDMA_CM_EVENT_USER (rdma-core v60), the context
    /// pointer of a multicast event, or whatever a future event type puts
    /// there: it is passed through untouched.
    pub fn param_word(&self) -> u64 {
        if self.owns_private_data() {
            return 0;
        }
        // SAFETY: reading a pointer value out of a union of plain data.
        (unsafe { self.slot().raw().param.conn.private_data }) as usize as u64
    }

    /// True if librdmacm filled `param.ud` (the id's QP type is UD), false
    /// if it filled `param.conn`.
    pub fn is_ud(&self) -> bool {
        self.slot().qp_type() == sys::ibv_qp_type::IBV_QPT_UD
    }

    /// The `param.conn` values (meaningful when `!is_ud()`).
    pub fn conn_param(&self) -> ConnParam {
        // SAFETY: reading plain integers out of a union of plain data.
        let c = unsafe { self.slot().raw().param.conn };
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
        let u = unsafe { self.slot().raw().param.ud };
        UdParam { ah_attr: u.ah_attr, qp_num: u.qp_num, qkey: u.qkey }
    }

    /// The C view of the copy. Its private data pointer points into this
    /// value and is valid while it lives.
    pub fn as_raw(&self) -> &rdma_cm_event {
        self.slot().raw()
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
        self.slot.take().expect("CmEvent holds its slot").into_c()
    }

    /// Takes back a copy handed out by [`CmEvent::into_raw`]. `None` for any
    /// other pointer, a copy taken back already, or one another thread is
    /// taking back at the same moment: the pointer is checked by address
    /// arithmetic and the slot's state before anything is read through it,
    /// so any value is safe to pass.
    pub fn from_raw(raw: *const rdma_cm_event) -> Option<CmEvent> {
        SlotBox::from_c(raw).map(|slot| CmEvent { slot: Some(slot), request: None })
    }

    /// Frees a copy handed out by [`CmEvent::into_raw`] or
    /// [`super::ChannelRef::get_raw_cancellable`], as dropping the [`CmEvent`]
    /// [`CmEvent::from_raw`] returns would (a copy handed to C never owns a
    /// connect request). `false`, nothing read or written, for any pointer
    /// `from_raw` refuses.
    #[inline]
    pub fn free_raw(raw: *const rdma_cm_event) -> bool {
        SlotBox::from_c(raw).map(SlotBox::free).is_some()
    }

    /// For a copy held by C: the ids' contexts captured at copy time
    /// (`(context, listen_context)`), read without taking the copy back.
    /// `None` for a pointer that is not a live copy held by C.
    pub fn contexts_of_raw(raw: *const rdma_cm_event) -> Option<(usize, usize)> {
        SlotBox::peek_c(raw).map(|s| (s.context(), s.listen_context()))
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // A connect request not taken is rejected + destroyed by its own Drop.
        drop(self.request.take());
        // The slot's own Drop frees it (and acks a held original last).
        drop(self.slot.take());
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

/// librdmacm's layout of an event as `rdma_get_cm_event` hands it out
/// (`struct cma_event` in cma.c: the event, then the private data buffer),
/// for tests and fuzzing of the copy path without a kernel.
#[doc(hidden)]
#[repr(C)]
pub struct SyntheticEvent {
    /// The event.
    pub event: rdma_cm_event,
    /// librdmacm's inline private data buffer.
    pub private_data: [u8; sys::RDMA_MAX_PRIVATE_DATA],
}

impl SyntheticEvent {
    /// An all-zero event.
    pub fn zeroed() -> Box<SyntheticEvent> {
        // SAFETY: plain C data; all-zero is a valid value.
        Box::new(unsafe { std::mem::zeroed() })
    }

    /// Puts `data` into the inline buffer and points `param` at it, as
    /// librdmacm does for events that carry private data.
    pub fn set_private_data(&mut self, data: &[u8]) {
        self.private_data[..data.len()].copy_from_slice(data);
        self.event.param.conn.private_data = self.private_data.as_ptr().cast();
        self.event.param.conn.private_data_len = data.len() as u8;
    }
}

/// Builds a copy from a synthetic event (see [`SyntheticEvent`]); panics if
/// no storage is left. Ids in `raw` must be NULL or point to live
/// `rdma_cm_id` values; see [`copy_raw`].
///
/// # Safety
/// As for [`copy_raw`].
#[doc(hidden)]
pub unsafe fn copy_synthetic(raw: *const rdma_cm_event) -> CmEvent {
    let mut slot = super::pool::take().expect("a slot for a synthetic copy");
    // SAFETY: forwarded contract.
    let alive = unsafe { copy_raw(raw, &mut slot) };
    super::pool::warn_if_many_held(alive);
    CmEvent::new(slot, None)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let _g = crate::cm::tests_lock();
        // SAFETY: zeroed rdma_cm_id is plain data; we only set context.
        let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
        id.context = 0x1234 as *mut c_void;
        let bytes: Vec<u8> = (0..196).map(|i| i as u8).collect();
        let mut ev = SyntheticEvent::zeroed();
        ev.event.id = &mut id;
        ev.event.event = EventType::ESTABLISHED.0;
        ev.set_private_data(&bytes);
        ev.event.param.conn.qp_num = 77;
        // SAFETY: ev is laid out as copy_raw requires; the id is live.
        let copy = unsafe { copy_synthetic(&ev.event) };
        ev.private_data.fill(0xee); // the source changes: the copy must not
        assert_eq!(copy.private_data(), &bytes[..]);
        assert_eq!(copy.context(), 0x1234);
        assert_eq!(copy.conn_param().qp_num, 77);
        assert_eq!(copy.param_word(), 0, "the rewritten pointer is not a pass-through word");
        let p = copy.as_raw();
        // SAFETY: reading the pointer value.
        let dp = unsafe { p.param.conn.private_data } as usize;
        assert_eq!(dp, copy.private_data().as_ptr() as usize, "C view points into the copy's own storage");

        let mut mc = SyntheticEvent::zeroed();
        mc.event.id = &mut id;
        mc.event.event = EventType::MULTICAST_JOIN.0;
        mc.event.param.ud.private_data = 0xdead_beef_usize as *const c_void; // never read
        mc.event.param.ud.private_data_len = 200;
        mc.event.param.ud.qkey = 0x11;
        mc.event.param.ud.qp_num = 0xFFFFFF;
        // SAFETY: as above; the multicast pointer is not dereferenced.
        let copy = unsafe { copy_synthetic(&mc.event) };
        assert_eq!(copy.multicast_context(), Some(0xdead_beef_usize as *mut c_void));
        assert!(copy.private_data().is_empty());
        assert_eq!((copy.ud_param().qkey, copy.ud_param().qp_num), (0x11, 0xFFFFFF));
        // SAFETY: reading the C view's union.
        assert_eq!(unsafe { copy.as_raw().param.ud.private_data_len }, 200, "length passed through too");
    }

    /// MULTICAST_ERROR cannot be provoked on RoCE: its copy is checked here.
    #[test]
    fn multicast_error_keeps_the_context_and_status() {
        let _g = crate::cm::tests_lock();
        let mut mc = SyntheticEvent::zeroed();
        mc.event.event = EventType::MULTICAST_ERROR.0;
        mc.event.status = -libc::ENETUNREACH;
        mc.event.param.ud.private_data = 0x5555_0000_usize as *const c_void;
        // SAFETY: no ids; the pointer is not the inline buffer, never read.
        let copy = unsafe { copy_synthetic(&mc.event) };
        assert_eq!(copy.event_type(), EventType::MULTICAST_ERROR);
        assert_eq!(copy.status(), -libc::ENETUNREACH);
        assert_eq!(copy.multicast_context(), Some(0x5555_0000_usize as *mut c_void));
        assert!(copy.private_data().is_empty());
    }

    /// RDMA_CM_EVENT_USER (rdma-core v60) carries `param.arg`, a u64 at the
    /// private data pointer's offset; an unknown type may carry anything.
    /// Only a pointer into librdmacm's own buffer is rewritten.
    #[test]
    fn param_passes_through_unless_it_points_into_the_event() {
        let _g = crate::cm::tests_lock();
        let mut user = SyntheticEvent::zeroed();
        user.event.event = EventType::USER.0;
        user.event.status = 7;
        user.event.param.conn.private_data = 0x0123_4567_89ab_cdef_u64 as usize as *const c_void;
        user.event.param.conn.private_data_len = 9;
        // SAFETY: no ids; the cookie is not the inline buffer, never read.
        let copy = unsafe { copy_synthetic(&user.event) };
        assert_eq!(copy.param_word(), 0x0123_4567_89ab_cdef);
        assert!(copy.private_data().is_empty());

        let mut odd = SyntheticEvent::zeroed();
        odd.event.event = 4242;
        // SAFETY: plain bytes into a union of plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                (&mut odd.event.param as *mut rdma_sys::param_t).cast::<u8>(),
                std::mem::size_of::<rdma_sys::param_t>(),
            )
        };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = 0x80 | i as u8;
        }
        // SAFETY: as above.
        let copy = unsafe { copy_synthetic(&odd.event) };
        // SAFETY: comparing the bytes of two unions of plain data.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(
                    (&odd.event.param as *const rdma_sys::param_t).cast::<u8>(),
                    std::mem::size_of::<rdma_sys::param_t>(),
                ),
                std::slice::from_raw_parts(
                    (&copy.as_raw().param as *const rdma_sys::param_t).cast::<u8>(),
                    std::mem::size_of::<rdma_sys::param_t>(),
                ),
            )
        };
        assert_eq!(a, b, "every byte of param as it was");
    }

    /// A recycled slot: bytes past the new, shorter private data read 0.
    #[test]
    fn private_data_tail_reads_zero_after_a_longer_event() {
        let _g = crate::cm::tests_lock();
        let mut long = SyntheticEvent::zeroed();
        long.set_private_data(&[0xee; 196]);
        let mut short = SyntheticEvent::zeroed();
        short.set_private_data(&[0x11; 56]);
        // SAFETY: synthetic events without ids.
        let first = unsafe { copy_synthetic(&long.event) };
        let addr = first.as_raw() as *const rdma_cm_event;
        drop(first);
        // Copies got and freed one after the other: the long copy's slot
        // comes back once the quarantine has passed.
        let mut again = None;
        let mut others = 0;
        for _ in 0..10_000 {
            // SAFETY: as above.
            let c = unsafe { copy_synthetic(&short.event) };
            if std::ptr::eq(c.as_raw(), addr) {
                again = Some(c);
                break;
            }
            others += 1;
        }
        let c = again.expect("the slot is reused after the quarantine");
        assert!(others >= super::super::pool::QUARANTINE, "reused after {others} others");
        // SAFETY: the C view's private data points into the copy (56 bytes
        // of data, 256 of storage).
        let tail = unsafe { std::slice::from_raw_parts(c.as_raw().param.conn.private_data.cast::<u8>(), 256) };
        assert!(tail[..56].iter().all(|b| *b == 0x11));
        assert!(tail[56..].iter().all(|b| *b == 0), "another client's bytes leaked into the padded tail");
    }

    #[test]
    fn raw_round_trip_keeps_the_copy() {
        let _g = crate::cm::tests_lock();
        let mut ev = SyntheticEvent::zeroed();
        ev.event.event = 999;
        ev.event.status = -110;
        // SAFETY: no ids, no private data.
        let copy = unsafe { copy_synthetic(&ev.event) };
        let raw = copy.into_raw();
        let back = CmEvent::from_raw(raw).expect("a live C copy");
        assert!(CmEvent::from_raw(raw).is_none(), "taken back once");
        assert_eq!(back.event_type(), EventType(999));
        assert_eq!(back.status(), -110);
        assert!(back.private_data().is_empty());
    }
}
