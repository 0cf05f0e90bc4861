//! Drop-in CM event calls: `rdmasafe_get_event` / `rdmasafe_event_free`
//! replace `rdma_get_cm_event` / `rdma_ack_cm_event`.

use std::collections::HashSet;
use std::os::raw::{c_char, c_int};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use rdmasafe_core::cm::{self, ChannelRef, CmEvent, EventType};
use rdmasafe_core::sys::{rdma_cm_event, rdma_event_channel, Wait};

use crate::{fail_errno, guard, PtrHash};

/// Addresses of the copies handed to C and not freed yet. A free looks the
/// pointer up here before touching it, so a foreign pointer or a double free
/// is an EINVAL, never a read through a bad pointer. The set keeps its
/// capacity, so steady state allocates nothing.
fn live() -> &'static Mutex<HashSet<usize, PtrHash>> {
    static LIVE: OnceLock<Mutex<HashSet<usize, PtrHash>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(HashSet::with_capacity_and_hasher(1024, PtrHash::default())))
}

pub(crate) fn hand_out(ev: CmEvent) -> *mut rdma_cm_event {
    let p = ev.into_raw();
    live().lock().unwrap_or_else(|e| e.into_inner()).insert(p as usize);
    p
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
/// returns rdmasafe's own copy: librdmacm's event is already acked when this
/// returns, so holding the copy never blocks `rdma_destroy_id`.
///
/// `*event` receives a `struct rdma_cm_event` owned by rdmasafe. Its
/// `param.conn.private_data` / `param.ud.private_data` point into the copy
/// and stay valid until `rdmasafe_event_free(*event)` (for
/// MULTICAST_JOIN / MULTICAST_ERROR `param.ud.private_data` is the context
/// pointer given to `rdma_join_multicast`, unchanged). `id` and `listen_id`
/// are the application's ids, as with librdmacm: a CONNECT_REQUEST's new id
/// must still be accepted, or rejected and destroyed, by the app.
/// The received `private_data_len` is the transport's padded maximum (56 on
/// a RoCE/IB connect request, 196 on ESTABLISHED), not what the peer sent.
///
/// Never pass the copy to `rdma_ack_cm_event`: that is a bug (librdmacm
/// would free memory it does not own). Free it with `rdmasafe_event_free`.
///
/// Blocks like `rdma_get_cm_event` does on this channel: until an event
/// arrives on a blocking fd; on an fd with O_NONBLOCK it fails with EAGAIN
/// when no event is ready. The channel's mode is never changed.
/// Thread-safe: several threads may get from one channel.
/// Ids created without a channel (`rdma_create_ep` synchronous ids) are
/// librdmacm's own business and never seen here.
///
/// Returns 0, or -1 with errno: EINVAL (`channel` or `event` NULL), EAGAIN
/// (non-blocking fd, nothing ready), EINTR (a signal interrupted the wait),
/// or the error of `rdma_get_cm_event`.
/// `*event` is left untouched on failure.
///
/// # Safety
/// `channel` must be NULL or a live channel from `rdma_create_event_channel`; `event` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_get_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int {
    guard(fail_errno(libc::EIO), || {
        let (Some(ch), false) = (self::channel(channel, false), event.is_null()) else {
            return fail_errno(libc::EINVAL);
        };
        match ch.get() {
            Ok(ev) => {
                // SAFETY: event was checked non-NULL; the caller provides a
                // writable pointer slot.
                unsafe { *event = hand_out(ev) };
                0
            }
            Err(e) => fail_errno(e.errno()),
        }
    })
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
/// O_NONBLOCK on the channel's fd. A signal ends the wait with EINTR, as
/// with `rdma_get_cm_event`.
///
/// Returns 0, or -1 with errno: EINVAL (NULL argument, `timeout_ms < -1`),
/// EAGAIN (`timeout_ms == 0`, nothing ready), ETIMEDOUT (nothing within
/// `timeout_ms`), EINTR (a signal), or the error of `rdma_get_cm_event`.
///
/// # Safety
/// As for `rdmasafe_get_event`.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_get_event_timeout(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
    timeout_ms: c_int,
) -> c_int {
    guard(fail_errno(libc::EIO), || {
        let (Some(ch), false, Some(wait)) = (self::channel(channel, false), event.is_null(), wait_of(timeout_ms))
        else {
            return fail_errno(libc::EINVAL);
        };
        match ch.get_wait(wait) {
            Ok(ev) => {
                // SAFETY: event checked non-NULL above.
                unsafe { *event = hand_out(ev) };
                0
            }
            Err(e) => fail_errno(e.errno()),
        }
    })
}

