//! The device goes away under live safe-Rust objects, and everything is
//! dropped in safe code afterwards, under valgrind: no invalid read.
//!
//! Why it matters: since rdma-core v30 librdmacm closes a removed device's
//! context once the last reference it counts is released (after
//! DEVICE_REMOVAL, on the next `rdma_get_devices` or a lookup miss). If the
//! PD, CQs, MRs or the async event reader did not hold a reference of their
//! own, dropping the ids first would close the context under them and
//! their destroys would read freed memory.
//!
//! The scenario (guest only: it deletes rxe0): a listener, a connected RC
//! pair with QPs, CQs on a completion channel, registered MRs, a posted
//! receive, and an `AsyncEvents` thread, with a second device rxe1 present;
//! `rdma link delete rxe0` in the background; DEVICE_REMOVAL on all three
//! ids; `cm::devices()` (librdmacm notices the removal, marks rxe0 dead and
//! from now on closes its context with the last reference); then everything is
//! dropped, ids first, in safe code, but for a control of a CQ loop on
//! the client's channel, kept past the loop (it kept the device open: the
//! delete never completed). Checked: the async thread ends with
//! Ok (rxe cannot disassociate, so it reports no DEVICE_FATAL: the thread
//! is stopped; on hardware it ends by itself after DEVICE_FATAL); `rdma
//! link delete`, which
//! only completes once no process has the device open, completes while
//! this process still runs (so every reference was released); valgrind
//! reports no error (invalid reads/writes, uninitialised values).
//!
//! The outer test runs the same binary under valgrind with
//! RDMASAFE_REMOVAL_SCENARIO=1, which runs the scenario itself.

mod common;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cm::{expect, listen, params, resolved};
use rdmasafe_core::cm::{self, EventType as E, PortSpace, QpCaps};
use rdmasafe_core::cq::{AsyncEventType, AsyncEvents, CqLoop, LoopOptions};
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd};

const INNER: &str = "RDMASAFE_REMOVAL_SCENARIO";

