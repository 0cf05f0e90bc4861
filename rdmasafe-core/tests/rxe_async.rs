//! The tokio feature on Soft-RoCE: the async echo server of
//! examples/rxe_async_echo.rs with 64 clients on a current-thread and on a
//! multi-thread runtime (every completion exactly once, nothing unacked,
//! no CM copy outstanding), and futures dropped mid-flight (a pending
//! `next()`, the loop's `run()`, a pending drain, a spawned loop aborted)
//! followed by a teardown that neither hangs nor leaks; tasks sharing one
//! channel, each woken; a loop spawned from a thread outside a
//! multi-thread runtime keeps its handlers on the runtime; events moved
//! in by `CmId::migrate` (which the kernel does not signal) are got.

mod common;

#[allow(dead_code)]
#[path = "../examples/rxe_async_echo.rs"]
mod echo;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::rc::{rc_pair, SLOT};
use rdmasafe_core::aio::{self, AsyncCqLoop, AsyncEventChannel};
use rdmasafe_core::cm::{self, EventChannel, EventType, PortSpace};
use rdmasafe_core::cq::{CqLoop, Keepalive, LoopOptions, LoopStats, DRAIN_RECV_WR_ID, DRAIN_SEND_WR_ID};
use rdmasafe_core::verbs::{CompChannel, WcStatus};
use rdmasafe_core::Wait;
use tokio::sync::mpsc::unbounded_channel;

const CLIENTS: usize = 64;

/// Polls a future once with a waker that does nothing.
fn futures_poll_once<F: std::future::Future + ?Sized>(f: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    f.poll(&mut cx)
}

/// The CM copy counters are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// A current-thread runtime with IO and time.
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn run_echo(rt: tokio::runtime::Runtime, what: &str) {
    let bed = common::bed();
    let t0 = Instant::now();
    let report = rt.block_on(echo::echo(bed.addr, CLIENTS)).unwrap_or_else(|e| panic!("{what}: {e}"));
    drop(rt);
    echo::check(&report, CLIENTS).unwrap_or_else(|e| panic!("{what}: {e}"));
    let copies = cm::counters();
    let total: u32 = report.completions.values().sum();
    println!(
        "{what}: {CLIENTS} clients, {total} completions each exactly once; server loop {} completions, {} CQ events, \
         {} wakeups, {} ack calls, {} unacked; client loop {} completions, {} CQ events, {} wakeups, {} ack calls, \
         {} unacked; CM copies: {} made, {} outstanding; {:.2?}",
        report.server_loop.completions,
        report.server_loop.cq_events,
        report.server_loop.wakeups,
        report.server_loop.ack_calls,
        report.server_loop.unacked_now,
        report.client_loop.completions,
        report.client_loop.cq_events,
        report.client_loop.wakeups,
        report.client_loop.ack_calls,
        report.client_loop.unacked_now,
        copies.copied,
        copies.outstanding,
        t0.elapsed()
    );
    assert_eq!(total as usize, 4 * CLIENTS);
    assert_eq!(copies.outstanding, 0, "every CM event copy was freed");
}

#[test]
fn echo_64_clients_on_a_current_thread_runtime() {
    let _s = serial();
    let _dog = common::watchdog("async echo, current-thread", Duration::from_secs(300));
    let rt = current_thread();
    run_echo(rt, "current-thread");
}

#[test]
fn echo_64_clients_on_a_multi_thread_runtime() {
    let _s = serial();
    let _dog = common::watchdog("async echo, multi-thread", Duration::from_secs(300));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(3).enable_all().build().unwrap();
    run_echo(rt, "multi-thread");
}

/// Outside a runtime the constructors fail (EINVAL), never panic.
#[test]
fn outside_a_runtime_registration_fails_cleanly() {
    let _s = serial();
    let err = AsyncEventChannel::new(EventChannel::new().unwrap()).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL);
}

