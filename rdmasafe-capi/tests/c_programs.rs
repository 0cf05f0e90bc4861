//! The C programs on the C API, end to end: builds tests/c/ and examples-c/
//! with plain make against librdmasafe, then runs all of them in ONE
//! Soft-RoCE guest (tests/bed/vm-run) through tests/c/run-in-guest.sh:
//!
//! 1. `cm_capi_test`: argument errors, timeouts, private data at the
//!    transport limits (byte by byte), reject data, no listener, 100 copies
//!    held across rdma_destroy_id, batch gets, counters;
//! 2. `messenger_server` with 8 connections from 5 `messenger_client`
//!    processes (one with `-n 4`, four single ones); the server's CQ loop
//!    runs on its own thread for its whole life, and each connection's CQ
//!    was added to it at accept and removed (QP drained first) at teardown
//!    while it ran: its figures (CQs added / removed / left, completions,
//!    nothing unacked, no foreign CQ event) against the server's own;
//! 3. `messenger_server` stopped by SIGTERM with 2 held connections (the
//!    same loop figures for its 2);
//! 4. `rdmasafe_rdma_server` with rdma-core's stock `rdma_client`;
//! 5. the stock `rdma_server` with `rdmasafe_rdma_client`;
//! 6. `cq_loop_test`: the CQ loop C API (handle and argument errors, stale
//!    handles of destroyed loops, CQs added and removed while another
//!    thread runs the loop and from inside callbacks, per-CQ options,
//!    async removal and destroy_cq, stop from signal handlers, EINTR,
//!    fork), 2000 messages each way in event / busy-poll / adaptive mode
//!    with every completion once and in order, stop from another thread
//!    and run again, acks at stop, drains (blocking and async, markers
//!    never delivered), ibv_destroy_cq after the loop's destroy;
//! 7. `mpi_ring` under Open MPI's mpirun: 4 ranks connected in a ring with
//!    rdmasafe_get_event, a token 100 times around in event and in adaptive
//!    mode, clean teardown (needs mpicc/mpirun: openmpi-bin, libopenmpi-dev);
//! 8. `cm_ud_test`: a udaddy-style UD exchange that uses only the two
//!    renamed calls: CONNECT_REQUEST and ESTABLISHED param.ud field by field
//!    (private data, qp_num, qkey 0x01234567, ah_attr), an AH from the
//!    event's ah_attr, one UD message each way;
//! 9. `cm_mcast_test`: mckey-style multicast, only the two renamed calls:
//!    MULTICAST_JOIN keeps each join's context pointer as is (one of them
//!    points before a guard page), ah_attr, qp_num 0xFFFFFF, qkey; messages
//!    sent to the group from one QP arrive on another; leave;
//! 10. `cm_barrier_test` (ASan), 30 runs: an rping-shaped program whose
//!     DISCONNECTED handler still uses the connection struct after waking
//!     main, which destroys the id and channel and frees the struct: correct
//!     only with librdmacm's barrier (rdma_destroy_id waits for the ack).
//!     All 30 runs must be clean (exit 0, no ASan report). The raw librdmacm
//!     build of the same source runs 10 times as the control;
//! 11. `cm_barrier_test -H`: the client keeps its DISCONNECTED copy for 5 s;
//!     rdma_destroy_id must return (watchdog) and its time is printed
//!     (`measure destroy_ms=`, no timed assertion), next to the raw build's.
//!
//! 12. `cm_cancel_test`: a thread waiting in `rdmasafe_get_event`,
//!     `_timeout` (-1 and 60 s), `_events`, `ibv_get_cq_event` and
//!     `rdmasafe_async_get` (-1 and 60 s; the raw build: `ibv_get_async_event`)
//!     is cancelled (pthread_cancel) and joined, as programs do with their CM
//!     or async-event thread at shutdown; also with the cancellation pending when the call
//!     starts: PTHREAD_CANCELED, the cleanup handler ran, and afterwards
//!     the channel delivers under a limit of one copy with no copy left;
//!     `rdmasafe_cq_loop_stop` called with a cancellation pending returns 0
//!     (no cancellation point inside) and the stop is kept;
//!     a trace-level log callback that cancels its own thread inside
//!     `rdmasafe_get_event` and calls usleep: deferred, the get returns its
//!     event, the thread is cancelled at its next cancellation point.
//!
//! 8-12 also run as *_raw builds (the same sources on librdmacm alone): the
//! controls that tell a wrong test from a wrong library.
//!
//! Asserts on every exit status and on the output (what each side saw).
//! This binary runs on the host (its name does not start with `rxe_`); it
//! boots the guest itself, once. With RDMASAFE_DEVICE and RDMASAFE_ADDR set
//! (real hardware, opt-in) the script runs directly on the host instead.

mod common;

use common::{blocks, ensure_library, profile_dir, root, run_logged, Block};

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Seconds the guest may run before vm-run kills it (a watchdog: a
/// normal run takes a minute or two; a busy machine stretches that).
const GUEST_TIMEOUT: u32 = 900;

/// Runs of cm_barrier_test (rdmasafe build) and of its raw control that
/// run-in-guest.sh makes (its defaults).
const BARRIER_RUNS: usize = 30;
const BARRIER_RAW_RUNS: usize = 10;

fn build_c_programs(profile: &Path, bin: &Path) {
    for dir in ["tests/c", "examples-c"] {
        run_logged(
            &format!("make -C {dir}"),
            Command::new("make")
                .current_dir(root())
                .arg("-C")
                .arg(dir)
                .arg(format!("LIBDIR={}", profile.display()))
                .arg(format!("OUT={}", bin.display())),
        );
    }
    for p in [
        "cm_capi_test",
        "cq_loop_test",
        "messenger_server",
        "messenger_client",
        "rdmasafe_rdma_server",
        "rdmasafe_rdma_client",
        "mpi_ring",
        "cm_ud_test",
        "cm_ud_test_raw",
        "cm_mcast_test",
        "cm_mcast_test_raw",
        "cm_barrier_test",
        "cm_barrier_test_raw",
        "cm_cancel_test",
        "cm_cancel_test_raw",
    ] {
        assert!(
            bin.join(p).exists(),
            "make did not produce {p} (mpi_ring needs mpicc: apt-get install openmpi-bin libopenmpi-dev)"
        );
    }
}

/// Collects failed expectations, so one run reports all of them.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    fn that(&mut self, ok: bool, what: impl Into<String>) -> bool {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(what.into());
        }
        ok
    }
}

