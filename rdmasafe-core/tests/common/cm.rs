//! CM helpers for the rxe tests: expect an event, listen, resolve, add a QP.

use std::net::IpAddr;
use std::time::Duration;

use rdmasafe_core::cm::{CmEvent, CmId, ConnectParams, EventChannel, EventType, PortSpace, QpCaps};
use rdmasafe_core::verbs::{Cq, DeviceContext, Pd};

/// Generous: under TCG a CM step takes milliseconds; this only turns a hang
/// into a failure.
pub const STEP: Duration = Duration::from_secs(30);

/// The device that serves `addr` (its context outlives the id that found
/// it).
pub fn device(addr: IpAddr) -> DeviceContext {
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((addr, 0).into()).unwrap();
    id.device_context().unwrap()
}

/// An id on `ch` whose ADDR_RESOLVED (to `addr`, port 7) is queued on
/// `ch`, not taken: the caller has taken every earlier event of `ch`, so
/// its fd's readiness (a level-triggered poll) is this event's.
pub fn with_queued_event(ch: &EventChannel, addr: IpAddr) -> CmId {
    use std::os::fd::AsRawFd;
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.resolve_addr(None, (addr, 7).into(), Duration::from_secs(10)).unwrap();
    let mut p = libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, STEP.as_millis() as i32) };
    assert_eq!(n, 1, "ADDR_RESOLVED queued on the channel within {STEP:?}");
    id
}

/// Gets the next event and asserts its type.
pub fn expect(ch: &EventChannel, want: EventType) -> CmEvent {
    let ev = ch.get_timeout(STEP).unwrap_or_else(|e| panic!("waiting for {want}: {e}"));
    assert_eq!(ev.event_type(), want, "unexpected event {:?} (status {})", ev.event_type(), ev.status());
    ev
}

/// A pattern that differs per position and per length.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed) | 1).collect()
}

/// Asserts that received (padded) private data starts with `sent` and is
/// zero after it.
pub fn assert_data(received: &[u8], sent: &[u8], what: &str) {
    assert!(received.len() >= sent.len(), "{what}: {} bytes received, {} sent", received.len(), sent.len());
    for (i, (r, s)) in received.iter().zip(sent).enumerate() {
        assert_eq!(r, s, "{what}: byte {i} differs");
    }
    assert!(received[sent.len()..].iter().all(|b| *b == 0), "{what}: padding is not zero");
}

pub struct Listener {
    pub ch: EventChannel,
    pub id: CmId,
    pub port: u16,
}

pub fn listen(addr: IpAddr, ps: PortSpace, backlog: i32) -> Listener {
    let ch = EventChannel::new().expect("server channel");
    let id = ch.create_id(ps).expect("listen id");
    id.bind_addr((addr, 0).into()).expect("bind");
    id.listen(backlog).expect("listen");
    let port = id.local_port();
    Listener { ch, id, port }
}

/// Creates an id on `ch` and resolves address and route to addr:port.
pub fn resolved(ch: &EventChannel, ps: PortSpace, addr: IpAddr, port: u16) -> CmId {
    let id = ch.create_id(ps).expect("client id");
    id.resolve_addr(None, (addr, port).into(), Duration::from_secs(5)).expect("resolve_addr");
    let ev = expect(ch, EventType::ADDR_RESOLVED);
    assert_eq!(ev.token(), Some(id.token()));
    id.resolve_route(Duration::from_secs(5)).expect("resolve_route");
    expect(ch, EventType::ROUTE_RESOLVED);
    id
}

/// Gives the id a small QP (RC, or UD) with its own PD and CQ; the id keeps
/// them alive.
pub fn add_qp(id: &mut CmId, ud: bool) {
    let ctx = id.device_context().expect("id bound to a device");
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 8, None).expect("cq");
    add_qp_on(id, &pd, &cq, ud);
}

/// Like [`add_qp`] with a shared PD and CQ (for many connections).
pub fn add_qp_on(id: &mut CmId, pd: &Pd, cq: &Cq, ud: bool) {
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };
    id.create_qp(pd, cq, cq, caps, ud).expect("create_qp");
}

pub fn params(data: &[u8]) -> ConnectParams<'_> {
    ConnectParams { private_data: data, ..Default::default() }
}