#[test]
fn futures_dropped_mid_flight_then_a_clean_teardown() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("dropped futures", Duration::from_secs(300));
    let rt = current_thread();
    let short = Duration::from_millis(50);
    rt.block_on(async {
        // 1. A pending next() dropped: nothing could come yet (no id on
        // the channel), and the event that comes later is not lost.
        let ch = AsyncEventChannel::new(EventChannel::new().unwrap()).unwrap();
        assert!(tokio::time::timeout(short, ch.next()).await.is_err(), "nothing to get: still pending when dropped");
        let id = ch.channel().create_id(PortSpace::Tcp).unwrap();
        id.resolve_addr(None, (bed.addr, 7).into(), Duration::from_secs(10)).unwrap();
        let ev = tokio::time::timeout(echo::STEP, ch.next()).await.expect("the event came").unwrap();
        assert_eq!(ev.event_type(), EventType::ADDR_RESOLVED);
        assert_eq!(ev.token(), Some(id.token()));
        drop(ev);
        // A next() pending on a channel that is then dropped with its id.
        {
            let pending = ch.next();
            assert!(tokio::time::timeout(short, pending).await.is_err());
        }
        drop(id);
        drop(ch);

        // 2. The loop's run() dropped mid-flight.
        let ctx = common::cm::device(bed.addr);
        let chan = CompChannel::new(&ctx).unwrap();
        let p = rc_pair(bed.addr, &chan, false, 16);
        let lp = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap();
        let ctl = lp.control();
        let (tx, mut rx) = unbounded_channel();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            for wc in wcs {
                s2.lock().unwrap().push((wc.wr_id(), wc.status()));
                let _ = tx.send(wc.wr_id());
            }
        })
        .unwrap();
        for i in 1..=5u64 {
            p.recv(i as usize * SLOT, SLOT as u32, i);
        }
        for i in 1..=3u64 {
            p.send(0, &[i as u8; 8], 8, 100 + i);
        }
        let got = {
            let run = lp.run();
            tokio::pin!(run);
            let mut got = Vec::new();
            while got.len() < 3 {
                tokio::select! {
                    r = &mut run => panic!("run ended without a stop: {r:?}"),
                    w = rx.recv() => got.push(w.unwrap()),
                    _ = tokio::time::sleep(echo::STEP) => panic!("completions did not come: {got:?}"),
                }
            }
            got
            // the run future is dropped here, in the middle of its loop
        };
        assert_eq!(got, vec![1, 2, 3]);
        let st = lp.get_ref().stats();
        assert_eq!(st.unacked_now, 0, "a dropped run flushes its acks");
        assert!(!lp.get_ref().is_running());

        // The loop runs again after the drop (one run at a time); a stop
        // ends that run.
        p.send(0, &[4; 8], 8, 104);
        {
            let run = lp.run();
            tokio::pin!(run);
            // Polled once, it holds the loop: a second run is refused.
            assert!(futures_poll_once(run.as_mut()).is_pending());
            assert_eq!(lp.run().await.unwrap_err().errno(), libc::EBUSY, "one run at a time");
            tokio::select! {
                r = &mut run => panic!("run ended without a stop: {r:?}"),
                w = rx.recv() => assert_eq!(w, Some(4)),
            }
            ctl.stop();
            tokio::time::timeout(echo::STEP, run).await.expect("a stop ends the run").unwrap();
        }

        // 3. A drain whose future is dropped while pending: nobody drives
        // the loop, so it cannot be done yet. It keeps going: once the loop
        // runs, the QP's receive left over (wr 5) is flushed to the
        // handler, and the drain's markers are consumed, never delivered.
        let mut d = {
            let s = p.server.lock().unwrap();
            aio::drain_id(&ctl, &s.id, echo::STEP).unwrap()
        };
        assert!(tokio::time::timeout(short, &mut d).await.is_err(), "pending: nobody runs the loop");
        drop(d);
        let task = AsyncCqLoop::spawn(lp);
        let w = tokio::time::timeout(echo::STEP, rx.recv()).await.expect("the flush came");
        assert_eq!(w, Some(5));
        // A second drain, awaited: its markers come after the first's on
        // each queue, so when it is done the first one is too.
        let d2 = {
            let s = p.server.lock().unwrap();
            aio::drain_id(&ctl, &s.id, echo::STEP).unwrap()
        };
        tokio::time::timeout(echo::STEP, d2).await.expect("the second drain ended").expect("drained");

        // 4. The spawned loop aborted: the loop is dropped in its task,
        // which flushes its acks and drops its handlers.
        task.abort();
        let err = tokio::time::timeout(echo::STEP, task.stop()).await.expect("the aborted task ended").err();
        assert_eq!(err.map(|e| e.errno()), Some(libc::EIO), "stop of an aborted task reports it");
        assert_eq!(Arc::strong_count(&seen), 1, "the handler went with the loop");
        assert!(rx.recv().await.is_none(), "the handler's sender is gone");
        let seen = seen.lock().unwrap().clone();
        let ids: Vec<u64> = seen.iter().map(|s| s.0).collect();
        assert_eq!(ids, vec![1, 2, 3, 4, 5], "each once, in order, no marker ({DRAIN_SEND_WR_ID}, {DRAIN_RECV_WR_ID})");
        assert!(seen[..4].iter().all(|s| s.1.is_success()));
        assert_eq!(seen[4].1, WcStatus::WR_FLUSH_ERR);
        // Teardown: ids, QPs, CQs, channel; the watchdog turns a hang into
        // a failure.
        drop(p);
        drop(chan);
    });
    drop(rt);
    assert_eq!(cm::counters().outstanding, 0, "no CM copy left");
}

