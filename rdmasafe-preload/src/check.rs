//! Check mode (`RDMASAFE_CHECK=1`, or `fix`): nothing is copied. librdmacm's
//! and libibverbs' events pass through untouched, and the preload keeps
//! books on them, to report what the program really does:
//!
//! * a CM event not acked `RDMASAFE_CHECK_HOLD_MS` (default 1000) after it
//!   was got (`held`), and when it is acked after all (`late-ack`);
//! * a `rdma_destroy_id` that has waited that long for an unacked event of
//!   its id (`destroy-id-waiting`): the destroy hang, named;
//! * CM events never acked at exit (`unacked-at-exit`);
//! * an ack of a pointer that is no unacked event (`bad-ack`): refused
//!   with EINVAL, not passed to librdmacm, which would free it again;
//! * `ibv_destroy_cq` of a CQ with unacked events (`cq-destroy-unacked`),
//!   reported before the call, which then waits forever; with
//!   `RDMASAFE_CHECK=fix` the preload acks them first, so it returns;
//! * more acks than events on a CQ (`cq-overack`), or acks on a CQ while
//!   another CQ of the same completion channel has the unacked events
//!   (`cq-wrong-cq`); either makes `ibv_destroy_cq` wait forever (it waits
//!   until the acks *equal* the events); with `fix` the excess is not
//!   passed on;
//! * `ibv_destroy_cq` after such excess acks (`cq-destroy-overacked`), and
//!   CQs with unacked events at exit (`cq-unacked-at-exit`).
//!
//! An event librdmacm itself holds as a synchronous id's current event
//! (`id->event`, ids made without a channel, e.g. by `rdma_create_ep`) is
//! not the program's to ack: it is never reported as held, at exit, or as
//! the one a destroy waits for (librdmacm acks it inside the destroy).
//!
//! The books ([`CmBook`], [`CqBook`]) are plain data, tested on the host;
//! [`Checker`] wraps the real calls around them.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rdmasafe_core::cm::EventType;
use rdmasafe_core::sys::{self, cancel, ibv_comp_channel, ibv_cq, rdma_cm_event, rdma_cm_id, rdma_event_channel};

use crate::out;
use crate::real::{AckCmEvent, AckCqEvents, DestroyCq, DestroyId, GetCmEvent, GetCqEvent};

/// One thing to report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Finding {
    pub kind: &'static str,
    pub text: String,
}

fn finding(kind: &'static str, text: String) -> Finding {
    Finding { kind, text }
}

fn type_name(t: u32) -> String {
    EventType(t).c_name().to_string_lossy().into_owned()
}

/// What the book keeps of an unacked CM event.
#[derive(Clone, Debug)]
pub(crate) struct CmEntry {
    pub ty: u32,
    pub status: i32,
    /// `ev->id` as a number.
    pub id: usize,
    /// The id whose `rdma_destroy_id` waits for this event's ack: librdmacm
    /// charges a CONNECT_REQUEST to its listening id (`ev->listen_id`); the
    /// new id `ev->id` may be destroyed before the ack, and that destroy
    /// does not wait. Every other event: `id`.
    pub charged: usize,
    /// `id` was destroyed while this event was unacked (only possible when
    /// it is not `charged`): it must not be read through any more.
    pub id_gone: bool,
    pub got_ms: u64,
    /// The process that got it (a child forked without exec inherits the
    /// book, not the events' fate).
    pub pid: u32,
    pub held_reported: bool,
    pub destroy_reported: bool,
}

impl CmEntry {
    fn describe(&self, ev: usize) -> String {
        format!("{} event {ev:#x} of id {:#x} (status {})", type_name(self.ty), self.id, self.status)
    }

    /// The id a destroy of which this event holds back, for a report.
    fn waiting_id(&self) -> String {
        if self.charged == self.id {
            "the id".to_string()
        } else {
            format!("its listening id {:#x}", self.charged)
        }
    }
}

/// Unacked CM events and the destroys in progress.
#[derive(Default)]
pub(crate) struct CmBook {
    live: HashMap<usize, CmEntry>,
    /// `rdma_destroy_id` calls in progress: id -> when it began (ms).
    destroying: HashMap<usize, u64>,
    pub seen: u64,
    pub acked: u64,
    pub bad_acks: u64,
}

impl CmBook {
    pub(crate) fn got(&mut self, ev: usize, e: CmEntry) {
        self.seen += 1;
        self.live.insert(ev, e);
    }

    /// The ack of `ev`: its entry, or `None` (and counted) if `ev` is no
    /// unacked event.
    pub(crate) fn ack(&mut self, ev: usize) -> Option<CmEntry> {
        let e = self.live.remove(&ev);
        if e.is_some() {
            self.acked += 1;
        } else {
            self.bad_acks += 1;
        }
        e
    }

    pub(crate) fn destroy_begin(&mut self, id: usize, now_ms: u64) {
        self.destroying.insert(id, now_ms);
        // A CONNECT_REQUEST's new id may go before its event is acked (the
        // destroy does not wait for it): from now on nothing reads it.
        for e in self.live.values_mut().filter(|e| e.id == id && e.charged != id) {
            e.id_gone = true;
        }
    }

