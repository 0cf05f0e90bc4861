//! Storage for event copies, and the acks of librdmacm's originals.
//!
//! Every copy lives in a [`Slot`] of one arena: address space reserved once
//! (see [`sys::reserve_address_space`]), committed a chunk at a time as more
//! copies are alive at once than ever before, never unmapped. So:
//!
//! * getting and freeing a copy allocates nothing in steady state;
//! * a pointer the C app hands back is checked by arithmetic alone (inside
//!   the arena, on a slot boundary) and then by the slot's state, before
//!   anything is read through it: no registry, no lock;
//! * a freed copy's slot goes to the back of a FIFO free list and is
//!   handed out again only after at least [`QUARANTINE`] other copies were
//!   made since its free (the slot records the copy count from which it
//!   may be reused; a free list whose oldest slot is not there yet makes a
//!   new slot instead), so a stale pointer freed a second time soon after
//!   finds its slot still free (EINVAL) instead of freeing somebody else's
//!   copy. When no new slot can be made (the arena full), the oldest free
//!   slot is reused even in its quarantine (the quarantine ages only with
//!   copies, which need slots). A get that fails (EAGAIN on a non-blocking
//!   channel, say) hands no copy out: its slot is kept aside as the next
//!   get's, so failed gets neither age the quarantine nor make new slots.
//!   The slots [`reserve`] prepares are kept aside the same way (new ones,
//!   or free ones out of their quarantine) and taken before the free list.
//! * The quarantine counts every copy of the process: all threads, all
//!   channels, the Rust API's too.
//!
//! A slot can also hold librdmacm's *original* event un-acked, for at most
//! a deadline (see [`ack_deadline`]): the original is acked when the copy is
//! freed or soon after the deadline passes, whichever comes first, by a
//! background thread if need be. While it is un-acked, `rdma_destroy_id` and
//! `rdma_migrate_id` of its id wait, exactly as they do with librdmacm,
//! which is what a program that relies on that barrier needs. Holding one
//! costs a get three stores and a counter: no lock, no queue. The thread
//! scans the slots a few times per deadline (see [`Reaper`]) and sleeps
//! for good when nothing has been held for a while.

use std::cell::{OnceCell, UnsafeCell};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::time::Duration;

use crate::sys::fork_lock::ForkLock;
use crate::sys::fork_once::ForkOnce;
use crate::sys::{self, rdma_cm_event, RDMA_MAX_PRIVATE_DATA};

/// Most copies one [`reserve`] call prepares for.
pub const FREE_LIST_CAPACITY: usize = 4096;
/// A freed copy's slot is handed out again only after this many other copies.
pub const QUARANTINE: usize = 64;
/// Most copies alive at once (the arena's size, 512 bytes each: 1 GiB of
/// address space, reserved, not used). Under an address-space limit
/// (`RLIMIT_AS`, `ulimit -v`) the arena takes at most a sixteenth of the
/// limit (and less if the reservation fails), so fewer: see [`capacity`].
pub const MAX_SLOTS: usize = 1 << 21;
/// The smallest arena tried before giving up (then every get fails with
/// ENOMEM, and nothing else breaks).
const MIN_SLOTS: usize = CHUNK_SLOTS;
/// Slots committed at a time.
const CHUNK_SLOTS: usize = 128;
/// Entries of the lock-free part of the free list (the rest: `overflow`).
const RING: usize = 16384;
/// The default ack deadline of app channels ([`ack_deadline`]).
pub const DEFAULT_ACK_DEADLINE: Duration = Duration::from_millis(1000);
/// The first "many copies outstanding" warning; each later one at twice the last.
const FIRST_WARNING: u64 = 4096;

const FREE: u32 = 0;
const OWNED: u32 = 1;
const WITH_C: u32 = 2;

/// One copy's storage. `#[repr(C)]` with the C event first: a pointer to
/// the slot is the `struct rdma_cm_event *` the C app gets. Aligned (and so
/// sized) to a power of two, 512 bytes, so that checking a pointer from C
/// (on a slot boundary, below the slots in use) is a mask and a shift.
#[repr(C, align(512))]
pub(crate) struct Slot {
    /// The C view; `param.*.private_data` points into `data` when the
    /// original pointed into librdmacm's own buffer, else is passed through.
    raw: UnsafeCell<rdma_cm_event>,
    data: UnsafeCell<[u8; RDMA_MAX_PRIVATE_DATA]>,
    /// Bytes of `data` that may be non-zero (zeroed before reuse).
    dirty: UnsafeCell<usize>,
    /// The id's QP type at copy time (which `param` arm was filled).
    qp_type: UnsafeCell<u32>,
    /// Counted as a copy (taken slots are counted once filled).
    counted: UnsafeCell<bool>,
    /// Holds a unit of [`set_limit`]'s bound ([`LimitUnit`]), given back
    /// when the slot is.
    unit: UnsafeCell<bool>,
    /// `id->context` / `listen_id->context` at copy time. Atomics: the C
    /// app may read them through `rdmasafe_event_get_contexts` on one
    /// thread while (wrongly) freeing the copy on another.
    context: AtomicUsize,
    listen_context: AtomicUsize,
    state: AtomicU32,
    /// `generation << 1 | original pending`; the generation counts takes.
    ack: AtomicU64,
    original: AtomicPtr<rdma_cm_event>,
    copied_at_ms: AtomicU64,
    deadline_ms: AtomicU64,
    /// The copy count ([`COPIED`]) from which this slot may be handed out
    /// again: its last copy's free's count + [`QUARANTINE`] (0: never
    /// held a copy). Written before the free list's push publishes it.
    ripe_at: AtomicU64,
    /// The held original is one librdmacm keeps itself: set by each hold
    /// from its get's [`CopyDestination`].
    kept_by_librdmacm: AtomicBool,
}

// SAFETY: the fields other threads touch (the reaper, counters, a C
// pointer's lookup) are atomics; the UnsafeCell fields are only touched by
// the slot's one owner, a SlotBox (see there).
unsafe impl Sync for Slot {}

const STRIDE: usize = std::mem::size_of::<Slot>();
const _: () = assert!(STRIDE == 512, "a slot is 512 bytes (a power of two: slot_of is a mask and a shift)");

struct Arena {
    base: NonNull<u8>,
    /// Slots the reservation holds (0: none could be reserved).
    max_slots: usize,
    /// Slots ever handed out; `0..allocated` are committed and initialised.
    allocated: AtomicUsize,
    committed: AtomicUsize,
    grow: ForkLock<()>,
    free: FreeRing,
    /// Slots freed while the ring was full, oldest first.
    overflow: ForkLock<std::collections::VecDeque<u32>>,
    overflow_len: AtomicUsize,
    /// Slots that may be handed out at once, taken before the free list:
    /// those of failed gets (they never held a copy) and those
    /// [`reserve`] made.
    ready: FreeRing<READY_RING>,
}

/// Entries of [`Arena::ready`]: [`FREE_LIST_CAPACITY`] + [`QUARANTINE`]
/// reserved and the slots of failed gets in flight fit (when it is full, a
/// slot goes to the free list instead).
const READY_RING: usize = 8192;

// SAFETY: `base` is an address, never unmapped; everything else is Sync.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

/// A [`FreeRing`] entry that is no slot: what a forked child's mending
/// leaves where a push of the parent never filled its claimed position.
const HOLE: u32 = u32::MAX;
const _: () = assert!(MAX_SLOTS < HOLE as usize);

/// The lock-free part of the free list: a bounded FIFO of slot indices for
/// any number of threads, one `AtomicU64` per cell holding a sequence
/// number (high 32 bits) and the index (low 32 bits), `N` cells (a power
/// of two, [`RING`] by default). Cell `p % N`
/// takes the push of position `p` when its sequence reads `p`, and gives
/// it to the pop of `p` when it reads `p + 1`; the pop leaves `p + N`
/// for the next lap. A push claims `p` by moving `tail`, a pop by moving
/// `head` (one compare-and-swap each, no lock, nothing allocated after
/// `new`). Sequences compare as the low 32 bits of the 64-bit positions
/// (N divides 2^32).
struct FreeRing<const N: usize = RING> {
    /// A fixed-size array: a masked position needs no bounds check. The
    /// arena's rings are statics: setting up the storage allocates nothing
    /// for them, so nothing there can fail.
    cells: &'static [AtomicU64; N],
    head: AtomicU64,
    tail: AtomicU64,
}

impl<const N: usize> FreeRing<N> {
    const POWER_OF_TWO: () = assert!(N.is_power_of_two() && N <= 1 << 31);

    /// An empty ring on `cells`, which only this ring uses from now on.
    fn new(cells: &'static [AtomicU64; N]) -> FreeRing<N> {
        #[allow(clippy::let_unit_value)]
        let () = Self::POWER_OF_TWO;
        for (k, c) in cells.iter().enumerate() {
            c.store((k as u64) << 32, Relaxed);
        }
        FreeRing { cells, head: AtomicU64::new(0), tail: AtomicU64::new(0) }
    }

    #[inline]
    fn cell(&self, pos: u64) -> &AtomicU64 {
        &self.cells[pos as usize & (N - 1)]
    }

    /// Entries now (exact when nobody pushes or pops meanwhile; head is
    /// read first, so the result never wraps below zero).
    #[inline]
    fn len(&self) -> usize {
        let head = self.head.load(Acquire);
        self.tail.load(Acquire).wrapping_sub(head) as usize
    }