/// A run future holds its loop from its first poll to its end: a thread's
/// runner call (`flush_acks`, `process_once`) made between two of its
/// steps is refused (EBUSY), and the run goes on serving its CQ. (The run
/// used to take the loop anew at each step: such a call got it, and the
/// run's next step was the one refused, which ended the run with EBUSY and
/// left its CQ to nobody.)
#[test]
fn a_threads_runner_call_is_refused_while_a_run_future_lives() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("runner calls vs a live run", Duration::from_secs(300));
    let rt = current_thread();
    rt.block_on(async {
        let ctx = common::cm::device(bed.addr);
        let chan = CompChannel::new(&ctx).unwrap();
        let p = rc_pair(bed.addr, &chan, false, 16);
        let lp = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap();
        let ctl = lp.control();
        let (tx, mut rx) = unbounded_channel();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            for wc in wcs {
                let _ = tx.send(wc.wr_id());
            }
        })
        .unwrap();
        p.recv(SLOT, SLOT as u32, 1);
        let run = lp.run();
        tokio::pin!(run);
        assert!(futures_poll_once(run.as_mut()).is_pending());
        let (flush, once) = std::thread::scope(|s| {
            s.spawn(|| {
                let l = lp.get_ref();
                (l.flush_acks().map_err(|e| e.errno()), l.process_once(Wait::None).map_err(|e| e.errno()))
            })
            .join()
            .unwrap()
        });
        assert_eq!(flush, Err(libc::EBUSY), "flush_acks from a thread while the run lives");
        assert_eq!(once, Err(libc::EBUSY), "process_once from a thread while the run lives");
        assert!(lp.get_ref().is_running());
        p.send(0, &[1; 8], 8, 101);
        tokio::select! {
            r = &mut run => panic!("the run ended: {r:?}"),
            w = rx.recv() => assert_eq!(w, Some(1), "the run goes on"),
        }
        ctl.stop();
        tokio::time::timeout(echo::STEP, run).await.expect("a stop ends the run").unwrap();
        assert!(!lp.get_ref().is_running());
        lp.get_ref().flush_acks().expect("the loop is free once the run is over");
    });
}

