//! A polling mode's loop embedded in the app's own wait (the app polls the
//! loop's fd and calls `process_once(Wait::None)` when it is readable, as
//! the docs say) is called again whenever it has a CQ unarmed. A drain of
//! one QP, with nobody waiting, on a CQ that another QP shares: its
//! markers' event wakes the loop, whose drain of that CQ finds only the
//! markers (the loop's own: adaptive and learning modes start no polling
//! for them, and do not re-arm what fired, expecting to poll it). The CQ
//! is then unarmed, and no timer is left (the drain is over). Unless the
//! call leaves the fd readable, the app waits on it, and a message to the
//! other QP raises no event: it is never delivered. The wait for it is
//! bounded (30 s; on rxe it comes within milliseconds).

mod common;

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::rc::{rc_pair, second_qp_on, SLOT};
use rdmasafe_core::cq::{CqLoop, LoopOptions, Mode};
use rdmasafe_core::sys;
use rdmasafe_core::verbs::CompChannel;
use rdmasafe_core::Wait;

/// The app's own wait: calls the loop when its fd is readable, until
/// `done()` or 30 s; returns `done()`.
fn drive_embedded(lp: &CqLoop, done: impl Fn() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(30);
    while !done() && Instant::now() < end {
        let [readable] = sys::poll_readable([lp.as_raw_fd()], Wait::For(Duration::from_millis(100))).unwrap();
        if readable {
            lp.process_once(Wait::None).unwrap();
        }
    }
    done()
}

#[test]
fn an_embedded_polling_loop_is_called_again_when_a_drain_leaves_its_cq_unarmed() {
    let bed = common::bed();
    let _dog = common::watchdog("embedded loop, CQ unarmed by a drain", Duration::from_secs(240));
    let ctx = common::cm::device(bed.addr);
    for mode in [Mode::Adaptive { spin: Duration::from_micros(50) }, Mode::Learning] {
        let chan = CompChannel::new(&ctx).unwrap();
        let pair = rc_pair(bed.addr, &chan, false, 16);
        let (_keep, qp_b) = second_qp_on(bed.addr, &pair.server_cq);
        let lp = CqLoop::new(&chan, LoopOptions { mode, ..Default::default() }).unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        lp.add_cq(&pair.server_cq, move |wcs, _| g.lock().unwrap().extend(wcs.iter().map(|w| w.wr_id()))).unwrap();
        // The app's first call (the fd is readable after the add): the CQ
        // is armed.
        lp.process_once(Wait::None).unwrap();
        let drained = Arc::new(Mutex::new(None));
        let d = drained.clone();
        // SAFETY: QP B lives in `_keep` until the end of the case; its
        // queues are empty (a free slot each).
        unsafe {
            lp.control().drain_qp_then(
                qp_b,
                false,
                Duration::from_secs(20),
                Box::new(move |r| {
                    *d.lock().unwrap() = Some(r.map_err(|e| e.errno()));
                }),
            )
        }
        .unwrap();
        assert!(drive_embedded(&lp, || drained.lock().unwrap().is_some()), "{mode:?}: the drain of QP B ended");
        assert_eq!(drained.lock().unwrap().take(), Some(Ok(())), "{mode:?}: the drain of QP B");
        assert!(got.lock().unwrap().is_empty(), "{mode:?}: the markers are the loop's");
        // A message to QP A, on the same CQ.
        const RECV: u64 = 7;
        pair.recv(0, SLOT as u32, RECV);
        pair.send(0, b"after the drain", 16, 1);
        let delivered = drive_embedded(&lp, || got.lock().unwrap().contains(&RECV));
        let s = lp.stats();
        println!(
            "{mode:?}: delivered {delivered}; {} CQ events, {} wakeups, next_timeout {:?}",
            s.cq_events,
            s.wakeups,
            lp.next_timeout()
        );
        assert!(delivered, "{mode:?}: the message after the drain never came (the fd stayed unreadable)");
    }
}
