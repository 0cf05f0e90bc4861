//! The Rust API at its edges, on Soft-RoCE (each case failed before its
//! fix; found by an adversarial test of the Rust API):
//!
//! * a `LocalCqLoop` that refuses a second `add_cq` of a CQ (EBUSY) keeps
//!   the handler in place (it was replaced, then dropped: completions lost);
//! * a keepalive on an id's QP ends by itself when the id is dropped, also
//!   after a drain or after its peer was declared dead (those were never
//!   collected: the entry and its callback lived as long as the loop);
//! * a `Dispatcher` survives the copy limit (ENOBUFS ended its thread, and
//!   every later event stayed in the kernel);
//! * a `_then` request racing the loop's drop is always finished (one
//!   queued while the drop held the loop was neither applied nor called
//!   back);
//! * the markers of a drain that timed out stay the loop's after their CQ
//!   is removed and added again, to the same loop or another (the loop
//!   forgot them when the CQ left: they reached the new handler); and so
//!   do a keepalive's probes still out when their CQ leaves (found by an
//!   adversarial test of the tokio API).
//!
//! * events moved in by `CmId::migrate` reach a thread already waiting in
//!   a get on the new channel, and a `Dispatcher` waiting there (the
//!   kernel moves them without waking the channel's waiters: the get
//!   timed out, the dispatcher slept on; found by an adversarial test of
//!   the tokio API, where the async get never saw them);
//!
//! * a keepalive's probe blocked by a full send queue is no dead peer once
//!   the peer's requests succeed again; a probe out when its id is dropped
//!   never reaches the handler; a panicking drain callback called by the
//!   loop's drop is caught; a handler that drains its QP on "retry
//!   exceeded" still gets the dead peer reported, and a keepalive added
//!   again on that QP goes quiet (found by an adversarial test of the
//!   timed features);
//! * a keepalive whose id dropped its QP before the add was applied leaves
//!   no registration of the QP number behind (found by the same review),
//!   nor does one refused by a closed loop (found by a review of its fix);
//!
//! (and the cases of the CQ loop below). No timing is asserted: each wait
//! ends when its condition holds, and a generous watchdog turns a hang into
//! a failure; where a case needs an order of events, sleeps in handlers or
//! past deadlines make it (a case that would pass vacuously checks it got
//! there).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::rc::{rc_pair, RcPair, Side, SLOT};
use rdmasafe_core::cm::{self, CmEvent, CmId, Dispatcher, EventChannel, PortSpace};
use rdmasafe_core::cq::{CqLoop, Keepalive, LocalCqLoop, LoopOptions};
use rdmasafe_core::verbs::{CompChannel, Cq, DeviceContext};
use rdmasafe_core::Wait;

/// The CM copy counters and the limit are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// Far beyond anything these cases need on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(60);

/// Sets its flag when dropped (to see that a closure was dropped).
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, SeqCst);
    }
}

/// The bed's device.
fn device() -> DeviceContext {
    common::cm::device(common::bed().addr)
}

fn channel() -> CompChannel {
    CompChannel::new(&device()).unwrap()
}

/// Waits (without running any loop) until `done()` or [`PATIENCE`];
/// returns `done()`.
fn wait_until(done: impl Fn() -> bool) -> bool {
    let end = Instant::now() + PATIENCE;
    while !done() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    done()
}

/// Runs `lp` until `done()` or [`PATIENCE`]; returns `done()`.
fn drive_until(lp: &CqLoop, done: impl Fn() -> bool) -> bool {
    let end = Instant::now() + PATIENCE;
    while !done() && Instant::now() < end {
        let _ = lp.process_once(Wait::For(Duration::from_millis(20)));
    }
    done()
}

/// A side's id, taken out of the pair (a bare id left in its place; the
/// rest stays alive in `pair`).
fn take_id(side: &Mutex<Side>) -> CmId {
    let bare = EventChannel::new().unwrap().create_id(PortSpace::Tcp).unwrap();
    std::mem::replace(&mut side.lock().unwrap().id, bare)
}

#[test]
fn a_refused_second_add_keeps_the_local_handler() {
    let _s = serial();
    let _dog = common::watchdog("local loop: second add", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 4);
    let lp = LocalCqLoop::new(&chan, LoopOptions::default()).unwrap();
    let seen = std::rc::Rc::new(std::cell::Cell::new(0usize));
    let s2 = seen.clone();
    lp.add_cq(&pair.server_cq, move |wcs, _| s2.set(s2.get() + wcs.len())).unwrap();
    let e = lp.add_cq(&pair.server_cq, |_, _| {}).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    // Two receives, flushed by the drain: the first handler must get both.
    pair.recv(0, SLOT as u32, 1);
    pair.recv(SLOT, SLOT as u32, 2);
    lp.drain_id(&pair.server.lock().unwrap().id, PATIENCE).unwrap();
    let end = Instant::now() + PATIENCE;
    while seen.get() < 2 && Instant::now() < end {
        let _ = lp.process_once(Wait::For(Duration::from_millis(20)));
    }
    assert_eq!(seen.get(), 2, "completions delivered to the CQ's handler (loop polled {})", lp.stats().completions);
}

/// A keepalive on the server's QP, brought to `state` (none, drained, or
/// peer declared dead), then the server id dropped without
/// `remove_keepalive`: the keepalive must end by itself (its callback
/// dropped, `remove_keepalive` ENOENT).
fn keepalive_ends_with_its_id(state: &str) {
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 4);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&pair.server_cq, |_, _| {}).unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let dead = Arc::new(AtomicBool::new(false));
    let (flag, d2) = (DropFlag(dropped.clone()), dead.clone());
    let bound = if state == "dead" { Duration::from_millis(500) } else { PATIENCE };
    let cfg = Keepalive { period: Duration::from_millis(100), bound, wr_id: 0xabc };
    let server = take_id(&pair.server);
    let qpn = server.qp_num().unwrap();
    lp.add_keepalive_id(
        &server,
        cfg,
        Box::new(move |_, _| {
            let _ = &flag;
            d2.store(true, SeqCst);
        }),
    )
    .unwrap();
    match state {
        "drained" => lp.drain_id(&server, PATIENCE).unwrap(),
        "dead" => {
            // The peer goes away (its id and QP destroyed): probes go
            // unanswered.
            drop(take_id(&pair.client));
            assert!(drive_until(&lp, || dead.load(SeqCst)), "the peer was never declared dead");
        }
        _ => {}
    }
    drop(server);
    assert!(
        drive_until(&lp, || dropped.load(SeqCst)),
        "{state}: the keepalive did not end when its id was dropped (its callback still lives)"
    );
    let e = lp.remove_keepalive(qpn).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{state}: {e}");
}

#[test]
fn a_keepalive_ends_with_its_id_after_a_drain_or_a_dead_peer() {
    let _s = serial();
    let _dog = common::watchdog("keepalive ends with its id", Duration::from_secs(600));
    for state in ["active", "drained", "dead"] {
        keepalive_ends_with_its_id(state);
    }
}

/// One RC connection whose server CQ is in a new loop, and the server's
/// id taken out of the pair (the rest of it stays alive in the pair), with
/// its QP number: the set-up of the keepalive cases that need one. Bound
/// in this order, the parts drop in the reverse one (the id and the loop
/// before the pair's CQs, the channel last).
fn one_connection() -> (CompChannel, RcPair, CqLoop, CmId, u32) {
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 4);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&pair.server_cq, |_, _| {}).unwrap();
    let server = take_id(&pair.server);
    let qpn = server.qp_num().unwrap();
    (chan, pair, lp, server, qpn)
}

/// Removing a keepalive's send CQ removes the keepalive, as the docs say:
/// `remove_keepalive` of its QP is ENOENT after, also once the CQ is back
/// in the loop (adding it back restores nothing), and the keepalive can be
/// added again (not EBUSY).
#[test]
fn removing_the_send_cq_removes_its_keepalives() {
    let _s = serial();
    let _dog = common::watchdog("keepalive removed with its send CQ", Duration::from_secs(120));
    let (_chan, pair, lp, server, qpn) = one_connection();
    let cfg = Keepalive { period: Duration::from_millis(100), bound: PATIENCE, wr_id: 0xabd };
    lp.add_keepalive_id(&server, cfg, Box::new(|_, _| {})).unwrap();
    lp.remove_cq(&pair.server_cq).unwrap();
    let e = lp.remove_keepalive(qpn).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "removed with its send CQ: {e}");
    lp.add_cq(&pair.server_cq, |_, _| {}).unwrap();
    let e = lp.remove_keepalive(qpn).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "the CQ back in the loop restores no keepalive: {e}");
    lp.add_keepalive_id(&server, cfg, Box::new(|_, _| {})).expect("added again");
    lp.remove_keepalive(qpn).expect("and removed");
    drop(lp);
    drop(server);
}

