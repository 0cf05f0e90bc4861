//! Getting events: blocking, with a timeout, non-blocking, and in batches.
//!
//! Every get copies the librdmacm event into rdmasafe's storage and acks it
//! before returning (see [`super::CmEvent`]). System calls per event:
//! on an [`EventChannel`] (non-blocking fd) a ready event costs exactly the
//! one `write()` inside `rdma_get_cm_event`, as the raw way does; a poll() is
//! added only when nothing is ready and the caller wants to wait. On a
//! [`ChannelRef`] whose blocking mode is not known, waits with a timeout and
//! batch drains poll() first, one extra call per event.

use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::event::{copy_raw, CmEvent, EventType};
use super::id::{CmId, ConnectRequest, IdToken};
use super::pool;
use crate::sys::{self, rdma_cm_event, rdma_event_channel, Wait};
use crate::{Error, Result};

/// Owner of a channel rdmasafe created. Ids hold an `Arc` of it, so the
/// channel is destroyed only after its last id.
pub(crate) struct ChannelInner {
    raw: NonNull<rdma_event_channel>,
    /// Made readable by [`CmId::migrate`] into this channel, for the
    /// edge-triggered waits (tokio, mio) that watch it beside the channel's
    /// fd: the kernel moves a migrated id's queued events to this channel
    /// without waking the channel's waiters. Made at the first such
    /// registration. (rdmasafe's level-triggered waits, a get or a
    /// dispatcher asleep in poll(), watch [`moved_in_any`] instead.)
    moved_in: OnceLock<sys::WakeFd>,
}

// SAFETY: librdmacm's channel calls are thread-safe (a get is one write() on
// the fd; the channel struct is not mutated after creation).
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    pub(crate) fn raw(&self) -> *mut rdma_event_channel {
        self.raw.as_ptr()
    }

    /// The eventfd that becomes readable (a new edge each time) when an id
    /// is migrated into this channel, for edge-triggered waits; made on the
    /// first call. Each migrate writes it, and nobody drains it: an
    /// edge-triggered wait sees every write.
    #[cfg(any(feature = "tokio", feature = "mio"))]
    pub(crate) fn moved_in(&self) -> Result<&sys::WakeFd> {
        if let Some(w) = self.moved_in.get() {
            return Ok(w);
        }
        let w = sys::WakeFd::new().map_err(|e| Error::from(e).context("eventfd"))?;
        // A racing first call may win: its fd is the one, ours is closed.
        let _ = self.moved_in.set(w);
        Ok(self.moved_in.get().expect("set just now"))
    }

    /// poll() for the channel's fd, `also` (an fd of the caller's, e.g. a
    /// stop eventfd; -1: none) and [`moved_in_any`], which it drains:
    /// `[channel, also]`, the channel's readable also when an id was
    /// migrated in anywhere (a get may then find an event here; if not, the
    /// caller polls again). Without that eventfd (none could be made) only
    /// the two are watched.
    pub(crate) fn poll(&self, also: RawFd, wait: Wait, retry_eintr: bool) -> std::io::Result<[bool; 2]> {
        let any = moved_in_any();
        let [ch, also, moved] =
            sys::poll_readable_ex([self.fd(), also, any.map_or(-1, sys::WakeFd::fd)], wait, retry_eintr)?;
        if moved {
            any.expect("polled").drain();
        }
        Ok([ch || moved, also])
    }

    /// Wakes the waits that may be on this channel: its edge-triggered
    /// ones (its own eventfd, if made) and every level-triggered one
    /// ([`moved_in_any`], if made): events may have been moved in.
    pub(crate) fn signal_moved_in(&self) {
        if let Some(w) = self.moved_in.get() {
            w.wake();
        }
        if let Some(w) = MOVED_IN_ANY.get().and_then(Option::as_ref) {
            w.wake();
        }
    }
}

static MOVED_IN_ANY: OnceLock<Option<sys::WakeFd>> = OnceLock::new();