/// Batch get: waits like `rdmasafe_get_event_timeout` for a first event,
/// then takes up to `max - 1` more that are ready without waiting, storing
/// the copies in `events[0..n]`. Each copy is freed with
/// `rdmasafe_event_free`. On a channel whose fd has O_NONBLOCK a ready event
/// costs one system call; otherwise a poll() is added per event.
///
/// Returns n >= 1, or -1 with errno: EINVAL (NULL argument, `max < 1`,
/// `timeout_ms < -1`), EAGAIN, ETIMEDOUT, or the error of
/// `rdma_get_cm_event`. Nothing is stored on failure.
///
/// # Safety
/// `channel` NULL or live; `events` NULL or writable for `max` pointers.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_get_events(
    channel: *mut rdma_event_channel,
    events: *mut *mut rdma_cm_event,
    max: c_int,
    timeout_ms: c_int,
) -> c_int {
    guard(fail_errno(libc::EIO), || {
        // Scalars first: nothing is read through `channel` unless every
        // argument is valid.
        let (false, true, Some(wait)) = (events.is_null(), max >= 1, wait_of(timeout_ms)) else {
            return fail_errno(libc::EINVAL);
        };
        let Some(ch) = self::channel(channel, true) else {
            return fail_errno(libc::EINVAL);
        };
        // A small inline buffer would need unsafe; reuse one Vec per thread
        // so steady state allocates nothing.
        thread_local! {
            static BUF: std::cell::RefCell<Vec<CmEvent>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.clear();
            match ch.get_batch(&mut buf, max as usize, wait) {
                Ok(n) => {
                    for (i, ev) in buf.drain(..).enumerate() {
                        // SAFETY: events has room for max >= n entries
                        // (caller's contract), checked non-NULL.
                        unsafe { *events.add(i) = hand_out(ev) };
                    }
                    n as c_int
                }
                Err(e) => fail_errno(e.errno()),
            }
        })
    })
}

/// Frees a copy returned by the get calls (replaces `rdma_ack_cm_event`).
/// Never blocks on librdmacm (the original event was acked long ago), so it
/// is safe after the event's id was destroyed. Thread-safe.
/// `rdmasafe_event_free(NULL)` does nothing and returns 0.
///
/// The pointer is looked up among the live copies before anything is read
/// through it: a pointer rdmasafe did not hand out, or one already freed,
/// fails with EINVAL and nothing is touched. Limit: once a freed copy's
/// storage has been handed out again by a later get, a second free of the
/// old pointer cannot be told apart from a free of the new copy.
///
/// Returns 0, or -1 with errno EINVAL.
///
/// # Safety
/// None beyond C's: any pointer value is checked before use.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_event_free(event: *mut rdma_cm_event) -> c_int {
    guard(fail_errno(libc::EIO), || {
        if event.is_null() {
            return 0;
        }
        if !live().lock().unwrap_or_else(|e| e.into_inner()).remove(&(event as usize)) {
            return fail_errno(libc::EINVAL);
        }
        // SAFETY: the pointer was in the live set, so it came from
        // CmEvent::into_raw and has not been taken back.
        drop(unsafe { CmEvent::from_raw(event) });
        0
    })
}

