//! sideway for the data path, rdmasafe for the connection manager and the
//! completions (feature `sideway`, see docs/interop.md).
//!
//! A server thread listens through an rdmasafe CM id, a client connects
//! through another; both QPs are sideway extended QPs (`ibv_wr_*`). The
//! server offers a buffer in its accept's private data; the client RDMA
//! WRITEs a message into it with an immediate (the server's receive
//! completion carries it) and RDMA READs the server's reply from it. One
//! rdmasafe CQ loop on one sideway completion channel serves both sides'
//! CQs. No raw pointer and no `unsafe` here.
//!
//! Run it in the Soft-RoCE guest (the cargo runner boots it):
//! `cargo run --example rxe_interop --features sideway`. Outside the guest,
//! set RDMASAFE_TEST_ADDR to an address on an RDMA device.

use std::net::{IpAddr, SocketAddr};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rdmasafe_core::cm::{CmEvent, ConnectParams, EventChannel, EventType, PortSpace, SendOptions};
use rdmasafe_core::cq::{LoopOptions, Mode, Wc};
use rdmasafe_core::sideway::sideway::ibverbs::completion::{CompletionChannel, GenericCompletionQueue};
use rdmasafe_core::sideway::sideway::ibverbs::device_context::DeviceContext;
use rdmasafe_core::sideway::sideway::ibverbs::protection_domain::ProtectionDomain;
use rdmasafe_core::sideway::sideway::ibverbs::queue_pair::ExtendedQueuePair;
use rdmasafe_core::sideway::{open_device, Buffer, CompletionLoop, Qp, RemoteBuffer};
use rdmasafe_core::{Error, Result};

const MSG: &[u8] = b"hello from the client, written by sideway";
const REPLY: &[u8] = b"and this the client read back";
const IMM: u32 = 0x1234_5678;
const STEP: Duration = Duration::from_secs(30);