    pub(crate) fn destroy_end(&mut self, id: usize) {
        self.destroying.remove(&id);
    }

    /// Reports due at `now_ms` in process `pid`: its events held `hold_ms`
    /// or longer (once each), and destroys that have waited `hold_ms` or
    /// longer for one (once per event). `librdmacm_holds(ev, entry)` tells
    /// the events a synchronous id holds, which are skipped. A forked
    /// child's book starts as a copy of its parent's: the parent's events
    /// in it are the parent's to ack, never reported by the child.
    pub(crate) fn due(
        &mut self,
        now_ms: u64,
        hold_ms: u64,
        pid: u32,
        mut librdmacm_holds: impl FnMut(usize, &CmEntry) -> bool,
    ) -> Vec<Finding> {
        let mut out = Vec::new();
        let mut evs: Vec<usize> = self.live.iter().filter(|(_, e)| e.pid == pid).map(|(ev, _)| *ev).collect();
        evs.sort_unstable(); // a stable order of reports within one pass
        for ev in evs {
            let destroying = self.live.get(&ev).and_then(|e| self.destroying.get(&e.charged).copied());
            let Some(e) = self.live.get_mut(&ev) else { continue };
            let age = now_ms.saturating_sub(e.got_ms);
            let held_due = !e.held_reported && age >= hold_ms;
            let destroy_due = !e.destroy_reported && destroying.is_some_and(|t| now_ms.saturating_sub(t) >= hold_ms);
            if !held_due && !destroy_due {
                continue;
            }
            if !e.id_gone && librdmacm_holds(ev, e) {
                continue;
            }
            if held_due {
                e.held_reported = true;
                out.push(finding(
                    "held",
                    format!(
                        "{} not acked for {age} ms (threshold {hold_ms} ms): until it is, rdma_destroy_id of {} \
                         waits",
                        e.describe(ev),
                        e.waiting_id()
                    ),
                ));
            }
            if destroy_due {
                e.destroy_reported = true;
                let waited = now_ms.saturating_sub(destroying.unwrap_or(now_ms));
                out.push(finding(
                    "destroy-id-waiting",
                    format!(
                        "rdma_destroy_id({:#x}) has waited {waited} ms for {} (held {age} ms, not acked): it \
                         returns only once the event is acked",
                        e.charged,
                        e.describe(ev)
                    ),
                ));
            }
        }
        out
    }

    /// Reports at exit: events of process `pid` never acked. Returns them
    /// and how many a synchronous id still held (not reported).
    pub(crate) fn at_exit(
        &self,
        now_ms: u64,
        pid: u32,
        mut librdmacm_holds: impl FnMut(usize, &CmEntry) -> bool,
    ) -> (Vec<Finding>, u64) {
        let mut out = Vec::new();
        let mut held_by_librdmacm = 0;
        let mut evs: Vec<(&usize, &CmEntry)> = self.live.iter().filter(|(_, e)| e.pid == pid).collect();
        evs.sort_unstable_by_key(|(ev, _)| **ev);
        for (&ev, e) in evs {
            if !e.id_gone && librdmacm_holds(ev, e) {
                held_by_librdmacm += 1;
                continue;
            }
            out.push(finding(
                "unacked-at-exit",
                format!("{} never acked: got {} ms before exit", e.describe(ev), now_ms.saturating_sub(e.got_ms)),
            ));
        }
        (out, held_by_librdmacm)
    }

    pub(crate) fn unacked(&self) -> u64 {
        self.live.len() as u64
    }
}

/// The events and acks of one CQ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct CqAcct {
    /// Its completion channel as a number (0: not known).
    channel: usize,
    got: u64,
    /// Acks passed on to libibverbs.
    acked: u64,
}

/// CQ event accounting per CQ.
#[derive(Default)]
pub(crate) struct CqBook {
    cqs: HashMap<usize, CqAcct>,
    pub events: u64,
    pub acks: u64,
    pub problems: u64,
}

/// What to do with an `ibv_ack_cq_events` call.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AckPlan {
    /// How many acks to pass on.
    pub forward: u32,
    pub findings: Vec<Finding>,
}

/// What to do before an `ibv_destroy_cq` call.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct DestroyPlan {
    /// Acks to pass on first (fix mode).
    pub ack_first: u32,
    pub findings: Vec<Finding>,
}

impl CqBook {
    pub(crate) fn got(&mut self, cq: usize, channel: usize) {
        self.events += 1;
        let a = self.cqs.entry(cq).or_default();
        a.channel = channel;
        a.got += 1;
    }

