//! [`LocalCqLoop`]: a CQ loop for one thread, whose handlers need not be
//! `Send` (they may hold `Rc`, `RefCell`, a thread's own state).
//!
//! It is the thread-safe [`CqLoop`] underneath, kept on the thread that
//! made it (the type is neither `Send` nor `Sync`) and handing out no
//! [`LoopControl`] (its handlers and dead-peer callbacks get a
//! [`LocalControl`]), so nothing but this thread can run it or change it;
//! a [`StopHandle`] may still stop it from anywhere. The app's handlers
//! and dead-peer callbacks live in this thread's storage, keyed by loop
//! and CQ or QP; the loop itself holds a small `Send` forwarder for each
//! that looks it up there. A forwarder that ever ran on another thread
//! would find nothing and do nothing, so no unsafe code is needed to make
//! the promise.
//!
//! ```compile_fail
//! fn needs_send<T: Send>(_: T) {}
//! fn check(lp: rdmasafe_core::cq::LocalCqLoop) {
//!     needs_send(lp); // a local loop never leaves its thread
//! }
//! ```
//!
//! A dead-peer callback gets no [`LoopControl`] either (one sent to
//! another thread from it used to let that thread run the loop, whose
//! forwarders then found no handler there: completions were lost):
//!
//! ```compile_fail
//! use rdmasafe_core::cq::{Keepalive, LocalCqLoop, LoopControl};
//! fn check(lp: &LocalCqLoop, id: &rdmasafe_core::cm::CmId, cfg: Keepalive, tx: std::sync::mpsc::Sender<LoopControl>) {
//!     let on_dead = move |_: u32, ctl: &LoopControl| tx.send(ctl.clone()).unwrap();
//!     lp.add_keepalive_id(id, cfg, Box::new(on_dead)).unwrap();
//! }
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hash;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread::LocalKey;
use std::time::Duration;

use super::{CqLoop, CqOptions, Keepalive, LoopControl, LoopOptions, LoopStats, Outcome, RunEnd};
use crate::cm::CmId;
use crate::verbs::{CompChannel, Cq};
use crate::wc::Wc;
use crate::{Result, Wait};

type LocalHandler = Box<dyn FnMut(&[Wc], &LocalControl<'_>)>;
type LocalDeadPeer = Box<dyn FnMut(u32, &LocalControl<'_>)>;

/// A callback in this thread's storage.
enum Slot<T> {
    Idle(T),
    /// Taken out for a call; the flag: removed during the call.
    Running(bool),
}

/// This thread's callbacks of one kind, by (loop, CQ or QP).
type Table<K, T> = LocalKey<RefCell<HashMap<K, Slot<T>>>>;

thread_local! {
    /// Handlers by (loop, CQ address).
    static HANDLERS: RefCell<HashMap<(u64, usize), Slot<LocalHandler>>> = RefCell::new(HashMap::new());
    /// Dead-peer callbacks by (loop, QP number).
    static DEAD: RefCell<HashMap<(u64, u32), Slot<LocalDeadPeer>>> = RefCell::new(HashMap::new());
}

/// Calls the callback of `key` if this thread has it: taken out of the
/// table for the call (it may change the table), put back after, or
/// dropped if it was removed meanwhile. A panic goes on to the loop
/// (which catches and re-raises it), the callback put back first, as the
/// `Send` path does.
fn call<K: Copy + Eq + Hash + 'static, T: 'static>(table: &'static Table<K, T>, key: K, f: impl FnOnce(&mut T)) {
    let taken = table.with(|m| match m.borrow_mut().get_mut(&key) {
        Some(slot @ Slot::Idle(_)) => match std::mem::replace(slot, Slot::Running(false)) {
            Slot::Idle(h) => Some(h),
            Slot::Running(_) => None,
        },
        _ => None,
    });
    let Some(mut h) = taken else { return };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut h)));
    let dropped = table.with(|m| {
        let mut m = m.borrow_mut();
        match m.get(&key) {
            Some(Slot::Running(false)) => {
                m.insert(key, Slot::Idle(h));
                None
            }
            // Removed during its own call: it goes now.
            Some(Slot::Running(true)) => {
                m.remove(&key);
                Some(h)
            }
            _ => Some(h),
        }
    });
    drop(dropped); // outside the borrow: a callback's Drop may use the loop
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// Removes (and drops, outside the borrow) the callback of `key`, or marks
/// it for removal when it is running. Nothing on a thread whose storage
/// is gone.
fn forget<K: Copy + Eq + Hash + 'static, T: 'static>(table: &'static Table<K, T>, key: K) {
    let old = table
        .try_with(|m| {
            let mut m = m.borrow_mut();
            match m.get_mut(&key) {
                Some(Slot::Running(removed)) => {
                    *removed = true;
                    None
                }
                Some(Slot::Idle(_)) => m.remove(&key),
                None => None,
            }
        })
        .ok()
        .flatten();
    drop(old);
}

