//! Dead-peer detection: a zero-length RDMA WRITE after a period of
//! silence, and a timer, not the QP's retry count, decides.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::drain;
use super::handle::LiveQp;
use super::options::Keepalive;
use super::DeadPeer;
use crate::sys;
use crate::wc::Wc;

enum Probe {
    /// None outstanding.
    Idle,
    /// Posted at this time.
    Sent(Instant),
    /// The send queue was full (ENOMEM) since this time: retried until
    /// the bound, not taken for a dead peer.
    Blocked(Instant),
    /// The peer is declared dead at the next look: a request of the QP
    /// failed with "retry exceeded", a probe failed, or the QP cannot take
    /// one. `out`: a probe of it is still outstanding (its completion is
    /// consumed; none is invented when there is none, which would take
    /// the probe of a keepalive added again on the QP).
    Failed { out: bool },
}

struct Entry {
    qp: LiveQp,
    /// Its registration's serial (see [`Registrations`]).
    serial: u64,
    send_cq: usize,
    cfg: Keepalive,
    last_activity: Instant,
    probe: Probe,
    dead: bool,
    /// The QP is in an error state that the keepalive did not cause (a
    /// drain, the app's disconnect, another request's error, whose own
    /// completion or event reports it): no more probes, and a flushed
    /// probe is not a dead peer.
    quiet: bool,
    /// A probe (or other work) of this QP completed successfully: it is
    /// connected. Until then a probe is posted only once the QP is in RTS
    /// (a keepalive added before accept or connect waits for it), and its
    /// bound is at least twice the QP's ack timeout: the peer's QP may not
    /// be ready yet when ours is (the client's moves on when its app gets
    /// the CM event), and then drops the probe, which is sent again only
    /// after that timeout.
    connected: bool,
    /// The probe out (sent or blocked) was attempted before the QP was
    /// connected: its bound includes `first_grace` until it is answered,
    /// also after another request of the QP succeeded meanwhile (that
    /// probe may still be the one the peer dropped).
    probe_graced: bool,
    /// Twice the QP's ack timeout (from `ibv_query_qp`, when the first
    /// probe is posted); zero until then.
    first_grace: Duration,
    /// Another request of the QP failed with "retry exceeded": the peer is
    /// unreachable (the probe then only flushes, which alone is not a dead
    /// peer).
    peer_lost: bool,
    /// The app drained the QP: the loop leaves its teardown to the app
    /// (a peer declared dead after that gets `on_dead`, and the loop
    /// neither drains the QP nor touches it again: the app may have
    /// destroyed it once its drain was reported).
    drained_by_app: bool,
    /// Added while an orphan probe of an older QP with its number
    /// (destroyed: another address) was out through its send CQ, in this
    /// sweep generation: the loop polls that CQ until it is empty, then
    /// forgets such orphans (see [`Keepalives::sweep_begin`]).
    sweep: Option<u64>,
    on_dead: DeadPeer,
}

/// The keepalives of one loop, by QP number.
#[derive(Default)]
pub(crate) struct Keepalives {
    by_qpn: HashMap<u32, Entry>,
    /// Probes still outstanding for keepalives that were removed, or
    /// adopted with their CQ. Their completions are consumed like any
    /// probe's; they go (parked) when their CQ leaves the loop, and at most
    /// [`MAX_ORPHANS`] are kept (a QP destroyed without a drain may never
    /// return its probe).
    orphans: VecDeque<LateProbe>,
    /// No deadline is earlier than this (a cache: activity only ever moves
    /// deadlines later, so waking at it is early at worst).
    next: Option<Instant>,
    /// Keepalives with `sweep` set (or fewer: one removed since).
    sweeps: usize,
    /// The sweep generation (see [`Keepalives::sweep_begin`]).
    sweep_gen: u64,
}

/// A keepalive's registration: its QP number and a serial that no other
/// registration of the loop has.
pub(crate) type Registration = (u32, u64);

/// The QP numbers with a keepalive, as the app sees them: an add answers
/// EBUSY at once for a number taken, a remove ENOENT for one not taken,
/// while the loop applies the change later. A keepalive that ends in the
/// loop by itself (its QP destroyed, its send CQ removed, its add never
/// started) forgets its own registration only: between the app's remove
/// and the loop's applying it, the number may have been registered again
/// for a new QP that got it, whose registration must stay. A change and
/// the loop's command for it are queued under the lock of these (see
/// `control::change_keepalives`), so the loop gets one number's adds and
/// removes in the order they were made; it applies an app's remove to the
/// registration it removed only (see [`Keepalives::remove`]).
#[derive(Default)]
pub(crate) struct Registrations {
    by_qpn: HashMap<u32, u64>,
    next: u64,
}

impl Registrations {
    /// Registers `qpn`; `None` if it is registered already.
    pub(crate) fn register(&mut self, qpn: u32) -> Option<Registration> {
        if self.by_qpn.contains_key(&qpn) {
            return None;
        }
        self.next += 1;
        self.by_qpn.insert(qpn, self.next);
        Some((qpn, self.next))
    }

    /// The app removes `qpn`'s keepalive: its registration, `None` if it
    /// had none.
    pub(crate) fn unregister(&mut self, qpn: u32) -> Option<Registration> {
        self.by_qpn.remove(&qpn).map(|serial| (qpn, serial))
    }

    /// Keepalives that ended in the loop by themselves: each forgets its
    /// registration if it is still the one under its number.
    pub(crate) fn forget(&mut self, gone: &[Registration]) {
        for (qpn, serial) in gone {
            if self.by_qpn.get(qpn) == Some(serial) {
                self.by_qpn.remove(qpn);
            }
        }
    }
}