/// Value after `key` up to the next space (e.g. "session=0x1 ..." -> "0x1").
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(key)? + key.len();
    let rest = &line[start..];
    Some(rest.split([' ', ',', ')']).next().unwrap_or(rest))
}

fn check_cm_capi_test(c: &mut Checks, b: &Block) {
    let ok_lines = b.lines().filter(|l| l.starts_with("ok   ")).count();
    let fail_lines: Vec<&str> = b.lines().filter(|l| l.starts_with("FAIL")).collect();
    c.that(fail_lines.is_empty(), format!("cm_capi_test failures: {fail_lines:#?}"));
    let last = b.lines().filter(|l| !l.trim().is_empty()).last().unwrap_or("");
    c.that(
        last == format!("cm_capi_test: {ok_lines} passed, 0 failed"),
        format!("cm_capi_test final line {last:?} (counted {ok_lines} ok lines)"),
    );
    c.that(ok_lines >= 150, format!("cm_capi_test ran only {ok_lines} checks"));
    for needle in [
        "ok   rdmasafe_get_event(NULL channel) -> -1/EINVAL",
        "ok   rdmasafe_get_event(NULL out pointer) -> -1/EINVAL",
        "ok   rdmasafe_event_free(NULL) -> 0",
        "ok   rdmasafe_event_free(stack pointer) -> -1/EINVAL",
        "ok   rdmasafe_get_events(max 0) -> -1/EINVAL",
        "ok   rdmasafe_get_event_timeout(timeout -2) -> -1/EINVAL",
        "ok   rdmasafe_event_str(9) = RDMA_CM_EVENT_ESTABLISHED",
        "ok   rdmasafe_event_str(1000) = RDMA_CM_EVENT_UNKNOWN",
        "ok   blocking channel: rdmasafe_get_event_timeout(0) -> -1/EAGAIN",
        "ok   non-blocking channel: rdmasafe_get_event_timeout(50) -> -1/ETIMEDOUT",
        "ok   rdma_connect with 57 bytes of private data -> -1/EINVAL",
        "ok   server: CONNECT_REQUEST private_data_len is 56",
        "ok   server: CONNECT_REQUEST private data: all 56 bytes match byte by byte",
        "ok   client: ESTABLISHED private data (accept's 196): all 196 bytes match byte by byte",
        "ok   server: request copy's private data after rdma_destroy_id: all 56 bytes match",
        "ok   server: rdma_reject with 149 bytes -> -1/EINVAL",
        "ok   reject client: REJECTED private data (148): all 148 bytes match byte by byte",
        "ok   no-listener: rejected: RDMA_CM_EVENT_REJECTED",
        "ok   hold: 100 ADDR_RESOLVED copies held, one per id",
        "ok   hold: rdma_destroy_id returned for all 100 ids while their copies were held",
        "ok   rdmasafe_event_free(copy) after its id was destroyed -> 0",
        "ok   rdmasafe_event_free of the same copy again (double free) -> -1/EINVAL",
        "ok   batch (non-blocking): all 50 ADDR_RESOLVED events came, each id once, none lost",
        "ok   batch (non-blocking): the first call after 50 were queued returned",
        "ok   batch (blocking): all 30 ADDR_RESOLVED events came, each id once, none lost",
        "ok   counters at the end: outstanding 0,",
        "ok   rdmasafe_cm_set_ack_deadline: the default was 1000 ms",
        "ok   rdmasafe_get_event_timeout success leaves errno alone",
        "ok   rdmasafe_event_free success leaves errno alone",
        "ok   rdmasafe_get_event success leaves errno alone",
        "ok   rdmasafe_get_events success leaves errno alone",
        "ok   barrier: rdma_destroy_id on another thread still waits while the copy is held",
        "ok   barrier: rdma_destroy_id returned once the copy was freed",
        "ok   barrier: counters: 1 original held, 1 acked at free",
        "ok   bound: rdma_destroy_id returned while the copy is still held",
        "ok   bound: the original was acked at its deadline",
        "ok   bound: the copy is still valid after its id is gone",
        "ok   idle: the original was acked at its deadline without another rdmasafe call",
        "ok   get at the limit -> -1/ENOBUFS",
        "ok   limit: the refused event stayed in the kernel and comes after a free",
    ] {
        c.that(b.has(needle), format!("cm_capi_test output lacks {needle:?}"));
    }
    for l in b.lines().filter(|l| l.starts_with("info batch")) {
        println!("[c_programs] {l}");
    }
}

/// (client id, connection index) of the 8 messenger connections.
fn messenger_conns() -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = (0..4).map(|i| (100, i)).collect();
    v.extend([201, 202, 203, 204].map(|id| (id, 0)));
    v
}

