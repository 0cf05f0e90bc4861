//! A keepalive that declares a peer dead moves the QP to the error state,
//! and the QP's outstanding sends flush. On a send CQ armed solicited-only
//! rxe raises no event for that flush (see `CqOptions::solicited_only`):
//! the loop drains the QP itself (a marker it polls for), so the flushed
//! send reaches the handler without the app doing anything; a drain the app
//! starts after that still finishes, and delivers nothing twice. The peer
//! is made "dead" by holding the keepalive's probes back (they never
//! complete): the test puts a wrapper in the device context's verbs table
//! (`ibv_context.ops.post_send`), so this binary must keep one test (the
//! table is the process's).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::rc::rc_pair;
use rdmasafe_core::cm::{EventChannel, PortSpace};
use rdmasafe_core::cq::{CqLoop, CqOptions, Keepalive, LoopOptions, Mode};
use rdmasafe_core::sys::{ibv_qp, ibv_send_wr};
use rdmasafe_core::verbs::{CompChannel, WcStatus};

const PROBE_WR_ID: u64 = 9999;
const APP_WR_ID: u64 = 42;

type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> i32;
static REAL: OnceLock<PostSend> = OnceLock::new();
/// Probes held back (never posted).
static HELD: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> i32 {
    // SAFETY: the caller's WR, valid for the call.
    if unsafe { (*wr).wr_id } == PROBE_WR_ID {
        HELD.fetch_add(1, SeqCst);
        return 0;
    }
    // SAFETY: the provider's own function, with the caller's arguments.
    unsafe { (REAL.get().unwrap())(qp, wr, bad) }
}

#[test]
fn a_dead_peers_flushed_send_on_a_solicited_only_cq_reaches_the_handler() {
    let bed = common::bed();
    let _dog = common::watchdog("dead peer, solicited-only send CQ", Duration::from_secs(180));
    for mode in [Mode::Event, Mode::Adaptive { spin: Duration::from_micros(50) }] {
        let ch = EventChannel::new().unwrap();
        let id = ch.create_id(PortSpace::Tcp).unwrap();
        id.bind_addr((bed.addr, 0).into()).unwrap();
        let ctx = id.device_context().unwrap();
        // SAFETY: the context lives for the test; its table is written
        // before any loop runs, and this is the binary's only test (no
        // other thread uses the context meanwhile); the wrapper calls the
        // function that was there (the provider's: the same in every
        // context).
        unsafe {
            let ops = &mut (*ctx.raw()).ops;
            if ops.post_send.map(|f| f as usize) != Some(post_send as PostSend as usize) {
                REAL.get_or_init(|| ops.post_send.unwrap());
                ops.post_send = Some(post_send);
            }
        }
        let chan = CompChannel::new(&ctx).unwrap();
        let p = Arc::new(rc_pair(bed.addr, &chan, false, 16));
        let lp = Arc::new(CqLoop::new(&chan, LoopOptions { mode, ..Default::default() }).unwrap());
        let got: Arc<Mutex<Vec<(u64, WcStatus)>>> = Arc::default();
        let g = got.clone();
        lp.add_cq_with(&p.server_cq, CqOptions { solicited_only: true, budget: 0 }, move |wcs, _| {
            g.lock().unwrap().extend(wcs.iter().map(|w| (w.wr_id(), w.status())));
        })
        .unwrap();
        // A send the client never takes (no receive posted there: RNR,
        // retried for as long as the QP lives).
        {
            let s = p.server.lock().unwrap();
            s.id.post_send(&s.mr, 0, 8, APP_WR_ID).unwrap();
        }
        let dead = Arc::new(AtomicUsize::new(0));
        let d = dead.clone();
        let cfg =
            Keepalive { period: Duration::from_millis(100), bound: Duration::from_millis(200), wr_id: PROBE_WR_ID };
        // SAFETY: the QP lives (in `p`) longer than the loop.
        unsafe { lp.add_keepalive(p.server_qp(), cfg, Box::new(move |_, _| _ = d.fetch_add(1, SeqCst))) }.unwrap();
        let runner = {
            let lp = lp.clone();
            std::thread::spawn(move || lp.run())
        };
        while dead.load(SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(HELD.load(SeqCst) >= 1, "{mode:?}: the probe was held back");
        // The flush, with nothing but the loop running (a bound that turns
        // "never" into a failure; on rxe it comes within milliseconds).
        let t0 = Instant::now();
        while got.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let before_drain = got.lock().unwrap().clone();
        // A drain by the app afterwards (the QP is in the error state
        // already), while the loop runs on its thread.
        // SAFETY: the QP lives (in `p`) until the drain is done; a free
        // slot on each queue (16 deep, one send outstanding).
        let drained = unsafe { lp.control().drain_qp(p.server_qp(), false, Duration::from_secs(30)) };
        let got_now = got.lock().unwrap().clone();
        lp.control().stop();
        runner.join().unwrap().unwrap();
        println!(
            "{mode:?}: on_dead {} time(s); the handler got {before_drain:?} before the app's drain, \
             {got_now:?} after it; drain {drained:?}",
            dead.load(SeqCst)
        );
        assert_eq!(dead.load(SeqCst), 1, "{mode:?}: on_dead once");
        assert_eq!(
            before_drain,
            [(APP_WR_ID, WcStatus::WR_FLUSH_ERR)],
            "{mode:?}: the flushed send, with no drain by the app"
        );
        drained.unwrap();
        assert_eq!(got_now, before_drain, "{mode:?}: the app's drain delivers nothing twice");
    }
}
