//! Async: the CM event channel and the CQ loop on a tokio runtime (the
//! `tokio` feature).
//!
//! Both sit on [`tokio::io::unix::AsyncFd`] and keep every guarantee of
//! the blocking paths, because they run the very same code, one
//! non-blocking step at a time:
//!
//! * [`AsyncEventChannel::next`] is [`EventChannel::try_get`] whenever the
//!   channel's fd is readable: each event is copied and librdmacm's
//!   original acked before you see it; readiness is cleared only after a
//!   get found the channel empty (EAGAIN).
//! * [`AsyncCqLoop::run`] is [`CqLoop::process_ready`] whenever the loop's
//!   own epoll fd is readable (a CQ event, a CQ added or removed from any
//!   task or thread, a stop, a due deadline): arm before the final drain,
//!   acks batched per CQ and flushed at stop, several CQs per channel, live
//!   membership through [`LoopControl`]. Readiness is cleared only when the
//!   loop reports nothing ready ([`Progress::more`](crate::cq::Progress)
//!   false). The loop's own deadlines (keepalives, drains, the watchdog)
//!   are awaited with [`tokio::time::sleep_until`] of
//!   [`CqLoop::next_timeout`], never a periodic timer.
//! * Drains and removals that would block ([`LoopControl::drain_id`],
//!   [`LoopControl::remove_cq`], [`LoopControl::remove_keepalive`]) have
//!   async forms that never block the runtime: [`drain_id`], [`drain_qp`],
//!   [`remove_cq`], [`remove_keepalive`] start the request at once and
//!   return a [`Done`] future that the loop completes (from its own cycle,
//!   through a oneshot). [`LoopTask::stop`] stops a spawned loop and awaits
//!   it. Adding a CQ or a keepalive never blocks.
//!
//! Handlers run on the runtime's thread that drives the loop: keep them
//! short and never block in them (send work to a task instead, e.g.
//! through an unbounded channel). A blocking request from a thread outside
//! the runtime ([`LoopControl::drain_id`], [`LoopControl::remove_cq`])
//! waits for the running loop to apply and finish it, so the handlers stay
//! on the runtime's thread and that thread is never held up by it (while
//! a run future is alive: between a run dropped, by `select!` or a
//! timeout, say, and the next one's first poll, the caller runs the loop
//! itself, as when nobody runs it); made
//! on the thread that polled the run last (outside a handler), it runs the
//! loop there, as a blocking call does when nobody runs the loop. A run
//! that is alive but not polled (its runtime idle, its task blocked: never
//! make a blocking call from the task that owns the run future) is waited
//! for only 2 s without a sign of life; then the caller runs the loop
//! itself (counted in [`crate::cq::LoopStats::grace_takeovers`]). In async
//! code use the async forms: a blocking request from any
//! task of the runtime holds its worker thread, and tokio may keep the
//! run's wakeup on that very worker (its next-task slot, which other
//! workers do not steal), so the run waits for the request and the request
//! for the run until the 2 s pass (seen about once in 40 to 120 blocking
//! `remove_keepalive` calls from a task on a 2- to 4-worker runtime).
//!
//! Cancellation: every future here may be dropped at any await point.
//! A dropped [`AsyncEventChannel::next`] loses no event (events are taken
//! only inside a synchronous step); a dropped [`AsyncCqLoop::run`] flushes
//! the loop's pending acks and leaves the loop ready to run again; a
//! dropped [`Done`] leaves its request running to its end (a drain's
//! markers are still consumed by the loop, never delivered).
//!
//! ```no_run
//! use rdmasafe_core::aio::{AsyncCqLoop, AsyncEventChannel};
//! use rdmasafe_core::cm::{EventChannel, EventType, PortSpace};
//! use rdmasafe_core::cq::{CqLoop, LoopOptions};
//! use rdmasafe_core::verbs::CompChannel;
//!
//! async fn serve() -> rdmasafe_core::Result<()> {
//!     let ch = AsyncEventChannel::new(EventChannel::new()?)?;
//!     let listener = ch.channel().create_id(PortSpace::Tcp)?;
//!     listener.bind_addr("10.77.0.1:7471".parse().unwrap())?;
//!     listener.listen(64)?;
//!     let ctx = listener.device_context()?;
//!     let chan = CompChannel::new(&ctx)?;
//!     let task = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default())?)?.spawn();
//!     let ctl = task.control(); // add CQs from any task: ctl.add_cq(..)
//!     loop {
//!         let ev = ch.next().await?; // copied and acked already
//!         if ev.event_type() == EventType::DISCONNECTED {
//!             break;
//!         }
//!         // accept requests, give their QPs CQs on `chan`, add them with `ctl`
//!     }
//!     task.stop().await?; // every ack flushed
//!     Ok(())
//! }
//! ```

