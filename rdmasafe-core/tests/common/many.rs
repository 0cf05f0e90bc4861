//! Many RC connections at once, each QP with a CQ of its own on one
//! completion channel (for the CQ loop at scale).

use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use super::cm::{expect, listen, params};
use rdmasafe_core::cm::{CmId, EventChannel, EventType as E, PortSpace, QpCaps};
use rdmasafe_core::verbs::{CompChannel, Cq, Mr, Pd};

pub const SLOT: usize = 64;

/// `n` connections: `clients[i]` talks to `servers[i]`; `cqs[2 i]` is
/// client i's CQ, `cqs[2 i + 1]` server i's, all on `chan`. One buffer per
/// side, `SLOT` bytes per connection and message index.
pub struct Many {
    pub clients: Mutex<Vec<CmId>>,
    pub servers: Mutex<Vec<CmId>>,
    pub cqs: Vec<Cq>,
    pub client_mr: Mutex<Mr>,
    pub server_mr: Mutex<Mr>,
    pub per_conn: usize,
    _keep: Mutex<(EventChannel, EventChannel, CmId)>,
}

pub fn many(addr: IpAddr, chan: &CompChannel, n: usize, depth: u32) -> Many {
    let l = listen(addr, PortSpace::Tcp, (2 * n) as i32);
    let cch = EventChannel::new().unwrap();
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, max_sge: 1, max_inline_data: 0 };
    let step = Duration::from_secs(60);
    let mut clients: Vec<CmId> = (0..n).map(|_| cch.create_id(PortSpace::Tcp).unwrap()).collect();
    for c in &clients {
        c.resolve_addr(None, (addr, l.port).into(), step).unwrap();
    }
    for _ in 0..n {
        expect(&cch, E::ADDR_RESOLVED);
    }
    for c in &clients {
        c.resolve_route(step).unwrap();
    }
    for _ in 0..n {
        expect(&cch, E::ROUTE_RESOLVED);
    }
    let ctx = clients[0].device_context().unwrap();
    let cpd = Pd::new(&ctx).unwrap();
    let mut cqs = Vec::with_capacity(2 * n);
    let per_conn = depth as usize;
    let client_mr = Mr::new(&cpd, SLOT * per_conn * n).unwrap();
    let spd = Pd::new(&ctx).unwrap();
    let server_mr = Mr::new(&spd, SLOT * per_conn * n).unwrap();
    let mut client_cqs = Vec::with_capacity(n);
    for c in clients.iter_mut() {
        let cq = Cq::new(&ctx, 2 * depth as i32, Some(chan)).unwrap();
        c.create_qp(&cpd, &cq, &cq, caps, false).unwrap();
        client_cqs.push(cq);
    }
    // Connect one at a time, in order, so servers[i] is clients[i]'s peer.
    let mut servers = Vec::with_capacity(n);
    let mut server_cqs = Vec::with_capacity(n);
    for c in &clients {
        c.connect(&params(b"m")).unwrap();
        let mut req = expect(&l.ch, E::CONNECT_REQUEST);
        let mut r = req.take_request().unwrap();
        let cq = Cq::new(&ctx, 2 * depth as i32, Some(chan)).unwrap();
        r.id_mut().create_qp(&spd, &cq, &cq, caps, false).unwrap();
        servers.push(r.accept(&params(b"ok")).unwrap());
        server_cqs.push(cq);
        expect(&cch, E::ESTABLISHED);
        expect(&l.ch, E::ESTABLISHED);
    }
    for (c, s) in client_cqs.into_iter().zip(server_cqs) {
        cqs.push(c);
        cqs.push(s);
    }
    Many {
        clients: Mutex::new(clients),
        servers: Mutex::new(servers),
        cqs,
        client_mr: Mutex::new(client_mr),
        server_mr: Mutex::new(server_mr),
        per_conn,
        _keep: Mutex::new((cch, l.ch, l.id)),
    }
}

impl Many {
    pub fn n(&self) -> usize {
        self.cqs.len() / 2
    }

    fn slot(&self, conn: usize, k: usize) -> usize {
        (conn * self.per_conn + k % self.per_conn) * SLOT
    }

    /// Posts receive `k` of connection `conn` on the server side.
    pub fn recv(&self, conn: usize, k: usize, wr_id: u64) {
        let s = self.servers.lock().unwrap();
        s[conn].post_recv(&self.server_mr.lock().unwrap(), self.slot(conn, k), SLOT as u32, wr_id).unwrap();
    }

    /// Client `conn` sends message `k`.
    pub fn send(&self, conn: usize, k: usize, wr_id: u64) {
        let c = self.clients.lock().unwrap();
        c[conn].post_send(&self.client_mr.lock().unwrap(), self.slot(conn, k), 8, wr_id).unwrap();
    }
}
