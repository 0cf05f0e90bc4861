//! Connected RC pairs whose CQs sit on a completion channel, for the CQ
//! loop tests.

use std::net::IpAddr;
use std::sync::Mutex;

use super::cm::{expect, listen, params, resolved};
use rdmasafe_core::cm::{CmId, EventType as E, PortSpace, QpCaps};
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd};

pub const SLOT: usize = 64;

/// One side of a pair: its id (with the QP) and its buffer. A `CmId` is
/// used by one thread at a time, so handlers on the loop's thread and the
/// test's thread share a side through a mutex.
pub struct Side {
    pub id: CmId,
    pub mr: Mr,
    pub pd: Pd,
}

pub struct RcPair {
    pub server: Mutex<Side>,
    pub client: Mutex<Side>,
    pub server_cq: Cq,
    pub client_cq: Cq,
    _channels: Mutex<(rdmasafe_core::cm::EventChannel, rdmasafe_core::cm::EventChannel, CmId)>,
}

impl RcPair {
    /// Posts a receive of `len` bytes at `offset` of the server's buffer.
    pub fn recv(&self, offset: usize, len: u32, wr_id: u64) {
        let s = self.server.lock().unwrap();
        s.id.post_recv(&s.mr, offset, len, wr_id).unwrap();
    }

    /// Writes `data` at `offset` of the client's buffer and sends `len`
    /// bytes from there.
    pub fn send(&self, offset: usize, data: &[u8], len: u32, wr_id: u64) {
        let mut c = self.client.lock().unwrap();
        c.mr.write(offset, data).unwrap();
        let Side { id, mr, .. } = &*c;
        id.post_send(mr, offset, len, wr_id).unwrap();
    }

    /// Reads the server's buffer at `offset`.
    pub fn read_server(&self, offset: usize, out: &mut [u8]) {
        self.server.lock().unwrap().mr.read(offset, out).unwrap();
    }

    /// The server's QP.
    pub fn server_qp(&self) -> std::ptr::NonNull<rdmasafe_core::sys::ibv_qp> {
        self.server.lock().unwrap().id.raw_qp().unwrap()
    }
}

/// One RC connection over rdma_cm on `addr`. The server CQ is bound to
/// `chan`; the client CQ too when `client_on_chan` (else it has no channel
/// and is polled directly). Each side's QP uses its one CQ for send and
/// receive. `depth` sizes queues and CQs.
pub fn rc_pair(addr: IpAddr, chan: &CompChannel, client_on_chan: bool, depth: u32) -> RcPair {
    rc_pair_sized(addr, chan, client_on_chan, depth, 2 * depth as i32)
}

/// Like [`rc_pair`] with the server CQ's size chosen (e.g. smaller than the
/// receive queue, to overrun it).
pub fn rc_pair_sized(addr: IpAddr, chan: &CompChannel, client_on_chan: bool, depth: u32, server_cqe: i32) -> RcPair {
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, max_sge: 1, max_inline_data: 0 };
    rc_pair_with(addr, chan, client_on_chan, caps, server_cqe)
}

/// Like [`rc_pair_sized`] with the QP sizes chosen (e.g. inline data).
pub fn rc_pair_with(addr: IpAddr, chan: &CompChannel, client_on_chan: bool, caps: QpCaps, server_cqe: i32) -> RcPair {
    let depth = caps.max_send_wr.max(caps.max_recv_wr);
    let l = listen(addr, PortSpace::Tcp, 8);
    let cch = rdmasafe_core::cm::EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, addr, l.port);
    let ctx = client.device_context().unwrap();
    let cpd = Pd::new(&ctx).unwrap();
    let client_cq = Cq::new(&ctx, 2 * depth as i32, client_on_chan.then_some(chan)).unwrap();
    client.create_qp(&cpd, &client_cq, &client_cq, caps, false).unwrap();
    let client_mr = Mr::new(&cpd, SLOT * depth as usize).unwrap();
    client.connect(&params(b"rc")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    let sctx = r.id_mut().device_context().unwrap();
    assert_eq!(sctx, ctx, "one device");
    let spd = Pd::new(&sctx).unwrap();
    let server_cq = Cq::new(&sctx, server_cqe, Some(chan)).unwrap();
    r.id_mut().create_qp(&spd, &server_cq, &server_cq, caps, false).unwrap();
    let server_mr = Mr::new(&spd, SLOT * depth as usize).unwrap();
    let server = r.accept(&params(b"ok")).unwrap();
    expect(&cch, E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    RcPair {
        server: Mutex::new(Side { id: server, mr: server_mr, pd: spd }),
        client: Mutex::new(Side { id: client, mr: client_mr, pd: cpd }),
        server_cq,
        client_cq,
        _channels: Mutex::new((cch, l.ch, l.id)),
    }
}

/// A second RC connection whose server QP uses `cq` for both queues (a CQ
/// shared by two QPs); what must outlive the test, and the server QP.
pub fn second_qp_on(addr: IpAddr, cq: &Cq) -> (impl Sized, std::ptr::NonNull<rdmasafe_core::sys::ibv_qp>) {
    let caps = QpCaps { max_send_wr: 8, max_recv_wr: 8, max_sge: 1, max_inline_data: 0 };
    let l = listen(addr, PortSpace::Tcp, 8);
    let cch = rdmasafe_core::cm::EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, addr, l.port);
    let ctx = client.device_context().unwrap();
    let cpd = Pd::new(&ctx).unwrap();
    let client_cq = Cq::new(&ctx, 16, None).unwrap();
    client.create_qp(&cpd, &client_cq, &client_cq, caps, false).unwrap();
    client.connect(&params(b"rc")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    let spd = Pd::new(&r.id_mut().device_context().unwrap()).unwrap();
    r.id_mut().create_qp(&spd, cq, cq, caps, false).unwrap();
    let server = r.accept(&params(b"ok")).unwrap();
    expect(&cch, E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    let qp = server.raw_qp().unwrap();
    ((server, client, client_cq, spd, cpd, cch, l), qp)
}
