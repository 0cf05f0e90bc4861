//! Minimal owned verbs handles: device listing, PD, MR, completion channel
//! and CQ. Enough for CM programs and tests; the CQ notification loop builds
//! on these.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::sys::{self, ibv_comp_channel, ibv_context, ibv_cq, ibv_mr, ibv_pd};
pub use crate::wc::{Wc, WcOpcode, WcStatus};
use crate::Wait;
use crate::{Error, Result};

/// Names of the RDMA devices present (`ibv_get_device_list`).
pub fn device_names() -> Result<Vec<String>> {
    let mut n = 0;
    // SAFETY: n receives the count; NULL means failure with errno set.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(Error::last("ibv_get_device_list"));
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: list has n valid entries; names are NUL-terminated.
        let name = unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: list came from ibv_get_device_list and is freed once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(names)
}

/// A device context, kept open as long as this value or anything built on
/// it (PD, MR, CQ, completion channel, async event reader) lives.
///
/// librdmacm opens one context per device and shares it with every id on
/// the device, but it does not keep it open for the life of the process:
/// since rdma-core v30, once the device is removed
/// (RDMA_CM_EVENT_DEVICE_REMOVAL) the context is closed as soon as the
/// last reference librdmacm counts is released. A context obtained from a
/// CM id ([`crate::cm::CmId::device_context`]) therefore holds a reference
/// of its own (the list of `rdma_get_devices`, released with
/// `rdma_free_devices` when the last clone goes), so verbs objects on it
/// stay valid until they are dropped, even after the ids that opened it.
#[derive(Clone)]
pub struct DeviceContext(Arc<DeviceInner>);

struct DeviceInner {
    raw: NonNull<ibv_context>,
    /// `rdma_get_devices()`'s list holding a reference on `raw`, or `None`
    /// for a context the app vouches for ([`DeviceContext::from_raw_checked`]).
    cm_ref: Option<NonNull<*mut ibv_context>>,
}

// SAFETY: libibverbs context calls are thread-safe; the list is only
// touched at drop, once.
unsafe impl Send for DeviceInner {}
// SAFETY: as above.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Some(list) = self.cm_ref {
            // SAFETY: the list came from rdma_get_devices and is freed once;
            // nothing built on the context is left (each holds a clone).
            unsafe { sys::rdma_free_devices(list.as_ptr()) };
        }
    }
}

/// Contexts handed out for CM ids, so the devices list is taken once per
/// context while any clone lives.
fn cm_contexts() -> &'static Mutex<HashMap<usize, Weak<DeviceInner>>> {
    static M: OnceLock<Mutex<HashMap<usize, Weak<DeviceInner>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// `[dev, NULL]` in malloc'd memory, as `rdma_free_devices` frees its list.
fn one_device_list(dev: *mut ibv_context) -> Result<NonNull<*mut ibv_context>> {
    // SAFETY: a plain allocation of two pointers.
    let p = unsafe { libc::malloc(2 * std::mem::size_of::<*mut ibv_context>()) }.cast::<*mut ibv_context>();
    let p = NonNull::new(p).ok_or(Error::new("malloc", libc::ENOMEM))?;
    // SAFETY: room for two pointers.
    unsafe {
        p.as_ptr().write(dev);
        p.as_ptr().add(1).write(std::ptr::null_mut());
    }
    Ok(p)
}

