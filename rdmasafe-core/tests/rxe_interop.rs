//! Interop with the sideway verbs crate (feature `sideway`), on Soft-RoCE:
//! sideway's QPs, CQs and completion channel, rdmasafe's CM ids and CQ
//! loop. A client connects through rdmasafe (private data both ways: a
//! hello, and the server's buffer for RDMA), then writes with immediate into
//! the server's buffer and reads another part of it back, on a sideway
//! extended QP. Asserted: the bytes arrived both ways; each completion is
//! delivered once, by the loop, with its opcode, length and immediate; the
//! server's unused receives come back flushed, once each, at disconnect;
//! the loop refuses a CQ twice and a CQ of another channel; one CQ leaves
//! the loop, the other is destroyed by the loop's drop; everything is
//! destroyed without a hang (the watchdog turns one into a failure).

mod common;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::cm::{assert_data, expect, listen, pattern, resolved, STEP};
use rdmasafe_core::cm::{ConnectParams, EventChannel, EventType, PortSpace, SendOptions};
use rdmasafe_core::cq::{LoopOptions, Mode, WcOpcode, WcStatus};
use rdmasafe_core::sideway::sideway::ibverbs::completion::{CompletionChannel, GenericCompletionQueue};
use rdmasafe_core::sideway::sideway::ibverbs::device_context::DeviceContext;
use rdmasafe_core::sideway::sideway::ibverbs::protection_domain::ProtectionDomain;
use rdmasafe_core::sideway::sideway::ibverbs::queue_pair::ExtendedQueuePair;
use rdmasafe_core::sideway::{open_device, Buffer, CompletionLoop, Qp, RemoteBuffer};

const LEN: usize = 4096;
const IMM: u32 = 0x5eed_1234;
const HELLO: &[u8] = b"sideway client, rdmasafe CM";
const WRITE_ID: u64 = 1;
const READ_ID: u64 = 2;
/// The server's receives: the first takes the write's immediate, the others
/// are flushed at disconnect.
const RECV_IDS: [u64; 4] = [100, 101, 102, 103];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    side: char,
    wr_id: u64,
    ok: bool,
    flushed: bool,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
}

fn cq_on(ctx: &Arc<DeviceContext>, chan: &Arc<CompletionChannel>) -> GenericCompletionQueue {
    GenericCompletionQueue::from(ctx.create_cq_builder().setup_cqe(32).setup_comp_channel(chan, 0).build().expect("cq"))
}

fn qp_on(pd: &Arc<ProtectionDomain>, cq: &GenericCompletionQueue) -> Qp<ExtendedQueuePair> {
    let qp = pd
        .create_qp_builder()
        .setup_max_send_wr(8)
        .setup_max_recv_wr(8)
        .setup_send_cq(cq.clone())
        .setup_recv_cq(cq.clone())
        .build_ex()
        .expect("sideway extended QP");
    Qp::new(qp)
}

fn next(rx: &mpsc::Receiver<Seen>, what: &str) -> Seen {
    rx.recv_timeout(STEP).unwrap_or_else(|e| panic!("waiting for {what}: {e}"))
}