    /// Appends `i`; gives it back when the ring is full, or looks full: a
    /// pop preempted between its claim and its release of the cell blocks
    /// pushes to that cell until it runs again (then the caller's fallback,
    /// the overflow list or the free list, takes `i`; nothing is lost).
    #[inline]
    fn push(&self, i: u32) -> Result<(), u32> {
        let mut pos = self.tail.load(Relaxed);
        loop {
            let seq = (self.cell(pos).load(Acquire) >> 32) as u32;
            match seq.wrapping_sub(pos as u32) as i32 {
                0 => match self.tail.compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed) {
                    // Claimed: nobody else writes this cell before our pop
                    // partner reads it.
                    Ok(_) => {
                        self.cell(pos).store(((pos as u32).wrapping_add(1) as u64) << 32 | i as u64, Release);
                        return Ok(());
                    }
                    Err(now) => pos = now,
                },
                // The cell still holds the entry of the previous lap: full.
                d if d < 0 => return Err(i),
                // Another push claimed pos already.
                _ => pos = self.tail.load(Relaxed),
            }
        }
    }

    /// Removes the oldest entry.
    fn pop(&self) -> Option<u32> {
        self.pop_if(|_| true)
    }

    /// Removes the oldest entry if `ready` says it may go (`None` when the
    /// ring is empty or the oldest entry is not ready).
    #[inline]
    fn pop_if(&self, ready: impl Fn(u32) -> bool) -> Option<u32> {
        let mut pos = self.head.load(Relaxed);
        loop {
            let c = self.cell(pos).load(Acquire);
            match ((c >> 32) as u32).wrapping_sub((pos as u32).wrapping_add(1)) as i32 {
                // A hole a forked child's mending left: taken and passed.
                0 if c as u32 == HOLE => {
                    if self.head.compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed).is_ok() {
                        self.cell(pos).store(((pos as u32).wrapping_add(N as u32) as u64) << 32, Release);
                    }
                    pos = self.head.load(Relaxed);
                }
                // Filled for pos. `c` stays valid if the claim succeeds: the
                // cell is rewritten only after a pop of pos, which is us.
                0 if !ready(c as u32) => return None,
                0 => match self.head.compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed) {
                    Ok(_) => {
                        self.cell(pos).store(((pos as u32).wrapping_add(N as u32) as u64) << 32, Release);
                        return Some(c as u32);
                    }
                    Err(now) => pos = now,
                },
                // Not filled yet: empty, unless a push claimed pos and is
                // about to fill it (then wait for it, as a lock-free queue
                // must not report an entry that is there as missing).
                d if d < 0 => {
                    if self.tail.load(Acquire) == pos {
                        return None;
                    }
                    std::hint::spin_loop();
                    pos = self.head.load(Relaxed);
                }
                // Another pop took pos already.
                _ => pos = self.head.load(Relaxed),
            }
        }
    }

    /// In a forked child (its fork handler, while the child has one
    /// thread): mends what threads of the parent left half-done. A push
    /// that claimed a position and never filled it would make every pop
    /// there wait for good: the position is filled with [`HOLE`], which
    /// pops pass over. A pop that took an entry and never released its
    /// cell would make the ring look full there for good: the cell is
    /// released. The slots those threads were pushing or popping stay
    /// unused in the child. `head` and `tail` stay as they are, so a step
    /// of the forking thread itself (a fork from a signal handler that
    /// interrupted it) goes on where it was when the handler returns: a
    /// push fills its position over the hole, unless a pop of the child
    /// passed it first (then that entry is lost to the child, and pushes
    /// find the ring full at that cell, so frees go to the overflow list;
    /// nothing waits). A ring with nothing half-done is not written (the
    /// child's copy of its pages stays shared with the parent's).
    ///
    /// # Safety
    /// No other thread may use the ring meanwhile.
    unsafe fn after_fork_in_child(&self) {
        let set = |pos: u64, c: u64| {
            if self.cell(pos).load(Relaxed) != c {
                self.cell(pos).store(c, Relaxed);
            }
        };
        let head = self.head.load(Relaxed);
        let tail = self.tail.load(Relaxed);
        for pos in head..tail {
            // Claimed by a push (sequence pos), or filled (pos + 1).
            if (self.cell(pos).load(Relaxed) >> 32) as u32 != (pos as u32).wrapping_add(1) {
                set(pos, ((pos as u32).wrapping_add(1) as u64) << 32 | HOLE as u64);
            }
        }
        // The other cells: free for the pushes of their positions (a cell
        // a pop took and did not release still holds its entry's).
        for pos in tail..head + N as u64 {
            set(pos, ((pos as u32) as u64) << 32);
        }
    }
}

/// The CM copies' storage, set up at its first use. A [`ForkOnce`], not a
/// `OnceLock`: a child forked while another thread sets it up (a
/// reservation, a log line) sets it up again instead of waiting for good
/// on a thread it does not have (the preload's child, which sets itself up
/// again, reaches this at once; found by a review: 8 of 600 children hung
/// without any fault injected).
static ARENA: ForkOnce<Arena> = ForkOnce::new();

#[inline]
fn arena() -> &'static Arena {
    match ARENA.get() {
        Some(a) => a,
        None => arena_first_use(),
    }
}

/// For a fork child handler registered at load (as the preload's and
/// librdmasafe's are): in a forked child, a set-up of the CM copies'
/// storage that another thread of the parent had under way is forgotten,
/// and the child sets it up again at its first use; a storage set up
/// already has its locks and free lists taken back from the threads the
/// child does not have, and mended. Never needed when the handler rdmasafe
/// registers at that storage's first use ran, but glibc runs only the
/// handlers registered when the fork began, and a thread may begin the
/// set-up, and register, while a fork is under way (a prepare handler of
/// another library lets it: found by a review). Running it more than once
/// in a child changes nothing more.
///
/// # Safety
/// Only from a fork child handler (the child has one thread then): it
/// takes locks from their holders and rewrites the free lists.
pub unsafe fn after_fork_in_child() {
    // SAFETY: the caller's contract: no other thread uses the storage.
    unsafe {
        ARENA.after_fork_in_child(false);
        if let Some(a) = ARENA.get() {
            a.after_fork_in_child();
        }
    }
}

/// [`after_fork_in_child`], registered at the storage's first use.
unsafe extern "C" fn arena_after_fork_in_child() {
    // SAFETY: registered as a fork child handler only.
    unsafe { after_fork_in_child() };
}

/// Sets the arena up. The fork handler that forgets a set-up under way is
/// registered first (by the first thread to come here, or by each that
/// comes before one has finished registering it; see also
/// [`after_fork_in_child`]). What the set-up has to say is logged after
/// it.
#[cold]
fn arena_first_use() -> &'static Arena {
    /// The rings' cells, each used by the one arena only (set again by a
    /// child's set-up).
    static FREE_CELLS: [AtomicU64; RING] = [const { AtomicU64::new(0) }; RING];
    static READY_CELLS: [AtomicU64; READY_RING] = [const { AtomicU64::new(0) }; READY_RING];
    static FORK_HANDLER: AtomicBool = AtomicBool::new(false);
    if !FORK_HANDLER.load(Acquire) && sys::at_fork_child(arena_after_fork_in_child) {
        FORK_HANDLER.store(true, Release);
    }
    let mut said = None;
    let a = ARENA.get_or_init(|| {
        let (base, max_slots, say) = reserve_arena();
        said = say;
        Arena {
            base,
            max_slots,
            allocated: AtomicUsize::new(0),
            committed: AtomicUsize::new(0),
            grow: ForkLock::new(()),
            free: FreeRing::new(&FREE_CELLS),
            overflow: ForkLock::new(std::collections::VecDeque::new()),
            overflow_len: AtomicUsize::new(0),
            ready: FreeRing::new(&READY_CELLS),
        }
    });
    match said {
        Some(ArenaNote::Limited(slots)) => {
            log::debug!(target: "rdmasafe", "CM event copies: at most {slots} alive at once (address-space limit)")
        }
        Some(ArenaNote::Refused(e)) => log::error!(
            target: "rdmasafe",
            "cannot reserve address space for CM event copies ({e}): every get fails with ENOMEM"
        ),
        None => {}
    }
    a
}

/// What the arena's set-up has to say (nothing allocated for it: the
/// set-up may run short of memory).
enum ArenaNote {
    /// Fewer slots than [`MAX_SLOTS`] (an address-space limit).
    Limited(usize),
    /// No address space at all.
    Refused(std::io::Error),
}

/// The arena's address space: [`MAX_SLOTS`] slots, or under an
/// address-space limit at most a sixteenth of it (the app keeps the rest),
/// halved while the kernel refuses, down to [`MIN_SLOTS`]. None at all (a
/// dangling base, 0 slots: every get fails with ENOMEM) rather than a
/// panic. Also what to log about it, if anything.
#[cold]
fn reserve_arena() -> (NonNull<u8>, usize, Option<ArenaNote>) {
    let mut slots = MAX_SLOTS;
    if let Some(limit) = sys::address_space_limit() {
        let share = (limit / 16) as usize / STRIDE / CHUNK_SLOTS * CHUNK_SLOTS;
        slots = slots.min(share.max(MIN_SLOTS));
    }
    loop {
        match sys::reserve_address_space(slots * STRIDE) {
            Ok(base) => return (base, slots, (slots < MAX_SLOTS).then_some(ArenaNote::Limited(slots))),
            Err(e) if slots / 2 < MIN_SLOTS => return (NonNull::dangling(), 0, Some(ArenaNote::Refused(e))),
            Err(_) => slots /= 2,
        }
    }
}

/// How many copies can be alive at once in this process: [`MAX_SLOTS`],
/// fewer under an address-space limit, 0 if no storage could be reserved
/// at all. Reserves the storage (address space only) if not done yet.
pub fn capacity() -> usize {
    arena().max_slots
}

