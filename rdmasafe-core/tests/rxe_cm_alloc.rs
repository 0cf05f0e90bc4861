//! In steady state, getting and freeing a CM event allocates nothing of
//! rdmasafe's own: a counting global allocator (which sees every Rust
//! allocation, not librdmacm's malloc) counts allocations made by this
//! thread while it gets and drops events of real connections.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use common::cm::{add_qp, expect, listen, params, pattern};
use rdmasafe_core::cm::{self, CmEvent, EventChannel, EventType as E, PortSpace};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
thread_local!(static COUNTING: Cell<bool> = const { Cell::new(false) });

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.with(|c| c.get()) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.with(|c| c.get()) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        // SAFETY: forwarded contract.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Runs `f` counting this thread's allocations.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCS.load(Relaxed);
    COUNTING.with(|c| c.set(true));
    let v = f();
    COUNTING.with(|c| c.set(false));
    (v, ALLOCS.load(Relaxed) - before)
}

/// One connection's client-side events (ADDR_RESOLVED, ROUTE_RESOLVED,
/// ESTABLISHED with 196 bytes of private data, DISCONNECTED), each got and
/// dropped inside the counted window. Returns (events, allocations).
fn one_connection(l: &common::cm::Listener, cch: &EventChannel, addr: std::net::IpAddr) -> (u64, u64) {
    let mut events = 0;
    let mut allocs = 0;
    let mut get_drop = |want: E| {
        let (ty, n) = counted(|| {
            let ev: CmEvent = cch.get_timeout(common::cm::STEP).expect("event");
            let t = ev.event_type();
            drop(ev);
            t
        });
        assert_eq!(ty, want);
        events += 1;
        allocs += n;
    };
    let mut client = cch.create_id(PortSpace::Tcp).unwrap();
    client.resolve_addr(None, (addr, l.port).into(), common::cm::STEP).unwrap();
    get_drop(E::ADDR_RESOLVED);
    client.resolve_route(common::cm::STEP).unwrap();
    get_drop(E::ROUTE_RESOLVED);
    add_qp(&mut client, false);
    client.connect(&params(&pattern(56, 1))).unwrap();
    let mut req = expect(&l.ch, E::CONNECT_REQUEST);
    let mut r = req.take_request().unwrap();
    add_qp(r.id_mut(), false);
    let server = r.accept(&params(&pattern(196, 2))).unwrap();
    get_drop(E::ESTABLISHED);
    expect(&l.ch, E::ESTABLISHED);
    client.disconnect().unwrap();
    expect(&l.ch, E::DISCONNECTED);
    server.disconnect().unwrap();
    get_drop(E::DISCONNECTED);
    (events, allocs)
}

#[test]
fn steady_state_get_and_free_allocate_nothing() {
    let bed = common::bed();
    let l = listen(bed.addr, PortSpace::Tcp, 16);
    let cch = EventChannel::new().unwrap();
    // Warm-up: the pool fills (past its quarantine), lazily initialised
    // statics are set.
    assert!(cm::reserve(16) >= 16);
    for _ in 0..5 {
        one_connection(&l, &cch, bed.addr);
    }
    let slots_before = cm::counters().slots_allocated;
    let (mut events, mut allocs) = (0, 0);
    for _ in 0..50 {
        let (e, a) = one_connection(&l, &cch, bed.addr);
        events += e;
        allocs += a;
    }
    let slots_after = cm::counters().slots_allocated;
    println!(
        "steady state: {events} CM events got and freed, {allocs} Rust heap allocations, \
         slots allocated {slots_before} -> {slots_after}"
    );
    assert_eq!(events, 200);
    assert_eq!(allocs, 0, "rdmasafe allocated while getting/freeing events");
    assert_eq!(slots_after, slots_before, "no new event slots in steady state");
    // The counter sees allocations (guards against a counter that never counts).
    let (_, n) = counted(|| drop(std::hint::black_box(vec![0u8; 64])));
    assert_eq!(n, 1, "the counting allocator counts");
}