#[test]
fn sideway_data_path_over_rdmasafe_cm_and_cq_loop() {
    let _dog = common::watchdog("sideway interop", Duration::from_secs(240));
    let bed = common::bed();

    let server = listen(bed.addr, PortSpace::Tcp, 4);
    let cch = EventChannel::new().expect("client channel");
    let cid = resolved(&cch, PortSpace::Tcp, bed.addr, server.port);

    // One sideway context, one channel, one rdmasafe loop for both sides'
    // CQs (several CQs on one channel, each event acked on its own CQ).
    let ctx = open_device(&cid).expect("sideway context on the id's device");
    let chan = CompletionChannel::new(&ctx).expect("sideway completion channel");
    let lp = CompletionLoop::new(&chan, LoopOptions { mode: Mode::Event, ..Default::default() }).expect("loop");
    let (tx, rx) = mpsc::channel::<Seen>();
    let handler = |side: char| {
        let tx = tx.clone();
        move |wcs: &[rdmasafe_core::cq::Wc], _: &rdmasafe_core::cq::LoopControl| {
            for wc in wcs {
                let _ = tx.send(Seen {
                    side,
                    wr_id: wc.wr_id(),
                    ok: wc.is_success(),
                    flushed: wc.status() == WcStatus::WR_FLUSH_ERR,
                    opcode: wc.opcode(),
                    byte_len: wc.byte_len(),
                    imm: wc.imm_data(),
                });
            }
        }
    };

    // Client: its QP on the sideway context, connected through the rdmasafe id.
    let ccq = cq_on(&ctx, &chan);
    lp.add_cq(&ccq, handler('c')).expect("add client CQ");
    // Misuse is refused: the same CQ twice, a CQ of another channel.
    assert_eq!(lp.add_cq(&ccq, |_: &[_], _: &_| {}).unwrap_err().errno(), libc::EBUSY, "a CQ in the loop already");
    let other_chan = CompletionChannel::new(&ctx).expect("a second channel");
    let other_cq = cq_on(&ctx, &other_chan);
    assert_eq!(lp.add_cq(&other_cq, |_: &[_], _: &_| {}).unwrap_err().errno(), libc::EINVAL, "a CQ of another channel");
    drop((other_cq, other_chan));
    let cpd = ctx.alloc_pd().expect("client pd");
    let mut cqp = qp_on(&cpd, &ccq);
    let mut cbuf = Buffer::new(&cpd, 2 * LEN).expect("client buffer");
    let written = pattern(LEN, 11);
    cbuf.write(0, &written).expect("fill");
    cqp.connect(&cid, &ConnectParams { private_data: HELLO, ..Default::default() }).expect("connect");

    // Server: a request with the hello; its QP goes to RTS and accepts.
    let mut ev = expect(&server.ch, EventType::CONNECT_REQUEST);
    assert_data(ev.private_data(), HELLO, "hello");
    let mut req = ev.take_request().expect("the request's id");
    let sctx = open_device(req.id_mut()).expect("server context");
    assert!(Arc::ptr_eq(&sctx, &ctx), "one sideway context per device");
    let scq = cq_on(&sctx, &chan);
    lp.add_cq(&scq, handler('s')).expect("add server CQ");
    let spd = sctx.alloc_pd().expect("server pd");
    let mut sqp = qp_on(&spd, &scq);
    let mut sbuf = Buffer::new(&spd, 2 * LEN).expect("server buffer");
    let served = pattern(LEN, 77);
    sbuf.write(LEN, &served).expect("fill");
    // A QP in RESET takes no receives: accept_with posts them once the QP
    // is in RTS, before rdma_accept tells the client.
    assert_eq!(sqp.post_recv_empty(RECV_IDS[0]).unwrap_err().errno(), libc::EINVAL, "a receive on a RESET QP");
    let offer = sbuf.remote(0, 2 * LEN).expect("remote").to_bytes();
    let sid = sqp
        .accept_with(req, &ConnectParams { private_data: &offer, ..Default::default() }, |qp| {
            RECV_IDS.iter().try_for_each(|id| qp.post_recv_empty(*id))
        })
        .expect("accept");

    // Client: the response carries the server's buffer; establish.
    let resp = expect(&cch, EventType::CONNECT_RESPONSE);
    assert_eq!(resp.token(), Some(cid.token()));
    let remote = RemoteBuffer::from_bytes(resp.private_data()).expect("the server's buffer");
    assert_eq!(remote.len, 2 * LEN as u64);
    cqp.establish(&cid).expect("establish");
    let est = expect(&server.ch, EventType::ESTABLISHED);
    assert_eq!(est.token(), Some(sid.token()));

    // The data path is sideway's; the loop delivers the completions.
    let th = lp.spawn(None).expect("loop thread");
    let signaled = SendOptions::default();
    cqp.post_write_with_imm(WRITE_ID, &cbuf, 0, LEN as u32, &remote, 0, IMM, signaled).expect("write with imm");
    cqp.post_read(READ_ID, &cbuf, LEN, LEN as u32, &remote, LEN as u64, signaled).expect("read");
    // Out of bounds is refused before sideway sees it.
    assert_eq!(
        cqp.post_read(9, &cbuf, LEN, LEN as u32, &remote, LEN as u64 + 1, signaled).unwrap_err().errno(),
        libc::EINVAL
    );

    let mut seen: Vec<Seen> = (0..3).map(|_| next(&rx, "the data path's completions")).collect();
    seen.sort_by_key(|s| s.wr_id);
    let want =
        |side, wr_id, opcode, byte_len, imm| Seen { side, wr_id, ok: true, flushed: false, opcode, byte_len, imm };
    // byte_len and imm_data of a send-side completion are undefined by the
    // verbs spec (rxe reports the length, and IBV_WC_WITH_IMM with 0 for a
    // write with immediate): only the receiver's are asserted.
    let (len0, imm0) = (seen[0].byte_len, seen[0].imm);
    assert_eq!(seen[0], Seen { byte_len: len0, imm: imm0, ..want('c', WRITE_ID, WcOpcode::RDMA_WRITE, 0, None) });
    assert_eq!(seen[1], want('c', READ_ID, WcOpcode::RDMA_READ, LEN as u32, None));
    assert_eq!(seen[2], want('s', RECV_IDS[0], WcOpcode::RECV_RDMA_WITH_IMM, LEN as u32, Some(IMM)));

    let mut got = vec![0u8; LEN];
    sbuf.read(0, &mut got).expect("read back");
    assert!(got == written, "the RDMA WRITE's bytes did not arrive in the server's buffer");
    cbuf.read(LEN, &mut got).expect("read back");
    assert!(got == served, "the RDMA READ did not bring the server's bytes");

    // Teardown: disconnect (the QPs go to the error state and flush what is
    // left: the server's three unused receives), both ids see DISCONNECTED:
    // the server on the client's DREQ, the client once the server's own
    // rdma_disconnect answers it (DREP).
    cqp.disconnect(&cid).expect("client disconnect");
    expect(&server.ch, EventType::DISCONNECTED);
    sqp.disconnect(&sid).expect("server disconnect");
    expect(&cch, EventType::DISCONNECTED);
    let mut flushed: Vec<Seen> = (0..3).map(|_| next(&rx, "the flushed receives")).collect();
    flushed.sort_by_key(|s| s.wr_id);
    for (s, id) in flushed.iter().zip(&RECV_IDS[1..]) {
        assert_eq!((s.side, s.wr_id, s.ok, s.flushed), ('s', *id, false, true), "{s:?}");
    }

    let lp = th.stop().expect("stop the loop");
    assert!(rx.try_recv().is_err(), "a completion was delivered twice or one too many");
    let stats = lp.stats();
    assert_eq!((stats.completions, stats.error_completions), (6, 3), "{stats:?}");
    assert_eq!(stats.unacked_now, 0, "{stats:?}");
    assert_eq!(stats.foreign_cq_events, 0, "{stats:?}");
    lp.remove_cq(&ccq).expect("remove client CQ");
    assert_eq!(lp.remove_cq(&ccq).unwrap_err().errno(), libc::ENOENT);
    assert_eq!(lp.stats().cqs, 1);

    // QPs first (they hold their CQs), then the loop, then the CQs,
    // buffers, PDs, context; ids last. The server CQ stays in the loop and
    // the test drops its own handle before the loop: the loop's clone keeps
    // it alive, and dropping the loop acks what it read before that clone
    // goes (ibv_destroy_cq would hang on an unacked event; the watchdog
    // turns a hang into a failure).
    drop((cqp, sqp));
    drop(scq);
    drop(lp);
    drop((ccq, chan));
    drop((cbuf, sbuf, cpd, spd, sctx, ctx));
    drop((sid, cid, server));
}