fn check_messenger(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let server = runs.get("messenger_server").unwrap_or(&empty);
    let mut sessions = BTreeSet::new();
    let mut numbers = BTreeSet::new();
    for (id, idx) in messenger_conns() {
        let name = format!("client-{id}.{idx}");
        let client = runs.get(&format!("messenger_client_{id}")).unwrap_or(&empty);
        // the server saw the hello (its own length 37 inside the padded 56)
        let hello = server.line(&format!("server: hello from client_id={id} conn={idx} name=\"{name}\" "));
        if !c.that(hello.is_some(), format!("server did not report the hello of {name}")) {
            continue;
        }
        let hello = hello.unwrap();
        c.that(
            hello.contains("(hello len 37, private_data_len 56)"),
            format!("hello of {name}: own length 37 in padded 56: {hello}"),
        );
        let session = field(hello, "-> session ").unwrap_or("?").to_string();
        let number = field(hello, " number ").unwrap_or("?").to_string();
        c.that(sessions.insert(session.clone()), format!("session {session} assigned twice"));
        numbers.insert(number.clone());
        // the client saw the welcome built from it
        let welcome = client.line(&format!("client {id} conn {idx}: welcome "));
        if c.that(welcome.is_some(), format!("{name} reported no welcome")) {
            let w = welcome.unwrap();
            c.that(
                field(w, "session=") == Some(session.as_str()),
                format!("{name}: welcome session vs server's {session}: {w}"),
            );
            c.that(
                field(w, "number=") == Some(number.as_str()),
                format!("{name}: welcome number vs server's {number}: {w}"),
            );
            c.that(
                w.contains("banner=\"rdmasafe messenger on ") && w.contains(&format!(" welcomes {name}\"")),
                format!("{name}: banner: {w}"),
            );
            // its own length: the 40-byte header plus the banner and its NUL
            let banner = w.split_once("banner=\"").and_then(|(_, r)| r.split_once('"')).map_or("", |(b, _)| b);
            let own = 40 + banner.len() + 1;
            c.that(
                w.contains(&format!("(welcome len {own}, private_data_len 196)")),
                format!("{name}: welcome own length {own} in padded 196: {w}"),
            );
        }
        // one PING, one PONG built from the server's per-connection state
        c.that(
            server.has(&format!(
                "server: message from client {id} conn {idx} session {session} seq 1 (55 bytes): \"ping from {name}\""
            )),
            format!("server did not receive the PING of {name}"),
        );
        c.that(
            client.has(&format!(
                "client {id} conn {idx}: reply OK (107 bytes): \"pong to {name} (client {id} conn {idx}, number {number}): ping from {name}\""
            )),
            format!("{name} did not get its PONG"),
        );
        c.that(
            server.has(&format!("({name}) session {session} disconnected, served")),
            format!("server did not finish {name} as served"),
        );
        c.that(
            client.has(&format!("client {id} conn {idx}: disconnected, done")),
            format!("{name} did not end cleanly"),
        );
    }
    c.that(sessions.len() == 8, format!("8 distinct sessions, got {sessions:?}"));
    let want: BTreeSet<String> = (1..=8).map(|n| n.to_string()).collect();
    c.that(numbers == want, format!("connection numbers 1..8, got {numbers:?}"));
    c.that(
        server.has("server: done: 8 served, 0 failed, 0 refused, all expected clients finished"),
        "messenger_server did not serve all 8",
    );
    c.that(
        server.has("server: counters copied=") && server.has(" outstanding=0 "),
        "messenger_server counters: outstanding not 0",
    );
    check_messenger_loop(c, "messenger_server", server, &sessions);
    for (id, n) in [(100, 4), (201, 1), (202, 1), (203, 1), (204, 1)] {
        let client = runs.get(&format!("messenger_client_{id}")).unwrap_or(&empty);
        c.that(
            client.has(&format!("client {id}: {n} of {n} connections OK; counters ")) && client.has(" outstanding=0 "),
            format!("messenger_client {id}: summary / counters"),
        );
        // rdma_destroy_id waits for the id's unfreed copies (the ack barrier):
        // a client that tore down inside its DISCONNECTED handler waited out
        // the deadline once per connection and counted it here.
        c.that(
            client.has(" acked_at_deadline=0"),
            format!("messenger_client {id}: a CM event copy was held past its ack deadline"),
        );
    }
    if let Some(l) = server.line("server: CM events ") {
        println!("[c_programs] messenger {l}");
    }

    // SIGTERM with two held connections
    let server = runs.get("messenger_sigterm_server").unwrap_or(&empty);
    let client = runs.get("messenger_sigterm_client").unwrap_or(&empty);
    c.that(
        server.has("server: SIGTERM: disconnecting 2 live connection(s)"),
        "SIGTERM server: did not disconnect 2 live connections",
    );
    c.that(server.count("disconnected, served") == 2, "SIGTERM server: both held connections served");
    c.that(server.has("server: done: 2 served, 0 failed, 0 refused, stopped by signal"), "SIGTERM server: summary");
    c.that(server.has(" outstanding=0 "), "SIGTERM server: counters outstanding not 0");
    let sigterm_sessions: BTreeSet<String> = server
        .lines()
        .filter(|l| l.starts_with("server: hello from client_id=300 "))
        .filter_map(|l| field(l, "-> session ").map(String::from))
        .collect();
    c.that(sigterm_sessions.len() == 2, format!("SIGTERM server: 2 sessions, got {sigterm_sessions:?}"));
    check_messenger_loop(c, "SIGTERM server", server, &sigterm_sessions);
    c.that(
        client.count("disconnected by the server (while holding)") == 2,
        "SIGTERM client: not disconnected by the server twice",
    );
    c.that(
        client.has("client 300: 2 of 2 connections OK;") && client.has(" outstanding=0 "),
        "SIGTERM client: summary / counters",
    );
    c.that(client.has(" acked_at_deadline=0"), "SIGTERM client: a CM event copy was held past its ack deadline");
}

/// The messenger server's CQ loop: one loop on its own thread for the
/// server's life; each session's CQ added to it while it ran and removed
/// (QP drained and destroyed first) while it still ran; the loop's figures
/// at the end against what the server's callback saw. Also: no CM copy was
/// held past its ack deadline (the server tears a connection down after
/// the batch's copies are freed, so no rdma_destroy_id waited for one).
fn check_messenger_loop(c: &mut Checks, label: &str, server: &Block, sessions: &BTreeSet<String>) {
    let n = sessions.len() as f64;
    c.that(
        server.lines().any(|l| l.starts_with("server: CQ loop on ") && l.contains(" running on its own thread; ")),
        format!("{label}: no CQ loop thread started"),
    );
    for s in sessions {
        c.that(
            server.has(&format!("server: session {s}: its CQ added to the running loop")),
            format!("{label}: session {s}: CQ not added to the running loop"),
        );
        let removed = server.line(&format!(
            "server: session {s}: QP drained and destroyed, CQ removed from the running loop and destroyed "
        ));
        if c.that(removed.is_some(), format!("{label}: session {s}: CQ not removed from the running loop")) {
            // its callback ran (at least for the PING) before the removal
            let calls: Option<u32> = removed.and_then(|l| field(l, "(callback calls ")).and_then(|v| v.parse().ok());
            c.that(calls.is_some_and(|k| k >= 1), format!("{label}: session {s}: callback calls: {removed:?}"));
        }
    }
    c.that(server.has(" acked_at_deadline=0"), format!("{label}: a CM event copy was held past its ack deadline"));
    let figures = server.line("server: CQ loop figures ");
    let seen = server.line("server: CQ loop seen by the server ");
    if !c.that(figures.is_some() && seen.is_some(), format!("{label}: no CQ loop figures / server's view")) {
        return;
    }
    let (fl, sl) = (figures.unwrap(), seen.unwrap());
    println!("[c_programs] {label}: {fl}");
    println!("[c_programs] {label}: {sl}");
    let (f, v) = (kv(fl), kv(sl));
    // the loop's own figures
    for (key, want) in [
        ("cqs_added", n),
        ("cqs_removed", n),
        ("cqs", 0.0),
        ("unacked_now", 0.0),
        ("foreign_cq_events", 0.0),
        // per connection: the PING received and the PONG sent (the drain's
        // markers are the loop's own, never counted or delivered)
        ("completions", 2.0 * n),
    ] {
        c.that(num(&f, key) == Some(want), format!("{label}: loop figure {key} want {want}: {fl}"));
    }
    c.that(num(&f, "cq_events").is_some_and(|e| e >= 1.0), format!("{label}: no CQ event: {fl}"));
    c.that(num(&f, "acked_events") == num(&f, "cq_events"), format!("{label}: every CQ event acked: {fl}"));
    // the server's side of the same story
    for (key, want) in [
        ("run", 0.0),
        ("accepted", n),
        ("added", n),
        ("removed", n),
        ("removed_while_running", n),
        ("drained", n),
        ("teardown_errors", 0.0),
        ("receives", n),
        ("off_loop_thread", 0.0),
    ] {
        c.that(num(&v, key) == Some(want), format!("{label}: server's {key} want {want}: {sl}"));
    }
    c.that(
        num(&v, "callback_completions") == num(&f, "completions") && num(&v, "errors") == num(&f, "error_completions"),
        format!("{label}: the callback saw every completion the loop counted:\n    {fl}\n    {sl}"),
    );
    c.that(
        num(&v, "receives").zip(num(&v, "sends")).zip(num(&v, "errors")).map(|((r, s), e)| r + s + e)
            == num(&v, "callback_completions"),
        format!("{label}: receives + sends + errors = callback completions: {sl}"),
    );
}