impl DeviceContext {
    /// The context librdmacm opened for an id (`id->verbs`), with a
    /// reference of our own on it. `ENODEV` if librdmacm no longer lists
    /// the device (removed).
    ///
    /// # Safety
    /// `raw` must be `verbs` of a live id (so the context is open now).
    pub(crate) unsafe fn for_cm_id(raw: NonNull<ibv_context>) -> Result<DeviceContext> {
        let mut map = cm_contexts().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(inner) = map.get(&(raw.as_ptr() as usize)).and_then(Weak::upgrade) {
            return Ok(DeviceContext(inner));
        }
        let mut n = 0;
        // SAFETY: plain call; the list (NULL-terminated) is ours to free.
        let list =
            NonNull::new(unsafe { sys::rdma_get_devices(&mut n) }).ok_or_else(|| Error::last("rdma_get_devices"))?;
        // The list holds a reference on every device. Keep the one on ours
        // in a list of its own and give back the others: rdma_free_devices
        // of a list with more than one device reads freed memory when it
        // removes a dead device (found by valgrind in the device removal
        // test: its inner loop reads the cma_device it just freed).
        let mut ours = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: n valid entries.
            let dev = unsafe { *list.as_ptr().add(i) };
            let single = one_device_list(dev)?;
            if dev == raw.as_ptr() && ours.is_none() {
                ours = Some(single);
            } else {
                // SAFETY: a one-entry list holding one reference, freed once.
                unsafe { sys::rdma_free_devices(single.as_ptr()) };
            }
        }
        // SAFETY: malloc'd by rdma_get_devices; its references were moved to
        // the one-device lists above.
        unsafe { libc::free(list.as_ptr().cast()) };
        let Some(list) = ours else {
            return Err(Error::new("rdma_get_devices: the id's device is gone", libc::ENODEV));
        };
        map.retain(|_, w| w.strong_count() > 0);
        let inner = Arc::new(DeviceInner { raw, cm_ref: Some(list) });
        map.insert(raw.as_ptr() as usize, Arc::downgrade(&inner));
        Ok(DeviceContext(inner))
    }

    /// Wraps a context the app opened or holds (e.g. `ibv_open_device`).
    ///
    /// # Safety
    /// `raw` must be NULL or a live context that stays open while the
    /// returned handle (and anything made from it) is used.
    pub unsafe fn from_raw_checked(raw: *mut ibv_context) -> Option<DeviceContext> {
        NonNull::new(raw).map(|raw| DeviceContext(Arc::new(DeviceInner { raw, cm_ref: None })))
    }

    /// The raw context.
    pub fn raw(&self) -> *mut ibv_context {
        self.0.raw.as_ptr()
    }

    /// The device name, e.g. `"rxe0"`.
    pub fn name(&self) -> String {
        // SAFETY: a live context has a live device with a NUL-terminated name.
        unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name((*self.raw()).device)) }
            .to_string_lossy()
            .into_owned()
    }
}

impl std::fmt::Debug for DeviceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceContext({:p})", self.0.raw)
    }
}

impl PartialEq for DeviceContext {
    fn eq(&self, other: &Self) -> bool {
        self.0.raw == other.0.raw
    }
}

impl Eq for DeviceContext {}

struct PdInner(NonNull<ibv_pd>, #[allow(dead_code)] DeviceContext);
// SAFETY: PD handles may be used from any thread.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}
impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; every MR/QP on it holds an Arc
        // of this, so nothing uses it any more.
        unsafe { sys::ibv_dealloc_pd(self.0.as_ptr()) };
    }
}

/// A protection domain; clones share it, the last one deallocates it.
#[derive(Clone)]
pub struct Pd(Arc<PdInner>);

impl Pd {
    /// `ibv_alloc_pd`. The PD keeps the context open.
    pub fn new(ctx: &DeviceContext) -> Result<Pd> {
        // SAFETY: ctx is a live context.
        let raw = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_alloc_pd"))?;
        Ok(Pd(Arc::new(PdInner(raw, ctx.clone()))))
    }

    /// The raw PD.
    pub fn raw(&self) -> *mut ibv_pd {
        self.0 .0.as_ptr()
    }
}

pub(crate) struct MrInner {
    raw: NonNull<ibv_mr>,
    buf: NonNull<u8>,
    len: usize,
    /// The buffer is rdmasafe's (a leaked `Box<[u8]>`, freed after
    /// deregistration); false for memory the app registered itself.
    owned: bool,
    _pd: Pd,
}
// SAFETY: the buffer is only reached through volatile copies (see Mr); the
// MR handle calls are thread-safe.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}
impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once here (the
        // last reference: no QP can use it any more).
        unsafe { sys::ibv_dereg_mr(self.raw.as_ptr()) };
        if self.owned {
            // SAFETY: the buffer was leaked from a Box<[u8]> of `len` bytes
            // in Mr::from_box and is freed exactly once, after deregistration.
            unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.buf.as_ptr(), self.len))) };
        }
    }
}