#[test]
fn device_removal_then_safe_drops_under_valgrind() {
    let bed = common::bed();
    assert!(bed.in_guest, "rxe_destructive_* tests delete the device: guest only");
    if std::env::var_os(INNER).is_some() {
        scenario(bed.addr);
        return;
    }
    let _dog = common::watchdog("device removal under valgrind", Duration::from_secs(600));
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("valgrind")
        .args(["--error-exitcode=99", "--leak-check=no", "--track-origins=no", "-q"])
        .arg(&exe)
        .args(["--exact", "device_removal_then_safe_drops_under_valgrind", "--nocapture", "--test-threads=1"])
        .env(INNER, "1")
        .stdin(Stdio::null())
        .output()
        .expect("run valgrind (apt-get install valgrind)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(stdout.contains("scenario: done"), "the scenario ran to its end under valgrind");
    assert!(!stderr.contains("Invalid read") && !stderr.contains("Invalid write"), "valgrind: invalid access");
    assert_eq!(out.status.code(), Some(0), "valgrind found errors (exit 99) or the scenario failed");
}

fn run(cmd: &str) {
    let st = Command::new("sh").args(["-c", cmd]).status().expect("run sh");
    assert!(st.success(), "{cmd}: {st}");
}

fn scenario(addr: std::net::IpAddr) {
    // A second device, so librdmacm still finds devices after rxe0 goes:
    // with none left, rdma_get_devices fails (ENODEV) before it compares
    // its list, never marks rxe0 dead, and keeps its context open until the
    // process exits -- the harmless case. With rxe1 it marks rxe0 dead and
    // closes the context as soon as the last reference goes: the case
    // where verbs objects outliving their ids would touch a closed context.
    run("ip link add rsdummy1 type dummy && ip link set rsdummy1 up && ip addr add 10.79.0.1/24 dev rsdummy1 \
         && rdma link add rxe1 type rxe netdev rsdummy1");
    let l = listen(addr, PortSpace::Tcp, 4);
    let cch = cm::EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, addr, l.port);
    let ctx = client.device_context().unwrap();
    let comp = CompChannel::new(&ctx).unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let ccq = Cq::new(&ctx, 16, Some(&comp)).unwrap();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };
    client.create_qp(&pd, &ccq, &ccq, caps, false).unwrap();
    let cmr = Mr::new(&pd, 4096).unwrap();
    client.post_recv(&cmr, 0, 64, 1).unwrap();
    client.connect(&params(b"hi")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    let sctx = r.id_mut().device_context().unwrap();
    let spd = Pd::new(&sctx).unwrap();
    let scq = Cq::new(&sctx, 16, None).unwrap();
    r.id_mut().create_qp(&spd, &scq, &scq, caps, false).unwrap();
    let smr = Mr::new(&spd, 4096).unwrap();
    r.id_mut().post_recv(&smr, 0, 64, 2).unwrap();
    let server = r.accept(&params(b"ok")).unwrap();
    expect(&cch, E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    drop(req);
    // A CQ loop on the client's channel, and a control of it that the app
    // keeps past the loop (in a connection's struct, another loop's
    // handler): it must not keep the device open once the loop is dropped.
    let lp = CqLoop::new(&comp, LoopOptions::default()).unwrap();
    lp.add_cq(&ccq, |_, _| {}).unwrap();
    let ctl = lp.control();
    let seen: Arc<Mutex<Vec<AsyncEventType>>> = Arc::default();
    let s2 = seen.clone();
    let async_thread = AsyncEvents::new(&ctx).spawn(move |ev| s2.lock().unwrap().push(ev.event_type)).unwrap();
    println!("scenario: connected; deleting rxe0");

    let mut delete = Command::new("rdma").args(["link", "delete", "rxe0"]).spawn().expect("run rdma link delete");
    let mut removals = 0;
    let t0 = Instant::now();
    while removals < 3 {
        for ch in [&l.ch, &cch] {
            if let Some(ev) = ch.try_get().unwrap() {
                println!("scenario: {} (status {}) after {:?}", ev.event_type(), ev.status(), t0.elapsed());
                if ev.event_type() == E::DEVICE_REMOVAL {
                    removals += 1;
                }
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "DEVICE_REMOVAL on every id ({removals} of 3)");
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = cm::devices().expect("rdma_get_devices (rxe1 is left)");
    println!("scenario: librdmacm lists {left:?} after the removal");
    assert!(left.iter().any(|d| d == "rxe1"), "librdmacm lists the other device");
    assert!(!left.iter().any(|d| d == "rxe0"), "librdmacm marked the removed device dead");

    // Ids first (the context must survive them), then everything else.
    drop(client);
    drop(server);
    drop(l);
    drop(lp);
    drop((ccq, scq, cmr, smr, pd, spd, comp, ctx, sctx));
    let r = async_thread.stop();
    println!("scenario: async events seen {:?}, thread ended with {r:?}", seen.lock().unwrap());
    // rxe has no disassociate support: the kernel reports nothing on the
    // async fd and waits for the process to close the device instead (on
    // hardware that disassociates, DEVICE_FATAL comes and the thread ends
    // by itself). Either way the reader ends cleanly, with its context open
    // until it is gone.
    assert!(r.is_ok(), "the async event thread ends cleanly after the removal: {r:?}");
    assert!(
        seen.lock().unwrap().iter().all(|t| *t == AsyncEventType::DEVICE_FATAL || *t == AsyncEventType::PORT_ERR),
        "only removal events reached the async reader"
    );
    drop(cch);

    // The delete completes only when no process has the device open.
    println!("scenario: device files still open: {:?}", device_fds());
    let t1 = Instant::now();
    let st = loop {
        if let Some(st) = delete.try_wait().unwrap() {
            break st;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(120),
            "rdma link delete still waits: the device is still open ({:?})",
            device_fds()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("scenario: rdma link delete finished ({st}) {:?} after the last drop", t1.elapsed());
    assert!(st.success(), "rdma link delete: {st}");
    // The control outlived all of it, and answers that the loop is gone.
    assert!(!ctl.is_running(), "the loop was dropped");
    drop(ctl);
    println!("scenario: done");
}

/// This process's open /dev/infiniband files (for the failure message).
fn device_fds() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|p| p.starts_with("/dev/infiniband"))
        .collect()
}