/// The name of a CM event type, e.g. `"RDMA_CM_EVENT_ESTABLISHED"`, like
/// `rdma_event_str`; `"RDMA_CM_EVENT_UNKNOWN"` for values it does not know.
/// Never NULL; the string is static. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_event_str(event: c_int) -> *const c_char {
    guard(c"RDMA_CM_EVENT_UNKNOWN".as_ptr(), || {
        if event < 0 {
            return c"RDMA_CM_EVENT_UNKNOWN".as_ptr();
        }
        EventType(event as u32).c_name().as_ptr()
    })
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
    /// Events copied (each acked to librdmacm at once).
    pub copied: u64,
    /// Copies freed.
    pub freed: u64,
    /// Copies alive now (`copied - freed`).
    pub outstanding: u64,
    /// Storage slots ever allocated (flat in steady state).
    pub slots_allocated: u64,
}

/// Reads the CM copy counters into `*out` (set `out->size` first). Never
/// blocks; thread-safe. Returns 0, or -EINVAL if `out` is NULL or its size
/// is not set.
///
/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_cm_get_counters(out: *mut rdmasafe_cm_counters) -> c_int {
    guard(-libc::EIO, || {
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
        };
        // SAFETY: out checked non-NULL; writable for its stated size (caller).
        match unsafe { crate::abi::write_out(out, &v) } {
            Ok(()) => 0,
            Err(e) => e,
        }
    })
}

/// Pre-allocates storage for `n` copies so the first `n` live copies
/// allocate nothing (at most 4096 are kept). Returns the number of free
/// slots held afterwards, -EINVAL if `n < 0`, or -ENOMEM. Larger `n` are
/// treated as 4096. Thread-safe.
#[no_mangle]
pub extern "C" fn rdmasafe_cm_reserve(n: c_int) -> c_int {
    guard(-libc::EIO, || {
        if n < 0 {
            return -libc::EINVAL;
        }
        // At most the pool's capacity: more would only grow the live set.
        let n = (n as usize).min(cm::FREE_LIST_CAPACITY);
        let mut set = live().lock().unwrap_or_else(|e| e.into_inner());
        let more = n.saturating_sub(set.capacity());
        if set.try_reserve(more).is_err() {
            return -libc::ENOMEM;
        }
        drop(set);
        cm::reserve(n) as c_int
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn errno() -> i32 {
        rdmasafe_core::sys::errno()
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
    }

    #[test]
    fn foreign_pointer_and_double_free_are_einval() {
        // A pointer rdmasafe never handed out: rejected without a read.
        let mut foreign = [0u64; 64];
        assert_eq!(unsafe { rdmasafe_event_free(foreign.as_mut_ptr().cast()) }, -1);
        assert_eq!(errno(), libc::EINVAL);
        // A real copy: freed once, then the second free is EINVAL. A full
        // free list (FIFO) keeps the freed slot from being handed out again
        // by other tests' threads before the second free.
        assert_eq!(rdmasafe_cm_reserve(4096), 4096);
        // SAFETY: a zeroed event has no pointers to follow.
        let raw: rdma_cm_event = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let p = hand_out(unsafe { rdmasafe_core::cm::copy_synthetic(&raw) });
        assert_eq!(unsafe { rdmasafe_event_free(p) }, 0);
        assert_eq!(unsafe { rdmasafe_event_free(p) }, -1);
        assert_eq!(errno(), libc::EINVAL);
    }

    /// Many threads handing out and freeing copies at once, with foreign
    /// and double frees mixed in: every free of a live copy succeeds once,
    /// everything else is EINVAL.
    #[test]
    fn concurrent_get_free_and_bad_frees() {
        let threads: Vec<_> = (0..8)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut bogus = [0u64; 8];
                    for i in 0..5_000u32 {
                        // SAFETY: a zeroed event has no pointers to follow.
                        let mut raw: rdma_cm_event = unsafe { std::mem::zeroed() };
                        raw.status = (t * 100_000 + i) as i32;
                        // SAFETY: as above.
                        let p = hand_out(unsafe { rdmasafe_core::cm::copy_synthetic(&raw) });
                        // SAFETY: p is a live copy; the status is readable.
                        assert_eq!(unsafe { (*p).status }, (t * 100_000 + i) as i32);
                        // SAFETY: frees go through the live-set check.
                        // (No double frees here: with other threads getting
                        // copies, a freed slot may be live again -- the
                        // documented limit; see the single-thread test.)
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
