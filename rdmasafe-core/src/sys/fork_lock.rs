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
//! A waiter spins briefly, yields, then sleeps on a futex until the
//! holder's release wakes it (a raw system call: no thread-cancellation
//! point, which matters inside calls that are cancellation points only at
//! their own waits). Meant for short sections that are rarely contended.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::*};

use super::fork_once::this_thread;

/// `ForkLock::holder` when nobody holds it; any other value is the
/// holder's `pthread_self()` (an address: never 0).
const FREE: usize = 0;

pub struct ForkLock<T> {
    /// FREE or the holder's `pthread_self()` (the same thread in a forked
    /// child, unlike its tid).
    holder: AtomicUsize,
    /// Threads that are about to sleep, or sleep, on `turn`.
    sleepers: AtomicU32,
    /// Moved on by a release that finds sleepers, before it wakes one (the
    /// futex word: a sleeper that read it before the release does not go
    /// to sleep after it).
    turn: AtomicU32,
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
        ForkLock {
            holder: AtomicUsize::new(FREE),
            sleepers: AtomicU32::new(0),
            turn: AtomicU32::new(0),
            value: UnsafeCell::new(value),
        }
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
                    // SeqCst: this thread's count before its look at the
                    // holder, a release's store of FREE before its look at
                    // the count: either this sees it free, or the release
                    // sees this sleeper and moves `turn` on (after this
                    // read it: the futex then returns at once, or is woken).
                    let turn = self.turn.load(SeqCst);
                    self.sleepers.fetch_add(1, SeqCst);
                    if self.holder.load(SeqCst) != FREE {
                        super::futex_wait(&self.turn, turn);
                    }
                    self.sleepers.fetch_sub(1, SeqCst);
                }
            }
            waits = waits.saturating_add(1);
        }
    }

    fn release(&self) {
        self.holder.store(FREE, SeqCst);
        if self.sleepers.load(SeqCst) != 0 {
            self.turn.fetch_add(1, SeqCst);
            super::futex_wake_one(&self.turn);
        }
    }

    /// In a forked child (its fork handler, while the child has one
    /// thread): a lock that another thread of the parent held is released,
    /// after `mend` has made its value whole again (that thread stopped
    /// wherever it was inside its section). One the forking thread holds
    /// itself (a fork from a signal handler that interrupted it) is left
    /// to it. Returns whether it released the lock.
    ///
    /// # Safety
    /// No other thread may use the lock meanwhile: call it from a fork
    /// child handler (the child has one thread then).
    pub unsafe fn after_fork_in_child(&self, mend: impl FnOnce(&mut T)) -> bool {
        // The parent's threads that slept on it are not in the child (the
        // forking thread, interrupted in its wait by the signal handler
        // that forked, then leaves the count too high: each release makes
        // one futex call in vain).
        self.sleepers.store(0, Relaxed);
        match self.holder.load(Acquire) {
            FREE => false,
            h if h == this_thread() => false,
            _ => {
                // SAFETY: the holder's thread does not exist in this child,
                // and nobody else uses the lock (the caller's contract).
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
        self.lock.release();
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

    /// Waiters that went to sleep on the futex are woken by the release:
    /// a lost wakeup leaves them asleep for good (the watchdog fails it).
    #[test]
    fn sleeping_waiters_are_woken_by_the_release() {
        static L: ForkLock<u32> = ForkLock::new(0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..20 {
                let g = L.lock();
                let waiters: Vec<_> = (0..3)
                    .map(|_| {
                        std::thread::spawn(|| {
                            *L.lock() += 1;
                        })
                    })
                    .collect();
                // Long enough for the waiters to spin, yield and sleep.
                while L.sleepers.load(SeqCst) < 3 {
                    std::thread::yield_now();
                }
                drop(g);
                for w in waiters {
                    w.join().unwrap();
                }
            }
            tx.send(*L.lock()).unwrap();
        });
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(60)).expect("no waiter sleeps for good"), 60);
    }

    #[test]
    fn a_child_takes_back_a_lock_another_thread_held() {
        static L: ForkLock<Vec<u32>> = ForkLock::new(Vec::new());
        L.lock().push(1);
        // Held by another thread (as a child inherits it): mended, freed.
        L.holder.store(this_thread().wrapping_add(8), Relaxed);
        // SAFETY (here and below): no other thread uses L.
        assert!(unsafe { L.after_fork_in_child(|v| v.push(2)) });
        assert_eq!(*L.lock(), [1, 2], "mended once, then free");
        // Held by this very thread: left alone.
        let g = L.lock();
        assert!(!unsafe { L.after_fork_in_child(|v| v.push(3)) });
        drop(g);
        assert_eq!(*L.lock(), [1, 2]);
        // Free: nothing to do.
        assert!(!unsafe { L.after_fork_in_child(|v| v.push(4)) });
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