/// A keepalive added on an id's QP while another thread holds the loop
/// (inside a `_then` callback here, as in a handler), and the id dropped
/// before that thread lets go: the add is applied after the QP is gone.
/// The keepalive never starts, and its QP number must not stay registered
/// (it did: `remove_keepalive` answered Ok for a keepalive that never was,
/// and a later keepalive on a new QP with that number got EBUSY).
#[test]
fn a_keepalive_whose_qp_is_gone_before_its_add_is_applied_leaves_no_registration() {
    let _s = serial();
    let _dog = common::watchdog("keepalive add applied after its QP is gone", Duration::from_secs(120));
    let ctx = device();
    let chan = CompChannel::new(&ctx).unwrap();
    let pair = rc_pair(common::bed().addr, &chan, false, 4);
    let other = Cq::new(&ctx, 4, Some(&chan)).unwrap();
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&pair.server_cq, |_, _| {}).unwrap();
    lp.add_cq(&other, |_, _| {}).unwrap();
    let server = take_id(&pair.server);
    let qpn = server.qp_num().unwrap();
    // A thread applies a removal (nobody runs the loop) and, in its done
    // callback, holds the loop until told to go on.
    let (inside_tx, inside_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (ctl, raw) = (lp.control(), other.raw() as usize);
    let holder = std::thread::spawn(move || {
        ctl.remove_raw_cq_then(
            raw as *mut _,
            Box::new(move |r| {
                inside_tx.send(r.is_ok()).unwrap();
                let _ = go_rx.recv();
            }),
        )
    });
    assert_eq!(inside_rx.recv_timeout(PATIENCE), Ok(true), "the holder's done callback ran (removal Ok)");
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = DropFlag(dropped.clone());
    let cfg = Keepalive { period: Duration::from_millis(100), bound: PATIENCE, wr_id: 0xabe };
    lp.control()
        .add_keepalive_id(
            &server,
            cfg,
            Box::new(move |_, _| {
                let _ = &flag;
            }),
        )
        .expect("queued while the loop is held");
    assert!(!dropped.load(SeqCst), "queued, not applied yet");
    drop(server);
    go_tx.send(()).unwrap();
    holder.join().unwrap().expect("the removal was accepted");
    assert!(dropped.load(SeqCst), "the add was applied when the holder let go (its callback dropped)");
    let e = lp.remove_keepalive(qpn).expect_err("a keepalive that never started is not registered");
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    drop(lp);
}

/// A keepalive add refused because the loop was closed (`try_close`: its
/// CQs' claims stay until the drop) leaves no registration behind (found
/// by a review: the second add answered EBUSY, the remove EINVAL, for a
/// keepalive that never was).
#[test]
fn a_keepalive_add_refused_by_a_closed_loop_leaves_no_registration() {
    let _s = serial();
    let _dog = common::watchdog("keepalive add on a closed loop", Duration::from_secs(120));
    let (_chan, _pair, lp, server, qpn) = one_connection();
    let cfg = Keepalive { period: Duration::from_millis(100), bound: PATIENCE, wr_id: 0xab6 };
    let ctl = lp.control();
    lp.try_close().unwrap();
    for attempt in ["first", "second"] {
        let r = ctl.add_keepalive_id(&server, cfg, Box::new(|_, _| {}));
        assert_eq!(r.map(|_| ()).map_err(|e| e.errno()), Err(libc::EINVAL), "{attempt} add on the closed loop");
    }
    let r = ctl.remove_keepalive(qpn);
    assert_eq!(r.map(|_| ()).map_err(|e| e.errno()), Err(libc::ENOENT), "no keepalive was registered");
    drop(lp);
    drop(server);
}

#[test]
fn a_dispatcher_waits_out_the_copy_limit() {
    let _s = serial();
    let _dog = common::watchdog("dispatcher at the copy limit", Duration::from_secs(300));
    let bed = common::bed();
    let ch = EventChannel::new().unwrap();
    let held: Arc<Mutex<Vec<CmEvent>>> = Arc::default();
    let got = Arc::new(AtomicUsize::new(0));
    let keep = Arc::new(AtomicBool::new(true));
    let (h2, g2, k2) = (held.clone(), got.clone(), keep.clone());
    /// The limit is lifted however the test ends (other tests follow).
    struct Unlimit;
    impl Drop for Unlimit {
        fn drop(&mut self) {
            cm::set_limit(0);
        }
    }
    let _unlimit = Unlimit;
    cm::set_limit(cm::counters().outstanding + 1);
    let d = Dispatcher::with_callback(&ch, move |ev| {
        g2.fetch_add(1, SeqCst);
        if k2.load(SeqCst) {
            h2.lock().unwrap().push(ev); // kept: the limit is reached
        }
    })
    .unwrap();
    let ids: Vec<CmId> = (0..3).map(|_| ch.create_id(PortSpace::Tcp).unwrap()).collect();
    let resolve = |i: usize| ids[i].resolve_addr(None, (bed.addr, 7).into(), Duration::from_secs(5)).unwrap();
    let wait = |what: &str, cond: &dyn Fn() -> bool| assert!(wait_until(cond), "{what}");
    resolve(0);
    wait("the first event delivered", &|| got.load(SeqCst) == 1);
    let refused = cm::counters().refused_at_limit;
    resolve(1);
    wait("a get refused at the limit", &|| cm::counters().refused_at_limit > refused);
    keep.store(false, SeqCst);
    held.lock().unwrap().clear(); // copies freed: events flow again
    resolve(2);
    wait("the events after the limit delivered", &|| got.load(SeqCst) == 3);
    cm::set_limit(0);
    let stats = d.stats();
    d.stop().unwrap();
    assert!(stats.storage_waits > 0, "{stats:?}");
}

#[test]
fn then_requests_racing_the_loops_drop_are_always_finished() {
    let _s = serial();
    let _dog = common::watchdog("then requests vs drop", Duration::from_secs(600));
    let ctx = device();
    // Each trial drops the loop at another point of a stream of changes
    // from another thread (the race needs many tries to be hit).
    for trial in 0..2000u64 {
        let chan = CompChannel::new(&ctx).unwrap();
        let cq = Cq::new(&ctx, 4, Some(&chan)).unwrap();
        let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
        let ctl = lp.control();
        let called = Arc::new(AtomicUsize::new(0));
        let started = Arc::new(AtomicBool::new(false));
        let (c2, s2) = (called.clone(), started.clone());
        let t = std::thread::spawn(move || {
            let mut submitted = 0usize;
            s2.store(true, SeqCst);
            loop {
                if ctl.add_cq(&cq, ctl.default_cq_options(), |_, _| {}).is_err() {
                    break;
                }
                let c = c2.clone();
                let r = ctl.remove_raw_cq_then(
                    cq.raw(),
                    Box::new(move |_| {
                        c.fetch_add(1, SeqCst);
                    }),
                );
                if r.is_err() {
                    break;
                }
                submitted += 1;
            }
            (submitted, ctl, cq)
        });
        while !started.load(SeqCst) {
            std::hint::spin_loop();
        }
        std::thread::sleep(Duration::from_micros(trial % 500));
        drop(lp);
        let (submitted, ctl, cq) = t.join().unwrap();
        // Every accepted request was finished by the time the loop's drop
        // and the request's call both returned.
        assert_eq!(called.load(SeqCst), submitted, "trial {trial}: requests accepted but never finished");
        drop((ctl, cq));
    }
}