use std::future::{poll_fn, Future};
use std::io;
use std::pin::{pin, Pin};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::cm::{CmEvent, CmId, EventChannel};
use crate::cq::{CqLoop, LoopControl, Progress, RunClaim};
use crate::sys::ibv_qp;
use crate::verbs::Cq;
use crate::{Error, Result};

fn no_runtime() -> Error {
    Error::new("rdmasafe async: not inside a tokio runtime", libc::EINVAL)
}

/// The fd-owning types this module registers: each returns the same fd,
/// open, for as long as the value lives.
trait OwnsItsFd: std::os::fd::AsRawFd {}
impl OwnsItsFd for EventChannel {}
impl OwnsItsFd for CqLoop {}
impl OwnsItsFd for MovedIn {}

fn register<T: OwnsItsFd>(inner: T) -> Result<AsyncFd<T>> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(no_runtime());
    }
    // SAFETY: I/O safety of the registered fd: an EventChannel's fd is the
    // librdmacm channel's, closed only when the channel (kept alive by the
    // value) is destroyed; a MovedIn's is the channel's moved-in eventfd,
    // closed only with the channel's shared state, which the value keeps;
    // a CqLoop's is its own epoll fd, owned by its shared state, which the
    // value keeps. All are fixed for the value's life, and the AsyncFd
    // owns the value until it is dropped or `into_inner` deregisters it.
    unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
        .map_err(|e| Error::from(e.into_parts().1).context("AsyncFd::register"))
}

// ------------------------------------------------------------ CM events

/// An [`EventChannel`] whose events are awaited on a tokio runtime.
///
/// Events are the same owned copies [`EventChannel::get`] returns (copied,
/// and librdmacm's original acked, before you see them). The channel may
/// be shared between tasks (`&self` is enough to await
/// [`AsyncEventChannel::next`]); ids are made on
/// [`AsyncEventChannel::channel`]. One `AsyncEventChannel` per channel: a
/// second one on a clone of the same channel fails to register (EEXIST)
/// on the same runtime; on another runtime it registers, and the two then
/// take events from one queue, each seeing only some of them: don't.
pub struct AsyncEventChannel {
    fd: AsyncFd<EventChannel>,
    /// Readable when an id was migrated into the channel
    /// ([`CmId::migrate`]): the kernel moves its queued events without an
    /// edge on `fd`.
    moved_in: AsyncFd<MovedIn>,
}

/// The channel's moved-in eventfd (see [`AsyncEventChannel`]), kept open
/// by the channel it belongs to.
struct MovedIn {
    fd: std::os::fd::RawFd,
    _channel: EventChannel,
}

impl std::os::fd::AsRawFd for MovedIn {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd
    }
}

impl AsyncEventChannel {
    /// Registers `channel` with the current runtime's I/O driver. EINVAL
    /// outside a runtime; the error of `eventfd(2)` (EMFILE, ...) if the
    /// channel's eventfd for migrated ids (see [`CmId::migrate`]) cannot
    /// be made. The runtime needs its I/O driver (`enable_io` /
    /// `enable_all`): inside one built without it, tokio panics here, as
    /// its own I/O types do (and `channel` is dropped with the unwind).
    pub fn new(channel: EventChannel) -> Result<AsyncEventChannel> {
        let moved_in = MovedIn { fd: channel.inner.moved_in()?.fd(), _channel: channel.clone() };
        let fd = register(channel)?;
        Ok(AsyncEventChannel { fd, moved_in: register(moved_in)? })
    }

