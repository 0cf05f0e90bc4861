//! Dead-peer detection by the CQ loop's keepalive. The peer is a stock
//! `rping -s` process; our idle client connection uses retry_count 7, which
//! on rxe means "retry forever": without the keepalive a dead peer would
//! never be reported through the QP. The keepalive's probes succeed while
//! the peer lives (nothing is declared dead meanwhile); after the peer is
//! SIGKILLed the keepalive declares it dead (once its probe has gone
//! unanswered for its bound; how much later the loop runs is the
//! machine's load, so the time is reported, not asserted), moves the QP to
//! error, and outstanding work flushes to the handler.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cm::{expect, params, resolved};
use rdmasafe_core::cm::{ConnectParams, EventChannel, EventType as E, PortSpace, QpCaps};
use rdmasafe_core::cq::{CqLoop, Keepalive, LoopOptions};
use rdmasafe_core::verbs::WcStatus;
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd};

fn wait_listen(port: u16) {
    let start = Instant::now();
    loop {
        let out = Command::new("rdma").args(["res", "show", "cm_id"]).output().expect("rdma tool");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.lines().any(|l| l.contains("LISTEN") && l.contains(&format!(":{port} "))) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rping never listened:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn keepalive_detects_a_killed_idle_peer_with_infinite_retries() {
    let bed = common::bed();
    let _dog = common::watchdog("keepalive", Duration::from_secs(240));
    let port = 20000 + (std::process::id() % 10000) as u16;
    let mut rping = Killed(
        Command::new("rping")
            .args(["-s", "-a", &bed.addr.to_string(), "-p", &port.to_string(), "-C", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rping -s"),
    );
    wait_listen(port);

    let ch = EventChannel::new().unwrap();
    let mut id = resolved(&ch, PortSpace::Tcp, bed.addr, port);
    let ctx = id.device_context().unwrap();
    let chan = CompChannel::new(&ctx).unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 16, Some(&chan)).unwrap();
    let mr = Mr::new(&pd, 64).unwrap();
    id.create_qp(&pd, &cq, &cq, QpCaps { max_send_wr: 8, max_recv_wr: 8, ..Default::default() }, false).unwrap();
    // rping's server needs a receive credit from us only after we send; we
    // stay idle. One receive of ours stays outstanding (it must flush).
    id.post_recv(&mr, 0, 64, 0x77).unwrap();
    id.connect(&ConnectParams { retry_count: 7, ..params(b"") }).unwrap();
    expect(&ch, E::ESTABLISHED);

    let lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let seen: Arc<Mutex<Vec<(u64, WcStatus)>>> = Arc::default();
    let s2 = seen.clone();
    lp.add_cq(&cq, move |w, _| s2.lock().unwrap().extend(w.iter().map(|w| (w.wr_id(), w.status())))).unwrap();
    let dead_qpn = Arc::new(AtomicU32::new(0));
    let d2 = dead_qpn.clone();
    let cfg = Keepalive { period: Duration::from_millis(200), bound: Duration::from_secs(5), wr_id: u64::MAX - 7 };
    let qp = id.raw_qp().unwrap();
    let qpn = id.qp_num().unwrap();
    // SAFETY: the QP lives (owned by `id`) until after the loop is dropped.
    unsafe { lp.add_keepalive(qp, cfg, Box::new(move |n, _| d2.store(n, SeqCst))) }.unwrap();
    let ctl = lp.control();
    let t = lp.spawn(None).unwrap();

    // Alive: probes complete, nothing reaches the handler.
    let start = Instant::now();
    while ctl.stats().keepalive_probes_ok < 3 {
        assert!(start.elapsed() < Duration::from_secs(60), "probes to a live peer complete: {:?}", ctl.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ctl.stats().keepalive_dead, 0);
    assert!(seen.lock().unwrap().is_empty(), "probe completions are not handed to the app");

    // Kill the peer process; the connection is idle. Until now the peer
    // answered every probe: nothing was declared dead.
    assert_eq!(dead_qpn.load(SeqCst), 0, "no peer declared dead while it answered: {:?}", ctl.stats());
    let killed_at = Instant::now();
    rping.0.kill().unwrap();
    let _ = rping.0.wait();
    while dead_qpn.load(SeqCst) == 0 {
        assert!(killed_at.elapsed() < Duration::from_secs(120), "keepalive never fired: {:?}", ctl.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    let detected = killed_at.elapsed();
    // The loop keeps running: the flushes of the QP now in error arrive.
    while !seen.lock().unwrap().contains(&(0x77, WcStatus::WR_FLUSH_ERR)) {
        assert!(killed_at.elapsed() < Duration::from_secs(120), "no flush after the QP went to error");
        std::thread::sleep(Duration::from_millis(10));
    }
    let lp = t.stop().unwrap();
    let s = lp.stats();
    println!(
        "peer killed; declared dead after {detected:?} (period 200 ms, bound 5 s); probes {} ok {}; delivered {:?}",
        s.keepalive_probes,
        s.keepalive_probes_ok,
        seen.lock().unwrap()
    );
    assert_eq!(dead_qpn.load(SeqCst), qpn, "the dead QP is named");
    // How soon after period + bound the loop got to run is the machine's
    // load: `detected` is reported, the 120 s limit above turns a keepalive
    // that never fires into a failure.
    assert!(
        seen.lock().unwrap().contains(&(0x77, WcStatus::WR_FLUSH_ERR)),
        "the outstanding receive flushed to the handler"
    );
    assert_eq!(s.keepalive_dead, 1);
    drop(lp);
}