/// A CQ removed from `on_dead` is not polled by the watchdog of the same
/// tick: its handler never runs after the removal (it got the QP's flushed
/// receives before).
#[test]
fn a_cq_removed_in_on_dead_gets_no_more_completions() {
    let _s = serial();
    let _dog = common::watchdog("on_dead removes its CQ", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 16);
    for k in 0..8 {
        pair.recv(k * SLOT, SLOT as u32, 100 + k as u64);
    }
    let opts = LoopOptions { watchdog: Some(Duration::from_millis(20)), ..LoopOptions::default() };
    let lp = CqLoop::new(&chan, opts).unwrap();
    let removed = Arc::new(AtomicBool::new(false));
    let late = Arc::new(Mutex::new(Vec::new()));
    let (r2, l2) = (removed.clone(), late.clone());
    lp.add_cq(&pair.server_cq, move |wcs, _| {
        if r2.load(SeqCst) {
            l2.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()));
        }
    })
    .unwrap();
    let server_cq = pair.server_cq.raw() as usize;
    let (r3, dead) = (removed.clone(), Arc::new(AtomicBool::new(false)));
    let d2 = dead.clone();
    let cfg = Keepalive { period: Duration::from_millis(20), bound: Duration::from_millis(100), wr_id: 0xfeed };
    let on_dead: rdmasafe_core::cq::DeadPeer = Box::new(move |_, ctl| {
        ctl.remove_raw_cq(server_cq as *mut rdmasafe_core::sys::ibv_cq).unwrap();
        r3.store(true, SeqCst);
        d2.store(true, SeqCst);
        // The QP is in the error state now: let its flushed receives land
        // in the CQ before the rest of this tick (the watchdog's poll).
        std::thread::sleep(Duration::from_millis(100));
    });
    // SAFETY: the QP lives in `pair`, which outlives the loop.
    unsafe { lp.add_keepalive(pair.server_qp(), cfg, on_dead) }.unwrap();
    lp.control().set_outstanding(1);
    assert!(drive_until(&lp, || lp.stats().keepalive_probes_ok >= 1), "a probe answered");
    // The peer dies; once a probe is out, the loop is left alone past the
    // keepalive's bound and the watchdog's period, so that one tick finds
    // both due: on_dead first, then the watchdog's poll of every CQ.
    let cqp = pair.client.lock().unwrap().id.raw_qp().unwrap();
    // SAFETY: the client's QP is live (in `pair`).
    unsafe { rdmasafe_core::sys::qp_to_error(cqp.as_ptr()) }.unwrap();
    let probes = lp.stats().keepalive_probes;
    assert!(drive_until(&lp, || lp.stats().keepalive_probes > probes), "a probe posted to the dead peer");
    std::thread::sleep(Duration::from_millis(300));
    // (When the probe's error completion, not the timer, declares the peer
    // dead, that event restarts the watchdog's count and its poll does not
    // come in the same tick: then this case passes without the order it is
    // about. Both ways were seen; before the fix it failed, 8 of 8
    // receives handed to the removed CQ's handler.)
    assert!(drive_until(&lp, || dead.load(SeqCst)), "the peer declared dead");
    let _ = lp.process_once(Wait::None);
    let late = late.lock().unwrap().clone();
    assert!(late.is_empty(), "the handler got completions after on_dead removed its CQ: {late:?}");
    assert_eq!(lp.len(), 0, "the CQ left the loop");
}

/// A CQ over its budget is polled again in the next cycle without an
/// event, also when the watchdog's poll found it so (that poll used to
/// forget it, and the rest waited for later watchdog periods).
#[test]
fn the_watchdogs_poll_keeps_the_budget_promise() {
    let _s = serial();
    let _dog = common::watchdog("watchdog and budget", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 16);
    let opts = LoopOptions { watchdog: Some(Duration::from_millis(50)), ..LoopOptions::default() };
    let lp = CqLoop::new(&chan, opts).unwrap();
    let got = Arc::new(AtomicUsize::new(0));
    let g2 = got.clone();
    // Solicited-only: the unsolicited messages below raise no event, so
    // only the watchdog's poll finds them.
    let cq_opts = rdmasafe_core::cq::CqOptions { solicited_only: true, budget: 2 };
    lp.add_cq_with(&pair.server_cq, cq_opts, move |wcs, _| {
        g2.fetch_add(wcs.len(), SeqCst);
    })
    .unwrap();
    lp.control().set_outstanding(1);
    // A first cycle arms the CQ (a new CQ is drained once by itself).
    lp.process_once(Wait::None).unwrap();
    for k in 0..10 {
        pair.recv(k * SLOT, SLOT as u32, k as u64);
    }
    for k in 0..10 {
        pair.send(0, &[], 8, k);
    }
    let mut wcs: [_; 16] = std::array::from_fn(|_| rdmasafe_core::verbs::empty_wc());
    let mut sent = 0;
    while sent < 10 {
        sent += pair.client_cq.poll(&mut wcs).unwrap();
    }
    assert!(drive_until(&lp, || got.load(SeqCst) > 0), "the watchdog's poll delivered the first ones");
    // From now on no watchdog (nothing outstanding): only the budget's
    // promise brings the rest, a cycle at a time, without any event.
    lp.control().set_outstanding(0);
    let polls = lp.stats().watchdog_polls;
    assert!(polls > 0 && lp.stats().cq_events == 0, "found by the watchdog: {:?}", lp.stats());
    for _ in 0..10 {
        lp.process_once(Wait::None).unwrap();
    }
    assert_eq!(got.load(SeqCst), 10, "the CQ over its budget was polled again in the next cycles");
    assert_eq!(lp.stats().watchdog_polls, polls);
    assert_eq!(lp.stats().cq_events, 0);
}

/// A drain of a QP whose send CQ is armed solicited-only (its receive CQ
/// for everything): the send queue's flushed marker raises no event on
/// rxe; the drain looks for it itself (it used to time out).
#[test]
fn a_drain_finds_markers_that_raised_no_event() {
    let _s = serial();
    let _dog = common::watchdog("drain with a solicited-only send CQ", Duration::from_secs(300));
    let bed = common::bed();
    let ctx = device();
    let chan = CompChannel::new(&ctx).unwrap();
    let (scq, rcq) = (Cq::new(&ctx, 16, Some(&chan)).unwrap(), Cq::new(&ctx, 16, Some(&chan)).unwrap());
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let (g2, g3) = (got.clone(), got.clone());
    let solicited = rdmasafe_core::cq::CqOptions { solicited_only: true, budget: 0 };
    lp.add_cq_with(&scq, solicited, move |wcs, _| g2.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()))).unwrap();
    lp.add_cq(&rcq, move |wcs, _| g3.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()))).unwrap();
    // A QP in the INIT state (resolved, not connected) on the two CQs.
    let l = common::cm::listen(bed.addr, PortSpace::Tcp, 8);
    let ch = EventChannel::new().unwrap();
    let mut id = common::cm::resolved(&ch, PortSpace::Tcp, bed.addr, l.port);
    let pd = rdmasafe_core::verbs::Pd::new(&ctx).unwrap();
    let caps = cm::QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };
    id.create_qp(&pd, &scq, &rcq, caps, false).unwrap();
    for round in 0..3 {
        // The drain's own looks come after a few ms, then at growing gaps:
        // far within its timeout.
        lp.drain_id(&id, PATIENCE).unwrap_or_else(|e| panic!("drain {round}: {e}"));
    }
    assert!(got.lock().unwrap().is_empty(), "a marker reached a handler: {:?}", got.lock().unwrap());
}

/// A stop that comes while another thread drives the loop for a drain
/// (nobody runs it: an app that embeds the loop) leaves the loop's fd
/// readable: the app's epoll wakes for it.
#[test]
fn a_stop_during_a_foreign_drain_leaves_the_fd_readable() {
    let _s = serial();
    let _dog = common::watchdog("stop during a drain", Duration::from_secs(300));
    let chan = channel();
    let pair = Arc::new(rc_pair(common::bed().addr, &chan, false, 16));
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    // Solicited-only: the drain's flush raises no event, so its drive
    // sleeps at least once before finding the markers.
    let cq_opts = rdmasafe_core::cq::CqOptions { solicited_only: true, budget: 0 };
    lp.add_cq_with(&pair.server_cq, cq_opts, |_, _| {}).unwrap();
    lp.process_once(Wait::None).unwrap();
    let ctl = lp.control();
    // The stop comes from inside the drive, right before it sleeps.
    let stopped = Arc::new(AtomicBool::new(false));
    let (c2, s2) = (ctl.clone(), stopped.clone());
    lp.set_before_sleep_hook(Some(Box::new(move || {
        if !s2.swap(true, SeqCst) {
            c2.stop();
        }
    })));
    let (p2, c3) = (pair.clone(), ctl.clone());
    std::thread::spawn(move || c3.drain_id(&p2.server.lock().unwrap().id, PATIENCE).map_err(|e| e.to_string()))
        .join()
        .unwrap()
        .expect("the drain");
    lp.set_before_sleep_hook(None);
    assert!(stopped.load(SeqCst), "the drive slept (and the stop came then)");
    let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&lp), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; no wait (the fd must be readable now).
    let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
    assert_eq!(ready, 1, "the loop's fd is readable: the pending stop is work");
    assert!(lp.process_ready().unwrap().stopped, "and the stop is what the next call finds");
}

/// A non-blocking cycle of an embedded loop (`process_once(Wait::None)`,
/// the C API's `run_once(l, 0)`) while another thread drives the loop for
/// a blocking drain: it waits for that drive's current cycle, never for
/// the whole drain (the drive hands the loop over). Here the drain needs
/// many cycles: 60 completions, a budget of 1, a handler that sleeps 25 ms
/// (so this thread gets the CPU however busy the machine is: the drain
/// cannot finish before the call below is made).
#[test]
fn a_nonblocking_cycle_does_not_wait_for_a_foreign_drain() {
    let _s = serial();
    let _dog = common::watchdog("process_once during a drain", Duration::from_secs(300));
    let d = SlowDrain::start(60);
    // A non-blocking cycle returns long before the drain is done.
    d.lp.process_once(Wait::None).unwrap();
    let done_then = d.drained.load(SeqCst);
    d.thread.join().unwrap().expect("the drain");
    assert!(!done_then, "process_once(Wait::None) waited for the whole drain");
    assert_eq!(d.handled.load(SeqCst), 60, "every flushed receive once");
}