fn check_interop(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let zeros16 = format!("received 16 bytes:{}", " 00".repeat(16));

    // stock rdma_client -> rdmasafe_rdma_server
    let ours = runs.get("rdmasafe_rdma_server").unwrap_or(&empty);
    let stock = runs.get("rdma_client").unwrap_or(&empty);
    c.that(stock.has("rdma_client: start") && stock.has("rdma_client: end 0"), "stock rdma_client did not end 0");
    for needle in [
        "rdmasafe_rdma_server: RDMA_CM_EVENT_CONNECT_REQUEST (status 0",
        "rdmasafe_rdma_server: RDMA_CM_EVENT_ESTABLISHED (status 0",
        // what the stock client sends: its 16-byte static buffer, zeroed
        &format!("rdmasafe_rdma_server: {zeros16}"),
        "rdmasafe_rdma_server: sent 16 bytes \"rdmasafe server!\"",
        "rdmasafe_rdma_server: RDMA_CM_EVENT_DISCONNECTED (status 0",
        "rdmasafe_rdma_server: 1 of 1 connections OK, exit 0",
    ] {
        c.that(ours.has(needle), format!("rdmasafe_rdma_server output lacks {needle:?}"));
    }
    c.that(ours.has("rdmasafe_rdma_server: counters copied=3 freed=3 outstanding=0"), "rdmasafe_rdma_server counters");

    // rdmasafe_rdma_client -> stock rdma_server
    let ours = runs.get("rdmasafe_rdma_client").unwrap_or(&empty);
    let stock = runs.get("rdma_server").unwrap_or(&empty);
    c.that(stock.has("rdma_server: start") && stock.has("rdma_server: end 0"), "stock rdma_server did not end 0");
    for needle in [
        "rdmasafe_rdma_client: RDMA_CM_EVENT_ADDR_RESOLVED (status 0",
        "rdmasafe_rdma_client: RDMA_CM_EVENT_ROUTE_RESOLVED (status 0",
        "rdmasafe_rdma_client: RDMA_CM_EVENT_ESTABLISHED (status 0",
        "rdmasafe_rdma_client: sent 16 bytes \"rdmasafe client!\"",
        &format!("rdmasafe_rdma_client: {zeros16}"),
        "rdmasafe_rdma_client: RDMA_CM_EVENT_DISCONNECTED (status 0",
        "rdmasafe_rdma_client: OK, exit 0",
    ] {
        c.that(ours.has(needle), format!("rdmasafe_rdma_client output lacks {needle:?}"));
    }
    c.that(ours.has("rdmasafe_rdma_client: counters copied=4 freed=4 outstanding=0"), "rdmasafe_rdma_client counters");
}

/// Messages each way per mode that run-in-guest.sh gives cq_loop_test (-n).
const CQ_LOOP_MESSAGES: u64 = 2000;
/// Messages each way of cq_loop_test's lockstep (window 1) runs (its default).
const CQ_LOOP_LOCKSTEP: u64 = 200;
/// Ranks and token trips of the mpi_ring run (mpirun -np, mpi_ring -n).
const MPI_RANKS: usize = 4;
const MPI_TRIPS: u64 = 100;

/// `key=value` fields of a figures line ("figures mode=event window=32 ...").
fn kv(line: &str) -> BTreeMap<&str, &str> {
    line.split_whitespace().filter_map(|w| w.split_once('=')).collect()
}

fn num(m: &BTreeMap<&str, &str>, key: &str) -> Option<f64> {
    m.get(key).and_then(|v| v.parse().ok())
}

