//! Handles the C app holds for rdmasafe objects (loops): a value that
//! encodes a table index and a generation, never a pointer to the object.
//!
//! * A handle is looked up, never trusted: any value is safe to pass; one
//!   that does not name a live object is EINVAL.
//! * A destroyed object's handle can never reach a newer object: the
//!   table cell's generation changes on destroy, and the handle carries the
//!   generation it was made with. A handle is `generation << 13 | cell + 1`
//!   (4,096 cells): 2^51 - 1 generations per cell before one comes back,
//!   some 70 years of a million creates and destroys a second in one cell
//!   (a 32-bit generation came back after 2^32 - 1, a day of one loop
//!   created and destroyed at a time).
//! * Lookups take no lock (two atomics); destroy waits until lookups in
//!   flight on other threads are done before it frees. A destroy on a
//!   thread that is itself still inside a call on the same object (a log
//!   callback run by that call) cannot wait for it: EDEADLK. For that, a
//!   thread remembers the cells it is inside calls on (a few, in a
//!   thread-local); [`Table::enter_signal_safe`] skips that (no
//!   thread-local in a signal handler).

use std::cell::Cell as StdCell;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Objects alive at once, at most.
const CELLS: usize = 4096;

/// The handle's low bits: the cell's index + 1 (1..=CELLS).
const INDEX_BITS: u32 = 13;

/// The last generation (what a handle's other bits hold: 2^51 - 1 on a
/// 64-bit target); the one after it is 1.
const GEN_MAX: u64 = (1 << (usize::BITS - INDEX_BITS)) - 1;

struct Cell<T> {
    gen: AtomicU64,
    users: AtomicU32,
    obj: AtomicPtr<T>,
}

pub(crate) struct Table<T> {
    cells: OnceLock<Box<[Cell<T>]>>,
    free: Mutex<Vec<u32>>,
}

/// Nested calls one thread can be inside at once and still be told apart
/// (deeper ones are not remembered: their destroy waits as another
/// thread's would).
const HELD: usize = 8;

thread_local! {
    /// Addresses of the cells this thread is inside calls on (0: free).
    static INSIDE: StdCell<[usize; HELD]> = const { StdCell::new([0; HELD]) };
}

/// Remembers that this thread is inside a call on `cell`; false when the
/// list is full (not remembered).
fn note_inside(cell: usize) -> bool {
    INSIDE.with(|c| {
        let mut v = c.get();
        let Some(free) = v.iter().position(|&x| x == 0) else { return false };
        v[free] = cell;
        c.set(v);
        true
    })
}

fn forget_inside(cell: usize) {
    INSIDE.with(|c| {
        let mut v = c.get();
        if let Some(i) = v.iter().position(|&x| x == cell) {
            v[i] = 0;
            c.set(v);
        }
    });
}

/// Calls on `cell` this thread is inside.
fn times_inside(cell: usize) -> usize {
    INSIDE.with(|c| c.get().iter().filter(|&&x| x == cell).count())
}

/// An object looked up by its handle; the object stays alive while this
/// lives (destroy waits for it).
pub(crate) struct Entered<'a, T> {
    cell: &'a Cell<T>,
    obj: &'a T,
    /// The generation the handle was looked up with.
    gen: u64,
    /// Counted in this thread's [`INSIDE`].
    noted: bool,
}

/// Why [`Table::remove`] did not remove.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum NotRemoved {
    /// Another thread removed it first.
    Gone,
    /// This thread is inside another call on it (which would wait for
    /// this one while this one waits for it).
    Nested,
}

impl<T> std::ops::Deref for Entered<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.obj
    }
}

impl<T> Entered<'_, T> {
    /// This thread is inside another call on the same object too (one
    /// that may wait for this one: its remove would never return).
    pub(crate) fn nested(&self) -> bool {
        times_inside(self.cell.addr()) > usize::from(self.noted)
    }
}

impl<T> Cell<T> {
    /// The cell's address: what a thread notes it is inside calls on.
    fn addr(&self) -> usize {
        self as *const Cell<T> as usize
    }
}

impl<T> Drop for Entered<'_, T> {
    fn drop(&mut self) {
        if self.noted {
            forget_inside(self.cell.addr());
        }
        self.cell.users.fetch_sub(1, SeqCst);
    }
}

fn split(h: usize) -> Option<(usize, u64)> {
    let v = h as u64;
    let idx = (v & ((1 << INDEX_BITS) - 1)) as usize;
    (1..=CELLS).contains(&idx).then(|| (idx - 1, v >> INDEX_BITS))
}

