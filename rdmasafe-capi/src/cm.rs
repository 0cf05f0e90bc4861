//! Drop-in CM event calls: `rdmasafe_get_event` / `rdmasafe_event_free`
//! replace `rdma_get_cm_event` / `rdma_ack_cm_event`; and the settings,
//! accessors and counters that go with them.

use std::os::raw::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::time::Duration;

use rdmasafe_core::cm::{self, ChannelRef, CmEvent, CopyDestination, EventType};
use rdmasafe_core::sys::{rdma_cm_event, rdma_event_channel};
use rdmasafe_core::Wait;

use crate::{fail_errno, guard, guard_errno};

pub(crate) fn hand_out(ev: CmEvent) -> *mut rdma_cm_event {
    ev.into_raw()
}

fn channel<'a>(channel: *mut rdma_event_channel, probe: bool) -> Option<ChannelRef<'a>> {
    let raw = NonNull::new(channel)?;
    // SAFETY: the C caller promises the channel is a live
    // rdma_create_event_channel() result for the duration of the call.
    Some(unsafe {
        if probe {
            ChannelRef::from_raw_probed(raw)
        } else {
            ChannelRef::from_raw(raw)
        }
    })
}

/// Timeouts: -1 waits forever, 0 does not wait, > 0 waits that many ms.
fn wait_of(timeout_ms: c_int) -> Option<Wait> {
    (timeout_ms >= -1).then(|| Wait::from_millis(timeout_ms as i64))
}

/// Gets the next CM event of `channel`, like `rdma_get_cm_event`, but
/// returns rdmasafe's own copy, in storage rdmasafe owns:
/// `param.conn.private_data` / `param.ud.private_data` point into the copy
/// and stay valid until `rdmasafe_event_free(*event)`, whatever happens to
/// the id. Every other byte of `param` is librdmacm's, passed through (for
/// MULTICAST_JOIN / MULTICAST_ERROR `param.ud.private_data` is the context
/// pointer given to `rdma_join_multicast`; for RDMA_CM_EVENT_USER it is
/// `param.arg`). Bytes of the private data buffer past `private_data_len`
/// read 0. The received `private_data_len` is the transport's padded
/// maximum (56 on a RoCE/IB connect request, 196 on ESTABLISHED), not what
/// the peer sent: carry your own length inside the data.
///
/// The barrier, kept and bounded: librdmacm's own event stays un-acked
/// until `rdmasafe_event_free` of the copy or until the ack deadline passes
/// (`rdmasafe_cm_set_ack_deadline`, default 1000 ms), whichever comes
/// first. So, exactly as with librdmacm, `rdma_destroy_id`,
/// `rdma_migrate_id` and `rdma_leave_multicast` wait until a thread that
/// still handles an event of the id has freed it, and a program that
/// destroys an id while another thread finishes handling its event keeps
/// working after the rename. Unlike librdmacm, a copy that is held (in a
/// queue, by a slow worker, forgotten) blocks them only a little longer
/// than the deadline (the ack thread's scans: see
/// `rdmasafe_cm_set_ack_deadline`; by default about 1.25 s at most); then
/// its original is acked (logged: the first time in the process at
/// warn level, later ones at debug level; `acked_at_deadline` of
/// `rdmasafe_cm_get_counters` counts them all), and the copy stays valid.
///
/// Ids: `ev->id` and `ev->listen_id` are the application's ids, as with
/// librdmacm: a CONNECT_REQUEST's new id must still be accepted, or
/// rejected and destroyed, by the app. They may be dereferenced while the
/// copy is held and its original is un-acked (the id cannot be destroyed
/// before), i.e. until the ack deadline; after it, only while the app knows
/// the id is alive. Except a CONNECT_REQUEST's `ev->id`, the new id:
/// librdmacm charges the request to the listening id, whose destroy is the
/// one that waits (`ev->listen_id` is protected as above), so the new id
/// can be rejected and destroyed by any thread while the copy is held, and
/// is only alive while the app knows it is. To route a copy that outlives that (a queue, a
/// worker), use the ids' contexts captured at copy time:
/// `rdmasafe_event_get_contexts`.
///
/// Never pass the copy to `rdma_ack_cm_event`: librdmacm would free memory
/// it does not own. Free it with `rdmasafe_event_free`.
///
/// Blocks like `rdma_get_cm_event` does on this channel: until an event
/// arrives on a blocking fd; on an fd with O_NONBLOCK it fails with EAGAIN
/// when no event is ready. The channel's mode is never changed.
/// Thread-safe: several threads may get from one channel.
/// A cancellation point, as `rdma_get_cm_event` is (as are the other two
/// get calls): a thread cancelled while it waits leaves by the
/// cancellation, and the event stays in the kernel (see the header's
/// conventions).
/// Ids created without a channel (`rdma_create_ep` synchronous ids) are
/// librdmacm's own business and never seen here.
///
/// Returns 0, or -1 with errno: EINVAL (`channel` or `event` NULL), EAGAIN
/// (non-blocking fd, nothing ready), EINTR (a signal interrupted the wait),
/// ENOBUFS (`rdmasafe_cm_set_limit` copies are held: the event stays in the
/// kernel), ENOMEM (no storage for the copy, or, with an ack deadline, the
/// thread that keeps the deadlines could not be started: the event stays
/// in the kernel either way), or the error of `rdma_get_cm_event`. errno is
/// left untouched on success (librdmacm's own `rdma_get_cm_event` may leave
/// a value from its internal calls there; rdmasafe restores the caller's).
/// `*event` is left untouched on failure.
///
/// # Safety
/// `channel` must be NULL or a live channel from `rdma_create_event_channel`; `event` NULL or writable.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdmasafe_get_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    // SAFETY: the caller's contract; this frame is one get_first needs.
    unsafe { get_first(self::channel(channel, false), event, None) }
}