/// What the device may do with a memory region (`ibv_access_flags`).
/// The local device may always read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrAccess {
    /// Local writes: receives and RDMA READ results land here.
    pub local_write: bool,
    /// Peers may RDMA WRITE into it (needs `local_write`).
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
}

impl MrAccess {
    /// Local and remote read and write ([`Mr::new`]'s default).
    pub const ALL: MrAccess = MrAccess { local_write: true, remote_write: true, remote_read: true };
    /// Local only: sends from it, receives and READ results into it.
    pub const LOCAL: MrAccess = MrAccess { local_write: true, remote_write: false, remote_read: false };

    fn flags(self) -> Result<i32> {
        use rdma_sys::ibv_access_flags as A;
        if self.remote_write && !self.local_write {
            // The verbs spec: remote write needs local write.
            return Err(Error::new("ibv_reg_mr: remote_write needs local_write", libc::EINVAL));
        }
        let mut f = 0;
        if self.local_write {
            f |= A::IBV_ACCESS_LOCAL_WRITE.0;
        }
        if self.remote_write {
            f |= A::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_read {
            f |= A::IBV_ACCESS_REMOTE_READ.0;
        }
        Ok(f as i32)
    }
}

impl Default for MrAccess {
    fn default() -> Self {
        MrAccess::ALL
    }
}

/// A peer's view of a memory region: where an RDMA WRITE or READ goes.
/// Exchange it in private data or a message ([`RemoteMr::to_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteMr {
    /// Address in the peer's address space.
    pub addr: u64,
    /// The peer's remote key.
    pub rkey: u32,
    /// Bytes from `addr` the peer registered.
    pub len: u32,
}

impl RemoteMr {
    /// 16 bytes, little-endian: addr, rkey, len.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads [`RemoteMr::to_bytes`]' form from the start of `b` (`None` if
    /// shorter than 16 bytes).
    pub fn from_bytes(b: &[u8]) -> Option<RemoteMr> {
        let b = b.get(..16)?;
        Some(RemoteMr {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            rkey: u32::from_le_bytes(b[8..12].try_into().ok()?),
            len: u32::from_le_bytes(b[12..16].try_into().ok()?),
        })
    }

    /// The sub-range `offset..offset + len`, if it is inside this one.
    pub fn slice(&self, offset: u32, len: u32) -> Option<RemoteMr> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| RemoteMr { addr: self.addr + offset as u64, rkey: self.rkey, len })
    }
}

/// A registered buffer (local write, remote read/write by default).
///
/// The device reads and writes the buffer on its own (DMA) while work
/// requests are posted, outside anything Rust can see, so its bytes are only
/// ever reached by volatile copies ([`Mr::read`], [`Mr::write`]), never by
/// reference. Writing needs `&mut Mr` and the type is not `Clone`, so two
/// Rust threads can never race on the buffer; a QP that posted work on the
/// MR keeps the registration and memory alive (not the `Mr` handle) until
/// it is destroyed.
///
/// The memory is rdmasafe's ([`Mr::new`]), the app's heap buffer handed
/// over ([`Mr::from_box`], given back by [`Mr::try_into_box`] once no QP
/// holds it), or memory the app manages itself ([`Mr::register_raw`]).
pub struct Mr(Arc<MrInner>);

impl Mr {
    /// Allocates `len` zeroed bytes and registers them (`ibv_reg_mr`) for
    /// local and remote read and write (`len` 0: one byte, so the MR has
    /// an address).
    pub fn new(pd: &Pd, len: usize) -> Result<Mr> {
        Mr::from_box(pd, vec![0u8; len.max(1)].into_boxed_slice(), MrAccess::ALL)
    }