/// A probe still out with no keepalive of its own (an orphan), or parked
/// with its CQ out of every loop. `qp` (the address) tells its QP from a
/// later one with the same number: an orphan of a destroyed QP must not
/// take the probes of a new QP that got its number (the new QP's keepalive
/// would wait for its probe until the bound, and declare a live peer dead).
#[derive(Debug, PartialEq)]
pub(crate) struct LateProbe {
    pub(crate) qp_num: u32,
    pub(crate) qp: usize,
    pub(crate) wr_id: u64,
    /// The send CQ it completes through.
    pub(crate) cq: usize,
}

impl Entry {
    /// A probe of it is outstanding.
    fn probe_out(&self) -> bool {
        matches!(self.probe, Probe::Sent(_) | Probe::Failed { out: true })
    }

    /// Its probe still out, if any, as a late probe (through its send CQ).
    fn late_probe(&self, qp_num: u32) -> Option<LateProbe> {
        self.probe_out().then(|| LateProbe {
            qp_num,
            qp: self.qp.raw() as usize,
            wr_id: self.cfg.wr_id,
            cq: self.send_cq,
        })
    }
}

/// Appends `p` to the orphans, forgetting the oldest when full.
fn push_orphan(orphans: &mut VecDeque<LateProbe>, p: LateProbe) {
    if orphans.len() >= MAX_ORPHANS {
        orphans.pop_front();
    }
    orphans.push_back(p);
}

/// `next` becomes `d` if that is earlier (or `next` is unset).
fn earliest(next: &mut Option<Instant>, d: Instant) {
    *next = Some(next.map_or(d, |n| n.min(d)));
}

/// A dead or quiet peer's keepalive sends no more probes. It is still
/// looked at once a period for its id's drop, which ends it; a QP without
/// an id stays until the app removes the keepalive.
fn watch_for_drop(e: &Entry, now: Instant, next: &mut Option<Instant>) {
    if e.qp.has_owner() {
        earliest(next, sys::deadline_after(now, e.cfg.period));
    }
}

impl Entry {
    /// The bound of the probe out now (see `connected`, `probe_graced`).
    fn bound(&self) -> Duration {
        if self.probe_graced {
            self.cfg.bound.max(self.first_grace)
        } else {
            self.cfg.bound
        }
    }

    /// The peer is dead: declared at the next look, which is `now` (the
    /// timer need not wait).
    fn fail_now(&mut self, next: &mut Option<Instant>, now: Instant) {
        self.probe = Probe::Failed { out: self.probe_out() };
        *next = Some(now);
    }

    /// A probe is due (its bound counting from `since`): waits for RTS,
    /// posts it, or says why not.
    fn attempt_probe(&mut self, now: Instant, since: Instant) -> Attempt {
        // Not connected yet (added before accept / connect): a probe waits
        // for RTS, a period at a time (one state query per attempt until
        // the QP's first success).
        if !self.connected && self.qp.send_state() == sys::QpSend::NotYet {
            self.probe = Probe::Idle;
            self.last_activity = now;
            return Attempt::NotPosted;
        }
        if !self.connected && self.first_grace.is_zero() {
            self.first_grace = self.qp.ack_timeout().map_or(Duration::ZERO, |t| 2 * t);
        }
        // A retry of a blocked probe keeps the grace it was first tried with.
        if !matches!(self.probe, Probe::Blocked(_)) {
            self.probe_graced = !self.connected;
        }
        match self.qp.post_probe(self.cfg.wr_id) {
            Ok(()) => {
                self.probe = Probe::Sent(now);
                return Attempt::Posted;
            }
            Err(err) if err.errno() == libc::ENOMEM => self.probe = Probe::Blocked(since),
            // Its CmId destroyed it meanwhile: the keepalive ends.
            Err(err) if err.errno() == libc::ENOENT => return Attempt::Destroyed,
            // In an error state someone else caused (see `quiet`).
            Err(_) if !self.peer_lost && self.qp.send_state() == sys::QpSend::Error => {
                self.probe = Probe::Idle;
                self.quiet = true;
            }
            // The QP cannot take a probe at all.
            Err(_) => self.probe = Probe::Failed { out: false },
        }
        Attempt::NotPosted
    }
}

/// What [`Entry::attempt_probe`] came to.
enum Attempt {
    Posted,
    NotPosted,
    /// The QP's `CmId` destroyed it.
    Destroyed,
}

/// Most probes of removed keepalives remembered (the oldest forgotten first).
const MAX_ORPHANS: usize = 1024;

/// How long the loop looks for the markers of a dead peer's QP (see
/// `Core::drain_dead_peer`); left to come back as orphans after that.
pub(crate) const DEAD_PEER_DRAIN: Duration = Duration::from_secs(5);

/// How often a probe blocked by a full send queue is retried.
fn retry_interval(cfg: &Keepalive) -> Duration {
    (cfg.period.min(cfg.bound) / 16).clamp(Duration::from_millis(1), Duration::from_millis(50))
}

impl Keepalives {
    pub(crate) fn is_empty(&self) -> bool {
        self.by_qpn.is_empty() && self.orphans.is_empty()
    }

