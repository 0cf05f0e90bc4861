//! Handles the C app holds for rdmasafe objects (loops): a value that
//! encodes a table index and a generation, never a pointer to the object.
//!
//! * A handle is looked up, never trusted: any value is safe to pass; one
//!   that does not name a live object is EINVAL.
//! * A destroyed object's handle can never reach a newer object: the
//!   table cell's generation changes on destroy, and the handle carries the
//!   generation it was made with.
//! * Lookups take no lock (two atomics), so they are async-signal-safe;
//!   destroy waits until lookups in flight are done before it frees.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};

/// Objects alive at once, at most.
const CELLS: usize = 4096;

struct Cell<T> {
    gen: AtomicU32,
    users: AtomicU32,
    obj: AtomicPtr<T>,
}

pub(crate) struct Table<T> {
    cells: OnceLock<Box<[Cell<T>]>>,
    free: Mutex<Vec<u32>>,
}

/// An object looked up by its handle; the object stays alive while this
/// lives (destroy waits for it).
pub(crate) struct Entered<'a, T> {
    cell: &'a Cell<T>,
    obj: &'a T,
}

impl<T> std::ops::Deref for Entered<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.obj
    }
}

impl<T> Drop for Entered<'_, T> {
    fn drop(&mut self) {
        self.cell.users.fetch_sub(1, SeqCst);
    }
}

fn split(h: usize) -> Option<(usize, u32)> {
    let v = h as u64;
    let idx = (v & 0xffff_ffff) as usize;
    (1..=CELLS).contains(&idx).then(|| (idx - 1, (v >> 32) as u32))
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
                    gen: AtomicU32::new(1),
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
        Some(((gen as u64) << 32 | (i as u64 + 1)) as usize)
    }

    /// The object `h` names, if it is alive. Lock-free.
    pub(crate) fn enter(&self, h: usize) -> Option<Entered<'_, T>> {
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
        Some(Entered { cell, obj: unsafe { &*p } })
    }

    /// Makes `e`'s handle invalid (later lookups fail), waits until no
    /// other lookup is in flight, and returns the object. `None` if another
    /// thread removed it first.
    pub(crate) fn remove(&self, e: Entered<'_, T>) -> Option<Box<T>> {
        let cell = e.cell;
        let gen = cell.gen.load(SeqCst);
        let p = cell.obj.load(SeqCst);
        if p.is_null() || cell.gen.compare_exchange(gen, gen.wrapping_add(1).max(1), SeqCst, SeqCst).is_err() {
            return None;
        }
        drop(e);
        while cell.users.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
        cell.obj.store(std::ptr::null_mut(), SeqCst);
        let i = (cell as *const Cell<T> as usize - self.cells().as_ptr() as usize) / std::mem::size_of::<Cell<T>>();
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(i as u32);
        // SAFETY: from Box::into_raw in insert; no user is left and the
        // generation changed, so nobody else can reach it.
        Some(unsafe { Box::from_raw(p) })
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
        // The same cell again (LIFO free list): a new generation.
        let b = T.insert(Box::new(2)).unwrap();
        assert_eq!(a & 0xffff_ffff, b & 0xffff_ffff, "same cell");
        assert_ne!(a, b, "different handle");
        assert!(T.enter(a).is_none(), "the stale handle does not reach the new object");
        assert_eq!(*T.enter(b).unwrap(), 2);
        for bad in [0usize, 1 << 40, usize::MAX, 0x7ffd_1234_5678, CELLS + 1] {
            assert!(T.enter(bad).is_none(), "{bad:#x}");
        }
        assert_eq!(*T.remove(T.enter(b).unwrap()).unwrap(), 2);
    }
}
