//! Races of the CQ loop whose window is too short to hit by chance, made
//! certain on Soft-RoCE: the test puts its own functions in the device
//! context's verbs table (`ibv_context.ops`, through which libibverbs
//! calls the provider's `post_send`, `req_notify_cq` and `poll_cq`), so a
//! completion lands at the one moment the race needs. The kernel, the
//! provider and the hardware path are the real ones; only the order of
//! events is forced. Its own binary: the table is the process's (other
//! tests' loops on the same device would go through it).

mod common;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::rc::{rc_pair, second_qp_on, SLOT};
use rdmasafe_core::cm::{EventChannel, PortSpace};
use rdmasafe_core::cq::{CqLoop, Keepalive, LoopOptions, Mode};
use rdmasafe_core::sys::{ibv_cq, ibv_qp, ibv_send_wr, ibv_wc};
use rdmasafe_core::verbs::{empty_wc, CompChannel, Wc, WcStatus};

const PROBE_WR_ID: u64 = 9999;

type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> i32;
type Notify = unsafe extern "C" fn(*mut ibv_cq, i32) -> i32;
type Poll = unsafe extern "C" fn(*mut ibv_cq, i32, *mut ibv_wc) -> i32;

/// The provider's functions, as the table had them.
static REAL: OnceLock<(PostSend, Notify, Poll)> = OnceLock::new();
/// The server's two QPs and their one CQ (addresses); everything else
/// passes through.
static QPS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
static CQ: AtomicUsize = AtomicUsize::new(0);
/// The comp channel's fd, to see the CQ's event queued.
static CHAN_FD: AtomicUsize = AtomicUsize::new(0);
/// What the wrappers do next (see [`Step`]).
static STEP: AtomicU32 = AtomicU32::new(Step::Off as u32);
/// Which QPs' probes are held back (bits).
static HELD: AtomicU32 = AtomicU32::new(0);
/// A probe's completion, taken from the CQ to be handed to the loop.
static KEPT: Mutex<Option<Wc>> = Mutex::new(None);
/// Sleeps the loop began, and their count when the last completion was
/// handed back.
static SLEEPS: AtomicU64 = AtomicU64::new(0);
static SLEEPS_AT_HANDBACK: AtomicU64 = AtomicU64::new(u64::MAX);
/// Set (with a reason) if a wrapper saw what the test did not plan for.
static UNPLANNED: Mutex<Option<String>> = Mutex::new(None);
/// The loop's control, its `cq_events` when the CQ was last armed, and
/// the first sleep seen with the CQ unarmed: an event read since its last
/// arm (the loop's only CQ: every event is its), none pending.
static CTL: Mutex<Option<rdmasafe_core::cq::LoopControl>> = Mutex::new(None);
static EVENTS_AT_ARM: AtomicU64 = AtomicU64::new(u64::MAX);
static UNARMED_SLEEP: Mutex<Option<String>> = Mutex::new(None);
fn cq_events() -> u64 {
    CTL.lock().unwrap().as_ref().unwrap().stats().cq_events
}

/// Gives up (the test then fails naming `what`) after this long in one of
/// the wrappers' waits.
const STEP_LIMIT: Duration = Duration::from_secs(60);

#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Debug)]
enum Step {
    Off,
    /// Keep the loop's next probe on each QP back (not posted).
    HoldProbes,
    /// Both are held. At the loop's next arm of the CQ: before the arm,
    /// post probe 0 and take its completion (it raises no event: the CQ is
    /// not armed yet).
    BeforeArm,
    /// Hand probe 0's completion to the loop's next poll of the CQ (its
    /// drain after the arm: the CQ's budget of 1, so the CQ goes on the
    /// ready list).
    HandBack0,
    /// At the loop's next poll of the CQ (the ready list's drain, after
    /// the cycle's fairness read): post probe 1, take its completion (the
    /// CQ is armed: it raises an event), wait until the event is in the
    /// channel, and hand the completion over.
    Probe1,
    Done,
}

fn step() -> Step {
    [Step::Off, Step::HoldProbes, Step::BeforeArm, Step::HandBack0, Step::Probe1]
        .get(STEP.load(SeqCst) as usize)
        .copied()
        .unwrap_or(Step::Done)
}

fn set_step(s: Step) {
    STEP.store(s as u32, SeqCst);
}