/// The first (or only) event of the three get calls, which are
/// cancellation points as `rdma_get_cm_event` is: a thread cancelled while
/// it waits (`pthread_cancel`) unwinds from the wait through the exported
/// function into the caller, taking nothing with it (the event stays in the
/// kernel). So the exports are `extern "C-unwind"` and, like this function,
/// hold only plain values and catch nothing across the wait
/// (`rdmasafe_core::sys::cancel`); the panic boundary is inside
/// `get_raw_cancellable`. The -1/errno convention as `guard_errno`'s.
///
/// # Safety
/// `event` NULL or writable; the caller's frame is an `extern "C-unwind"`
/// export holding plain values only.
#[inline(always)]
unsafe fn get_first(ch: Option<ChannelRef<'_>>, event: *mut *mut rdma_cm_event, wait: Option<Wait>) -> c_int {
    crate::log::ensure_installed();
    let errno = rdmasafe_core::sys::errno_slot();
    // SAFETY: the calling thread's own errno.
    let saved = unsafe { *errno };
    let (Some(ch), false) = (ch, event.is_null()) else {
        return fail_errno(libc::EINVAL);
    };
    // SAFETY: the frames up to the export hold plain values (contract).
    // No destination: librdmacm's own calls never come here.
    match unsafe { ch.get_raw_cancellable(wait, CopyDestination::Out(std::ptr::null_mut())) } {
        Ok(ev) => {
            // SAFETY: event checked non-NULL; errno is this thread's.
            unsafe {
                *event = ev;
                *errno = saved;
            }
            0
        }
        Err(e) => fail_errno(e.errno()),
    }
}

