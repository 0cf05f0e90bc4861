//! The Rust API's conveniences on Soft-RoCE: `run_for`, a `LocalCqLoop`
//! whose handlers hold `Rc<RefCell<..>>` state and change the loop from
//! inside, and the safe id-level drain and keepalive, which stay safe when
//! the id (and with it the QP) goes first.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::rc::{rc_pair, RcPair, SLOT};
use rdmasafe_core::cm::{EventChannel, PortSpace};
use rdmasafe_core::cq::{CqLoop, Keepalive, LocalCqLoop, LoopOptions, Outcome, RunEnd};
use rdmasafe_core::verbs::{CompChannel, Cq, DeviceContext, Wc, WcStatus};
use rdmasafe_core::Wait;

fn device(addr: std::net::IpAddr) -> (DeviceContext, EventChannel) {
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((addr, 0).into()).unwrap();
    (id.device_context().unwrap(), ch)
}

fn poll_n(cq: &Cq, n: usize) {
    let start = Instant::now();
    let mut got = 0;
    let mut wcs: [Wc; 16] = std::array::from_fn(|_| Wc::zeroed());
    while got < n {
        got += cq.poll(&mut wcs).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60), "{got} of {n}");
    }
}

/// Sends `n` messages into the server's CQ (client side polled directly).
fn prefill(p: &RcPair, first: u64, n: u64) {
    for i in 0..n {
        p.recv(((first + i) % 16) as usize * SLOT, SLOT as u32, first + i);
    }
    for i in 0..n {
        p.send(0, &[], 8, first + i);
    }
    poll_n(&p.client_cq, n as usize);
}

#[test]
fn run_for_ends_on_time_or_on_stop() {
    let bed = common::bed();
    let _dog = common::watchdog("run_for", Duration::from_secs(120));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    lp.add_cq(&p.server_cq, move |w, _| {
        s2.fetch_add(w.len(), SeqCst);
    })
    .unwrap();
    let t0 = Instant::now();
    assert_eq!(lp.run_for(Duration::from_millis(50)).unwrap(), RunEnd::TimedOut);
    assert!(t0.elapsed() >= Duration::from_millis(50), "it waited its time");
    prefill(&p, 1, 3);
    // Delivers what came, then times out again: nothing is left unacked.
    assert_eq!(lp.run_for(Duration::from_millis(200)).unwrap(), RunEnd::TimedOut);
    assert_eq!(seen.load(SeqCst), 3);
    assert_eq!(lp.stats().unacked_now, 0, "acks flushed when the time is up");
    // A stop from another thread ends a long run_for, and is consumed.
    let ctl = lp.control();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        ctl.stop();
    });
    assert_eq!(lp.run_for(Duration::MAX).unwrap(), RunEnd::Stopped);
    stopper.join().unwrap();
    assert_eq!(lp.run_for(Duration::from_millis(10)).unwrap(), RunEnd::TimedOut, "the stop was consumed");
}

/// A local loop's dead-peer callback need not be `Send` either: it runs
/// on the loop's thread and gets a `LocalControl`, never a `LoopControl`
/// (one sent to another thread from it let that thread run the loop, whose
/// forwarders found no handler there: completions were lost; found by an
/// adversarial test of the local loop). A second keepalive for the QP is
/// refused (EBUSY) and the first one's callback stays; the callback goes
/// with the loop.
#[test]
fn a_local_loops_dead_peer_callback_runs_on_its_thread() {
    let bed = common::bed();
    let _dog = common::watchdog("local loop dead peer", Duration::from_secs(120));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let lp = LocalCqLoop::new(&chan, LoopOptions::default()).unwrap();
    lp.add_cq(&p.server_cq, |_, _| {}).unwrap();
    let deaths: Rc<RefCell<Vec<(u32, std::thread::ThreadId, u64)>>> = Rc::default();
    let d = deaths.clone();
    let cfg = Keepalive { period: Duration::from_millis(100), bound: Duration::from_millis(500), wr_id: 9999 };
    let (qpn, e) = {
        let s = p.server.lock().unwrap();
        lp.add_keepalive_id(&s.id, cfg, move |qpn, ctl| {
            d.borrow_mut().push((qpn, std::thread::current().id(), ctl.stats().keepalive_dead))
        })
        .unwrap();
        let e = lp.add_keepalive_id(&s.id, cfg, |_, _| panic!("the refused keepalive's callback ran")).unwrap_err();
        (s.id.qp_num().unwrap(), e)
    };
    assert_eq!(e.errno(), libc::EBUSY, "a second keepalive for the QP");
    p.client.lock().unwrap().id.disconnect().unwrap(); // the peer goes away
    let end = Instant::now() + Duration::from_secs(60);
    while deaths.borrow().is_empty() && Instant::now() < end {
        lp.process_once(Wait::For(Duration::from_millis(100))).unwrap();
    }
    let got = deaths.borrow().clone();
    assert_eq!(got.len(), 1, "the peer declared dead once: {got:?}");
    assert_eq!((got[0].0, got[0].1), (qpn, std::thread::current().id()), "its QP, on the loop's thread");
    assert_eq!(got[0].2, 1, "its LocalControl shows the loop's figures");
    assert_eq!(Rc::strong_count(&deaths), 2, "the callback is held until the keepalive or the loop goes");
    drop(lp);
    assert_eq!(Rc::strong_count(&deaths), 1, "the callback went with the loop");
}