    /// The channel (to create ids on it).
    pub fn channel(&self) -> &EventChannel {
        self.fd.get_ref()
    }

    /// Waits for the next event. Cancel-safe: dropping the future before
    /// it completes loses no event. Any number of tasks may await it at
    /// once: each waiter is woken when the channel becomes readable, and
    /// each event goes to one of them. Events of an id migrated into the
    /// channel ([`CmId::migrate`]) wake it too.
    pub async fn next(&self) -> Result<CmEvent> {
        loop {
            // `async_io` and `readable` wait with a waker per waiter
            // (`poll_read_ready`, under poll_next, keeps only the last
            // task's) and spend the task's cooperative budget as tokio's
            // own I/O does. Events are taken only in the synchronous steps.
            let io = pin!(self.fd.async_io(Interest::READABLE, get_or_would_block));
            let moved = pin!(self.moved_in.readable());
            match first_of(io, moved).await {
                Ok(r) => return r.map_err(Error::from)?,
                Err(guard) => {
                    // The moved-in signal stays set until a get finds the
                    // channel empty (as the fd's own readiness does).
                    if let Ok(r) = guard.map_err(Error::from)?.try_io(|_| get_or_would_block(self.channel())) {
                        return r.map_err(Error::from)?;
                    }
                }
            }
        }
    }

    /// Waits for a first event, then appends it and up to `max - 1` more
    /// that are ready without waiting to `out`; returns how many (at
    /// least 1). Cancel-safe like [`AsyncEventChannel::next`].
    pub async fn next_batch(&self, out: &mut Vec<CmEvent>, max: usize) -> Result<usize> {
        if max == 0 {
            return Err(Error::new("rdmasafe next_batch", libc::EINVAL));
        }
        out.push(self.next().await?);
        let mut n = 1;
        while n < max {
            match self.channel().try_get() {
                Ok(Some(ev)) => {
                    out.push(ev);
                    n += 1;
                }
                // Nothing more (or an error the next call reports).
                _ => break,
            }
        }
        Ok(n)
    }

    /// The poll form of [`AsyncEventChannel::next`] (for a hand-written
    /// future or a `Stream` adapter): `Ready` with the next event or an
    /// error, `Pending` with `cx` registered for the fd's readiness.
    /// Single consumer: only the task that polled it last is woken (as
    /// tokio's `AsyncFd::poll_read_ready`); tasks that share the channel
    /// await [`AsyncEventChannel::next`] instead.
    pub fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Result<CmEvent>> {
        loop {
            if let Poll::Ready(guard) = self.moved_in.poll_read_ready(cx) {
                if let Ok(r) = guard.map_err(Error::from)?.try_io(|_| get_or_would_block(self.channel())) {
                    return Poll::Ready(r.map_err(Error::from)?);
                }
                // Cleared: the next poll_read_ready registers cx.
                continue;
            }
            let mut guard = ready!(self.fd.poll_read_ready(cx)).map_err(Error::from)?;
            if let Ok(r) = guard.try_io(|inner| get_or_would_block(inner.get_ref())) {
                return Poll::Ready(r.map_err(Error::from)?);
            }
        }
    }

    /// Deregisters the channel and gives it back.
    pub fn into_inner(self) -> EventChannel {
        let AsyncEventChannel { fd, moved_in } = self;
        drop(moved_in);
        fd.into_inner()
    }
}