/// Like `rdmasafe_get_event`, waiting at most `timeout_ms` milliseconds
/// (-1: forever, 0: do not wait). Waits with poll() on the channel fd; the
/// fd's blocking mode is never changed. With several threads getting from
/// one blocking-mode channel, a thread that saw an event another thread
/// took then blocks: set O_NONBLOCK on channels shared between threads.
///
/// On a blocking-mode fd the timeout bounds the wait for the fd to become
/// readable; librdmacm may then consume an internal event (e.g. one for an
/// id it is tearing down) and block in its read. For strict timeouts set
/// O_NONBLOCK on the channel's fd. Signals: with `timeout_ms` -1 on a
/// blocking fd the wait is `rdma_get_cm_event`'s own, which a signal
/// handler installed without SA_RESTART ends with EINTR, and one with
/// SA_RESTART restarts. Every other wait (another timeout, or an
/// O_NONBLOCK fd) is a poll(), which the kernel never restarts
/// (signal(7)): any signal whose handler runs ends it with EINTR,
/// SA_RESTART or not. The same for `rdmasafe_get_events`. An id moved to the channel with
/// `rdma_migrate_id` brings its queued events without waking anyone (the
/// kernel's doing, as with librdmacm): a get already waiting here (or a
/// poll() or epoll of the app's on the fd) sleeps on until another event
/// comes or its timeout ends (it finds them then), and an edge-triggered
/// epoll (EPOLLET) gets no edge for them. A get or poll made after the
/// migrate sees them: wake the thread that serves the new channel.
///
/// Returns 0, or -1 with errno: EINVAL (NULL argument, `timeout_ms < -1`),
/// EAGAIN (`timeout_ms == 0`, nothing ready), ETIMEDOUT (nothing within
/// `timeout_ms`), EINTR (a signal), ENOBUFS (`rdmasafe_cm_set_limit`
/// copies are held: the event stays in the kernel), ENOMEM (no storage for
/// the copy, or, with an ack deadline, the thread that keeps the deadlines
/// could not be started: the event stays in the kernel either way), or
/// the error of `rdma_get_cm_event`. errno is untouched on success.
///
/// # Safety
/// As for `rdmasafe_get_event`.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdmasafe_get_event_timeout(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
    timeout_ms: c_int,
) -> c_int {
    let Some(wait) = wait_of(timeout_ms) else {
        return fail_errno(libc::EINVAL);
    };
    // SAFETY: the caller's contract; this frame is one get_first needs.
    unsafe { get_first(self::channel(channel, false), event, Some(wait)) }
}

/// Batch get: waits like `rdmasafe_get_event_timeout` for a first event,
/// then takes up to `max - 1` more that are ready without waiting, storing
/// the copies in `events[0..n]`. Each copy is freed with
/// `rdmasafe_event_free`. On a channel whose fd has O_NONBLOCK a ready event
/// costs one system call; otherwise a poll() is added per event. On a
/// blocking-mode channel that another thread reads too, an event the poll()
/// saw may be taken by that thread first, and the get after it then blocks
/// until the next event, holding the events taken so far, with
/// cancellation deferred (it is acted on only while the first event is
/// waited for): set O_NONBLOCK on a channel that threads share.
///
/// Returns n >= 1, or -1 with errno (each about the first event; an error
/// after it ends the batch, which then returns the events taken): EINVAL
/// (NULL argument, `max < 1`, `timeout_ms < -1`), EAGAIN (`timeout_ms ==
/// 0`, nothing ready), ETIMEDOUT (nothing within `timeout_ms`), EINTR (a
/// signal), ENOBUFS (`rdmasafe_cm_set_limit` copies are held: the event
/// stays in the kernel), ENOMEM (no storage for the copy, or the thread
/// that keeps the ack deadlines could not be started: the event stays in
/// the kernel), or the error of `rdma_get_cm_event`. Nothing is stored on
/// failure; errno is untouched on success.
///
/// # Safety
/// `channel` NULL or live; `events` NULL or writable for `max` pointers.
#[no_mangle]
pub unsafe extern "C-unwind" fn rdmasafe_get_events(
    channel: *mut rdma_event_channel,
    events: *mut *mut rdma_cm_event,
    max: c_int,
    timeout_ms: c_int,
) -> c_int {
    // Scalars first: nothing is read through `channel` unless every
    // argument is valid.
    let (false, true, Some(wait)) = (events.is_null(), max >= 1, wait_of(timeout_ms)) else {
        return fail_errno(libc::EINVAL);
    };
    // The first event: the wait, cancellable. SAFETY: the caller's
    // contract (events has room for max >= 1); this frame is one
    // get_first needs.
    let ch = self::channel(channel, true);
    let r = unsafe { get_first(ch, events, Some(wait)) };
    if r != 0 || max == 1 {
        return if r == 0 { 1 } else { r };
    }
    // The rest never waits: no cancellation is acted on inside.
    let _no_cancel = rdmasafe_core::sys::cancel::CancelDisabled::new();
    let errno = rdmasafe_core::sys::errno_slot();
    // SAFETY: the calling thread's own errno.
    let saved = unsafe { *errno };
    // A panic in the rest still returns the first event (1): events[0] is
    // the caller's, and the unwind dropped (freed) what the rest had taken.
    let got = guard(
        || 0,
        || {
            let Some(ch) = ch else { return 0 };
            // A small inline buffer would need unsafe; reuse one Vec per
            // thread so steady state allocates nothing. It is taken out of
            // its cell for the call (not borrowed): a log callback that
            // calls back in here (the header allows it) gets an empty Vec
            // of its own instead of a borrow conflict.
            thread_local! {
                static BUF: std::cell::Cell<Vec<CmEvent>> = const { std::cell::Cell::new(Vec::new()) };
            }
            let mut buf = BUF.take();
            buf.clear();
            let got = ch.get_more(&mut buf, max as usize - 1);
            for (i, ev) in buf.drain(..).enumerate() {
                // SAFETY: events has room for max > got entries (caller's
                // contract), checked non-NULL; events[0] is the first event.
                unsafe { *events.add(1 + i) = hand_out(ev) };
            }
            BUF.set(buf);
            got as c_int
        },
    );
    // SAFETY: as above.
    unsafe { *errno = saved };
    1 + got
}