/// One eventfd for the whole process that every [`CmId::migrate`] writes,
/// watched by rdmasafe's level-triggered waits on any channel (a get or a
/// dispatcher asleep in poll(); the kernel does not wake a channel's
/// waiters for the events a migrated id brings): made at the first such
/// wait, one fd however many channels there are. A write wakes every such
/// wait, which finds its own channel's fd readable if the events came to
/// it (poll() rescans its fds after a wakeup), so whichever drains it
/// takes nothing from the others. None if it could not be made (then
/// those waits sleep through a migrate, as librdmacm's do); not retried.
fn moved_in_any() -> Option<&'static sys::WakeFd> {
    MOVED_IN_ANY
        .get_or_init(|| {
            sys::WakeFd::new()
                .inspect_err(|e| log::debug!(target: "rdmasafe", "no eventfd for migrate wakeups: {e}"))
                .ok()
        })
        .as_ref()
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // No id of ours is left (each holds an Arc of this). Events still
        // queued in the kernel can only be connect requests that raced with
        // the listener's destruction: ack them, reject and destroy their ids.
        let r = ChannelRef {
            raw: self.raw,
            nonblocking: true,
            retry_eintr: true,
            ack_deadline: Some(Duration::ZERO),
            _owner: PhantomData,
        };
        while let Ok(ev) = r.fetch(None) {
            if ev.event_type() == EventType::CONNECT_REQUEST && !ev.raw_id().is_null() {
                // SAFETY: the new id belongs to nobody but this channel now.
                unsafe {
                    sys::rdma_reject(ev.raw_id(), std::ptr::null(), 0);
                    sys::rdma_destroy_id(ev.raw_id());
                }
            }
        }
        // SAFETY: created by rdma_create_event_channel, destroyed once, here.
        unsafe { sys::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// An event channel that rdmasafe created and owns.
///
/// Its fd is non-blocking (the get calls wait with poll() when asked to).
/// Registered with tokio (`aio::AsyncEventChannel`, feature `tokio`) or `mio`, it
/// also holds an eventfd that [`CmId::migrate`] into the channel writes:
/// the kernel does not wake the channel's waiters for the events a
/// migrated id brings. (Its gets and a [`super::Dispatcher`] watch one
/// eventfd for the whole process instead.)
/// It can be shared between threads (`&EventChannel` is enough to get), and
/// clones share the channel.
///
/// Teardown: every [`CmId`] keeps its channel alive, so the librdmacm
/// channel is destroyed only after the last id made on it (and the last
/// clone) is gone. Events still queued in the kernel then can only be
/// connect requests that raced with their listener's destruction: the drop
/// acks them, rejects their new ids and destroys them, so nothing leaks and
/// the clients get REJECTED instead of waiting for a timeout.
#[derive(Clone)]
pub struct EventChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl EventChannel {
    /// Creates a channel (`rdma_create_event_channel`) and makes its fd
    /// non-blocking.
    pub fn new() -> Result<EventChannel> {
        // SAFETY: plain constructor; NULL means failure with errno set.
        let raw = unsafe { sys::rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last("rdma_create_event_channel"))?;
        let inner = Arc::new(ChannelInner { raw, moved_in: OnceLock::new() });
        sys::set_nonblocking(inner.fd()).map_err(|e| Error::new("fcntl", e.raw_os_error().unwrap_or(libc::EIO)))?;
        Ok(EventChannel { inner })
    }

    fn getter(&self) -> ChannelRef<'_> {
        ChannelRef {
            raw: self.inner.raw,
            nonblocking: true,
            retry_eintr: true,
            ack_deadline: Some(Duration::ZERO),
            _owner: PhantomData,
        }
    }

    /// The raw librdmacm channel (still owned by this value).
    pub fn raw(&self) -> *mut rdma_event_channel {
        self.inner.raw()
    }

    /// Waits for the next event, copies and acks it.
    ///
    /// Errors (here and in the other gets): ENOBUFS when the process holds
    /// as many copies as [`crate::cm::set_limit`] allows (the event stays
    /// in the kernel for a later get), ENOMEM when no storage for a copy
    /// can be had (likewise), or librdmacm's errno.
    pub fn get(&self) -> Result<CmEvent> {
        self.getter().get_with(Wait::Forever, Some(&self.inner))
    }

    /// Returns the next event if one is ready, `Ok(None)` if not.
    pub fn try_get(&self) -> Result<Option<CmEvent>> {
        match self.getter().get_with(Wait::None, Some(&self.inner)) {
            Ok(ev) => Ok(Some(ev)),
            Err(e) if e.is_would_block() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits at most `timeout` for an event; `Err` with ETIMEDOUT if none.
    pub fn get_timeout(&self, timeout: Duration) -> Result<CmEvent> {
        self.getter().get_with(Wait::For(timeout), Some(&self.inner))
    }

    /// Waits per `wait` for a first event, then takes up to `max - 1` more
    /// that are ready without waiting, appending them to `out`. Returns how
    /// many it appended (at least 1), or the error of the first get
    /// (EAGAIN for `Wait::None`, ETIMEDOUT for `Wait::For`, those of
    /// [`EventChannel::get`]); EINVAL if `max` is 0.
    /// `out` grows only if its capacity is too small.
    pub fn get_batch(&self, out: &mut Vec<CmEvent>, max: usize, wait: Wait) -> Result<usize> {
        self.getter().batch_with(out, max, wait, Some(&self.inner))
    }

    /// Creates an id on this channel; see [`CmId::new`].
    pub fn create_id(&self, ps: super::PortSpace) -> Result<CmId> {
        CmId::new(self, ps)
    }
}

impl AsRawFd for ChannelInner {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl ChannelInner {
    fn fd(&self) -> RawFd {
        // SAFETY: raw is a live channel for as long as self lives.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd()
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open while self (and so the channel) lives.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd()) }
    }
}

/// A channel the application owns, borrowed for the lifetime `'a`.
///
/// rdmasafe never changes the fd's blocking mode: waits with a timeout use
/// poll() on the fd. Events are copied like on [`EventChannel`], but
/// librdmacm's original is acked when the copy is dropped or when the ack
/// deadline passes ([`pool::ack_deadline`], 1 s by default;
/// [`ChannelRef::with_ack_deadline`]), whichever comes first: as with plain
/// librdmacm, `rdma_destroy_id` / `rdma_migrate_id` of the id wait while a
/// copy is held (a thread handling an event finishes before the id goes),
/// but never much longer than the deadline (the ack thread scans every
/// quarter of it, at most every 250 ms). Ids are the app's: a CONNECT_REQUEST's new id is reported by pointer
/// only ([`CmEvent::raw_id`]), and the app accepts or rejects and destroys
/// it as with plain librdmacm. With several threads getting from one
/// blocking-mode channel, a thread whose poll() saw an event that another
/// thread took blocks in the get: set O_NONBLOCK on shared channels.
/// A signal interrupts a wait with EINTR, as with `rdma_get_cm_event`.
#[derive(Clone, Copy)]
pub struct ChannelRef<'a> {
    raw: NonNull<rdma_event_channel>,
    /// The fd is known to be non-blocking (try the get first, poll only on
    /// EAGAIN). Otherwise poll first whenever a get must not block.
    nonblocking: bool,
    /// Restart waits and gets interrupted by a signal (rdmasafe's own
    /// channels) or report EINTR like librdmacm (app channels).
    retry_eintr: bool,
    /// How long librdmacm's original stays un-acked after a get (until the
    /// copy is freed, at most this); `None`: the process-wide
    /// [`pool::ack_deadline`].
    ack_deadline: Option<Duration>,
    _owner: PhantomData<&'a rdma_event_channel>,
}