/// A client and a server sideway QP connected through rdmasafe ids, the
/// server with one receive posted and its buffer offered in the accept.
struct Pair {
    cqp: Qp<ExtendedQueuePair>,
    sqp: Qp<ExtendedQueuePair>,
    cbuf: Buffer,
    sbuf: Buffer,
    remote: RemoteBuffer,
    pds: (Arc<ProtectionDomain>, Arc<ProtectionDomain>),
    ids: (rdmasafe_core::cm::CmId, rdmasafe_core::cm::CmId),
    chans: (EventChannel, common::cm::Listener),
}

fn connect_pair(
    addr: std::net::IpAddr,
    ctx: &Arc<DeviceContext>,
    ccq: &GenericCompletionQueue,
    scq: &GenericCompletionQueue,
    recv_id: u64,
) -> Pair {
    let server = listen(addr, PortSpace::Tcp, 1);
    let cch = EventChannel::new().expect("client channel");
    let cid = resolved(&cch, PortSpace::Tcp, addr, server.port);
    let cpd = ctx.alloc_pd().expect("client pd");
    let spd = ctx.alloc_pd().expect("server pd");
    let mut cqp = qp_on(&cpd, ccq);
    let mut sqp = qp_on(&spd, scq);
    let cbuf = Buffer::new(&cpd, LEN).expect("client buffer");
    let sbuf = Buffer::new(&spd, LEN).expect("server buffer");
    cqp.connect(&cid, &ConnectParams::default()).expect("connect");
    let mut ev = expect(&server.ch, EventType::CONNECT_REQUEST);
    let req = ev.take_request().expect("the request's id");
    let offer = sbuf.remote(0, LEN).expect("remote").to_bytes();
    let sid = sqp
        .accept_with(req, &ConnectParams { private_data: &offer, ..Default::default() }, |qp| {
            qp.post_recv_empty(recv_id)
        })
        .expect("accept");
    let resp = expect(&cch, EventType::CONNECT_RESPONSE);
    let remote = RemoteBuffer::from_bytes(resp.private_data()).expect("the server's buffer");
    cqp.establish(&cid).expect("establish");
    expect(&server.ch, EventType::ESTABLISHED);
    Pair { cqp, sqp, cbuf, sbuf, remote, pds: (cpd, spd), ids: (cid, sid), chans: (cch, server) }
}