/// Runner calls from inside a handler of a run future answer EDEADLK, as
/// they do from a handler of a thread's run, and so does a second async
/// run made there (it answered EBUSY: found by a review).
#[test]
fn runner_calls_from_a_run_futures_handler_answer_edeadlk() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("runner calls from a run future's handler", Duration::from_secs(300));
    let rt = current_thread();
    rt.block_on(async {
        let ctx = common::cm::device(bed.addr);
        let chan = CompChannel::new(&ctx).unwrap();
        let p = rc_pair(bed.addr, &chan, false, 16);
        let lp = Arc::new(AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap());
        let ctl = lp.control();
        let got = Arc::new(Mutex::new(Vec::new()));
        let (l2, g2) = (Arc::downgrade(&lp), got.clone());
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |_, ctl| {
            let Some(lp) = l2.upgrade() else { return };
            let errno = |r: rdmasafe_core::Result<()>| r.map_err(|e| e.errno());
            let nested = std::pin::pin!(lp.run());
            let nested = match futures_poll_once(nested) {
                std::task::Poll::Ready(r) => errno(r),
                std::task::Poll::Pending => Ok(()),
            };
            let l = lp.get_ref();
            g2.lock().unwrap().extend([
                ("flush_acks", errno(l.flush_acks())),
                ("process_once", errno(l.process_once(Wait::None).map(|_| ()))),
                ("async run", nested),
            ]);
            ctl.stop();
        })
        .unwrap();
        p.recv(SLOT, SLOT as u32, 1);
        p.send(0, &[1; 8], 8, 101);
        tokio::time::timeout(Duration::from_secs(60), lp.run()).await.expect("the handler stops the run").unwrap();
        let got = got.lock().unwrap().clone();
        assert_eq!(
            got,
            [
                ("flush_acks", Err(libc::EDEADLK)),
                ("process_once", Err(libc::EDEADLK)),
                ("async run", Err(libc::EDEADLK))
            ]
        );
        lp.get_ref().flush_acks().expect("the loop is free once the run is over");
    });
}

/// A thread that gets the `pthread_t` of an exited thread that polled a
/// run future last (glibc gives it to the next thread it makes) is not
/// taken for the run's thread: its blocking drain treats the run as any
/// other thread's request does. Here nobody polls the runtime during the
/// drain, so the drain waits for a sign of life the grace period (2 s),
/// then drives the loop itself, counted (as
/// `a_blocking_drain_does_not_wait_forever_for_an_idle_runtime`). Found by
/// a review: the loop named threads by `pthread_t`, and the drain took
/// the loop at once, as the run's own thread may, with no takeover
/// counted; on a polled runtime it ran the handlers on the new thread
/// while the run lived on.
#[test]
fn a_thread_with_an_exited_pollers_pthread_t_is_not_the_run() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("a reused pthread_t and an async run", Duration::from_secs(240));
    let rt = current_thread();
    let ctx = common::cm::device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = Arc::new(rc_pair(bed.addr, &chan, false, 16));
    let lp = {
        let _in = rt.enter();
        Arc::new(AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap())
    };
    let ctl = lp.control();
    let delivered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d2 = delivered.clone();
    ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
        d2.fetch_add(wcs.len(), std::sync::atomic::Ordering::SeqCst);
    })
    .unwrap();
    for k in 0..4 {
        p.recv(k * SLOT, SLOT as u32, 300 + k as u64);
    }
    // SAFETY: pthread_self has no preconditions.
    let pthread = || unsafe { libc::pthread_self() } as u64;
    // The run's first poll, on a thread that then exits.
    let (l2, h) = (lp.clone(), rt.handle().clone());
    let (first_poller, run) = std::thread::spawn(move || {
        let _in = h.enter();
        type Run = std::pin::Pin<Box<dyn std::future::Future<Output = rdmasafe_core::Result<()>> + Send>>;
        let mut run: Run = Box::pin(async move { l2.run().await });
        assert!(futures_poll_once(run.as_mut()).is_pending());
        (pthread(), run)
    })
    .join()
    .unwrap();
    // A task of the runtime from now on, which nobody polls until the end.
    let run = rt.spawn(run);
    let p2 = p.clone();
    let (drainer_pthread, drained) = std::thread::spawn(move || {
        let s = p2.server.lock().unwrap();
        (pthread(), ctl.drain_id(&s.id, Duration::from_secs(60)).map_err(|e| e.to_string()))
    })
    .join()
    .unwrap();
    drained.expect("the drain");
    println!("the drainer got the first poller's pthread_t: {}", drainer_pthread == first_poller);
    assert_eq!(delivered.load(std::sync::atomic::Ordering::SeqCst), 4);
    let st = lp.get_ref().stats();
    assert_eq!(st.grace_takeovers, 1, "the drain waited for the run, then drove the loop itself: {st:?}");
    lp.control().stop();
    rt.block_on(run).unwrap().unwrap();
    assert_eq!(lp.get_ref().stats().unacked_now, 0);
}