/// A drain of `n` flushed receives that needs `n` cycles (a budget of 1,
/// a handler that sleeps 25 ms), driven by another thread while nobody
/// runs the loop; `start` returns once the drive is under way (a receive
/// handled).
struct SlowDrain {
    lp: CqLoop,
    handled: Arc<AtomicUsize>,
    drained: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<std::result::Result<(), String>>,
    // Dropped after the loop, in this order.
    _pair: Arc<RcPair>,
    _chan: CompChannel,
}

impl SlowDrain {
    fn start(n: usize) -> SlowDrain {
        let chan = channel();
        let pair = Arc::new(rc_pair(common::bed().addr, &chan, false, 64));
        let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
        let handled = Arc::new(AtomicUsize::new(0));
        let h2 = handled.clone();
        let cq_opts = rdmasafe_core::cq::CqOptions { solicited_only: false, budget: 1 };
        lp.add_cq_with(&pair.server_cq, cq_opts, move |wcs, _| {
            h2.fetch_add(wcs.len(), SeqCst);
            std::thread::sleep(Duration::from_millis(25));
        })
        .unwrap();
        lp.process_once(Wait::None).unwrap();
        for k in 0..n {
            pair.recv(k * SLOT, SLOT as u32, k as u64);
        }
        let ctl = lp.control();
        let drained = Arc::new(AtomicBool::new(false));
        let (p2, d2) = (pair.clone(), drained.clone());
        let thread = std::thread::spawn(move || {
            let r = ctl.drain_id(&p2.server.lock().unwrap().id, PATIENCE).map(|_| ()).map_err(|e| e.to_string());
            d2.store(true, SeqCst);
            r
        });
        assert!(wait_until(|| handled.load(SeqCst) > 0), "the drain started");
        SlowDrain { lp, handled, drained, thread, _pair: pair, _chan: chan }
    }
}

/// Dropping a `LoopThread` stops its loop and waits for the thread, like
/// `Dispatcher` and the async thread (it used to detach a thread that ran
/// the loop forever, keeping its CQs alive).
#[test]
fn dropping_a_loop_thread_stops_its_loop() {
    let _s = serial();
    let _dog = common::watchdog("LoopThread drop", Duration::from_secs(300));
    let ctx = device();
    let chan = CompChannel::new(&ctx).unwrap();
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let ctl = lp.control();
    drop(lp.spawn(None).unwrap());
    let cq = Cq::new(&ctx, 4, Some(&chan)).unwrap();
    let e = ctl.add_cq(&cq, ctl.default_cq_options(), |_, _| {}).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "the loop is gone once the drop returned: {e}");
}

/// A keepalive is refused (EINVAL) on a QP that is not RC: its probe, a
/// zero-length RDMA WRITE, would fail at once and declare a healthy peer
/// dead, moving the QP to the error state (it used to be accepted).
#[test]
fn a_keepalive_on_a_ud_qp_is_refused() {
    let _s = serial();
    let _dog = common::watchdog("keepalive on UD", Duration::from_secs(300));
    let bed = common::bed();
    let ctx = device();
    let chan = CompChannel::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 8, Some(&chan)).unwrap();
    let pd = rdmasafe_core::verbs::Pd::new(&ctx).unwrap();
    let ch = EventChannel::new().unwrap();
    let mut id = ch.create_id(PortSpace::Udp).unwrap();
    id.bind_addr((bed.addr, 0).into()).unwrap();
    common::cm::add_qp_on(&mut id, &pd, &cq, true);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&cq, |_, _| {}).unwrap();
    let cfg = Keepalive { period: Duration::from_millis(10), bound: Duration::from_millis(50), wr_id: 1 };
    let e = lp.add_keepalive_id(&id, cfg, Box::new(|qpn, _| panic!("UD QP {qpn} declared dead"))).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // Nothing was started: the loop runs on without a dead peer.
    for _ in 0..5 {
        lp.process_once(Wait::For(Duration::from_millis(20))).unwrap();
    }
    assert_eq!(lp.stats().keepalive_dead, 0);
}

/// `LoopThread::stop` from one of the loop's own handlers: EDEADLK, and
/// the loop stops once the handler returns (it used to try to join its own
/// thread: a panic inside the handler).
#[test]
fn stopping_a_loop_thread_from_its_handler_is_edeadlk() {
    let _s = serial();
    let _dog = common::watchdog("LoopThread::stop from a handler", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 4);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let ctl = lp.control();
    let slot: Arc<Mutex<Option<rdmasafe_core::cq::LoopThread>>> = Arc::default();
    let result = Arc::new(Mutex::new(None));
    let (s2, r2) = (slot.clone(), result.clone());
    lp.add_cq(&pair.server_cq, move |_, _| {
        if let Some(t) = s2.lock().unwrap().take() {
            *r2.lock().unwrap() = Some(t.stop().map(|_| ()).map_err(|e| e.errno()));
        }
    })
    .unwrap();
    *slot.lock().unwrap() = Some(lp.spawn(None).unwrap());
    pair.recv(0, SLOT as u32, 1);
    pair.send(0, b"x", 1, 1);
    wait_until(|| result.lock().unwrap().is_some());
    assert_eq!(*result.lock().unwrap(), Some(Err(libc::EDEADLK)));
    // The loop stopped, and its thread ended once the handler returned.
    let loop_threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
            .filter(|c| c.trim() == "rdmasafe-cq")
            .count()
    };
    assert!(wait_until(|| loop_threads() == 0), "the loop's thread ended");
    drop(ctl);
}

/// A drain another thread drives while the loop is closed: it is not left
/// waiting for a runner that is gone (a `process_once` after the close is
/// refused); the close ends it with ECANCELED (it used to go on to its
/// end, which for a drain that cannot finish is its timeout: see
/// `rxe_cq_loop_live`'s `closing_the_loop_cancels_a_blocking_drain_that_drives_it`).
#[test]
fn a_close_during_a_drain_another_thread_drives_ends_it() {
    let _s = serial();
    let _dog = common::watchdog("close during a driven drain", Duration::from_secs(300));
    // 60 receives, 25 ms each in the handler: the drain takes 1.5 s.
    let d = SlowDrain::start(60);
    d.lp.try_close().unwrap();
    let e = d.lp.process_once(Wait::None).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let r = d.thread.join().unwrap();
    let handled = d.handled.load(SeqCst);
    assert!(handled < 60, "the premise: the close came while the drain was in progress");
    assert!(r.as_ref().is_err_and(|e| e.contains("the loop is gone")), "the drain ends with the close: {r:?}");
}

/// Where a CQ goes after a drain timed out with its markers still in it.
#[derive(Clone, Copy, Debug)]
enum Readd {
    /// Removed from its loop and added back to it.
    SameLoop,
    /// Removed from its loop, which is then dropped; added to a new loop
    /// on the same channel.
    OtherLoop,
    /// Its loop is dropped with the CQ in it; added to a new loop.
    LoopDropped,
}