fn unplanned(what: String) {
    UNPLANNED.lock().unwrap().get_or_insert(what);
    set_step(Step::Done);
}

unsafe extern "C" fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> i32 {
    // SAFETY: the caller's WR, valid for the call.
    let probe = unsafe { (*wr).wr_id } == PROBE_WR_ID;
    if let (true, Step::HoldProbes, Some(k)) = (probe, step(), QPS.iter().position(|q| q.load(SeqCst) == qp as usize)) {
        if HELD.fetch_or(1 << k, SeqCst) | (1 << k) == 3 {
            set_step(Step::BeforeArm);
        }
        return 0;
    }
    // SAFETY: the provider's own function, with the caller's arguments.
    unsafe { (REAL.get().unwrap().0)(qp, wr, bad) }
}

/// Posts QP `k`'s held probe (a signaled zero-length RDMA WRITE, as the
/// loop does) and takes its completion from the CQ.
fn post_and_take(k: usize, cq: *mut ibv_cq) -> Option<Wc> {
    let real = REAL.get().unwrap();
    // SAFETY: the server's QPs live for the test; a WR without buffers.
    let posted = unsafe {
        let mut wr: ibv_send_wr = std::mem::zeroed();
        wr.wr_id = PROBE_WR_ID;
        wr.opcode = rdmasafe_core::sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = rdmasafe_core::sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        (real.0)(QPS[k].load(SeqCst) as *mut ibv_qp, &mut wr, &mut bad)
    };
    if posted != 0 {
        unplanned(format!("posting probe {k} failed: {posted}"));
        return None;
    }
    let mut wc = empty_wc();
    let t0 = Instant::now();
    loop {
        if t0.elapsed() > STEP_LIMIT {
            unplanned(format!("probe {k}'s completion did not come"));
            return None;
        }
        // SAFETY: one ibv_wc to fill (Wc is repr(transparent) over it).
        match unsafe { (real.2)(cq, 1, (&mut wc as *mut Wc).cast()) } {
            1 => break,
            0 => std::thread::yield_now(),
            n => {
                unplanned(format!("poll_cq: {n}"));
                return None;
            }
        }
    }
    if wc.wr_id() != PROBE_WR_ID || wc.status() != WcStatus::SUCCESS {
        unplanned(format!("not probe {k}'s completion: wr_id {} status {:?}", wc.wr_id(), wc.status()));
        return None;
    }
    Some(wc)
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited: i32) -> i32 {
    if cq as usize == CQ.load(SeqCst) && step() == Step::BeforeArm {
        if let Some(wc) = post_and_take(0, cq) {
            *KEPT.lock().unwrap() = Some(wc);
            set_step(Step::HandBack0);
        }
    }
    // SAFETY: the provider's own function, with the caller's arguments.
    let r = unsafe { (REAL.get().unwrap().1)(cq, solicited) };
    if r == 0 && cq as usize == CQ.load(SeqCst) {
        EVENTS_AT_ARM.store(cq_events(), SeqCst);
    }
    r
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: i32, wcs: *mut ibv_wc) -> i32 {
    if n >= 1 && cq as usize == CQ.load(SeqCst) {
        let wc = match step() {
            Step::HandBack0 => {
                set_step(Step::Probe1);
                KEPT.lock().unwrap().take()
            }
            Step::Probe1 => {
                let wc = post_and_take(1, cq);
                if wc.is_some() {
                    // Its event is on its way to the channel: wait until it
                    // is there (without reading it: it is the loop's), so
                    // the loop's next read finds it.
                    let mut pfd = libc::pollfd { fd: CHAN_FD.load(SeqCst) as i32, events: libc::POLLIN, revents: 0 };
                    let t0 = Instant::now();
                    // SAFETY: one pollfd, alive for the call.
                    while unsafe { libc::poll(&mut pfd, 1, 10) } != 1 {
                        if t0.elapsed() > STEP_LIMIT {
                            unplanned("probe 1's event did not reach the channel".into());
                            break;
                        }
                    }
                    SLEEPS_AT_HANDBACK.store(SLEEPS.load(SeqCst), SeqCst);
                    set_step(Step::Done);
                }
                wc
            }
            _ => None,
        };
        if let Some(wc) = wc {
            // SAFETY: the caller's array has room for n >= 1; Wc is
            // repr(transparent) over ibv_wc.
            unsafe { wcs.cast::<Wc>().write(wc) };
            return 1;
        }
    }
    // SAFETY: the provider's own function, with the caller's arguments.
    unsafe { (REAL.get().unwrap().2)(cq, n, wcs) }
}