/// The loop's own deadlines drive an idle async loop: keepalive probes
/// are posted at their deadline (no CQ event, no change, nothing else
/// makes the loop's fd readable before), complete, and are consumed by
/// the loop, never delivered. Without deadlines honoured this hangs (the
/// watchdog fails it).
#[test]
fn keepalive_deadlines_drive_an_idle_async_loop() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("async keepalive", Duration::from_secs(240));
    let t0 = Instant::now();
    let rt = current_thread();
    rt.block_on(async {
        let ctx = common::cm::device(bed.addr);
        let chan = CompChannel::new(&ctx).unwrap();
        let p = rc_pair(bed.addr, &chan, false, 16);
        let task = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap().spawn();
        let ctl = task.control();
        let delivered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let d2 = delivered.clone();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            d2.fetch_add(wcs.len(), std::sync::atomic::Ordering::SeqCst);
        })
        .unwrap();
        let cfg = Keepalive { period: Duration::from_millis(100), bound: Duration::from_secs(60), wr_id: 0xa11e };
        {
            let s = p.server.lock().unwrap();
            ctl.add_keepalive_id(&s.id, cfg, Box::new(|qpn, _| panic!("QP {qpn} declared dead"))).unwrap();
        }
        // Watch the figures (the test's own polling, not the loop's).
        while ctl.stats().keepalive_probes_ok < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let st = ctl.stats();
        // Removed without blocking the runtime (its async form), then
        // gone: a second removal is ENOENT at once, and the QP takes a
        // keepalive again (not EBUSY), removed the same way.
        let qpn = p.server.lock().unwrap().id.qp_num().unwrap();
        aio::remove_keepalive(&ctl, qpn).unwrap().await.unwrap();
        assert_eq!(aio::remove_keepalive(&ctl, qpn).unwrap_err().errno(), libc::ENOENT);
        {
            let s = p.server.lock().unwrap();
            ctl.add_keepalive_id(&s.id, cfg, Box::new(|qpn, _| panic!("QP {qpn} declared dead"))).unwrap();
        }
        aio::remove_keepalive(&ctl, qpn).unwrap().await.unwrap();
        let lp = task.stop().await.unwrap();
        println!(
            "async keepalive: {} probes posted, {} completed, {} dead, {} CQ events, {} wakeups; {:.2?}",
            st.keepalive_probes,
            st.keepalive_probes_ok,
            st.keepalive_dead,
            st.cq_events,
            st.wakeups,
            t0.elapsed()
        );
        assert_eq!(st.keepalive_dead, 0);
        assert_eq!(delivered.load(std::sync::atomic::Ordering::SeqCst), 0, "probes never reach the handler");
        assert_eq!(lp.get_ref().stats().unacked_now, 0);
        drop(lp);
        drop(p);
    });
}

/// A blocking drain from a plain thread while a spawned async loop runs on
/// a current-thread runtime: the request waits for the loop, so the
/// handlers run on the runtime's thread (as the module promises), never on
/// the draining thread. Before, the draining thread ran the loop itself
/// (the flushed completions were delivered there, and the runtime's thread
/// blocked on the loop meanwhile).
#[test]
fn a_blocking_drain_from_a_plain_thread_leaves_the_handlers_on_the_runtime() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("async loop, blocking drain from a thread", Duration::from_secs(240));
    let rt = current_thread();
    let runtime_thread = std::thread::current().id();
    rt.block_on(async {
        let ctx = common::cm::device(bed.addr);
        let chan = CompChannel::new(&ctx).unwrap();
        let p = Arc::new(rc_pair(bed.addr, &chan, false, 16));
        let task = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap().spawn();
        let ctl = task.control();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let c2 = calls.clone();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            for wc in wcs {
                c2.lock().unwrap().push((wc.wr_id(), std::thread::current().id()));
            }
        })
        .unwrap();
        for k in 0..4 {
            p.recv(k * SLOT, SLOT as u32, 100 + k as u64);
        }
        let (p2, ctl2) = (p.clone(), ctl.clone());
        let drainer = std::thread::spawn(move || {
            let s = p2.server.lock().unwrap();
            ctl2.drain_id(&s.id, Duration::from_secs(60)).map_err(|e| e.to_string())
        });
        // The runtime keeps running the loop while the thread waits.
        while !drainer.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let drainer_thread = drainer.thread().id();
        drainer.join().unwrap().expect("the drain");
        let lp = task.stop().await.unwrap();
        let calls = calls.lock().unwrap().clone();
        let mut ids: Vec<u64> = calls.iter().map(|c| c.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, [100, 101, 102, 103], "the four flushed receives, once each");
        let st = lp.get_ref().stats();
        if !no_handler_on_the_drainer(&calls, drainer_thread, &st) {
            return;
        }
        for (wr_id, thread) in calls {
            assert_eq!(thread, runtime_thread, "wr_id {wr_id}: handler ran off the runtime's thread");
        }
        assert_eq!(st.unacked_now, 0);
        drop(lp);
    });
}

