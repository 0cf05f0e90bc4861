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

/// One test at a time: librdmacm's ids on one device share its verbs
/// context, and with it the context's one stream of async events.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn cq_overrun_reaches_the_app() {
    let _s = serial();
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

/// An async-event thread stopped from its own callback (an app that tears
/// its device state down on an error event) says EDEADLK and ends once
/// the callback returns; one dropped there ends the same way. (Both used
/// to join the thread from itself, which panicked in std: the callback
/// never went on, and with `panic = "abort"` the process ended; found by
/// an adversarial test of the async events.) The event is a CQ overrun's
/// CQ_ERR.
#[test]
fn an_async_thread_stopped_or_dropped_from_its_own_callback_ends() {
    let _s = serial();
    let bed = common::bed();
    assert!(bed.in_guest, "rxe_destructive_* run in the guest only");
    let _dog = common::watchdog("async thread stopped from its callback", Duration::from_secs(300));
    for stop in [true, false] {
        let ch = EventChannel::new().unwrap();
        let id = ch.create_id(PortSpace::Tcp).unwrap();
        id.bind_addr((bed.addr, 0).into()).unwrap();
        let ctx = id.device_context().unwrap();
        let chan = CompChannel::new(&ctx).unwrap();
        let slot: Arc<Mutex<Option<rdmasafe_core::cq::AsyncThread>>> = Arc::default();
        let said: Arc<Mutex<Vec<String>>> = Arc::default();
        let (s2, d2) = (slot.clone(), said.clone());
        let th = AsyncEvents::new(&ctx)
            .spawn(move |ev| {
                let Some(t) = s2.lock().unwrap().take() else { return };
                if stop {
                    let e = t.stop().expect_err("a stop from the callback");
                    d2.lock().unwrap().push(format!("{:?} stop: errno {}", ev.event_type, e.errno()));
                } else {
                    drop(t);
                    d2.lock().unwrap().push(format!("{:?} dropped", ev.event_type));
                }
            })
            .unwrap();
        let thread_name = "rdmasafe-async";
        *slot.lock().unwrap() = Some(th);
        // A CQ of 4 entries, 64 receives completed into it: overrun.
        let p = rc_pair_sized(bed.addr, &chan, false, 64, 4);
        for i in 0..64u64 {
            p.recv((i as usize % 64) * SLOT, SLOT as u32, i);
        }
        for i in 0..64u64 {
            p.send(0, &[], 8, i);
        }
        let mut wcs: Vec<_> = (0..16).map(|_| empty_wc()).collect();
        let end = Instant::now() + Duration::from_secs(60);
        let mut done = 0;
        while done < 64 && Instant::now() < end {
            let n = p.client_cq.poll(&mut wcs).unwrap();
            done += n;
            if n == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        while said.lock().unwrap().is_empty() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let said = said.lock().unwrap().clone();
        println!("{said:?}");
        assert_eq!(said.len(), 1, "the callback went on after the stop or drop: {said:?}");
        if stop {
            assert!(said[0].ends_with(&format!("errno {}", libc::EDEADLK)), "{said:?}");
        }
        // The thread ends once the callback returns.
        while threads_named(thread_name) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(threads_named(thread_name), 0, "the async thread ended");
    }
}

/// This process's threads named `name`.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim() == name)
        .count()
}
