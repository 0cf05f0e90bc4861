//! A CM event thread: it gets, copies and acks events, then hands the copies
//! to a callback or to worker threads through a bounded lock-free queue.
//!
//! Contract:
//! * Acks never wait on the app: each event is acked the moment it is
//!   copied, before the callback runs or the copy is queued.
//! * Backpressure: the thread takes an event only once it has room for its
//!   copy in the [`WorkQueue`]; while the queue is full, events wait in the
//!   kernel (a stop never leaves a copy behind). They are not lost, with
//!   one exception the kernel imposes: connect requests
//!   beyond the listener's backlog (see [`super::CmId::listen`]) are dropped
//!   by the kernel, and those clients end in UNREACHABLE after ~100 s.
//!   The same when no copy can be made (the copy limit of
//!   [`super::set_limit`] is reached, or memory is short): the thread
//!   waits for copies to be freed, retrying every few milliseconds
//!   ([`DispatcherStats::storage_waits`]), and goes on.
//! * Order: the callback sees a channel's events in the channel's order;
//!   so does a single worker of a [`WorkQueue`], but several workers of one
//!   queue may handle one id's events concurrently or out of order (see
//!   [`WorkQueue`]).
//! * Stop is prompt: the thread waits in poll() on the channel fd and an
//!   eventfd, and [`Dispatcher::stop`] (or a [`StopHandle`], also usable
//!   from inside the callback) writes the eventfd. (It watches the
//!   channel's moved-in eventfd too: see [`super::CmId::migrate`].)

use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use sync::{fence, ArrayQueue, AtomicBool, AtomicUsize, Condvar, Mutex};

/// The primitives of the queue's sleep/wake protocol. Under `--cfg loom`
/// they are loom's, and the lock-free queue is replaced by a linearizable
/// model, so loom explores every interleaving of the protocol and reports a
/// lost wakeup as a deadlock (see `loom_tests`).
#[cfg(not(loom))]
mod sync {
    pub(super) use crossbeam_queue::ArrayQueue;
    pub(super) use std::sync::atomic::{fence, AtomicBool, AtomicUsize};
    pub(super) use std::sync::{Condvar, Mutex};
}

#[cfg(loom)]
mod sync {
    pub(super) use loom::sync::atomic::{fence, AtomicBool, AtomicUsize};
    pub(super) use loom::sync::{Condvar, Mutex};

    /// Model of crossbeam's ArrayQueue: each operation is atomic.
    pub(super) struct ArrayQueue<T> {
        q: Mutex<std::collections::VecDeque<T>>,
        cap: usize,
    }

    impl<T> ArrayQueue<T> {
        pub(super) fn new(cap: usize) -> Self {
            ArrayQueue { q: Mutex::new(Default::default()), cap }
        }
        pub(super) fn push(&self, v: T) -> Result<(), T> {
            let mut q = self.q.lock().unwrap();
            if q.len() == self.cap {
                return Err(v);
            }
            q.push_back(v);
            Ok(())
        }
        pub(super) fn pop(&self) -> Option<T> {
            self.q.lock().unwrap().pop_front()
        }
        pub(super) fn len(&self) -> usize {
            self.q.lock().unwrap().len()
        }
        pub(super) fn is_empty(&self) -> bool {
            self.len() == 0
        }
        pub(super) fn is_full(&self) -> bool {
            self.len() == self.cap
        }
        pub(super) fn capacity(&self) -> usize {
            self.cap
        }
    }
}

use super::{CmEvent, EventChannel};
use crate::sys::{self, Wait, WakeFd};
use crate::{Error, Result};

/// Most events taken from the channel per wakeup before looking at the stop
/// flag again.
const DRAIN_PER_WAKEUP: usize = 64;