/// Awaits two futures at once: `Ok` with the first's output if it is ready
/// first (or both are), `Err` with the second's.
async fn first_of<A: Future, B: Future>(
    mut a: Pin<&mut A>,
    mut b: Pin<&mut B>,
) -> std::result::Result<A::Output, B::Output> {
    poll_fn(|cx| {
        if let Poll::Ready(v) = a.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        b.as_mut().poll(cx).map(Err)
    })
    .await
}

/// One get from the channel, for a readiness wait: `Ok` with the event or
/// the get's error, `WouldBlock` when the channel is empty (readiness is
/// cleared then, and only then). A step taken inside the wait's
/// synchronous part: a future dropped at any await loses no event.
fn get_or_would_block(ch: &EventChannel) -> io::Result<Result<CmEvent>> {
    match ch.try_get() {
        Ok(Some(ev)) => Ok(Ok(ev)),
        Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
        Err(e) => Ok(Err(e)),
    }
}

impl std::fmt::Debug for AsyncEventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AsyncEventChannel({:?})", self.fd.get_ref())
    }
}

// -------------------------------------------------------------- CQ loop

/// A [`CqLoop`] driven by a tokio runtime: [`AsyncCqLoop::run`] is a
/// future that runs the loop until a stop, [`AsyncCqLoop::spawn`] runs it
/// as a task. CQs are added and removed through [`AsyncCqLoop::control`]
/// from any task, thread, or handler, while it runs.
///
/// Meant for [`Mode::Event`](crate::cq::Mode) (the default): the future
/// sleeps until the loop has work. In busy-poll mode it never sleeps, and
/// in adaptive mode not while it spins: it then keeps a runtime thread
/// busy, letting the thread's other tasks run every few cycles.
///
/// The loop's deadlines (keepalive, drain, watchdog) are real time: the
/// run waits for them with a `tokio::time` sleep of the real time left.
/// Under tokio's paused clock (`start_paused`, test-util) such a sleep
/// ends at once whenever the runtime is idle, so while the loop has a
/// deadline the run keeps a thread busy until the real deadline, and the
/// paused clock races ahead of real time meanwhile.
pub struct AsyncCqLoop {
    fd: AsyncFd<CqLoop>,
    /// A `run` future is alive (a second one gets EBUSY).
    active: AtomicBool,
}

/// How many cycles [`AsyncCqLoop::run`] runs in a row before it lets other
/// tasks of its runtime thread run (it never holds a thread longer).
const CYCLES_PER_TURN: usize = 32;

impl AsyncCqLoop {
    /// Registers the loop's fd with the current runtime's I/O driver.
    /// EINVAL outside a runtime. The runtime needs its I/O driver and its
    /// time driver (`enable_all`): without the I/O driver tokio panics
    /// here (and `lp` is dropped with the unwind); without the time driver
    /// [`AsyncCqLoop::run`] panics in tokio once the loop has a deadline to
    /// wait for (a keepalive, a drain, the watchdog), as `tokio::time`
    /// does.
    pub fn new(lp: CqLoop) -> Result<AsyncCqLoop> {
        Ok(AsyncCqLoop { fd: register(lp)?, active: AtomicBool::new(false) })
    }

    /// The loop (its figures, options, CQ count, ...). While a run future
    /// is alive its runner calls get EBUSY from other threads, EDEADLK
    /// from inside one of its handlers (see [`AsyncCqLoop::run`]).
    pub fn get_ref(&self) -> &CqLoop {
        self.fd.get_ref()
    }

    /// The loop's control: add and remove CQs, stop, from anywhere.
    pub fn control(&self) -> LoopControl {
        self.fd.get_ref().control()
    }