/// Handlers with `Rc<RefCell<..>>` state; one adds a second CQ and removes
/// itself from inside; the local loop's stop handle crosses threads.
#[test]
fn a_local_loop_runs_handlers_that_are_not_send() {
    let bed = common::bed();
    let _dog = common::watchdog("local loop", Duration::from_secs(120));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let a = Rc::new(rc_pair(bed.addr, &chan, false, 16));
    let b = Rc::new(rc_pair(bed.addr, &chan, false, 16));
    let lp = LocalCqLoop::new(&chan, LoopOptions::default()).unwrap();
    let log: Rc<RefCell<Vec<(&'static str, u64)>>> = Rc::default();
    let (l2, b2, a2) = (log.clone(), b.clone(), a.clone());
    lp.add_cq(&a.server_cq, move |wcs, ctl| {
        l2.borrow_mut().extend(wcs.iter().map(|w| ("a", w.wr_id())));
        let l3 = l2.clone();
        let added =
            ctl.add_cq(&b2.server_cq, move |wcs, _| l3.borrow_mut().extend(wcs.iter().map(|w| ("b", w.wr_id()))));
        assert_eq!(added.unwrap(), Outcome::Pending);
        assert_eq!(ctl.remove_cq(&a2.server_cq).unwrap(), Outcome::Pending);
    })
    .unwrap();
    prefill(&a, 1, 1);
    while log.borrow().is_empty() {
        lp.process_once(Wait::For(Duration::from_secs(10))).unwrap();
    }
    assert_eq!(lp.stats().cqs, 1, "a left, b joined");
    prefill(&b, 10, 2);
    prefill(&a, 2, 1); // a is out: never delivered
    while log.borrow().len() < 3 {
        lp.process_once(Wait::For(Duration::from_secs(10))).unwrap();
    }
    assert_eq!(lp.run_for(Duration::from_millis(100)).unwrap(), RunEnd::TimedOut);
    assert_eq!(*log.borrow(), vec![("a", 1), ("b", 10), ("b", 11)]);
    assert_eq!(Rc::strong_count(&a), 1, "a's handler (holding Rcs of a and b) was dropped after its own removal");
    assert_eq!(Rc::strong_count(&b), 1);
    assert_eq!(Rc::strong_count(&log), 2, "b's handler (holding the log) is alive in the loop");
    let stop = lp.stop_handle();
    std::thread::spawn(move || stop.stop()).join().unwrap();
    assert_eq!(lp.run_for(Duration::MAX).unwrap(), RunEnd::Stopped);
    lp.remove_cq(&b.server_cq).unwrap();
    assert_eq!(Rc::strong_count(&log), 1, "b's handler dropped with its removal");
    // A handler still in the loop goes with the loop.
    let l4 = log.clone();
    lp.add_cq(&b.server_cq, move |_, _| drop(l4.borrow())).unwrap();
    assert_eq!(Rc::strong_count(&log), 2);
    drop(lp);
    assert_eq!(Rc::strong_count(&log), 1, "dropped with the loop");
}

/// drain_id and add_keepalive_id need no unsafe: the loop uses the id's QP
/// only while the id has it. A keepalive whose id is dropped first ends by
/// itself, with no death reported and no crash.
#[test]
fn id_level_drain_and_keepalive_are_safe_in_any_drop_order() {
    let bed = common::bed();
    let _dog = common::watchdog("id-level drain / keepalive", Duration::from_secs(120));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = rc_pair(bed.addr, &chan, false, 16);
    let q = rc_pair(bed.addr, &chan, false, 16);
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let flushed = Arc::new(AtomicUsize::new(0));
    let f2 = flushed.clone();
    lp.add_cq(&p.server_cq, |_, _| {}).unwrap();
    lp.add_cq(&q.server_cq, move |w, _| {
        f2.fetch_add(w.iter().filter(|w| w.status() == WcStatus::WR_FLUSH_ERR).count(), SeqCst);
    })
    .unwrap();
    // A generous bound: a probe answered late on a loaded guest is no death.
    let cfg = Keepalive { period: Duration::from_millis(20), bound: Duration::from_secs(3), wr_id: 0xfeed };
    {
        let s = p.server.lock().unwrap();
        lp.add_keepalive_id(&s.id, cfg, Box::new(|_, _| panic!("a healthy peer declared dead"))).unwrap();
    }
    let ctl = lp.control();
    let t = lp.spawn(None).unwrap();
    let start = Instant::now();
    while ctl.stats().keepalive_probes_ok < 2 {
        assert!(start.elapsed() < Duration::from_secs(60), "probes answered");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The server's id goes while its keepalive is registered and probing.
    let RcPair { server, client, server_cq, client_cq, .. } = p;
    let server = server.into_inner().unwrap();
    drop(server);
    std::thread::sleep(cfg.period + cfg.bound + Duration::from_millis(500));
    let s = ctl.stats();
    assert_eq!(s.keepalive_dead, 0, "no death for a QP its owner destroyed: {s:?}");
    // A drain through an id whose CQ is not in the loop: EINVAL, nothing
    // posted. One whose CQ is: the 3 posted receives come back flushed.
    let c = client.into_inner().unwrap();
    assert_eq!(ctl.drain_id(&c.id, Duration::from_secs(5)).unwrap_err().errno(), libc::EINVAL);
    for i in 0..3 {
        q.recv(i * SLOT, SLOT as u32, 100 + i as u64);
    }
    {
        let s = q.server.lock().unwrap();
        assert_eq!(ctl.drain_id(&s.id, Duration::from_secs(30)).unwrap(), Outcome::Done);
    }
    assert_eq!(flushed.load(SeqCst), 3, "everything posted before the drain completed, through the handler");
    let lp = t.stop().unwrap();
    drop(lp);
    drop((c, server_cq, client_cq, q));
}