impl Arena {
    #[inline]
    fn slot(&self, i: usize) -> &'static Slot {
        debug_assert!(i < self.allocated.load(Relaxed));
        // SAFETY: slot i lies in the committed part of the arena (i <
        // allocated <= committed), which is never unmapped; all-zero bytes
        // (fresh pages) are a valid Slot, and slots are only ever accessed
        // through shared references (owner-only fields are UnsafeCells).
        unsafe { &*self.base.as_ptr().add(i * STRIDE).cast::<Slot>() }
    }

    /// In a forked child: the locks and free lists that other threads of
    /// the parent were inside when it forked are taken back and mended, so
    /// the child's own gets and frees neither wait for those threads nor
    /// spin on their half-done steps. A chunk of slots being committed is
    /// committed again (the `mprotect` of a range already committed
    /// changes nothing); a slot those threads were freeing, or taking off a
    /// list, stays unused in the child, and so do all the slots of the
    /// overflow list if one of them held its lock (the list may be
    /// half-changed: the child starts an empty one).
    ///
    /// # Safety
    /// As [`after_fork_in_child`].
    unsafe fn after_fork_in_child(&self) {
        // SAFETY: the caller's contract: no other thread uses the arena.
        unsafe {
            self.grow.after_fork_in_child(|()| {});
            if self.overflow.after_fork_in_child(|o| std::mem::forget(std::mem::take(o))) {
                self.overflow_len.store(0, Relaxed);
            }
            self.free.after_fork_in_child();
            self.ready.after_fork_in_child();
        }
    }

    /// The slot a pointer the app gave us points to, if any: arithmetic only.
    #[inline]
    fn slot_of(&self, p: *const u8) -> Option<&'static Slot> {
        let off = (p as usize).checked_sub(self.base.as_ptr() as usize)?;
        (off % STRIDE == 0 && off / STRIDE < self.allocated.load(Acquire)).then(|| self.slot(off / STRIDE))
    }

    #[inline]
    fn index_of(&self, s: &Slot) -> u32 {
        ((s as *const Slot as usize - self.base.as_ptr() as usize) / STRIDE) as u32
    }

    /// A never-used slot, committing memory if needed; `None` when full.
    fn new_slot(&self) -> Option<u32> {
        let _g = self.grow.lock();
        let i = self.allocated.load(Relaxed);
        if i >= self.max_slots {
            return None;
        }
        let committed = self.committed.load(Relaxed);
        if i >= committed {
            let n = CHUNK_SLOTS.min(self.max_slots - committed);
            // SAFETY: the next chunk of our own reservation, unused so far
            // (STRIDE * CHUNK_SLOTS is a multiple of the page size).
            let at = unsafe { NonNull::new_unchecked(self.base.as_ptr().add(committed * STRIDE)) };
            // SAFETY: as above.
            if unsafe { sys::commit(at, n * STRIDE) }.is_err() {
                return None;
            }
            self.committed.store(committed + n, Relaxed);
        }
        self.allocated.store(i + 1, Release);
        ALLOCATED.fetch_add(1, Relaxed);
        Some(i as u32)
    }

    /// Slot `i` is out of its quarantine: [`QUARANTINE`] copies were made
    /// since its last copy was freed (a stale COPIED read only says no).
    #[inline]
    fn ripe(&self, i: u32) -> bool {
        self.slot(i as usize).ripe_at.load(Relaxed) <= COPIED.load(Relaxed)
    }

    /// The oldest free slot, if it is out of its quarantine.
    #[inline]
    fn pop_free(&self) -> Option<u32> {
        if let Some(i) = self.free.pop_if(|i| self.ripe(i)) {
            return Some(i);
        }
        if self.overflow_len.load(Relaxed) > 0 {
            return self.pop_overflow();
        }
        None
    }

    /// The oldest free slot, in its quarantine or not: for a get that
    /// finds no slot otherwise (the arena full, or its memory not
    /// committable). The quarantine ages only as copies are made, and none
    /// can be made without a slot: without this, every get would fail for
    /// good once the arena is full, even after every copy was freed.
    #[cold]
    fn pop_free_quarantined(&self) -> Option<u32> {
        if let Some(i) = self.free.pop_if(|_| true) {
            return Some(i);
        }
        self.pop_overflow_if(|_| true)
    }

    #[cold]
    fn pop_overflow(&self) -> Option<u32> {
        self.pop_overflow_if(|i| self.ripe(i))
    }

    /// The oldest slot of the overflow list, if `take(slot)`.
    fn pop_overflow_if(&self, take: impl Fn(u32) -> bool) -> Option<u32> {
        let mut o = self.overflow.lock();
        let i = *o.front()?;
        if !take(i) {
            return None;
        }
        o.pop_front();
        self.overflow_len.store(o.len(), Relaxed);
        Some(i)
    }

    /// A slot of [`Arena::ready`], if any.
    #[inline]
    fn take_ready(&self) -> Option<u32> {
        if self.ready.len() == 0 {
            return None;
        }
        self.take_ready_slow()
    }

    #[cold]
    fn take_ready_slow(&self) -> Option<u32> {
        self.ready.pop()
    }

    /// A slot that may be handed out at once (it never held a copy, or its
    /// quarantine is over) goes to [`Arena::ready`].
    #[cold]
    fn push_ready(&self, i: u32) {
        if let Err(i) = self.ready.push(i) {
            self.push_free(i);
        }
    }

    #[inline]
    fn push_free(&self, i: u32) {
        if let Err(i) = self.free.push(i) {
            self.push_overflow(i);
        }
    }

    #[cold]
    fn push_overflow(&self, i: u32) {
        let mut o = self.overflow.lock();
        o.push_back(i);
        self.overflow_len.store(o.len(), Relaxed);
    }
}

static COPIED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static HIGH_WATER: AtomicU64 = AtomicU64::new(0);
static DEFERRED: AtomicU64 = AtomicU64::new(0);
static ACKED_AT_FREE: AtomicU64 = AtomicU64::new(0);
static ACKED_AT_DEADLINE: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);
static NEXT_WARNING: AtomicU64 = AtomicU64::new(FIRST_WARNING);
static LIMIT: AtomicU64 = AtomicU64::new(0);
/// Units of [`LIMIT`] held: by copies alive and by gets in flight (taken
/// before `rdma_get_cm_event`, so that threads getting at once cannot all
/// pass the bound).
static UNITS: AtomicU64 = AtomicU64::new(0);

fn outstanding() -> u64 {
    // FREED first: a concurrent free between the loads can only make the
    // result too high, never wrap below zero.
    let freed = FREED.load(Relaxed);
    COPIED.load(Relaxed).saturating_sub(freed)
}

/// The "many copies held" warning, once per doubling, for a copy that made
/// `alive` copies alive ([`SlotBox::mark_copied`]'s result). Call it after
/// the copy's original is acked or held: a log callback may block on the
/// event's id (an app lock held by a thread in `rdma_destroy_id`), and only
/// a held original is acked by the deadline.
#[inline]
pub(crate) fn warn_if_many_held(alive: u64) {
    let next = NEXT_WARNING.load(Relaxed);
    if alive >= next {
        warn_many_held(alive, next);
    }
}

/// [`warn_if_many_held`]'s message (out of the get path).
#[cold]
fn warn_many_held(n: u64, next: u64) {
    if NEXT_WARNING.compare_exchange(next, next.saturating_mul(2), Relaxed, Relaxed).is_ok() {
        // On the get path, whose callers may be cancelled: the app's log
        // backend may write (a cancellation point).
        let _no_cancel = crate::sys::cancel::CancelDisabled::new();
        log::warn!(
            target: "rdmasafe",
            "{n} CM event copies are held and not freed (oldest {} ms): free copies when done with them \
             (rdmasafe_event_free / drop), or bound them with rdmasafe_cm_set_limit",
            counters().oldest_age_ms
        );
    }
}

/// The owner of one slot: the only code that touches its event, private
/// data and QP type while it lives (the invariant that makes the
/// `UnsafeCell` accesses below sound).
pub(crate) struct SlotBox(&'static Slot);

// SAFETY: owning a slot is owning plain data (its pointers are values,
// never followed by rdmasafe after the copy); moving the owner to another
// thread moves the exclusive access with it.
unsafe impl Send for SlotBox {}

impl SlotBox {
    #[inline]
    pub(crate) fn raw(&self) -> &rdma_cm_event {
        // SAFETY: the owner has exclusive access (type invariant).
        unsafe { &*self.0.raw.get() }
    }

    #[inline]
    pub(crate) fn raw_mut(&mut self) -> &mut rdma_cm_event {
        // SAFETY: as above, and &mut self is unique.
        unsafe { &mut *self.0.raw.get() }
    }

    pub(crate) fn data(&self) -> &[u8; RDMA_MAX_PRIVATE_DATA] {
        // SAFETY: as for `raw`.
        unsafe { &*self.0.data.get() }
    }

    /// Fills the private data with `src` and zeroes whatever an earlier
    /// copy left past it (librdmacm's events read 0 there too). Returns the
    /// address of the bytes, for the C view's pointer.
    #[inline]
    pub(crate) fn set_data(&mut self, src: &[u8]) -> *const u8 {
        // SAFETY: as for `raw_mut`.
        let (data, dirty) = unsafe { (&mut *self.0.data.get(), &mut *self.0.dirty.get()) };
        data[..src.len()].copy_from_slice(src);
        if *dirty > src.len() {
            data[src.len()..*dirty].fill(0);
        }
        *dirty = src.len();
        data.as_ptr()
    }

    /// Clears leftover private data of an earlier copy (no data this time).
    #[inline]
    pub(crate) fn clear_data(&mut self) {
        self.set_data(&[]);
    }

    pub(crate) fn qp_type(&self) -> u32 {
        // SAFETY: as for `raw`.
        unsafe { *self.0.qp_type.get() }
    }

    #[inline]
    pub(crate) fn set_qp_type(&mut self, t: u32) {
        // SAFETY: as for `raw_mut`.
        unsafe { *self.0.qp_type.get() = t };
    }

    pub(crate) fn context(&self) -> usize {
        self.0.context.load(Relaxed)
    }

    pub(crate) fn listen_context(&self) -> usize {
        self.0.listen_context.load(Relaxed)
    }

    /// Counts the slot as a live copy (copied, high-water mark) and stamps
    /// its age. Returns the copies alive now, for [`warn_if_many_held`],
    /// which the caller calls once librdmacm's original is acked or held
    /// (a log callback may wait on the event's id).
    #[inline]
    pub(crate) fn mark_copied(&mut self) -> u64 {
        // SAFETY: the owner's exclusive field.
        unsafe { *self.0.counted.get() = true };
        self.0.copied_at_ms.store(sys::coarse_now_ms(), Relaxed);
        let n = (COPIED.fetch_add(1, Relaxed) + 1).saturating_sub(FREED.load(Relaxed));
        // A plain load first: the locked max only when the mark moves.
        if n > HIGH_WATER.load(Relaxed) {
            HIGH_WATER.fetch_max(n, Relaxed);
        }
        n
    }

    #[inline]
    pub(crate) fn set_contexts(&mut self, context: usize, listen_context: usize) {
        self.0.context.store(context, Relaxed);
        self.0.listen_context.store(listen_context, Relaxed);
    }

    /// Keeps librdmacm's `original` event un-acked until this copy is freed
    /// or `ms` milliseconds (the deadline) pass, whichever comes first.
    /// Marked as one librdmacm keeps itself as its [`CopyDestination`]
    /// says.
    ///
    /// # Safety
    /// `original` must be an un-acked event from `rdma_get_cm_event`, not
    /// acked by anyone else afterwards.
    #[inline]
    pub(crate) unsafe fn hold_original(&mut self, original: *mut rdma_cm_event, ms: u64, destination: CopyDestination) {
        let s = self.0;
        let gen = s.ack.load(Relaxed) >> 1;
        // The copy's time stamp (taken by mark_copied) is "now" here.
        let now = match s.copied_at_ms.load(Relaxed) {
            0 => sys::coarse_now_ms(),
            t => t,
        };
        s.original.store(original, Relaxed);
        s.deadline_ms.store(now.saturating_add(ms), Relaxed);
        // Before the original is published (the `ack` store): the reaper
        // never sees it held without its mark.
        let kept = match destination {
            CopyDestination::Librdmacm => true,
            CopyDestination::Out(out) => into_its_ids_own_field(self.raw(), out),
        };
        s.kept_by_librdmacm.store(kept, Relaxed);
        s.ack.store(gen << 1 | 1, Release);
        if ms < SHORTEST_DEADLINE_MS.load(Relaxed) {
            SHORTEST_DEADLINE_MS.fetch_min(ms, Relaxed);
        }
        // SeqCst: paired with the reaper's going idle (see Reaper::run).
        DEFERRED.fetch_add(1, SeqCst);
        reaper().kick();
    }

    /// Hands the copy to C: its address is the `struct rdma_cm_event *`.
    #[inline]
    pub(crate) fn into_c(self) -> *mut rdma_cm_event {
        let s = self.0;
        std::mem::forget(self);
        s.state.store(WITH_C, Release);
        s.raw.get()
    }

    /// Takes a copy back from C. `None` (nothing read or written) unless
    /// `p` is a copy handed to C and not taken back yet; of two threads
    /// taking back the same pointer at once, one gets it.
    #[inline]
    pub(crate) fn from_c(p: *const rdma_cm_event) -> Option<SlotBox> {
        let s = arena().slot_of(p.cast())?;
        s.state.compare_exchange(WITH_C, OWNED, Acquire, Relaxed).ok()?;
        Some(SlotBox(s))
    }

    /// For a pointer that is a live copy held by C: a look at it without
    /// taking it back (`None` for anything else).
    pub(crate) fn peek_c(p: *const rdma_cm_event) -> Option<&'static Slot> {
        let s = arena().slot_of(p.cast())?;
        (s.state.load(Acquire) == WITH_C).then_some(s)
    }
}