    /// `ibv_ack_cq_events(cq, n)`; `channel_of` gives the CQ's channel if
    /// the book does not know it yet (the CQ had no event).
    pub(crate) fn ack(&mut self, cq: usize, n: u32, channel_of: impl FnOnce() -> usize, fix: bool) -> AckPlan {
        self.acks += u64::from(n);
        let a = *self.cqs.entry(cq).or_insert_with(|| CqAcct { channel: channel_of(), ..CqAcct::default() });
        let unacked = a.got.saturating_sub(a.acked);
        if u64::from(n) <= unacked {
            self.cqs.entry(cq).or_default().acked += u64::from(n);
            return AckPlan { forward: n, findings: Vec::new() };
        }
        self.problems += 1;
        let excess = u64::from(n) - unacked;
        let mut siblings: Vec<(usize, u64)> = self
            .cqs
            .iter()
            .filter(|(other, o)| **other != cq && a.channel != 0 && o.channel == a.channel && o.got > o.acked)
            .map(|(other, o)| (*other, o.got - o.acked))
            .collect();
        siblings.sort_unstable();
        let (kind, mut text) = if siblings.is_empty() {
            (
                "cq-overack",
                format!(
                    "ibv_ack_cq_events({cq:#x}, {n}): more acks than events on this CQ (got {}, acked {} before): \
                     ibv_destroy_cq({cq:#x}) will wait forever",
                    a.got, a.acked
                ),
            )
        } else {
            let others: Vec<String> = siblings.iter().map(|(o, u)| format!("CQ {o:#x} has {u} unacked")).collect();
            (
                "cq-wrong-cq",
                format!(
                    "ibv_ack_cq_events({cq:#x}, {n}): this CQ has only {unacked} unacked event(s) (got {}, acked {}) \
                     while on the same completion channel {}: acked on the wrong CQ? ibv_destroy_cq waits forever \
                     on both",
                    a.got,
                    a.acked,
                    others.join(", ")
                ),
            )
        };
        // `unacked < n`, so it fits a u32.
        let forward = if fix { unacked as u32 } else { n };
        if fix {
            text.push_str(&format!("; RDMASAFE_CHECK=fix: passed on {forward}, dropped the {excess} excess"));
        }
        self.cqs.entry(cq).or_default().acked += u64::from(forward);
        AckPlan { forward, findings: vec![finding(kind, text)] }
    }

    /// Before `ibv_destroy_cq(cq)`.
    pub(crate) fn destroy(&mut self, cq: usize, fix: bool) -> DestroyPlan {
        let Some(a) = self.cqs.get_mut(&cq) else {
            return DestroyPlan { ack_first: 0, findings: Vec::new() };
        };
        if a.got > a.acked {
            self.problems += 1;
            let unacked = a.got - a.acked;
            let mut text = format!(
                "ibv_destroy_cq({cq:#x}) with {unacked} unacked CQ event(s) (got {}, acked {}): it waits until they \
                 are acked, forever if nobody does",
                a.got, a.acked
            );
            let mut ack_first = 0;
            if fix {
                ack_first = u32::try_from(unacked).unwrap_or(u32::MAX);
                a.acked += u64::from(ack_first);
                text.push_str(&format!("; RDMASAFE_CHECK=fix: acked {ack_first} now, so it returns"));
            }
            return DestroyPlan { ack_first, findings: vec![finding("cq-destroy-unacked", text)] };
        }
        if a.acked > a.got {
            self.problems += 1;
            return DestroyPlan {
                ack_first: 0,
                findings: vec![finding(
                    "cq-destroy-overacked",
                    format!(
                        "ibv_destroy_cq({cq:#x}) after more acks than events (got {}, acked {}): it waits forever",
                        a.got, a.acked
                    ),
                )],
            };
        }
        DestroyPlan { ack_first: 0, findings: Vec::new() }
    }

    /// After a successful `ibv_destroy_cq(cq)`.
    pub(crate) fn destroyed(&mut self, cq: usize) {
        self.cqs.remove(&cq);
    }

    pub(crate) fn at_exit(&self) -> Vec<Finding> {
        let mut cqs: Vec<(&usize, &CqAcct)> = self.cqs.iter().filter(|(_, a)| a.got > a.acked).collect();
        cqs.sort_unstable_by_key(|(cq, _)| **cq);
        cqs.into_iter()
            .map(|(cq, a)| {
                finding(
                    "cq-unacked-at-exit",
                    format!(
                        "CQ {cq:#x} has {} unacked event(s) at exit (got {}, acked {})",
                        a.got - a.acked,
                        a.got,
                        a.acked
                    ),
                )
            })
            .collect()
    }
}

/// Reports emitted so far.
static REPORTS: AtomicU64 = AtomicU64::new(0);

fn emit(findings: &[Finding]) {
    for f in findings {
        REPORTS.fetch_add(1, Relaxed);
        out::report(f.kind, &f.text);
    }
}

/// Runs bookkeeping; a panic in it is logged and `fallback` used instead:
/// the program's call goes on as if the preload were not there.
fn guarded<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            log::error!(target: "rdmasafe", "preload: internal panic in check mode's bookkeeping (call passed through)");
            fallback
        }
    }
}