fn check_cq_loop_test(c: &mut Checks, b: &Block) {
    let ok_lines = b.lines().filter(|l| l.starts_with("ok   ")).count();
    let fail_lines: Vec<&str> = b.lines().filter(|l| l.starts_with("FAIL")).collect();
    c.that(fail_lines.is_empty(), format!("cq_loop_test failures: {fail_lines:#?}"));
    let last = b.lines().filter(|l| !l.trim().is_empty()).last().unwrap_or("");
    c.that(
        last == format!("cq_loop_test: {ok_lines} passed, 0 failed"),
        format!("cq_loop_test final line {last:?} (counted {ok_lines} ok lines)"),
    );
    c.that(ok_lines >= 250, format!("cq_loop_test ran only {ok_lines} checks"));
    let mut needles = vec![
        "ok   NULL loop: rdmasafe_cq_loop_run -> -EINVAL".to_string(),
        "ok   stack (foreign) loop: rdmasafe_cq_loop_add_cq -> -EINVAL".to_string(),
        "ok   heap (foreign) loop: rdmasafe_cq_loop_destroy -> -EINVAL".to_string(),
        "ok   destroyed loop: rdmasafe_cq_loop_get_stats -> -EINVAL".to_string(),
        "ok   rdmasafe_cq_loop_destroy twice -> -EINVAL".to_string(),
        "ok   rdmasafe_cq_loop_create(poll_batch 4097) -> -EINVAL, *out untouched".to_string(),
        "ok   rdmasafe_cq_loop_create(ack_batch 65537) -> -EINVAL, *out untouched".to_string(),
        "ok   rdmasafe_cq_loop_create(mode 4 (after RDMASAFE_MODE_LEARNING)) -> -EINVAL, *out untouched".to_string(),
        "ok   add_cq of a CQ created on ANOTHER comp channel -> -EINVAL".to_string(),
        "ok   add_cq of a CQ created without a channel -> -EINVAL".to_string(),
        "ok   a second loop on channel 1 -> -EBUSY".to_string(),
        "ok   remove_cq of a CQ not in the loop -> -ENOENT".to_string(),
        "ok   rdmasafe_cq_loop_run_once(timeout -2) -> -EINVAL".to_string(),
        "ok   add_cq while another thread runs the loop -> 0".to_string(),
        "ok   remove_cq while another thread runs the loop (returns when it is out) -> 0".to_string(),
        "ok   rdmasafe_cq_loop_destroy while another thread runs the loop -> -EBUSY".to_string(),
        "ok   rdmasafe_cq_loop_add_cq from inside a callback -> 1 (RDMASAFE_PENDING)".to_string(),
        "ok   rdmasafe_cq_loop_remove_cq from inside a callback -> 1 (RDMASAFE_PENDING)".to_string(),
        "(the loop's own epoll fd, not the channel's".to_string(),
        "ok   stale: rdmasafe_cq_loop_destroy of the destroyed handle -> -EINVAL".to_string(),
        "ok   stale: the newest loop is intact -> 0".to_string(),
        "ok   add_cq_ex (solicited only, budget 8) -> 0".to_string(),
        "ok   add_cq_ex with a newer struct, unknown field set -> -E2BIG".to_string(),
        "ok   remove_cq_async: done called once".to_string(),
        "ok   rdmasafe_cq_loop_destroy_cq: removed, then ibv_destroy_cq -> 0".to_string(),
        "ok   signals: rdmasafe_cq_loop_stop from a handler interrupting other loop calls".to_string(),
        "ok   signals: rdmasafe_cq_loop_run_once(-1) ended by a signal -> -EINTR".to_string(),
        "ok   signals: rdmasafe_cq_loop_run kept running through signals and a handler's stop ended it -> 0"
            .to_string(),
        "ok   fork: 40 children forked while another thread was inside rdmasafe calls exited 0 (40)".to_string(),
        "ok   rdmasafe_cq_loop_destroy from inside its own callback -> -EDEADLK".to_string(),
        "ok   rdmasafe_cq_loop_run from inside a callback -> -EDEADLK".to_string(),
        "ok   rdmasafe_cq_loop_run_once(0) with nothing to do -> 0".to_string(),
        "ok   rdmasafe_async_get(0) on a quiet device -> -EAGAIN".to_string(),
        "ok   run_once: the fd never stayed quiet while work was outstanding (0 stalls)".to_string(),
        "ok   client: rdmasafe_cq_loop_drain_qp from another thread while the loop runs -> 0".to_string(),
        "ok   rdmasafe_cq_loop_drain_qp_async while the loop runs -> 0".to_string(),
        "ok   server: the async drain's callback: result 0, its QP".to_string(),
        "ok   client: the drain markers are the loop's own: none reached the callback (send 0, recv 0)".to_string(),
        "ok   server: the drain markers are the loop's own: none reached the callback (send 0, recv 0)".to_string(),
        "ok   client: the 64 posted receives flushed (IBV_WC_WR_FLUSH_ERR), in order, before the marker".to_string(),
        "ok   server: the 64 posted receives flushed (IBV_WC_WR_FLUSH_ERR), in order, before the marker".to_string(),
        "ok   ibv_destroy_cq returned 0 for all 6 CQs of the channel after the loops were destroyed".to_string(),
    ];
    let want = 4 * CQ_LOOP_MESSAGES;
    for mode in ["event", "busy_poll", "adaptive", "learning"] {
        let m = format!("{mode}/w32");
        needles.push(format!("ok   {m}: stopped mid-stream"));
        needles.push(format!("ok   {m}: after the stop unacked_now 0 "));
        needles.push(format!("ok   {m}: rdmasafe_cq_loop_run again on the main thread -> 0"));
        needles.push(format!(
            "ok   {m}: every completion delivered exactly once, in wr_id order per QP and queue ({want} of {want})"
        ));
        needles.push(format!("ok   {m}: after the run unacked_now 0 "));
        needles
            .push(format!("ok   {mode}/w1: every completion delivered exactly once, in wr_id order per QP and queue"));
    }
    for needle in &needles {
        c.that(b.has(needle), format!("cq_loop_test output lacks {needle:?}"));
    }
    // the per-mode figures: complete and consistent
    for (mode, window, msgs) in [
        ("event", 32, CQ_LOOP_MESSAGES),
        ("busy_poll", 32, CQ_LOOP_MESSAGES),
        ("adaptive", 32, CQ_LOOP_MESSAGES),
        ("learning", 32, CQ_LOOP_MESSAGES),
        ("event", 1, CQ_LOOP_LOCKSTEP),
        ("busy_poll", 1, CQ_LOOP_LOCKSTEP),
        ("adaptive", 1, CQ_LOOP_LOCKSTEP),
        ("learning", 1, CQ_LOOP_LOCKSTEP),
    ] {
        let line = b.lines().find(|l| l.starts_with(&format!("figures mode={mode} window={window} ")));
        if !c.that(line.is_some(), format!("cq_loop_test printed no figures for {mode} window {window}")) {
            continue;
        }
        let line = line.unwrap();
        println!("[c_programs] cq_loop_test {line}");
        let f = kv(line);
        c.that(num(&f, "messages") == Some((2 * msgs) as f64), format!("figures messages: {line}"));
        c.that(num(&f, "completions") == Some((4 * msgs) as f64), format!("figures completions: {line}"));
        let wakeups = num(&f, "wakeups").unwrap_or(0.0);
        c.that(wakeups >= 1.0, format!("figures wakeups: {line}"));
        for key in ["per_wakeup", "empty_wakeups", "cq_events", "ack_calls", "acks_per_cq_event", "arm_calls", "ms"] {
            c.that(num(&f, key).is_some(), format!("figures lack a number for {key}: {line}"));
        }
        let (events, acks) = (num(&f, "cq_events").unwrap_or(-1.0), num(&f, "ack_calls").unwrap_or(-1.0));
        if mode == "busy_poll" {
            c.that(events == 0.0 && acks == 0.0, format!("busy_poll read CQ events: {line}"));
        } else {
            // batched acks: never more ack calls than events
            c.that(acks <= events, format!("more ack calls than CQ events: {line}"));
        }
        if mode == "event" {
            c.that(events >= 1.0 && acks >= 1.0, format!("event mode without CQ events / acks: {line}"));
        }
    }
    for l in b.lines().filter(|l| {
        l.starts_with("info stop requested")
            || l.starts_with("info first run_once")
            || l.starts_with("info run_once after a stop")
    }) {
        println!("[c_programs] cq_loop_test {l}");
    }
}