impl Slot {
    pub(crate) fn context(&self) -> usize {
        self.context.load(Relaxed)
    }

    pub(crate) fn listen_context(&self) -> usize {
        self.listen_context.load(Relaxed)
    }

    /// If the original of generation `gen` is still pending, claims it
    /// (exactly one caller wins) and returns it, to be acked, with its
    /// mark (`kept_by_librdmacm`).
    #[inline]
    fn claim_original(&self, gen: u64) -> Option<(*mut rdma_cm_event, bool)> {
        let pending = gen << 1 | 1;
        if self.ack.load(Acquire) != pending {
            return None;
        }
        // Read before the claim: once the claim succeeds the copy's owner
        // may free the slot, and a later get rewrite both (until then a
        // rewrite needs the slot freed and taken again, which changes `ack`).
        let o = self.original.load(Acquire);
        let kept = self.kept_by_librdmacm.load(Relaxed);
        self.ack.compare_exchange(pending, gen << 1, AcqRel, Relaxed).ok().map(|_| (o, kept))
    }
}

impl SlotBox {
    /// Frees the slot now (what dropping it does), in the caller's frame:
    /// the C free path's one call.
    #[inline(always)]
    pub(crate) fn free(self) {
        std::mem::ManuallyDrop::new(self).release();
    }

    /// Drop's body: the slot goes back to the free list, its held original
    /// (if any) is acked last. Called exactly once per owner, by `drop` or
    /// by `free` (which then forgets the owner).
    #[inline(always)]
    fn release(&mut self) {
        let s = self.0;
        let held = s.claim_original(s.ack.load(Relaxed) >> 1).map(|(o, _)| o);
        // SAFETY: the owner's exclusive fields.
        let (counted, unit) = unsafe { (*s.counted.get(), std::mem::replace(&mut *s.unit.get(), false)) };
        if unit {
            UNITS.fetch_sub(1, AcqRel); // the unit keep_unit kept
        }
        if counted {
            FREED.fetch_add(1, Relaxed);
            // Published by the push below (Release), read by a pop after it.
            s.ripe_at.store(COPIED.load(Relaxed) + QUARANTINE as u64, Relaxed);
        }
        s.state.store(FREE, Release);
        let a = arena();
        let i = a.index_of(s);
        // A slot that holds no copy (its get failed) was out of its
        // quarantine when taken: it is the next get's, and the free list
        // does not move (failed gets neither age the quarantine of the
        // slots in it nor make new slots).
        if counted {
            a.push_free(i);
        } else {
            a.push_ready(i);
        }
        // The ack comes last, as with librdmacm's own free: a thread waiting
        // in rdma_destroy_id wakes only after this copy is completely gone.
        if let Some(o) = held {
            ACKED_AT_FREE.fetch_add(1, SeqCst);
            // SAFETY: claimed exactly once; an un-acked original (hold_original).
            unsafe { sys::ack_cm_event(o) };
        }
    }
}

impl Drop for SlotBox {
    fn drop(&mut self) {
        self.release();
    }
}

/// Takes a slot for a new copy; it counts as a copy once
/// [`SlotBox::mark_copied`]. ENOMEM when the arena is full or memory cannot
/// be committed. Taken *before* librdmacm is asked for an event, so a
/// failure here loses nothing.
#[inline]
pub(crate) fn take() -> crate::Result<SlotBox> {
    let a = arena();
    let i = a
        .take_ready()
        .or_else(|| a.pop_free())
        .or_else(|| a.new_slot())
        .or_else(|| a.pop_free_quarantined())
        .ok_or_else(|| crate::Error::new("rdmasafe: CM event copy", libc::ENOMEM))?;
    let s = a.slot(i as usize);
    let gen = (s.ack.load(Relaxed) >> 1) + 1;
    s.ack.store(gen << 1, Relaxed);
    s.copied_at_ms.store(0, Relaxed);
    s.state.store(OWNED, Relaxed);
    let b = SlotBox(s);
    // SAFETY: the new owner's exclusive field.
    unsafe { *b.0.counted.get() = false };
    // SAFETY: as above (released with the slot's last owner).
    unsafe { *b.0.unit.get() = false };
    // The contexts are left as they were: nothing reads them before the
    // copy (copy_raw) sets them, since only a copy handed to C is peeked.
    Ok(b)
}