    /// Starts detection on `qp`, registered as `serial`; false (nothing
    /// kept, `on_dead` dropped) if its `CmId` destroyed it since the caller
    /// checked it: the caller then forgets the registration.
    #[must_use]
    pub(crate) fn add(&mut self, qp: LiveQp, serial: u64, cfg: Keepalive, on_dead: DeadPeer, now: Instant) -> bool {
        let Ok((qpn, send_cq, _)) = qp.info() else { return false };
        // A keepalive of the number still here would be an older one the
        // app removed, its removal not applied yet (none is: the control
        // queues changes in the order they were registered). It goes now,
        // its probe out kept as an orphan, as a removal keeps it.
        self.remove_entry(qpn);
        // An orphan of another QP with this number through the same CQ:
        // that QP was destroyed before its probe came back (live QPs have
        // distinct numbers), and before this one was created. Its
        // completion, if it comes at all (rxe leaves a destroyed QP's
        // completions in the CQ; mlx5 removes them), is in the CQ now,
        // before any of this keepalive's probes: the loop polls the CQ for
        // all it holds at its next tick (an event may never come: a flush
        // on a solicited-only CQ raises none), then forgets the
        // orphan (kept longer, it would take this keepalive's probe, and
        // at the bound a live peer would be declared dead). Orphans
        // through other CQs never take its probes (see `note`).
        let addr = qp.raw() as usize;
        let sweep =
            self.orphans.iter().any(|o| o.qp_num == qpn && o.qp != addr && o.cq == send_cq).then_some(self.sweep_gen);
        let first = if sweep.is_some() { now } else { sys::deadline_after(now, cfg.period) };
        self.sweeps += usize::from(sweep.is_some());
        self.next = Some(self.next.map_or(first, |n| n.min(first)));
        self.by_qpn.insert(
            qpn,
            Entry {
                qp,
                serial,
                send_cq,
                cfg,
                last_activity: now,
                probe: Probe::Idle,
                dead: false,
                quiet: false,
                connected: false,
                probe_graced: false,
                first_grace: Duration::ZERO,
                peer_lost: false,
                drained_by_app: false,
                sweep,
                on_dead,
            },
        );
        true
    }

    /// The app's remove of the keepalive registered as `reg`: stops its
    /// detection; false if it is not here (it ended by itself, or a newer
    /// keepalive of the number took its place). A probe still outstanding
    /// is consumed when it completes.
    pub(crate) fn remove(&mut self, reg: Registration) -> bool {
        if self.by_qpn.get(&reg.0).is_none_or(|e| e.serial != reg.1) {
            return false;
        }
        self.remove_entry(reg.0)
    }

    /// Stops detection for `qpn`, its probe out kept as an orphan; false if
    /// it had none.
    fn remove_entry(&mut self, qpn: u32) -> bool {
        match self.by_qpn.remove(&qpn) {
            Some(e) => {
                if let Some(p) = e.late_probe(qpn) {
                    push_orphan(&mut self.orphans, p);
                }
                true
            }
            None => false,
        }
    }

    /// Stops detection for every QP whose send CQ is `cq` (the CQ leaves
    /// the loop: no probe could be seen completing any more). The probes
    /// still out through it (theirs, and orphans) are parked process-wide
    /// for the loop the CQ joins next (see [`Keepalives::adopt`]), as drain
    /// markers are: a probe never reaches a handler.
    /// Returns their registrations.
    pub(crate) fn remove_for_cq(&mut self, cq: usize) -> Vec<Registration> {
        let gone: Vec<Registration> =
            self.by_qpn.iter().filter(|(_, e)| e.send_cq == cq).map(|(q, e)| (*q, e.serial)).collect();
        let mut parked: Vec<LateProbe> =
            gone.iter().filter_map(|(q, _)| self.by_qpn.remove(q)?.late_probe(*q)).collect();
        parked.extend(drain::take_where(&mut self.orphans, |o| o.cq == cq));
        drain::park_probes(parked);
        gone
    }

    /// The loop goes away: every probe still out is parked for its CQ.
    pub(crate) fn park_all(&mut self) {
        let mut parked: Vec<LateProbe> = self.by_qpn.drain().filter_map(|(q, e)| e.late_probe(q)).collect();
        parked.extend(self.orphans.drain(..));
        drain::park_probes(parked);
    }

    /// `cq` joins the loop: the probes parked for it when it left a loop
    /// (this one or another) are this loop's to consume. (No keepalive
    /// here probes through `cq` yet; one added later on a QP that got the
    /// number of a parked probe's destroyed QP sweeps it, see `add`.)
    pub(crate) fn adopt(&mut self, cq: usize) {
        for p in drain::take_probes(cq) {
            push_orphan(&mut self.orphans, p);
        }
    }

