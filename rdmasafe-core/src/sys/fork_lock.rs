//! A lock that a forked child takes back from a thread it does not have
//! (the CM copy storage's growth and its overflow list).
//!
//! A `Mutex` held by one thread when another forks is inherited by the
//! child as held, by a thread the child does not have: the child's first
//! use waits for good. Taking the lock in a prepare fork handler instead
//! (what malloc does) makes every fork wait for it and deadlocks a fork
//! handler, or a fork from a library constructor, that uses it. So the
//! lock records its holder, and the owner's child fork handler calls
//! [`ForkLock::after_fork_in_child`], which releases a lock another thread
//! of the parent held and lets the caller mend what that thread may have
//! left half-changed.
//!
//! The lock spins briefly, then yields, then sleeps 1 ms at a time (with
//! thread cancellation disabled: it is taken inside calls that are
//! cancellation points only at their own waits). It is meant for short
//! sections that are rarely contended.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::time::Duration;

use super::fork_once::this_thread;

/// `ForkLock::holder` when nobody holds it; any other value is the
/// holder's `pthread_self()` (an address: never 0).
const FREE: usize = 0;

pub struct ForkLock<T> {
    /// FREE or the holder's `pthread_self()` (the same thread in a forked
    /// child, unlike its tid).
    holder: AtomicUsize,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is touched only through a guard, by the one thread that
// moved `holder` from FREE to its own mark (Acquire) until it stores FREE
// (Release), or by `after_fork_in_child` in a child where the holder's
// thread does not exist.
unsafe impl<T: Send> Sync for ForkLock<T> {}

/// The lock, held while this lives.
pub struct ForkLockGuard<'a, T> {
    lock: &'a ForkLock<T>,
}

impl<T> ForkLock<T> {
    pub const fn new(value: T) -> Self {
        ForkLock { holder: AtomicUsize::new(FREE), value: UnsafeCell::new(value) }
    }

    /// Takes the lock, waiting for its holder. A thread that holds it
    /// already (a signal handler that interrupted it) panics instead of
    /// waiting for itself.
    #[inline]
    pub fn lock(&self) -> ForkLockGuard<'_, T> {
        let me = this_thread();
        if self.holder.compare_exchange(FREE, me, Acquire, Relaxed).is_err() {
            self.lock_contended(me);
        }
        ForkLockGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self, me: usize) {
        let mut waits = 0u32;
        loop {
            match self.holder.compare_exchange(FREE, me, Acquire, Relaxed) {
                Ok(_) => return,
                Err(h) if h == me => panic!("rdmasafe: a lock taken again by its holder"),
                Err(_) if waits < 64 => std::hint::spin_loop(),
                Err(_) if waits < 128 => std::thread::yield_now(),
                Err(_) => {
                    let _no_cancel = super::cancel::CancelDisabled::new();
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            waits = waits.saturating_add(1);
        }
    }

    /// In a forked child (its fork handler, while the child has one
    /// thread): a lock that another thread of the parent held is released,
    /// after `mend` has made its value whole again (that thread stopped
    /// wherever it was inside its section). One the forking thread holds
    /// itself (a fork from a signal handler that interrupted it) is left
    /// to it. Returns whether it released the lock.
    pub fn after_fork_in_child(&self, mend: impl FnOnce(&mut T)) -> bool {
        match self.holder.load(Acquire) {
            FREE => false,
            h if h == this_thread() => false,
            _ => {
                // SAFETY: the holder's thread does not exist in this child,
                // and the child's only thread is here: nobody else touches
                // the value.
                mend(unsafe { &mut *self.value.get() });
                self.holder.store(FREE, Release);
                true
            }
        }
    }
}

impl<T> Deref for ForkLockGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard's thread holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for ForkLockGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard's thread holds the lock.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for ForkLockGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.holder.store(FREE, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excludes_other_threads() {
        static L: ForkLock<u64> = ForkLock::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        let mut g = L.lock();
                        let v = *g;
                        std::hint::black_box(&mut *g);
                        *g = v + 1;
                    }
                });
            }
        });
        assert_eq!(*L.lock(), 40_000);
    }

    #[test]
    fn a_child_takes_back_a_lock_another_thread_held() {
        static L: ForkLock<Vec<u32>> = ForkLock::new(Vec::new());
        L.lock().push(1);
        // Held by another thread (as a child inherits it): mended, freed.
        L.holder.store(this_thread().wrapping_add(8), Relaxed);
        assert!(L.after_fork_in_child(|v| v.push(2)));
        assert_eq!(*L.lock(), [1, 2], "mended once, then free");
        // Held by this very thread: left alone.
        let g = L.lock();
        assert!(!L.after_fork_in_child(|v| v.push(3)));
        drop(g);
        assert_eq!(*L.lock(), [1, 2]);
        // Free: nothing to do.
        assert!(!L.after_fork_in_child(|v| v.push(4)));
        assert_eq!(*L.lock(), [1, 2]);
    }

    #[test]
    fn taking_it_again_panics_instead_of_waiting_for_ever() {
        static L: ForkLock<()> = ForkLock::new(());
        let g = L.lock();
        assert!(std::panic::catch_unwind(|| drop(L.lock())).is_err());
        drop(g);
        drop(L.lock());
    }
}