/// Frees a copy returned by the get calls (replaces `rdma_ack_cm_event`).
/// Does not wait for anything of the app's. If librdmacm's original was
/// still held (see `rdmasafe_get_event`), it is acked here, last, so a
/// thread waiting in `rdma_destroy_id` for it wakes after the copy is
/// gone; that ack takes librdmacm's mutex of the event's id for a moment
/// (it blocks for good only after a thread was cancelled inside
/// `rdma_destroy_id` of that id, see the header's conventions). Safe after the
/// event's id was destroyed. Thread-safe. `rdmasafe_event_free(NULL)` does
/// nothing and returns 0.
///
/// The pointer is checked before anything is read through it (address
/// arithmetic over rdmasafe's own storage, then the copy's state): a
/// pointer rdmasafe did not hand out, or one already freed, fails with
/// EINVAL, nothing is touched, and an error-level log line says so (a
/// librdmacm event must go to `rdma_ack_cm_event`, or its id's destroy
/// waits forever). A freed copy's storage is handed out again only after at
/// least 64 other copies were got since its free, on any thread and
/// channel (gets that fail do not count), so a stale pointer freed a
/// second time within that window is EINVAL; beyond it, it cannot be told
/// apart from the newer copy that reuses the storage. (The window gives
/// way only when the storage is exhausted: 2,097,152 copies alive, or
/// fewer under an address-space limit (RLIMIT_AS), of which the storage
/// takes a sixteenth at most. A get then reuses the oldest free copy's
/// storage rather than fail.)
///
/// Returns 0, or -1 with errno EINVAL. errno is untouched on success.
///
/// # Safety
/// None beyond C's: any pointer value is checked before use.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_event_free(event: *mut rdma_cm_event) -> c_int {
    guard_errno(|| {
        if event.is_null() {
            return Ok(0);
        }
        match CmEvent::free_raw(event) {
            true => Ok(0),
            false => {
                log::error!(
                    target: "rdmasafe",
                    "rdmasafe_event_free({event:p}): not a live rdmasafe copy (freed already, or never handed \
                     out by rdmasafe_get_event*); an event from rdma_get_cm_event must go to rdma_ack_cm_event, \
                     or rdma_destroy_id of its id waits forever"
                );
                Err(libc::EINVAL)
            }
        }
    })
}