/// The generation after `gen` (never 0, which no handle carries).
fn next_gen(gen: u64) -> u64 {
    if gen >= GEN_MAX {
        1
    } else {
        gen + 1
    }
}

impl<T> Table<T> {
    pub(crate) const fn new() -> Table<T> {
        Table { cells: OnceLock::new(), free: Mutex::new(Vec::new()) }
    }

    fn cells(&self) -> &[Cell<T>] {
        self.cells.get_or_init(|| {
            *self.free.lock().unwrap_or_else(|e| e.into_inner()) = (0..CELLS as u32).rev().collect();
            (0..CELLS)
                .map(|_| Cell {
                    gen: AtomicU64::new(1),
                    users: AtomicU32::new(0),
                    obj: AtomicPtr::new(std::ptr::null_mut()),
                })
                .collect()
        })
    }

    /// Stores `obj`; returns its handle, or `None` when the table is full.
    pub(crate) fn insert(&self, obj: Box<T>) -> Option<usize> {
        let cells = self.cells();
        let i = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()? as usize;
        let cell = &cells[i];
        cell.obj.store(Box::into_raw(obj), SeqCst);
        let gen = cell.gen.load(SeqCst);
        Some((gen << INDEX_BITS | (i as u64 + 1)) as usize)
    }

    /// The object `h` names, if it is alive. Lock-free.
    pub(crate) fn enter(&self, h: usize) -> Option<Entered<'_, T>> {
        let mut e = self.enter_signal_safe(h)?;
        e.noted = note_inside(e.cell.addr());
        Some(e)
    }

    /// [`Table::enter`] without the thread-local note (for a signal
    /// handler: lock-free, no thread-local). A destroy from a call entered
    /// so is not seen as nested; such a call must not call back into code
    /// that may destroy the object.
    pub(crate) fn enter_signal_safe(&self, h: usize) -> Option<Entered<'_, T>> {
        let (i, gen) = split(h)?;
        let cell = self.cells.get()?.get(i)?;
        cell.users.fetch_add(1, SeqCst);
        let p = cell.obj.load(SeqCst);
        if cell.gen.load(SeqCst) != gen || p.is_null() {
            cell.users.fetch_sub(1, SeqCst);
            return None;
        }
        // SAFETY: the cell held `p` after we became a user, with the
        // handle's generation; destroy changes the generation first and
        // frees only once no user is left, so `p` stays valid while the
        // returned value (one user) lives.
        Some(Entered { cell, obj: unsafe { &*p }, gen, noted: false })
    }

    /// Makes `e`'s handle invalid (later lookups fail), waits until no
    /// other lookup is in flight (calls on other threads return), and
    /// returns the object. Nothing changes if this thread is inside
    /// another call on it ([`NotRemoved::Nested`]) or another thread
    /// removed it first ([`NotRemoved::Gone`]).
    pub(crate) fn remove(&self, e: Entered<'_, T>) -> Result<Box<T>, NotRemoved> {
        let cell = e.cell;
        if e.nested() {
            return Err(NotRemoved::Nested);
        }
        // From the generation `e` was looked up with: of two removes of one
        // object, the second finds it changed (it once read the current
        // one, changed already by the first, and both freed the object).
        if cell.gen.compare_exchange(e.gen, next_gen(e.gen), SeqCst, SeqCst).is_err() {
            return Err(NotRemoved::Gone);
        }
        // Cleared before the wait: a lookup that still finds the object is
        // counted in `users` (it adds itself before it reads `obj`) and
        // waited for; one that comes later finds none (cleared after the
        // wait, a lookup by a guessed handle of the next generation could
        // find the object after the wait, and use it once freed). Only the
        // remove that changed the generation clears it: `e`'s object.
        let p = cell.obj.swap(std::ptr::null_mut(), SeqCst);
        drop(e);
        if p.is_null() {
            return Err(NotRemoved::Gone);
        }
        // Calls in flight on other threads: most end within microseconds
        // (yield), a blocking one (a drain) takes longer (sleep: no spin).
        let mut waits = 0u32;
        while cell.users.load(SeqCst) != 0 {
            if waits < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
            waits = waits.saturating_add(1);
        }
        let i = (cell.addr() - self.cells().as_ptr() as usize) / std::mem::size_of::<Cell<T>>();
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(i as u32);
        // SAFETY: from Box::into_raw in insert (the object `e` entered);
        // this call changed the generation from `e`'s, once, and cleared
        // the cell, and no user is left: nobody else can reach it.
        Ok(unsafe { Box::from_raw(p) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destroyed_handle_never_reaches_the_next_object_in_its_cell() {
        static T: Table<u32> = Table::new();
        let a = T.insert(Box::new(1)).unwrap();
        assert_eq!(*T.enter(a).unwrap(), 1);
        assert_eq!(*T.remove(T.enter(a).unwrap()).unwrap(), 1);
        assert!(T.enter(a).is_none(), "destroyed");
        assert!(T.enter_signal_safe(a).is_none(), "destroyed");
        // The same cell again (LIFO free list): a new generation.
        let b = T.insert(Box::new(2)).unwrap();
        assert_eq!(split(a).unwrap().0, split(b).unwrap().0, "same cell");
        assert_ne!(a, b, "different handle");
        assert!(T.enter(a).is_none(), "the stale handle does not reach the new object");
        assert_eq!(*T.enter(b).unwrap(), 2);
        for bad in [0usize, 1 << 40, usize::MAX, 0x7ffd_1234_5678, CELLS + 1] {
            assert!(T.enter(bad).is_none(), "{bad:#x}");
        }
        assert_eq!(*T.remove(T.enter(b).unwrap()).unwrap(), 2);
    }

    /// One object created and destroyed at a time takes the same cell
    /// every time (LIFO free list): its handle must not come back after
    /// 2^32 - 1 destroys (it did, with a 32-bit generation: a stale handle
    /// reached the object of 2^32 - 1 destroys later, about a day of one
    /// loop per connection at 1,000 connections a second; found by a
    /// review).
    #[test]
    fn a_stale_handle_does_not_come_back_after_2_pow_32_destroys_of_its_cell() {
        static T: Table<u32> = Table::new();
        let first = T.insert(Box::new(1)).unwrap();
        let (cell, _) = split(first).unwrap();
        T.remove(T.enter(first).unwrap()).unwrap();
        // As after 2^32 - 3 more creates and destroys in that cell.
        T.cells()[cell].gen.store(u32::MAX.into(), SeqCst);
        let last = T.insert(Box::new(2)).unwrap();
        assert_eq!(split(last).unwrap().0, cell, "the same cell");
        T.remove(T.enter(last).unwrap()).unwrap();
        let next = T.insert(Box::new(3)).unwrap();
        assert_ne!(next, first, "the first handle came back");
        assert!(T.enter(first).is_none(), "a stale handle reached a newer object");
        assert_eq!(*T.enter(next).unwrap(), 3);
        T.remove(T.enter(next).unwrap()).unwrap();
    }

    /// Two threads inside calls on one object both remove it: one gets
    /// it, the other `Gone`. (Both got it, the second from the generation
    /// the first had just changed: a double free.)
    #[test]
    fn of_two_removes_of_one_object_one_gets_it() {
        static T: Table<u32> = Table::new();
        for _ in 0..100 {
            let a = T.insert(Box::new(9)).unwrap();
            let mine = T.enter(a).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let t = std::thread::spawn(move || {
                let theirs = T.enter(a).unwrap();
                tx.send(()).unwrap();
                T.remove(theirs).map(|b| *b)
            });
            rx.recv().unwrap();
            let here = T.remove(mine).map(|b| *b);
            let there = t.join().unwrap();
            let mut got = [here, there];
            got.sort();
            assert_eq!(got, [Ok(9), Err(NotRemoved::Gone)]);
            assert!(T.enter(a).is_none());
        }
    }

    #[test]
    fn a_remove_nested_in_a_call_on_the_same_object_is_refused_and_changes_nothing() {
        static T: Table<u32> = Table::new();
        let a = T.insert(Box::new(7)).unwrap();
        let outer = T.enter(a).unwrap();
        assert_eq!(T.remove(T.enter(a).unwrap()).unwrap_err(), NotRemoved::Nested);
        assert_eq!(*T.enter(a).unwrap(), 7, "still alive, same handle");
        // A lookup from a signal handler is not remembered: only `outer` counts.
        let sig = T.enter_signal_safe(a).unwrap();
        assert_eq!(T.remove(T.enter(a).unwrap()).unwrap_err(), NotRemoved::Nested);
        drop(sig);
        drop(outer);
        assert_eq!(*T.remove(T.enter(a).unwrap()).unwrap(), 7, "no call left: removed");
        assert!(T.enter(a).is_none());
        // Another thread's call in flight is waited for, not refused.
        let b = T.insert(Box::new(8)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let e = T.enter(b).unwrap();
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            drop(e);
        });
        rx.recv().unwrap();
        assert_eq!(*T.remove(T.enter(b).unwrap()).unwrap(), 8);
        t.join().unwrap();
    }
}