fn check_mpi_ring(c: &mut Checks, b: &Block) {
    let bad: Vec<&str> = b
        .lines()
        .filter(|l| l.contains("FAIL") || l.contains("FATAL") || l.contains("watchdog") || l.contains("rejecting"))
        .collect();
    c.that(bad.is_empty(), format!("mpi_ring reported failures: {bad:#?}"));
    for rank in 0..MPI_RANKS {
        let next = (rank + 1) % MPI_RANKS;
        let prev = (rank + MPI_RANKS - 1) % MPI_RANKS;
        c.that(
            b.has(&format!("mpi_ring rank={rank}: connected to rank {next} (next) and from rank {prev} (prev)")),
            format!("mpi_ring rank {rank} did not connect its ring neighbours"),
        );
        for mode in ["event", "adaptive"] {
            let prefix = format!("mpi_ring rank={rank} size={MPI_RANKS} mode={mode} ");
            let line = b.lines().find(|l| l.starts_with(&prefix));
            if !c.that(line.is_some(), format!("mpi_ring rank {rank} printed no figures for {mode} mode")) {
                continue;
            }
            let line = line.unwrap();
            println!("[c_programs] {line}");
            let f = kv(line);
            let t = MPI_TRIPS as f64;
            c.that(
                num(&f, "trips") == Some(t) && num(&f, "tokens") == Some(t) && num(&f, "sends") == Some(t),
                format!(
                    "mpi_ring rank {rank} {mode}: every one of the {MPI_TRIPS} tokens received and sent on: {line}"
                ),
            );
            c.that(
                num(&f, "completions") == Some(2.0 * t),
                format!("mpi_ring rank {rank} {mode}: completions: {line}"),
            );
            c.that(
                num(&f, "unacked_now") == Some(0.0),
                format!("mpi_ring rank {rank} {mode}: unacked after stop: {line}"),
            );
            for key in ["wakeups", "per_wakeup", "empty_wakeups", "cq_events", "ack_calls"] {
                c.that(num(&f, key).is_some(), format!("mpi_ring rank {rank} {mode}: no {key}: {line}"));
            }
            c.that(num(&f, "wakeups").unwrap_or(0.0) >= 1.0, format!("mpi_ring rank {rank} {mode}: no wakeup: {line}"));
        }
        for needle in [
            format!("mpi_ring rank={rank}: drained: prev QP 4 flushed receives, no marker reached the callback"),
            format!("mpi_ring rank={rank}: done OK"),
        ] {
            c.that(b.has(&needle), format!("mpi_ring output lacks {needle:?}"));
        }
        let counters = b.line(&format!("mpi_ring rank={rank}: counters "));
        c.that(
            counters.is_some_and(|l| l.ends_with(" outstanding=0")),
            format!("mpi_ring rank {rank}: CM copy counters {counters:?}"),
        );
    }
    for mode in ["event", "adaptive"] {
        let line = b.line(&format!(
            "mpi_ring: mode={mode} token made {MPI_TRIPS} of {MPI_TRIPS} trips around {MPI_RANKS} ranks"
        ));
        if c.that(line.is_some(), format!("mpi_ring: the token did not make all its trips in {mode} mode")) {
            println!("[c_programs] {}", line.unwrap());
        }
    }
}

/// The common shape of the ok/FAIL programs: no FAIL line, the summary
/// line ("`name`: N passed, 0 failed") counts every ok line, at least `min`
/// checks ran, and each needle (the start of an ok line's text) is there.
fn check_ok_program(c: &mut Checks, label: &str, name: &str, b: &Block, min: usize, needles: &[&str]) {
    let ok_lines = b.lines().filter(|l| l.starts_with("ok   ")).count();
    let fails = b.fails();
    c.that(fails.is_empty(), format!("{label} failures: {fails:#?}"));
    let last = b.last_line();
    c.that(
        last == format!("{name}: {ok_lines} passed, 0 failed"),
        format!("{label} final line {last:?} (counted {ok_lines} ok lines)"),
    );
    c.that(ok_lines >= min, format!("{label} ran only {ok_lines} checks (want >= {min})"));
    for needle in needles {
        c.that(b.has(&format!("ok   {needle}")), format!("{label} output lacks \"ok   {needle}\""));
    }
}

/// The info lines that must read the same in the rdmasafe and raw builds.
fn same_info(c: &mut Checks, label: &str, ours: &Block, raw: &Block, prefixes: &[&str]) {
    for prefix in prefixes {
        let (a, b) = (ours.line(prefix), raw.line(prefix));
        c.that(
            a.is_some() && a == b,
            format!("{label}: \"{prefix}\" differs from librdmacm's:\n    rdmasafe: {a:?}\n    raw:      {b:?}"),
        );
    }
}

/// Thread cancellation (12): a thread waiting in each of the get calls is
/// cancelled and joined, with the cancellation arriving during the wait
/// and pending when the call starts; then the channel delivers under a
/// limit of one copy and no copy is alive. Before the get calls were
/// "C-unwind" this aborted ("FATAL: exception not rethrown", exit 134).
fn check_cancel(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let ways: &[(&str, &[&str])] = &[
        (
            "cm_cancel_test",
            &[
                "rdmasafe_get_event",
                "rdmasafe_get_event_timeout(-1)",
                "rdmasafe_get_event_timeout(60000)",
                "rdmasafe_get_events(-1)",
                "ibv_get_cq_event",
                "rdmasafe_async_get(-1)",
                "rdmasafe_async_get(60000)",
            ],
        ),
        ("cm_cancel_test_raw", &["rdma_get_cm_event", "ibv_get_cq_event", "ibv_get_async_event"]),
    ];
    for (label, ways) in ways {
        let b = runs.get(*label).unwrap_or(&empty);
        let mut needles = vec!["after the cancellations: ADDR_RESOLVED got on the same channel".to_string()];
        for way in *ways {
            for pending in ["", " (cancel pending at the call)"] {
                for what in
                    ["the join reports PTHREAD_CANCELED", "the thread's cleanup handler ran", "the call never returned"]
                {
                    needles.push(format!("{way}{pending}: {what}"));
                }
            }
        }
        if *label == "cm_cancel_test" {
            needles.push("no copy alive after the cancelled gets and the free".to_string());
            for what in [
                "the join reports PTHREAD_CANCELED",
                "it returned 0 (no cancellation point inside)",
                "the thread's cleanup handler ran",
                "the stop is kept: the next run returns 0 at once",
            ] {
                needles.push(format!("rdmasafe_cq_loop_stop (cancel pending at the call): {what}"));
            }
            for what in [
                "the join reports PTHREAD_CANCELED",
                "its usleep returned (cancellation deferred)",
                "the get returned its event",
                "cancelled at its next cancellation point",
            ] {
                needles.push(format!("log callback cancelling its thread: {what}"));
            }
        }
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        check_ok_program(c, label, "cm_cancel_test", b, needles.len(), &needles);
    }
}