/// Adaptive mode, a CQ with a budget of 1 and two QPs with a keepalive.
/// The loop arms the CQ and its drain takes one probe's completion (the
/// loop's own: no spin starts), which fills its budget: the CQ goes on the
/// ready list. The cycle's fairness read finds nothing; then the second
/// probe's completion lands (raising an event: the CQ is armed) and the
/// ready list's drain takes it. So the next cycle's fairness read takes an
/// event for completions already taken, which leaves the CQ unarmed
/// (non-event modes do not re-arm what fired: they poll it), both drains
/// find nothing, and the loop slept at once: with the CQ unarmed, a
/// message that came then raised no event and waited for the next
/// keepalive timer (with no timer, for whatever woke the loop next). Now
/// every CQ is armed and drained once more before such a sleep: the
/// message comes with its event. The learning mode takes the same path,
/// but its sleep there may carry a timer of its own (a calibration of the
/// wake-up) that ends it and re-arms the CQ before the message lands, so
/// the message alone shows the fault only sometimes there; the before-
/// sleep hook checks the state itself: no sleep may begin with an event
/// read for the CQ since its last arm and none pending.
#[test]
fn a_fairness_read_of_an_event_for_completions_already_taken_leaves_no_cq_unarmed_in_a_sleep() {
    let bed = common::bed();
    let _dog = common::watchdog("fairness read + unarmed CQ", Duration::from_secs(240));
    for mode in [Mode::Adaptive { spin: Duration::from_micros(50) }, Mode::Learning] {
        fairness_read_case(bed.addr, mode);
    }
}

/// Puts the wrappers in `ctx`'s table (once per context).
fn install(ctx: &rdmasafe_core::verbs::DeviceContext) {
    // SAFETY: the context lives for the test; its table is written before
    // the loop runs and while no other thread uses the context (this must
    // stay the binary's only test: a second one running beside it would
    // make these writes a data race with its verbs calls), and the
    // wrappers call the functions that were there (the provider's: the
    // same in every context).
    unsafe {
        let ops = &mut (*ctx.raw()).ops;
        if ops.post_send.map(|f| f as usize) == Some(post_send as PostSend as usize) {
            return;
        }
        let real = (ops.post_send.unwrap(), ops.req_notify_cq.unwrap(), ops.poll_cq.unwrap());
        let had = REAL.get_or_init(|| real);
        let same =
            (had.0 as usize, had.1 as usize, had.2 as usize) == (real.0 as usize, real.1 as usize, real.2 as usize);
        assert!(same, "one provider");
        ops.post_send = Some(post_send);
        ops.req_notify_cq = Some(req_notify_cq);
        ops.poll_cq = Some(poll_cq);
    }
}

