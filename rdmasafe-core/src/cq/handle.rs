//! The verbs objects the loop works on, as small handle types whose one
//! unsafe constructor states why the object is alive; every method is then
//! safe. The rest of the loop calls only these (and `sys` for fds), so the
//! loop's logic holds no `unsafe` of its own.

use std::ptr::NonNull;

use crate::sys::{self, ibv_comp_channel, ibv_context, ibv_cq, ibv_qp};
use crate::verbs::{CompChannel, Cq};
use crate::wc::Wc;
use crate::{Error, Result};

/// A CQ the loop may poll, arm and ack: alive as long as this value.
pub(crate) struct LiveCq {
    raw: NonNull<ibv_cq>,
    /// For CQs from the Rust API: the loop keeps them alive itself.
    _keep: Option<Cq>,
}

// SAFETY: libibverbs CQ calls may come from any thread; the handle is a
// pointer plus an owned keep-alive.
unsafe impl Send for LiveCq {}

impl LiveCq {
    /// A CQ the loop keeps alive itself.
    pub(crate) fn owned(cq: &Cq) -> LiveCq {
        LiveCq { raw: NonNull::new(cq.raw()).expect("a Cq is never NULL"), _keep: Some(cq.clone()) }
    }

    /// A CQ the app owns (the C API).
    ///
    /// # Safety
    /// `raw` must be a live CQ that stays alive as long as the returned
    /// value (the app removes it from the loop before `ibv_destroy_cq`).
    pub(crate) unsafe fn borrowed(raw: NonNull<ibv_cq>) -> LiveCq {
        LiveCq { raw, _keep: None }
    }

    pub(crate) fn addr(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// How many completions the CQ holds at most (`cqe`, as the provider
    /// made it; at least 1).
    pub(crate) fn capacity(&self) -> usize {
        // SAFETY: live CQ (type invariant); a plain field read.
        (unsafe { (*self.raw.as_ptr()).cqe }).max(1) as usize
    }

    /// The completion channel the CQ was created on, and its context.
    pub(crate) fn channel_and_context(&self) -> (*mut ibv_comp_channel, *mut ibv_context) {
        // SAFETY: live CQ (type invariant); plain field reads.
        unsafe { ((*self.raw.as_ptr()).channel, (*self.raw.as_ptr()).context) }
    }

    /// `ibv_poll_cq` into `wcs`; the number filled.
    pub(crate) fn poll(&self, wcs: &mut [Wc]) -> Result<usize> {
        let wcs = Wc::as_raw_slice_mut(wcs);
        let n = wcs.len().min(i32::MAX as usize) as i32;
        // SAFETY: live CQ; wcs has room for n entries.
        let r = unsafe { sys::ibv_poll_cq(self.raw.as_ptr(), n, wcs.as_mut_ptr()) };
        if r < 0 {
            Err(Error::new("ibv_poll_cq", -r))
        } else {
            Ok(r as usize)
        }
    }

    /// `ibv_req_notify_cq`.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        match unsafe { sys::ibv_req_notify_cq(self.raw.as_ptr(), solicited_only as i32) } {
            0 => Ok(()),
            r => Err(Error::new("ibv_req_notify_cq", r)),
        }
    }

    /// `ibv_ack_cq_events(cq, n)`: `n` events read for this CQ.
    pub(crate) fn ack(&self, n: u32) {
        if n > 0 {
            // SAFETY: live CQ; the caller read n events for it.
            unsafe { sys::ibv_ack_cq_events(self.raw.as_ptr(), n) };
        }
    }
}

/// One CQ event read from a channel and not acked yet. Its CQ is alive
/// until it is acked: `ibv_destroy_cq` waits for exactly that ack.
pub(crate) struct CqEvent(NonNull<ibv_cq>);

impl CqEvent {
    pub(crate) fn cq_addr(&self) -> usize {
        self.0.as_ptr() as usize
    }

    /// Acks the event on its CQ (an event for a CQ the loop does not serve).
    pub(crate) fn ack(self) {
        // SAFETY: the CQ lives until this ack (see the type).
        unsafe { sys::ibv_ack_cq_events(self.0.as_ptr(), 1) };
    }
}