/// A slot taken for a get that has not returned yet, as a plain value
/// with no destructor: what a frame that a thread cancellation may unwind
/// can hold across the get ([`crate::sys::cancel`]). It goes back into a
/// [`SlotBox`] when the get returns ([`PendingGet::into_slot`]), or is
/// given back by the cancellation's cleanup handler
/// ([`PendingGet::abandon`]); dropped otherwise, the slot leaks.
pub(crate) struct PendingGet(&'static Slot);

impl SlotBox {
    /// The slot as a [`PendingGet`], for the duration of a cancellable get.
    #[inline]
    pub(crate) fn into_pending(self) -> PendingGet {
        let s = self.0;
        std::mem::forget(self);
        PendingGet(s)
    }
}

impl PendingGet {
    /// The slot's owner again (the get returned).
    #[inline]
    pub(crate) fn into_slot(self) -> SlotBox {
        SlotBox(self.0)
    }

    /// Gives the slot (and its unit of the limit) back, holding no copy:
    /// the get it was taken for never returned.
    pub(crate) fn abandon(self) {
        drop(self.into_slot());
    }
}

/// A unit of [`set_limit`]'s bound, held by a get from before it asks
/// librdmacm until its copy is freed (or the get fails): given back when
/// dropped.
#[must_use]
pub(crate) struct LimitUnit(());

impl LimitUnit {
    /// A unit, or ENOBUFS while the bound is reached (counting the copies
    /// alive and the gets in flight), before anything is taken from
    /// librdmacm; `None` without a bound. `COUNT`: the refusal is a get's
    /// (counted in `refused_at_limit`); the rest of a batch stopping at the
    /// bound is not one (the call succeeded).
    #[inline]
    pub(crate) fn take<const COUNT: bool>() -> crate::Result<Option<LimitUnit>> {
        let limit = LIMIT.load(Relaxed);
        if limit == 0 {
            return Ok(None);
        }
        let mut held = UNITS.load(Relaxed);
        loop {
            if Self::reached(limit, held) {
                return Err(Self::refuse(COUNT));
            }
            match UNITS.compare_exchange_weak(held, held + 1, AcqRel, Relaxed) {
                Ok(_) => return Ok(Some(LimitUnit(()))),
                Err(now) => held = now,
            }
        }
    }

    /// ENOBUFS (a refusal, counted) while the bound is reached, without
    /// taking a unit: a get that waits checks it before its wait, so that
    /// a get at the limit fails at once, event queued or not (its unit is
    /// taken, by [`LimitUnit::take`], only once an event is there).
    #[inline]
    pub(crate) fn check() -> crate::Result<()> {
        let limit = LIMIT.load(Relaxed);
        if limit != 0 && Self::reached(limit, UNITS.load(Relaxed)) {
            return Err(Self::refuse(true));
        }
        Ok(())
    }

    /// Copies got before the bound was set hold no unit: counted through
    /// `outstanding` (exact once they are freed).
    #[inline]
    fn reached(limit: u64, held: u64) -> bool {
        held >= limit || outstanding() >= limit
    }

    #[cold]
    fn refuse(count: bool) -> crate::Error {
        if count {
            REFUSED.fetch_add(1, Relaxed);
        }
        crate::Error::new("rdmasafe: held CM event copies at the limit", libc::ENOBUFS)
    }
}

impl Drop for LimitUnit {
    fn drop(&mut self) {
        UNITS.fetch_sub(1, AcqRel);
    }
}

impl SlotBox {
    /// The slot keeps `unit` until it is given back (the copy freed, or
    /// the get failed).
    #[inline]
    pub(crate) fn keep_unit(&mut self, unit: Option<LimitUnit>) {
        if let Some(u) = unit {
            std::mem::forget(u);
            // SAFETY: the owner's exclusive field.
            unsafe { *self.0.unit.get() = true };
        }
    }
}

/// Bounds the copies alive at once (0: unlimited, the default). A get that
/// would pass the bound fails with ENOBUFS before `rdma_get_cm_event`, so
/// the event stays in the kernel until copies are freed. Gets in flight
/// count: threads getting at once never hold more than the bound between
/// them (copies got before the bound was set count as alive, not exactly
/// against racing gets, until they are freed). A get at the bound fails at
/// once, whether an event is pending or not (a get that waits in poll(),
/// on a non-blocking fd or with a timeout, holds no unit while it waits:
/// when other gets reach the bound meanwhile, it is refused as its event
/// comes, which stays in the kernel), and nothing wakes a waiter
/// when a copy is freed (an async `AsyncEventChannel::next` returns
/// ENOBUFS at its next get: at once, or when an event comes if it found
/// the channel empty last): free copies before you get again, or a loop
/// that retries spins.
pub fn set_limit(max_outstanding: u64) {
    LIMIT.store(max_outstanding, Relaxed);
}

/// The bound set by [`set_limit`] (0: unlimited).
pub fn limit() -> u64 {
    LIMIT.load(Relaxed)
}

static ACK_DEADLINE_MS: AtomicU64 = AtomicU64::new(u64::MAX);

/// How long a copy got through a [`super::ChannelRef`] (an app channel, as
/// in the C API) keeps librdmacm's original un-acked: until the copy is
/// freed or this long after the get, whichever comes first. The reaper
/// thread acks it after the deadline: it scans every quarter of the
/// shortest deadline any get of the process has used so far (1 to 250 ms;
/// a scan visits every slot allocated) against the kernel's coarse clock
/// (a tick of a few ms), so an original is acked at most that long after
/// its deadline, or up to 250 ms after it while the thread ends a sleep it
/// began before a deadline shorter than any before was first used. Default
/// [`DEFAULT_ACK_DEADLINE`], or `RDMASAFE_ACK_DEADLINE_MS` from the
/// environment; zero acks at once. Copies from an [`super::EventChannel`]
/// are always acked at once.
pub fn ack_deadline() -> Duration {
    Duration::from_millis(ack_deadline_ms())
}

/// [`ack_deadline`] in milliseconds (the get path's form: one load once set).
#[inline]
pub(crate) fn ack_deadline_ms() -> u64 {
    match ACK_DEADLINE_MS.load(Relaxed) {
        u64::MAX => read_ack_deadline_env(),
        v => v,
    }
}

/// `RDMASAFE_ACK_DEADLINE_MS` as the environment has it: `Ok(None)` unset,
/// `Ok(Some(ms))` a number of milliseconds (blanks around it allowed),
/// `Err(value)` anything else, for which [`ack_deadline`] is the default
/// (and says so once, at warning level, unless [`set_ack_deadline`] came
/// first).
pub fn ack_deadline_env() -> std::result::Result<Option<u64>, String> {
    match std::env::var("RDMASAFE_ACK_DEADLINE_MS") {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(v.to_string_lossy().into_owned()),
        Ok(s) => s.trim().parse::<u64>().map(Some).map_err(|_| s),
    }
}

#[cold]
fn read_ack_deadline_env() -> u64 {
    let _ = ACK_DEADLINE_MS.compare_exchange(u64::MAX, env_ack_deadline_ms(true), Relaxed, Relaxed);
    ACK_DEADLINE_MS.load(Relaxed)
}

/// The deadline the environment sets (ms, below `u64::MAX`): the default
/// if unset or no number (said at warning level if `warn`).
fn env_ack_deadline_ms(warn: bool) -> u64 {
    let d = match ack_deadline_env() {
        Ok(ms) => ms.map_or(DEFAULT_ACK_DEADLINE, Duration::from_millis),
        Err(v) => {
            if warn {
                log::warn!(
                    target: "rdmasafe",
                    "RDMASAFE_ACK_DEADLINE_MS={v:?} is no number of milliseconds: the default, {} ms",
                    DEFAULT_ACK_DEADLINE.as_millis()
                );
            }
            DEFAULT_ACK_DEADLINE
        }
    };
    d.as_millis().min(u64::MAX as u128 - 1) as u64
}

/// Sets [`ack_deadline`] for gets from now on; returns the previous value.
/// Set before any get, the environment's value is never used: the
/// previous value returned is then what it would have been (the default
/// for one that is no number, which is then not warned of).
pub fn set_ack_deadline(d: Duration) -> Duration {
    match ACK_DEADLINE_MS.swap(d.as_millis().min(u64::MAX as u128 - 1) as u64, Relaxed) {
        u64::MAX => Duration::from_millis(env_ack_deadline_ms(false)),
        old => Duration::from_millis(old),
    }
}

/// The shortest ack deadline any copy was held with (ms): the reaper scans
/// four times per that deadline (at most every 250 ms).
static SHORTEST_DEADLINE_MS: AtomicU64 = AtomicU64::new(u64::MAX);

/// Originals held now (deferred and not acked yet).
fn held_originals() -> u64 {
    let acked = ACKED_AT_FREE.load(SeqCst) + ACKED_AT_DEADLINE.load(SeqCst);
    DEFERRED.load(SeqCst).saturating_sub(acked)
}

/// Acks originals whose deadline passed: one lazily started thread that
/// scans the slots (O(slots ever allocated), a few times per deadline)
/// for held originals past their deadline. A get that holds an original
/// touches nothing of it but two atomics (`state`, `idle`) in the common
/// case: no lock, no queue, no system call. An original is acked at most a
/// quarter of the shortest deadline used so far (1 to 250 ms) after its own
/// deadline, or up to 250 ms after it while the thread ends a sleep begun
/// before a deadline shorter than any before was first used (as the C
/// API's `rdmasafe_cm_set_ack_deadline` says). After [`IDLE_SCANS`] scans
/// without any original held, the thread parks until the next get that
/// holds one unparks it.
///
/// Its state lives in a page the kernel zeroes in a forked child
/// (`MADV_WIPEONFORK`), and all zeros is "not started": the thread does
/// not survive a fork, so a child starts its own at its next get with a
/// deadline (it would otherwise hold originals with nobody to keep their
/// deadlines). Where that page cannot be made (a kernel before 4.14, no
/// memory), a static that a `pthread_atfork` child handler sets to all
/// zeros: the same for a child of `fork()` (one made by the raw system
/// call runs no handler, and keeps no deadlines).
struct Reaper {
    /// [`NOT_STARTED`], [`STARTING`] or [`RUNNING`].
    state: AtomicU8,
    /// The thread parks until a get holds an original.
    idle: AtomicBool,
    /// The running thread's handle (stored by the thread, leaked: one per
    /// thread ever started in the process, see [`leak_handle`]), to
    /// unpark it.
    thread: AtomicPtr<std::thread::Thread>,
}

/// A reaper thread's handle, leaked, on the list of [`HANDLES`].
struct Handle {
    thread: std::thread::Thread,
    next: *mut Handle,
}

/// Every reaper thread's handle made in the process (a forked child's
/// list goes on from its parent's). Only so that a leak checker sees them
/// reachable: the [`Reaper`] that points to its thread's lives in a page
/// LeakSanitizer does not scan, and an application built with
/// AddressSanitizer exited with status 1 ("8 bytes leaked") once a release
/// librdmasafe.so had started the thread.
static HANDLES: AtomicPtr<Handle> = AtomicPtr::new(std::ptr::null_mut());

/// Leaks `thread` onto [`HANDLES`]; its address, valid for the process.
fn leak_handle(thread: std::thread::Thread) -> *mut std::thread::Thread {
    let node = Box::into_raw(Box::new(Handle { thread, next: std::ptr::null_mut() }));
    let mut head = HANDLES.load(Acquire);
    loop {
        // SAFETY: `node` is this call's alone until the exchange publishes it.
        unsafe { (*node).next = head };
        match HANDLES.compare_exchange_weak(head, node, AcqRel, Acquire) {
            Ok(_) => break,
            Err(now) => head = now,
        }
    }
    // SAFETY: `node` is leaked (never freed): valid for the process.
    unsafe { &raw mut (*node).thread }
}

const NOT_STARTED: u8 = 0;
const STARTING: u8 = 1;
const RUNNING: u8 = 2;

/// Scans with nothing held before the reaper goes idle.
const IDLE_SCANS: u32 = 8;

#[inline]
fn reaper() -> &'static Reaper {
    static R: AtomicPtr<Reaper> = AtomicPtr::new(std::ptr::null_mut());
    let p = R.load(Acquire);
    if p.is_null() {
        return init_reaper(&R);
    }
    // SAFETY: set once, by init_reaper, to a Reaper that lives (and is
    // valid: all zeros is a valid Reaper) for the process's life.
    unsafe { &*p }
}

impl Reaper {
    /// All zeros: not started, not idle, no thread (what a wiped page
    /// reads as).
    const fn zero() -> Reaper {
        Reaper { state: AtomicU8::new(0), idle: AtomicBool::new(false), thread: AtomicPtr::new(std::ptr::null_mut()) }
    }

    /// Back to [`Reaper::zero`]. Atomic stores only: async-signal-safe.
    fn reset(&self) {
        let Reaper { state, idle, thread } = self;
        state.store(0, Relaxed);
        idle.store(false, Relaxed);
        thread.store(std::ptr::null_mut(), Relaxed);
    }
}

/// The reaper where no wipe-on-fork page can be made.
static FALLBACK_REAPER: Reaper = Reaper::zero();