    /// Runs the loop until a stop ([`LoopControl::stop`], from anywhere):
    /// delivers completions to the handlers as their CQs' events come, and
    /// returns with every pending ack flushed and the stop request
    /// consumed (the loop can run again). EBUSY if another `run` future of
    /// this loop is alive or a thread runs the loop ([`CqLoop::run`]),
    /// EDEADLK from inside one of its handlers.
    /// From its first poll until it returns or is dropped, the future
    /// holds the loop as a running thread does: the runner calls of
    /// [`AsyncCqLoop::get_ref`] (`run`, `run_for`, `process_once`,
    /// `process_ready`, `flush_acks`) get EBUSY from any other thread
    /// (EDEADLK from inside one of its handlers, as this call does there),
    /// and [`CqLoop::is_running`] is true.
    /// Dropping the future mid-flight flushes every pending ack too; CQ
    /// events that arrive afterwards are read by the next run (or acked
    /// when the loop is dropped).
    pub async fn run(&self) -> Result<()> {
        let lp = self.fd.get_ref();
        if lp.control().on_loop_thread() {
            return Err(Error::new("rdmasafe async CQ loop: run from inside one of its handlers", libc::EDEADLK));
        }
        if self.active.swap(true, SeqCst) {
            return Err(Error::new("rdmasafe async CQ loop: another run future is alive", libc::EBUSY));
        }
        // The loop is this run's from now until it ends or is dropped: a
        // thread's runner call in between two steps is refused, never one
        // of the steps (which would end the run).
        let mark = ActiveMark(&self.active);
        let flush = FlushOnDrop { lp, claim: lp.claim_run()?, _mark: mark };
        // Blocking changes from other threads wait for the thread polling
        // the run now instead of running handlers there (set again after
        // every wait: the task may move to another thread).
        lp.set_async_driver(true);
        loop {
            // Wait for the fd, or for the loop's next deadline (the fd's
            // timer fires then too; this is the runtime's own timer for it).
            let deadline = lp.next_timeout().map(|d| tokio::time::Instant::now() + d);
            let guard = {
                let mut readable = pin!(self.fd.readable());
                let mut sleep = pin!(deadline.map(tokio::time::sleep_until));
                poll_fn(|cx| {
                    if let Poll::Ready(r) = readable.as_mut().poll(cx) {
                        return Poll::Ready(r.map(Some));
                    }
                    if let Some(s) = sleep.as_mut().as_pin_mut() {
                        if s.poll(cx).is_ready() {
                            return Poll::Ready(Ok(None));
                        }
                    }
                    Poll::Pending
                })
                .await
                .map_err(Error::from)?
            };
            lp.set_async_driver(true);
            let mut guard = guard;
            let mut turn = 0;
            loop {
                let p: Progress = match guard.as_mut() {
                    // Readiness is cleared only when the loop reports
                    // nothing ready.
                    Some(g) => match g.try_io(|inner| match inner.get_ref().process_ready_claimed(&flush.claim) {
                        Ok(p) if !p.more && !p.stopped => Err(io::ErrorKind::WouldBlock.into()),
                        other => Ok(other),
                    }) {
                        Ok(r) => r.map_err(Error::from)??,
                        Err(_would_block) => break,
                    },
                    None => lp.process_ready_claimed(&flush.claim)?,
                };
                if p.stopped {
                    return Ok(());
                }
                if !p.more {
                    break;
                }
                turn += 1;
                if turn == CYCLES_PER_TURN {
                    // Let the thread's other tasks run; the fd's readiness
                    // was not cleared, so the next wait returns at once.
                    tokio::task::yield_now().await;
                    break;
                }
            }
        }
    }

    /// Runs the loop as a task of the current runtime (see
    /// [`AsyncCqLoop::run`]); [`LoopTask::stop`] stops it and gives the
    /// loop back. Until the task is first polled, a blocking change
    /// ([`LoopControl::drain_id`], [`LoopControl::remove_cq`]) from the
    /// spawning thread waits for the runtime to run it if that thread is
    /// outside a multi-thread runtime's tasks (a plain thread in
    /// `Runtime::enter`, `block_on`); from a task, or on a current-thread
    /// runtime, it runs the loop (and the handlers) on the spawning thread,
    /// also when that is a `spawn_blocking` or `block_in_place` thread.
    pub fn spawn(self) -> LoopTask {
        let ctl = self.control();
        // From now on, not only once the task is first polled: blocking
        // changes from other threads wait for the task (see the module
        // docs). The mark goes with the task, however it ends (run over,
        // aborted, dropped before its first poll).
        let mark = DriverMark(self.control());
        mark.0 .0.set_driver_tag(first_driver());
        let join = tokio::spawn(async move {
            let _mark = mark;
            let r = self.run().await;
            (self, r)
        });
        LoopTask { ctl, join }
    }

