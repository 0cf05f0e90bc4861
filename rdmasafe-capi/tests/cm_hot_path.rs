//! The drop-in CM event calls' hot path, without a kernel: librdmacm's two
//! calls are replaced (`set_cm_event_calls`) by a stand-in that hands out
//! one synthetic event laid out as librdmacm's, so the counts below are
//! rdmasafe's own. Counts, never times.
//!
//! Also the harness for a local callgrind look at rdmasafe's own share of
//! a get + free (no RDMA device needed):
//!
//! ```text
//! valgrind --tool=callgrind --toggle-collect=rdmasafe_get_event \
//!     --toggle-collect=rdmasafe_event_free target/debug/deps/cm_hot_path-* \
//!     --test-threads=1 hot_path_loop
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::os::raw::c_int;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Mutex;

use rdmasafe::{rdmasafe_cm_set_ack_deadline, rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::cm::SyntheticEvent;
use rdmasafe_core::sys::{self, rdma_cm_event, rdma_event_channel, CmEventCalls};

/// Counts allocations per thread: the test's own, not those libtest's
/// threads make meanwhile (reporting another test's end, say).
struct Counting;
thread_local!(static ALLOCS: Cell<u64> = const { Cell::new(0) });

/// Allocations the calling thread made so far.
fn allocs() -> u64 {
    ALLOCS.with(|n| n.get())
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // try_with: nothing to count in a thread's teardown
        let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The stand-in's one event (librdmacm's layout); handed out again once acked.
static EVENT: AtomicUsize = AtomicUsize::new(0);
static GETS: AtomicU64 = AtomicU64::new(0);
static ACKS: AtomicU64 = AtomicU64::new(0);

unsafe extern "C-unwind" fn fake_get(_ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    GETS.fetch_add(1, Relaxed);
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = EVENT.load(Relaxed) as *mut rdma_cm_event };
    0
}

unsafe extern "C" fn fake_ack(_ev: *mut rdma_cm_event) -> c_int {
    ACKS.fetch_add(1, Relaxed);
    0
}

/// One process, one table: every test goes through here first.
fn setup() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        let mut e = SyntheticEvent::zeroed();
        e.event.event = 0; // ADDR_RESOLVED
        EVENT.store(Box::into_raw(e) as usize, Relaxed);
        // SAFETY: fake_get / fake_ack behave as one librdmacm's pair for
        // this one event (no id, no private data), from any thread.
        unsafe { sys::set_cm_event_calls(CmEventCalls { get: fake_get, ack: fake_ack }) }
            .expect("first CM use of this process");
    });
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A channel pointer the stand-in never reads (rdmasafe passes it through).
fn channel() -> *mut rdma_event_channel {
    std::ptr::NonNull::<rdma_event_channel>::dangling().as_ptr()
}

fn get_free(n: usize) {
    for _ in 0..n {
        let mut ev = null_mut();
        // SAFETY: channel is passed through to the stand-in only.
        assert_eq!(unsafe { rdmasafe_get_event(channel(), &mut ev) }, 0);
        // SAFETY: a copy rdmasafe handed out.
        assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    }
}

/// Steady state: a get + free allocates nothing and acks each original once.
#[test]
fn hot_path_loop() {
    let _g = setup();
    get_free(200);
    let (a0, g0, k0) = (allocs(), GETS.load(SeqCst), ACKS.load(SeqCst));
    get_free(1000);
    assert_eq!(allocs() - a0, 0, "allocations in 1000 get + free");
    assert_eq!(GETS.load(SeqCst) - g0, 1000);
    assert_eq!(ACKS.load(SeqCst) - k0, 1000, "every original acked at its free");
}

/// The errno convention of the drop-in calls: untouched on success.
#[test]
fn errno_untouched_on_success() {
    let _g = setup();
    sys::set_errno(4242);
    get_free(3);
    assert_eq!(sys::errno_raw(), 4242);
    // A foreign pointer, and a stale one (a copy freed already): refused
    // with EINVAL, nothing read through them.
    let mut foreign = [0u64; 64];
    // SAFETY: any pointer value is checked before use.
    assert_eq!(unsafe { rdmasafe_event_free(foreign.as_mut_ptr().cast()) }, -1);
    assert_eq!(sys::errno_raw(), libc::EINVAL);
    assert!(foreign.iter().all(|w| *w == 0), "nothing written through a foreign pointer");
    let mut ev = null_mut();
    // SAFETY: channel is passed through to the stand-in only.
    assert_eq!(unsafe { rdmasafe_get_event(channel(), &mut ev) }, 0);
    // SAFETY: a copy rdmasafe handed out, then the same pointer again.
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, 0);
    sys::set_errno(0);
    // SAFETY: as above (checked before use).
    assert_eq!(unsafe { rdmasafe_event_free(ev) }, -1);
    assert_eq!(sys::errno_raw(), libc::EINVAL);
    // With the barrier off nothing changes on the hot path's results.
    let old = rdmasafe_cm_set_ack_deadline(0);
    get_free(3);
    rdmasafe_cm_set_ack_deadline(old as _);
}