fn fairness_read_case(addr: std::net::IpAddr, mode: Mode) {
    set_step(Step::Off);
    HELD.store(0, SeqCst);
    *KEPT.lock().unwrap() = None;
    SLEEPS.store(0, SeqCst);
    SLEEPS_AT_HANDBACK.store(u64::MAX, SeqCst);
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((addr, 0).into()).unwrap();
    let ctx = id.device_context().unwrap();
    let chan = CompChannel::new(&ctx).unwrap();
    let p = Arc::new(rc_pair(addr, &chan, false, 8));
    let (_second, qp2) = second_qp_on(addr, &p.server_cq);
    let opts = LoopOptions { mode, ..Default::default() };
    let lp = Arc::new(CqLoop::new(&chan, opts).unwrap());

    // Each message's cq_events when its handler ran.
    let got: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    for k in 0..4u64 {
        p.recv(k as usize * SLOT, SLOT as u32, k);
    }
    let mut cq_opts = lp.default_cq_options();
    cq_opts.budget = 1;
    let (g, pp) = (got.clone(), p.clone());
    lp.add_cq_with(&p.server_cq, cq_opts, move |wcs, ctl| {
        for wc in wcs {
            assert_eq!(wc.status(), WcStatus::SUCCESS);
            g.lock().unwrap().push((wc.wr_id(), ctl.stats().cq_events));
            pp.recv((wc.wr_id() % 4) as usize * SLOT, SLOT as u32, wc.wr_id() + 4);
        }
    })
    .unwrap();
    *CTL.lock().unwrap() = Some(lp.control());
    EVENTS_AT_ARM.store(u64::MAX, SeqCst);
    *UNARMED_SLEEP.lock().unwrap() = None;
    let chan_fd = chan.as_raw_fd();
    lp.set_before_sleep_hook(Some(Box::new(move || {
        let k = SLEEPS.fetch_add(1, SeqCst);
        let (ev, at) = (cq_events(), EVENTS_AT_ARM.load(SeqCst));
        let mut pfd = libc::pollfd { fd: chan_fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, alive for the call.
        let pending = unsafe { libc::poll(&mut pfd, 1, 0) } > 0;
        if at != u64::MAX && ev > at && !pending {
            UNARMED_SLEEP
                .lock()
                .unwrap()
                .get_or_insert(format!("sleep {k}: {ev} events read, {at} when last armed, none pending"));
        }
    })));

    // The wrappers, for the server's QPs and CQ only.
    let qps = [p.server_qp(), qp2];
    for (slot, qp) in QPS.iter().zip(qps) {
        slot.store(qp.as_ptr() as usize, SeqCst);
    }
    CQ.store(p.server_cq.raw() as usize, SeqCst);
    CHAN_FD.store(chan.as_raw_fd() as usize, SeqCst);
    install(&ctx);
    set_step(Step::HoldProbes);
    for qp in qps {
        let cfg = Keepalive { period: Duration::from_secs(3), bound: Duration::from_secs(60), wr_id: PROBE_WR_ID };
        // SAFETY: the QPs live (in `p` and `_second`) longer than the loop.
        unsafe { lp.add_keepalive(qp, cfg, Box::new(|_, _| {})) }.unwrap();
    }
    let runner = {
        let lp = lp.clone();
        std::thread::spawn(move || lp.run())
    };

    let send = |seq: u64| {
        p.send((seq % 4) as usize * SLOT, &seq.to_le_bytes(), 8, seq);
        let mut wcs = [empty_wc()];
        while p.client_cq.poll(&mut wcs).unwrap() == 0 {
            std::thread::yield_now();
        }
        assert_eq!(wcs[0].status(), WcStatus::SUCCESS, "send {seq}");
    };
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        while !done() {
            if let Some(u) = UNPLANNED.lock().unwrap().clone() {
                panic!("{what}: {u}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };

    // 1. The loop's first probes are held back (about one period).
    wait_for("the first probes", &|| step() == Step::BeforeArm);
    // 2. A message: the loop polls after it (the spin), then arms the CQ
    //    to sleep: the wrappers play the probes' completions as above.
    send(0);
    wait_for("the second probe", &|| step() == Step::Done);
    // 3. The loop has taken both probes and gone to sleep.
    wait_for("a sleep after them", &|| SLEEPS.load(SeqCst) > SLEEPS_AT_HANDBACK.load(SeqCst));
    let events = lp.stats().cq_events;
    // Message 0's event and the second probe's (read by the fairness read).
    assert_eq!(events, 2, "{mode:?}: the events before message 1");
    // 4. A message while it sleeps.
    send(1);
    wait_for("message 1", &|| got.lock().unwrap().len() == 2);
    lp.control().stop();
    runner.join().unwrap().unwrap();
    let got = got.lock().unwrap().clone();
    let s = lp.stats();
    println!(
        "{mode:?}: messages (wr_id, cq_events at delivery) {got:?}; cq_events before message 1: {events}; \
         keepalive probes ok: {}",
        s.keepalive_probes_ok
    );
    let unarmed = UNARMED_SLEEP.lock().unwrap().clone();
    println!("{mode:?}: unarmed sleep: {unarmed:?}");
    assert!(unarmed.is_none(), "{mode:?}: slept with its CQ unarmed: {unarmed:?}");
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1]);
    assert!(s.keepalive_probes_ok >= 2, "{mode:?}: both probes were taken as the loop's own");
    assert!(
        got[1].1 > events,
        "{mode:?}: message 1 was delivered without a CQ event ({} events when it was delivered, {events} before it was \
         sent): its CQ slept unarmed",
        got[1].1
    );
}