/// A drain that timed out leaves its markers to come back later: they are
/// the loop's, also once their CQ has left the loop and been added again
/// (to the same loop or another one). The drain times out for sure: 16
/// receives are flushed ahead of its receive marker, the CQ's budget is
/// one completion, and the handler sleeps past the drain's 1 ms timeout on
/// each batch (so the first check after the first batch finds the deadline
/// past, a few completions at most later). The wait at the end is for a
/// send posted once every receive came: it completes after both markers.
fn a_late_marker_stays_the_loops_after(how: Readd) {
    let _s = serial();
    let _dog = common::watchdog("a late marker after a re-add", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 64);
    let is_marker = |w: &u64| *w == rdmasafe_core::cq::DRAIN_SEND_WR_ID || *w == rdmasafe_core::cq::DRAIN_RECV_WR_ID;
    let (first, second) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let f2 = first.clone();
    let one = rdmasafe_core::cq::CqOptions { solicited_only: false, budget: 1 };
    lp.add_cq_with(&pair.server_cq, one, move |wcs, _| {
        f2.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()));
        std::thread::sleep(Duration::from_millis(5));
    })
    .unwrap();
    lp.process_once(Wait::None).unwrap();
    const RECVS: u64 = 16;
    for k in 0..RECVS {
        pair.recv(k as usize * SLOT, SLOT as u32, k);
    }
    let result = Arc::new(Mutex::new(None));
    let r2 = result.clone();
    let id_guard = pair.server.lock().unwrap();
    lp.control()
        .drain_id_then(&id_guard.id, Duration::from_millis(1), Box::new(move |r| *r2.lock().unwrap() = Some(r)))
        .unwrap();
    drop(id_guard);
    assert!(drive_until(&lp, || result.lock().unwrap().is_some()), "the drain ended");
    let r = result.lock().unwrap().take().unwrap();
    assert_eq!(r.map_err(|e| e.errno()), Err(libc::ETIMEDOUT), "the drain timed out (the test's premise)");
    let lp = match how {
        Readd::SameLoop => {
            lp.remove_cq(&pair.server_cq).unwrap();
            lp
        }
        Readd::OtherLoop => {
            lp.remove_cq(&pair.server_cq).unwrap();
            drop(lp);
            CqLoop::new(&chan, LoopOptions::default()).unwrap()
        }
        Readd::LoopDropped => {
            drop(lp);
            CqLoop::new(&chan, LoopOptions::default()).unwrap()
        }
    };
    let s2 = second.clone();
    lp.add_cq(&pair.server_cq, move |wcs, _| s2.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()))).unwrap();
    let recvs = || -> Vec<u64> {
        let (f, s) = (first.lock().unwrap(), second.lock().unwrap());
        let mut r: Vec<u64> = f.iter().chain(s.iter()).copied().filter(|w| *w < RECVS).collect();
        r.sort_unstable();
        r
    };
    assert!(drive_until(&lp, || recvs().len() >= RECVS as usize), "every flushed receive came: {:?}", recvs());
    // A send posted now completes after the drain's send marker (a queue
    // completes in order) and after its receive marker (flushed right
    // after the last receive, which came already): once the handler has
    // it, the loop has polled both markers. (A receive posted to a QP in the error
    // state is not flushed on Linux 6.1's rxe: a send it must be.)
    const LATE_SEND: u64 = 1001;
    {
        let s = pair.server.lock().unwrap();
        s.id.post_send(&s.mr, 0, 8, LATE_SEND).unwrap();
    }
    assert!(
        drive_until(&lp, || second.lock().unwrap().contains(&LATE_SEND)),
        "the late send reached the new handler: {:?}",
        second.lock().unwrap()
    );
    assert_eq!(recvs(), (0..RECVS).collect::<Vec<_>>(), "every flushed receive once");
    drop(lp);
    let (first, second) = (first.lock().unwrap(), second.lock().unwrap());
    assert!(!first.iter().any(is_marker), "a marker reached the first handler ({how:?}): {first:?}");
    assert!(!second.iter().any(is_marker), "a marker reached the handler after the re-add ({how:?}): {second:?}");
}

#[test]
fn a_late_marker_stays_the_loops_after_a_remove_and_re_add() {
    a_late_marker_stays_the_loops_after(Readd::SameLoop);
}

#[test]
fn a_late_marker_stays_the_loops_after_moving_to_another_loop() {
    a_late_marker_stays_the_loops_after(Readd::OtherLoop);
}

#[test]
fn a_late_marker_stays_the_loops_after_its_loop_is_dropped() {
    a_late_marker_stays_the_loops_after(Readd::LoopDropped);
}

/// A drain in progress when its loop is dropped ends with ECANCELED, its
/// `done` called on the dropping thread before the drop returns (the
/// header's promise for `rdmasafe_cq_loop_destroy`). Nobody runs the loop
/// between the start of the drain and the drop, so the drain cannot have
/// finished otherwise (checked: `done` not called before the drop).
#[test]
fn a_drain_in_progress_ends_with_ecanceled_on_the_dropping_thread() {
    let _s = serial();
    let _dog = common::watchdog("a drain cancelled by the drop", Duration::from_secs(300));
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 16);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&pair.server_cq, |_, _| {}).unwrap();
    lp.process_once(Wait::None).unwrap();
    type Called = Option<(std::thread::ThreadId, Result<(), i32>)>;
    let called: Arc<Mutex<Called>> = Arc::new(Mutex::new(None));
    let c2 = called.clone();
    {
        let s = pair.server.lock().unwrap();
        lp.control()
            .drain_id_then(
                &s.id,
                Duration::from_secs(60),
                Box::new(move |r| *c2.lock().unwrap() = Some((std::thread::current().id(), r.map_err(|e| e.errno())))),
            )
            .unwrap();
    }
    assert!(
        called.lock().unwrap().is_none(),
        "the drain was still in progress when the loop was dropped (the premise)"
    );
    drop(lp);
    let got = called.lock().unwrap().take();
    assert_eq!(
        got,
        Some((std::thread::current().id(), Err(libc::ECANCELED))),
        "done called with ECANCELED on the dropping thread before the drop returned"
    );
}

/// How a keepalive's probe is left out when its send CQ leaves the loop.
#[derive(Debug, Clone, Copy)]
enum ProbeLeft {
    /// The keepalive still registered; the CQ removed and added back.
    CqRemoved,
    /// The keepalive removed first, then the CQ removed and added back.
    KeepaliveRemovedFirst,
    /// The loop dropped with the CQ in it; the CQ added to a new loop.
    LoopDropped,
}

/// A keepalive's probe still out when its send CQ leaves the loop stays
/// the loop's: its completion, polled after the CQ was added back (to the
/// same loop or a new one), never reaches a handler. The probe is held
/// out by the peer's QP in the error state (it never acknowledges: the
/// probe is retransmitted, bound 60 s); then our QP goes to the error state
/// with the CQ out of every loop, which flushes the probe into it. A send
/// posted after that completes after the probe (a queue completes in
/// order): once the handler has it, the probe was polled. Before, the
/// probe's completion reached the handler (wr_id and all) in each case.
fn a_probe_out_stays_the_loops_after(how: ProbeLeft) {
    let _s = serial();
    let _dog = common::watchdog("a probe out at a CQ's removal", Duration::from_secs(300));
    const PROBE: u64 = 0xa11e;
    const LATE_SEND: u64 = 1001;
    let chan = channel();
    let pair = rc_pair(common::bed().addr, &chan, false, 16);
    let got = Arc::new(Mutex::new(Vec::new()));
    let recorder = || {
        let g = got.clone();
        move |wcs: &[rdmasafe_core::verbs::Wc], _: &rdmasafe_core::cq::LoopControl| {
            g.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()))
        }
    };
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&pair.server_cq, recorder()).unwrap();
    let cfg = Keepalive { period: Duration::from_millis(20), bound: Duration::from_secs(60), wr_id: PROBE };
    lp.control().add_keepalive_id(&pair.server.lock().unwrap().id, cfg, Box::new(|_, _| {})).unwrap();
    assert!(drive_until(&lp, || lp.stats().keepalive_probes_ok >= 2), "probes complete while the peer answers");
    // The peer stops answering.
    let client_qp = pair.client.lock().unwrap().id.raw_qp().unwrap();
    // SAFETY: the client's QP lives in `pair`.
    unsafe { rdmasafe_core::sys::qp_to_error(client_qp.as_ptr()) }.unwrap();
    let out = |lp: &CqLoop| {
        let s = lp.stats();
        s.keepalive_probes > s.keepalive_probes_ok
    };
    assert!(drive_until(&lp, || out(&lp)), "a probe is out (the test's premise)");
    assert_eq!(lp.stats().keepalive_dead, 0, "not declared dead (bound 60 s)");
    let server_qp = pair.server_qp();
    let lp = match how {
        ProbeLeft::CqRemoved => {
            lp.remove_cq(&pair.server_cq).unwrap();
            lp
        }
        ProbeLeft::KeepaliveRemovedFirst => {
            // SAFETY: the server's QP lives in `pair`; a plain field read.
            lp.remove_keepalive(unsafe { (*server_qp.as_ptr()).qp_num }).unwrap();
            lp.remove_cq(&pair.server_cq).unwrap();
            lp
        }
        ProbeLeft::LoopDropped => {
            drop(lp);
            CqLoop::new(&chan, LoopOptions::default()).unwrap()
        }
    };
    assert!(!got.lock().unwrap().contains(&PROBE), "the probe was still out when the CQ left ({how:?})");
    // SAFETY: the server's QP lives in `pair`.
    unsafe { rdmasafe_core::sys::qp_to_error(server_qp.as_ptr()) }.unwrap();
    {
        let s = pair.server.lock().unwrap();
        s.id.post_send(&s.mr, 0, 8, LATE_SEND).unwrap();
    }
    lp.add_cq(&pair.server_cq, recorder()).unwrap();
    assert!(
        drive_until(&lp, || got.lock().unwrap().contains(&LATE_SEND)),
        "the send posted after the flush reached the handler: {:?}",
        got.lock().unwrap()
    );
    drop(lp);
    let got = got.lock().unwrap();
    assert!(!got.contains(&PROBE), "a keepalive probe reached the handler ({how:?}): {got:?}");
}

#[test]
fn a_probe_out_stays_the_loops_after_its_cq_is_removed_and_added_back() {
    a_probe_out_stays_the_loops_after(ProbeLeft::CqRemoved);
}

#[test]
fn a_probe_out_stays_the_loops_after_its_keepalive_and_cq_are_removed() {
    a_probe_out_stays_the_loops_after(ProbeLeft::KeepaliveRemovedFirst);
}