/// In a child of `fork()`: [`FALLBACK_REAPER`] as a wiped page would be
/// (its thread was not forked).
unsafe extern "C" fn fallback_reaper_forked() {
    FALLBACK_REAPER.reset();
}

#[cold]
fn init_reaper(r: &AtomicPtr<Reaper>) -> &'static Reaper {
    const _: () = assert!(std::mem::size_of::<Reaper>() <= 4096);
    let fresh = match sys::wipe_on_fork_page() {
        Some(page) => page.as_ptr().cast::<Reaper>(),
        None => {
            // Registered once: only the first call gets here (the pointer
            // set below is never null again), or racing first calls (a
            // second registration resets the same zeros again).
            if sys::at_fork_child(fallback_reaper_forked) {
                log::debug!(target: "rdmasafe", "no wipe-on-fork page: a fork handler resets the CM ack thread's state");
            } else {
                log::warn!(target: "rdmasafe", "no wipe-on-fork page, no fork handler: a forked child keeps no CM ack deadlines");
            }
            std::ptr::from_ref(&FALLBACK_REAPER).cast_mut()
        }
    };
    // A racing first call may win: its Reaper is the one (ours, a page,
    // stays mapped and unused).
    let p = match r.compare_exchange(std::ptr::null_mut(), fresh, AcqRel, Acquire) {
        Ok(_) => fresh,
        Err(won) => won,
    };
    // SAFETY: a zeroed page (a valid Reaper: atomics are their integers and
    // pointer, zero is "not started", not idle, no thread), or the static;
    // never unmapped.
    unsafe { &*p }
}

/// Makes sure the deadline thread runs, before a get takes an event whose
/// original it will hold: ENOMEM if the thread cannot be started (the get
/// then fails before it takes anything, rather than hold an original with
/// no deadline).
#[inline]
pub(crate) fn ensure_deadline_thread() -> crate::Result<()> {
    let r = reaper();
    if r.state.load(Acquire) == RUNNING {
        return Ok(());
    }
    r.start()
}

impl Reaper {
    /// An original is held: wake the thread if it sleeps (started by
    /// [`ensure_deadline_thread`] before the get).
    #[inline]
    fn kick(&'static self) {
        if self.state.load(Relaxed) != RUNNING {
            // Every hold comes after ensure_deadline_thread; only a child
            // forked (from a signal handler) in between gets here.
            let _ = self.start();
            return;
        }
        // SeqCst: after the DEFERRED increment (hold_original), paired with
        // the thread's store of `idle` and its load of DEFERRED: either it
        // sees the original, or this sees it idle and wakes it.
        if self.idle.load(SeqCst) {
            self.wake();
        }
    }

    #[cold]
    fn start(&'static self) -> crate::Result<()> {
        // On the app's thread, inside a get that catches panics (no forced
        // unwind may cross it): the sleep below, the spawn and the log are
        // no cancellation points here (a cancellation pending or arriving
        // now is acted on at the get's own cancellable wait).
        let _no_cancel = crate::sys::cancel::CancelDisabled::new();
        loop {
            match self.state.compare_exchange(NOT_STARTED, STARTING, Acquire, Acquire) {
                Ok(_) => break,
                Err(RUNNING) => return Ok(()),
                // Another get is starting it: wait for the outcome (a sleep,
                // not a spin: the starter may have a lower priority). A start
                // cut off by a fork is not seen here: the child's state is
                // wiped (or reset by the fork handler).
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        match crate::sys::spawn_signals_blocked("rdmasafe-ack", move || self.run()) {
            Ok(_) => {
                self.state.store(RUNNING, Release);
                Ok(())
            }
            Err(e) => {
                self.state.store(NOT_STARTED, Release);
                // Once per process: an app may retry its get in a loop.
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Relaxed) {
                    log::warn!(
                        target: "rdmasafe",
                        "cannot start the CM ack deadline thread ({e}): gets that would hold an original fail \
                         with ENOMEM until it can (or set the deadline to 0)"
                    );
                }
                Err(crate::Error::new("rdmasafe: starting the CM ack deadline thread", libc::ENOMEM))
            }
        }
    }

    #[cold]
    fn wake(&self) {
        if self.idle.swap(false, SeqCst) {
            let t = self.thread.load(Acquire);
            // SAFETY: stored by the running thread before it ever set
            // `idle`, leaked, never freed.
            if let Some(t) = unsafe { t.as_ref() } {
                t.unpark();
            }
        }
    }

    fn tick() -> Duration {
        let shortest = SHORTEST_DEADLINE_MS.load(Relaxed);
        Duration::from_millis((shortest / 4).clamp(1, 250))
    }

    fn run(&self) {
        // Before `idle` is ever set: a wake finds the handle.
        self.thread.store(leak_handle(std::thread::current()), Release);
        let mut empty_scans = 0;
        loop {
            std::thread::sleep(Self::tick());
            scan(sys::coarse_now_ms());
            if held_originals() > 0 {
                empty_scans = 0;
                continue;
            }
            empty_scans += 1;
            if empty_scans < IDLE_SCANS {
                continue;
            }
            empty_scans = 0;
            self.idle.store(true, SeqCst);
            if held_originals() > 0 {
                // Held meanwhile; whoever held it may have seen `idle`
                // already (then its unpark just finds us running, and
                // leaves a token that ends a later park at once: harmless).
                self.idle.store(false, SeqCst);
                continue;
            }
            // An unpark before the park leaves a token: no wakeup is lost;
            // a spurious return finds `idle` still set.
            while self.idle.load(SeqCst) {
                std::thread::park();
            }
        }
    }
}

/// Acks every held original whose deadline is at or before `now`.
fn scan(now: u64) {
    let a = arena();
    for i in 0..a.allocated.load(Acquire) {
        let s = a.slot(i);
        let ack = s.ack.load(Acquire);
        if ack & 1 == 0 || s.deadline_ms.load(Relaxed) > now {
            continue;
        }
        if let Some((o, kept)) = s.claim_original(ack >> 1) {
            ACKED_AT_DEADLINE.fetch_add(1, SeqCst);
            // SAFETY: the original is un-acked (claimed just now), so
            // librdmacm still owns it: only rdma_ack_cm_event frees it.
            // Its fields are read, not the ids they point to.
            let (t, id) = unsafe { ((*o).event, (*o).id) };
            let t = super::EventType(t);
            // SAFETY: an un-acked original's type and id (see there).
            let librdmacms = kept || unsafe { held_by_librdmacm(t, id, s) };
            // SAFETY: claimed exactly once. Nothing reads it afterwards.
            unsafe { sys::ack_cm_event(o) };
            let (level, line) = if librdmacms && t == super::EventType::CONNECT_REQUEST {
                // Marked: got inside rdma_get_request, which keeps it as
                // the new id's current event until rdma_accept or the new
                // id's destroy acks it (rdma_reject does not). Its new id
                // may be gone by now: never read.
                let line = "CM event CONNECT_REQUEST that librdmacm's rdma_get_request keeps for its new id was \
                            neither accepted nor destroyed within the ack deadline: acked its original, so \
                            rdma_destroy_id of the listen id no longer waits for it (harmless for a server \
                            still setting the connection up, which accepts it later; a new id rejected and \
                            never destroyed leaks)"
                    .to_string();
                (log::Level::Info, line)
            } else if librdmacms {
                let line = format!(
                    "CM event {t} (id {id:p}) is librdmacm's own current event of a synchronous id \
                     (rdma_create_ep, rsockets), kept past the ack deadline: acked its original (harmless: \
                     librdmacm frees its copy itself, before it destroys the id)"
                );
                (log::Level::Debug, line)
            } else {
                // A request is charged to its listen id: the listen id's
                // destroy waited for it, never the new id's.
                let (waited, field) = if t == super::EventType::CONNECT_REQUEST {
                    ("the listen id", "ev->listen_id")
                } else {
                    ("the id", "ev->id")
                };
                let line = format!(
                    "a copy of CM event {t} (id {id:p}) was held past its ack deadline: acked librdmacm's \
                     original, so rdma_destroy_id / rdma_migrate_id of {waited} no longer wait for it (the \
                     copy stays valid; its {field} may be destroyed from now on)"
                );
                (if WARNED_LATE.replace(true) { log::Level::Debug } else { log::Level::Warn }, line)
            };
            if log::log_enabled!(target: "rdmasafe", level) {
                log_off_the_reaper(level, line);
            }
        }
    }
}

thread_local! {
    /// A copy held past its deadline was warned of (later ones: debug
    /// lines). The reaper's thread's: one per process, and a forked
    /// child's own thread warns again.
    static WARNED_LATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True if the copy in `slot` is what librdmacm keeps as `id`'s current
/// event ([`sys::current_event`]: a synchronous id's own get, which an
/// LD_PRELOAD makes a copy). Not an app's late free. A fallback, looked at
/// the deadline, behind the mark taken at the hold (`kept_by_librdmacm`):
/// a copy stored into `id->event` by a get whose destination the hold was
/// not told. No such path of librdmacm is known today (`ucma_complete` is
/// marked by its destination, the gets inside `rdma_get_request` as
/// [`CopyDestination::Librdmacm`]); one would be missed by this look
/// while its getter has not stored the copy yet.
///
/// Never true for a CONNECT_REQUEST, whose `id` (the new id) is not read:
/// librdmacm charges a request to the *listen* id (`rdma_ack_cm_event`
/// completes it on the listen id; the kernel counts it in the listen id's
/// `events_reported`), so `rdma_destroy_id` of the new id does not wait
/// for the un-acked original, and the app may reject and destroy the new
/// id while it holds the copy: the id's memory is freed (valgrind: an
/// invalid read here, "inside a block ... free'd by rdma_destroy_id").
/// The listen id is alive, but a request is never its current event
/// (`rdma_get_request` keeps it as the *new* id's, until `rdma_accept` or
/// the new id's destroy), so it tells nothing. Such a request held past
/// the deadline by a synchronous server (under an LD_PRELOAD, between
/// `rdma_get_request` and `rdma_accept`) is known instead by the mark of
/// each get made inside `rdma_get_request` ([`CopyDestination::Librdmacm`]).
///
/// # Safety
/// `t` and `id` are `event` and `id` of an original the caller holds
/// un-acked (claimed, acked after this call): then `id` is NULL, or a live
/// id, or (a CONNECT_REQUEST's only) possibly freed, never read.
unsafe fn held_by_librdmacm(t: super::EventType, id: *mut sys::rdma_cm_id, slot: &Slot) -> bool {
    if id.is_null() || t == super::EventType::CONNECT_REQUEST {
        return false;
    }
    // SAFETY: every other event librdmacm charges to its own id
    // (`ev->id`, also for MULTICAST_JOIN / MULTICAST_ERROR: the multicast's
    // id): `rdma_destroy_id` (and `rdma_migrate_id`) of that id waits until
    // the event is acked, and the caller has not acked it, so the id is
    // not freed before the caller's ack.
    std::ptr::eq(unsafe { sys::current_event(id) }.cast::<Slot>(), slot)
}

/// Where the C caller of a get puts the copy, as far as it knows: what
/// tells librdmacm's own holds from a program's. An original held past the
/// ack deadline that librdmacm keeps itself (an LD_PRELOAD makes its gets
/// copies) is acked with a debug or info line, a program's late free with
/// a warning. Marked at the hold, before the deadline thread can see the
/// original (see `ChannelRef::get_raw_cancellable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDestination {
    /// The `event` out-pointer of the caller's get (NULL: not known):
    /// librdmacm's own when it is the event's id's own `event` field, where
    /// librdmacm's synchronous calls keep an event (`ucma_complete` passes
    /// `&id->event`) until their next call on the id or its destroy. Only
    /// the address is compared, never followed.
    Out(*mut *mut rdma_cm_event),
    /// A get librdmacm makes inside `rdma_get_request`, into storage no
    /// caller can name: it keeps the connect request as the new id's
    /// current event until `rdma_accept` or the new id's destroy acks it
    /// (`rdma_reject` does not), and an error event as the listen id's.
    Librdmacm,
}

/// True if a get of `ev` stores it at `dest`, the `event` field of `ev`'s
/// own id: how librdmacm's synchronous calls keep it
/// ([`CopyDestination::Out`]). An address computed, nothing read through
/// it. Never for a CONNECT_REQUEST: its id (the new one) did not exist
/// before the get, so no caller can have named its field (and that id may
/// be destroyed while the copy is held: see [`held_by_librdmacm`]).
fn into_its_ids_own_field(ev: &rdma_cm_event, dest: *mut *mut rdma_cm_event) -> bool {
    !dest.is_null()
        && !ev.id.is_null()
        && ev.event != super::EventType::CONNECT_REQUEST.0
        && std::ptr::eq(
            dest.cast::<u8>(),
            ev.id.cast::<u8>().wrapping_add(std::mem::offset_of!(sys::rdma_cm_id, event)),
        )
}

/// Lines of the reaper waiting for [`log_off_the_reaper`]'s thread.
const REAPER_LINES: usize = 256;

/// Writes a line of the reaper's on a thread of its own (started at the
/// first line): the app's log callback may block, e.g. on an app lock that
/// a thread in `rdma_destroy_id` holds, and that destroy (or any other
/// one) may be waiting for the reaper's next ack. The reaper never waits
/// for a log callback. A line that finds [`REAPER_LINES`] waiting (a
/// callback blocked that long), or no thread, is dropped. Called by the
/// reaper's thread only: the writer is that thread's (a forked child,
/// which has neither, starts both anew; a writer inherited through a
/// static would take the child's lines and never write them).
fn log_off_the_reaper(level: log::Level, line: String) {
    type Lines = std::sync::mpsc::SyncSender<(log::Level, String)>;
    thread_local! {
        static LINES: OnceCell<Option<Lines>> = const { OnceCell::new() };
    }
    LINES.with(|lines| {
        let lines = lines.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<(log::Level, String)>(REAPER_LINES);
            let writer = move || {
                for (level, line) in rx {
                    log::log!(target: "rdmasafe", level, "{line}");
                }
            };
            crate::sys::spawn_signals_blocked("rdmasafe-cm-log", writer).ok().map(|_| tx)
        });
        if let Some(tx) = lines {
            let _ = tx.try_send((level, line));
        }
    });
}