/// A bounded multi-producer multi-consumer queue of event copies. Push and
/// pop are lock-free; a mutex/condvar pair is touched only to put a thread
/// to sleep on an empty (consumer) or full (producer) queue and to wake it.
/// A dispatcher reserves room before it takes an event from its channel,
/// so it never holds a copy it cannot queue.
///
/// Order: the queue is FIFO, and one dispatcher pushes a channel's copies
/// in the channel's order, so a single worker sees them in that order.
/// Several workers popping one queue do not: two copies of one id (its
/// ESTABLISHED and its DISCONNECTED, say) may be handled at the same time,
/// or the later one first. A handler that needs one connection's events in
/// order serializes them itself: one worker (or one queue per worker) per
/// connection, routed by the copy's id or context, or a per-connection lock
/// and sequence.
pub struct WorkQueue {
    q: ArrayQueue<CmEvent>,
    lock: Mutex<()>,
    not_empty: Condvar,
    not_full: Condvar,
    sleeping_consumers: AtomicUsize,
    sleeping_producers: AtomicUsize,
    closed: AtomicBool,
    /// Copies queued plus room reserved by producers about to take an
    /// event: at most the capacity, so a reserved push always fits (a pop
    /// frees its place in `q` before it gives the room back here).
    used: AtomicUsize,
    producers: Mutex<Producers>,
}

/// The dispatchers feeding a [`WorkQueue`].
#[derive(Default)]
struct Producers {
    /// Feeding it now: the last to stop closes it, the first to start
    /// opens it again.
    running: usize,
    /// One stopped while another was still counted since the count last
    /// rose from 0: one that then fails to start closes the queue, as that
    /// stop would have.
    stopped_meanwhile: bool,
}

impl WorkQueue {
    /// A queue holding at most `capacity` copies (at least 1).
    pub fn new(capacity: usize) -> Arc<WorkQueue> {
        Arc::new(WorkQueue {
            q: ArrayQueue::new(capacity.max(1)),
            lock: Mutex::new(()),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            sleeping_consumers: AtomicUsize::new(0),
            sleeping_producers: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            used: AtomicUsize::new(0),
            producers: Mutex::new(Producers::default()),
        })
    }

    /// Copies queued now.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// True if no copy is queued.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// The queue's capacity.
    pub fn capacity(&self) -> usize {
        self.q.capacity()
    }

    /// A dispatcher starts feeding the queue: opens it if it was closed
    /// (true then).
    fn producer_started(&self) -> bool {
        let mut p = self.producers.lock().unwrap_or_else(|e| e.into_inner());
        p.running += 1;
        if p.running == 1 {
            p.stopped_meanwhile = false;
            return self.closed.swap(false, SeqCst);
        }
        false
    }

    /// A dispatcher stopped feeding the queue: the last one closes it.
    /// (The count's lock is held across the close: a dispatcher starting
    /// meanwhile opens the queue after it, never before.)
    fn producer_stopped(&self) {
        let mut p = self.producers.lock().unwrap_or_else(|e| e.into_inner());
        p.running -= 1;
        if p.running == 0 {
            self.close();
        } else {
            p.stopped_meanwhile = true;
        }
    }

    /// A dispatcher that never started: as if it had not come (a queue it
    /// opened, or one whose last feeder stopped meanwhile, is closed; one
    /// that was open stays open).
    fn producer_abandoned(&self, opened: bool) {
        let mut p = self.producers.lock().unwrap_or_else(|e| e.into_inner());
        p.running -= 1;
        if p.running == 0 && (opened || p.stopped_meanwhile) {
            self.close();
        }
    }

    fn wake(&self, sleepers: &AtomicUsize, cv: &Condvar) {
        // Pairs with the SeqCst increment in the sleeper: either the sleeper
        // sees our change of the queue, or we see it asleep and notify it.
        // (A read-modify-write reads the latest count, and orders after our
        // change: loom checks the protocol with it, as it would not with a
        // plain load, whose SeqCst loom models as acquire.)
        fence(SeqCst);
        if sleepers.fetch_add(0, SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            cv.notify_all();
        }
    }

    /// Takes a copy without waiting.
    pub fn try_pop(&self) -> Option<CmEvent> {
        let ev = self.q.pop()?;
        self.give_room_back();
        Some(ev)
    }

    /// Gives back the room of a copy popped (or of one reserved that did
    /// not come) and wakes a producer waiting for room.
    fn give_room_back(&self) {
        self.used.fetch_sub(1, SeqCst);
        self.wake(&self.sleeping_producers, &self.not_full);
    }