/// Installs the callback of `key`; gives it back (nothing changed) while
/// `key` has one. One removed during its own call is replaced.
fn install<K: Copy + Eq + Hash + 'static, T: 'static>(
    table: &'static Table<K, T>,
    key: K,
    h: T,
) -> std::result::Result<(), T> {
    let old = table.with(|m| {
        let mut m = m.borrow_mut();
        match m.get(&key) {
            Some(Slot::Idle(_) | Slot::Running(false)) => Err(h),
            _ => Ok(m.insert(key, Slot::Idle(h))),
        }
    });
    old.map(drop) // the old one outside the borrow
}

/// Drops (outside the borrow) every callback of loop `id` in `table`.
fn forget_loop<K: Copy + Eq + Hash + 'static, T: 'static>(
    table: &'static Table<K, T>,
    id: u64,
    loop_of: fn(&K) -> u64,
) {
    let olds: Vec<Slot<T>> = table
        .try_with(|m| {
            let mut m = m.borrow_mut();
            let keys: Vec<K> = m.keys().filter(|k| loop_of(k) == id).copied().collect();
            keys.into_iter().filter_map(|k| m.remove(&k)).collect()
        })
        .unwrap_or_default();
    drop(olds);
}

/// The loop's `Send` stand-in for a local dead-peer callback: calls it
/// when it runs on this thread, and takes it out of this thread's storage
/// when the loop lets the keepalive go.
struct DeadForwarder {
    key: (u64, u32),
}

impl DeadForwarder {
    fn call(&self, qpn: u32, ctl: &LoopControl) {
        let local = LocalControl { ctl, loop_id: self.key.0, _not_send: PhantomData };
        call(&DEAD, self.key, |f| f(qpn, &local));
    }
}