/// What the loop's handlers saw: (side, wr_id, ok, immediate).
type Seen = (&'static str, u64, bool, Option<u32>);

fn main() {
    let addr: IpAddr = match std::env::var("RDMASAFE_TEST_ADDR").ok().and_then(|a| a.parse().ok()) {
        Some(a) => a,
        None => {
            eprintln!("rxe_interop: set RDMASAFE_TEST_ADDR, or run it through the test bed (cargo run --example rxe_interop --features sideway)");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(addr) {
        eprintln!("rxe_interop: failed: {e}");
        std::process::exit(1);
    }
    println!("rxe_interop: OK");
}

fn expect(ch: &EventChannel, want: EventType) -> Result<CmEvent> {
    let ev = ch.get_timeout(STEP)?;
    if ev.event_type() != want {
        eprintln!("expected {want}, got {} (status {})", ev.event_type(), ev.status());
        return Err(Error::new("unexpected CM event", libc::EPROTO));
    }
    Ok(ev)
}

fn cq_on(ctx: &Arc<DeviceContext>, chan: &Arc<CompletionChannel>) -> Result<GenericCompletionQueue> {
    let cq = ctx.create_cq_builder().setup_cqe(16).setup_comp_channel(chan, 0).build();
    Ok(GenericCompletionQueue::from(cq.map_err(|e| Error::new("sideway: create CQ", errno(&e)))?))
}

fn qp_on(pd: &Arc<ProtectionDomain>, cq: &GenericCompletionQueue) -> Result<Qp<ExtendedQueuePair>> {
    let qp = pd.create_qp_builder().setup_send_cq(cq.clone()).setup_recv_cq(cq.clone()).build_ex();
    Ok(Qp::new(qp.map_err(|e| Error::new("sideway: create QP", errno(&e)))?))
}

fn errno(e: &dyn std::error::Error) -> i32 {
    eprintln!("sideway: {e}");
    libc::EIO
}

fn run(addr: IpAddr) -> Result<()> {
    // The server's listening id (rdmasafe): bound, so the client can find it.
    let sch = EventChannel::new()?;
    let listener = sch.create_id(PortSpace::Tcp)?;
    listener.bind_addr(SocketAddr::new(addr, 0))?;
    listener.listen(1)?;
    let port = listener.local_port();

    // The client's id resolves the server: from here on the device is known.
    let cch = EventChannel::new()?;
    let cid = cch.create_id(PortSpace::Tcp)?;
    cid.resolve_addr(None, SocketAddr::new(addr, port), Duration::from_secs(5))?;
    expect(&cch, EventType::ADDR_RESOLVED)?;
    cid.resolve_route(Duration::from_secs(5))?;
    expect(&cch, EventType::ROUTE_RESOLVED)?;

    // sideway objects on the id's device; rdmasafe's loop on sideway's
    // channel, on a thread of its own, serving both sides' CQs.
    let ctx = open_device(&cid)?;
    let chan = CompletionChannel::new(&ctx).map_err(|e| Error::new("sideway: completion channel", errno(&e)))?;
    let lp = CompletionLoop::new(&chan, LoopOptions { mode: Mode::Event, ..Default::default() })?;
    let (tx, rx) = mpsc::channel::<Seen>();
    let handler = |side: &'static str| {
        let tx = tx.clone();
        move |wcs: &[Wc], _: &rdmasafe_core::cq::LoopControl| {
            for wc in wcs {
                println!("[{side}] completion wr_id {} {} opcode {:?}", wc.wr_id(), wc.status(), wc.opcode());
                let _ = tx.send((side, wc.wr_id(), wc.is_success(), wc.imm_data()));
            }
        }
    };
    let ccq = cq_on(&ctx, &chan)?;
    let scq = cq_on(&ctx, &chan)?;
    lp.add_cq(&ccq, handler("client"))?;
    lp.add_cq(&scq, handler("server"))?;
    let lp = lp.spawn(None)?;
    let wait = || rx.recv_timeout(STEP).map_err(|_| Error::new("waiting for a completion", libc::ETIMEDOUT));

    // Server thread: accepts one connection on a sideway QP, offers a buffer.
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (sctx, scq2) = (ctx.clone(), scq.clone());
    let server = std::thread::spawn(move || -> Result<Vec<u8>> {
        let mut ev = expect(&sch, EventType::CONNECT_REQUEST)?;
        println!("[server] connect request, private data {:?}", String::from_utf8_lossy(&ev.private_data()[..5]));
        let req = ev.take_request().expect("a request carries its id");
        let pd = sctx.alloc_pd().map_err(|e| Error::new("sideway: PD", errno(&e)))?;
        let mut qp = qp_on(&pd, &scq2)?;
        let mut buf = Buffer::new(&pd, 4096)?;
        buf.write(2048, REPLY)?;
        let offer = buf.remote(0, 4096)?.to_bytes();
        let params = ConnectParams { private_data: &offer, ..Default::default() };
        // The receive for the write's immediate goes in before the accept.
        let sid = qp.accept_with(req, &params, |qp| qp.post_recv_empty(7))?;
        expect(&sch, EventType::ESTABLISHED)?;
        ready_tx.send(()).ok();
        // The client disconnects when it is done; then the bytes are in.
        expect(&sch, EventType::DISCONNECTED)?;
        qp.disconnect(&sid)?;
        let mut got = vec![0u8; MSG.len()];
        buf.read(0, &mut got)?;
        drop(qp); // the QP before its buffer and its id
        drop((buf, sid, listener));
        Ok(got)
    });

    // Client: a sideway QP connected through the rdmasafe id.
    let pd = ctx.alloc_pd().map_err(|e| Error::new("sideway: PD", errno(&e)))?;
    let mut qp = qp_on(&pd, &ccq)?;
    let mut buf = Buffer::new(&pd, 4096)?;
    buf.write(0, MSG)?;
    qp.connect(&cid, &ConnectParams { private_data: b"hello", ..Default::default() })?;
    let resp = expect(&cch, EventType::CONNECT_RESPONSE)?;
    let remote = RemoteBuffer::from_bytes(resp.private_data()).ok_or(Error::new("server's buffer", libc::EPROTO))?;
    qp.establish(&cid)?;
    ready_rx.recv_timeout(STEP).map_err(|_| Error::new("server not established", libc::ETIMEDOUT))?;

    // The data path, sideway's: WRITE with immediate, then READ.
    let sig = SendOptions::default();
    qp.post_write_with_imm(1, &buf, 0, MSG.len() as u32, &remote, 0, IMM, sig)?;
    qp.post_read(2, &buf, 1024, REPLY.len() as u32, &remote, 2048, sig)?;
    let mut seen = [wait()?, wait()?, wait()?];
    seen.sort_by_key(|s| s.1);
    let ok = seen.iter().all(|s| s.2) && seen[2] == ("server", 7, true, Some(IMM));
    let mut reply = vec![0u8; REPLY.len()];
    buf.read(1024, &mut reply)?;
    println!("[client] read back {:?}", String::from_utf8_lossy(&reply));

    qp.disconnect(&cid)?;
    expect(&cch, EventType::DISCONNECTED)?;
    let written = server.join().expect("server thread")?;
    println!("[server] found {:?} in its buffer", String::from_utf8_lossy(&written));

    // Teardown: QPs, then the loop (it acks what it read), then the CQs.
    drop(qp);
    let lp = lp.stop()?;
    lp.remove_cq(&ccq)?;
    lp.remove_cq(&scq)?;
    drop((lp, ccq, scq, chan, buf, pd, cid));
    if !ok || written != MSG || reply != REPLY {
        return Err(Error::new("data or completions differ from what was sent", libc::EPROTO));
    }
    Ok(())
}
