//! Minimal owned verbs handles: device listing, PD, MR, completion channel
//! and CQ. Enough for CM programs and tests; the CQ notification loop builds
//! on these.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::sys::{self, ibv_comp_channel, ibv_context, ibv_cq, ibv_mr, ibv_pd, ibv_wc, Wait};
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

/// A device context opened by librdmacm for a CM id. librdmacm keeps it open
/// for the life of the process, so this handle is a plain copyable pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceContext(NonNull<ibv_context>);

// SAFETY: libibverbs context calls are thread-safe.
unsafe impl Send for DeviceContext {}
// SAFETY: as above.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    pub(crate) fn from_raw(raw: *mut ibv_context) -> Option<DeviceContext> {
        NonNull::new(raw).map(DeviceContext)
    }

    /// Wraps a context the app opened (e.g. `id->verbs`).
    ///
    /// # Safety
    /// `raw` must be NULL or a live context that stays open while the
    /// returned handle (and anything made from it) is used.
    pub unsafe fn from_raw_checked(raw: *mut ibv_context) -> Option<DeviceContext> {
        Self::from_raw(raw)
    }

    /// The raw context.
    pub fn raw(&self) -> *mut ibv_context {
        self.0.as_ptr()
    }

    /// The device name, e.g. `"rxe0"`.
    pub fn name(&self) -> String {
        // SAFETY: a live context has a live device with a NUL-terminated name.
        unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name((*self.raw()).device)) }
            .to_string_lossy()
            .into_owned()
    }
}

struct PdInner(NonNull<ibv_pd>);
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
    /// `ibv_alloc_pd`.
    pub fn new(ctx: DeviceContext) -> Result<Pd> {
        // SAFETY: ctx is a live context.
        let raw = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        Ok(Pd(Arc::new(PdInner(NonNull::new(raw).ok_or_else(|| Error::last("ibv_alloc_pd"))?))))
    }

    /// The raw PD.
    pub fn raw(&self) -> *mut ibv_pd {
        self.0 .0.as_ptr()
    }
}

struct MrInner {
    raw: NonNull<ibv_mr>,
    buf: NonNull<u8>,
    len: usize,
    _pd: Pd,
}
// SAFETY: the MR is only read through raw-pointer copies (see Mr::read/write).
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}
impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr; the buffer was leaked from a Box
        // in Mr::new and is freed exactly once, after deregistration.
        unsafe {
            sys::ibv_dereg_mr(self.raw.as_ptr());
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.buf.as_ptr(), self.len)));
        }
    }
}

/// A registered buffer owned by rdmasafe (local write, remote read/write).
/// The device may write it at any time while receives are posted, so its
/// bytes are reached by copying ([`Mr::read`], [`Mr::write`]), never by
/// reference.
#[derive(Clone)]
pub struct Mr(Arc<MrInner>);

impl Mr {
    /// Allocates `len` zeroed bytes and registers them (`ibv_reg_mr`).
    pub fn new(pd: &Pd, len: usize) -> Result<Mr> {
        let boxed: Box<[u8]> = vec![0u8; len.max(1)].into_boxed_slice();
        let len = boxed.len();
        let buf = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("Box is never NULL");
        let access = (rdma_sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as i32;
        // SAFETY: pd is live; buf..buf+len is our allocation.
        let raw = unsafe { sys::ibv_reg_mr(pd.raw(), buf.as_ptr().cast(), len, access) };
        match NonNull::new(raw) {
            Some(raw) => Ok(Mr(Arc::new(MrInner { raw, buf, len, _pd: pd.clone() }))),
            None => {
                let err = Error::last("ibv_reg_mr");
                // SAFETY: undo the leak above; nothing registered it.
                unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(buf.as_ptr(), len))) };
                Err(err)
            }
        }
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

    pub(crate) fn same(&self, other: &Mr) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn sge(&self, offset: usize, len: u32) -> Option<sys::ibv_sge> {
        let end = offset.checked_add(len as usize)?;
        (end <= self.0.len).then(|| sys::ibv_sge { addr: self.addr() + offset as u64, length: len, lkey: self.lkey() })
    }

    /// Copies `dst.len()` bytes out of the buffer at `offset`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len()).filter(|e| *e <= self.0.len);
        end.ok_or(Error::new("Mr::read", libc::EINVAL))?;
        // SAFETY: in bounds (checked); the buffer lives as long as self.
        unsafe { std::ptr::copy_nonoverlapping(self.0.buf.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let end = offset.checked_add(src.len()).filter(|e| *e <= self.0.len);
        end.ok_or(Error::new("Mr::write", libc::EINVAL))?;
        // SAFETY: in bounds (checked); the buffer lives as long as self.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.buf.as_ptr().add(offset), src.len()) };
        Ok(())
    }
}

struct CompChannelInner(NonNull<ibv_comp_channel>);
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
    /// `ibv_create_comp_channel`.
    pub fn new(ctx: DeviceContext) -> Result<CompChannel> {
        // SAFETY: ctx is a live context.
        let raw = unsafe { sys::ibv_create_comp_channel(ctx.raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_create_comp_channel"))?;
        Ok(CompChannel(Arc::new(CompChannelInner(raw))))
    }

    /// The raw channel.
    pub fn raw(&self) -> *mut ibv_comp_channel {
        self.0 .0.as_ptr()
    }

    /// Waits per `wait` for one CQ event and returns which of `cqs` it was
    /// for, counting it on that CQ as unacked (acked by [`Cq::ack_events`]
    /// or at the latest when the CQ is dropped). An event for a CQ not in
    /// `cqs` is an error (EPROTO): pass every CQ bound to this channel.
    pub fn get_event<'c>(&self, cqs: &[&'c Cq], wait: Wait) -> Result<&'c Cq> {
        if wait != Wait::Forever {
            let [ready] = sys::poll_readable([self.as_raw_fd()], wait)
                .map_err(|e| Error::new("poll", e.raw_os_error().unwrap_or(libc::EIO)))?;
            if !ready {
                return Err(Error::new("ibv_get_cq_event", libc::ETIMEDOUT));
            }
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: live channel; out-pointers valid.
        if unsafe { sys::ibv_get_cq_event(self.raw(), &mut cq, &mut ctx) } != 0 {
            return Err(Error::last("ibv_get_cq_event"));
        }
        let found = cqs.iter().find(|c| c.raw() == cq).ok_or(Error::new("ibv_get_cq_event", libc::EPROTO))?;
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
    pub fn new(ctx: DeviceContext, cqe: i32, channel: Option<&CompChannel>) -> Result<Cq> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.raw());
        // SAFETY: live context and channel; no cq_context.
        let raw = unsafe { sys::ibv_create_cq(ctx.raw(), cqe, std::ptr::null_mut(), ch, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("ibv_create_cq"))?;
        Ok(Cq(Arc::new(CqInner { raw, unacked: AtomicU32::new(0), _channel: channel.cloned() })))
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
    pub fn poll(&self, wcs: &mut [ibv_wc]) -> Result<usize> {
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

/// An all-zero work completion, for filling arrays before polling.
pub fn empty_wc() -> ibv_wc {
    // SAFETY: ibv_wc is plain data; zero is valid.
    unsafe { std::mem::zeroed() }
}