thread_local! {
    /// True while this thread holds one of the books' locks (a [`Booked`]
    /// lives): a `fork` from a signal handler that interrupted it there
    /// must not wait for the lock ([`Checker::before_fork`]).
    static IN_BOOK: Cell<bool> = const { Cell::new(false) };
    /// The locks the forking thread holds across `fork` (from
    /// [`Checker::before_fork`] to [`Checker::after_fork`]).
    static HELD_FOR_FORK: RefCell<Option<ForkHold>> = const { RefCell::new(None) };
}

/// A book locked by this thread, marked in `IN_BOOK` from before the lock
/// is taken until after it is let go (the guard is `None` only in drop).
struct Booked<'a, T>(Option<MutexGuard<'a, T>>);

impl<T> Drop for Booked<'_, T> {
    fn drop(&mut self) {
        drop(self.0.take());
        IN_BOOK.with(|b| b.set(false));
    }
}

impl<T> std::ops::Deref for Booked<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_deref().expect("a Booked holds its guard until dropped")
    }
}

impl<T> std::ops::DerefMut for Booked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_deref_mut().expect("a Booked holds its guard until dropped")
    }
}

/// `m` locked (a poisoned lock is taken as it is: the books stay usable).
/// The books are never locked two at a time, but by the fork handler.
fn lock<T>(m: &Mutex<T>) -> Booked<'_, T> {
    IN_BOOK.with(|b| b.set(true));
    Booked(Some(m.lock().unwrap_or_else(|e| e.into_inner())))
}

/// What the forking thread holds across `fork`: both books, so that the
/// child gets neither locked by a thread it does not have. (The reports'
/// fallback, stderr, takes no lock: see `out::to_stderr`.)
struct ForkHold {
    _cm: MutexGuard<'static, CmBook>,
    _cq: MutexGuard<'static, CqBook>,
}

/// `m` locked for the exit report, or None (said on stderr) if it stays
/// taken for 200 ms: its holder may be the exiting thread itself.
fn lock_at_exit<'a, T>(m: &'a Mutex<T>, what: &str) -> Option<MutexGuard<'a, T>> {
    let patience = std::time::Instant::now() + Duration::from_millis(200);
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < patience => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                crate::out::setup_error(&format!(
                    "exit: the {what} book stayed locked (exit called from a signal handler inside a get or an ack?): \
                     its findings and counts are left out of the exit report"
                ));
                return None;
            }
        }
    }
}

/// True if `ev` is librdmacm's own current event of a synchronous id.
///
/// # Safety
/// Call with the CM book locked and `ev` in it (unacked): then its id
/// cannot be freed meanwhile (`rdma_destroy_id` waits until every event of
/// the id is acked, and an ack takes the book's lock first).
unsafe fn librdmacm_holds(ev: usize, e: &CmEntry) -> bool {
    if e.id == 0 {
        return false;
    }
    // SAFETY: the id is live (see above).
    unsafe { sys::current_event(e.id as *const rdma_cm_id) as usize == ev }
}

/// Check mode's state.
pub(crate) struct Checker {
    fix: bool,
    hold_ms: u64,
    cm: Mutex<CmBook>,
    cq: Mutex<CqBook>,
    /// The process whose watcher thread runs (0: none yet). A forked child
    /// inherits its parent's value but not the thread: it starts its own.
    watcher: AtomicU32,
}

impl Checker {
    pub(crate) fn new(fix: bool) -> Checker {
        let hold_ms = match std::env::var("RDMASAFE_CHECK_HOLD_MS") {
            Err(_) => 1000,
            Ok(s) => s.trim().parse::<u64>().unwrap_or_else(|_| {
                crate::out::setup_error(&format!("RDMASAFE_CHECK_HOLD_MS={s:?} is no number of milliseconds: 1000"));
                1000
            }),
        }
        .max(1);
        Checker { fix, hold_ms, cm: Mutex::default(), cq: Mutex::default(), watcher: AtomicU32::new(0) }
    }

    pub(crate) fn describe(&self) -> String {
        format!("check{} (hold threshold {} ms)", if self.fix { " with fix" } else { "" }, self.hold_ms)
    }

    /// Starts the thread that reports held events (once per process `pid`,
    /// at its first CM event).
    fn start_watcher(&'static self, pid: u32) {
        if self.watcher.load(Relaxed) == pid || self.watcher.swap(pid, Relaxed) == pid {
            return;
        }
        let tick = Duration::from_millis((self.hold_ms / 4).clamp(10, 250));
        let spawned = sys::spawn_signals_blocked("rdmasafe-check", move || loop {
            std::thread::sleep(tick);
            let findings = guarded(Vec::new(), || {
                let mut book = lock(&self.cm);
                // SAFETY: the book is locked and every event it holds is unacked.
                book.due(sys::coarse_now_ms(), self.hold_ms, pid, |ev, e| unsafe { librdmacm_holds(ev, e) })
            });
            emit(&findings);
        });
        if let Err(e) = spawned {
            crate::out::setup_error(&format!("cannot start the check thread ({e}): held events go unreported"));
        }
    }