    /// Notes a completion polled from `cq`: activity on its QP, and
    /// whether it is a probe (consumed: it never reaches the app's
    /// handler).
    pub(crate) fn note(&mut self, wc: &Wc, cq: usize, now: Instant) -> (bool, bool) {
        let ok = wc.is_success();
        // An orphan first: a QP's probes complete in the order they were
        // posted, and an orphan (of a keepalive removed, or one whose CQ
        // left a loop) through this CQ was posted before any probe of the
        // keepalive the QP has now (one of another QP with this number is
        // swept before that keepalive probes: see `add`).
        let orphan = !self.orphans.is_empty()
            && (self.orphans.iter().position(|o| o.qp_num == wc.qp_num() && o.wr_id == wc.wr_id() && o.cq == cq))
                .and_then(|i| self.orphans.remove(i))
                .is_some();
        if let Some(e) = self.by_qpn.get_mut(&wc.qp_num()) {
            if ok {
                e.last_activity = now;
                e.connected = true;
                if matches!(e.probe, Probe::Blocked(_)) {
                    // A probe waiting for room in the send queue: the
                    // peer answers (a request of the QP succeeded), so the
                    // full queue is no dead peer; the next probe is due a
                    // period after this activity. (A streaming app that
                    // refills the queue from its handler would otherwise
                    // keep every retry blocked until the bound.)
                    e.probe = Probe::Idle;
                    earliest(&mut self.next, sys::deadline_after(now, e.cfg.period));
                }
            }
            let probe = !orphan && cq == e.send_cq && wc.wr_id() == e.cfg.wr_id && e.probe_out();
            if !probe && wc.status() == crate::wc::WcStatus::RETRY_EXC_ERR && !e.dead && !e.quiet {
                // The peer is unreachable (the QP is in error now): dead,
                // whatever the probe's flush says after this.
                e.peer_lost = true;
                e.fail_now(&mut self.next, now);
            }
            if probe {
                e.probe = Probe::Idle;
                if ok {
                    // The next probe is due a period from now, not at the
                    // bound of the one that just came back (the deadline
                    // the timer was set for while it was out).
                    let d = sys::deadline_after(now, e.cfg.period);
                    earliest(&mut self.next, d);
                }
                if !ok && wc.status() == crate::wc::WcStatus::WR_FLUSH_ERR && !e.peer_lost {
                    // The QP was moved to the error state by someone else
                    // (a drain, the app's disconnect, another request's
                    // error, each reported by its own completion or
                    // event): not a dead peer, and no more probes.
                    e.quiet = true;
                } else if !ok && !e.dead && !e.quiet {
                    // Retry exceeded or the like.
                    e.fail_now(&mut self.next, now);
                }
                return (true, ok);
            }
        }
        (orphan, false)
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.next
    }

    /// Posts due probes, declares dead the peers whose probe is overdue,
    /// and recomputes the next deadline. Returns the probes posted, the
    /// newly dead peers (the caller moves their QPs to the error state, see
    /// [`Keepalives::qp_to_drain`], then calls their `on_dead`), and the registrations
    /// of the keepalives dropped because their `CmId` destroyed the QP.
    pub(crate) fn tick(&mut self, now: Instant) -> (u64, Vec<Registration>, Vec<Registration>) {
        if self.next.is_none_or(|n| now < n) {
            return (0, Vec::new(), Vec::new());
        }
        let mut posted = 0;
        let mut dead = Vec::new();
        let mut next: Option<Instant> = None;
        let mut destroyed = Vec::new();
        for (qpn, e) in self.by_qpn.iter_mut() {
            if e.qp.is_destroyed() {
                // Its CmId was dropped: nothing to watch any more (dead or
                // quiet too: the keepalive ends by itself, as promised).
                // A probe still out may have completed into its CQ: it is
                // consumed when polled, never handed to the handler.
                if let Some(p) = e.late_probe(*qpn) {
                    push_orphan(&mut self.orphans, p);
                }
                destroyed.push((*qpn, e.serial));
                continue;
            }
            if e.dead || e.quiet {
                watch_for_drop(e, now, &mut next);
                continue;
            }
            let bound_from = match e.probe {
                Probe::Idle if now.saturating_duration_since(e.last_activity) >= e.cfg.period => Some(now),
                Probe::Blocked(since) => Some(since),
                _ => None,
            };
            if let Some(since) = bound_from {
                match e.attempt_probe(now, since) {
                    Attempt::Posted => posted += 1,
                    Attempt::NotPosted => {}
                    Attempt::Destroyed => {
                        destroyed.push((*qpn, e.serial));
                        continue;
                    }
                }
                if e.quiet {
                    watch_for_drop(e, now, &mut next);
                    continue;
                }
            }
            let overdue = match e.probe {
                Probe::Sent(t) | Probe::Blocked(t) => now.saturating_duration_since(t) >= e.bound(),
                Probe::Failed { .. } => true,
                Probe::Idle => false,
            };
            if overdue {
                e.dead = true;
                log::warn!(target: "rdmasafe", "keepalive: peer of QP {qpn} declared dead");
                dead.push((*qpn, e.serial));
                watch_for_drop(e, now, &mut next);
                continue;
            }
            let d = match e.probe {
                Probe::Idle => sys::deadline_after(e.last_activity, e.cfg.period),
                Probe::Sent(t) => sys::deadline_after(t, e.bound()),
                Probe::Blocked(t) => {
                    sys::deadline_after(now, retry_interval(&e.cfg)).min(sys::deadline_after(t, e.bound()))
                }
                // Overdue above.
                Probe::Failed { .. } => now,
            };
            earliest(&mut next, d);
        }
        self.next = next;
        for (q, _) in &destroyed {
            self.by_qpn.remove(q);
        }
        (posted, dead, destroyed)
    }

    /// A drain of `qpn` started: its keepalive stays registered (remove it
    /// as usual) but probes no more, and the flush of an outstanding probe
    /// is consumed, never taken for a dead peer. A peer found dead already
    /// (a request or the probe failed with "retry exceeded": a handler
    /// that drains the QP on that error, or on the flushes that follow it
    /// in the same batch, say) is still declared dead.
    pub(crate) fn draining(&mut self, qpn: u32) {
        if let Some(e) = self.by_qpn.get_mut(&qpn) {
            e.drained_by_app = true;
            // (A request's "retry exceeded" leaves the probe `Failed` too,
            // until the peer is declared dead.)
            if !matches!(e.probe, Probe::Failed { .. }) {
                e.quiet = true;
            }
        }
    }