impl Drop for DeadForwarder {
    fn drop(&mut self) {
        forget(&DEAD, self.key);
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Calls the handler of (`loop_id`, `cq`) if this thread has it.
fn dispatch(loop_id: u64, cq: usize, wcs: &[Wc], ctl: &LoopControl) {
    let local = LocalControl { ctl, loop_id, _not_send: PhantomData };
    call(&HANDLERS, (loop_id, cq), |h| h(wcs, &local));
}

/// A CQ loop for the thread that made it; see the module docs. Everything
/// [`CqLoop`] guarantees holds (arm before the final drain, batched acks,
/// live add and remove from handlers); what it gives up is changes from
/// other threads (only [`StopHandle::stop`] crosses threads).
pub struct LocalCqLoop {
    // Field order is drop order: the loop (its forwarders, every ack
    // flushed) before this thread's handlers of it.
    inner: CqLoop,
    handlers: Handlers,
    _not_send: PhantomData<Rc<()>>,
}

/// This thread's handlers of one local loop; dropped with it.
struct Handlers {
    id: u64,
}

impl Drop for Handlers {
    fn drop(&mut self) {
        forget_loop(&HANDLERS, self.id, |k| k.0);
        forget_loop(&DEAD, self.id, |k| k.0);
    }
}

/// What a [`LocalCqLoop`]'s handler may do to its loop (changes take
/// effect when the handler returns, as with [`LoopControl`]).
pub struct LocalControl<'a> {
    ctl: &'a LoopControl,
    loop_id: u64,
    _not_send: PhantomData<Rc<()>>,
}

/// Stops a loop from any thread or a signal handler; nothing else.
#[derive(Clone)]
pub struct StopHandle(LoopControl);

impl StopHandle {
    /// Asks the loop to stop (see [`LoopControl::stop`]).
    pub fn stop(&self) {
        self.0.stop();
    }
}

fn add_local<F>(ctl: &LoopControl, loop_id: u64, cq: &Cq, opts: CqOptions, handler: F) -> Result<Outcome>
where
    F: FnMut(&[Wc], &LocalControl<'_>) + 'static,
{
    let key = (loop_id, cq.raw() as usize);
    // Refused before the loop is asked: the handler in place stays.
    if let Err(h) = install(&HANDLERS, key, Box::new(handler) as LocalHandler) {
        drop(h);
        return Err(crate::Error::new("rdmasafe_cq_loop_add_cq: CQ already in a loop", libc::EBUSY));
    }
    let r = ctl.add_cq(cq, opts, move |wcs: &[Wc], ctl: &LoopControl| dispatch(key.0, key.1, wcs, ctl));
    if r.is_err() {
        forget(&HANDLERS, key);
    }
    r
}

impl LocalCqLoop {
    /// A loop on `channel` (see [`CqLoop::new`], and its errors).
    pub fn new(channel: &CompChannel, opts: LoopOptions) -> Result<LocalCqLoop> {
        Ok(LocalCqLoop {
            inner: CqLoop::new(channel, opts)?,
            handlers: Handlers { id: NEXT_ID.fetch_add(1, Relaxed) },
            _not_send: PhantomData,
        })
    }

    /// Adds a CQ with a handler that need not be `Send`, and the loop's
    /// default options. Errors as [`LoopControl::add_cq`]'s (EBUSY: the CQ
    /// is in a loop already; the handler it has there stays).
    pub fn add_cq<F>(&self, cq: &Cq, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LocalControl<'_>) + 'static,
    {
        self.add_cq_with(cq, self.inner.default_cq_options(), handler)
    }

    /// Adds a CQ with its own options.
    pub fn add_cq_with<F>(&self, cq: &Cq, opts: CqOptions, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LocalControl<'_>) + 'static,
    {
        add_local(&self.inner.control(), self.handlers.id, cq, opts, handler).map(|_| ())
    }

    /// Removes a CQ: done when this returns (its handler dropped).
    pub fn remove_cq(&self, cq: &Cq) -> Result<()> {
        self.inner.remove_cq(cq)?;
        forget(&HANDLERS, (self.handlers.id, cq.raw() as usize));
        Ok(())
    }

    /// Runs until stopped (see [`CqLoop::run`]).
    pub fn run(&self) -> Result<()> {
        self.inner.run()
    }

    /// Runs for at most `timeout` (see [`CqLoop::run_for`]).
    pub fn run_for(&self, timeout: Duration) -> Result<RunEnd> {
        self.inner.run_for(timeout)
    }

    /// Waits until completions are delivered (see [`CqLoop::process_once`]).
    pub fn process_once(&self, wait: Wait) -> Result<usize> {
        self.inner.process_once(wait)
    }

    /// The next deadline (see [`CqLoop::next_timeout`]).
    pub fn next_timeout(&self) -> Option<Duration> {
        self.inner.next_timeout()
    }

    /// The loop's figures.
    pub fn stats(&self) -> LoopStats {
        self.inner.stats()
    }

    /// A handle that stops the loop from any thread.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.inner.control())
    }

    /// Blocking drain of the QP `id` owns (see [`LoopControl::drain_id`]).
    pub fn drain_id(&self, id: &CmId, timeout: Duration) -> Result<()> {
        self.inner.drain_id(id, timeout)
    }

    /// Dead-peer detection for the QP `id` owns (see
    /// [`LoopControl::add_keepalive_id`]), with a callback that need not be
    /// `Send`, called on this thread with the QP number and a
    /// [`LocalControl`]. Errors as [`LoopControl::add_keepalive_id`]'s
    /// (EBUSY: the QP has a keepalive already; its callback stays).
    pub fn add_keepalive_id<F>(&self, id: &CmId, cfg: Keepalive, on_dead: F) -> Result<()>
    where
        F: FnMut(u32, &LocalControl<'_>) + 'static,
    {
        let qpn = id.qp_num().ok_or(crate::Error::new("rdmasafe keepalive: the id has no QP", libc::EINVAL))?;
        let key = (self.handlers.id, qpn);
        if let Err(f) = install(&DEAD, key, Box::new(on_dead) as LocalDeadPeer) {
            drop(f);
            return Err(crate::Error::new("rdmasafe add_keepalive: the QP has a keepalive already", libc::EBUSY));
        }
        let fwd = DeadForwarder { key };
        // On failure the forwarder is dropped with the box: the callback goes.
        self.inner.add_keepalive_id(id, cfg, Box::new(move |qpn, ctl: &LoopControl| fwd.call(qpn, ctl)))
    }
}

impl AsRawFd for LocalCqLoop {
    /// The loop's epoll fd (see [`CqLoop`]'s `AsRawFd`).
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

impl LocalControl<'_> {
    /// Adds a CQ with a local handler (pending until this handler returns).
    pub fn add_cq<F>(&self, cq: &Cq, handler: F) -> Result<Outcome>
    where
        F: FnMut(&[Wc], &LocalControl<'_>) + 'static,
    {
        add_local(self.ctl, self.loop_id, cq, self.ctl.cq_defaults(), handler)
    }

    /// Removes a CQ (its own included); see [`LoopControl::remove_cq`].
    pub fn remove_cq(&self, cq: &Cq) -> Result<Outcome> {
        let r = self.ctl.remove_cq(cq)?;
        forget(&HANDLERS, (self.loop_id, cq.raw() as usize));
        Ok(r)
    }

    /// Asks the loop to stop.
    pub fn stop(&self) {
        self.ctl.stop();
    }

    /// The loop's figures.
    pub fn stats(&self) -> LoopStats {
        self.ctl.stats()
    }
}