/// What was captured from the event's ids at copy time, for routing a copy
/// without dereferencing `ev->id` (which the app may have destroyed):
/// `*context` receives `ev->id->context`, `*listen_context`
/// `ev->listen_id->context` (NULL without a listen id). For a
/// CONNECT_REQUEST both are the listener's context: librdmacm gives the
/// new id its listener's (route such a copy by the event type first, or
/// set the new id's context before its next event). Either out pointer
/// may be NULL. Thread-safe; never blocks.
///
/// Returns 0, or -EINVAL (`event` is not a live copy: nothing is written).
///
/// # Safety
/// `context` and `listen_context` NULL or writable; `event` any value.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_event_get_contexts(
    event: *const rdma_cm_event,
    context: *mut *mut c_void,
    listen_context: *mut *mut c_void,
) -> c_int {
    guard(
        || -libc::EIO,
        || {
            let Some((c, l)) = CmEvent::contexts_of_raw(event) else { return -libc::EINVAL };
            for (out, v) in [(context, c), (listen_context, l)] {
                if !out.is_null() {
                    // SAFETY: non-NULL out pointers are writable (caller).
                    unsafe { *out = v as *mut c_void };
                }
            }
            0
        },
    )
}

/// The name of a CM event type, e.g. `"RDMA_CM_EVENT_ESTABLISHED"`, like
/// `rdma_event_str`; `"RDMA_CM_EVENT_UNKNOWN"` for values it does not know.
/// Never NULL; the string is static. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_event_str(event: c_int) -> *const c_char {
    guard(
        || c"RDMA_CM_EVENT_UNKNOWN".as_ptr(),
        || {
            if event < 0 {
                return c"RDMA_CM_EVENT_UNKNOWN".as_ptr();
            }
            EventType(event as u32).c_name().as_ptr()
        },
    )
}

/// Sets how long librdmacm's original event stays un-acked after a get
/// (the destroy barrier, see `rdmasafe_get_event`): until the copy is
/// freed, at most `ms` milliseconds. A background thread acks it after
/// that: it scans the copies every quarter of the shortest deadline any get
/// of the process has used so far (1 to 250 ms; a scan visits every copy
/// slot allocated) against the kernel's coarse clock (a tick of a few ms),
/// so an original is acked at most that long after its deadline, or up to
/// 250 ms after it while the thread ends a sleep it began before a
/// deadline shorter than any before was first used (a get takes no lock
/// for it). 0 acks at once (a held copy then never
/// delays `rdma_destroy_id`, and `ev->id` may be destroyed while the copy is
/// held). With a deadline, a thread that destroys an event's id before it
/// frees the copy waits in `rdma_destroy_id` until the original is acked at
/// its deadline, as above (where
/// librdmacm would wait forever; for a CONNECT_REQUEST the listening id's
/// destroy waits, not the new id's): free first, or set 0. The deadlines are
/// kept by one thread for the process, started by the first get with a
/// deadline (a get that cannot start it fails with ENOMEM and takes
/// nothing, so no original is ever held without its deadline): a thread
/// cancelled inside
/// `rdma_destroy_id` leaves that id's mutex locked, and once the ack thread
/// blocks on it no other deadline is kept (header conventions). Applies to
/// gets from now on. The default is 1000 ms, or
/// RDMASAFE_ACK_DEADLINE_MS from the environment, read at the first get
/// unless this is called before it (a value that is no number of
/// milliseconds is then logged as a warning, and 1000 ms is used).
/// Thread-safe.
///
/// Returns the previous value in ms (>= 0), or -EINVAL for `ms < 0`.
#[no_mangle]
pub extern "C" fn rdmasafe_cm_set_ack_deadline(ms: c_int) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if ms < 0 {
                return -libc::EINVAL;
            }
            cm::set_ack_deadline(Duration::from_millis(ms as u64)).as_millis().min(c_int::MAX as u128) as c_int
        },
    )
}

