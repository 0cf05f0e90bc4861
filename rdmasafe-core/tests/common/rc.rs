//! Connected RC pairs whose CQs sit on a completion channel, for the CQ
//! loop tests.

use std::net::IpAddr;
use std::sync::Arc;

use super::cm::{expect, listen, params, resolved};
use rdmasafe_core::cm::{CmId, EventType as E, PortSpace, QpCaps};
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd};

pub const SLOT: usize = 64;

pub struct RcPair {
    pub server: Arc<CmId>,
    pub client: Arc<CmId>,
    pub server_cq: Cq,
    pub client_cq: Cq,
    pub server_mr: Mr,
    pub client_mr: Mr,
    _channels: (rdmasafe_core::cm::EventChannel, rdmasafe_core::cm::EventChannel, CmId),
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
    let l = listen(addr, PortSpace::Tcp, 8);
    let cch = rdmasafe_core::cm::EventChannel::new().unwrap();
    let mut client = resolved(&cch, PortSpace::Tcp, addr, l.port);
    let ctx = client.device_context().unwrap();
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, max_sge: 1, max_inline_data: 0 };
    let cpd = Pd::new(ctx).unwrap();
    let client_cq = Cq::new(ctx, 2 * depth as i32, client_on_chan.then_some(chan)).unwrap();
    client.create_qp(&cpd, &client_cq, &client_cq, caps, false).unwrap();
    let client_mr = Mr::new(&cpd, SLOT * depth as usize).unwrap();
    client.connect(&params(b"rc")).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    let sctx = r.id_mut().device_context().unwrap();
    assert_eq!(sctx, ctx, "one device");
    let spd = Pd::new(sctx).unwrap();
    let server_cq = Cq::new(sctx, server_cqe, Some(chan)).unwrap();
    r.id_mut().create_qp(&spd, &server_cq, &server_cq, caps, false).unwrap();
    let server_mr = Mr::new(&spd, SLOT * depth as usize).unwrap();
    let server = r.accept(&params(b"ok")).unwrap();
    expect(&cch, E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    RcPair {
        server: Arc::new(server),
        client: Arc::new(client),
        server_cq,
        client_cq,
        server_mr,
        client_mr,
        _channels: (cch, l.ch, l.id),
    }
}