/// Sets a flag when dropped: tells the test that the loop dropped a handler.
struct DropFlag(mpsc::Sender<&'static str>, &'static str);

impl Drop for DropFlag {
    fn drop(&mut self) {
        let _ = self.0.send(self.1);
    }
}

/// sideway CQs join a running loop from another thread (SidewayControl on
/// the loop's control), and one leaves it from inside its own handler:
/// the removal is pending until the handler returns, the handler is never
/// called again and is dropped (with the loop's clone of the CQ) once the
/// CQ is out; removing it again is ENOENT.
#[test]
fn sideway_cqs_join_and_leave_a_running_loop() {
    use rdmasafe_core::cq::Outcome;
    use rdmasafe_core::sideway::SidewayControl;

    let _dog = common::watchdog("sideway live CQs", Duration::from_secs(240));
    let bed = common::bed();
    let lookup = EventChannel::new().expect("channel");
    let probe = lookup.create_id(PortSpace::Tcp).expect("id");
    probe.bind_addr((bed.addr, 0).into()).expect("bind: the id is on the device now");
    let ctx = open_device(&probe).expect("sideway context");
    drop((probe, lookup));
    let chan = CompletionChannel::new(&ctx).expect("sideway completion channel");
    let ccq = cq_on(&ctx, &chan);
    let scq = cq_on(&ctx, &chan);

    // The loop runs (and sleeps: it has no CQ yet) on its own thread.
    let lp = CompletionLoop::new(&chan, LoopOptions { mode: Mode::Event, ..Default::default() }).expect("loop");
    let opts = lp.cq_loop().default_cq_options();
    let th = lp.spawn(None).expect("loop thread");
    let ctl = th.control();
    let (tx, rx) = mpsc::channel::<Seen>();
    let (gone_tx, gone_rx) = mpsc::channel::<&'static str>();
    let (out_tx, out_rx) = mpsc::channel::<Result<Outcome, i32>>();

    let client_tx = tx.clone();
    let outcome = ctl
        .add_sideway_cq(&ccq, opts, move |wcs, _| {
            for wc in wcs {
                let s = Seen {
                    side: 'c',
                    wr_id: wc.wr_id(),
                    ok: wc.is_success(),
                    flushed: false,
                    opcode: wc.opcode(),
                    byte_len: 0,
                    imm: None,
                };
                let _ = client_tx.send(s);
            }
        })
        .expect("add the client CQ to the running loop");
    assert_eq!(outcome, Outcome::Done, "added from another thread: done when the call returns");

    let scq_in_handler = scq.clone();
    let flag = DropFlag(gone_tx.clone(), "server handler");
    let mut calls = 0;
    let outcome = ctl
        .add_sideway_cq(&scq, opts, move |wcs, ctl| {
            let _alive = &flag;
            calls += 1;
            for wc in wcs {
                let s = Seen {
                    side: 's',
                    wr_id: wc.wr_id(),
                    ok: wc.is_success(),
                    flushed: false,
                    opcode: wc.opcode(),
                    byte_len: wc.byte_len(),
                    imm: wc.imm_data(),
                };
                let _ = tx.send(s);
            }
            // Leave the loop from inside the handler, on the first call.
            if calls == 1 {
                let _ = out_tx.send(ctl.remove_sideway_cq(&scq_in_handler).map_err(|e| e.errno()));
            } else {
                let _ = tx.send(Seen {
                    side: '!',
                    wr_id: calls,
                    ok: false,
                    flushed: false,
                    opcode: WcOpcode(u32::MAX),
                    byte_len: 0,
                    imm: None,
                });
            }
        })
        .expect("add the server CQ to the running loop");
    assert_eq!(outcome, Outcome::Done);
    assert_eq!(ctl.add_sideway_cq(&scq, opts, |_, _| {}).unwrap_err().errno(), libc::EBUSY, "a CQ in the loop already");

    let mut p = connect_pair(bed.addr, &ctx, &ccq, &scq, RECV_IDS[0]);
    let data = pattern(LEN, 5);
    p.cbuf.write(0, &data).expect("fill");
    let signaled = SendOptions::default();
    p.cqp.post_write_with_imm(WRITE_ID, &p.cbuf, 0, LEN as u32, &p.remote, 0, IMM, signaled).expect("write with imm");

    let mut seen: Vec<Seen> = (0..2).map(|_| next(&rx, "the write's completions")).collect();
    seen.sort_by_key(|s| s.side);
    assert_eq!((seen[0].side, seen[0].wr_id, seen[0].ok, seen[0].opcode), ('c', WRITE_ID, true, WcOpcode::RDMA_WRITE));
    assert_eq!(
        (seen[1].side, seen[1].wr_id, seen[1].ok, seen[1].opcode, seen[1].imm),
        ('s', RECV_IDS[0], true, WcOpcode::RECV_RDMA_WITH_IMM, Some(IMM))
    );
    let removal = out_rx.recv_timeout(STEP).expect("the handler's removal");
    assert_eq!(removal, Ok(Outcome::Pending), "a removal from the CQ's own handler is pending until it returns");

    // Stopping the loop joins its thread: the handler has returned, the
    // removal is applied and the handler (with the loop's CQ clone) dropped.
    let lp = th.stop().expect("stop the loop");
    assert_eq!(gone_rx.recv_timeout(STEP), Ok("server handler"), "the removed CQ's handler was dropped");
    assert_eq!(lp.remove_cq(&scq).unwrap_err().errno(), libc::ENOENT, "the server CQ left the loop");
    assert_eq!(lp.stats().cqs, 1, "the client CQ is still in");
    assert!(rx.try_recv().is_err(), "no completion delivered twice, no call after the removal");
    let mut got = vec![0u8; LEN];
    p.sbuf.read(0, &mut got).expect("read back");
    assert!(got == data, "the write's bytes did not arrive");

    drop((p.cqp, p.sqp));
    drop(lp);
    drop((ccq, scq, chan, p.cbuf, p.sbuf, p.pds));
    drop((p.ids, p.chans, ctx));
}