#[test]
fn a_probe_out_stays_the_loops_after_its_loop_is_dropped() {
    a_probe_out_stays_the_loops_after(ProbeLeft::LoopDropped);
}

/// A keepalive added at CONNECT_REQUEST, before `accept` (the QP in INIT:
/// it cannot send yet), with several periods passing before the accept:
/// the probes wait for the QP instead of declaring the peer dead (which
/// moved the QP to the error state and made the accept fail). Found by a
/// soak test of a Ceph-style server. Then probes while our QP is in RTS
/// and the client's not yet (dropped there, sent again only after the ack
/// timeout): not a dead peer. Then a clean close (our disconnect):
/// not a dead peer either (a flushed or refused probe was taken for one).
/// The waits only make the premises (periods pass); nothing is timed.
#[test]
fn a_keepalive_added_before_accept_waits_for_the_qp_to_send() {
    use common::cm::{expect, listen, params, resolved};
    use rdmasafe_core::cm::{EventType as E, QpCaps};
    use rdmasafe_core::verbs::{Mr, Pd};
    let _s = serial();
    let _dog = common::watchdog("keepalive before accept", Duration::from_secs(300));
    let addr = common::bed().addr;
    let chan = channel();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };
    let l = listen(addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, addr, l.port);
    let ctx = client.device_context().unwrap();
    let cpd = Pd::new(&ctx).unwrap();
    let client_cq = Cq::new(&ctx, 8, None).unwrap();
    client.create_qp(&cpd, &client_cq, &client_cq, caps, false).unwrap();
    client.connect(&params(b"ka")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    let spd = Pd::new(&ctx).unwrap();
    let server_cq = Cq::new(&ctx, 8, Some(&chan)).unwrap();
    r.id_mut().create_qp(&spd, &server_cq, &server_cq, caps, false).unwrap();
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g2 = got.clone();
    lp.add_cq(&server_cq, move |wcs, _| g2.lock().unwrap().extend(wcs.iter().map(|w| (w.wr_id(), w.is_success()))))
        .unwrap();
    let dead = Arc::new(AtomicBool::new(false));
    let d2 = dead.clone();
    let period = Duration::from_millis(20);
    let cfg = Keepalive { period, bound: Duration::from_millis(200), wr_id: 0xabc };
    lp.add_keepalive_id(r.id_mut(), cfg, Box::new(move |_, _| d2.store(true, SeqCst))).unwrap();
    // Well past the bound, the loop running: probes were due all along.
    let until = Instant::now() + 20 * period;
    while Instant::now() < until {
        let _ = lp.process_once(Wait::For(period));
    }
    assert!(!dead.load(SeqCst), "the peer of a QP that cannot send yet was declared dead: {:?}", lp.stats());
    let mr = Mr::new(&spd, 64).unwrap();
    r.id_mut().post_recv(&mr, 0, 64, 7).unwrap();
    let server = r.accept(&params(b"ok")).expect("accept after the keepalive's periods");
    // Our QP is in RTS now, the client's still in INIT until its app gets
    // the CM event: probes meanwhile are dropped there and sent again only
    // after the ack timeout (2 s on rxe), longer than the bound. Not a dead
    // peer either (the first probe's bound covers that timeout).
    let until = Instant::now() + 2 * cfg.bound;
    while Instant::now() < until {
        let _ = lp.process_once(Wait::For(period));
    }
    assert!(lp.stats().keepalive_probes > 0, "the premise: a probe went out before the client's QP was ready");
    expect(&cch, E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    // The connection works, and the keepalive probes it now.
    let mut cmr = Mr::new(&cpd, 64).unwrap();
    cmr.write(0, b"hello").unwrap();
    client.post_send(&cmr, 0, 5, 1).unwrap();
    assert!(drive_until(&lp, || got.lock().unwrap().contains(&(7, true))), "the receive: {:?}", got.lock().unwrap());
    let probes_before = lp.stats().keepalive_probes_ok;
    assert!(drive_until(&lp, || lp.stats().keepalive_probes_ok > probes_before), "a probe answered after the accept");
    assert!(!dead.load(SeqCst) && lp.stats().keepalive_dead == 0, "{:?}", lp.stats());
    // A clean close (our disconnect moves the QP to the error state): the
    // keepalive goes quiet; a peer that closed is not a dead one.
    server.disconnect().unwrap();
    let until = Instant::now() + 20 * period + cfg.bound;
    while Instant::now() < until {
        let _ = lp.process_once(Wait::For(period));
    }
    assert!(
        !dead.load(SeqCst) && lp.stats().keepalive_dead == 0,
        "declared dead after a clean close: {:?}",
        lp.stats()
    );
    drop((server, client, cch, l));
}

/// The system calls of poll(): ppoll, and poll where the architecture has it.
#[cfg(target_arch = "x86_64")]
const POLLS: &[i64] = &[libc::SYS_poll, libc::SYS_ppoll];
#[cfg(not(target_arch = "x86_64"))]
const POLLS: &[i64] = &[libc::SYS_ppoll];

/// Whether thread `tid` of this process is asleep in poll(2) / ppoll(2)
/// (from /proc: the system call it is blocked in).
fn in_poll(tid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse::<i64>().ok()))
        .is_some_and(|n| POLLS.contains(&n))
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> Vec<i32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|tid| std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).is_ok_and(|c| c.trim() == name))
        .collect()
}