    /// The send CQs of the QPs whose probe is past its bound at `now`: the
    /// loop polls them before `tick` decides, so a probe that completed
    /// without raising an event (a solicited-only CQ, an event not read
    /// yet) is never taken for a dead peer.
    pub(crate) fn send_cqs_due(&self, now: Instant) -> Vec<usize> {
        let mut cqs: Vec<usize> = self
            .by_qpn
            .values()
            .filter(|e| !e.dead && !e.quiet)
            .filter(|e| match e.probe {
                Probe::Sent(t) | Probe::Blocked(t) => now.saturating_duration_since(t) >= e.bound(),
                // Dead whatever a poll finds.
                Probe::Failed { .. } | Probe::Idle => false,
            })
            .map(|e| e.send_cq)
            .collect();
        cqs.sort_unstable();
        cqs.dedup();
        cqs
    }

    /// A sweep begins (see `add`): the send CQs of the keepalives with one
    /// to make, and the generation to pass to [`Keepalives::sweep_end`]
    /// once each of those CQs was polled for all it held now. A keepalive
    /// added after this (by a handler the poll calls, say) waits for the
    /// next sweep: its CQ may have been polled before its add.
    pub(crate) fn sweep_begin(&mut self) -> (Vec<usize>, u64) {
        if self.sweeps == 0 {
            return (Vec::new(), 0);
        }
        self.sweep_gen += 1;
        let mut cqs: Vec<usize> = self.by_qpn.values().filter(|e| e.sweep.is_some()).map(|e| e.send_cq).collect();
        if cqs.is_empty() {
            // Those counted were removed since.
            self.sweeps = 0;
        }
        cqs.sort_unstable();
        cqs.dedup();
        (cqs, self.sweep_gen)
    }

    /// `cqs` (of [`Keepalives::sweep_begin`], generation `gen`) were each
    /// polled for all they held when it began: the keepalives on them added
    /// before the sweep began forget the orphans of older QPs with their
    /// number there.
    pub(crate) fn sweep_end(&mut self, cqs: &[usize], gen: u64) {
        let mut left = 0;
        for (qpn, e) in self.by_qpn.iter_mut() {
            match e.sweep {
                Some(g) if g < gen && cqs.contains(&e.send_cq) => {
                    e.sweep = None;
                    let (addr, cq) = (e.qp.raw() as usize, e.send_cq);
                    self.orphans.retain(|o| o.qp_num != *qpn || o.qp == addr || o.cq != cq);
                }
                Some(_) => left += 1,
                None => {}
            }
        }
        self.sweeps = left;
    }

    /// The QP of the keepalive for `qpn`, for the loop's drain of a dead
    /// peer's QP: none if the app drained the QP itself (it may have
    /// destroyed it since: see `drained_by_app`).
    pub(crate) fn qp_to_drain(&self, qpn: u32) -> Option<&LiveQp> {
        self.by_qpn.get(&qpn).filter(|e| !e.drained_by_app).map(|e| &e.qp)
    }

