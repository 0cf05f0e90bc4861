//! First proof on real RDMA (Soft-RoCE in the test bed guest): connect over
//! rdma_cm with private data both ways, one SEND, its completion through a
//! completion channel, disconnect, destroy. Asserts the event sequences,
//! the private-data bytes and the payload.

mod common;

use std::time::Duration;

use common::proof::{self, HELLO, PAYLOAD, WELCOME};
use rdmasafe_core::cm::EventType as E;
use rdmasafe_core::verbs::WcOpcode;

#[test]
fn connect_send_recv_disconnect_on_rxe() {
    let bed = common::bed();
    let _dog = common::watchdog("the rxe proof", Duration::from_secs(180));
    let t = proof::run(bed.addr, true).expect("proof flow");

    assert!(t.devices.contains(&bed.device), "device {} listed in {:?}", bed.device, t.devices);
    assert_eq!(t.device_used, bed.device, "the CM ids use the test device");
    let types = |v: &[(E, i32)]| v.iter().map(|(t, _)| *t).collect::<Vec<_>>();
    assert_eq!(
        types(&t.client_events),
        [E::ADDR_RESOLVED, E::ROUTE_RESOLVED, E::ESTABLISHED, E::DISCONNECTED],
        "client event sequence"
    );
    assert_eq!(types(&t.server_events), [E::CONNECT_REQUEST, E::ESTABLISHED, E::DISCONNECTED], "server sequence");
    assert!(t.client_events.iter().chain(&t.server_events).all(|(_, s)| *s == 0), "all statuses 0");

    // Received private data has the transport's padded length (RoCE/IB:
    // 56 on a request, 196 on the reply); the bytes sent come first, then
    // zero padding.
    assert_eq!(t.request_data.len(), 56, "CONNECT_REQUEST private data length");
    assert_eq!(&t.request_data[..HELLO.len()], HELLO, "hello bytes");
    assert!(t.request_data[HELLO.len()..].iter().all(|b| *b == 0), "request padding");
    assert_eq!(t.established_data.len(), 196, "ESTABLISHED private data length");
    assert_eq!(&t.established_data[..WELCOME.len()], WELCOME, "welcome bytes");
    assert!(t.established_data[WELCOME.len()..].iter().all(|b| *b == 0), "reply padding");

    assert_eq!(t.received, PAYLOAD, "payload bytes");
    assert_eq!(t.recv_opcode, WcOpcode::RECV);
    assert_eq!(t.cq_events_acked, 1, "exactly one CQ event, acked");
    assert_eq!(t.copies_outstanding_at_end, 0, "every event copy freed");
}
