//! A value set up once, at its first use, that a forked child may set up
//! again (rdmasafe's CM copy storage; the preload's state and report
//! file).
//!
//! A `OnceLock` being set up by one thread when another forks is inherited
//! by the child as "being set up" by a thread the child does not have: the
//! child's first use waits for good. A set-up may take a while (system
//! calls, a log line to a full stderr pipe, a report file that is a FIFO
//! without a reader yet). Making a fork wait for the set-up instead makes
//! every fork of the process wait on it, and takes a lock in the fork
//! handlers, which a fork handler or a library constructor that forks can
//! then deadlock on. So nobody waits: the owner's child fork handler calls
//! [`ForkOnce::after_fork_in_child`], which forgets a set-up that another
//! thread had under way, and the child's first use sets the value up
//! again (what the abandoned set-up made is leaked).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::time::Duration;

/// `ForkOnce::state` before the set-up.
const UNSET: usize = 0;
/// `ForkOnce::state` once set up. Any other value: being set up, by the
/// thread whose `pthread_self()` it is (an address: never 0 or 1).
const SET: usize = 1;

pub struct ForkOnce<T> {
    /// UNSET, SET, or the setter's `pthread_self()` (the same thread in a
    /// forked child, unlike its tid): one word, so that the setter is known
    /// from the moment the set-up is under way.
    state: AtomicUsize,
    value: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: `value` is written by one thread only, the one that moved
// `state` from UNSET to its own `pthread_self()`, before it stores SET
// (Release); it is read only after a load of SET (Acquire), and never
// written again once SET. (A child's reset leaves a value that no thread of
// the child reads: see `after_fork_in_child`.)
unsafe impl<T: Send + Sync> Sync for ForkOnce<T> {}

/// The calling thread's `pthread_self()`: never 0 or 1, and the same
/// for the forking thread in a child.
pub(super) fn this_thread() -> usize {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as usize }
}

impl<T> Default for ForkOnce<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ForkOnce<T> {
    /// Not set up yet.
    pub const fn new() -> Self {
        ForkOnce { state: AtomicUsize::new(UNSET), value: UnsafeCell::new(MaybeUninit::uninit()) }
    }

    /// The value, if it is set up.
    #[inline]
    pub fn get(&self) -> Option<&T> {
        if self.state.load(Acquire) == SET {
            // SAFETY: SET (Acquire) means the value was written before
            // (Release) and is never written again.
            Some(unsafe { (*self.value.get()).assume_init_ref() })
        } else {
            None
        }
    }

    /// The value, set up with `init` by the first caller; the others wait
    /// for it. A panic in `init` leaves it unset (the next use tries
    /// again), and so does a use from inside `init` on the same thread (a
    /// signal handler, say), with a panic.
    #[inline]
    pub fn get_or_init(&self, init: impl FnOnce() -> T) -> &T {
        match self.get() {
            Some(v) => v,
            None => self.set_up(init),
        }
    }

    #[cold]
    fn set_up(&self, init: impl FnOnce() -> T) -> &T {
        // Inside rdmasafe's C calls, some of them cancellation points that
        // catch panics (no forced unwind may cross them): the wait below and
        // `init` (its system calls, a log line, a report file opened) are
        // no cancellation points; a cancellation pending or arriving now is
        // acted on at the call's own cancellable wait, if it has one.
        let _no_cancel = super::cancel::CancelDisabled::new();
        let me = this_thread();
        let mut waits = 0u32;
        loop {
            match self.state.compare_exchange(UNSET, me, Acquire, Acquire) {
                Ok(_) => break,
                Err(SET) => return self.get().expect("set"),
                Err(setter) if setter == me => panic!("rdmasafe: a use of a value inside its own set-up"),
                // Another thread sets it up: that may take long (blocking
                // I/O), so yield, then sleep.
                Err(_) => {
                    waits += 1;
                    if waits < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        /// Unset again if `init` panics.
        struct Unset<'a>(&'a AtomicUsize);
        impl Drop for Unset<'_> {
            fn drop(&mut self) {
                self.0.store(UNSET, Release);
            }
        }
        let undo = Unset(&self.state);
        let v = init();
        // SAFETY: this thread moved the state to its own mark: no other
        // thread reads or writes the value until SET.
        unsafe { (*self.value.get()).write(v) };
        std::mem::forget(undo);
        self.state.store(SET, Release);
        self.get().expect("set")
    }

    /// In a forked child (its fork handler): a set-up that another thread
    /// of the parent had under way is forgotten (that thread does not exist
    /// here); the child's first use sets the value up anew. One of the
    /// forking thread itself (a fork from a signal handler that interrupted
    /// it) goes on when the handler returns. With `also_if_set`, a value
    /// set up already is forgotten too (what the parent's set-up made is
    /// left to leak: the caller knows the child must not use it).
    ///
    /// # Safety
    /// No other thread may use the value meanwhile: call it from a fork
    /// child handler (the child has one thread then).
    pub unsafe fn after_fork_in_child(&self, also_if_set: bool) {
        match self.state.load(Acquire) {
            UNSET => {}
            SET if !also_if_set => {}
            s if s == this_thread() => {}
            _ => self.state.store(UNSET, Release),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_once_and_reset_in_a_child_as_asked() {
        static CELL: ForkOnce<u32> = ForkOnce::new();
        assert_eq!(CELL.get(), None);
        // A set-up under way in another thread (as a child inherits it).
        CELL.state.store(this_thread().wrapping_add(8), Relaxed);
        // SAFETY: no other thread uses CELL.
        unsafe { CELL.after_fork_in_child(false) };
        assert_eq!(*CELL.get_or_init(|| 7), 7, "set up again");
        assert_eq!(*CELL.get_or_init(|| 8), 7, "once");
        // SAFETY: as above.
        unsafe { CELL.after_fork_in_child(false) };
        assert_eq!(CELL.get(), Some(&7), "a value set stays");
        // SAFETY: as above.
        unsafe { CELL.after_fork_in_child(true) };
        assert_eq!(CELL.get(), None, "unless the caller says it must go");
        assert_eq!(*CELL.get_or_init(|| 9), 9);
    }

    #[test]
    fn a_panicking_set_up_leaves_it_unset() {
        static CELL: ForkOnce<u32> = ForkOnce::new();
        let r = std::panic::catch_unwind(|| *CELL.get_or_init(|| panic!("no")));
        assert!(r.is_err());
        assert_eq!(CELL.get(), None);
        assert_eq!(*CELL.get_or_init(|| 3), 3);
    }

    #[test]
    fn a_use_inside_its_own_set_up_panics_instead_of_waiting() {
        static CELL: ForkOnce<u32> = ForkOnce::new();
        let r = std::panic::catch_unwind(|| *CELL.get_or_init(|| *CELL.get_or_init(|| 1)));
        assert!(r.is_err());
        assert_eq!(*CELL.get_or_init(|| 2), 2, "and it is set up later");
    }

    #[test]
    fn other_threads_wait_for_the_set_up() {
        static CELL: ForkOnce<u32> = ForkOnce::new();
        let got: Vec<u32> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|i| {
                    s.spawn(move || {
                        *CELL.get_or_init(|| {
                            std::thread::sleep(Duration::from_millis(20));
                            i
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|v| *v == got[0]), "{got:?}");
    }
}
