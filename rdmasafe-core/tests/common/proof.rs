//! The first proof on rxe, shared by the `rxe_proof` test (which asserts on
//! the transcript) and the `demo` example (which prints it).
//!
//! A listener and a client on two rdmasafe event channels connect over
//! rdma_cm with private data both ways, the client sends one message, the
//! server waits for the receive completion through a completion channel
//! (req_notify, get_cq_event, ack, poll), both disconnect, and everything is
//! destroyed.

use std::net::IpAddr;
use std::time::Duration;

use rdmasafe_core::cm::{CmEvent, ConnectParams, EventChannel, EventType, PortSpace, QpCaps};
use rdmasafe_core::verbs::{self, CompChannel, Cq, Mr, Pd};
use rdmasafe_core::verbs::{WcOpcode, WcStatus};
use rdmasafe_core::Result;
use rdmasafe_core::Wait;

pub const HELLO: &[u8] = b"hello from the client: rdmasafe proof";
pub const WELCOME: &[u8] = b"welcome from the server, conn #1";
pub const PAYLOAD: &[u8] = b"one SEND over rxe through rdmasafe";

/// What happened, as seen by each side.
#[derive(Debug, Default)]
pub struct Transcript {
    pub devices: Vec<String>,
    pub device_used: String,
    pub client_events: Vec<(EventType, i32)>,
    pub server_events: Vec<(EventType, i32)>,
    /// Private data the server saw on CONNECT_REQUEST (padded length).
    pub request_data: Vec<u8>,
    /// Private data the client saw on ESTABLISHED (padded length).
    pub established_data: Vec<u8>,
    /// The received message, `byte_len` bytes.
    pub received: Vec<u8>,
    pub recv_opcode: WcOpcode,
    pub cq_events_acked: u32,
    pub copies_outstanding_at_end: u64,
}

const STEP: Duration = Duration::from_secs(20);

fn next(ch: &EventChannel, log: &mut Vec<(EventType, i32)>, side: &str, verbose: bool) -> Result<CmEvent> {
    let ev = ch.get_timeout(STEP)?;
    if verbose {
        println!(
            "{side}: {:<16} status {:>4}  private data {:>3} bytes",
            ev.event_type().name(),
            ev.status(),
            ev.private_data().len()
        );
    }
    log.push((ev.event_type(), ev.status()));
    Ok(ev)
}

/// Runs the proof on `addr`. `verbose` prints each event as it arrives.
pub fn run(addr: IpAddr, verbose: bool) -> Result<Transcript> {
    let mut t = Transcript { devices: verbs::device_names()?, ..Default::default() };
    if verbose {
        println!("RDMA devices: {:?}", t.devices);
    }
    let server_ch = EventChannel::new()?;
    let client_ch = EventChannel::new()?;

    let listener = server_ch.create_id(PortSpace::Tcp)?;
    listener.bind_addr((addr, 0).into())?;
    listener.listen(8)?;
    let port = listener.local_port();
    t.device_used = listener.device_context().map(|c| c.name()).unwrap_or_default();
    if verbose {
        println!("server: listening on {addr}:{port} ({})", t.device_used);
    }

    let mut client = client_ch.create_id(PortSpace::Tcp)?;
    client.resolve_addr(None, (addr, port).into(), Duration::from_secs(2))?;
    next(&client_ch, &mut t.client_events, "client", verbose)?;
    client.resolve_route(Duration::from_secs(2))?;
    next(&client_ch, &mut t.client_events, "client", verbose)?;

    let cctx = client.device_context().expect("resolved id has a device");
    let cpd = Pd::new(&cctx)?;
    let ccq = Cq::new(&cctx, 16, None)?;
    let mut cmr = Mr::new(&cpd, 4096)?;
    client.create_qp(&cpd, &ccq, &ccq, QpCaps::default(), false)?;
    client.connect(&ConnectParams { private_data: HELLO, ..Default::default() })?;

    let mut req_ev = next(&server_ch, &mut t.server_events, "server", verbose)?;
    t.request_data = req_ev.private_data().to_vec();
    assert_eq!(req_ev.listen_token(), Some(listener.token()), "request names its listener");
    let mut req = req_ev.take_request().expect("CONNECT_REQUEST on an rdmasafe channel owns its new id");
    drop(req_ev); // the copy is independent of the request from here on
    let sctx = req.id_mut().device_context().expect("request id has a device");
    let spd = Pd::new(&sctx)?;
    let comp = CompChannel::new(&sctx)?;
    let scq = Cq::new(&sctx, 16, Some(&comp))?;
    let smr = Mr::new(&spd, 4096)?;
    req.id_mut().create_qp(&spd, &scq, &scq, QpCaps::default(), false)?;
    req.id_mut().post_recv(&smr, 0, 4096, 0x5e)?;
    scq.req_notify(false)?;
    let server = req.accept(&ConnectParams { private_data: WELCOME, ..Default::default() })?;

    let est = next(&client_ch, &mut t.client_events, "client", verbose)?;
    t.established_data = est.private_data().to_vec();
    let sest = next(&server_ch, &mut t.server_events, "server", verbose)?;
    assert_eq!(sest.token(), Some(server.token()), "ESTABLISHED names the accepted id");

    // One SEND from the client; the server waits for it through its
    // completion channel: get the CQ event, ack it, re-arm, poll.
    cmr.write(0, PAYLOAD)?;
    client.post_send(&cmr, 0, PAYLOAD.len() as u32, 0xc1)?;
    let mut wcs: [_; 4] = std::array::from_fn(|_| verbs::empty_wc());
    let got = comp.get_event(&[&scq], Wait::For(STEP))?;
    t.cq_events_acked = got.ack_events();
    got.req_notify(false)?;
    let n = scq.poll(&mut wcs)?;
    assert!(n >= 1, "a CQ event means a completion is there to poll");
    let wc = &wcs[0];
    assert_eq!(wc.status(), WcStatus::SUCCESS, "receive completion status");
    assert_eq!(wc.wr_id(), 0x5e);
    t.recv_opcode = wc.opcode();
    let mut buf = vec![0u8; wc.byte_len() as usize];
    smr.read(0, &mut buf)?;
    t.received = buf;
    if verbose {
        println!("server: received {} bytes: {:?}", t.received.len(), String::from_utf8_lossy(&t.received));
    }
    // The client's send completion (polled, no channel on that CQ).
    let mut spins = 0u64;
    loop {
        if ccq.poll(&mut wcs)? > 0 {
            assert_eq!(wcs[0].status(), WcStatus::SUCCESS, "send completion status");
            assert_eq!(wcs[0].opcode(), WcOpcode::SEND);
            break;
        }
        spins += 1;
        if spins % 1000 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    // The active side's DISCONNECTED waits for the peer's DREP, which the
    // passive side sends by calling rdma_disconnect on its DISCONNECTED.
    client.disconnect()?;
    next(&server_ch, &mut t.server_events, "server", verbose)?;
    server.disconnect()?;
    next(&client_ch, &mut t.client_events, "client", verbose)?;
    drop((est, sest));
    drop((client, server, listener));
    drop((ccq, scq, cmr, smr, cpd, spd, comp));
    t.copies_outstanding_at_end = rdmasafe_core::cm::counters().outstanding;
    if verbose {
        println!("all ids, QPs, CQs, MRs, PDs destroyed; event copies outstanding: {}", t.copies_outstanding_at_end);
    }
    Ok(t)
}