/// A spawned async loop whose runtime is idle (its `block_on` returned):
/// a blocking drain from another thread waits for the run only while the
/// run shows life, then drives the loop itself and finishes (it used to
/// wait forever for a run nobody polls).
#[test]
fn a_blocking_drain_does_not_wait_forever_for_an_idle_runtime() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("async loop on an idle runtime, blocking drain", Duration::from_secs(240));
    let rt = current_thread();
    let ctx = common::cm::device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = Arc::new(rc_pair(bed.addr, &chan, false, 16));
    let delivered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d2 = delivered.clone();
    let (task, ctl) = rt.block_on(async {
        let task = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap().spawn();
        let ctl = task.control();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            d2.fetch_add(wcs.len(), std::sync::atomic::Ordering::SeqCst);
        })
        .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await; // the run is polled, then idle
        (task, ctl)
    });
    for k in 0..4 {
        p.recv(k * SLOT, SLOT as u32, 200 + k as u64);
    }
    // Nobody polls the runtime now.
    let p2 = p.clone();
    let drainer = std::thread::spawn(move || {
        let s = p2.server.lock().unwrap();
        ctl.drain_id(&s.id, Duration::from_secs(60)).map_err(|e| e.to_string())
    });
    drainer.join().unwrap().expect("the drain");
    assert_eq!(delivered.load(std::sync::atomic::Ordering::SeqCst), 4);
    let lp = rt.block_on(task.stop()).unwrap();
    let st = lp.get_ref().stats();
    assert_eq!(st.grace_takeovers, 1, "the drain drove the loop itself, once: {st:?}");
    assert_eq!(st.unacked_now, 0);
    drop(lp);
}

/// Whether no handler ran on the draining thread (`calls`: wr_id, thread).
/// The library's promise: a blocking change leaves the handlers to the
/// async run while the run shows life, and runs them itself only after 2 s
/// without a cycle of the run (`grace_takeovers`), which a busy machine
/// can cause. So a handler on the drainer fails the test unless the stats
/// count such a takeover (then it is reported, and the caller skips its
/// checks of where the handlers ran: false).
fn no_handler_on_the_drainer(
    calls: &[(u64, std::thread::ThreadId)],
    drainer: std::thread::ThreadId,
    st: &LoopStats,
) -> bool {
    let on_drainer: Vec<u64> = calls.iter().filter(|c| c.1 == drainer).map(|c| c.0).collect();
    if on_drainer.is_empty() {
        return true;
    }
    assert!(
        st.grace_takeovers > 0,
        "wr_ids {on_drainer:?}: handlers ran on the draining thread, with no takeover after the grace period: {st:?}"
    );
    println!(
        "info: the run showed no life for the grace period ({} takeover(s)): wr_ids {on_drainer:?} handled on the \
         draining thread, as documented",
        st.grace_takeovers
    );
    false
}