#[test]
fn events_moved_in_by_migrate_wake_a_waiting_get_and_a_dispatcher() {
    let _s = serial();
    let _dog = common::watchdog("migrate into a channel being waited on", Duration::from_secs(300));
    let bed = common::bed();
    let a = EventChannel::new().unwrap();
    let token_of = |r: rdmasafe_core::Result<CmEvent>| r.map(|ev| (ev.event_type(), ev.token()));

    // 1. A thread already asleep in a get on B. Its timeout is four times
    // the wait for its answer: poll() rescans its fds when it times out,
    // and would find the moved event then.
    let b = EventChannel::new().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (rtx, rrx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn({
        let b = b.clone();
        // SAFETY: gettid has no preconditions.
        move || {
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = rtx.send(token_of(b.get_timeout(4 * common::cm::STEP)));
        }
    });
    let tid = rx.recv().unwrap();
    assert!(wait_until(|| in_poll(tid)), "the getter is asleep in poll()");
    let mut id = common::cm::with_queued_event(&a, bed.addr);
    id.migrate(&b).unwrap();
    assert_eq!(
        rrx.recv_timeout(common::cm::STEP),
        Ok(Ok((cm::EventType::ADDR_RESOLVED, Some(id.token())))),
        "the waiting get returned the moved event"
    );
    waiter.join().unwrap();

    // 2. A dispatcher asleep on B2.
    let b2 = EventChannel::new().unwrap();
    let (etx, erx) = std::sync::mpsc::channel();
    let d = Dispatcher::with_callback(&b2, move |ev| {
        let _ = etx.send((ev.event_type(), ev.token()));
    })
    .unwrap();
    assert!(
        wait_until(|| threads_named("rdmasafe-cm").into_iter().any(in_poll)),
        "the dispatcher's thread is asleep in poll()"
    );
    let mut id2 = common::cm::with_queued_event(&a, bed.addr);
    id2.migrate(&b2).unwrap();
    assert_eq!(
        erx.recv_timeout(common::cm::STEP),
        Ok((cm::EventType::ADDR_RESOLVED, Some(id2.token()))),
        "the dispatcher delivered the moved event"
    );
    d.stop().unwrap();
}

/// A `Dispatcher` whose queue is full takes no event it has no room for,
/// so a stop leaves none in its hands: the events wait in the kernel, and a
/// dispatcher started on the queue later opens it again and feeds it the
/// rest (found by an adversarial test: the copy the thread held was
/// dropped at the stop, a CONNECT_REQUEST among them a rejected client;
/// the queue stayed closed for good, so `pop_timeout` returned `None` at
/// once; and the figures counted the held copy as delivered, with no
/// wakeup). Five ids' ADDR_RESOLVED events, a queue of two.
#[test]
fn a_dispatcher_stopped_with_its_queue_full_loses_no_event_and_the_queue_reopens() {
    let bed = common::bed();
    let _s = serial();
    let _dog = common::watchdog("dispatcher stopped with a full queue", Duration::from_secs(300));
    let ch = EventChannel::new().unwrap();
    let ids: Vec<CmId> = (0..5)
        .map(|_| {
            let id = ch.create_id(PortSpace::Tcp).unwrap();
            id.resolve_addr(None, (bed.addr, 7).into(), Duration::from_secs(10)).unwrap();
            id
        })
        .collect();
    let queue = cm::WorkQueue::new(2);
    let d = Dispatcher::with_queue(&ch, queue.clone()).unwrap();
    let end = Instant::now() + PATIENCE;
    while d.stats().queue_full_waits == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = d.stats();
    assert!(st.queue_full_waits > 0, "the dispatcher waits for room, its queue full: {st:?}");
    assert_eq!((st.events, queue.len()), (2, 2), "two copies delivered (queued): {st:?}");
    assert!(st.wakeups >= 1 && st.max_batch >= 1, "a stalled dispatcher's figures show it woke: {st:?}");
    d.stop().unwrap();
    let mut got: Vec<CmEvent> = std::iter::from_fn(|| queue.try_pop()).collect();
    assert_eq!(got.len(), 2, "the workers get the two queued");
    assert!(queue.pop_timeout(Duration::from_secs(3600)).is_none(), "closed and empty: None at once");

    // Another dispatcher on the same queue opens it and feeds it the rest,
    // which waited in the kernel.
    let d = Dispatcher::with_queue(&ch, queue.clone()).unwrap();
    while got.len() < 5 && Instant::now() < end {
        if let Some(ev) = queue.pop_timeout(Duration::from_millis(100)) {
            got.push(ev);
        }
    }
    assert_eq!(d.stats().events, 3, "the second dispatcher delivered the other three");
    drop(d);
    let mut seen: Vec<_> = got.iter().map(|e| e.token()).collect();
    let mut want: Vec<_> = ids.iter().map(|id| Some(id.token())).collect();
    seen.sort_unstable();
    want.sort_unstable();
    assert_eq!(seen, want, "each id's ADDR_RESOLVED once, none lost at the stop");
    assert!(got.iter().all(|e| e.event_type() == cm::EventType::ADDR_RESOLVED));
}

/// A probe blocked by a full send queue is no dead peer once the peer
/// answers: the peer stalls (no receive posted: RNR, retried forever) with
/// our send queue full for longer than the keepalive's period, then
/// recovers, while the app refills the queue from its handler, as a
/// streaming app does. Successful completions flow, and the peer must not
/// be declared dead. (It was, at the bound: a probe blocked by the full
/// queue stayed blocked, since every retry came after the handler had
/// refilled the queue; found by an adversarial test of the timed
/// features.)
#[test]
fn a_full_send_queue_with_live_traffic_is_not_a_dead_peer() {
    let _s = serial();
    let _dog = common::watchdog("a full send queue with live traffic", Duration::from_secs(120));
    let bed = common::bed();
    let chan = channel();
    let p = Arc::new(rc_pair(bed.addr, &chan, false, 16));
    let lp = Arc::new(CqLoop::new(&chan, LoopOptions::default()).unwrap());
    const APP: u64 = 42;
    let fill = {
        let p = p.clone();
        move || {
            let s = p.server.lock().unwrap();
            let mut n = 0;
            while s.id.post_send(&s.mr, 0, 8, APP).is_ok() {
                n += 1;
            }
            n
        }
    };
    assert!(fill() > 0, "the sends that fill the queue");
    let ok = Arc::new(AtomicUsize::new(0));
    let (o, f) = (ok.clone(), fill.clone());
    lp.add_cq(&p.server_cq, move |wcs, _| {
        o.fetch_add(wcs.iter().filter(|w| w.is_success() && w.wr_id() == APP).count(), SeqCst);
        if wcs.iter().any(|w| w.is_success()) {
            f();
        }
    })
    .unwrap();
    let dead = Arc::new(AtomicBool::new(false));
    let d = dead.clone();
    let cfg = Keepalive { period: Duration::from_millis(300), bound: Duration::from_secs(3), wr_id: 9999 };
    // SAFETY: the server QP outlives the loop's use of it (the pair is
    // dropped after the loop stops).
    unsafe { lp.add_keepalive(p.server_qp(), cfg, Box::new(move |_, _| d.store(true, SeqCst))) }.unwrap();
    let runner = {
        let lp = lp.clone();
        std::thread::spawn(move || lp.run())
    };
    // The peer: no receive for 800 ms, then receives kept posted.
    let stop = Arc::new(AtomicBool::new(false));
    let peer = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(800));
            let mut out = 0usize;
            let mut wcs = vec![rdmasafe_core::verbs::Wc::default(); 32];
            while !stop.load(SeqCst) {
                {
                    let c = p.client.lock().unwrap();
                    while out < 14 && c.id.post_recv(&c.mr, 0, 64, 7).is_ok() {
                        out += 1;
                    }
                }
                out = out.saturating_sub(p.client_cq.poll(&mut wcs).unwrap());
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    // Past the bound counted from the stall's first blocked probe (0.3 s
    // in), with room: the blocked probe would have been declared dead by
    // then.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(8) && !dead.load(SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = lp.control().stats();
    stop.store(true, SeqCst);
    peer.join().unwrap();
    lp.control().stop();
    runner.join().unwrap().unwrap();
    let sent = ok.load(SeqCst);
    println!(
        "{sent} sends completed; probes {} ({} ok), dead {}",
        st.keepalive_probes, st.keepalive_probes_ok, st.keepalive_dead
    );
    assert!(sent > 16, "the stream ran past the stall ({sent} sends completed)");
    assert!(!dead.load(SeqCst), "a peer whose requests kept succeeding was declared dead: {st:?}");
}

/// A probe that completed into a solicited-only send CQ (no event) is not
/// handed to the app's handler after its id is dropped, when another
/// keepalive's tick notices the drop first (the keepalive ended without
/// keeping its probe as one to consume: the next poll handed it to the
/// handler; found by an adversarial test of the timed features).
#[test]
fn a_dropped_ids_probe_never_reaches_the_handler() {
    let _s = serial();
    let _dog = common::watchdog("a dropped id's probe", Duration::from_secs(120));
    let bed = common::bed();
    let ctx = device();
    let chan = CompChannel::new(&ctx).unwrap();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let cq2 = Cq::new(&ctx, 32, Some(&chan)).unwrap();
    let (_keep2, qp2) = common::rc::second_qp_on(bed.addr, &cq2);
    let lp = Arc::new(CqLoop::new(&chan, LoopOptions::default()).unwrap());
    const PROBE: u64 = 9999;
    let got: Arc<Mutex<Vec<u64>>> = Arc::default();
    let g = got.clone();
    let solicited = rdmasafe_core::cq::CqOptions { solicited_only: true, budget: 0 };
    lp.add_cq_with(&p.server_cq, solicited, move |wcs: &[rdmasafe_core::verbs::Wc], _| {
        g.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()));
    })
    .unwrap();
    lp.add_cq(&cq2, |_, _| {}).unwrap();
    let cfg = Keepalive { period: Duration::from_millis(100), bound: Duration::from_secs(30), wr_id: PROBE };
    lp.control().add_keepalive_id(&p.server.lock().unwrap().id, cfg, Box::new(|_, _| {})).unwrap();
    let cfg2 = Keepalive { period: Duration::from_millis(20), bound: Duration::from_secs(30), wr_id: PROBE + 1 };
    // SAFETY: the second QP lives in `_keep2` until the end of the test.
    unsafe { lp.add_keepalive(qp2, cfg2, Box::new(|_, _| {})) }.unwrap();
    let runner = {
        let lp = lp.clone();
        std::thread::spawn(move || lp.run())
    };
    // A probe of the id's QP is out (its completion raises no event, so it
    // stays out): it was due 100 ms after the add, and every tick of the
    // other keepalive after that posts it if it is not out yet.
    std::thread::sleep(Duration::from_millis(150));
    let before = lp.control().stats().keepalive_probes;
    assert!(wait_until(|| lp.control().stats().keepalive_probes >= before + 2), "the other keepalive ticks on");
    drop(take_id(&p.server)); // rdma_destroy_qp with the id
                              // The other keepalive's ticks see the drop.
    let later = lp.control().stats().keepalive_probes;
    assert!(wait_until(|| lp.control().stats().keepalive_probes >= later + 5), "the other keepalive ticks on");
    lp.control().stop();
    runner.join().unwrap().unwrap();
    // The next run arms and polls every CQ.
    lp.run_for(Duration::from_millis(200)).unwrap();
    let got = got.lock().unwrap().clone();
    assert!(!got.contains(&PROBE), "a keepalive probe reached the app's handler: {got:?}");
}

