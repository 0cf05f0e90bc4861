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
//!   back).
//!
//! No timing is asserted: each wait ends when its condition holds, and a
//! generous watchdog turns a hang into a failure.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::rc::{rc_pair, Side, SLOT};
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

/// The bed's device (its context outlives the id that found it).
fn device() -> DeviceContext {
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((common::bed().addr, 0).into()).unwrap();
    id.device_context().unwrap()
}

fn channel() -> CompChannel {
    CompChannel::new(&device()).unwrap()
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
    let wait = |what: &str, cond: &dyn Fn() -> bool| {
        let end = Instant::now() + PATIENCE;
        while !cond() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(cond(), "{what}");
    };
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