    /// Takes a copy, waiting at most `timeout`. `None` on timeout, or at once
    /// when the queue is closed and empty ([`WorkQueue::is_closed`] tells
    /// the two apart):
    ///
    /// ```no_run
    /// # fn handle(_: rdmasafe_core::cm::CmEvent) {}
    /// # fn worker(q: &rdmasafe_core::cm::WorkQueue) {
    /// loop {
    ///     match q.pop_timeout(std::time::Duration::from_millis(100)) {
    ///         Some(ev) => handle(ev),
    ///         // No dispatcher feeds the queue any more, and it is empty.
    ///         None if q.is_closed() && q.is_empty() => break,
    ///         None => {}
    ///     }
    /// }
    /// # }
    /// ```
    pub fn pop_timeout(&self, timeout: Duration) -> Option<CmEvent> {
        if let Some(ev) = self.try_pop() {
            return Some(ev);
        }
        let deadline = crate::sys::deadline_after(std::time::Instant::now(), timeout);
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            self.sleeping_consumers.fetch_add(1, SeqCst);
            let got = self.q.pop();
            if got.is_some() || self.closed.load(SeqCst) {
                self.sleeping_consumers.fetch_sub(1, SeqCst);
                drop(g);
                if got.is_some() {
                    self.give_room_back();
                }
                return got;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                self.sleeping_consumers.fetch_sub(1, SeqCst);
                return None;
            }
            g = self.not_empty.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
            self.sleeping_consumers.fetch_sub(1, SeqCst);
        }
    }

    /// Reserves room for one copy, without waiting.
    fn try_reserve(&self) -> bool {
        let cap = self.q.capacity();
        self.used.fetch_update(SeqCst, SeqCst, |u| (u < cap).then_some(u + 1)).is_ok()
    }

    /// Reserves room for one copy, waiting while the queue is full until
    /// there is room (true) or `give_up()` says stop (false). A wait is
    /// counted in `full_waits` once.
    fn reserve_wait(&self, give_up: &dyn Fn() -> bool, full_waits: &AtomicU64) -> bool {
        let mut counted = false;
        loop {
            if self.try_reserve() {
                return true;
            }
            if give_up() {
                return false;
            }
            if !counted {
                full_waits.fetch_add(1, Relaxed);
                counted = true;
            }
            let g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            // SeqCst, paired with `give_room_back`: either the pop's room is
            // seen below, or the pop sees a sleeper and notifies (under the
            // lock, which this holds until it waits).
            self.sleeping_producers.fetch_add(1, SeqCst);
            // A read-modify-write: the latest count (see `wake`).
            if self.used.fetch_add(0, SeqCst) >= self.q.capacity() && !give_up() {
                // Woken by a pop or by stop; the timeout only bounds a missed
                // stop check, it is not needed for correctness.
                let _ = self.not_full.wait_timeout(g, Duration::from_millis(100));
            }
            self.sleeping_producers.fetch_sub(1, SeqCst);
        }
    }

    /// Queues a copy into room reserved for it.
    fn push_reserved(&self, ev: CmEvent) {
        // `used` counts the reserved room, and a pop frees its place in
        // `q` before it gives room back: `q` has room. Were it ever not so,
        // the copy is kept (it is acked already) until a pop makes room.
        let mut ev = ev;
        while let Err(back) = self.q.push(ev) {
            debug_assert!(false, "a reserved push always fits");
            ev = back;
            std::thread::yield_now();
        }
        self.wake(&self.sleeping_consumers, &self.not_empty);
    }

    /// Pushes, waiting while the queue is full until there is room or
    /// `give_up()` says stop; then the copy is handed back.
    #[cfg(test)]
    fn push_wait(
        &self,
        ev: CmEvent,
        give_up: &dyn Fn() -> bool,
        full_waits: &AtomicU64,
    ) -> std::result::Result<(), CmEvent> {
        if !self.reserve_wait(give_up, full_waits) {
            return Err(ev);
        }
        self.push_reserved(ev);
        Ok(())
    }

    /// True once the queue is closed ([`WorkQueue::close`], or the last
    /// dispatcher feeding it stopped or ended), until a dispatcher starts
    /// on it again: with the queue empty too, no copy will come.
    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    /// Marks the queue closed: consumers drain what is queued, then
    /// `pop_timeout` returns `None` at once (until a dispatcher starts on
    /// it again). It stops no dispatcher: one still feeding the queue goes
    /// on queueing the copies it takes, which workers that saw it closed
    /// and empty may never take (they are freed with the queue, a
    /// CONNECT_REQUEST's id rejected). Stop every dispatcher feeding the
    /// queue first; the last one to stop closes it anyway.
    pub fn close(&self) {
        self.closed.store(true, SeqCst);
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

/// Figures of a running dispatcher.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatcherStats {
    /// Times the thread woke up with events to take.
    pub wakeups: u64,
    /// Events copied, acked and delivered (handed to the callback, or
    /// queued).
    pub events: u64,
    /// Most events taken in one wakeup.
    pub max_batch: u64,
    /// Times the thread found the work queue full and waited (taking no
    /// event meanwhile; room is reserved before the channel is read, so a
    /// wait may come with no event pending).
    pub queue_full_waits: u64,
    /// Times a get was refused for want of storage (the copy limit of
    /// [`super::set_limit`] reached: ENOBUFS; no memory: ENOMEM) and the
    /// thread waited for copies to be freed. The event stays in the kernel
    /// meanwhile; nothing is lost.
    pub storage_waits: u64,
}