// SAFETY: see ChannelInner; the app promised (from_raw) the channel lives for 'a.
unsafe impl Send for ChannelRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for ChannelRef<'_> {}

impl<'a> ChannelRef<'a> {
    /// Borrows an app-owned channel.
    ///
    /// # Safety
    /// `raw` must be a channel from `rdma_create_event_channel` that stays
    /// alive (not destroyed) for `'a`.
    pub unsafe fn from_raw(raw: NonNull<rdma_event_channel>) -> ChannelRef<'a> {
        ChannelRef { raw, nonblocking: false, retry_eintr: false, ack_deadline: None, _owner: PhantomData }
    }

    /// Like [`ChannelRef::from_raw`], and reads the fd's blocking mode once
    /// (one fcntl), so a batch drain on a non-blocking fd costs no poll().
    ///
    /// # Safety
    /// As for [`ChannelRef::from_raw`].
    pub unsafe fn from_raw_probed(raw: NonNull<rdma_event_channel>) -> ChannelRef<'a> {
        // SAFETY: raw is live (caller's contract).
        let fd = unsafe { (*raw.as_ptr()).fd };
        let nonblocking = sys::is_nonblocking(fd).unwrap_or(false);
        ChannelRef { raw, nonblocking, retry_eintr: false, ack_deadline: None, _owner: PhantomData }
    }

    /// Overrides the process-wide [`pool::ack_deadline`] for gets through
    /// this value (zero: ack librdmacm's original at once).
    pub fn with_ack_deadline(mut self, deadline: Duration) -> ChannelRef<'a> {
        self.ack_deadline = Some(deadline);
        self
    }

    /// The channel's fd.
    pub fn fd(&self) -> RawFd {
        // SAFETY: raw is live for 'a.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    /// Waits for the next event like `rdma_get_cm_event` does on this fd
    /// (blocks on a blocking fd; EAGAIN on a non-blocking one), then copies
    /// and acks it. One system call per event, as the raw way.
    pub fn get(&self) -> Result<CmEvent> {
        self.fetch(None)
    }

    /// Waits per `wait` (never changing the fd's mode); `Err` EAGAIN
    /// (`Wait::None`) or ETIMEDOUT (`Wait::For`) if no event came.
    pub fn get_wait(&self, wait: Wait) -> Result<CmEvent> {
        self.get_with(wait, None)
    }

    /// See [`EventChannel::get_batch`].
    pub fn get_batch(&self, out: &mut Vec<CmEvent>, max: usize, wait: Wait) -> Result<usize> {
        self.batch_with(out, max, wait, None)
    }

    /// One `rdma_get_cm_event` (may block per the fd's mode), then the copy,
    /// then the ack of librdmacm's original: at once, or (with an ack
    /// deadline) when the copy is freed or the deadline passes.
    /// With an owner, a CONNECT_REQUEST's new id gets a token as context and
    /// is owned by the returned event.
    fn fetch(&self, owner: Option<&Arc<ChannelInner>>) -> Result<CmEvent> {
        self.fetch_counting::<true>(owner)
    }

    /// [`ChannelRef::fetch`]; `COUNT` as for [`pool::LimitUnit::take`].
    #[inline(always)]
    fn fetch_counting<const COUNT: bool>(&self, owner: Option<&Arc<ChannelInner>>) -> Result<CmEvent> {
        let (mut slot, ev, alive, deadline_ms) = self.take_event::<COUNT>()?;
        let request = match owner {
            Some(owner) if EventType(slot.raw().event) == EventType::CONNECT_REQUEST && !slot.raw().id.is_null() => {
                let token = IdToken::next();
                let new_id = slot.raw().id;
                // SAFETY: the new id is live (event unacked) and ours to
                // label: librdmacm made it on our channel for this request.
                unsafe { (*new_id).context = token.as_context() as *mut _ };
                let listen_context = slot.listen_context();
                slot.set_contexts(token.as_context(), listen_context);
                // SAFETY: the new id is owned by nobody else; it becomes the
                // request's, on the channel it was created on.
                let id = unsafe { CmId::from_new_request(new_id, token, owner.clone()) };
                Some(ConnectRequest::new(id))
            }
            _ => None,
        };
        self.settle(&mut slot, ev, alive, deadline_ms, pool::CopyDestination::Out(null_mut()));
        Ok(CmEvent::new(slot, request))
    }

    /// The ack deadline of this channel's gets, in ms (0: ack at once).
    #[inline(always)]
    fn deadline_ms(&self) -> u64 {
        match self.ack_deadline {
            Some(d) => d.as_millis().min(u64::MAX as u128) as u64,
            None => pool::ack_deadline_ms(),
        }
    }

    /// Storage, a unit of the limit and (with a deadline) the deadline
    /// thread for one get: made sure of before librdmacm is asked, so a
    /// failure here leaves the event in the kernel. Returns the slot and
    /// the get's ack deadline in ms (read once, here: the thread is there
    /// for the deadline the get will use).
    #[inline(always)]
    fn reserve<const COUNT: bool>(&self) -> Result<(pool::SlotBox, u64)> {
        let deadline_ms = self.deadline_ms();
        if deadline_ms != 0 {
            pool::ensure_deadline_thread()?;
        }
        let unit = pool::LimitUnit::take::<COUNT>()?;
        let mut slot = pool::take()?;
        slot.keep_unit(unit);
        Ok((slot, deadline_ms))
    }

    /// The limit, a slot, one `rdma_get_cm_event`, the copy: the slot,
    /// librdmacm's original, not acked yet (see [`ChannelRef::settle`]),
    /// the copies alive now and the get's ack deadline.
    #[inline]
    fn take_event<const COUNT: bool>(&self) -> Result<(pool::SlotBox, *mut rdma_cm_event, u64, u64)> {
        let (mut slot, deadline_ms) = self.reserve::<COUNT>()?;
        let mut ev = null_mut();
        loop {
            // SAFETY: raw is a live channel; ev receives an event pointer.
            if unsafe { sys::get_cm_event(self.raw.as_ptr(), &mut ev) } == 0 {
                break;
            }
            let err = Error::last("rdma_get_cm_event");
            if err.errno() != libc::EINTR || !self.retry_eintr {
                return Err(err);
            }
        }
        // SAFETY: ev is a fresh, unacked librdmacm event: ids live, private
        // data readable in its own buffer, as copy_raw requires.
        let alive = unsafe { copy_raw(ev, &mut slot) };
        Ok((slot, ev, alive, deadline_ms))
    }

    /// The original `ev` of the copy in `slot` (fresh from
    /// [`ChannelRef::take_event`], un-acked, nothing read from it any more):
    /// acked at once (`deadline_ms` 0), or held by the slot until the copy
    /// is freed or `deadline_ms` passes (marked as librdmacm's own as
    /// `destination` says: see [`ChannelRef::get_raw_cancellable`]). Then
    /// the get path's
    /// log lines (the trace of the copy, the "many copies held" warning for
    /// `alive` copies).
    #[inline]
    fn settle(
        &self,
        slot: &mut pool::SlotBox,
        ev: *mut rdma_cm_event,
        alive: u64,
        deadline_ms: u64,
        destination: pool::CopyDestination,
    ) {
        if deadline_ms == 0 {
            // SAFETY: ev came from rdma_get_cm_event and is acked exactly
            // once; nothing reads it afterwards (the copy is complete).
            unsafe { sys::ack_cm_event(ev) };
        } else {
            // SAFETY: as above; from now on the slot acks it, once.
            unsafe { slot.hold_original(ev, deadline_ms, destination) };
        }
        // After the ack or the hold: a log callback that waits on the id
        // (rdma_destroy_id) is released by the free or the deadline.
        if log::log_enabled!(target: "rdmasafe", log::Level::Trace) {
            // Whatever log backend the app has may write (a cancellation
            // point), and a get's callers may be cancelled.
            let _no_cancel = sys::cancel::CancelDisabled::new();
            log::trace!(target: "rdmasafe", "copied CM event {} status {}", EventType(slot.raw().event), slot.raw().status);
        }
        pool::warn_if_many_held(alive);
    }

    /// [`ChannelRef::get`] (`wait` `None`: as the fd's mode, one get) or
    /// [`ChannelRef::get_wait`], for a C caller: the copy is handed out at
    /// once as the `struct rdma_cm_event *` that [`CmEvent::free_raw`] (or
    /// [`CmEvent::from_raw`]) takes back; and for a thread that may be
    /// cancelled (`pthread_cancel`) while it waits, as one waiting in
    /// librdmacm's `rdma_get_cm_event` may: the C API's get calls. The waits
    /// (poll(), librdmacm's get) are cancellation points here; a
    /// cancellation acted on in one unwinds this frame into the caller's and
    /// leaves nothing taken (the slot reserved for the get is given back by
    /// a cleanup handler; an event not yet read stays in the kernel).
    /// Panics are caught here (EIO) and never unwind.
    ///
    /// `destination` is where the caller puts the copy, as far as it knows
    /// ([`super::CopyDestination`]): an LD_PRELOAD, which makes librdmacm's
    /// own gets copies, passes its `event` out-pointer (librdmacm's
    /// synchronous calls pass `&id->event`), or `Librdmacm` inside
    /// `rdma_get_request`; such a copy held past the ack deadline is acked
    /// with a debug or info line, not warned of as a program's late free.
    /// Known at the hold, before the deadline thread can see the original:
    /// it also covers a getter preempted before it stores the copy (a 1 ms
    /// deadline under load warned of the ESTABLISHED that `rdma_accept`
    /// keeps, when that was looked up in `id->event` at the deadline). The
    /// drop-in `rdmasafe_get_event` passes `Out(NULL)`: librdmacm's own
    /// calls never reach it.
    ///
    /// # Safety
    /// The callers' frames up to the C boundary hold nothing with a
    /// destructor and catch nothing, and the exported function is
    /// `extern "C-unwind"` ([`sys::cancel`]).
    #[inline]
    pub unsafe fn get_raw_cancellable(
        &self,
        wait: Option<Wait>,
        destination: pool::CopyDestination,
    ) -> Result<*mut rdma_cm_event> {
        match wait {
            // The drop-in get: one get as the fd's mode makes it.
            // SAFETY: the caller's contract, passed on.
            None => unsafe { self.get_once_cancellable(destination) },
            // SAFETY: as above.
            Some(wait) => unsafe { self.get_waiting_cancellable(wait, destination) },
        }
    }

    /// [`ChannelRef::get_raw_cancellable`] with a wait: poll() first on an
    /// fd of unknown mode, unless the wait is forever.
    ///
    /// # Safety
    /// As for [`ChannelRef::get_raw_cancellable`].
    #[inline(never)]
    unsafe fn get_waiting_cancellable(
        &self,
        wait: Wait,
        destination: pool::CopyDestination,
    ) -> Result<*mut rdma_cm_event> {
        let poll = |left: Wait| {
            let ms = left.poll_ms();
            // SAFETY: this frame and wait_and_get's hold plain values only
            // (the caller's contract covers the frames above).
            match unsafe { sys::cancel::poll_readable(self.fd(), ms) } {
                r if r > 0 => Ok(true),
                0 => Ok(false),
                _ => Err(Error::new("poll", sys::errno())),
            }
        };
        // SAFETY: the caller's contract, passed on.
        self.wait_and_get(wait, poll, || unsafe { self.get_once_cancellable(destination) })
    }

    /// One get of [`ChannelRef::get_raw_cancellable`]: the slot as a plain
    /// value across librdmacm's call, given back if the thread is
    /// cancelled inside it.
    ///
    /// # Safety
    /// As for [`ChannelRef::get_raw_cancellable`].
    #[inline(always)]
    unsafe fn get_once_cancellable(&self, destination: pool::CopyDestination) -> Result<*mut rdma_cm_event> {
        /// The cleanup handler: `arg` is the `PendingGet` in the frame
        /// being unwound, never used again by that frame.
        unsafe extern "C" fn give_back(arg: *mut std::os::raw::c_void) {
            // SAFETY: registered with a pointer to the frame's PendingGet,
            // which the unwind ends without another use (moved out here).
            let pending = unsafe { std::ptr::read(arg.cast::<pool::PendingGet>()) };
            // Never unwind into glibc's unwinder: a panic here is a bug,
            // and the slot then leaks.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pending.abandon()));
        }
        let (pending, deadline_ms) = no_panic(|| self.reserve::<true>().map(|(s, d)| (s.into_pending(), d)))?;
        let mut ev = null_mut();
        // SAFETY: raw is a live channel, ev receives the event; give_back
        // gets the address of `pending`, which lives in this frame until
        // the call returns; the frames hold plain values (the caller's
        // contract).
        let rc = unsafe {
            sys::cancel::get_cm_event_with_cleanup(
                self.raw.as_ptr(),
                &mut ev,
                give_back,
                (&pending as *const pool::PendingGet).cast_mut().cast(),
            )
        };
        let err = (rc != 0).then(|| Error::last("rdma_get_cm_event"));
        no_panic(move || {
            let mut slot = pending.into_slot();
            if let Some(err) = err {
                return Err(err);
            }
            // SAFETY: ev is a fresh, unacked librdmacm event (as in
            // take_event).
            let alive = unsafe { copy_raw(ev, &mut slot) };
            self.settle(&mut slot, ev, alive, deadline_ms, destination);
            Ok(slot.into_c())
        })
    }

    /// Takes up to `max` events that are ready without waiting, appending
    /// them to `out`: the rest of a batch after its first event. Returns
    /// how many; stops at the first failure (the next get reports it). At
    /// the [`crate::cm::set_limit`] bound it stops without counting a
    /// refused get (the batch's first get is the one that counts), so
    /// call it after a get, not instead of one.
    pub fn get_more(&self, out: &mut Vec<CmEvent>, max: usize) -> usize {
        self.more_with(out, max, None)
    }

    fn get_with(&self, wait: Wait, owner: Option<&Arc<ChannelInner>>) -> Result<CmEvent> {
        let poll = |left: Wait| {
            match owner {
                // An owned channel: an id migrated in wakes the wait too.
                Some(o) => o.poll(-1, left, self.retry_eintr).map(|[ready, _]| ready),
                None => sys::poll_readable_ex([self.fd()], left, self.retry_eintr).map(|[ready]| ready),
            }
            .map_err(|e| Error::new("poll", e.raw_os_error().unwrap_or(libc::EIO)))
        };
        self.wait_and_get(wait, poll, || self.fetch(owner))
    }

    /// The wait of the get calls: on an fd of unknown mode a get that must
    /// not block polls first (`poll(left)`, `left` what is left of `wait`:
    /// `Ok(false)` when nothing came); on a blocking wait it simply gets,
    /// as `rdma_get_cm_event` would. A get that finds nothing (EAGAIN on a
    /// non-blocking fd) polls and tries again, until `wait` runs out. Holds
    /// plain values only across `poll` and `get` (the cancellable get runs
    /// through here). A get already at the [`crate::cm::set_limit`] bound
    /// fails with ENOBUFS before it polls, as it does before it gets: it
    /// does not wait to be refused (a get that reaches the bound only
    /// while it waits, through other gets, is refused as its event comes).
    #[inline(always)]
    fn wait_and_get<T>(
        &self,
        wait: Wait,
        mut poll: impl FnMut(Wait) -> Result<bool>,
        mut get: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        let deadline = match wait {
            Wait::For(d) => Some(sys::deadline_after(Instant::now(), d)),
            _ => None,
        };
        let mut poll_first = !self.nonblocking && wait != Wait::Forever;
        if poll_first {
            pool::LimitUnit::check()?;
        }
        loop {
            if poll_first {
                let left = match deadline {
                    Some(dl) => Wait::For(dl.saturating_duration_since(Instant::now())),
                    None => wait,
                };
                match poll(left) {
                    Ok(true) => {}
                    Ok(false) => {
                        let errno = if wait == Wait::None { libc::EAGAIN } else { libc::ETIMEDOUT };
                        return Err(Error::new("rdma_get_cm_event", errno));
                    }
                    Err(e) if e.errno() == libc::EINTR && self.retry_eintr => continue,
                    Err(e) => return Err(e),
                }
            }
            match get() {
                Err(e) if e.is_would_block() && wait != Wait::None => poll_first = true,
                Err(e) if e.errno() == libc::EINTR && self.retry_eintr => {}
                other => return other,
            }
        }
    }

    fn batch_with(
        &self,
        out: &mut Vec<CmEvent>,
        max: usize,
        wait: Wait,
        owner: Option<&Arc<ChannelInner>>,
    ) -> Result<usize> {
        if max == 0 {
            return Err(Error::new("rdmasafe_get_events", libc::EINVAL));
        }
        out.push(self.get_with(wait, owner)?);
        Ok(1 + self.more_with(out, max - 1, owner))
    }

    fn more_with(&self, out: &mut Vec<CmEvent>, max: usize, owner: Option<&Arc<ChannelInner>>) -> usize {
        let mut n = 0;
        while n < max {
            if !self.nonblocking {
                match sys::poll_readable([self.fd()], Wait::None) {
                    Ok([true]) => {}
                    _ => break,
                }
            }
            // The bound reached stops the batch without failing a get: not
            // counted as a refusal.
            match self.fetch_counting::<false>(owner) {
                Ok(ev) => {
                    out.push(ev);
                    n += 1;
                }
                // Nothing more ready (or a failure after the first event,
                // which the next call will report): return what we have.
                Err(_) => break,
            }
        }
        n
    }
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventChannel(fd {})", self.inner.fd())
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<EventChannel>();
    is::<ChannelRef<'static>>();
    let _ = Duration::ZERO;
}

/// `f()`, with a panic turned into an EIO error instead of an unwind (for
/// the frames of [`ChannelRef::get_raw_cancellable`], which must not
/// unwind but for a cancellation).
#[inline(always)]
fn no_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        // The log line must neither unwind (a backend that panics) nor be
        // cancelled.
        let _ = std::panic::catch_unwind(|| {
            let _no_cancel = sys::cancel::CancelDisabled::new();
            log::error!(target: "rdmasafe", "internal panic caught in a CM get");
        });
        Err(Error::new("rdmasafe: internal panic", libc::EIO))
    })
}
