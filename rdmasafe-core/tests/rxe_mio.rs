//! The mio feature on Soft-RoCE: one hand-made `mio::Poll` loop drives two
//! CM event channels (a listener's and the clients') and a CQ loop whose
//! CQs come and go while it runs, all edge-triggered: connections with
//! private data both ways, one message per client, every completion once,
//! drains done through the loop, a stop from another thread seen through
//! `process_ready`; an event moved in by `CmId::migrate` (which the kernel
//! does not signal) raises an edge.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::cm::{assert_data, pattern};
use mio::{Events, Interest, Poll, Token};
use rdmasafe_core::cm::{self, CmId, ConnectParams, EventChannel, EventType, PortSpace, QpCaps};
use rdmasafe_core::cq::{CqLoop, LoopOptions};
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd, WcStatus};

const SERVER: Token = Token(0);
const CLIENT: Token = Token(1);
const LOOP: Token = Token(2);
const N: usize = 4;
const MSG: usize = 48;
const CAPS: QpCaps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };

type Seen = Arc<Mutex<Vec<(char, usize, u64, WcStatus)>>>;
/// When the poll loop may return: (clients, servers, stops seen).
type Until<'a> = &'a dyn Fn(&[Client], &HashMap<u64, Server>, usize) -> bool;

struct Client {
    id: CmId,
    qp: Option<(Pd, Cq, Mr)>,
    established: bool,
}

struct Server {
    index: usize,
    id: Option<CmId>,
    mr: Mr,
    _cq: Cq,
}

/// The CM copy counters are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

fn hello(i: usize) -> Vec<u8> {
    pattern(12, i as u8)
}

fn welcome(i: usize) -> Vec<u8> {
    pattern(20, 100 + i as u8)
}

