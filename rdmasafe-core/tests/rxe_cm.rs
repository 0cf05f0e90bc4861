//! CM event copies on Soft-RoCE: private data sizes both ways, the
//! transport limits, reject data, unreachable ports and addresses, UD
//! parameters, and teardown while copies are held (vs raw librdmacm events
//! held, which block rdma_destroy_id).

mod common;

use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::cm::{add_qp, assert_data, expect, listen, params, pattern, resolved};
use rdmasafe_core::cm::{EventChannel, EventType as E, PortSpace};
use rdmasafe_core::sys;

fn connect_with(c_len: usize, s_len: usize) {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut client, false);
    let hello = pattern(c_len, 3);
    let welcome = pattern(s_len, 101);
    client.connect(&params(&hello)).expect("connect");

    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    assert_eq!(req.listen_token(), Some(l.id.token()));
    assert_eq!(req.private_data().len(), 56, "received length is the padded RoCE maximum");
    assert_data(req.private_data(), &hello, "CONNECT_REQUEST data");
    assert!(!req.is_ud());
    let mut r = req.take_request().expect("owned request");
    add_qp(r.id_mut(), false);
    let server = r.accept(&params(&welcome)).expect("accept");

    let est = expect(&cch, E::ESTABLISHED);
    assert_eq!(est.token(), Some(client.token()));
    assert_eq!(est.private_data().len(), 196, "received length is the padded RoCE maximum");
    assert_data(est.private_data(), &welcome, "ESTABLISHED data");
    let sest = expect(&l.ch, E::ESTABLISHED);
    assert_eq!(sest.token(), Some(server.token()));

    client.disconnect().unwrap();
    assert_eq!(expect(&l.ch, E::DISCONNECTED).token(), Some(server.token()));
    server.disconnect().unwrap();
    assert_eq!(expect(&cch, E::DISCONNECTED).token(), Some(client.token()));
    println!("connect {c_len} B / accept {s_len} B: sequence and bytes ok");
}

#[test]
fn private_data_0_bytes_both_ways() {
    connect_with(0, 0);
}

#[test]
fn private_data_1_byte_both_ways() {
    connect_with(1, 1);
}

#[test]
fn private_data_at_the_roce_maximum_56_and_196() {
    connect_with(56, 196);
}

#[test]
fn connect_with_57_bytes_fails_with_einval() {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut client, false);
    let err = client.connect(&params(&pattern(57, 9))).expect_err("57 bytes exceed a RoCE connect's private data");
    assert_eq!(err.errno(), libc::EINVAL, "{err}");
    assert!(l.ch.try_get().unwrap().is_none(), "the listener saw nothing");
    println!("57-byte connect: {err}");
}

#[test]
fn reject_with_148_bytes_reaches_the_client() {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut client, false);
    client.connect(&params(b"let me in")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let why = pattern(148, 55);
    req.take_request().unwrap().reject(&why).expect("reject with 148 bytes");
    let rej = expect(&cch, E::REJECTED);
    // IB CM reject reason 28: consumer defined.
    assert_eq!(rej.status(), 28, "status is the IB CM reject reason");
    assert_data(rej.private_data(), &why, "REJECTED data");
    println!("REJECTED status {} with {} bytes of private data", rej.status(), rej.private_data().len());
}

#[test]
fn dropping_an_unaccepted_request_rejects_it() {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut client, false);
    client.connect(&params(b"ignored")).unwrap();
    drop(expect(&l.ch, E::CONNECT_REQUEST)); // never accepted
    let rej = expect(&cch, E::REJECTED);
    assert_eq!(rej.status(), 28, "consumer-defined reject");
}

#[test]
fn connect_to_a_port_nobody_listens_on_is_rejected() {
    let bed = common::bed();
    // Bind then free a port so that nobody listens on it.
    let port = {
        let l = listen(bed.addr, PortSpace::Tcp, 1);
        l.port
    };
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, port);
    add_qp(&mut client, false);
    client.connect(&params(b"anyone?")).unwrap();
    let rej = expect(&cch, E::REJECTED);
    // IB CM reject reason 8: invalid service ID.
    assert_eq!(rej.status(), 8, "status is the IB CM reject reason");
}

#[test]
fn off_subnet_address_fails_synchronously() {
    let bed = common::bed();
    if !bed.in_guest {
        eprintln!("off-subnet check uses the guest's routing table (no default route); host run: checked in the guest");
        return;
    }
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    let err = id
        .resolve_addr(None, "10.99.0.1:4000".parse().unwrap(), Duration::from_secs(2))
        .expect_err("no route to an off-subnet address in the guest");
    println!("off-subnet resolve: {err}");
    assert_eq!(err.op(), "rdma_resolve_addr");
    assert!(ch.try_get().unwrap().is_none(), "no event follows a synchronous failure");
}

