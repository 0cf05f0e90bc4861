//! The rdmasafe demo: runs the first proof on the RDMA device named by
//! RDMASAFE_TEST_ADDR (set by the test bed guest) and prints the CM events
//! each side saw and the message that crossed.

#[path = "../tests/common/proof.rs"]
mod proof;

fn main() {
    let addr = match std::env::var("RDMASAFE_TEST_ADDR").ok().and_then(|a| a.parse().ok()) {
        Some(a) => a,
        None => {
            eprintln!("demo: RDMASAFE_TEST_ADDR is not set; run it with tests/demo.sh or cargo run --example rxe_demo (the runner boots the Soft-RoCE guest)");
            std::process::exit(2);
        }
    };
    match proof::run(addr, true) {
        Ok(t) => {
            println!("client saw: {:?}", t.client_events.iter().map(|(e, _)| e.name()).collect::<Vec<_>>());
            println!("server saw: {:?}", t.server_events.iter().map(|(e, _)| e.name()).collect::<Vec<_>>());
            println!("demo: OK");
        }
        Err(e) => {
            eprintln!("demo: failed: {e}");
            std::process::exit(1);
        }
    }
}