    /// `rdma_get_cm_event`, watched.
    ///
    /// # Safety
    /// As `rdma_get_cm_event`.
    pub(crate) unsafe fn get_cm_event(
        &'static self,
        real: GetCmEvent,
        channel: *mut rdma_event_channel,
        event: *mut *mut rdma_cm_event,
    ) -> c_int {
        // SAFETY: the program's own arguments, passed on unchanged.
        let r = unsafe { real(channel, event) };
        if r == 0 {
            let errno = sys::errno_raw();
            // SAFETY: on success *event is a new, unacked librdmacm event,
            // readable until it is acked (not before this returns).
            let (ev, ty, status, id, listen_id) = unsafe {
                let ev = *event;
                (ev, (*ev).event, (*ev).status, (*ev).id as usize, (*ev).listen_id as usize)
            };
            let charged = if EventType(ty) == EventType::CONNECT_REQUEST && listen_id != 0 { listen_id } else { id };
            let pid = std::process::id();
            let entry = CmEntry {
                ty,
                status,
                id,
                charged,
                id_gone: false,
                got_ms: sys::coarse_now_ms(),
                pid,
                held_reported: false,
                destroy_reported: false,
            };
            guarded((), || {
                lock(&self.cm).got(ev as usize, entry);
                self.start_watcher(pid);
            });
            sys::set_errno(errno);
        }
        r
    }

    /// `rdma_ack_cm_event`, watched: an event the book does not hold is
    /// refused (EINVAL) instead of freed a second time.
    ///
    /// # Safety
    /// As `rdma_ack_cm_event`.
    pub(crate) unsafe fn ack_cm_event(&self, real: AckCmEvent, event: *mut rdma_cm_event) -> c_int {
        if event.is_null() {
            // SAFETY: librdmacm checks for NULL itself (EINVAL).
            return unsafe { real(event) };
        }
        let errno = sys::errno_raw();
        let known = guarded(Some(None), || lock(&self.cm).ack(event as usize).map(Some));
        let Some(entry) = known else {
            emit(&[finding(
                "bad-ack",
                format!(
                    "rdma_ack_cm_event({:#x}): not an event rdma_get_cm_event handed out, or acked already: not \
                     passed to librdmacm (it would free it again); returned -1/EINVAL",
                    event as usize
                ),
            )]);
            sys::set_errno(libc::EINVAL);
            return -1;
        };
        sys::set_errno(errno);
        // SAFETY: an unacked event of librdmacm's (the book had it), acked once.
        let r = unsafe { real(event) };
        if let Some(e) = entry.filter(|e| e.held_reported) {
            let errno = sys::errno_raw();
            let age = sys::coarse_now_ms().saturating_sub(e.got_ms);
            emit(&[finding("late-ack", format!("{} acked after {age} ms", e.describe(event as usize)))]);
            sys::set_errno(errno);
        }
        r
    }

    /// `rdma_destroy_id`, watched (the watcher names a destroy that waits
    /// for an unacked event).
    ///
    /// # Safety
    /// As `rdma_destroy_id`.
    pub(crate) unsafe fn destroy_id(&self, real: DestroyId, id: *mut rdma_cm_id) -> c_int {
        /// The thread was cancelled inside the destroy (librdmacm waits on
        /// a condition variable, a cancellation point): the destroy is
        /// over, and waits for no event any more.
        unsafe extern "C" fn ended(arg: *mut c_void) {
            // SAFETY: a pointer to the frame's (checker, id), alive while
            // the unwind runs this.
            let (checker, id) = unsafe { *arg.cast::<(&Checker, usize)>() };
            guarded((), || lock(&checker.cm).destroy_end(id));
        }
        guarded((), || lock(&self.cm).destroy_begin(id as usize, sys::coarse_now_ms()));
        let mut who = (self, id as usize);
        // SAFETY: the program's argument, passed on unchanged; `who` lives
        // in this frame across the call, which holds plain values only.
        let r = unsafe { cancel::call_with_cleanup(ended, (&mut who as *mut (&Checker, usize)).cast(), || real(id)) };
        let errno = sys::errno_raw();
        guarded((), || lock(&self.cm).destroy_end(id as usize));
        sys::set_errno(errno);
        r
    }