/// The completion channel the loop reads: alive as long as this value,
/// until [`LiveChannel::release`].
pub(crate) struct LiveChannel {
    raw: NonNull<ibv_comp_channel>,
    keep: Option<CompChannel>,
    /// Let go of ([`LiveChannel::release`]): `raw` may be freed.
    released: bool,
}

// SAFETY: channel calls may come from any thread.
unsafe impl Send for LiveChannel {}
// SAFETY: as above; only reads through &self.
unsafe impl Sync for LiveChannel {}

impl LiveChannel {
    /// A channel the loop keeps alive itself.
    pub(crate) fn owned(ch: &CompChannel) -> LiveChannel {
        LiveChannel {
            raw: NonNull::new(ch.raw()).expect("a CompChannel is never NULL"),
            keep: Some(ch.clone()),
            released: false,
        }
    }

    /// A channel the app owns (the C API).
    ///
    /// # Safety
    /// `raw` must be a live completion channel that outlives the value.
    pub(crate) unsafe fn borrowed(raw: NonNull<ibv_comp_channel>) -> LiveChannel {
        LiveChannel { raw, keep: None, released: false }
    }

    pub(crate) fn addr(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// Lets go of the channel the loop kept alive, and with it of its
    /// device context: the loop is torn down ([`super::core::Core::shutdown`]),
    /// but a `LoopControl` may keep the loop's shared state (and this)
    /// for long after, and an open context keeps the device from being
    /// removed. Afterwards the value reads nothing: [`Self::fd`] is -1 and
    /// [`Self::get_event`] finds no event.
    pub(crate) fn release(&mut self) {
        self.keep = None;
        self.released = true;
    }

    pub(crate) fn fd(&self) -> i32 {
        if self.released {
            return -1;
        }
        // SAFETY: live channel (not released); a plain field read.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    pub(crate) fn context(&self) -> *mut ibv_context {
        // SAFETY: live channel; a plain field read.
        unsafe { (*self.raw.as_ptr()).context }
    }

    /// Reads one CQ event (the fd is non-blocking): `None` when none is
    /// ready. EINTR is retried. Inlined: it is on every wakeup's path
    /// (out of line, its call cost about 16 instructions per completion).
    #[inline(always)]
    pub(crate) fn get_event(&self) -> Result<Option<CqEvent>> {
        if self.released {
            return Ok(None);
        }
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: live channel (not released); out-pointers valid for
            // the call.
            if unsafe { sys::ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut ctx) } == 0 {
                return Ok(NonNull::new(cq).map(CqEvent));
            }
            let e = Error::last("ibv_get_cq_event");
            match e.errno() {
                libc::EAGAIN => return Ok(None),
                libc::EINTR => continue,
                _ => return Err(e),
            }
        }
    }
}

/// Whether a QP owned by a [`crate::cm::CmId`] still exists: the id clears
/// it (under the lock) before `rdma_destroy_qp`, and the loop uses the QP
/// only under the lock while it is set. So a keepalive or drain on an id's
/// QP can never touch a destroyed QP, whatever order the app drops things
/// in.
#[derive(Default)]
pub(crate) struct QpLife(std::sync::Mutex<bool>);

impl QpLife {
    pub(crate) fn new_alive() -> QpLife {
        QpLife(std::sync::Mutex::new(true))
    }

    /// Marks the QP destroyed; waits for a use in progress.
    pub(crate) fn end(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
    }
}

/// A QP the loop posts probes and drain markers on.
pub(crate) struct LiveQp {
    raw: NonNull<ibv_qp>,
    /// For a QP owned by a `CmId`: checked (locked) around every use.
    life: Option<std::sync::Arc<QpLife>>,
}

// SAFETY: QP calls may come from any thread.
unsafe impl Send for LiveQp {}

impl LiveQp {
    /// # Safety
    /// `raw` must be a live QP that stays alive as long as the value (the
    /// app removes the keepalive / waits for the drain before destroying).
    pub(crate) unsafe fn new(raw: NonNull<ibv_qp>) -> LiveQp {
        LiveQp { raw, life: None }
    }

    /// A QP whose destruction is announced through `life` (a `CmId`'s).
    ///
    /// # Safety
    /// `raw` must be live while `life` says so: its owner calls
    /// [`QpLife::end`] before destroying it.
    pub(crate) unsafe fn with_life(raw: NonNull<ibv_qp>, life: std::sync::Arc<QpLife>) -> LiveQp {
        LiveQp { raw, life: Some(life) }
    }