/// Allocates slots up front so that the next `n` copies (at most
/// [`FREE_LIST_CAPACITY`]) allocate nothing, the quarantine included: they
/// are taken before the free list, whose slots may still be in their
/// quarantine (just freed), and [`QUARANTINE`] more cover the copies made
/// while the first ones freed come out of theirs.
/// Returns how many copies can be taken now without allocating.
pub fn reserve(n: usize) -> usize {
    let a = arena();
    let n = n.min(FREE_LIST_CAPACITY);
    let want = n + QUARANTINE;
    // Free slots out of their quarantine first, new ones only when there
    // are none: a reserve per get or per burst reuses the slots the copies
    // before it freed instead of growing the arena. A fixed number of
    // rounds: getters taking from `ready` meanwhile cannot keep it going.
    let mut failed = false;
    for _ in 0..want.saturating_sub(a.ready.len()) {
        if a.ready.len() >= want {
            break;
        }
        let Some(i) = a.pop_free().or_else(|| a.new_slot()) else {
            failed = true;
            break;
        };
        if let Err(i) = a.ready.push(i) {
            a.push_free(i);
            break;
        }
    }
    let got = a.ready.len().saturating_sub(QUARANTINE);
    // Only a failed allocation reports fewer than asked: what other
    // threads took meanwhile was theirs to take.
    if failed {
        got
    } else {
        got.max(n)
    }
}

/// Process-wide figures about event copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Events copied since the process started.
    pub copied: u64,
    /// Copies freed.
    pub freed: u64,
    /// Copies alive now (`copied - freed`).
    pub outstanding: u64,
    /// Most copies alive at once so far.
    pub high_water: u64,
    /// Age in milliseconds of the oldest copy alive now (0 without any).
    pub oldest_age_ms: u64,
    /// Slots ever allocated; flat in steady state.
    pub slots_allocated: u64,
    /// Copies whose librdmacm original was kept un-acked (the barrier of
    /// app channels, see [`ack_deadline`]).
    pub acks_deferred: u64,
    /// Of those, originals acked when their copy was freed.
    pub acked_at_free: u64,
    /// Of those, originals acked because the deadline passed first (under
    /// an LD_PRELOAD also librdmacm's own current events of synchronous
    /// ids, `rdma_create_ep` and rsockets, kept for a connection's life:
    /// harmless, logged at debug level, not warned of).
    pub acked_at_deadline: u64,
    /// Gets refused with ENOBUFS by [`set_limit`].
    pub refused_at_limit: u64,
}