    /// `ibv_get_cq_event`, watched.
    ///
    /// # Safety
    /// As `ibv_get_cq_event`.
    pub(crate) unsafe fn get_cq_event(
        &self,
        real: GetCqEvent,
        channel: *mut ibv_comp_channel,
        cq: *mut *mut ibv_cq,
        cq_context: *mut *mut c_void,
    ) -> c_int {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(channel, cq, cq_context) };
        if r == 0 && !cq.is_null() {
            let errno = sys::errno_raw();
            // SAFETY: on success libibverbs wrote the CQ the event is for.
            let got = unsafe { *cq } as usize;
            guarded((), || lock(&self.cq).got(got, channel as usize));
            sys::set_errno(errno);
        }
        r
    }

    /// `ibv_ack_cq_events`, watched.
    ///
    /// # Safety
    /// As `ibv_ack_cq_events`.
    pub(crate) unsafe fn ack_cq_events(&self, real: AckCqEvents, cq: *mut ibv_cq, nevents: c_uint) {
        if cq.is_null() || nevents == 0 {
            // SAFETY: passed on unchanged, as the program made the call.
            return unsafe { real(cq, nevents) };
        }
        let errno = sys::errno_raw();
        let plan = guarded(AckPlan { forward: nevents, findings: Vec::new() }, || {
            // SAFETY: the CQ is live (the program acks on it; libibverbs
            // reads it too); its channel field is plain data.
            lock(&self.cq).ack(cq as usize, nevents, || unsafe { (*cq).channel } as usize, self.fix)
        });
        emit(&plan.findings);
        sys::set_errno(errno);
        if plan.forward > 0 {
            // SAFETY: the program's CQ; at most the acks it asked for.
            unsafe { real(cq, plan.forward) };
        }
    }

    /// `ibv_destroy_cq`, watched; reports unacked events before the call
    /// (which waits for them) and, in fix mode, acks them first.
    ///
    /// # Safety
    /// As `ibv_destroy_cq`.
    pub(crate) unsafe fn destroy_cq(&self, real: DestroyCq, ack: Option<AckCqEvents>, cq: *mut ibv_cq) -> c_int {
        if cq.is_null() {
            // SAFETY: passed on unchanged.
            return unsafe { real(cq) };
        }
        let errno = sys::errno_raw();
        // The plan (its findings) is dropped before the destroy: a thread
        // cancelled in it (it waits for the CQ's acks) unwinds through this
        // frame, which must then hold nothing with a destructor.
        let ack_first = {
            let plan = guarded(DestroyPlan { ack_first: 0, findings: Vec::new() }, || {
                lock(&self.cq).destroy(cq as usize, self.fix && ack.is_some())
            });
            emit(&plan.findings);
            plan.ack_first
        };
        if let (n @ 1.., Some(ack)) = (ack_first, ack) {
            // SAFETY: the program's live CQ, acked by exactly the events it
            // got and did not ack.
            unsafe { ack(cq, n) };
        }
        sys::set_errno(errno);
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(cq) };
        if r == 0 {
            let errno = sys::errno_raw();
            guarded((), || lock(&self.cq).destroyed(cq as usize));
            sys::set_errno(errno);
        }
        r
    }

    /// `fork`'s prepare handler (`pthread_atfork`): takes both books'
    /// locks, and keeps them in this thread until [`Checker::after_fork`]
    /// runs in the parent and in the child. Without it a child forked while
    /// another thread was inside the book-keeping (the watcher, or any
    /// thread in a get or an ack) inherited the lock taken for good: its
    /// first get or ack hung. A `fork` from a signal handler that
    /// interrupted this thread inside the book-keeping takes nothing (the
    /// lock is this thread's own; waiting would hang the parent): that
    /// child may hang as before (`fork` is not async-signal-safe with
    /// fork handlers, POSIX.1-2008 TC2).
    pub(crate) fn before_fork(&'static self) {
        if IN_BOOK.with(Cell::get) {
            return;
        }
        let hold = ForkHold {
            _cm: self.cm.lock().unwrap_or_else(|e| e.into_inner()),
            _cq: self.cq.lock().unwrap_or_else(|e| e.into_inner()),
        };
        HELD_FOR_FORK.with(|h| *h.borrow_mut() = Some(hold));
    }

    /// `fork`'s parent and child handler: lets go of what
    /// [`Checker::before_fork`] took (in the child, the forking thread is
    /// the one thread, and the same thread: its locks are its own).
    pub(crate) fn after_fork(&self) {
        let hold = HELD_FOR_FORK.with(|h| h.borrow_mut().take());
        drop(hold);
    }

    /// At exit: reports what was never acked; the info-level summary line.
    /// A book that stays locked (its holder is the exiting thread itself,
    /// which a signal handler that calls `exit` interrupted inside a get or
    /// an ack, or a thread that exit(3) left running) is left out after a
    /// short wait, with a line that says so, rather than waited for.
    pub(crate) fn at_exit(&self) {
        let now = sys::coarse_now_ms();
        let mut findings = Vec::new();
        let (librdmacm_held, cm) = match lock_at_exit(&self.cm, "CM") {
            Some(book) => {
                // SAFETY: the book is locked and every event it holds is unacked.
                let (f, held) = book.at_exit(now, std::process::id(), |ev, e| unsafe { librdmacm_holds(ev, e) });
                findings = f;
                (held, (book.seen, book.acked, book.unacked(), book.bad_acks))
            }
            None => (0, (0, 0, 0, 0)),
        };
        let cq = match lock_at_exit(&self.cq, "CQ") {
            Some(book) => {
                findings.extend(book.at_exit());
                (book.events, book.acks, book.problems)
            }
            None => (0, 0, 0),
        };
        emit(&findings);
        log::info!(
            target: "rdmasafe",
            "preload exit [{}]: mode={} cm_events={} cm_acked={} cm_unacked={} held_by_librdmacm={} bad_acks={} \
             cq_events={} cq_acks={} cq_problems={} reports={}",
            out::who(),
            if self.fix { "fix" } else { "check" },
            cm.0,
            cm.1,
            cm.2,
            librdmacm_held,
            cm.3,
            cq.0,
            cq.1,
            cq.2,
            REPORTS.load(Relaxed)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ty: u32, id: usize, got_ms: u64) -> CmEntry {
        CmEntry {
            ty,
            status: 0,
            id,
            charged: id,
            id_gone: false,
            got_ms,
            pid: 7,
            held_reported: false,
            destroy_reported: false,
        }
    }

    /// A CONNECT_REQUEST of new id `id` on listening id `listen`.
    fn request(id: usize, listen: usize, got_ms: u64) -> CmEntry {
        CmEntry { charged: listen, ..entry(EventType::CONNECT_REQUEST.0, id, got_ms) }
    }

    /// A forked child's watcher reports its own events only: the events
    /// of its parent (pid 7) in the copy of the book it inherited, held or
    /// waited for by a destroy in the parent, are the parent's (they were
    /// reported by the child as held; found by a review).
    #[test]
    fn a_forked_childs_watcher_reports_only_its_own_events() {
        let mut b = CmBook::default();
        b.got(0x1000, entry(EventType::ADDR_RESOLVED.0, 0xa0, 0));
        b.destroy_begin(0xa0, 0);
        b.got(0x2000, CmEntry { pid: 8, ..entry(EventType::ADDR_RESOLVED.0, 0xb0, 0) });
        let f = b.due(5000, 1000, 8, |_, _| false);
        assert_eq!(f.len(), 1, "{:?}", f.iter().map(|f| &f.text).collect::<Vec<_>>());
        assert!(f[0].text.contains("event 0x2000 of id 0xb0"), "{}", f[0].text);
        // In the parent, its own (held, and waited for by its destroy).
        let f = b.due(5000, 1000, 7, |_, _| false);
        assert_eq!(f.iter().map(|f| f.kind).collect::<Vec<_>>(), ["held", "destroy-id-waiting"]);
    }

    #[test]
    fn a_connect_request_holds_back_its_listening_ids_destroy() {
        let mut b = CmBook::default();
        b.got(0x1000, request(0xa0, 0x50, 0));
        let f = b.due(1000, 1000, 7, |_, _| false);
        assert_eq!(f.len(), 1);
        assert!(f[0].text.ends_with("until it is, rdma_destroy_id of its listening id 0x50 waits"), "{}", f[0].text);
        // The listening id's destroy waits for it, and is named.
        b.destroy_begin(0x50, 1500);
        let f = b.due(2500, 1000, 7, |_, _| false);
        assert_eq!(f.iter().map(|f| f.kind).collect::<Vec<_>>(), ["destroy-id-waiting"]);
        assert!(f[0].text.starts_with("rdma_destroy_id(0x50) has waited 1000 ms for RDMA_CM_EVENT_CONNECT_REQUEST"));
    }

    #[test]
    fn a_connect_requests_new_id_destroyed_before_the_ack_is_never_read() {
        let mut b = CmBook::default();
        b.got(0x1000, request(0xa0, 0x50, 0));
        // The program rejects and destroys the new id, then acks later: that
        // destroy does not wait, and the id's memory is freed.
        b.destroy_begin(0xa0, 10);
        b.destroy_end(0xa0);
        let f = b.due(1000, 1000, 7, |ev, _| panic!("event {ev:#x}: its freed id was read"));
        assert_eq!(f.iter().map(|f| f.kind).collect::<Vec<_>>(), ["held"], "no destroy of 0xa0 waits for it");
        let (f, _) = b.at_exit(2000, 7, |ev, _| panic!("event {ev:#x}: its freed id was read at exit"));
        assert_eq!(f.iter().map(|f| f.kind).collect::<Vec<_>>(), ["unacked-at-exit"]);
        assert!(b.ack(0x1000).is_some());
    }

    #[test]
    fn held_events_are_reported_once_and_sync_ids_never() {
        let mut b = CmBook::default();
        b.got(0x1000, entry(EventType::ESTABLISHED.0, 0xa0, 100));
        b.got(0x2000, entry(EventType::ADDR_RESOLVED.0, 0xb0, 100));
        assert!(b.due(1099, 1000, 7, |_, _| false).is_empty(), "not yet");
        let f = b.due(1100, 1000, 7, |ev, _| ev == 0x2000);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "held");
        assert!(f[0]
            .text
            .starts_with("RDMA_CM_EVENT_ESTABLISHED event 0x1000 of id 0xa0 (status 0) not acked for 1000 ms"));
        assert!(b.due(5000, 1000, 7, |ev, _| ev == 0x2000).is_empty(), "reported once");
        let e = b.ack(0x1000).expect("known");
        assert!(e.held_reported);
        assert!(b.ack(0x1000).is_none(), "a second ack is unknown");
        assert_eq!((b.seen, b.acked, b.bad_acks), (2, 1, 1));
    }

    #[test]
    fn a_destroy_waiting_for_an_event_is_named() {
        let mut b = CmBook::default();
        b.got(0x1000, entry(EventType::DISCONNECTED.0, 0xa0, 0));
        let f = b.due(1000, 1000, 7, |_, _| false);
        assert_eq!(f.iter().map(|f| f.kind).collect::<Vec<_>>(), ["held"]);
        b.destroy_begin(0xa0, 1500);
        assert!(b.due(2499, 1000, 7, |_, _| false).is_empty());
        let f = b.due(2500, 1000, 7, |_, _| false);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "destroy-id-waiting");
        assert!(f[0].text.starts_with("rdma_destroy_id(0xa0) has waited 1000 ms for RDMA_CM_EVENT_DISCONNECTED"));
        b.destroy_end(0xa0);
        // A destroy of an id whose event is acked quickly reports nothing.
        b.got(0x3000, entry(EventType::DISCONNECTED.0, 0xc0, 3000));
        b.destroy_begin(0xc0, 3000);
        assert!(b.ack(0x3000).is_some());
        b.destroy_end(0xc0);
        assert!(b.due(9000, 1000, 7, |_, _| false).is_empty());
    }

    #[test]
    fn exit_reports_this_process_events_except_librdmacm_ones() {
        let mut b = CmBook::default();
        b.got(0x1000, entry(EventType::ADDR_RESOLVED.0, 0xa0, 0));
        b.got(0x2000, entry(EventType::ESTABLISHED.0, 0xb0, 0));
        let mut other = entry(EventType::ESTABLISHED.0, 0xc0, 0);
        other.pid = 8;
        b.got(0x3000, other);
        let (f, held) = b.at_exit(250, 7, |ev, _| ev == 0x2000);
        assert_eq!(held, 1);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "unacked-at-exit");
        assert_eq!(
            f[0].text,
            "RDMA_CM_EVENT_ADDR_RESOLVED event 0x1000 of id 0xa0 (status 0) never acked: got 250 ms before exit"
        );
    }

    #[test]
    fn cq_acks_balance_and_unacked_destroy_is_reported_and_fixed() {
        let mut b = CqBook::default();
        b.got(0xa, 0xc);
        b.got(0xa, 0xc);
        assert_eq!(b.ack(0xa, 1, || unreachable!(), false), AckPlan { forward: 1, findings: vec![] });
        let p = b.destroy(0xa, false);
        assert_eq!(p.ack_first, 0);
        assert_eq!(p.findings[0].kind, "cq-destroy-unacked");
        assert!(p.findings[0].text.starts_with("ibv_destroy_cq(0xa) with 1 unacked CQ event(s) (got 2, acked 1)"));
        let p = b.destroy(0xa, true);
        assert_eq!(p.ack_first, 1);
        assert!(p.findings[0].text.ends_with("RDMASAFE_CHECK=fix: acked 1 now, so it returns"));
        assert_eq!(b.destroy(0xa, true), DestroyPlan { ack_first: 0, findings: vec![] }, "balanced now");
        b.destroyed(0xa);
        assert!(b.at_exit().is_empty());
        assert_eq!(b.destroy(0xdead, false), DestroyPlan { ack_first: 0, findings: vec![] }, "a CQ never seen");
    }

    #[test]
    fn wrong_cq_and_overack() {
        let mut b = CqBook::default();
        b.got(0xa, 0xc); // the event is A's
        let p = b.ack(0xb, 1, || 0xc, false); // acked on B, same channel
        assert_eq!(p.forward, 1);
        assert_eq!(p.findings[0].kind, "cq-wrong-cq");
        assert!(p.findings[0].text.contains("while on the same completion channel CQ 0xa has 1 unacked"));
        assert_eq!(b.destroy(0xb, false).findings[0].kind, "cq-destroy-overacked");
        assert_eq!(b.destroy(0xa, false).findings[0].kind, "cq-destroy-unacked");
        assert_eq!(b.at_exit()[0].kind, "cq-unacked-at-exit");

        let mut b = CqBook::default();
        b.got(0xa, 0xc);
        let p = b.ack(0xa, 3, || unreachable!(), true);
        assert_eq!(p.forward, 1, "fix passes on only what was got");
        assert_eq!(p.findings[0].kind, "cq-overack");
        assert!(p.findings[0].text.ends_with("RDMASAFE_CHECK=fix: passed on 1, dropped the 2 excess"));
        assert!(b.destroy(0xa, true).findings.is_empty(), "fix kept it balanced");
        assert_eq!(b.problems, 1);

        // A CQ on another channel with unacked events is no sibling.
        let mut b = CqBook::default();
        b.got(0xa, 0xc);
        let p = b.ack(0xb, 1, || 0xd, false);
        assert_eq!(p.findings[0].kind, "cq-overack");
    }
}