fn check_ud_mcast(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let ud = [
        "server: CONNECT_REQUEST status 0",
        "server: CONNECT_REQUEST listen_id is the listener",
        "server: CONNECT_REQUEST id is a new id",
        "server: the new id is RDMA_PS_UDP / IBV_QPT_UD",
        "server: the new id carries the listener's context",
        "server: CONNECT_REQUEST param.ud.private_data_len is 180",
        "server: CONNECT_REQUEST private data: all 180 bytes match",
        "server: CONNECT_REQUEST param.ud qp_num 0, qkey 0x0",
        "client: ESTABLISHED status 0",
        "client: ESTABLISHED listen_id is NULL",
        "client: ESTABLISHED id carries the client's context",
        "client: ESTABLISHED param.ud.qp_num",
        "client: ESTABLISHED param.ud.qkey 0x01234567 (want 0x01234567)",
        "client: ESTABLISHED param.ud.private_data_len is 136",
        "client: ESTABLISHED private data: all 136 bytes match",
        "client: ah_attr.is_global is 1",
        "client: ah_attr.grh.dgid ",
        "client: ah_attr.grh.sgid_index",
        "client: ah_attr.port_num",
        "client: ibv_create_ah from the ESTABLISHED event's ah_attr",
        "client: UD SEND through the AH to qp_num",
        "server: the message came from QP",
        "server: all 64 payload bytes match",
        "client: the message came from QP",
        "client: all 64 payload bytes match",
        "client: the answer's address (GID, GID index, port, dlid) is the ESTABLISHED ah_attr's",
        "client: rdma_destroy_id",
        "server: rdma_destroy_id of the accepted id",
    ];
    let mc = [
        "sender: MULTICAST_JOIN status 0",
        "sender: MULTICAST_JOIN id carries the id's context",
        "sender: MULTICAST_JOIN param.ud.private_data 0x",
        "receiver: MULTICAST_JOIN param.ud.private_data 0x",
        "receiver: the byte its context points at is untouched",
        "sender: MULTICAST_JOIN param.ud.private_data_len 0",
        "sender: MULTICAST_JOIN param.ud.qp_num 0xffffff (want 0xffffff)",
        "receiver: MULTICAST_JOIN param.ud.qp_num 0xffffff (want 0xffffff)",
        "sender: MULTICAST_JOIN param.ud.qkey 0x01234567 (want 0x01234567)",
        "receiver: MULTICAST_JOIN param.ud.qkey 0x01234567 (want 0x01234567)",
        "sender: ah_attr is global with grh.dgid ::ffff:239.77.0.9, the group's GID",
        "receiver: ah_attr is global with grh.dgid ::ffff:239.77.0.9, the group's GID",
        "sender: ah_attr.grh.sgid_index",
        "sender: ibv_create_ah from the MULTICAST_JOIN ah_attr",
        "receiver: its UD QP's qkey 0x01234567 is the join's qkey",
        "sender: 4 UD SENDs posted",
        "sender: 4 of 4 send completions, all successful",
        "receiver: the group's messages arrived on the other QP",
        "receiver: every message intact, from the sender's QP",
        "sender: rdma_leave_multicast",
        "receiver: rdma_leave_multicast",
        "sender: rdma_destroy_id",
        "receiver: rdma_destroy_id",
    ];
    for build in ["", "_raw"] {
        let label = format!("cm_ud_test{build}");
        check_ok_program(c, &label, "cm_ud_test", runs.get(&label).unwrap_or(&empty), 70, &ud);
        let label = format!("cm_mcast_test{build}");
        let b = runs.get(&label).unwrap_or(&empty);
        check_ok_program(c, &label, "cm_mcast_test", b, 50, &mc);
        // the context pointers came back as they were given, as pointers
        for who in ["sender", "receiver"] {
            let l = b.lines().find(|l| l.starts_with(&format!("ok   {who}: MULTICAST_JOIN param.ud.private_data 0x")));
            c.that(
                l.is_some_and(|l| l.contains(" is the join's context pointer 0x")),
                format!("{label} {who}: context pointer line {l:?}"),
            );
        }
        if let Some(l) = b.lines().find(|l| l.contains(" multicast messages received")) {
            println!("[c_programs] {label}: {l}");
        }
    }
    // the same values as librdmacm's own events
    let (ours, raw) = (runs.get("cm_ud_test").unwrap_or(&empty), runs.get("cm_ud_test_raw").unwrap_or(&empty));
    same_info(
        c,
        "cm_ud_test",
        ours,
        raw,
        &["info server: CONNECT_REQUEST param.ud ", "info server: CONNECT_REQUEST: ah_attr "],
    );
    let (ours, raw) = (runs.get("cm_mcast_test").unwrap_or(&empty), runs.get("cm_mcast_test_raw").unwrap_or(&empty));
    same_info(
        c,
        "cm_mcast_test",
        ours,
        raw,
        &["info sender: MULTICAST_JOIN ah_attr ", "info receiver: MULTICAST_JOIN ah_attr "],
    );
}