    pub(crate) fn raw(&self) -> *mut ibv_qp {
        self.raw.as_ptr()
    }

    /// Whether a `CmId` owns the QP (and announces its destruction).
    pub(crate) fn has_owner(&self) -> bool {
        self.life.is_some()
    }

    /// True once the QP's owning `CmId` destroyed it.
    pub(crate) fn is_destroyed(&self) -> bool {
        self.life.as_ref().is_some_and(|l| !*l.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Runs `f` on the QP if it still exists (ENOENT if its owner destroyed it).
    fn with<T>(&self, f: impl FnOnce(*mut ibv_qp) -> Result<T>) -> Result<T> {
        match &self.life {
            None => f(self.raw.as_ptr()),
            Some(l) => {
                let alive = l.0.lock().unwrap_or_else(|e| e.into_inner());
                if *alive {
                    f(self.raw.as_ptr())
                } else {
                    Err(Error::new("rdmasafe: the QP was destroyed (its CmId dropped)", libc::ENOENT))
                }
            }
        }
    }

    /// Whether the QP is reliable connected (a keepalive's zero-length
    /// RDMA WRITE needs it).
    pub(crate) fn is_rc(&self) -> Result<bool> {
        // SAFETY: live QP (checked by `with`); a plain field read.
        self.with(|q| Ok(unsafe { (*q).qp_type } == sys::ibv_qp_type::IBV_QPT_RC))
    }

    /// (qp_num, send CQ, receive CQ), as addresses.
    pub(crate) fn info(&self) -> Result<(u32, usize, usize)> {
        self.with(|q| {
            // SAFETY: live QP (checked); plain field reads.
            let q = unsafe { &*q };
            Ok((q.qp_num, q.send_cq as usize, q.recv_cq as usize))
        })
    }

    /// Whether the QP takes its receives from an SRQ (it then has no
    /// receive queue of its own to put a drain marker on).
    pub(crate) fn has_srq(&self) -> Result<bool> {
        // SAFETY: live QP (checked by `with`); a plain field read.
        self.with(|q| Ok(!unsafe { (*q).srq }.is_null()))
    }

    /// A signaled zero-length RDMA WRITE (a keepalive probe).
    pub(crate) fn post_probe(&self, wr_id: u64) -> Result<()> {
        // SAFETY: live QP (checked by `with`).
        self.with(|q| unsafe { sys::post_zero_length_write(q, wr_id) })
    }

    /// The QP's ack timeout (see [`sys::qp_ack_timeout`]).
    pub(crate) fn ack_timeout(&self) -> Option<std::time::Duration> {
        // SAFETY: live QP (checked by `with`).
        self.with(|q| Ok(unsafe { sys::qp_ack_timeout(q) })).ok().flatten()
    }

    /// Where the QP stands for sending (see [`sys::QpSend`]); `Unknown`
    /// for a QP its owner destroyed.
    pub(crate) fn send_state(&self) -> sys::QpSend {
        // SAFETY: live QP (checked by `with`).
        self.with(|q| Ok(unsafe { sys::qp_send_state(q) })).unwrap_or(sys::QpSend::Unknown)
    }

    /// Moves the QP to the error state (flushes what is outstanding).
    pub(crate) fn to_error(&self) -> Result<()> {
        // SAFETY: live QP (checked by `with`).
        self.with(|q| unsafe { sys::qp_to_error(q) })
    }

    /// Error state plus drain markers (see `sys::qp_to_error_and_post_markers`).
    /// The error carries whether the receive marker was posted (it will
    /// still arrive, as a flush, and must be consumed).
    pub(crate) fn to_error_with_markers(
        &self,
        recv: bool,
        send_wr_id: u64,
        recv_wr_id: u64,
    ) -> std::result::Result<(), (crate::Error, bool)> {
        // SAFETY: live QP (checked by `with`).
        match self.with(|q| Ok(unsafe { sys::qp_to_error_and_post_markers(q, recv, send_wr_id, recv_wr_id) })) {
            Ok(r) => r,
            Err(e) => Err((e, false)),
        }
    }
}