    /// Deregisters the loop's fd and gives the loop back.
    pub fn into_inner(self) -> CqLoop {
        self.fd.into_inner()
    }
}

/// Who drives a loop spawned now until its task is first polled (then the
/// polling thread, see [`CqLoop::set_async_driver`]): a guess of whether
/// the spawning thread will poll it. Yes inside a task (on a multi-thread
/// runtime a worker, whose LIFO slot the new task takes and no other
/// worker steals: a blocking change from it must drive the loop, not wait
/// for the grace) and on a current-thread runtime (usually its one thread,
/// in `block_on`): the spawner's tag. Otherwise (a plain thread in
/// `Runtime::enter`, or `block_on` of a multi-thread runtime) no thread:
/// its blocking changes wait for the workers, which run the handlers.
/// tokio has no "is this a worker" call, so the guess is wrong, until the
/// first poll only, for a spawn from `spawn_blocking`, `block_in_place`, a
/// `LocalSet` task on a multi-thread runtime's `block_on` thread, or a
/// second thread in a current-thread runtime's `enter` (see
/// [`AsyncCqLoop::spawn`]).
fn first_driver() -> u64 {
    let on_this_thread = tokio::task::try_id().is_some()
        || tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread;
    if on_this_thread {
        crate::sys::thread_tag()
    } else {
        crate::cq::NOT_POLLED_YET
    }
}

/// A spawned loop's task drives the loop: set at the spawn, cleared when
/// the task's future goes.
struct DriverMark(LoopControl);

impl Drop for DriverMark {
    fn drop(&mut self) {
        self.0 .0.set_driver(false);
    }
}

/// A run future's hold on its loop: when the run ends or is dropped
/// mid-flight, flushes the loop's pending acks (never blocks: the state is
/// not held across an await), then lets the loop go: the fields drop in
/// order, the claim before the mark (a run started meanwhile by another
/// task, refused by the mark until then, is never refused by the claim).
struct FlushOnDrop<'a> {
    lp: &'a CqLoop,
    claim: RunClaim<'a>,
    _mark: ActiveMark<'a>,
}

impl Drop for FlushOnDrop<'_> {
    fn drop(&mut self) {
        self.lp.flush_acks_claimed(&self.claim);
        self.lp.set_async_driver(false);
    }
}

/// A run future of the loop is alive (cleared on drop).
struct ActiveMark<'a>(&'a AtomicBool);

impl Drop for ActiveMark<'_> {
    fn drop(&mut self) {
        self.0.store(false, SeqCst);
    }
}

impl std::fmt::Debug for AsyncCqLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AsyncCqLoop(fd {})", std::os::fd::AsRawFd::as_raw_fd(self.fd.get_ref()))
    }
}

/// A loop running as a tokio task ([`AsyncCqLoop::spawn`]). Dropping it
/// detaches the task: the loop keeps running until a stop through one of
/// its controls (then the loop is dropped with the task's result).
pub struct LoopTask {
    ctl: LoopControl,
    join: tokio::task::JoinHandle<(AsyncCqLoop, Result<()>)>,
}

impl LoopTask {
    /// The loop's control.
    pub fn control(&self) -> LoopControl {
        self.ctl.clone()
    }

    /// Stops the loop, awaits its task (never blocking the runtime), and
    /// gives the loop back (it can be run again). The error is the one the
    /// run ended with, if any; EIO if the task panicked or was aborted.
    pub async fn stop(self) -> Result<AsyncCqLoop> {
        self.ctl.stop();
        let (lp, r) = self.join.await.map_err(|_| Error::new("rdmasafe async CQ loop task", libc::EIO))?;
        // As LoopThread::stop: a stop a handler requested before ours was
        // consumed by the run; ours must not linger for the next run.
        lp.get_ref().control().0.stop.store(false, SeqCst);
        r.map(|_| lp)
    }