/// Bounds the copies alive at once: with `max_outstanding` copies held, the
/// get calls fail with ENOBUFS *before* asking librdmacm, so the event stays
/// in the kernel until copies are freed (0: unlimited, the default). A get
/// blocked in librdmacm counts as a copy held: threads getting at once
/// never hold more than the bound between them (copies got before the
/// bound was set are counted, but not against racing gets, until they are
/// freed). A get at the bound fails at once, without waiting. A get that
/// waits in poll() (any timeout on an O_NONBLOCK channel, a timeout other
/// than -1 on a blocking one) holds no unit while it waits: when other
/// threads' gets reach the bound meanwhile (or it is lowered), it is
/// refused as its event comes, which stays in the kernel. Also,
/// whatever the limit, a warn-level log line says so when the copies held
/// pass 4096, and again at every doubling. Thread-safe.
///
/// Returns 0.
#[no_mangle]
pub extern "C" fn rdmasafe_cm_set_limit(max_outstanding: u64) -> c_int {
    guard(
        || -libc::EIO,
        || {
            cm::set_limit(max_outstanding);
            0
        },
    )
}

/// Process-wide CM copy figures. Set `size` to `sizeof` the struct before
/// the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct rdmasafe_cm_counters {
    /// In: `sizeof(struct rdmasafe_cm_counters)` as the caller's header
    /// declares it. Out: the number of bytes the library filled.
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    /// Events copied.
    pub copied: u64,
    /// Copies freed.
    pub freed: u64,
    /// Copies alive now (`copied - freed`).
    pub outstanding: u64,
    /// Storage slots ever allocated (flat in steady state).
    pub slots_allocated: u64,
    /// Most copies alive at once so far.
    pub high_water: u64,
    /// Age in ms of the oldest copy alive now (0 without any).
    pub oldest_age_ms: u64,
    /// Copies whose librdmacm original was held un-acked (the barrier).
    pub acks_deferred: u64,
    /// Of those, originals acked by `rdmasafe_event_free`.
    pub acked_at_free: u64,
    /// Of those, originals acked because the ack deadline passed first
    /// (under librdmasafe-preload.so also librdmacm's own current events
    /// of synchronous ids, `rdma_create_ep` and rsockets, which it keeps for
    /// a connection's life: harmless, not warned of).
    pub acked_at_deadline: u64,
    /// Gets refused with ENOBUFS by `rdmasafe_cm_set_limit`.
    pub refused_at_limit: u64,
}

/// Reads the CM copy counters into `*out` (set `out->size` first). Never
/// blocks; thread-safe. The oldest copy's age is found by a scan of
/// rdmasafe's storage (proportional to `slots_allocated`, the slots ever
/// allocated, which `rdmasafe_cm_reserve` raises).
///
/// Returns 0, or -EINVAL if `out` is NULL or `out->size` is not set or over
/// 4096.
///
/// # Safety
/// `out` must be NULL or writable for its stated size.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cm_get_counters(out: *mut rdmasafe_cm_counters) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if out.is_null() {
                return -libc::EINVAL;
            }
            let c = cm::counters();
            let v = rdmasafe_cm_counters {
                size: 0,
                reserved: 0,
                copied: c.copied,
                freed: c.freed,
                outstanding: c.outstanding,
                slots_allocated: c.slots_allocated,
                high_water: c.high_water,
                oldest_age_ms: c.oldest_age_ms,
                acks_deferred: c.acks_deferred,
                acked_at_free: c.acked_at_free,
                acked_at_deadline: c.acked_at_deadline,
                refused_at_limit: c.refused_at_limit,
            };
            // SAFETY: out checked non-NULL; writable for its stated size (caller).
            match unsafe { crate::abi::write_out(out, &v) } {
                Ok(()) => 0,
                Err(e) => e,
            }
        },
    )
}