    /// Registers the app's own buffer, which the MR owns from now on. A
    /// boxed slice never moves, so the registration stays valid (the
    /// pages are pinned by the kernel while registered). Get it back with
    /// [`Mr::try_into_box`]. An empty buffer is EINVAL.
    pub fn from_box(pd: &Pd, buf: Box<[u8]>, access: MrAccess) -> Result<Mr> {
        let flags = access.flags()?;
        let len = buf.len();
        if len == 0 {
            return Err(Error::new("ibv_reg_mr: empty buffer", libc::EINVAL));
        }
        let ptr = NonNull::new(Box::into_raw(buf).cast::<u8>()).expect("Box is never NULL");
        // SAFETY: pd is live; ptr..ptr+len is the leaked Box.
        let raw = unsafe { sys::ibv_reg_mr(pd.raw(), ptr.as_ptr().cast(), len, flags) };
        match NonNull::new(raw) {
            Some(raw) => Ok(Mr(Arc::new(MrInner { raw, buf: ptr, len, owned: true, _pd: pd.clone() }))),
            None => {
                let err = Error::last("ibv_reg_mr");
                // SAFETY: undo the leak above; nothing registered it.
                unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len))) };
                Err(err)
            }
        }
    }

    /// Registers memory the app manages (a huge page, an mmap'ed file, a
    /// buffer pool): the MR neither frees it nor reads it except through
    /// [`Mr::read`] / [`Mr::write`].
    ///
    /// # Safety
    /// `addr..addr + len` must stay mapped and must not be freed or reused
    /// until the registration is gone: the `Mr` dropped *and* every QP that
    /// posted work on it destroyed (a QP keeps the registration; see
    /// [`Mr::is_shared`]). While it is registered the device may write it
    /// at any time (receives, RDMA WRITE from peers, READ results): the app
    /// must not hold Rust references (`&`/`&mut`) into it that assume
    /// nobody else writes, only raw pointers and volatile or atomic access.
    pub unsafe fn register_raw(pd: &Pd, addr: NonNull<u8>, len: usize, access: MrAccess) -> Result<Mr> {
        let flags = access.flags()?;
        if len == 0 {
            return Err(Error::new("ibv_reg_mr: empty buffer", libc::EINVAL));
        }
        // SAFETY: pd is live; the range is the caller's, valid per the
        // contract above.
        let raw = unsafe { sys::ibv_reg_mr(pd.raw(), addr.as_ptr().cast(), len, flags) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_reg_mr"))?;
        Ok(Mr(Arc::new(MrInner { raw, buf: addr, len, owned: false, _pd: pd.clone() })))
    }

    /// True while a QP that posted work on this MR still holds the
    /// registration (then dropping the `Mr` does not deregister yet).
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// Deregisters and gives the buffer back, if the MR owns one
    /// ([`Mr::new`], [`Mr::from_box`]) and no QP holds it any more;
    /// otherwise returns the `Mr` unchanged.
    pub fn try_into_box(self) -> std::result::Result<Box<[u8]>, Mr> {
        if !self.0.owned {
            return Err(self);
        }
        match Arc::try_unwrap(self.0) {
            Ok(inner) => {
                let inner = std::mem::ManuallyDrop::new(inner);
                // SAFETY: the last reference: no QP uses the registration.
                unsafe { sys::ibv_dereg_mr(inner.raw.as_ptr()) };
                // SAFETY: the leaked Box of from_box, handed back once; the
                // ManuallyDrop keeps MrInner's Drop from freeing it again.
                // The PD reference is dropped by hand below.
                let b = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(inner.buf.as_ptr(), inner.len)) };
                // SAFETY: read out once; `inner` is never used again.
                drop(unsafe { std::ptr::read(&inner._pd) });
                Ok(b)
            }
            Err(arc) => Err(Mr(arc)),
        }
    }

    /// What a peer needs to RDMA WRITE into / READ from the whole MR.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr { addr: self.addr(), rkey: self.rkey(), len: self.0.len.min(u32::MAX as usize) as u32 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True if the buffer is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.0.raw.as_ptr()).lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.0.raw.as_ptr()).rkey }
    }

    /// The buffer's address (for remote access).
    pub fn addr(&self) -> u64 {
        self.0.buf.as_ptr() as u64
    }

    /// A keep-alive for a QP that posts work on this MR.
    pub(crate) fn keep(&self) -> Arc<MrInner> {
        self.0.clone()
    }

    pub(crate) fn sge(&self, offset: usize, len: u32) -> Option<sys::ibv_sge> {
        let end = offset.checked_add(len as usize)?;
        (end <= self.0.len).then(|| sys::ibv_sge { addr: self.addr() + offset as u64, length: len, lkey: self.lkey() })
    }

    fn range(&self, offset: usize, n: usize, op: &'static str) -> Result<*mut u8> {
        offset.checked_add(n).filter(|e| *e <= self.0.len).ok_or(Error::new(op, libc::EINVAL))?;
        // SAFETY: in bounds (checked).
        Ok(unsafe { self.0.buf.as_ptr().add(offset) })
    }

    /// Copies `dst.len()` bytes out of the buffer at `offset` (volatile
    /// reads: the device may have written them).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let p = self.range(offset, dst.len(), "Mr::read")?;
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: in bounds; the buffer lives as long as self.
            *d = unsafe { p.add(i).read_volatile() };
        }
        Ok(())
    }

    /// Copies `src` into the buffer at `offset` (volatile writes: the device
    /// may read them at any time).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let p = self.range(offset, src.len(), "Mr::write")?;
        for (i, b) in src.iter().enumerate() {
            // SAFETY: in bounds; the buffer lives as long as self, and
            // &mut self excludes every other Rust access.
            unsafe { p.add(i).write_volatile(*b) };
        }
        Ok(())
    }
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("shared", &self.is_shared())
            .finish()
    }
}

