//! CQ overrun on rxe (guest only: it drives a CQ past its size). Measures
//! what rxe reports and asserts that it reaches the app: the CQ_ERR async
//! event (copied, acked) names the CQ; the loop delivers what the CQ holds
//! and the flush errors after the QP is moved to error, with the drain
//! marker last.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::rc::{rc_pair_sized, SLOT};
use rdmasafe_core::cm::{EventChannel, PortSpace};
use rdmasafe_core::cq::{
    AsyncElement, AsyncEventType, AsyncEvents, CqLoop, LoopOptions, DRAIN_RECV_WR_ID, DRAIN_SEND_WR_ID,
};
use rdmasafe_core::verbs::WcStatus;
use rdmasafe_core::verbs::{empty_wc, CompChannel};
use rdmasafe_core::Wait;

#[test]
fn cq_overrun_reaches_the_app() {
    let bed = common::bed();
    assert!(bed.in_guest, "rxe_destructive_* run in the guest only");
    let _dog = common::watchdog("CQ overrun", Duration::from_secs(300));
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((bed.addr, 0).into()).unwrap();
    let ctx = id.device_context().unwrap();
    let chan = CompChannel::new(&ctx).unwrap();
    // Receive queue of 64, server CQ asked for 4 entries (rxe rounds up).
    let p = rc_pair_sized(bed.addr, &chan, false, 64, 4);
    // SAFETY: reading the size field of a live CQ.
    let cqe = unsafe { (*p.server_cq.raw()).cqe };
    println!("server CQ: asked for 4 entries, rxe gave cqe = {cqe}");
    assert!(cqe < 64, "the CQ is smaller than the receive queue");
    for i in 0..64u64 {
        p.recv((i as usize % 64) * SLOT, SLOT as u32, i);
    }
    // Client sends more than the server's CQ holds; nobody polls the server CQ.
    let sends = 64u64;
    let mut client_status = Vec::new();
    for i in 0..sends {
        p.send(0, &[], 8, i);
    }
    let mut wcs: Vec<_> = (0..16).map(|_| empty_wc()).collect();
    let start = Instant::now();
    while (client_status.len() as u64) < sends && start.elapsed() < Duration::from_secs(60) {
        let n = p.client_cq.poll(&mut wcs).unwrap();
        client_status.extend(wcs[..n].iter().map(|w| w.status()));
        if n == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    println!("client send completions: {} of {sends}, statuses {:?}", client_status.len(), dedup(&client_status));

    // What rxe reported asynchronously.
    let asyncs = AsyncEvents::new(&ctx);
    let mut seen = Vec::new();
    while let Ok(ev) = asyncs.get(Wait::For(Duration::from_secs(if seen.is_empty() { 20 } else { 1 }))) {
        println!("async event: {:?} {:?}", ev.event_type, ev.element);
        seen.push(ev);
    }
    assert!(
        seen.iter().any(|e| e.event_type == AsyncEventType::CQ_ERR && e.element == AsyncElement::Cq(p.server_cq.raw())),
        "CQ_ERR naming the overrun CQ reached the app: {seen:?}"
    );

    // The loop delivers what the CQ holds, then the flush errors after the
    // QP goes to error; the drain's markers stay the loop's own.
    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let got: Arc<Mutex<Vec<(u64, WcStatus)>>> = Arc::default();
    let g = got.clone();
    lp.add_cq(&p.server_cq, move |w, _| g.lock().unwrap().extend(w.iter().map(|w| (w.wr_id(), w.status())))).unwrap();
    lp.process_once(Wait::None).unwrap();
    // SAFETY: the server QP is live.
    let drained = unsafe { lp.drain_qp(p.server_qp(), false, Duration::from_secs(30)) };
    let got = got.lock().unwrap();
    let ok = got.iter().filter(|w| w.1 == WcStatus::SUCCESS).count();
    let flushed = got.iter().filter(|w| w.1 == WcStatus::WR_FLUSH_ERR).count();
    println!("loop delivered {} completions: {ok} successful, {flushed} flush errors; drain: {drained:?}", got.len());
    assert!(ok > 0 && ok <= cqe as usize + 1, "the CQ held at most its size");
    drained.expect("drain completes after an overrun");
    assert!(
        got.iter().all(|w| w.0 != DRAIN_RECV_WR_ID && w.0 != DRAIN_SEND_WR_ID),
        "no drain marker reaches the handler"
    );
    assert_eq!(lp.stats().unacked_now, 0);
    drop(lp);
    drop(p);
}

fn dedup(v: &[WcStatus]) -> Vec<(WcStatus, usize)> {
    let mut out: Vec<(WcStatus, usize)> = Vec::new();
    for s in v {
        match out.last_mut() {
            Some((x, n)) if x == s => *n += 1,
            _ => out.push((*s, 1)),
        }
    }
    out
}