#[test]
fn ud_ids_deliver_ud_params() {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Udp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Udp, bed.addr, l.port);
    add_qp(&mut client, true);
    let hello = pattern(40, 17);
    client.connect(&params(&hello)).expect("UD connect (SIDR)");

    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    assert!(req.is_ud(), "UD request fills param.ud");
    assert_data(req.private_data(), &hello, "UD request data");
    let mut r = req.take_request().unwrap();
    add_qp(r.id_mut(), true);
    let server_qpn = r.id_mut().qp_num().unwrap();
    let reply = pattern(100, 5);
    let server = r.accept(&params(&reply)).expect("UD accept");

    let est = expect(&cch, E::ESTABLISHED);
    assert!(est.is_ud());
    let ud = est.ud_param();
    println!("UD ESTABLISHED: {ud:?}, private data {} bytes", est.private_data().len());
    assert_eq!(ud.qp_num, server_qpn, "peer QP number");
    assert_eq!(ud.qkey, 0x0123_4567, "RDMA_UDP_QKEY");
    assert_eq!(ud.ah_attr.is_global, 1, "RoCE address handles are global");
    assert_data(est.private_data(), &reply, "UD reply data");
    drop((client, server));
}

/// 1000 copies held while their ids are destroyed: every destroy returns.
#[test]
fn holding_1000_copies_never_blocks_destroy() {
    let bed = common::bed();
    let _dog = common::watchdog("destroying 1000 ids with copies held", Duration::from_secs(300));
    let ch = EventChannel::new().unwrap();
    let ids: Vec<_> = (0..1000).map(|_| ch.create_id(PortSpace::Tcp).unwrap()).collect();
    for id in &ids {
        id.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    }
    let mut held = Vec::with_capacity(1000);
    while held.len() < 1000 {
        ch.get_batch(&mut held, 1000, sys::Wait::For(common::cm::STEP)).expect("ADDR_RESOLVED events");
    }
    assert!(held.iter().all(|e| e.event_type() == E::ADDR_RESOLVED));
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    for id in ids {
        let t = Instant::now();
        drop(id); // rdma_destroy_id
        slowest = slowest.max(t.elapsed());
    }
    println!("destroyed 1000 ids with 1000 copies held in {:?} (slowest {:?})", start.elapsed(), slowest);
    // Reading the copies after their ids are gone is safe: they own their data.
    assert_eq!(held.iter().filter(|e| e.private_data().is_empty()).count(), 1000);
    drop(held);
}

/// The contrast: one raw librdmacm event held blocks rdma_destroy_id until
/// it is acked.
#[test]
fn a_raw_librdmacm_event_held_blocks_destroy_until_acked() {
    let bed = common::bed();
    let _dog = common::watchdog("raw destroy after ack", Duration::from_secs(120));
    // SAFETY (whole block): raw librdmacm use, as a plain C program would
    // do it; every pointer comes from the library and is used per its API.
    unsafe {
        let ch = sys::rdma_create_event_channel();
        assert!(!ch.is_null());
        let mut id = null_mut();
        assert_eq!(sys::rdma_create_id(ch, &mut id, null_mut(), sys::rdma_port_space::RDMA_PS_TCP), 0);
        let mut dst = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: 4791u16.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(match bed.addr {
                    std::net::IpAddr::V4(a) => a.octets(),
                    _ => panic!("IPv4 test address expected"),
                }),
            },
            sin_zero: [0; 8],
        };
        assert_eq!(sys::rdma_resolve_addr(id, null_mut(), (&mut dst as *mut libc::sockaddr_in).cast(), 5000), 0);
        let mut ev = null_mut();
        assert_eq!(sys::get_cm_event(ch, &mut ev), 0);
        assert_eq!((*ev).event, E::ADDR_RESOLVED.0);

        let (tx, rx) = mpsc::channel();
        let id_addr = id as usize;
        let t = std::thread::spawn(move || {
            sys::rdma_destroy_id(id_addr as *mut sys::rdma_cm_id);
            let _ = tx.send(());
        });
        let blocked = rx.recv_timeout(Duration::from_secs(2)).is_err();
        assert!(blocked, "rdma_destroy_id returned while a raw event for the id was held");
        println!("raw: rdma_destroy_id still blocked after 2 s with one unacked event");
        let acked = Instant::now();
        sys::ack_cm_event(ev);
        rx.recv_timeout(Duration::from_secs(60)).expect("destroy returns once the event is acked");
        println!("raw: destroy returned {:?} after the ack", acked.elapsed());
        t.join().unwrap();
        sys::rdma_destroy_event_channel(ch);
    }
}

