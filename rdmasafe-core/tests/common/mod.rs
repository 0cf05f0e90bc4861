//! Helpers shared by the RDMA integration tests (binaries named `rxe_*`,
//! which the cargo runner in tests/bed runs inside the Soft-RoCE guest).
#![allow(dead_code)]

pub mod cm;
pub mod host;
pub mod many;
pub mod proof;
pub mod rc;

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::Duration;

/// Where the RDMA tests run: set by tests/bed/vm-run (or by a user's opt-in
/// to a real device). Missing means the test was not started through the
/// test bed: fail loudly, never skip.
pub struct Bed {
    pub device: String,
    pub addr: IpAddr,
    pub in_guest: bool,
}

pub fn bed() -> Bed {
    let device = std::env::var("RDMASAFE_TEST_DEVICE").unwrap_or_default();
    let addr = std::env::var("RDMASAFE_TEST_ADDR").unwrap_or_default();
    if device.is_empty() || addr.is_empty() {
        panic!(
            "RDMASAFE_TEST_DEVICE / RDMASAFE_TEST_ADDR are not set: RDMA tests must run through \
             the Soft-RoCE test bed (cargo test uses tests/bed/cargo-runner via .cargo/config.toml), \
             or opt in to a real device with RDMASAFE_DEVICE and RDMASAFE_ADDR"
        );
    }
    Bed {
        device,
        addr: addr.parse().expect("RDMASAFE_TEST_ADDR is an IP address"),
        in_guest: std::env::var("RDMASAFE_IN_GUEST").as_deref() == Ok("1"),
    }
}

impl Bed {
    pub fn sock(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.addr, port)
    }
}

/// Turns a hang into a failure: aborts the process if not dropped within
/// `limit`. Generous limits only; this is not a timing assertion.
pub struct Watchdog(Option<mpsc::Sender<()>>);

pub fn watchdog(what: &'static str, limit: Duration) -> Watchdog {
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("WATCHDOG: {what} did not finish within {limit:?}: treating the hang as a failure");
            std::process::abort();
        }
    });
    Watchdog(Some(tx))
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}