/// Reads the process-wide counters (never blocks; the oldest copy's age is
/// found by a scan of every slot ever allocated, [`Counters::slots_allocated`]:
/// [`reserve`] raises it beyond [`Counters::high_water`]).
pub fn counters() -> Counters {
    let a = arena();
    let now = sys::coarse_now_ms();
    let oldest = (0..a.allocated.load(Acquire))
        .map(|i| a.slot(i))
        .filter(|s| s.state.load(Relaxed) != FREE)
        .map(|s| s.copied_at_ms.load(Relaxed))
        .filter(|t| *t != 0)
        .min();
    let freed = FREED.load(Relaxed);
    let copied = COPIED.load(Relaxed);
    Counters {
        copied,
        freed,
        outstanding: copied.saturating_sub(freed),
        high_water: HIGH_WATER.load(Relaxed),
        oldest_age_ms: oldest.map_or(0, |t| now.saturating_sub(t)),
        slots_allocated: ALLOCATED.load(Relaxed),
        acks_deferred: DEFERRED.load(Relaxed),
        acked_at_free: ACKED_AT_FREE.load(Relaxed),
        acked_at_deadline: ACKED_AT_DEADLINE.load(Relaxed),
        refused_at_limit: REFUSED.load(Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_page_friendly() {
        assert_eq!(STRIDE % 64, 0);
        assert_eq!((STRIDE * CHUNK_SLOTS) % 4096, 0, "chunks commit whole pages");
    }

    /// A slot taken and marked as a copy, as a get that copied an event.
    fn copy() -> SlotBox {
        let mut s = take().unwrap();
        let _ = s.mark_copied();
        s
    }

    /// Empties the free list (the ring, its overflow and `ready`) for a
    /// test that needs to know what is in it; `restore` puts it back.
    fn drain_free_list() -> Vec<u32> {
        let a = arena();
        let mut all: Vec<u32> = std::iter::from_fn(|| a.free.pop()).collect();
        all.extend(a.overflow.lock().drain(..));
        a.overflow_len.store(0, Relaxed);
        all.extend(std::iter::from_fn(|| a.take_ready()));
        all
    }

    fn restore(drained: Vec<u32>) {
        let a = arena();
        for i in drained {
            a.push_free(i);
        }
    }

    /// A freed slot stays out of circulation for QUARANTINE other copies,
    /// and a pointer to a free slot is never taken back from C.
    #[test]
    fn quarantine_and_stale_pointers() {
        let _g = crate::cm::tests_lock();
        let first = copy();
        let p = first.into_c();
        let back = SlotBox::from_c(p).expect("a live C copy is taken back");
        assert!(SlotBox::from_c(p).is_none(), "the same pointer twice: refused");
        drop(back);
        assert!(SlotBox::from_c(p).is_none(), "a freed copy: refused");
        let mut held = Vec::new();
        for _ in 0..QUARANTINE {
            let s = copy();
            assert_ne!(s.0 as *const Slot as *const rdma_cm_event, p as *const _, "reused inside the quarantine");
            held.push(s.into_c());
        }
        assert!(SlotBox::from_c(p).is_none(), "still free after {QUARANTINE} other copies");
        for h in held {
            drop(SlotBox::from_c(h).unwrap());
        }
    }

    /// The quarantine counts copies made since the free, not slots queued
    /// behind it: with the free list empty, QUARANTINE + 1 copies freed in
    /// a row and one more get must not hand out the first one's slot (it
    /// did when reuse waited for QUARANTINE slots behind it).
    #[test]
    fn quarantine_counts_copies_not_queued_slots() {
        let _g = crate::cm::tests_lock();
        let drained = drain_free_list();
        let copies: Vec<_> = (0..=QUARANTINE).map(|_| copy().into_c()).collect();
        for &c in &copies {
            drop(SlotBox::from_c(c).unwrap());
        }
        let next = copy().into_c();
        assert_ne!(next, copies[0], "the first freed slot handed out again with no copy in between");
        assert!(SlotBox::from_c(copies[0]).is_none(), "a stale pointer freed again: refused");
        assert!(SlotBox::peek_c(next).is_some(), "the new copy is still alive");
        drop(SlotBox::from_c(next).unwrap());
        restore(drained);
    }

    /// Gets that fail (a slot taken, no copy made) neither age the
    /// quarantine nor make new slots: after a free, 2 * QUARANTINE + 1
    /// failed gets and then one copy, the freed slot is still free (with a
    /// FIFO that failed gets cycled, it was at the head by then).
    #[test]
    fn failed_gets_do_not_age_the_quarantine() {
        let _g = crate::cm::tests_lock();
        let drained = drain_free_list();
        let p = copy().into_c();
        drop(SlotBox::from_c(p).unwrap());
        let before = ALLOCATED.load(Relaxed);
        for _ in 0..2 * QUARANTINE + 1 {
            drop(take().unwrap());
        }
        assert!(ALLOCATED.load(Relaxed) - before <= 1, "failed gets made new slots");
        let next = copy().into_c();
        assert_ne!(next, p, "a slot handed out again after failed gets only");
        assert!(SlotBox::from_c(p).is_none(), "a stale pointer freed again: refused");
        drop(SlotBox::from_c(next).unwrap());
        restore(drained);
    }

    /// A reserve before every get, or before every burst of gets, reuses
    /// the slots the copies before it freed: the arena stays bounded (it
    /// grew by one slot per reserved copy when reserve made new slots only).
    #[test]
    fn reserve_reuses_freed_slots() {
        let _g = crate::cm::tests_lock();
        for _ in 0..200 {
            assert!(reserve(1) >= 1);
            drop(copy());
        }
        let before = ALLOCATED.load(Relaxed);
        for _ in 0..5_000 {
            assert!(reserve(1) >= 1);
            drop(copy());
        }
        let grown = ALLOCATED.load(Relaxed) - before;
        assert!(grown <= QUARANTINE as u64, "a reserve per get made {grown} new slots in 5,000 gets");
        let before = ALLOCATED.load(Relaxed);
        for _ in 0..10 {
            assert!(reserve(500) >= 500);
            let burst: Vec<_> = (0..500).map(|_| copy()).collect();
            drop(burst);
        }
        let grown = ALLOCATED.load(Relaxed) - before;
        // At most two bursts' worth: the last burst's slots are still in
        // their quarantine when the next reserve runs.
        assert!(grown <= 2 * (500 + QUARANTINE) as u64, "10 bursts of 500 made {grown} new slots");
    }

    #[test]
    fn foreign_pointers_are_refused_by_arithmetic() {
        let _g = crate::cm::tests_lock();
        let x = [0u64; 64];
        assert!(SlotBox::from_c(x.as_ptr().cast()).is_none());
        let s = take().unwrap();
        let p = s.into_c();
        // Inside the arena, not on a slot boundary.
        assert!(SlotBox::from_c((p as *const u8).wrapping_add(8).cast()).is_none());
        assert!(SlotBox::peek_c(p).is_some());
        drop(SlotBox::from_c(p).unwrap());
        assert!(SlotBox::peek_c(p).is_none());
    }

    /// The free list's ring: FIFO, full and empty at the right moments,
    /// across many laps, and every entry out exactly once with many
    /// threads at once.
    #[test]
    fn free_ring_fifo_and_concurrent() {
        let cells = || Box::leak(Box::new([const { AtomicU64::new(0) }; RING]));
        let r = FreeRing::<RING>::new(cells());
        assert_eq!(r.pop(), None);
        for lap in 0..5u32 {
            for i in 0..RING as u32 {
                assert_eq!(r.push(lap * 7 + i), Ok(()));
            }
            assert_eq!(r.push(1), Err(1), "full");
            assert_eq!(r.len(), RING);
            for i in 0..RING as u32 {
                assert_eq!(r.pop(), Some(lap * 7 + i));
            }
            assert_eq!(r.pop(), None, "empty");
        }
        let r = std::sync::Arc::new(FreeRing::<RING>::new(cells()));
        let per = 20_000u32;
        let seen: Vec<u32> = std::thread::scope(|sc| {
            for t in 0..2u32 {
                let r = r.clone();
                sc.spawn(move || {
                    for i in 0..per {
                        while r.push(t * per + i).is_err() {
                            std::thread::yield_now();
                        }
                    }
                });
            }
            let poppers: Vec<_> = (0..2)
                .map(|_| {
                    let r = r.clone();
                    sc.spawn(move || {
                        let mut got = Vec::new();
                        while got.len() < per as usize {
                            match r.pop() {
                                Some(i) => got.push(i),
                                None => std::thread::yield_now(),
                            }
                        }
                        got
                    })
                })
                .collect();
            poppers.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut seen = seen;
        seen.sort_unstable();
        assert!(seen.iter().copied().eq(0..2 * per), "every entry exactly once");
        assert_eq!(r.pop(), None);
    }

    /// A leaked ring of eight cells, for the mending tests.
    fn small_ring() -> &'static FreeRing<8> {
        Box::leak(Box::new(FreeRing::<8>::new(Box::leak(Box::new([const { AtomicU64::new(0) }; 8])))))
    }

    /// `f(ring)` on another thread, its result back here. A watchdog, not
    /// a timing: a pop or push that waits for good fails the test.
    fn within_a_minute<T: Send + 'static>(r: &'static FreeRing<8>, f: fn(&FreeRing<8>) -> T) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f(r)).unwrap());
        rx.recv_timeout(Duration::from_secs(60)).expect("no pop or push waits for good")
    }

    /// Every entry popped until the ring says empty.
    fn pop_all(r: &FreeRing<8>) -> Vec<u32> {
        std::iter::from_fn(|| r.pop()).collect()
    }

    /// A child's ring, forked while one thread of the parent had claimed
    /// a position for its push and not filled it yet, and another had
    /// taken an entry and not released its cell yet: once mended, pops go
    /// on past the unfilled position (before: they waited for good), and
    /// all eight cells take pushes again (before: the unreleased one
    /// looked full).
    #[test]
    fn a_childs_ring_is_mended_from_its_parents_half_done_steps() {
        let r = small_ring();
        for i in [1, 2, 3] {
            r.push(i).unwrap();
        }
        assert_eq!(r.pop(), Some(1));
        // A push claims position 3 and stops; a later one fills 4.
        r.tail.fetch_add(1, Relaxed);
        r.push(5).unwrap();
        // A pop claims position 1 (entry 2) and stops before its release.
        r.head.fetch_add(1, Relaxed);
        // SAFETY: no other thread uses the ring.
        unsafe { r.after_fork_in_child() };
        let (got, pushed, refused, again) = within_a_minute(r, |r| {
            let got = pop_all(r);
            let pushed = (10..18).map(|i| r.push(i)).filter(Result::is_ok).count();
            (got, pushed, r.push(99).is_err(), pop_all(r))
        });
        assert_eq!(got, [3, 5], "the entries there, in order");
        assert_eq!(pushed, 8, "every cell takes a push");
        assert!(refused, "and then it is full");
        assert!(again.iter().copied().eq(10..18), "FIFO: {again:?}");
        // Mending a ring with nothing half-done changes nothing.
        for i in [20, 21] {
            r.push(i).unwrap();
        }
        // SAFETY: as above.
        unsafe { r.after_fork_in_child() };
        assert_eq!(pop_all(r), [20, 21]);
    }

    /// The forking thread's own push, cut short by the signal handler that
    /// forked, goes on in the child after the mending: its entry is there
    /// (found by a review: a mending that moved `tail` back made the next
    /// push spin for good). Had a pop passed its position first, the entry
    /// is lost, and nothing waits.
    #[test]
    fn the_forking_threads_own_push_goes_on_after_the_mending() {
        let r = small_ring();
        r.push(1).unwrap();
        let pos = r.tail.fetch_add(1, Relaxed);
        // SAFETY: no other thread uses the ring.
        unsafe { r.after_fork_in_child() };
        // The push goes on: it fills its claimed position.
        r.cell(pos).store(((pos as u32).wrapping_add(1) as u64) << 32 | 7, Release);
        let (got, pushed, again) = within_a_minute(r, |r| {
            let got = pop_all(r);
            let pushed = (10..18).map(|i| r.push(i)).filter(Result::is_ok).count();
            (got, pushed, pop_all(r))
        });
        assert_eq!(got, [1, 7]);
        assert_eq!(pushed, 8);
        assert!(again.iter().copied().eq(10..18), "FIFO: {again:?}");
        // This time a pop of the child passes the hole before the push
        // goes on.
        let pos = r.tail.fetch_add(1, Relaxed);
        // SAFETY: as above.
        unsafe { r.after_fork_in_child() };
        assert_eq!(r.pop(), None);
        r.cell(pos).store(((pos as u32).wrapping_add(1) as u64) << 32 | 7, Release);
        let (pushed, got) = within_a_minute(r, |r| {
            let pushed = (10..30).map(|i| r.push(i)).filter(Result::is_ok).count();
            (pushed, pop_all(r))
        });
        assert!(pushed < 8, "full at the cell the push filled late: {pushed}");
        assert!(got.iter().copied().eq(10..10 + pushed as u32), "{got:?}");
    }

    #[test]
    fn private_data_tail_is_zeroed_on_reuse() {
        let _g = crate::cm::tests_lock();
        let mut s = take().unwrap();
        s.set_data(&[0xee; 196]);
        s.set_data(&[0x11; 56]);
        assert!(s.data()[..56].iter().all(|b| *b == 0x11));
        assert!(s.data()[56..].iter().all(|b| *b == 0), "bytes past the data read 0");
        s.clear_data();
        assert!(s.data().iter().all(|b| *b == 0));
    }
}