/// Two tasks await `next()` on one shared channel; two events come, one
/// after the other: each task gets one. (Each await used to register
/// through `poll_read_ready`, which keeps only the last task's waker: the
/// other task never woke, 20 of 20 runs on either runtime.)
fn two_tasks_share_one_channel(rt: &tokio::runtime::Runtime, what: &str, bed: std::net::IpAddr) {
    rt.block_on(async {
        let ch = Arc::new(AsyncEventChannel::new(EventChannel::new().unwrap()).unwrap());
        let (tx, mut rx) = unbounded_channel();
        let mut tasks = Vec::new();
        for name in ["first", "second"] {
            let (ch, tx) = (ch.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let ev = ch.next().await.unwrap();
                tx.send((name, ev.token())).unwrap();
            }));
            // Both tasks are waiting before any event comes (if one is not
            // polled in time, it gets its event all the same).
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let ids = [ch.channel().create_id(PortSpace::Tcp).unwrap(), ch.channel().create_id(PortSpace::Tcp).unwrap()];
        let mut got = Vec::new();
        for id in &ids {
            id.resolve_addr(None, (bed, 7).into(), Duration::from_secs(10)).unwrap();
            let one = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await;
            let (task, token) = one
                .unwrap_or_else(|_| {
                    panic!("{what}: {} event(s) taken, then no task woke within 20 s for the next: {got:?}", got.len())
                })
                .unwrap();
            assert_eq!(token, Some(id.token()), "{what}: {task} got another id's event");
            got.push(task);
        }
        got.sort_unstable();
        assert_eq!(got, ["first", "second"], "{what}: one event each");
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[test]
fn tasks_sharing_a_channel_are_each_woken() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("tasks sharing an async channel", Duration::from_secs(300));
    for i in 0..3 {
        two_tasks_share_one_channel(&current_thread(), &format!("current-thread, run {i}"), bed.addr);
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        two_tasks_share_one_channel(&multi, &format!("multi-thread, run {i}"), bed.addr);
    }
    assert_eq!(cm::counters().outstanding, 0);
}

/// A loop spawned on a multi-thread runtime from a thread outside it (in
/// `Runtime::enter`), then a blocking drain from that thread: the handlers
/// run on the runtime's workers, never on the draining thread. (The
/// spawning thread was taken for the task's driver until the task's first
/// poll, so its blocking drain ran the loop itself: handlers on it in 13
/// and 17 of 20 runs.)
#[test]
fn a_loop_spawned_from_outside_a_multi_thread_runtime_keeps_its_handlers_there() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("spawned from outside, blocking drain", Duration::from_secs(300));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let here = std::thread::current().id();
    let ctx = common::cm::device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    for run in 0..10 {
        let p = rc_pair(bed.addr, &chan, false, 16);
        let threads = Arc::new(Mutex::new(Vec::new()));
        let t2 = threads.clone();
        let _in_rt = rt.enter();
        let lp = AsyncCqLoop::new(CqLoop::new(&chan, LoopOptions::default()).unwrap()).unwrap();
        let ctl = lp.control();
        ctl.add_cq(&p.server_cq, ctl.default_cq_options(), move |wcs, _| {
            t2.lock().unwrap().extend(wcs.iter().map(|wc| (wc.wr_id(), std::thread::current().id())));
        })
        .unwrap();
        for k in 0..4 {
            p.recv(k * SLOT, SLOT as u32, 300 + k as u64);
        }
        let task = lp.spawn();
        {
            let s = p.server.lock().unwrap();
            task.control().drain_id(&s.id, Duration::from_secs(60)).expect("the drain");
        }
        let lp = rt.block_on(task.stop()).unwrap();
        let calls = threads.lock().unwrap().clone();
        let mut ids: Vec<u64> = calls.iter().map(|c| c.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, [300, 301, 302, 303], "run {run}: the four flushed receives, once each");
        let st = lp.get_ref().stats();
        no_handler_on_the_drainer(&calls, here, &st);
        assert_eq!(st.unacked_now, 0);
        drop(lp);
        drop(p);
    }
}

