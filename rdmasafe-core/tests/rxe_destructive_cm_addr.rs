//! ADDR_ERROR for an address nobody owns on an ARP-capable interface.
//! Changes the guest's network (adds a veth pair), so it only ever runs in
//! the guest (binaries named rxe_destructive_* never run on a real host).

mod common;

use std::process::Command;
use std::time::Duration;

use common::cm::expect;
use rdmasafe_core::cm::{EventChannel, EventType as E, PortSpace};

fn ip(args: &str) {
    let st = Command::new("ip").args(args.split_whitespace()).status().expect("run ip");
    assert!(st.success(), "ip {args}");
}

#[test]
fn unowned_address_on_an_arp_interface_gives_addr_error() {
    let bed = common::bed();
    assert!(bed.in_guest, "rxe_destructive_* tests change the network: guest only");
    let _dog = common::watchdog("ADDR_ERROR", Duration::from_secs(120));
    ip("link add rsveth0 type veth peer name rsveth1");
    ip("addr add 10.88.0.1/24 dev rsveth0");
    ip("link set rsveth0 up");
    ip("link set rsveth1 up");

    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.resolve_addr(None, "10.88.0.2:4000".parse().unwrap(), Duration::from_millis(2000))
        .expect("resolution starts (the address is on a local subnet)");
    let ev = expect(&ch, E::ADDR_ERROR);
    println!("ADDR_ERROR status {} for an unowned address on a veth", ev.status());
    assert!(ev.status() < 0, "status is a negative errno");
    assert_eq!(ev.token(), Some(id.token()));
    drop(id);
    ip("link del rsveth0");
}
