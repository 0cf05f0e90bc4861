//! Recycled storage for event copies.
//!
//! Every copy lives in a [`Slot`]: the C view of the event
//! (`struct rdma_cm_event`) followed by up to 256 bytes of private data,
//! inline. Slots are boxed once and then cycle between live events and a
//! lock-free free list of fixed capacity, so in steady state getting and
//! freeing an event allocates nothing. Only when more copies are alive at
//! once than ever before does a new slot get allocated (counted in
//! [`Counters::slots_allocated`]); a slot freed while the free list is full
//! is released to the allocator.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use crossbeam_queue::ArrayQueue;

use crate::sys::{rdma_cm_event, RDMA_MAX_PRIVATE_DATA};

/// Most free slots kept for reuse (each is about 370 bytes).
pub const FREE_LIST_CAPACITY: usize = 4096;

/// Storage of one event copy. `#[repr(C)]` with the C event first, so a
/// pointer to the slot is a valid `struct rdma_cm_event *` for C callers.
#[repr(C)]
pub(crate) struct Slot {
    /// The C view; `param.*.private_data` points into `data` (or is the
    /// multicast context pointer, or NULL).
    pub(crate) raw: rdma_cm_event,
    /// Private data bytes, inline.
    pub(crate) data: [u8; RDMA_MAX_PRIVATE_DATA],
    /// `id->context` read while the event was still unacked.
    pub(crate) context: usize,
    /// `listen_id->context`, likewise (0 without a listen id).
    pub(crate) listen_context: usize,
    /// The id's QP type at copy time says which `param` arm librdmacm filled.
    pub(crate) qp_type: u32,
}

// SAFETY: a slot owns plain data; its pointers are values that rdmasafe
// never follows after the copy (private_data points into the slot itself).
unsafe impl Send for Slot {}

impl Slot {
    fn new() -> Box<Slot> {
        Box::new(Slot {
            // SAFETY: rdma_cm_event is plain C data (pointers, integers and a
            // union of such); all-zero is a valid value of it.
            raw: unsafe { std::mem::zeroed() },
            data: [0; RDMA_MAX_PRIVATE_DATA],
            context: 0,
            listen_context: 0,
            qp_type: 0,
        })
    }
}

fn free_list() -> &'static ArrayQueue<Box<Slot>> {
    static FREE: OnceLock<ArrayQueue<Box<Slot>>> = OnceLock::new();
    FREE.get_or_init(|| ArrayQueue::new(FREE_LIST_CAPACITY))
}

static COPIED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// Takes a slot for a new copy (counts it as copied).
pub(crate) fn take() -> Box<Slot> {
    COPIED.fetch_add(1, Relaxed);
    free_list().pop().unwrap_or_else(|| {
        ALLOCATED.fetch_add(1, Relaxed);
        Slot::new()
    })
}

/// Returns a slot whose copy was freed.
pub(crate) fn give(slot: Box<Slot>) {
    FREED.fetch_add(1, Relaxed);
    // A full free list drops the slot: memory goes back to the allocator.
    let _ = free_list().push(slot);
}

/// Allocates slots up front so that the first `n` live copies allocate
/// nothing. Returns how many slots the free list holds afterwards.
pub fn reserve(n: usize) -> usize {
    let list = free_list();
    while list.len() < n.min(FREE_LIST_CAPACITY) {
        ALLOCATED.fetch_add(1, Relaxed);
        if list.push(Slot::new()).is_err() {
            break;
        }
    }
    list.len()
}

/// Process-wide figures about event copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Events copied (and acked) since the process started.
    pub copied: u64,
    /// Copies freed.
    pub freed: u64,
    /// Copies alive now (`copied - freed`).
    pub outstanding: u64,
    /// Slots ever allocated; flat in steady state.
    pub slots_allocated: u64,
}

/// Reads the process-wide counters (never blocks).
pub fn counters() -> Counters {
    let freed = FREED.load(Relaxed);
    let copied = COPIED.load(Relaxed);
    Counters { copied, freed, outstanding: copied.saturating_sub(freed), slots_allocated: ALLOCATED.load(Relaxed) }
}