/// Pre-allocates storage so that the next `n` copies allocate nothing (at
/// most 4096 are prepared; larger `n` are treated as 4096). Returns how many
/// copies can be got now without allocating (at least `n`, or 4096 for a
/// larger `n`), -EINVAL if `n < 0`, or -ENOMEM. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_cm_reserve(n: c_int) -> c_int {
    guard(
        || -libc::EIO,
        || {
            if n < 0 {
                return -libc::EINVAL;
            }
            let want = (n as usize).min(cm::FREE_LIST_CAPACITY);
            let got = cm::reserve(want);
            if got < want {
                -libc::ENOMEM
            } else {
                got.min(cm::FREE_LIST_CAPACITY) as c_int
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    use rdmasafe_core::cm::SyntheticEvent;

    fn errno() -> i32 {
        rdmasafe_core::sys::errno()
    }

    /// Serialises the tests that depend on which storage slot comes next.
    fn pool_lock() -> std::sync::MutexGuard<'static, ()> {
        static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
        L.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn synthetic() -> *mut rdma_cm_event {
        let raw = SyntheticEvent::zeroed();
        // SAFETY: a zeroed event has no pointers to follow.
        hand_out(unsafe { rdmasafe_core::cm::copy_synthetic(&raw.event) })
    }

    #[test]
    fn null_arguments_give_einval_and_touch_nothing() {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        assert_eq!(unsafe { rdmasafe_get_event(std::ptr::null_mut(), &mut ev) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        assert!(ev.is_null());
        assert_eq!(unsafe { rdmasafe_get_event_timeout(std::ptr::null_mut(), &mut ev, 0) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(unsafe { rdmasafe_get_events(std::ptr::null_mut(), &mut ev, 1, 0) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(unsafe { rdmasafe_event_free(std::ptr::null_mut()) }, 0);
        assert_eq!(unsafe { rdmasafe_cm_get_counters(std::ptr::null_mut()) }, -libc::EINVAL);
        assert_eq!(rdmasafe_cm_reserve(-1), -libc::EINVAL);
        assert_eq!(rdmasafe_cm_set_ack_deadline(-1), -libc::EINVAL);
    }

    /// librdmacm leaves errno alone on success; so must the drop-ins.
    #[test]
    fn errno_is_untouched_on_success() {
        let _g = pool_lock();
        let p = synthetic();
        rdmasafe_core::sys::set_errno(12345);
        assert_eq!(unsafe { rdmasafe_event_free(p) }, 0);
        assert_eq!(errno(), 12345, "rdmasafe_event_free success changed errno");
        rdmasafe_core::sys::set_errno(777);
        assert_eq!(unsafe { rdmasafe_event_free(std::ptr::null_mut()) }, 0);
        assert_eq!(errno(), 777, "rdmasafe_event_free(NULL) changed errno");
        assert_eq!(unsafe { rdmasafe_event_free(p) }, -1);
        assert_eq!(errno(), libc::EINVAL, "a failure sets errno");
    }

    #[test]
    fn foreign_pointer_and_double_free_are_einval() {
        let _g = pool_lock();
        // A pointer rdmasafe never handed out: rejected without a read.
        let mut foreign = [0u64; 64];
        assert_eq!(unsafe { rdmasafe_event_free(foreign.as_mut_ptr().cast()) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        // A real copy: freed once, then the second free is EINVAL, also
        // after 63 other copies were got and freed in between (the
        // quarantine keeps its storage out of circulation).
        let p = synthetic();
        assert_eq!(unsafe { rdmasafe_event_free(p) }, 0);
        let mut others = Vec::new();
        for _ in 0..63 {
            others.push(synthetic());
        }
        for o in others {
            assert_ne!(o, p, "storage reused inside the quarantine");
            assert_eq!(unsafe { rdmasafe_event_free(o) }, 0);
        }
        assert_eq!(unsafe { rdmasafe_event_free(p) }, -1, "stale double free");
        assert_eq!(errno(), libc::EINVAL);
    }

    #[test]
    fn contexts_are_read_without_the_id() {
        let _g = pool_lock();
        // SAFETY: plain C data; only the contexts are set.
        let mut id: rdma_sys::rdma_cm_id = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut listen: rdma_sys::rdma_cm_id = unsafe { std::mem::zeroed() };
        id.context = 0xc0ffee as *mut c_void;
        listen.context = 0x1157e7 as *mut c_void;
        let mut raw = SyntheticEvent::zeroed();
        raw.event.id = &mut id;
        raw.event.listen_id = &mut listen;
        // SAFETY: the ids are live for the copy.
        let p = hand_out(unsafe { rdmasafe_core::cm::copy_synthetic(&raw.event) });
        // The id changes (or dies): the copy kept what it had.
        // SAFETY: the id is the local above, still alive.
        unsafe { (*raw.event.id).context = std::ptr::null_mut() };
        let (mut c, mut l) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(unsafe { rdmasafe_event_get_contexts(p, &mut c, &mut l) }, 0);
        assert_eq!((c as usize, l as usize), (0xc0ffee, 0x1157e7));
        assert_eq!(unsafe { rdmasafe_event_get_contexts(p, std::ptr::null_mut(), &mut l) }, 0);
        assert_eq!(unsafe { rdmasafe_event_free(p) }, 0);
        c = 7 as *mut c_void;
        assert_eq!(unsafe { rdmasafe_event_get_contexts(p, &mut c, &mut l) }, -libc::EINVAL);
        assert_eq!(c as usize, 7, "nothing written for a freed copy");
    }

    /// Many threads handing out and freeing copies at once, with foreign
    /// frees mixed in: every free of a live copy succeeds once, everything
    /// else is EINVAL.
    #[test]
    fn concurrent_get_free_and_bad_frees() {
        let _g = pool_lock();
        let threads: Vec<_> = (0..8)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut bogus = [0u64; 8];
                    for i in 0..5_000u32 {
                        let mut raw = SyntheticEvent::zeroed();
                        raw.event.status = (t * 100_000 + i) as i32;
                        // SAFETY: no ids, no private data.
                        let p = hand_out(unsafe { rdmasafe_core::cm::copy_synthetic(&raw.event) });
                        // SAFETY: p is a live copy; the status is readable.
                        assert_eq!(unsafe { (*p).status }, (t * 100_000 + i) as i32);
                        // SAFETY: frees check the pointer first.
                        unsafe {
                            assert_eq!(rdmasafe_event_free(bogus.as_mut_ptr().cast()), -1);
                            assert_eq!(rdmasafe_event_free(p), 0);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn huge_reserve_is_capped_not_an_abort() {
        let _g = pool_lock();
        let n = rdmasafe_cm_reserve(c_int::MAX);
        assert_eq!(n as usize, cm::FREE_LIST_CAPACITY);
    }

    #[test]
    fn event_names_are_static_and_never_null() {
        // SAFETY: the returned strings are static and NUL-terminated.
        let s = |v| unsafe { CStr::from_ptr(rdmasafe_event_str(v)) }.to_str().unwrap();
        assert_eq!(s(9), "RDMA_CM_EVENT_ESTABLISHED");
        assert_eq!(s(-3), "RDMA_CM_EVENT_UNKNOWN");
        assert_eq!(s(12345), "RDMA_CM_EVENT_UNKNOWN");
    }

    #[test]
    fn bad_counts_and_timeouts_are_einval() {
        // A real (non-NULL) channel pointer is not needed to reject these:
        // the argument checks run before the channel is touched.
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        let fake = NonNull::<rdma_event_channel>::dangling().as_ptr();
        assert_eq!(unsafe { rdmasafe_get_events(fake, &mut ev, 0, 0) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(unsafe { rdmasafe_get_event_timeout(fake, &mut ev, -2) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(unsafe { rdmasafe_get_events(fake, std::ptr::null_mut(), 4, 0) }, -1);
        assert_eq!(errno(), libc::EINVAL);
    }
}
