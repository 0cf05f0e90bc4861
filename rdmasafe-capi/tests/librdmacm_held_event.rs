//! A copy that librdmacm itself keeps as a synchronous id's current event
//! (`id->event`: `rdma_create_ep` ids and rsockets, whose own
//! `rdma_get_cm_event` the preload makes a copy) is acked at the ack
//! deadline without the "held past its ack deadline" warning: librdmacm
//! frees it itself before it destroys the id, so no app is late. (rstream
//! under the preload warned on every connection longer than the deadline.)
//! An app's copy held past the deadline is still warned of. A
//! CONNECT_REQUEST's id is never looked at: librdmacm charges a request to
//! the listen id, so the app may destroy the new id while it holds the
//! copy (the reaper read the freed id, valgrind in the `leaks` fault case).
//! librdmacm's two calls are replaced (`set_cm_event_calls`) by a stand-in.

mod standin;

use std::collections::HashSet;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_set_log_callback, rdmasafe_set_log_level};
use rdmasafe_core::cm::{ChannelRef, CopyDestination, EventType, SyntheticEvent};
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_cm_id, rdma_event_channel, CmEventCalls};
use standin::{channel, ready, take_ready};

/// The id the stand-in's next event is of.
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
/// The type of the stand-in's next event.
static NEXT_TYPE: AtomicU32 = AtomicU32::new(0);
static ACKED: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
/// The deadline's lines: (level, message).
static LINES: Mutex<Vec<(c_int, String)>> = Mutex::new(Vec::new());
/// A watchdog, not a timing: far beyond the 50 ms deadline.
const WATCHDOG: Duration = Duration::from_secs(30);

unsafe extern "C-unwind" fn fake_get(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: ch is the test's channel.
    if !unsafe { take_ready(ch) } {
        return -1;
    }
    let mut e = SyntheticEvent::zeroed();
    e.event.id = NEXT_ID.load(SeqCst) as *mut rdma_cm_id;
    e.event.event = NEXT_TYPE.load(SeqCst);
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = Box::into_raw(e).cast() };
    0
}

unsafe extern "C" fn fake_ack(ev: *mut rdma_cm_event) -> c_int {
    ACKED.lock().unwrap().get_or_insert_with(HashSet::new).insert(ev as usize);
    0
}

unsafe extern "C" fn log_cb(_ctx: *mut c_void, level: c_int, msg: *const c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    if msg.contains("ack deadline") {
        LINES.lock().unwrap().push((level, msg));
    }
}

/// Who keeps a copy, and how.
#[derive(Clone, Copy, PartialEq)]
enum Keeper {
    /// The app, in a variable of its own.
    App,
    /// librdmacm, as `ucma_complete` does: the get's destination is
    /// `&id->event` (what an LD_PRELOAD's get passes to
    /// `get_raw_cancellable`), stored when the get returns.
    Librdmacm,
    /// As `Librdmacm`, but the getter is slow to return (preempted under
    /// load): the deadline passes before the copy lands in `id->event`.
    LibrdmacmLate,
    /// librdmacm inside `rdma_get_request`, into a variable of its own
    /// (the preload says `CopyDestination::Librdmacm` there).
    GetRequest,
}

/// A copy of an event of `id`, kept until the deadline's line about it.
fn held_past_the_deadline(
    ch: &mut rdma_event_channel,
    w: c_int,
    id: &mut rdma_cm_id,
    keeper: Keeper,
) -> (c_int, String) {
    let before = LINES.lock().unwrap().len();
    NEXT_ID.store(id as *mut rdma_cm_id as usize, SeqCst);
    ready(w);
    let mut ev = null_mut();
    let dest = match keeper {
        Keeper::App => CopyDestination::Out(&mut ev),
        Keeper::Librdmacm | Keeper::LibrdmacmLate => CopyDestination::Out(&mut id.event),
        Keeper::GetRequest => CopyDestination::Librdmacm,
    };
    // As the preload's get: the C get's one call, with its destination.
    // SAFETY: a live stand-in channel for the call; no thread cancels this
    // one (the frames' contract is about cancellation).
    ev = unsafe { ChannelRef::from_raw(NonNull::from(&mut *ch)).get_raw_cancellable(None, dest) }.expect("the get");
    if keeper == Keeper::Librdmacm {
        id.event = ev; // as librdmacm's ucma_complete keeps it
    }
    let end = Instant::now() + WATCHDOG;
    while LINES.lock().unwrap().len() == before {
        assert!(Instant::now() < end, "no deadline line");
        std::thread::sleep(Duration::from_millis(5));
    }
    if keeper == Keeper::LibrdmacmLate {
        id.event = ev; // only now: the deadline's line came first
    }
    id.event = null_mut();
    // SAFETY: the copy got above, freed once.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    LINES.lock().unwrap()[before].clone()
}

#[test]
fn librdmacms_own_held_event_is_no_late_app() {
    // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for
    // zeroed events of zeroed ids, from any thread.
    unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
        .expect("first CM use of this process");
    assert!(rdmasafe_cm_set_ack_deadline(50) >= 0);
    let (mut ch, w) = channel();
    assert_eq!(rdmasafe_set_log_callback(Some(log_cb), null_mut()), 0);
    assert_eq!(rdmasafe_set_log_level(4), 0);
    // SAFETY: an all-zero id is a valid value of the C struct.
    let mut id: Box<rdma_cm_id> = Box::new(unsafe { std::mem::zeroed() });
    let (level, line) = held_past_the_deadline(&mut ch, w, &mut id, Keeper::Librdmacm);
    assert_eq!(level, 4, "librdmacm's own held event: a debug line, not a warning: {line}");
    assert!(line.contains("synchronous id"), "{line}");
    // Known by the get's destination, at the hold: also when the deadline
    // passes before the getter stores the copy (a 1 ms deadline under load
    // warned of rstream's ESTABLISHED, kept by rdma_accept).
    let (level, line) = held_past_the_deadline(&mut ch, w, &mut id, Keeper::LibrdmacmLate);
    assert_eq!(level, 4, "librdmacm's own event, deadline before the store: a debug line: {line}");
    assert!(line.contains("synchronous id"), "{line}");
    let (level, line) = held_past_the_deadline(&mut ch, w, &mut id, Keeper::App);
    assert_eq!(level, 2, "an app's copy held past the deadline is warned of: {line}");
    assert!(line.contains("was held past its ack deadline"), "{line}");
    // A request kept as its new id's current event (as rdma_get_request
    // does) is still not looked up through that id: it may be destroyed.
    NEXT_TYPE.store(EventType::CONNECT_REQUEST.0, SeqCst);
    let (_, line) = held_past_the_deadline(&mut ch, w, &mut id, Keeper::Librdmacm);
    assert!(line.contains("was held past its ack deadline"), "a request's id is not read: {line}");
    assert!(line.contains("of the listen id no longer wait"), "{line}");
    // A request got inside rdma_get_request: librdmacm's, an info line.
    let (level, line) = held_past_the_deadline(&mut ch, w, &mut id, Keeper::GetRequest);
    assert_eq!(level, 3, "a request rdma_get_request keeps: an info line: {line}");
    assert!(line.contains("that librdmacm's rdma_get_request keeps"), "{line}");
    assert_eq!(rdmasafe_set_log_level(0), 0);
}