#[test]
fn a_mio_poll_loop_drives_cm_channels_and_the_cq_loop() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("mio loop", Duration::from_secs(240));
    let t0 = Instant::now();
    let mut poll = Poll::new().unwrap();
    let mut events = Events::with_capacity(16);

    let mut sch = EventChannel::new().unwrap();
    let listener = sch.create_id(PortSpace::Tcp).unwrap();
    listener.bind_addr((bed.addr, 0).into()).unwrap();
    listener.listen(N as i32).unwrap();
    let port = listener.local_port();
    let ctx = listener.device_context().unwrap();
    let chan = CompChannel::new(&ctx).unwrap();
    let mut lp = CqLoop::new(&chan, LoopOptions::default()).unwrap();
    let ctl = lp.control();
    let mut cch = EventChannel::new().unwrap();
    poll.registry().register(&mut sch, SERVER, Interest::READABLE).unwrap();
    poll.registry().register(&mut cch, CLIENT, Interest::READABLE).unwrap();
    poll.registry().register(&mut lp, LOOP, Interest::READABLE).unwrap();

    let mut clients: Vec<Client> = (0..N)
        .map(|_| {
            let id = cch.create_id(PortSpace::Tcp).unwrap();
            id.resolve_addr(None, (bed.addr, port).into(), Duration::from_secs(10)).unwrap();
            Client { id, qp: None, established: false }
        })
        .collect();
    let by_token: HashMap<u64, usize> = clients.iter().enumerate().map(|(i, c)| (c.id.token().get(), i)).collect();
    let mut servers: HashMap<u64, Server> = HashMap::new();
    let seen: Seen = Arc::default();
    let handler = |side: char, index: usize| {
        let seen = seen.clone();
        move |wcs: &[rdmasafe_core::verbs::Wc], _: &rdmasafe_core::cq::LoopControl| {
            seen.lock().unwrap().extend(wcs.iter().map(|w| (side, index, w.wr_id(), w.status())));
        }
    };

    // Runs the poll loop until `done()`: every source is drained until it
    // has nothing ready (edge-triggered); the poll waits at most the CQ
    // loop's next deadline.
    let mut stopped = 0;
    let mut step = |done: Until<'_>, clients: &mut Vec<Client>, servers: &mut HashMap<u64, Server>| {
        while !done(clients, servers, stopped) {
            assert!(t0.elapsed() < Duration::from_secs(200), "no progress");
            poll.poll(&mut events, lp.next_timeout().or(Some(Duration::from_secs(30)))).unwrap();
            for ev in events.iter() {
                match ev.token() {
                    SERVER => {
                        while let Some(mut e) = sch.try_get().unwrap() {
                            match e.event_type() {
                                EventType::CONNECT_REQUEST => {
                                    let index = (0..N).find(|i| e.private_data().starts_with(&hello(*i))).unwrap();
                                    assert_data(e.private_data(), &hello(index), "the client's private data");
                                    let mut req = e.take_request().unwrap();
                                    let pd = Pd::new(&ctx).unwrap();
                                    let cq = Cq::new(&ctx, 8, Some(&chan)).unwrap();
                                    req.id_mut().create_qp(&pd, &cq, &cq, CAPS, false).unwrap();
                                    let mr = Mr::new(&pd, MSG).unwrap();
                                    req.id_mut().post_recv(&mr, 0, MSG as u32, 1).unwrap();
                                    ctl.add_cq(&cq, ctl.default_cq_options(), handler('s', index)).unwrap();
                                    let key = req.token().get();
                                    let w = welcome(index);
                                    let id = req.accept(&ConnectParams { private_data: &w, ..Default::default() });
                                    servers.insert(key, Server { index, id: Some(id.unwrap()), mr, _cq: cq });
                                }
                                EventType::ESTABLISHED => {}
                                other => panic!("server: unexpected {other} (status {})", e.status()),
                            }
                        }
                    }
                    CLIENT => {
                        while let Some(e) = cch.try_get().unwrap() {
                            let i = by_token[&e.token().unwrap().get()];
                            let c = &mut clients[i];
                            match e.event_type() {
                                EventType::ADDR_RESOLVED => c.id.resolve_route(Duration::from_secs(10)).unwrap(),
                                EventType::ROUTE_RESOLVED => {
                                    let pd = Pd::new(&ctx).unwrap();
                                    let cq = Cq::new(&ctx, 8, Some(&chan)).unwrap();
                                    c.id.create_qp(&pd, &cq, &cq, CAPS, false).unwrap();
                                    ctl.add_cq(&cq, ctl.default_cq_options(), handler('c', i)).unwrap();
                                    let mut mr = Mr::new(&pd, MSG).unwrap();
                                    mr.write(0, &pattern(MSG, 200 + i as u8)).unwrap();
                                    c.qp = Some((pd, cq, mr));
                                    let h = hello(i);
                                    c.id.connect(&ConnectParams { private_data: &h, ..Default::default() }).unwrap();
                                }
                                EventType::ESTABLISHED => {
                                    assert_data(e.private_data(), &welcome(i), "the server's private data");
                                    let (_, _, mr) = c.qp.as_ref().unwrap();
                                    c.id.post_send(mr, 0, MSG as u32, 2).unwrap();
                                    c.established = true;
                                }
                                other => panic!("client {i}: unexpected {other} (status {})", e.status()),
                            }
                        }
                    }
                    LOOP => loop {
                        let p = lp.process_ready().unwrap();
                        if p.stopped {
                            stopped += 1;
                        }
                        if !p.more {
                            break;
                        }
                    },
                    t => panic!("token {t:?}"),
                }
            }
        }
    };

    // Connect, send, receive: 2 completions per connection.
    let count = |side: char, wr: u64| seen.lock().unwrap().iter().filter(|s| s.0 == side && s.2 == wr).count();
    step(&|_, _, _| count('s', 1) == N && count('c', 2) == N, &mut clients, &mut servers);
    for s in servers.values() {
        let mut got = vec![0u8; MSG];
        s.mr.read(0, &mut got).unwrap();
        assert_eq!(got, pattern(MSG, 200 + s.index as u8), "server {} received its client's message", s.index);
    }

    // Drain every server QP through the loop (run by the mio loop).
    let drained = Arc::new(AtomicUsize::new(0));
    for s in servers.values() {
        let d = drained.clone();
        let cb = Box::new(move |r: rdmasafe_core::Result<()>| {
            r.expect("drained");
            d.fetch_add(1, SeqCst);
        });
        ctl.drain_id_then(s.id.as_ref().unwrap(), Duration::from_secs(60), cb).unwrap();
    }
    step(&|_, _, _| drained.load(SeqCst) == N, &mut clients, &mut servers);

    // A stop from another thread reaches the mio loop as a readable fd.
    let c2 = ctl.clone();
    std::thread::spawn(move || c2.stop()).join().unwrap();
    step(&|_, _, stopped| stopped == 1, &mut clients, &mut servers);

    let seen = seen.lock().unwrap().clone();
    let mut per: HashMap<(char, usize, u64), usize> = HashMap::new();
    for s in &seen {
        assert_eq!(s.3, WcStatus::SUCCESS, "{s:?}");
        *per.entry((s.0, s.1, s.2)).or_default() += 1;
    }
    assert_eq!(per.len(), 2 * N, "a receive per server and a send per client, nothing else: {per:?}");
    assert!(per.values().all(|n| *n == 1), "each exactly once: {per:?}");
    assert!(clients.iter().all(|c| c.established));
    let st = lp.stats();
    assert_eq!(st.unacked_now, 0, "the stop flushed every ack");
    println!(
        "mio: {N} connections, {} completions each once, {} drains, {} loop wakeups, {} ack calls, {:.2?}",
        seen.len(),
        drained.load(SeqCst),
        st.wakeups,
        st.ack_calls,
        t0.elapsed()
    );

    // Teardown: deregister, drop the loop (CQs leave it), then the rest.
    poll.registry().deregister(&mut lp).unwrap();
    poll.registry().deregister(&mut sch).unwrap();
    poll.registry().deregister(&mut cch).unwrap();
    drop(lp);
    for s in servers.values_mut() {
        s.id.take();
    }
    drop(servers);
    drop(clients);
    drop(listener);
    drop((sch, cch, chan));
    assert_eq!(cm::counters().outstanding, 0);
}