/// A copy held for an id does not make rdma_migrate_id wait; the id's next
/// events arrive on the new channel.
#[test]
fn migrating_an_id_with_a_copy_held_returns_and_events_follow() {
    let bed = common::bed();
    let _dog = common::watchdog("rdma_migrate_id", Duration::from_secs(120));
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let a = EventChannel::new().unwrap();
    let b = EventChannel::new().unwrap();
    let mut id = a.create_id(PortSpace::Tcp).unwrap();
    id.resolve_addr(None, (bed.addr, l.port).into(), Duration::from_secs(5)).unwrap();
    let held = expect(&a, E::ADDR_RESOLVED);
    id.migrate(&b).expect("migrate returns with a copy held");
    id.resolve_route(Duration::from_secs(5)).unwrap();
    let ev = expect(&b, E::ROUTE_RESOLVED);
    assert_eq!(ev.token(), Some(id.token()));
    assert!(a.try_get().unwrap().is_none(), "nothing more on the old channel");
    drop((held, id, a));
}

/// Listener and channel dropped while a connect request is still queued in
/// the kernel: the drops return and the client is told (REJECTED).
#[test]
fn dropping_a_listener_with_a_request_queued_rejects_the_client() {
    let bed = common::bed();
    let _dog = common::watchdog("channel teardown with a queued request", Duration::from_secs(120));
    let l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut client, false);
    client.connect(&params(b"nobody will fetch this")).unwrap();
    // Wait until the request is queued for the server (its fd is readable).
    let fd = std::os::fd::AsRawFd::as_raw_fd(&l.ch);
    let [ready] = sys::poll_readable([fd], sys::Wait::For(common::cm::STEP)).unwrap();
    assert!(ready, "the request reached the server's channel");
    drop(l); // listener id, then the channel: neither waits on anything
    let ev = cch.get_timeout(common::cm::STEP).expect("the client hears about it");
    println!("client after the server dropped a queued request: {} status {}", ev.event_type(), ev.status());
    assert_eq!(ev.event_type(), E::REJECTED);
}

/// What `CmId::migrate`'s docs say of a listening id: a connect request
/// still queued for it when it moves is lost. The kernel moves the request
/// to the new channel (its fd turns readable), but librdmacm's get there
/// consumes it and reports nothing; the listener itself keeps working on
/// the new channel.
#[test]
fn migrating_a_listener_with_a_request_queued_loses_the_request() {
    let bed = common::bed();
    let _dog = common::watchdog("listener migrated with a request queued", Duration::from_secs(180));
    let mut l = listen(bed.addr, PortSpace::Tcp, 8);
    let cch = EventChannel::new().unwrap();
    let mut first = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut first, false);
    first.connect(&params(b"queued when the listener moves")).unwrap();
    let readable = |ch: &EventChannel, wait: sys::Wait| {
        let [r] = sys::poll_readable([std::os::fd::AsRawFd::as_raw_fd(ch)], wait).unwrap();
        r
    };
    assert!(readable(&l.ch, sys::Wait::For(common::cm::STEP)), "the request reached the listener's channel");
    let b = EventChannel::new().unwrap();
    l.id.migrate(&b).expect("migrate the listener");
    assert!(!readable(&l.ch, sys::Wait::None), "the request left the old channel");
    assert!(readable(&b, sys::Wait::None), "the kernel moved the request to the new channel");
    let got = b.try_get().expect("a get on the new channel");
    assert!(got.is_none(), "the moved request was reported: {:?}", got.map(|e| e.event_type()));
    assert!(!readable(&b, sys::Wait::None), "the get consumed the moved request");

    // The listener works on its new channel.
    let mut second = resolved(&cch, PortSpace::Tcp, bed.addr, l.port);
    add_qp(&mut second, false);
    second.connect(&params(b"after the move")).unwrap();
    let req = expect(&b, E::CONNECT_REQUEST);
    assert_eq!(req.listen_token(), Some(l.id.token()));
    assert_data(req.private_data(), b"after the move", "the second request");
    println!("first client so far: {:?}", cch.try_get().unwrap().map(|e| (e.event_type(), e.status())));
    drop((req, second, first, l, b));
}