#[derive(Default)]
struct Shared {
    stop: std::sync::atomic::AtomicBool,
    wakeups: AtomicU64,
    events: AtomicU64,
    max_batch: AtomicU64,
    full_waits: AtomicU64,
    storage_waits: AtomicU64,
}

/// Asks a dispatcher to stop; cheap to clone, callable from any thread,
/// including from inside the dispatcher's own callback.
#[derive(Clone)]
pub struct StopHandle {
    shared: Arc<Shared>,
    wake: Arc<WakeFd>,
    queue: Option<Arc<WorkQueue>>,
}

impl StopHandle {
    /// Requests the stop and wakes the thread. Does not wait for it.
    pub fn stop(&self) {
        self.shared.stop.store(true, SeqCst);
        self.wake.wake();
        if let Some(q) = &self.queue {
            let _g = q.lock.lock().unwrap_or_else(|e| e.into_inner());
            q.not_full.notify_all();
        }
    }
}

enum Sink {
    Callback(Box<dyn FnMut(CmEvent) + Send>),
    Queue(Arc<WorkQueue>),
}

/// The CM event thread. Dropping it stops and joins the thread.
pub struct Dispatcher {
    handle: StopHandle,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Dispatcher {
    /// Starts a thread that calls `f` with every event copy of `channel`, in
    /// order. A slow `f` delays later gets but never an ack. An `f` that
    /// panics ends the thread: the copy it was given is freed, later events
    /// wait in the kernel, [`Dispatcher::is_finished`] turns true and
    /// [`Dispatcher::stop`] returns EIO ("rdmasafe-cm thread panicked").
    pub fn with_callback<F>(channel: &EventChannel, f: F) -> Result<Dispatcher>
    where
        F: FnMut(CmEvent) + Send + 'static,
    {
        Self::start(channel, Sink::Callback(Box::new(f)), None)
    }

    /// Starts a thread that pushes every event copy of `channel` into
    /// `queue`, for worker threads to [`WorkQueue::pop_timeout`]. Several
    /// dispatchers (of several channels) may feed one queue. The queue is
    /// closed when the last dispatcher feeding it stops; one started on it
    /// later opens it again.
    pub fn with_queue(channel: &EventChannel, queue: Arc<WorkQueue>) -> Result<Dispatcher> {
        let opened = queue.producer_started();
        let d = Self::start(channel, Sink::Queue(queue.clone()), Some(queue.clone()));
        if d.is_err() {
            queue.producer_abandoned(opened);
        }
        d
    }

    fn start(channel: &EventChannel, sink: Sink, queue: Option<Arc<WorkQueue>>) -> Result<Dispatcher> {
        let wake = Arc::new(WakeFd::new().map_err(|e| Error::new("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?);
        let handle = StopHandle { shared: Arc::default(), wake, queue };
        let ch = channel.clone();
        let h = handle.clone();
        let thread = std::thread::Builder::new()
            .name("rdmasafe-cm".into())
            .spawn(move || run(ch, sink, h))
            .map_err(|e| Error::new("pthread_create", e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
        Ok(Dispatcher { handle, thread: Some(thread) })
    }

    /// Whether the thread has ended: stopped ([`StopHandle::stop`], or
    /// [`Dispatcher::stop`]), ended on an error of the channel, or ended by
    /// a panic of the callback. Until [`Dispatcher::stop`] collects how it
    /// ended, a thread that ended by itself takes no more events (they wait
    /// in the kernel): a service can poll this as a health check.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// A handle to stop the dispatcher from anywhere (e.g. its callback).
    pub fn stop_handle(&self) -> StopHandle {
        self.handle.clone()
    }

    /// Figures so far (readable while running).
    pub fn stats(&self) -> DispatcherStats {
        let s = &self.handle.shared;
        DispatcherStats {
            wakeups: s.wakeups.load(Relaxed),
            events: s.events.load(Relaxed),
            max_batch: s.max_batch.load(Relaxed),
            queue_full_waits: s.full_waits.load(Relaxed),
            storage_waits: s.storage_waits.load(Relaxed),
        }
    }

    /// Stops the thread and waits for it. Events not yet fetched stay in
    /// the kernel (a new dispatcher or a get on the channel finds them; the
    /// thread takes no event it has no room for, so a full queue leaves
    /// none in its hands). Returns the thread's error, if it ended on one
    /// (e.g. the channel failed). From the dispatcher's own callback it
    /// cannot wait for its thread: it asks for the stop and returns `Ok`
    /// at once; the thread ends once the callback returns (an error it
    /// then ends on is not reported).
    pub fn stop(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        self.handle.stop();
        match self.thread.take() {
            Some(t) if t.thread().id() != std::thread::current().id() => {
                t.join().unwrap_or(Err(Error::new("rdmasafe-cm thread panicked", libc::EIO)))
            }
            // Dropped from inside its own callback: the stop flag ends the
            // loop after the callback returns; joining here would deadlock.
            _ => Ok(()),
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// The first wait for copies to be freed when a get finds no storage;
/// each further one in a row doubles, up to the last.
const STORAGE_WAIT_FIRST: Duration = Duration::from_millis(1);
const STORAGE_WAIT_LAST: Duration = Duration::from_millis(64);

/// A get refused for want of storage that frees of copies can end: the
/// copy limit (ENOBUFS), or ENOMEM while storage exists at all.
fn no_storage_yet(e: &Error) -> bool {
    e.errno() == libc::ENOBUFS || (e.errno() == libc::ENOMEM && super::capacity() > 0)
}

/// Waits `wait` for copies to be freed (a stop ends it early), counted and
/// logged (warn the first time, debug at each later episode); returns the
/// next wait if the get is refused again.
fn wait_for_storage(h: &StopHandle, e: &Error, wait: Duration) -> Duration {
    if h.shared.storage_waits.fetch_add(1, Relaxed) == 0 {
        log::warn!(target: "rdmasafe", "CM dispatcher: {e}; waiting for copies to be freed");
    } else if wait == STORAGE_WAIT_FIRST {
        log::debug!(target: "rdmasafe", "CM dispatcher: {e}; waiting for copies to be freed");
    }
    if let Ok([true]) = sys::poll_readable([h.wake.fd()], Wait::For(wait)) {
        h.wake.drain();
    }
    (wait * 2).min(STORAGE_WAIT_LAST)
}

/// Ends a dispatcher's feeding of its queue however its thread ends.
struct Feeding<'a>(&'a WorkQueue);

impl Drop for Feeding<'_> {
    fn drop(&mut self) {
        self.0.producer_stopped();
    }
}

fn run(ch: EventChannel, mut sink: Sink, h: StopHandle) -> Result<()> {
    let s = &h.shared;
    let stopped = || s.stop.load(SeqCst);
    let mut storage_wait = STORAGE_WAIT_FIRST;
    let queue = match &sink {
        Sink::Queue(q) => Some(q.clone()),
        Sink::Callback(_) => None,
    };
    let _feeding = queue.as_deref().map(Feeding);
    while !stopped() {
        // (An id migrated into the channel wakes it too.)
        let [_, woken] = ch
            .inner
            .poll(h.wake.fd(), Wait::Forever, true)
            .map_err(|e| Error::new("poll", e.raw_os_error().unwrap_or(libc::EIO)))?;
        if woken {
            h.wake.drain();
        }
        let mut batch = 0u64;
        while batch < DRAIN_PER_WAKEUP as u64 && !stopped() {
            // Room first: an event is taken only when its copy can be
            // queued, so a stop never leaves one in the thread's hands.
            if let Some(q) = &queue {
                if !q.try_reserve() {
                    s.max_batch.fetch_max(batch, Relaxed);
                    if !q.reserve_wait(&stopped, &s.full_waits) {
                        break;
                    }
                }
            }
            let ev = match ch.try_get() {
                Ok(Some(ev)) => {
                    storage_wait = STORAGE_WAIT_FIRST;
                    ev
                }
                other => {
                    if let Some(q) = &queue {
                        q.give_room_back();
                    }
                    match other {
                        Ok(_) => break,
                        // No storage for a copy: the event stays in the
                        // kernel until copies are freed. Any other error
                        // ends the thread.
                        Err(e) if no_storage_yet(&e) => {
                            storage_wait = wait_for_storage(&h, &e, storage_wait);
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            batch += 1;
            if batch == 1 {
                s.wakeups.fetch_add(1, Relaxed);
            }
            s.events.fetch_add(1, Relaxed);
            match &mut sink {
                Sink::Callback(f) => f(ev),
                Sink::Queue(q) => q.push_reserved(ev),
            }
        }
        s.max_batch.fetch_max(batch, Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::copy_synthetic;

    /// A copy. It ages the copies' quarantine, which other unit tests
    /// count: a test that makes copies holds [`crate::cm::tests_lock`].
    fn ev(n: u32) -> CmEvent {
        // SAFETY: a zeroed event with no ids and no private data.
        let mut raw: sys::rdma_cm_event = unsafe { std::mem::zeroed() };
        raw.status = n as i32;
        // SAFETY: no pointers to follow.
        unsafe { copy_synthetic(&raw) }
    }

    #[test]
    fn queue_is_bounded_fifo_and_wakes_consumers() {
        let _g = crate::cm::tests_lock();
        let q = WorkQueue::new(2);
        let waits = AtomicU64::new(0);
        assert!(q.push_wait(ev(1), &|| false, &waits).is_ok());
        assert!(q.push_wait(ev(2), &|| false, &waits).is_ok());
        // Full: a producer that must give up gets its copy back.
        let back = q.push_wait(ev(3), &|| true, &waits).expect_err("full queue hands the copy back");
        assert_eq!(back.status(), 3);
        assert_eq!(q.try_pop().unwrap().status(), 1);
        // A sleeping consumer is woken by a push from another thread.
        let q2 = q.clone();
        let t = std::thread::spawn(move || {
            let a = q2.pop_timeout(Duration::from_secs(30)).map(|e| e.status());
            let b = q2.pop_timeout(Duration::from_secs(30)).map(|e| e.status());
            (a, b)
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(q.push_wait(ev(4), &|| false, &waits).is_ok());
        assert_eq!(t.join().unwrap(), (Some(2), Some(4)));
        assert_eq!(q.pop_timeout(Duration::from_millis(10)).map(|e| e.status()), None);
        assert!(!q.is_closed(), "a None of a timeout: the queue is open");
        q.close();
        assert!(q.is_closed(), "a None from here on says: closed and empty");
        assert!(q.pop_timeout(Duration::from_secs(30)).is_none(), "closed and empty returns at once");
    }

    /// The last dispatcher feeding a queue closes it, the next opens it
    /// again; one that never started leaves the queue as it found it.
    #[test]
    fn the_last_producer_closes_the_queue_and_the_next_opens_it() {
        let q = WorkQueue::new(1);
        let closed = || q.is_closed();
        assert!(!q.producer_started() && !q.producer_started(), "a new queue is open");
        q.producer_stopped();
        assert!(!closed(), "one producer still feeds it");
        q.producer_stopped();
        assert!(closed(), "the last one stopped");
        assert!(q.producer_started() && !closed(), "reopened");
        q.producer_abandoned(true);
        assert!(closed(), "closed again: its opener never started");
        let fresh = WorkQueue::new(1);
        let opened = fresh.producer_started();
        fresh.producer_abandoned(opened);
        assert!(!fresh.closed.load(SeqCst), "a queue open before stays open");
        // A runs; B counts itself in; A stops; B fails to start: closed,
        // as A's stop would have closed it without B.
        assert!(!fresh.producer_started());
        let opened = fresh.producer_started();
        fresh.producer_stopped();
        assert!(!fresh.closed.load(SeqCst), "B still counted");
        fresh.producer_abandoned(opened);
        assert!(fresh.closed.load(SeqCst), "nobody feeds it: closed");
    }

    #[test]
    fn full_queue_producer_sleeps_until_a_pop() {
        let _g = crate::cm::tests_lock();
        let q = WorkQueue::new(1);
        let waits = Arc::new(AtomicU64::new(0));
        assert!(q.push_wait(ev(1), &|| false, &waits).is_ok());
        let (q2, w2) = (q.clone(), waits.clone());
        let t = std::thread::spawn(move || q2.push_wait(ev(2), &|| false, &w2).is_ok());
        while waits.load(Relaxed) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(q.pop_timeout(Duration::from_secs(30)).unwrap().status(), 1);
        assert!(t.join().unwrap(), "producer got room after the pop");
        assert_eq!(q.try_pop().unwrap().status(), 2);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::cm::copy_synthetic;

    fn ev(n: i32) -> CmEvent {
        // SAFETY: a zeroed event has no pointers to follow.
        let mut raw: crate::sys::rdma_cm_event = unsafe { std::mem::zeroed() };
        raw.status = n;
        // SAFETY: as above.
        unsafe { copy_synthetic(&raw) }
    }

    /// A consumer that finds the queue empty and sleeps is always woken by
    /// a push (no lost wakeup in any interleaving).
    #[test]
    fn sleeping_consumer_is_woken_by_a_push() {
        loom::model(|| {
            let q = WorkQueue::new(1);
            let q2 = q.clone();
            let t = loom::thread::spawn(move || q2.pop_timeout(Duration::from_secs(3600)).map(|e| e.status()));
            let waits = AtomicU64::new(0);
            assert!(q.push_wait(ev(1), &|| false, &waits).is_ok());
            assert_eq!(t.join().unwrap(), Some(1));
        });
    }

    /// A producer that finds the queue full and sleeps is always woken by a
    /// pop, and FIFO order holds.
    #[test]
    fn sleeping_producer_is_woken_by_a_pop() {
        loom::model(|| {
            let q = WorkQueue::new(1);
            let waits = Arc::new(AtomicU64::new(0));
            assert!(q.push_wait(ev(1), &|| false, &waits).is_ok());
            let (q2, w2) = (q.clone(), waits.clone());
            let t = loom::thread::spawn(move || q2.push_wait(ev(2), &|| false, &w2).is_ok());
            let a = q.pop_timeout(Duration::from_secs(3600)).map(|e| e.status());
            let b = q.pop_timeout(Duration::from_secs(3600)).map(|e| e.status());
            assert!(t.join().unwrap());
            assert_eq!((a, b), (Some(1), Some(2)));
        });
    }

    /// Room reserved and given back (the channel had no event for it)
    /// wakes a producer waiting for room.
    #[test]
    fn room_given_back_wakes_a_waiting_producer() {
        loom::model(|| {
            let q = WorkQueue::new(1);
            assert!(q.try_reserve());
            let q2 = q.clone();
            let t = loom::thread::spawn(move || q2.reserve_wait(&|| false, &AtomicU64::new(0)));
            q.give_room_back();
            assert!(t.join().unwrap());
        });
    }

    /// close() wakes a sleeping consumer, which then returns None.
    #[test]
    fn close_wakes_a_sleeping_consumer() {
        loom::model(|| {
            let q = WorkQueue::new(1);
            let q2 = q.clone();
            let t = loom::thread::spawn(move || q2.pop_timeout(Duration::from_secs(3600)).is_none());
            q.close();
            assert!(t.join().unwrap());
        });
    }
}