/// `rdma_migrate_id` moves an id's queued events to the new channel, and
/// the kernel raises no edge on that channel's fd for them: rdmasafe's
/// `Source` must, or an edge-triggered poll never sees them.
#[test]
fn an_event_moved_in_by_migrate_raises_an_edge() {
    let _s = serial();
    let bed = common::bed();
    let _dog = common::watchdog("migrate into a mio channel", Duration::from_secs(240));
    let a = EventChannel::new().unwrap();
    let mut b = EventChannel::new().unwrap();
    let mut poll = Poll::new().unwrap();
    poll.registry().register(&mut b, CLIENT, Interest::READABLE).unwrap();
    let mut events = Events::with_capacity(8);
    // Whatever edge the registration gave is consumed; B is empty.
    poll.poll(&mut events, Some(Duration::ZERO)).unwrap();
    assert!(b.try_get().unwrap().is_none());
    for round in 0..2 {
        let mut id = common::cm::with_queued_event(&a, bed.addr);
        id.migrate(&b).unwrap();
        poll.poll(&mut events, Some(common::cm::STEP)).unwrap();
        assert!(events.iter().any(|e| e.token() == CLIENT && e.is_readable()), "round {round}: an edge for B");
        let ev = b.try_get().unwrap().unwrap_or_else(|| panic!("round {round}: the moved event on B"));
        assert_eq!((ev.event_type(), ev.token()), (EventType::ADDR_RESOLVED, Some(id.token())));
        assert!(b.try_get().unwrap().is_none());
    }
    poll.registry().deregister(&mut b).unwrap();
}