/// A `drain_qp_then` done callback that panics, called by the loop's drop
/// (the drain still in progress: ECANCELED), is caught there as anywhere
/// else: the drop finishes, and the channel takes a new loop. (The panic
/// unwound out of the drop, which left the channel claimed for good:
/// EBUSY for every later loop; found by an adversarial test of the timed
/// features.)
#[test]
fn a_panicking_drain_callback_at_the_loops_drop_is_caught() {
    let _s = serial();
    let _dog = common::watchdog("a panicking drain callback at the drop", Duration::from_secs(120));
    let bed = common::bed();
    let chan = channel();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&p.server_cq, |_, _| {}).unwrap();
    let ctl = lp.control();
    let called = Arc::new(AtomicBool::new(false));
    let c = called.clone();
    // Nobody runs the loop: the drain starts and stays in progress.
    // SAFETY: the server QP outlives the drain (the pair outlives the loop).
    unsafe {
        ctl.drain_qp_then(
            p.server_qp(),
            false,
            Duration::from_secs(60),
            Box::new(move |r| {
                c.store(true, SeqCst);
                panic!("the done callback panics: {r:?}")
            }),
        )
    }
    .unwrap();
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(lp)));
    assert!(called.load(SeqCst), "the drop called the drain's callback");
    assert!(dropped.is_ok(), "the callback's panic unwound out of the loop's drop");
    let again = CqLoop::new(&chan, LoopOptions::default()).expect("a new loop on the channel");
    again.add_cq(&p.server_cq, |_, _| {}).expect("the CQ joins the new loop");
}

/// What [`retry_exceeded`] saw: the completions the handler got, and the
/// `on_dead` calls.
struct RetryExceeded {
    got: Vec<(u64, rdmasafe_core::verbs::WcStatus)>,
    deaths: usize,
}

/// The cases of [`retry_exceeded`].
#[derive(Clone, Copy, PartialEq)]
enum AfterRetryExceeded {
    /// The handler drains the QP when it sees the failure (an app's
    /// teardown).
    HandlerDrains,
    /// Once the peer is declared dead, the app removes the keepalive and
    /// adds one again on the same QP, in the error state now: its probe
    /// flushes, and it must go quiet (an error state it did not cause).
    KeepaliveAddedAgain,
    /// A probe is out first, and fails with "retry exceeded" (consumed by
    /// the loop); the app's send behind it flushes, and the handler drains
    /// the QP when it sees that flush, in the same batch.
    ProbeFirstHandlerDrains,
}

/// The peer goes away (its QP destroyed) and a send of ours fails with
/// "retry exceeded" (after some 16 s of retries on rxe), a keepalive on
/// our QP with a bound far longer than that (so only the failure can
/// declare the peer dead), and a period as long, but in
/// `ProbeFirstHandlerDrains`, where a probe goes out before the send.
fn retry_exceeded(case: AfterRetryExceeded) -> RetryExceeded {
    use rdmasafe_core::verbs::WcStatus;
    let bed = common::bed();
    let chan = channel();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let lp = Arc::new(CqLoop::new(&chan, LoopOptions::default()).unwrap());
    let got: Arc<Mutex<Vec<(u64, WcStatus)>>> = Arc::default();
    let g = got.clone();
    let qp = p.server_qp();
    let qp_addr = qp.as_ptr() as usize;
    let drains_on = match case {
        AfterRetryExceeded::HandlerDrains => Some(WcStatus::RETRY_EXC_ERR),
        AfterRetryExceeded::ProbeFirstHandlerDrains => Some(WcStatus::WR_FLUSH_ERR),
        AfterRetryExceeded::KeepaliveAddedAgain => None,
    };
    lp.add_cq(&p.server_cq, move |wcs, ctl| {
        for w in wcs {
            g.lock().unwrap().push((w.wr_id(), w.status()));
            if Some(w.status()) == drains_on {
                let qp = std::ptr::NonNull::new(qp_addr as *mut rdmasafe_core::sys::ibv_qp).unwrap();
                // SAFETY: the server QP outlives the loop's use of it.
                let r = unsafe { ctl.drain_qp(qp, false, Duration::from_secs(30)) };
                assert!(r.is_ok(), "the drain requested from the handler: {r:?}");
            }
        }
    })
    .unwrap();
    let deaths = Arc::new(AtomicUsize::new(0));
    let n = deaths.clone();
    const PROBE: u64 = 9999;
    let probe_first = case == AfterRetryExceeded::ProbeFirstHandlerDrains;
    let period = if probe_first { Duration::from_millis(200) } else { Duration::from_secs(600) };
    let cfg = Keepalive { period, bound: Duration::from_secs(600), wr_id: PROBE };
    // SAFETY: the server QP outlives the loop's use of it.
    unsafe { lp.add_keepalive(qp, cfg, Box::new(move |_, _| _ = n.fetch_add(1, SeqCst))) }.unwrap();
    let runner = {
        let lp = lp.clone();
        std::thread::spawn(move || lp.run())
    };
    let probes = || lp.control().stats().keepalive_probes;
    let before = probes();
    drop(take_id(&p.client)); // the peer's QP is gone
    if probe_first {
        // A probe posted after the peer went: first in the send queue.
        assert!(wait_until(|| probes() > before), "a probe went out");
    }
    {
        let s = p.server.lock().unwrap();
        s.id.post_send(&s.mr, 0, 8, 42).unwrap();
    }
    assert!(
        wait_until(|| deaths.load(SeqCst) > 0),
        "the peer was never declared dead; the handler got {:?}",
        got.lock().unwrap()
    );
    if case == AfterRetryExceeded::KeepaliveAddedAgain {
        let qpn = p.server.lock().unwrap().id.qp_num().unwrap();
        lp.control().remove_keepalive(qpn).unwrap();
        let n = deaths.clone();
        let cfg = Keepalive { period: Duration::from_millis(50), bound: Duration::from_millis(500), wr_id: PROBE };
        // SAFETY: as above.
        unsafe { lp.add_keepalive(qp, cfg, Box::new(move |_, _| _ = n.fetch_add(1, SeqCst))) }.unwrap();
        // Its probe goes out a period after the add, and flushes (the QP is
        // in the error state): wait for that probe's completion.
        let ok0 = lp.control().stats().keepalive_probes;
        assert!(wait_until(|| lp.control().stats().keepalive_probes > ok0), "the new keepalive probed");
        // Past its bound, with room: a probe taken by something else would
        // have made it declare the peer dead again by then. (A keepalive's
        // first probe has a bound of at least twice the QP's ack timeout,
        // about 4.3 s on rxe: see `Keepalive::bound`.)
        std::thread::sleep(Duration::from_secs(8));
    }
    lp.control().stop();
    runner.join().unwrap().unwrap();
    let got = got.lock().unwrap().clone();
    RetryExceeded { got, deaths: deaths.load(SeqCst) }
}

/// A handler that drains the QP when a request fails with "retry
/// exceeded" does not keep the peer from being declared dead (the drain
/// silenced the keepalive before its next look: `on_dead` was never
/// called; found by an adversarial test of the timed features).
#[test]
fn retry_exceeded_is_a_dead_peer_also_when_the_handler_drains() {
    let _s = serial();
    let _dog = common::watchdog("retry exceeded, the handler drains", Duration::from_secs(180));
    let r = retry_exceeded(AfterRetryExceeded::HandlerDrains);
    assert!(r.got.iter().any(|w| w.1 == rdmasafe_core::verbs::WcStatus::RETRY_EXC_ERR), "{:?}", r.got);
    assert_eq!(r.deaths, 1, "on_dead once: {:?}", r.got);
}

/// The same with the probe first in the send queue: the probe fails with
/// "retry exceeded" (the loop's own completion), and the handler drains
/// the QP on the flush of the app's send behind it, in the same batch (the
/// drain silenced the keepalive before its next look: the fix above missed
/// this order; found by a review of that fix).
#[test]
fn a_failed_probe_is_a_dead_peer_also_when_the_handler_drains_on_the_flush() {
    let _s = serial();
    let _dog = common::watchdog("a failed probe, the handler drains", Duration::from_secs(180));
    let r = retry_exceeded(AfterRetryExceeded::ProbeFirstHandlerDrains);
    assert!(r.got.iter().any(|w| w.1 == rdmasafe_core::verbs::WcStatus::WR_FLUSH_ERR), "{:?}", r.got);
    assert!(r.got.iter().all(|w| w.0 != 9999), "a probe reached the handler: {:?}", r.got);
    assert_eq!(r.deaths, 1, "on_dead once: {:?}", r.got);
}

/// After a dead peer found by a request's "retry exceeded" (no probe out),
/// a keepalive removed and added again on the same QP goes quiet (a probe
/// that was never posted was remembered as one still out, and took the
/// new keepalive's probe: the peer was declared dead a second time; found
/// by an adversarial test of the timed features).
#[test]
fn a_keepalive_added_again_on_a_dead_peers_qp_goes_quiet() {
    let _s = serial();
    let _dog = common::watchdog("a keepalive added again on a dead peer's QP", Duration::from_secs(180));
    let r = retry_exceeded(AfterRetryExceeded::KeepaliveAddedAgain);
    assert!(r.got.iter().any(|w| w.1 == rdmasafe_core::verbs::WcStatus::RETRY_EXC_ERR), "{:?}", r.got);
    assert_eq!(r.deaths, 1, "on_dead once, not again for the keepalive added anew: {:?}", r.got);
    assert!(r.got.iter().all(|w| w.0 != 9999), "a probe reached the handler: {:?}", r.got);
}