impl PartialEq for Mr {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

struct CompChannelInner(NonNull<ibv_comp_channel>, #[allow(dead_code)] DeviceContext);
// SAFETY: completion channel calls are thread-safe.
unsafe impl Send for CompChannelInner {}
// SAFETY: as above.
unsafe impl Sync for CompChannelInner {}
impl Drop for CompChannelInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel; every CQ on it holds an
        // Arc of this, so none is left.
        unsafe { sys::ibv_destroy_comp_channel(self.0.as_ptr()) };
    }
}

/// A completion channel; clones share it.
#[derive(Clone)]
pub struct CompChannel(Arc<CompChannelInner>);

impl CompChannel {
    /// `ibv_create_comp_channel`. The channel keeps the context open.
    pub fn new(ctx: &DeviceContext) -> Result<CompChannel> {
        // SAFETY: ctx is a live context.
        let raw = unsafe { sys::ibv_create_comp_channel(ctx.raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_create_comp_channel"))?;
        Ok(CompChannel(Arc::new(CompChannelInner(raw, ctx.clone()))))
    }

    /// The raw channel.
    pub fn raw(&self) -> *mut ibv_comp_channel {
        self.0 .0.as_ptr()
    }

    /// Waits per `wait` for one CQ event and returns which of `cqs` it was
    /// for, counting it on that CQ as unacked (acked by [`Cq::ack_events`]
    /// or at the latest when the CQ is dropped). An event for a CQ not in
    /// `cqs` is acked at once (so that CQ's destroy cannot hang), logged
    /// with the CQ's address, and returned as an error (EPROTO) that names
    /// the CQ ([`Error::object`]): pass every CQ bound to this channel.
    /// No event: EAGAIN with [`Wait::None`] ([`Error::is_would_block`]),
    /// ETIMEDOUT when a [`Wait::For`] ran out ([`Error::is_timeout`]).
    pub fn get_event<'c>(&self, cqs: &[&'c Cq], wait: Wait) -> Result<&'c Cq> {
        if wait != Wait::Forever {
            let [ready] = sys::poll_readable([self.as_raw_fd()], wait)
                .map_err(|e| Error::new("poll", e.raw_os_error().unwrap_or(libc::EIO)))?;
            if !ready {
                let errno = if wait == Wait::None { libc::EAGAIN } else { libc::ETIMEDOUT };
                return Err(Error::new("ibv_get_cq_event", errno));
            }
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: live channel; out-pointers valid.
        if unsafe { sys::ibv_get_cq_event(self.raw(), &mut cq, &mut ctx) } != 0 {
            return Err(Error::last("ibv_get_cq_event"));
        }
        let Some(found) = cqs.iter().find(|c| c.raw() == cq) else {
            // SAFETY: the event was read for `cq`, which therefore lives
            // until this ack (its destroy waits for it).
            unsafe { sys::ibv_ack_cq_events(cq, 1) };
            log::warn!(target: "rdmasafe", "CompChannel::get_event: an event for CQ {cq:p}, not among the CQs passed: acked");
            return Err(Error::new("ibv_get_cq_event: event for a CQ not passed (acked)", libc::EPROTO).about(cq));
        };
        found.0.unacked.fetch_add(1, Ordering::Relaxed);
        Ok(found)
    }
}