/// The dispatcher thread waits in poll() on the channel and a wakeup fd:
/// stop returns promptly when idle, and a stop requested from inside the
/// callback ends the thread after that callback.
#[test]
fn dispatcher_stops_when_idle_and_from_its_callback() {
    use rdmasafe_core::cm::Dispatcher;
    let bed = common::bed();
    let _dog = common::watchdog("dispatcher stop", Duration::from_secs(120));

    let idle = EventChannel::new().unwrap();
    let d = Dispatcher::with_callback(&idle, |_| panic!("no event expected")).unwrap();
    std::thread::sleep(Duration::from_millis(100)); // let it block in poll()
    d.stop().expect("idle dispatcher stops");

    // Stop from the callback: the first event stops it; the second stays
    // in the kernel for whoever gets next.
    let ch = EventChannel::new().unwrap();
    let (tx, rx) = mpsc::channel();
    let slot: std::sync::Arc<std::sync::Mutex<Option<rdmasafe_core::cm::StopHandle>>> = Default::default();
    let s2 = slot.clone();
    let d = Dispatcher::with_callback(&ch, move |ev| {
        tx.send(ev.event_type()).unwrap();
        if let Some(h) = s2.lock().unwrap().as_ref() {
            h.stop();
        }
    })
    .unwrap();
    *slot.lock().unwrap() = Some(d.stop_handle());
    let a = ch.create_id(PortSpace::Tcp).unwrap();
    a.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    assert_eq!(rx.recv_timeout(common::cm::STEP).unwrap(), E::ADDR_RESOLVED);
    // The thread has ended by itself: a later event is not consumed.
    let b = ch.create_id(PortSpace::Tcp).unwrap();
    b.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    let ev = expect(&ch, E::ADDR_RESOLVED);
    assert_eq!(ev.token(), Some(b.token()), "the stopped dispatcher left the event in the kernel");
    assert!(rx.try_recv().is_err());
    assert_eq!(d.stats().events, 1);
    d.stop().unwrap();
}

/// A callback that panics ends the dispatcher's thread, as documented:
/// `is_finished` turns true, later events stay in the kernel for the next
/// get, and `stop` returns EIO.
#[test]
fn a_panicking_dispatcher_callback_ends_the_thread_and_stop_says_so() {
    use rdmasafe_core::cm::Dispatcher;
    let bed = common::bed();
    let _dog = common::watchdog("dispatcher callback panics", Duration::from_secs(120));
    let ch = EventChannel::new().unwrap();
    let d = Dispatcher::with_callback(&ch, |ev| panic!("test: the callback panics on {}", ev.event_type())).unwrap();
    assert!(!d.is_finished(), "a running dispatcher");
    let a = ch.create_id(PortSpace::Tcp).unwrap();
    a.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    let t0 = std::time::Instant::now();
    while !d.is_finished() {
        assert!(t0.elapsed() < common::cm::STEP, "the panic did not end the thread");
        std::thread::sleep(Duration::from_millis(5));
    }
    let b = ch.create_id(PortSpace::Tcp).unwrap();
    b.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    let ev = expect(&ch, E::ADDR_RESOLVED);
    assert_eq!(ev.token(), Some(b.token()), "the ended dispatcher left the later event in the kernel");
    drop(ev);
    let err = d.stop().expect_err("stop reports the panic");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    drop((a, b));
}

/// Eight threads getting from one channel at once: 2000 events, each
/// delivered to exactly one thread, none lost.
#[test]
fn eight_threads_share_one_channel() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    let bed = common::bed();
    let _dog = common::watchdog("eight getters", Duration::from_secs(300));
    let ch = EventChannel::new().unwrap();
    let ids: Vec<_> = (0..2000).map(|_| ch.create_id(PortSpace::Tcp).unwrap()).collect();
    let seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let count = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (ch, seen, count) = (ch.clone(), seen.clone(), count.clone());
            std::thread::spawn(move || {
                let mut mine = 0;
                while count.load(SeqCst) < 2000 {
                    if let Ok(ev) = ch.get_timeout(Duration::from_millis(50)) {
                        assert_eq!(ev.event_type(), E::ADDR_RESOLVED);
                        seen.lock().unwrap().push(ev.token().unwrap().get());
                        count.fetch_add(1, SeqCst);
                        mine += 1;
                    }
                }
                mine
            })
        })
        .collect();
    for id in &ids {
        id.resolve_addr(None, (bed.addr, 4791).into(), Duration::from_secs(5)).unwrap();
    }
    let per_thread: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let seen = seen.lock().unwrap();
    let unique: HashSet<_> = seen.iter().collect();
    println!("8 getters on one channel: {per_thread:?}");
    assert_eq!(seen.len(), 2000, "every event delivered");
    assert_eq!(unique.len(), 2000, "each exactly once");
    let want: HashSet<u64> = ids.iter().map(|i| i.token().get()).collect();
    assert_eq!(unique.into_iter().copied().collect::<HashSet<_>>(), want);
}