    /// The callback of a peer declared dead, if its keepalive is still
    /// here: an `on_dead` called before it may have removed it, and added
    /// another on its QP, whose callback this death is not for.
    pub(crate) fn on_dead(&mut self, reg: Registration) -> Option<&mut DeadPeer> {
        self.by_qpn.get_mut(&reg.0).filter(|e| e.serial == reg.1).map(|e| &mut e.on_dead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::verbs::wc_of as wc;

    /// A removed keepalive's probe still out goes with its send CQ when
    /// that leaves the loop (a later QP with its number and an app request
    /// with that wr_id would have been swallowed), and comes back with it:
    /// the loop the CQ joins next consumes it. (The parking is the
    /// process's: these CQ addresses are this test's alone.)
    #[test]
    fn orphan_probes_go_with_their_cq_and_come_back_with_it() {
        let (cq1, cq2) = (0x7e57_1000, 0x7e57_2000);
        let mut k = Keepalives::default();
        k.orphans.push_back(LateProbe { qp_num: 7, qp: 0x7007, wr_id: 0xfeed, cq: cq1 });
        k.orphans.push_back(LateProbe { qp_num: 8, qp: 0x8008, wr_id: 0xfeed, cq: cq2 });
        assert!(k.remove_for_cq(cq1).is_empty());
        assert_eq!(k.orphans.len(), 1, "QP 7's probe went with its CQ");
        let (ours, _) = k.note(&wc(7, 0xfeed), cq1, Instant::now());
        assert!(!ours, "with its CQ out of the loop, a QP 7 request reaches the app");
        let (ours, _) = k.note(&wc(8, 0xfeed), cq2, Instant::now());
        assert!(ours, "QP 8's orphan probe, its CQ still in the loop, is consumed");
        assert!(k.is_empty());
        let mut other = Keepalives::default();
        other.adopt(cq1);
        let (ours, _) = other.note(&wc(7, 0xfeed), cq1, Instant::now());
        assert!(ours, "the CQ joined another loop: QP 7's probe is that loop's");
        let (ours, _) = other.note(&wc(7, 0xfeed), cq1, Instant::now());
        assert!(!ours, "only once");
        k.adopt(cq1);
        assert!(k.is_empty(), "adopted once");
    }

    /// A keepalive that ends in the loop by itself forgets its own
    /// registration, not a newer one of its QP number (found by a review:
    /// the app removed QP 5's keepalive, a new QP got number 5 and a
    /// keepalive, and the old one's end, applied after, unregistered the
    /// new one: its `remove_keepalive` answered ENOENT).
    #[test]
    fn a_keepalive_that_ends_forgets_its_own_registration_only() {
        let mut r = Registrations::default();
        let old = r.register(5).unwrap();
        assert_eq!(r.register(5), None, "a number is registered once");
        assert_eq!(r.unregister(5), Some(old));
        let new = r.register(5).unwrap();
        assert_ne!(old, new);
        r.forget(&[old]);
        assert_eq!(r.register(5), None, "the new registration stays");
        r.forget(&[new]);
        assert_eq!(r.unregister(5), None, "its own end forgets it");
        assert!(r.register(5).is_some());
    }

    /// A QP struct with this number and CQ, never handed to the provider:
    /// the tests below only let the keepalive read its fields.
    fn fake_qp(raw: &mut crate::sys::ibv_qp, qp_num: u32, cq: usize) -> LiveQp {
        raw.qp_num = qp_num;
        raw.send_cq = cq as *mut _;
        raw.recv_cq = cq as *mut _;
        // SAFETY: `raw` outlives the keepalive in each test; nothing in
        // them posts on it (no tick before the probe is overdue or idle
        // within its period).
        unsafe { LiveQp::new(std::ptr::NonNull::from(raw)) }
    }

    /// A keepalive of `CFG` on a fake QP `qp_num` (its struct in `raw`,
    /// CQ `cq`), added at `t0`.
    fn one_keepalive(raw: &mut crate::sys::ibv_qp, qp_num: u32, cq: usize, t0: Instant) -> Keepalives {
        let mut k = Keepalives::default();
        assert!(k.add(fake_qp(raw, qp_num, cq), 1, CFG, Box::new(|_, _| {}), t0));
        k
    }

    /// A failed completion of QP `qp_num`: retry exceeded.
    fn retry_exceeded(qp_num: u32, wr_id: u64) -> Wc {
        let mut failed = wc(qp_num, wr_id);
        Wc::as_raw_slice_mut(std::slice::from_mut(&mut failed))[0].status =
            crate::sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
        failed
    }

    const CFG: Keepalive =
        Keepalive { period: Duration::from_secs(100), bound: Duration::from_secs(200), wr_id: 0xfeed };

    /// A keepalive of `CFG` added at `t0` on a fake QP 7 (its struct in
    /// `raw`, send CQ `cq`) while an orphan probe of an older QP 7 (another
    /// address) is out through `orphan_cq`.
    fn added_over_an_orphan(raw: &mut crate::sys::ibv_qp, cq: usize, orphan_cq: usize, t0: Instant) -> Keepalives {
        let qp = fake_qp(raw, 7, cq);
        let old = qp.raw() as usize + 0x1000;
        let mut k = Keepalives::default();
        k.orphans.push_back(LateProbe { qp_num: 7, qp: old, wr_id: 0xfeed, cq: orphan_cq });
        assert!(k.add(qp, 1, CFG, Box::new(|_, _| {}), t0));
        k
    }

    /// The orphan probe of a QP destroyed before it came back does not take
    /// the probe of a new QP that got its number (found by a review: the
    /// new keepalive's probe stayed out, and at the bound a live peer was
    /// declared dead): the new keepalive's CQ is polled before the next
    /// tick, which forgets the orphan.
    #[test]
    fn a_destroyed_qps_orphan_does_not_take_a_new_qps_probe() {
        let cq = 0x7e57_4000;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        // The old QP 7 lost its probe.
        let mut k = added_over_an_orphan(&mut raw, cq, cq, t0);
        assert_eq!(k.next_deadline(), Some(t0), "the loop ticks at once");
        let (cqs, gen) = k.sweep_begin();
        assert_eq!(cqs, [cq], "its CQ is polled until empty");
        k.sweep_end(&cqs, gen);
        assert!(k.orphans.is_empty(), "then the old QP's orphan is forgotten");
        assert!(k.sweep_begin().0.is_empty(), "once");
        k.by_qpn.get_mut(&7).unwrap().probe = Probe::Sent(t0);
        let (ours, ok) = k.note(&wc(7, 0xfeed), cq, t0);
        assert!(ours && ok, "the new QP's probe, credited to its keepalive");
        assert!(matches!(k.by_qpn[&7].probe, Probe::Idle), "its probe is back");
    }

    /// The orphan probe of a QP destroyed before a new QP got its number
    /// and a keepalive, its completion left in the CQ (rxe leaves a
    /// destroyed QP's completions there; a flush on a solicited-only CQ
    /// raises no event), is consumed by the poll before the next tick.
    /// (Found by reviews: the orphan was dropped when the keepalive was
    /// added, and its completion reached the app's handler; or, dropped at
    /// the new keepalive's first probe, taken for that probe.)
    #[test]
    fn a_destroyed_qps_orphan_left_in_the_cq_never_reaches_the_handler() {
        let cq = 0x7e57_6100;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let mut k = added_over_an_orphan(&mut raw, cq, cq, t0);
        let (cqs, gen) = k.sweep_begin();
        assert_eq!(cqs, [cq]);
        // The poll finds the old QP's flushed probe.
        let mut flushed = wc(7, 0xfeed);
        Wc::as_raw_slice_mut(std::slice::from_mut(&mut flushed))[0].status =
            crate::sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
        let (ours, _) = k.note(&flushed, cq, t0);
        assert!(ours, "the old QP's probe is consumed, not handed to the handler");
        assert!(k.orphans.is_empty());
        let e = &k.by_qpn[&7];
        assert!(matches!(e.probe, Probe::Idle) && !e.quiet && !e.dead, "the new keepalive's state is untouched");
        k.sweep_end(&cqs, gen);
    }

    /// A sweep forgets orphans only for keepalives added before it began,
    /// and only on the CQs it polled (found by a review: a keepalive added
    /// by a handler during the poll, after its CQ was polled, lost its
    /// orphan to the tick after, with the orphan's completion still in the
    /// CQ; so did a poll cut short).
    #[test]
    fn a_sweep_forgets_only_what_its_poll_covered() {
        let cq = 0x7e57_6400;
        let (mut raw7, mut raw8) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        let (qp7, qp8) = (fake_qp(&mut raw7, 7, cq), fake_qp(&mut raw8, 8, cq));
        let (old7, old8) = (qp7.raw() as usize + 0x1000, qp8.raw() as usize + 0x1000);
        let t0 = Instant::now();
        let mut k = Keepalives::default();
        k.orphans.push_back(LateProbe { qp_num: 7, qp: old7, wr_id: 0xfeed, cq });
        k.orphans.push_back(LateProbe { qp_num: 8, qp: old8, wr_id: 0xfeed, cq });
        assert!(k.add(qp7, 1, CFG, Box::new(|_, _| {}), t0));
        let (cqs, gen) = k.sweep_begin();
        // Added while the sweep polls.
        assert!(k.add(qp8, 2, CFG, Box::new(|_, _| {}), t0));
        k.sweep_end(&cqs, gen);
        assert_eq!(k.orphans.iter().map(|o| o.qp_num).collect::<Vec<_>>(), [8], "QP 8's waits for the next sweep");
        // A sweep whose poll did not cover the CQ forgets nothing.
        let (_, gen) = k.sweep_begin();
        k.sweep_end(&[], gen);
        assert_eq!(k.orphans.len(), 1);
        let (cqs, gen) = k.sweep_begin();
        assert_eq!(cqs, [cq]);
        k.sweep_end(&cqs, gen);
        assert!(k.orphans.is_empty());
        assert!(k.sweep_begin().0.is_empty(), "no sweep left");
    }

    /// A keepalive removed with its sweep still to make is no longer
    /// counted once the next sweep finds no CQ to poll (found by a review:
    /// the count stayed up, and every tick after scanned the keepalives
    /// for a sweep).
    #[test]
    fn a_removed_keepalives_sweep_is_not_counted_for_ever() {
        let cq = 0x7e57_6500;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let mut k = added_over_an_orphan(&mut raw, cq, cq, Instant::now());
        assert!(k.remove((7, 1)));
        assert!(k.sweep_begin().0.is_empty());
        assert_eq!(k.sweeps, 0);
    }

    /// Orphans are matched through the CQ they complete in: an old QP's
    /// orphan through another CQ neither takes a new QP's probe nor is
    /// forgotten for it (its completion comes in that other CQ, in no
    /// order with the new QP's). (Found by a review.)
    #[test]
    fn an_orphan_through_another_cq_is_left_alone() {
        let (cq, other) = (0x7e57_6200, 0x7e57_6300);
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let mut k = added_over_an_orphan(&mut raw, cq, other, t0);
        assert!(k.sweep_begin().0.is_empty(), "no sweep");
        k.by_qpn.get_mut(&7).unwrap().probe = Probe::Sent(t0);
        let (ours, ok) = k.note(&wc(7, 0xfeed), cq, t0);
        assert!(ours && ok, "the new QP's probe, credited to its keepalive");
        assert_eq!(k.orphans.len(), 1, "the other CQ's orphan stays");
        let (ours, ok) = k.note(&wc(7, 0xfeed), other, t0);
        assert!(ours && !ok, "consumed as the orphan it is");
        assert!(k.orphans.is_empty());
    }

    /// An orphan probe of the QP that fails with "retry exceeded" makes the
    /// QP's current keepalive declare the peer dead, as any other request
    /// of the QP failing so does (found by a review: the orphan was
    /// consumed and nothing else looked at it).
    #[test]
    fn an_orphan_probes_retry_exceeded_is_a_dead_peer() {
        let cq = 0x7e57_5000;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let qp = fake_qp(&mut raw, 11, cq);
        let addr = qp.raw() as usize;
        let t0 = Instant::now();
        let mut k = Keepalives::default();
        assert!(k.add(qp, 1, CFG, Box::new(|_, _| {}), t0));
        // Removed with its probe out, and added again.
        k.by_qpn.get_mut(&11).unwrap().probe = Probe::Sent(t0);
        assert!(k.remove((11, 1)));
        assert_eq!(k.orphans.len(), 1);
        let again = fake_qp(&mut raw, 11, cq);
        assert_eq!(again.raw() as usize, addr);
        assert!(k.add(again, 2, CFG, Box::new(|_, _| {}), t0));
        assert_eq!(k.orphans.len(), 1, "the same QP: its orphan stays");
        let (ours, _) = k.note(&retry_exceeded(11, 0xfeed), cq, t0);
        assert!(ours, "the orphan is consumed");
        let (_, dead, _) = k.tick(t0);
        assert_eq!(dead, [(11, 2)], "the peer is dead");
    }

    /// The loop's own guard, should a remove and an add of one QP's
    /// keepalive ever reach it in the other order (the control queues them
    /// under the registrations' lock so that they do not: see
    /// `control::tests`): the add replaces the removed keepalive, whose
    /// probe out stays the loop's, and the remove then leaves the new
    /// keepalive alone (found by a review, before that lock: the add
    /// overwrote the entry and lost its probe, which reached the app's
    /// handler, and the remove then dropped the new keepalive).
    #[test]
    fn a_remove_that_reaches_the_loop_after_a_newer_add_leaves_the_new_keepalive() {
        let cq = 0x7e57_8000;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let mut k = one_keepalive(&mut raw, 5, cq, t0);
        k.by_qpn.get_mut(&5).unwrap().probe = Probe::Sent(t0);
        // Added again on the same QP (a new QP with the number would mean
        // the old one was destroyed, and its probe with it: see `add`).
        assert!(k.add(fake_qp(&mut raw, 5, cq), 2, CFG, Box::new(|_, _| {}), t0));
        assert!(!k.remove((5, 1)), "the removed keepalive is gone already");
        assert_eq!(k.by_qpn.get(&5).map(|e| e.serial), Some(2), "the new keepalive stays");
        let (ours, _) = k.note(&wc(5, 0xfeed), cq, t0);
        assert!(ours, "the old keepalive's probe is consumed, never handed to the app");
        assert!(matches!(k.by_qpn[&5].probe, Probe::Idle), "and is not taken for the new one's");
    }

    /// A dead peer's `on_dead` is not called for a keepalive added on its
    /// QP after the death was declared (found by a review: the callbacks of
    /// one tick run one after the other, each one's changes applied before
    /// the next, and an earlier one may remove this keepalive and add
    /// another; the new one's callback got the old one's death).
    #[test]
    fn a_death_is_not_reported_to_a_keepalive_added_after_it() {
        let cq = 0x7e57_9000;
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let mut k = one_keepalive(&mut raw, 19, cq, t0);
        let (ours, _) = k.note(&retry_exceeded(19, 1), cq, t0);
        assert!(!ours, "an app request");
        let (_, dead, _) = k.tick(t0);
        assert_eq!(dead, [(19, 1)]);
        assert!(k.remove((19, 1)));
        assert!(k.add(fake_qp(&mut raw, 19, cq), 2, CFG, Box::new(|_, _| {}), t0));
        assert!(k.on_dead((19, 1)).is_none(), "the new keepalive's callback is not told of the old death");
        assert!(k.on_dead((19, 2)).is_some());
    }

    /// A probe posted before the QP's first success keeps the first-probe
    /// grace after another request of the QP succeeds: the peer's QP may
    /// have dropped that probe (not ready yet), which is sent again only
    /// after the ack timeout. Found by a review's question: the success
    /// shortened the probe's bound to the plain one, and a tick made for
    /// any other reason (another keepalive's deadline) between the two
    /// declared the peer dead early.
    #[test]
    fn a_probe_sent_before_the_first_success_keeps_its_grace() {
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let cq = 0x7e57_6000;
        let mut k = one_keepalive(&mut raw, 13, cq, t0);
        // As `attempt_probe` leaves it after posting the first probe, not
        // connected yet (the grace, 1000 s here, beyond the bound, 200 s).
        let grace = Duration::from_secs(1000);
        let e = k.by_qpn.get_mut(&13).unwrap();
        e.first_grace = grace;
        e.probe_graced = true;
        e.probe = Probe::Sent(t0);
        // An app request of the QP succeeds; the probe is not back yet.
        let (ours, _) = k.note(&wc(13, 0x1234), cq, t0);
        assert!(!ours, "the app's completion");
        // A tick past the plain bound (made for another keepalive's sake).
        k.next = Some(t0);
        let (_, dead, _) = k.tick(t0 + CFG.bound + Duration::from_secs(1));
        assert!(dead.is_empty(), "declared dead before the probe's own bound (the grace)");
        let (_, dead, _) = k.tick(t0 + grace + Duration::from_secs(1));
        assert_eq!(dead, [(13, 1)], "dead at the grace: the probe never came back");
    }

    /// A request's "retry exceeded" and then the app's drain of the QP: the
    /// peer is still declared dead, but the loop does not drain the QP
    /// itself (found by a review: it read and moved the QP, which the app
    /// may destroy as soon as its own drain is reported, as the header
    /// allows: a use after free).
    #[test]
    fn a_dead_peer_whose_qp_the_app_drained_is_not_drained_again() {
        let mut raw: crate::sys::ibv_qp = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        let cq = 0x7e57_7000;
        let mut k = one_keepalive(&mut raw, 17, cq, t0);
        let (ours, _) = k.note(&retry_exceeded(17, 0x1234), cq, t0);
        assert!(!ours, "the app's request");
        k.draining(17);
        let (_, dead, _) = k.tick(t0);
        assert_eq!(dead, [(17, 1)], "still a dead peer");
        assert!(k.qp_to_drain(17).is_none(), "the app drains (and may destroy) the QP: the loop keeps off it");
    }

    /// A CQ destroyed out of every loop takes its parked probes along: a
    /// new CQ at its address does not consume them.
    #[test]
    fn a_destroyed_cqs_parked_probes_go_with_it() {
        let cq = 0x7e57_3000;
        let mut k = Keepalives::default();
        k.orphans.push_back(LateProbe { qp_num: 9, qp: 0x9009, wr_id: 0xbeef, cq });
        k.remove_for_cq(cq);
        crate::cq::cq_destroyed(cq as *mut crate::sys::ibv_cq);
        k.adopt(cq);
        assert!(k.is_empty(), "nothing parked for a destroyed CQ");
    }
}