    /// Aborts the task: the loop is dropped on the runtime (its CQs leave
    /// it, every ack flushed), as a dropped [`CqLoop`] is.
    pub fn abort(&self) {
        self.join.abort();
    }

    /// True once the task has ended.
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

// ---------------------------------------------------- requests, awaited

/// The result of a request the loop completes (a drain, a removal): a
/// future that never blocks the runtime. The request was started when the
/// call that returned this was made; dropping this future does not cancel
/// it. It completes only while something drives the loop (its
/// [`AsyncCqLoop::run`] or another runner). ECANCELED if the loop went
/// away first.
#[must_use = "the request runs anyway; await this to learn its result"]
pub struct Done(oneshot::Receiver<Result<()>>);

impl Future for Done {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match ready!(Pin::new(&mut self.0).poll(cx)) {
            Ok(r) => Poll::Ready(r),
            Err(_) => Poll::Ready(Err(Error::new("rdmasafe async request: the loop went away", libc::ECANCELED))),
        }
    }
}

impl std::fmt::Debug for Done {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Done")
    }
}

type DoneFn = Box<dyn FnOnce(Result<()>) + Send>;

fn done_pair() -> (DoneFn, Done) {
    let (tx, rx) = oneshot::channel();
    (
        Box::new(move |r| {
            // The receiver may be gone (a dropped future): fine.
            let _ = tx.send(r);
        }),
        Done(rx),
    )
}

/// Drains the QP `id` owns (see [`LoopControl::drain_id`]) without
/// blocking: the drain starts now (error state, markers), and the returned
/// future completes when the loop has seen both markers (everything posted
/// before completed and delivered, every CQ event acked) or at `timeout`
/// (ETIMEDOUT). EINVAL at once if the id has no QP or its CQs are not in
/// the loop.
pub fn drain_id(ctl: &LoopControl, id: &CmId, timeout: Duration) -> Result<Done> {
    let (f, done) = done_pair();
    ctl.drain_id_then(id, timeout, f)?;
    Ok(done)
}

/// [`drain_id`] for a raw QP (see [`LoopControl::drain_qp`]).
///
/// # Safety
/// As for [`LoopControl::drain_qp_then`]: `qp` live, with a free slot on
/// each queue, until the returned future completes (or, if it is dropped,
/// until the drain's timeout).
pub unsafe fn drain_qp(ctl: &LoopControl, qp: NonNull<ibv_qp>, srq: bool, timeout: Duration) -> Result<Done> {
    let (f, done) = done_pair();
    // SAFETY: forwarded contract.
    unsafe { ctl.drain_qp_then(qp, srq, timeout, f) }?;
    Ok(done)
}

/// Stops dead-peer detection for the QP with this number (see
/// [`LoopControl::remove_keepalive`]) without blocking: the future
/// completes once the loop applied the removal (no probe is posted after
/// that; one still out is consumed when it completes). ENOENT at once if
/// the QP has no keepalive.
pub fn remove_keepalive(ctl: &LoopControl, qp_num: u32) -> Result<Done> {
    let (f, done) = done_pair();
    ctl.remove_keepalive_then(qp_num, f)?;
    Ok(done)
}

/// Removes a CQ from the loop (see [`LoopControl::remove_cq`]) without
/// blocking: the future completes once the removal is done (its acks
/// flushed, its handler dropped), after which the CQ may be destroyed.
/// ENOENT at once if the CQ is not in the loop.
pub fn remove_cq(ctl: &LoopControl, cq: &Cq) -> Result<Done> {
    let (f, done) = done_pair();
    ctl.remove_raw_cq_then(cq.raw(), f)?;
    Ok(done)
}