/// One cm_barrier_test run is clean: exit 0, no sanitizer report, no FAIL,
/// both sides saw the barrier hold. Otherwise: why not, in one line.
fn barrier_run(b: Option<&Block>) -> Result<(), String> {
    let Some(b) = b else { return Err("did not run".into()) };
    let asan: Vec<&str> = b.lines_with("ERROR: AddressSanitizer");
    if let Some(first) = asan.first() {
        let frame = b.lines().find(|l| l.trim_start().starts_with("#0 ")).unwrap_or("").trim();
        return Err(format!("exit {:?}: {} ({frame})", b.exit, first.trim()));
    }
    if b.exit != Some(0) || !b.fails().is_empty() {
        return Err(format!("exit {:?}: {:?}", b.exit, b.fails()));
    }
    for side in ["server", "client"] {
        let needle = format!(
            "ok   {side}: the DISCONNECTED handler was done with the connection before rdma_destroy_id returned"
        );
        if !b.has(&needle) {
            return Err(format!("no barrier check passed on the {side} side"));
        }
    }
    if !b.last_line().starts_with("cm_barrier_test: ") || !b.last_line().ends_with(" passed, 0 failed") {
        return Err(format!("final line {:?}", b.last_line()));
    }
    Ok(())
}

fn check_barrier(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    for (name, n) in [("cm_barrier_test", BARRIER_RUNS), ("cm_barrier_test_raw", BARRIER_RAW_RUNS)] {
        let results: Vec<Result<(), String>> = (1..=n).map(|i| barrier_run(runs.get(&format!("{name}.{i}")))).collect();
        let clean = results.iter().filter(|r| r.is_ok()).count();
        let bad: Vec<String> = results
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().err().map(|e| format!("run {}: {e}", i + 1)))
            .collect();
        println!("[c_programs] {name} (ASan): {clean} of {n} runs clean");
        c.that(
            clean == n,
            format!("{name} (ASan): {clean} of {n} runs clean; the others:\n    {}", bad.join("\n    ")),
        );
    }
    let empty = Block::default();
    let mut destroy_ms = Vec::new();
    for label in ["cm_barrier_test_hold", "cm_barrier_test_raw_hold"] {
        let b = runs.get(label).unwrap_or(&empty);
        c.that(!b.has("AddressSanitizer"), format!("{label}: sanitizer report"));
        check_ok_program(
            c,
            label,
            "cm_barrier_test",
            b,
            30,
            &["client: rdma_destroy_id of the connection returned 0", "server: client process exited 0"],
        );
        let ms = b.num("destroy_ms");
        c.that(ms.is_some(), format!("{label}: no `measure destroy_ms=` line"));
        c.that(
            b.has("info client: CM thread freed the kept DISCONNECTED event "),
            format!("{label}: the kept DISCONNECTED was not freed"),
        );
        destroy_ms.push(ms);
    }
    let show = |ms: Option<f64>| ms.map_or("?".to_string(), |v| format!("{v:.1}"));
    println!(
        "[c_programs] cm_barrier_test -H: rdma_destroy_id with the DISCONNECTED copy held took {} ms (raw librdmacm: {} ms)",
        show(destroy_ms[0]),
        show(destroy_ms[1])
    );
}

#[test]
fn c_programs_on_rdma() {
    let t0 = Instant::now();
    let root = root();
    let profile = profile_dir();
    let lib = ensure_library(&profile);
    let bin = profile.parent().expect("<target>").join("c");
    build_c_programs(&profile, &bin);
    println!("[c_programs] built against {} in {:.1} s", lib.display(), t0.elapsed().as_secs_f64());

    let script = root.join("tests/c/run-in-guest.sh");
    let hw = match (std::env::var("RDMASAFE_DEVICE"), std::env::var("RDMASAFE_ADDR")) {
        (Ok(d), Ok(a)) if !d.is_empty() && !a.is_empty() => Some((d, a)),
        _ => None,
    };
    let mut cmd;
    if let Some((device, addr)) = &hw {
        println!("[c_programs] real hardware: {device} ({addr}), on the host");
        cmd = Command::new("timeout");
        cmd.args(["-k", "10", &GUEST_TIMEOUT.to_string(), "bash"])
            .arg(&script)
            .env("RDMASAFE_TEST_DEVICE", device)
            .env("RDMASAFE_TEST_ADDR", addr)
            .env("RDMASAFE_TEST_GID_INDEX", std::env::var("RDMASAFE_GID_INDEX").unwrap_or_else(|_| "0".into()));
    } else {
        cmd = Command::new(root.join("tests/bed/vm-run"));
        cmd.args(["--timeout", &GUEST_TIMEOUT.to_string(), "--", "bash"]).arg(&script);
    }
    cmd.current_dir(&root).env("RDMASAFE_C_BIN", &bin);
    let t1 = Instant::now();
    let out = cmd.output().expect("run tests/c/run-in-guest.sh");
    let run_secs = t1.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    println!("[c_programs] guest run {run_secs:.1} s, total {:.1} s", t0.elapsed().as_secs_f64());

    let runs = blocks(&stdout);
    let mut c = Checks::default();
    c.that(out.status.success(), format!("run-in-guest.sh exit status {}", out.status));
    c.that(stdout.contains("==== SUMMARY 0 failed"), "the script's summary does not say 0 failed");
    let mut labels = vec![
        "cm_capi_test",
        "messenger_server",
        "messenger_sigterm_server",
        "messenger_sigterm_client",
        "rdmasafe_rdma_server",
        "rdma_client",
        "rdma_server",
        "rdmasafe_rdma_client",
        "cq_loop_test",
        "mpi_ring",
        "cm_ud_test",
        "cm_ud_test_raw",
        "cm_mcast_test",
        "cm_mcast_test_raw",
        "cm_barrier_test_hold",
        "cm_barrier_test_raw_hold",
        "cm_cancel_test",
        "cm_cancel_test_raw",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    labels.extend([100, 201, 202, 203, 204].map(|id| format!("messenger_client_{id}")));
    for label in &labels {
        let exit = runs.get(label).and_then(|b| b.exit);
        c.that(exit == Some(0), format!("{label}: exit {exit:?} (want Some(0); None = did not run)"));
    }
    let empty = Block::default();
    check_cm_capi_test(&mut c, runs.get("cm_capi_test").unwrap_or(&empty));
    check_messenger(&mut c, &runs);
    check_interop(&mut c, &runs);
    check_cq_loop_test(&mut c, runs.get("cq_loop_test").unwrap_or(&empty));
    check_mpi_ring(&mut c, runs.get("mpi_ring").unwrap_or(&empty));
    check_ud_mcast(&mut c, &runs);
    check_cancel(&mut c, &runs);
    check_barrier(&mut c, &runs);

    println!("[c_programs] {} expectations met, {} failed", c.passed, c.failures.len());
    assert!(
        c.failures.is_empty(),
        "C programs on RDMA: {} failed expectations:\n  {}",
        c.failures.len(),
        c.failures.join("\n  ")
    );
}