/// `next()` over a burst of queued events spends the task's cooperative
/// budget as tokio's own I/O does: the runtime's other tasks get to run
/// before the burst is all taken. (Awaited through `readable()` alone, it
/// took all 300 before another task ran.)
#[test]
fn next_over_a_burst_lets_other_tasks_run() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("next over a burst", Duration::from_secs(300));
    const N: usize = 300;
    current_thread().block_on(async {
        let ch = AsyncEventChannel::new(EventChannel::new().unwrap()).unwrap();
        let ids: Vec<_> = (0..N).map(|_| ch.channel().create_id(PortSpace::Tcp).unwrap()).collect();
        for id in &ids {
            id.resolve_addr(None, (bed.addr, 7).into(), Duration::from_secs(10)).unwrap();
        }
        // Let the events queue up (a blocking sleep: no task runs meanwhile),
        // and take the first: the fd is known readable from then on.
        std::thread::sleep(Duration::from_secs(2));
        let first = tokio::time::timeout(Duration::from_secs(20), ch.next()).await.expect("the event").unwrap();
        assert_eq!(first.event_type(), EventType::ADDR_RESOLVED);
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r2 = ran.clone();
        let other = tokio::spawn(async move { r2.store(true, std::sync::atomic::Ordering::SeqCst) });
        let mut taken_before_it_ran = None;
        for i in 1..N {
            let ev = tokio::time::timeout(Duration::from_secs(20), ch.next()).await.expect("the event").unwrap();
            assert_eq!(ev.event_type(), EventType::ADDR_RESOLVED);
            if taken_before_it_ran.is_none() && ran.load(std::sync::atomic::Ordering::SeqCst) {
                taken_before_it_ran = Some(i);
            }
        }
        other.await.unwrap();
        println!("next() over a burst of {N}: the other task ran after {taken_before_it_ran:?} events");
        assert!(taken_before_it_ran.is_some(), "all {N} events were taken before another task ran");
    });
    assert_eq!(cm::counters().outstanding, 0);
}

/// `rdma_migrate_id` moves an id's queued events to the new channel, and
/// the kernel raises no edge on that channel's fd for them (tokio's epoll
/// is edge-triggered): a `next()` waiting there, a later `next()` and
/// `poll_next` must still get every one of them, in order.
#[test]
fn events_moved_in_by_migrate_are_got_by_next_and_poll_next() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("migrate into an async channel", Duration::from_secs(300));
    let a = EventChannel::new().unwrap();
    current_thread().block_on(async {
        let b = Arc::new(AsyncEventChannel::new(EventChannel::new().unwrap()).unwrap());
        // Found empty: B's readiness is cleared, only an edge sets it.
        assert!(tokio::time::timeout(Duration::from_millis(50), b.next()).await.is_err());
        let got = |ev: rdmasafe_core::Result<cm::CmEvent>, id: &cm::CmId, how: &str| {
            let ev = ev.unwrap_or_else(|e| panic!("{how}: {e}"));
            assert_eq!((ev.event_type(), ev.token()), (EventType::ADDR_RESOLVED, Some(id.token())), "{how}");
        };
        // 1. A next() already waiting when the event is moved in.
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.next().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        let mut id1 = common::cm::with_queued_event(&a, bed.addr);
        id1.migrate(b.channel()).unwrap();
        let ev = tokio::time::timeout(echo::STEP, waiter).await.expect("the waiting next() got the moved event");
        got(ev.unwrap(), &id1, "waiting next()");
        // 2. Two events moved in at once, then two next() calls, then
        // poll_next for a third.
        let mut id2 = common::cm::with_queued_event(&a, bed.addr);
        let mut id3 = common::cm::with_queued_event(&a, bed.addr);
        let mut id4 = common::cm::with_queued_event(&a, bed.addr);
        for id in [&mut id2, &mut id3, &mut id4] {
            id.migrate(b.channel()).unwrap();
        }
        got(tokio::time::timeout(echo::STEP, b.next()).await.expect("next() got the 1st of 3"), &id2, "next() 1 of 3");
        got(tokio::time::timeout(echo::STEP, b.next()).await.expect("next() got the 2nd of 3"), &id3, "next() 2 of 3");
        let third = std::future::poll_fn(|cx| b.poll_next(cx));
        got(
            tokio::time::timeout(echo::STEP, third).await.expect("poll_next got the 3rd of 3"),
            &id4,
            "poll_next 3 of 3",
        );
        assert!(a.try_get().unwrap().is_none(), "A kept nothing");
        assert!(b.channel().try_get().unwrap().is_none(), "B had nothing more");
    });
}
