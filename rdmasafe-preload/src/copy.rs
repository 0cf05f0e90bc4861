//! Copy mode (the default): `rdma_get_cm_event` is rdmasafe's copy,
//! `rdma_ack_cm_event` its free, exactly what `rdmasafe_get_event` /
//! `rdmasafe_event_free` do for a program that renamed the two calls. The
//! program (and librdmacm's own synchronous paths) only ever see copies;
//! librdmacm's original is acked when the copy is freed or when the ack
//! deadline passes (RDMASAFE_ACK_DEADLINE_MS, default 1000 ms), so
//! `rdma_destroy_id`'s barrier holds, bounded.

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use rdmasafe_core::cm::{self, ChannelRef, CmEvent, CopyDestination};
use rdmasafe_core::sys::{rdma_cm_event, rdma_event_channel};

/// Gets that returned an event (a copy).
static GOT: AtomicU64 = AtomicU64::new(0);
/// Gets that failed (librdmacm's error, EINVAL, ENOMEM, ...).
static GET_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Acks of copies (the copy freed).
static ACKED: AtomicU64 = AtomicU64::new(0);
/// Acks of a pointer that is no live copy (refused with EINVAL).
static NOT_COPIES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread is inside librdmacm's `rdma_get_request` (see
    /// [`in_get_request`]). A `Cell<bool>`: nothing to drop.
    static IN_GET_REQUEST: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Says whether this thread is inside librdmacm's `rdma_get_request` from
/// now on (returns the previous setting: restore it after): its gets there
/// are librdmacm's own ([`CopyDestination::Librdmacm`]).
pub(crate) fn in_get_request(on: bool) -> bool {
    IN_GET_REQUEST.replace(on)
}

/// `rdma_get_cm_event` in copy mode: `Ok(0)` with `*event` set to a copy,
/// or `Err(errno)` with `*event` untouched.
///
/// # Safety
/// As `rdma_get_cm_event`: `channel` NULL or a live event channel, `event`
/// NULL or writable.
pub(crate) unsafe fn get(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> Result<c_int, c_int> {
    let (Some(raw), false) = (NonNull::new(channel), event.is_null()) else {
        GET_ERRORS.fetch_add(1, Relaxed);
        return Err(libc::EINVAL);
    };
    // SAFETY: the caller passes a live channel for the duration of the
    // call, as rdma_get_cm_event requires. rdmasafe never changes its mode.
    let ch = unsafe { ChannelRef::from_raw(raw) };
    // Where the copy goes: inside rdma_get_request librdmacm keeps it
    // itself; otherwise `event`, which librdmacm's synchronous calls point
    // at the id's own `event` field (either way marked at the hold as
    // librdmacm's, so the deadline's line is not the warning for a
    // program's late free).
    let destination = if IN_GET_REQUEST.get() { CopyDestination::Librdmacm } else { CopyDestination::Out(event) };
    // SAFETY: the frames up to the interposer ("C-unwind") hold plain
    // values: a cancellation in the wait unwinds through them.
    match unsafe { ch.get_raw_cancellable(None, destination) } {
        Ok(ev) => {
            GOT.fetch_add(1, Relaxed);
            // SAFETY: event checked non-NULL; writable (caller's contract).
            unsafe { *event = ev };
            Ok(0)
        }
        Err(e) => {
            GET_ERRORS.fetch_add(1, Relaxed);
            Err(e.errno())
        }
    }
}

/// `rdma_ack_cm_event` in copy mode: frees a copy (its original is acked
/// then, if the deadline has not acked it already). NULL is EINVAL, as
/// with librdmacm; a pointer that is no live copy is EINVAL and logged
/// (librdmacm would free memory it does not own).
pub(crate) fn ack(event: *mut rdma_cm_event) -> Result<c_int, c_int> {
    if event.is_null() {
        return Err(libc::EINVAL);
    }
    match CmEvent::from_raw(event) {
        Some(copy) => {
            counted_drop(&ACKED, copy);
            Ok(0)
        }
        None => {
            NOT_COPIES.fetch_add(1, Relaxed);
            log::error!(
                target: "rdmasafe",
                "preload: rdma_ack_cm_event({event:p}): not an event rdma_get_cm_event handed out (acked \
                 already?): refused with EINVAL, nothing freed"
            );
            Err(libc::EINVAL)
        }
    }
}

/// Counts `what` in `counter`, then drops it. A copy's drop acks its held
/// original last, and that ack may let a `rdma_destroy_id` in another
/// thread return and the program exit at once (rping's main does): counted
/// after the drop, the exit line could miss the ack that let it run
/// (`freed=3 acks=2`, seen once under load).
fn counted_drop<T>(counter: &AtomicU64, what: T) {
    counter.fetch_add(1, Relaxed);
    drop(what);
}

/// The line logged at exit (info level): what went through the preload.
pub(crate) fn exit_line() -> String {
    let c = cm::counters();
    // Originals acked at once (deadline 0) are not deferred ones.
    let originals_acked = c.copied.saturating_sub(c.acks_deferred) + c.acked_at_free + c.acked_at_deadline;
    format!(
        "preload exit [{}]: mode=copy gets={} copied={} freed={} outstanding={} originals_acked={} \
         acked_at_free={} acked_at_deadline={} acks={} not_copies={} get_errors={} ack_deadline_ms={}",
        crate::out::who(),
        GOT.load(Relaxed),
        c.copied,
        c.freed,
        c.outstanding,
        originals_acked,
        c.acked_at_free,
        c.acked_at_deadline,
        ACKED.load(Relaxed),
        NOT_COPIES.load(Relaxed),
        GET_ERRORS.load(Relaxed),
        cm::ack_deadline().as_millis(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads the counter when dropped, as the exit line would if the
    /// program exited from the thread a held original's ack woke.
    struct SeesCount<'a>(&'a AtomicU64, &'a AtomicU64);

    impl Drop for SeesCount<'_> {
        fn drop(&mut self) {
            self.1.store(self.0.load(Relaxed), Relaxed);
        }
    }

    #[test]
    fn an_ack_is_counted_before_the_copy_goes() {
        let (counter, seen) = (AtomicU64::new(2), AtomicU64::new(0));
        counted_drop(&counter, SeesCount(&counter, &seen));
        assert_eq!(seen.load(Relaxed), 3, "the drop (which acks the original last) saw the ack uncounted");
    }
}