impl AsRawFd for CompChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.raw()).fd }
    }
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open while the channel (kept by self) lives.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

struct CqInner {
    raw: NonNull<ibv_cq>,
    unacked: AtomicU32,
    _channel: Option<CompChannel>,
    _ctx: DeviceContext,
}
// SAFETY: CQ calls are thread-safe in libibverbs.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}
impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: live CQ; ack what was counted so destroy does not wait
        // forever, then destroy once.
        unsafe {
            let n = *self.unacked.get_mut();
            if n > 0 {
                sys::ibv_ack_cq_events(self.raw.as_ptr(), n);
            }
            // Before the destroy: a new CQ at this address must not inherit.
            crate::cq::cq_destroyed(self.raw.as_ptr());
            sys::ibv_destroy_cq(self.raw.as_ptr());
        }
    }
}

/// A completion queue; clones share it, the last one destroys it (after
/// acking every event counted on it).
#[derive(Clone)]
pub struct Cq(Arc<CqInner>);

impl Cq {
    /// `ibv_create_cq` with `cqe` entries, optionally bound to `channel`.
    /// The CQ keeps the context (and the channel) open.
    pub fn new(ctx: &DeviceContext, cqe: i32, channel: Option<&CompChannel>) -> Result<Cq> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.raw());
        // SAFETY: live context and channel; no cq_context.
        let raw = unsafe { sys::ibv_create_cq(ctx.raw(), cqe, std::ptr::null_mut(), ch, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_create_cq"))?;
        Ok(Cq(Arc::new(CqInner { raw, unacked: AtomicU32::new(0), _channel: channel.cloned(), _ctx: ctx.clone() })))
    }

    /// The raw CQ.
    pub fn raw(&self) -> *mut ibv_cq {
        self.0.raw.as_ptr()
    }

    /// `ibv_req_notify_cq`.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        match unsafe { sys::ibv_req_notify_cq(self.raw(), solicited_only as i32) } {
            0 => Ok(()),
            r => Err(Error::new("ibv_req_notify_cq", r)),
        }
    }

    /// `ibv_poll_cq` into `wcs`; returns how many entries were filled.
    pub fn poll(&self, wcs: &mut [Wc]) -> Result<usize> {
        let wcs = Wc::as_raw_slice_mut(wcs);
        let n = wcs.len().min(i32::MAX as usize) as i32;
        // SAFETY: live CQ; wcs has room for n entries.
        let r = unsafe { sys::ibv_poll_cq(self.raw(), n, wcs.as_mut_ptr()) };
        if r < 0 {
            Err(Error::new("ibv_poll_cq", -r))
        } else {
            Ok(r as usize)
        }
    }

    /// Acks every event counted on this CQ (one `ibv_ack_cq_events` call).
    /// Returns how many were acked.
    pub fn ack_events(&self) -> u32 {
        let n = self.0.unacked.swap(0, Ordering::Relaxed);
        if n > 0 {
            // SAFETY: live CQ; n events were reported for it and not acked.
            unsafe { sys::ibv_ack_cq_events(self.raw(), n) };
        }
        n
    }

    /// Events counted and not acked yet.
    pub fn unacked(&self) -> u32 {
        self.0.unacked.load(Ordering::Relaxed)
    }
}

/// An all-zero work completion, for filling arrays before polling
/// (the same as [`Wc::zeroed`]).
pub fn empty_wc() -> Wc {
    Wc::zeroed()
}

/// A successful completion of `qp_num` with `wr_id` (unit tests).
#[cfg(test)]
pub(crate) fn wc_of(qp_num: u32, wr_id: u64) -> Wc {
    let mut wc = empty_wc();
    let raw = &mut Wc::as_raw_slice_mut(std::slice::from_mut(&mut wc))[0];
    raw.qp_num = qp_num;
    raw.wr_id = wr_id;
    wc
}
