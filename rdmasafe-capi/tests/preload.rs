//! librdmasafe-preload.so (rdmasafe-preload/) under unmodified programs, in
//! ONE Soft-RoCE guest (tests/bed/vm-run, tests/preload/run-in-guest.sh):
//!
//! 1. copy mode against stock peers: rdma-core's stock `rping`, `cmtime`,
//!    `ucmatose`, `udaddy`, `rdma_server`/`rdma_client` (synchronous ids:
//!    `rdma_create_ep` without a channel) and perftest's `ib_send_lat -R`,
//!    each run with both sides stock (the baseline), with the server under
//!    the preload and with the client under it; then rping 20 more times
//!    under the preload (the client in odd runs, the server in even ones).
//!    Each side must exit as the stock one did and print the same lines,
//!    numbers (timings, addresses, keys, QP numbers) aside and in any order
//!    (the tools print from several threads). The preloaded side's exit line
//!    (RDMASAFE_LOG=info) must show every event went through the preload:
//!    got = copied = freed = acked, nothing outstanding, no ack of a
//!    non-copy, and as many events as the program saw (rping -d prints each
//!    one; cmtime, rdma_server/rdma_client: the fixed sequences of their
//!    protocols; the others: what the same program got in check mode, which
//!    counts librdmacm's own events);
//! 2. the raw librdmacm build of tests/c/cm_barrier_test (rping-shaped,
//!    ASan: it relies on rdma_destroy_id's barrier) under the preload, 5
//!    runs clean (tests/c runs it 30 times on librdmasafe.so), and once with a DISCONNECTED copy held 5 s (`-H`: the
//!    destroy must return; its time is printed, not asserted); and
//!    tests/preload/check_cm_bugs in copy mode: a copy never freed is
//!    outstanding at exit, a double ack is refused (-1/EINVAL), a destroy
//!    of an id whose copy is never freed returns (the deadline acked the
//!    original); and the raw build of tests/c/cm_cancel_test, in copy and
//!    in check mode: threads waiting in the interposed rdma_get_cm_event
//!    and ibv_get_cq_event are cancelled and joined (PTHREAD_CANCELED,
//!    their cleanup handlers run) and the channel delivers afterwards; in
//!    check mode also a thread cancelled in rdma_destroy_id's wait (the
//!    event it waited for is reported held, the destroy never as waiting);
//! 3. check mode (RDMASAFE_CHECK=1 / fix) on the C bug programs of
//!    tests/preload: each bug's report, with the event type, event, id and
//!    CQ addresses the program printed (a held event also in a child
//!    forked after the parent's first event); with `fix` the hanging destroys
//!    return; the correct programs report nothing;
//! 4. the stock tools with both sides in check mode: nothing reported, and
//!    the same exits and output as stock.
//!
//! rping and cmtime each have a teardown race of their own (their CM
//! thread reads the channel after main destroyed it: EBADF); a run that
//! lost it is compared as the run the tool meant (see `lost_teardown_race`).
//! rping's client may or may not see DISCONNECTED before it destroys its id
//! (a race in rping itself: stock runs differ in it too), so its
//! DISCONNECTED lines are left out of the comparison; the count check
//! holds either way. So are perftest's warnings about its clock calibration
//! ("Correlation coefficient r^2: 0.76814 < 0.9", seen from a stock
//! ib_send_lat on a busy machine): timing, not output. perftest's client
//! may ask for its data connection before its server listens for it (a
//! second listen after the control connection; REJECTED, no listener): the
//! script runs such a pair once more and says so.
//!
//! Runs on the host (the name does not start with `rxe_`); it boots the
//! guest itself, once: 8.3 to 10.7 minutes of guest time measured with
//! load averages of 9 to 12 on 2 cores (TCG), less on a quiet machine. With
//! RDMASAFE_DEVICE and RDMASAFE_ADDR set (real hardware, opt-in) the script
//! runs on the host. RDMASAFE_PRELOAD_REPLAY=FILE checks a saved output of
//! the script instead of running it (for work on the checks only).

mod common;

use common::{blocks, build_cdylib, profile_dir, root, run_logged, Block};

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Seconds the guest may run before vm-run kills it (a watchdog; the
/// script took 10 min at a host load average of 9).
const GUEST_TIMEOUT: u32 = 2400;
/// rping runs under the preload after the three rounds (the 20).
const RPING_RUNS: usize = 20;
/// Runs of cm_barrier_test_raw under the preload.
const BARRIER_RUNS: usize = 5;
/// The stock tool pairs, by the label run-in-guest.sh gives them.
const TOOLS: &[&str] = &["rping", "cmtime", "ucmatose", "udaddy", "rdma_server", "ib_send_lat"];
const SIDES: &[&str] = &["server", "client"];

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

/// Builds the preload (the cdylib, `<profile>/librdmasafe_preload.so`) and
/// the C programs of tests/preload (`<target>/preload/`).
fn build(profile: &Path) -> (PathBuf, PathBuf) {
    // Once per test process: tests run on threads, and two makes in one
    // folder at once would race.
    static BUILT: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| build_once(profile)).clone()
}

fn build_once(profile: &Path) -> (PathBuf, PathBuf) {
    let target = profile.parent().expect("<target>");
    let lib = build_cdylib(profile, "rdmasafe-preload", "librdmasafe_preload.so");
    let bin = target.join("preload");
    run_logged(
        "make -C tests/preload",
        Command::new("make").current_dir(root()).args(["-C", "tests/preload"]).arg(format!("OUT={}", bin.display())),
    );
    for p in
        ["check_cm_bugs", "check_cq_bugs", "cm_barrier_test_raw", "cm_cancel_test_raw", "late_cm", "late_cm_plugin.so"]
    {
        assert!(bin.join(p).exists(), "make did not produce {p}");
    }
    (lib, bin)
}

/// Words after which rping and perftest print a hex number (a key, an
/// address, a QP number): there even a number of hex letters only ("bedf",
/// a 4-digit lkey, about one in 50) is a number.
const HEX_AFTER: &[&str] = &["rkey", "lkey", "addr", "laddr", "id", "cb", "pd", "cq", "qp", "channel", "QPN", "PSN"];

/// `word` is a number: decimal, hex (with or without 0x), with a fraction;
/// after a word of [`HEX_AFTER`], hex letters only are one too.
fn is_number(word: &str, prev: &str) -> bool {
    // perftest prints a degenerate timing as inf / -nan (seen under load).
    if word == "inf" || word == "nan" {
        return true;
    }
    let digits = word.strip_prefix("0x").unwrap_or(word);
    let hex = !digits.is_empty() && digits.chars().all(|c| c.is_ascii_hexdigit() || c == '.');
    hex && (word.chars().any(|c| c.is_ascii_digit()) || (HEX_AFTER.contains(&prev) && !digits.contains('.')))
}

/// A line with every number as `#` and runs of blanks as one space:
/// timings, addresses, keys, QP numbers and PSNs differ run to run.
fn normalize(line: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let mut prev = String::new();
    let flush = |word: &mut String, prev: &mut String, out: &mut String| {
        if word.is_empty() {
            return;
        }
        out.push_str(if is_number(word, prev) { "#" } else { word });
        *prev = std::mem::take(word);
    };
    for ch in line.chars() {
        if ch.is_ascii_alphanumeric() || ch == '.' {
            word.push(ch);
        } else {
            flush(&mut word, &mut prev, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut prev, &mut out);
    // A sign in front of a number is part of the figure.
    out.split_whitespace().map(|w| if w == "-#" { "#" } else { w }).collect::<Vec<_>>().join(" ")
}

/// Lines left out of the comparison: rping's client lines that depend on
/// a race in rping (see the top), and perftest's warnings about its own
/// clock calibration (timing: printed by stock runs too, now and then).
fn racy(tool: &str, side: &str, line: &str) -> bool {
    match tool {
        "rping" => {
            side == "client"
                && (line.starts_with("cma_event type RDMA_CM_EVENT_DISCONNECTED")
                    || line == "client DISCONNECT EVENT...")
        }
        "ib_send_lat" => line.starts_with("Correlation coefficient r^2:") || line.contains("CPU Frequency"),
        _ => false,
    }
}

/// What a program printed, as compared: its lines (the preload's own
/// `rdmasafe[...]` log lines left out), normalized, sorted.
fn view(tool: &str, side: &str, b: &Block) -> Vec<String> {
    let mut v: Vec<String> = b
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("rdmasafe[") && !racy(tool, side, l.trim()))
        .map(normalize)
        .collect();
    v.sort();
    v
}

/// The difference of two views, for a message.
fn diff(a: &[String], b: &[String]) -> String {
    let mut only_a: Vec<&String> = Vec::new();
    let mut rest: Vec<&String> = b.iter().collect();
    for l in a {
        match rest.iter().position(|r| *r == l) {
            Some(i) => {
                rest.remove(i);
            }
            None => only_a.push(l),
        }
    }
    format!("only in stock: {only_a:?}; only here: {rest:?}")
}

/// `key=value` of a counter line (value up to the next space).
fn field(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split(' ').next()?.parse().ok()
}

/// The preload's exit lines in a stderr block.
fn exit_lines(b: &Block) -> Vec<&str> {
    b.lines().filter(|l| l.starts_with("rdmasafe[INFO]: preload exit [")).collect()
}

/// What a copy-mode side's exit line says: checks its balance, returns
/// the events copied.
/// `get_errors`: the failed gets allowed (a lost teardown race: none or
/// one, see [`lost_teardown_race`]).
fn copy_counters(c: &mut Checks, label: &str, err: &Block, get_errors: RangeInclusive<u64>) -> Option<u64> {
    let lines = exit_lines(err);
    if !c.that(lines.len() == 1, format!("{label}: {} preload exit lines (want 1): {lines:?}", lines.len())) {
        return None;
    }
    let l = lines[0];
    let f = |k: &str| field(l, k);
    c.that(l.contains(": mode=copy "), format!("{label}: not in copy mode: {l}"));
    let copied = f("copied");
    c.that(copied.is_some_and(|n| n > 0), format!("{label}: no event copied: {l}"));
    c.that(
        f("gets") == copied && f("freed") == copied && f("acks") == copied && f("originals_acked") == copied,
        format!("{label}: gets, copied, freed, acks and originals acked differ: {l}"),
    );
    c.that(f("outstanding") == Some(0), format!("{label}: copies outstanding at exit: {l}"));
    c.that(f("not_copies") == Some(0), format!("{label}: acks of non-copies: {l}"));
    c.that(
        f("get_errors").is_some_and(|n| get_errors.contains(&n)),
        format!("{label}: failed gets (want {get_errors:?}): {l}"),
    );
    copied
}

/// Events a side of a tool gets in every run (the fixed sequences of
/// their protocols); `None`: known from check mode instead.
fn fixed_events(tool: &str, side: &str) -> Option<u64> {
    match (tool, side) {
        // 10 connections: ADDR_RESOLVED, ROUTE_RESOLVED, ESTABLISHED,
        // DISCONNECTED each (the server's, killed, are counted by trace)
        ("cmtime", "client") => Some(40),
        ("cmtime", "server") => Some(30),
        // synchronous ids: ADDR_RESOLVED, ROUTE_RESOLVED, ESTABLISHED,
        // DISCONNECTED (rdma_connect / rdma_disconnect wait for them)
        ("rdma_server", "client") => Some(4),
        // CONNECT_REQUEST (rdma_get_request), ESTABLISHED, DISCONNECTED
        ("rdma_server", "server") => Some(3),
        _ => None,
    }
}

/// The check-mode exit line's cm_events of a tool's side, if any.
fn check_events(runs: &BTreeMap<String, Block>, tool: &str, side: &str) -> Option<u64> {
    let b = runs.get(&format!("{tool}.check.{side}.err"))?;
    exit_lines(b).first().and_then(|l| field(l, "cm_events"))
}

#[derive(Default)]
struct Totals {
    copied: u64,
    preloaded_runs: usize,
    rping_runs: usize,
    /// Processes (labels) that lost their tool's own teardown race (see
    /// [`lost_teardown_race`]), each with whether it ran under the preload
    /// in copy mode.
    races: BTreeMap<String, bool>,
    /// Sides under the preload (copy or check mode) whose lost race ended
    /// the process before the preload's exit line (see
    /// [`lost_teardown_race`]): nothing of theirs counted.
    unwritten: usize,
}

/// What rping's CM thread prints when it loses its teardown race.
const RPING_RACE_LINE: &str = "rdma_get_cm_event: Bad file descriptor";
/// What cmtime's event thread prints when it loses its teardown race.
const CMTIME_RACE_LINE: &str = "failure in rdma_get_cm_event in process_server_events: Bad file descriptor";

/// A stock tool's own teardown race (see [`lost_teardown_race`]): the line
/// its CM thread prints when its rdma_get_cm_event fails with EBADF, and
/// the exit statuses a run that printed it may end with.
struct TeardownRace {
    line: &'static str,
    exits: &'static [i32],
    /// Whether the thread that printed the line calls exit(3) while main
    /// may be exiting too, which can end the process before the preload's
    /// exit line is written.
    exits_race: bool,
}

fn teardown_race(tool: &str) -> Option<TeardownRace> {
    match tool {
        // the thread calls exit(-1) after the print, racing main's return
        "rping" => Some(TeardownRace { line: RPING_RACE_LINE, exits: &[0, 255], exits_race: true }),
        // the thread returns after the print; main goes on and exits 0
        "cmtime" => Some(TeardownRace { line: CMTIME_RACE_LINE, exits: &[0], exits_race: false }),
        _ => None,
    }
}

/// rping of rdma-core 44.0 (Debian 12's rdmacm-utils) has a teardown race
/// of its own, on both sides: its CM thread loops on rdma_get_cm_event
/// forever, and the main thread destroys the event channel (closing its fd)
/// right after its last rdma_destroy_id returns (the client's one id; the
/// server's listening id, after the child's), without stopping that thread.
/// If the thread comes back to rdma_get_cm_event after the close, the call
/// fails with EBADF and the thread calls exit(-1) after printing
/// [`RPING_RACE_LINE`]. Its exit races main's return: the status is 255 or
/// 0, at the very end of a run whose output is otherwise complete; if
/// main's exit ends the process between the failed get and the print, only
/// the preload's exit line shows it (one failed get). (rdma-core fixed it
/// later: the CM thread polls an eventfd too and is joined before the
/// channel is destroyed.) The window is the thread's time from its ack of
/// DISCONNECTED, which lets the destroy return, to its next read of the
/// fd: wider under the preload (the free and the next get do more than
/// librdmacm's) and on a busy machine. Such a run is counted, and compared
/// as the run rping meant: its stdout as stock's, its stderr as stock's but
/// for that one line, exit 0, and under the preload a balanced exit line
/// with at most that one failed get: the exit line is written by main's
/// exit, which may come before the thread's failed get is counted (CI
/// 2026-12-03: the line printed, `get_errors=0`). The two exits race as
/// well: exit(3) is MT-Unsafe (race:exit), and in Debian 12's glibc (2.36) each exit takes
/// the next handler off one shared list and goes on to _exit once the list
/// is empty, so the exit that finds it empty can end the process while the
/// other is still before or inside the dynamic linker's fini, which runs
/// the preload's destructor: such a run has the race line and no exit line
/// at all (2026-12-05, exit 255), and it has no copies to count.
///
/// cmtime of rdma-core 44.0 has the same race on its client side: its
/// event thread (`process_events`) loops on rdma_get_cm_event, and main
/// destroys the channel after its last rdma_destroy_id (cleanup_nodes)
/// without stopping or joining that thread (rdma-core's current cmtime
/// still does not join it; it prints another line and exits on the failed
/// get instead). The thread that comes back to the fd after the close prints
/// [`CMTIME_RACE_LINE`] and returns; main's run is complete and exits 0.
/// A full run on 2 busy cores (2026-12-03) saw it in 2 of the 4 cmtime
/// clients, the preloaded one and the one in check mode; with 4 clients a
/// run, no cap on them would tell a pattern from chance, so each raced run
/// is compared as meant and listed, and only rping's races are capped.
fn lost_teardown_race(tool: &str, out: &Block, err: &Block) -> bool {
    let Some(race) = teardown_race(tool) else { return false };
    match err.lines().filter(|l| l.trim() == race.line).count() {
        1 => out.exit.is_some_and(|e| race.exits.contains(&e)),
        // ended before the print: main's exit won, the preload counted it
        0 => out.exit == Some(0) && exit_lines(err).iter().map(|l| field(l, "get_errors")).eq([Some(1)]),
        _ => false,
    }
}

/// A run's exit status and stderr view as compared: those of the run the
/// tool meant if it lost its teardown race (see [`lost_teardown_race`]).
fn as_meant(tool: &str, side: &str, out: &Block, err: &Block, raced: bool) -> (Option<i32>, Vec<String>) {
    let mut v = view(tool, side, err);
    if let (true, Some(race)) = (raced, teardown_race(tool)) {
        v.retain(|l| *l != normalize(race.line));
        return (Some(0), v);
    }
    (out.exit, v)
}

/// One run of a tool pair in `cfg` (pserver, pclient, check; `run` for the
/// rping repeats) against the stock baseline.
fn check_pair(
    c: &mut Checks,
    runs: &BTreeMap<String, Block>,
    tool: &str,
    cfg: &str,
    run: Option<usize>,
    t: &mut Totals,
) {
    let empty = Block::default();
    let label = |cfg: &str, side: &str| match run {
        Some(i) if cfg != "stock" => format!("{tool}.{cfg}.{i}.{side}"),
        _ => format!("{tool}.{cfg}.{side}"),
    };
    for side in SIDES {
        let (stock, this) = (label("stock", side), label(cfg, side));
        let (so, se) = (runs.get(&stock).unwrap_or(&empty), runs.get(&format!("{stock}.err")).unwrap_or(&empty));
        let (to, te) = (runs.get(&this).unwrap_or(&empty), runs.get(&format!("{this}.err")).unwrap_or(&empty));
        let want_exit = if tool == "cmtime" && *side == "server" { 130 } else { 0 }; // stopped by SIGINT
        let preloaded = cfg == format!("p{side}");
        let (stock_raced, raced) = (lost_teardown_race(tool, so, se), lost_teardown_race(tool, to, te));
        let (stock_exit, stock_err) = as_meant(tool, side, so, se, stock_raced);
        c.that(stock_exit == Some(want_exit), format!("{stock}: exit {:?} (want {want_exit})", so.exit));
        if stock_raced && t.races.insert(stock.clone(), false).is_none() {
            println!("[preload] {stock}: lost {tool}'s own teardown race (exit {:?}); compared as meant", so.exit);
        }
        if !c.that(to.exit.is_some(), format!("{this}: did not run")) {
            continue;
        }
        if raced && t.races.insert(this.clone(), preloaded).is_none() {
            println!("[preload] {this}: lost {tool}'s own teardown race (exit {:?}); compared as meant", to.exit);
        }
        let (this_exit, this_err) = as_meant(tool, side, to, te, raced);
        // The race's two exits ended the process before the preload's
        // destructor wrote its exit line (see [`lost_teardown_race`]).
        let no_exit_line = raced && teardown_race(tool).is_some_and(|r| r.exits_race) && exit_lines(te).is_empty();
        c.that(this_exit == stock_exit, format!("{this}: exit {:?}, stock {:?}", to.exit, so.exit));
        let (vs, vt) = (view(tool, side, so), view(tool, side, to));
        c.that(vs == vt, format!("{this}: stdout differs from stock's: {}", diff(&vs, &vt)));
        c.that(
            stock_err == this_err,
            format!("{this}.err: stderr differs from stock's: {}", diff(&stock_err, &this_err)),
        );

        if cfg == "check" {
            let rep = runs.get(&format!("{this}.report"));
            c.that(rep.is_some_and(|r| r.out.trim().is_empty()), format!("{this}: check mode reported {rep:?}"));
            let l = exit_lines(te);
            if no_exit_line {
                // seen once under load
                println!("[preload] {this}: no check-mode exit line after the lost teardown race");
                t.unwritten += 1;
            } else if !(tool == "cmtime" && *side == "server") {
                c.that(
                    l.len() == 1
                        && l[0].contains(": mode=check ")
                        && field(l[0], "reports") == Some(0)
                        && field(l[0], "cm_unacked") == Some(0)
                        && field(l[0], "bad_acks") == Some(0)
                        && field(l[0], "cq_problems") == Some(0),
                    format!("{this}: check mode's exit line {l:?}"),
                );
            }
        } else if preloaded {
            t.preloaded_runs += 1;
            let copied = if tool == "cmtime" && *side == "server" {
                // killed by SIGINT: no exit line; each copy is a trace line
                let n = te.count("rdmasafe[TRACE]: copied CM event ") as u64;
                for (ty, want) in [("CONNECT_REQUEST", 10), ("ESTABLISHED", 10), ("DISCONNECTED", 10)] {
                    let got = te.count(&format!("rdmasafe[TRACE]: copied CM event {ty} status 0"));
                    c.that(got == want, format!("{this}: {got} {ty} copies (want {want})"));
                }
                Some(n)
            } else if no_exit_line {
                // 2026-12-05: the race line, exit 255, no exit line: nothing
                // to count for this run; its output was compared above.
                println!("[preload] {this}: no copy-mode exit line after the lost teardown race");
                t.unwritten += 1;
                continue;
            } else {
                // The exit line is written by main's exit, which races the
                // CM thread's failed get: counted or not yet (CI 2026-12-03:
                // rping's race line with get_errors=0).
                copy_counters(c, &this, te, if raced { 0..=1 } else { 0..=0 })
            };
            let want = match tool {
                "rping" => Some(to.count("cma_event type ") as u64),
                _ => fixed_events(tool, side).or_else(|| check_events(runs, tool, side)),
            };
            c.that(
                want.is_some() && copied == want,
                format!("{this}: {copied:?} events copied, the program got {want:?}"),
            );
            t.copied += copied.unwrap_or(0);
        } else {
            c.that(exit_lines(te).is_empty(), format!("{this}: the stock side logged a preload line"));
        }
    }
}

fn check_copy_mode(c: &mut Checks, runs: &BTreeMap<String, Block>) -> Totals {
    let mut t = Totals::default();
    for tool in TOOLS {
        for cfg in ["pserver", "pclient", "check"] {
            check_pair(c, runs, tool, cfg, None, &mut t);
        }
    }
    let before = t.preloaded_runs;
    for i in 1..=RPING_RUNS {
        let cfg = if i % 2 == 0 { "pserver" } else { "pclient" };
        check_pair(c, runs, "rping", cfg, Some(i), &mut t);
    }
    let rping = t.preloaded_runs - before;
    t.rping_runs = rping;
    c.that(rping == RPING_RUNS, format!("{rping} rping runs under the preload (want {RPING_RUNS})"));
    check_race_counts(c, &t);
    t
}

/// rping's teardown race now and then, not as a pattern: at most 4 of the
/// 22 rping sides run under the preload in copy mode (one each of pserver
/// and pclient, then RPING_RUNS), and a quarter of all 48 rping processes
/// (stock's pair, then both sides of pserver, pclient, check and the
/// RPING_RUNS repeats).
fn check_race_counts(c: &mut Checks, t: &Totals) {
    let rping: BTreeMap<&String, &bool> = t.races.iter().filter(|(l, _)| l.starts_with("rping.")).collect();
    let preloaded = rping.values().filter(|p| ***p).count();
    let sides = 2 + RPING_RUNS;
    c.that(
        preloaded <= 4,
        format!(
            "{preloaded} of the {sides} preloaded rping sides lost rping's teardown race (at most 4 may): {rping:?}"
        ),
    );
    let processes = 2 * (1 + 3 + RPING_RUNS);
    c.that(
        rping.len() * 4 <= processes,
        format!(
            "{} of the {processes} rping processes lost rping's teardown race (at most a quarter may): {rping:?}",
            rping.len()
        ),
    );
}

/// Thread cancellation: the raw build of tests/c/cm_cancel_test under the
/// preload, in copy and in check mode. Threads waiting in the interposed
/// rdma_get_cm_event and ibv_get_cq_event (and, as a control, libibverbs'
/// own ibv_get_async_event) are cancelled and joined; before the
/// interposers were "C-unwind" this aborted the process ("FATAL:
/// exception not rethrown", exit 134).
fn check_cancel(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    for label in ["cm_cancel_test_raw.preload.run", "cm_cancel_test_raw.check.run"] {
        let out = runs.get(label).unwrap_or(&empty);
        let last = out.last_line();
        let oks = out.lines().filter(|l| l.starts_with("ok   ")).count();
        c.that(
            out.exit == Some(0) && out.fails().is_empty() && last == format!("cm_cancel_test: {oks} passed, 0 failed"),
            format!("{label}: exit {:?}, failures {:?}, last {last:?}", out.exit, out.fails()),
        );
        for way in ["rdma_get_cm_event", "ibv_get_cq_event", "ibv_get_async_event"] {
            for pending in ["", " (cancel pending at the call)"] {
                let want = format!("ok   {way}{pending}: the join reports PTHREAD_CANCELED");
                c.that(out.has(&want), format!("{label}: no \"{want}\""));
            }
        }
        c.that(
            out.has("ok   after the cancellations: ADDR_RESOLVED got on the same channel"),
            format!("{label}: the channel did not deliver after the cancellations"),
        );
    }
    // A thread cancelled in rdma_destroy_id's wait (check mode, hold
    // threshold 300 ms, the event held 3 s after the cancel): the event is
    // reported held, the destroy never as waiting. Before check mode ended
    // the destroy in a cleanup handler it was reported 300 ms in.
    let label = "cm_cancel_test_raw.destroy.run";
    let out = runs.get(label).unwrap_or(&empty);
    let last = out.last_line();
    let oks = out.lines().filter(|l| l.starts_with("ok   ")).count();
    c.that(
        out.exit == Some(0)
            && out.fails().is_empty()
            && last == format!("cm_cancel_test: {oks} passed, 0 failed")
            && out.has("ok   rdma_destroy_id: the join reports PTHREAD_CANCELED"),
        format!("{label}: exit {:?}, failures {:?}, last {last:?}", out.exit, out.fails()),
    );
    // A waiting destroy may be reported while it still waits (a busy
    // machine may cancel it late, past the threshold): true then, and its
    // wait is at most what the program measured until the join (a few ms
    // of slack for the coarse clock). A report after the cancel says a
    // longer wait.
    let waited_until_join = word_after(out, "info destroy: waited ").and_then(|w| w.parse::<u64>().ok());
    let rep = reports(runs.get(&format!("{label}.report")));
    let late: Vec<&(String, String)> = rep
        .iter()
        .filter(|(k, text)| {
            k == "destroy-id-waiting"
                && waited_until_join
                    .is_none_or(|j| waited_in_report(text).is_none_or(|w| w > j + DESTROY_REPORT_SLACK_MS))
        })
        .collect();
    c.that(
        waited_until_join.is_some() && rep.iter().any(|(k, _)| k == "held") && late.is_empty(),
        format!(
            "{label}: reports {rep:?}, the destroy waited {waited_until_join:?} ms until the join (want held, and \
             no destroy-id-waiting for a longer wait: {late:?})"
        ),
    );
}

/// The coarse clock check mode reads (a tick of a few ms), both ends.
const DESTROY_REPORT_SLACK_MS: u64 = 20;

/// N of a destroy-id-waiting report's "has waited N ms".
fn waited_in_report(text: &str) -> Option<u64> {
    let at = text.find(" has waited ")? + " has waited ".len();
    text[at..].split(' ').next()?.parse().ok()
}

/// The barrier: the raw (unmodified) rping-shaped program under the preload.
fn check_barrier(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let mut clean = 0;
    let mut copied = 0;
    for i in 1..=BARRIER_RUNS + 1 {
        let label = if i > BARRIER_RUNS {
            "cm_barrier_test_raw.preload.hold.run".to_string()
        } else {
            format!("cm_barrier_test_raw.preload.{i}.run")
        };
        let out = runs.get(&label).unwrap_or(&empty);
        let err = runs.get(&format!("{label}.err")).unwrap_or(&empty);
        let asan = out.has("AddressSanitizer") || err.has("AddressSanitizer");
        let last = out.last_line();
        let ok = out.exit == Some(0)
            && !asan
            && out.fails().is_empty()
            && last.starts_with("cm_barrier_test: ")
            && last.ends_with(" passed, 0 failed")
            && SIDES.iter().all(|s| {
                out.has(&format!(
                    "ok   {s}: the DISCONNECTED handler was done with the connection before rdma_destroy_id returned"
                )) || i > BARRIER_RUNS
            });
        if c.that(ok, format!("{label}: exit {:?}, ASan {asan}, failures {:?}, last {last:?}", out.exit, out.fails())) {
            clean += 1;
        }
        // two processes (server, and the client it forks and execs)
        let lines = exit_lines(err);
        c.that(lines.len() == 2, format!("{label}: {} preload exit lines (want 2)", lines.len()));
        for l in &lines {
            let f = |k: &str| field(l, k);
            c.that(
                f("copied").is_some_and(|n| n > 0) && f("freed") == f("copied") && f("outstanding") == Some(0),
                format!("{label}: {l}"),
            );
            copied += f("copied").unwrap_or(0);
        }
        if i > BARRIER_RUNS {
            c.that(
                out.has("ok   client: rdma_destroy_id of the connection returned 0")
                    && out.has("info client: CM thread freed the kept DISCONNECTED event "),
                format!("{label}: the held DISCONNECTED copy and the destroy: {:?}", out.lines_with("client:")),
            );
            let deadline: u64 = lines.iter().filter_map(|l| field(l, "acked_at_deadline")).sum();
            println!(
                "[preload] cm_barrier_test_raw -H under the preload: rdma_destroy_id with the DISCONNECTED copy \
                 held 5 s took {} ms; originals acked at the deadline: {deadline}",
                out.measure("destroy_ms").unwrap_or("?")
            );
        }
    }
    println!(
        "[preload] cm_barrier_test_raw (ASan) under the preload: {clean} of {} runs clean, {copied} events copied",
        BARRIER_RUNS + 1
    );
}

/// Copy mode under the buggy check_cm_bugs modes: the exit line counts
/// what they did, and the destroy without an ack returns (bounded).
fn check_copy_books(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    for (mode, copied, freed, not_copies, at_deadline) in
        [("leak", 1, 0, 0, 0), ("double", 1, 1, 1, 0), ("destroy", 1, 0, 0, 1)]
    {
        let label = format!("check_cm_bugs.{mode}.copy");
        let b = runs.get(&label).unwrap_or(&empty);
        let err = runs.get(&format!("{label}.err")).unwrap_or(&empty);
        c.that(
            b.exit == Some(0) && b.last_line() == "check_cm_bugs: done",
            format!("{label}: exit {:?}, last line {:?}", b.exit, b.last_line()),
        );
        let l = exit_lines(err);
        let ok = l.len() == 1 && {
            let f = |k: &str| field(l[0], k);
            f("copied") == Some(copied)
                && f("freed") == Some(freed)
                && f("outstanding") == Some(copied - freed)
                && f("not_copies") == Some(not_copies)
                && f("acked_at_deadline") == Some(at_deadline)
        };
        c.that(
            ok,
            format!(
                "{label}: exit line {l:?} (want copied={copied} freed={freed} outstanding={} not_copies={not_copies} \
                 acked_at_deadline={at_deadline})",
                copied - freed
            ),
        );
        match mode {
            "double" => c.that(
                b.has("second rdma_ack_cm_event of the same event: -1 (Invalid argument)"),
                format!("{label}: the second ack was not refused: {:?}", b.out),
            ),
            "destroy" => c.that(b.has("rdma_destroy_id returned 0"), format!("{label}: {:?}", b.out)),
            _ => true,
        };
    }
}

/// A plugin linked with librdmacm, loaded with dlopen (RTLD_LOCAL or
/// RTLD_GLOBAL) by a program that is not, also after the preload set
/// itself up (a libibverbs call first): its CM calls work, copied in copy
/// mode, watched in check mode. (The preload depends on librdmacm itself,
/// so librdmacm is there before the plugin.)
fn check_late_librdmacm(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    for how in ["local", "local_verbs", "global_verbs", "check_verbs"] {
        let label = format!("late_cm.{how}.run");
        let out = runs.get(&label).unwrap_or(&empty);
        let err = runs.get(&format!("{label}.err")).unwrap_or(&empty);
        let last = out.last_line();
        let oks = out.lines().filter(|l| l.starts_with("ok   ")).count();
        c.that(
            out.exit == Some(0) && out.fails().is_empty() && last == format!("late_cm: {oks} passed, 0 failed"),
            format!("{label}: exit {:?}, failures {:?}, last {last:?}", out.exit, out.fails()),
        );
        c.that(
            out.has("ok   the plugin gets and acks ADDR_RESOLVED"),
            format!("{label}: the plugin's CM calls were not checked"),
        );
        let l = exit_lines(err);
        if how.starts_with("check") {
            c.that(
                l.len() == 1
                    && l[0].contains("mode=check")
                    && field(l[0], "cm_events") == Some(1)
                    && field(l[0], "cm_acked") == Some(1),
                format!("{label}: exit line {l:?} (want check mode, cm_events=1 cm_acked=1)"),
            );
        } else {
            c.that(
                l.len() == 1
                    && l[0].contains("mode=copy")
                    && field(l[0], "copied") == Some(1)
                    && field(l[0], "freed") == Some(1)
                    && field(l[0], "outstanding") == Some(0),
                format!("{label}: exit line {l:?} (want copy mode, copied=1 freed=1 outstanding=0)"),
            );
        }
    }
}

/// An rsockets server whose accept outlasts a 1 ms ack deadline (the
/// script's rstream.slowaccept): the connect request `rdma_get_request`
/// keeps is acked at the deadline as librdmacm's own hold (an info line),
/// never with the warning of a program's late free, which it got before
/// the preload marked the gets inside `rdma_get_request`.
fn check_slow_accept(c: &mut Checks, runs: &BTreeMap<String, Block>) {
    let empty = Block::default();
    let client = runs.get("rstream.slowaccept.client").unwrap_or(&empty);
    let server = runs.get("rstream.slowaccept.server").unwrap_or(&empty);
    let err = runs.get("rstream.slowaccept.server.err").unwrap_or(&empty);
    c.that(
        client.exit == Some(0) && server.exit == Some(0),
        format!("rstream.slowaccept: exits {:?} / {:?}", client.exit, server.exit),
    );
    let kept = err.lines().any(|l| l.contains("CONNECT_REQUEST that librdmacm's rdma_get_request keeps"));
    c.that(kept, "rstream.slowaccept: the request was acked at the deadline as librdmacm's (the premise)");
    let warned: Vec<&str> = err.lines_with("held past its ack deadline");
    c.that(warned.is_empty(), format!("rstream.slowaccept: librdmacm's hold warned of as a program's: {warned:?}"));
    let l = exit_lines(err);
    c.that(
        l.len() == 1
            && field(l[0], "outstanding") == Some(0)
            && field(l[0], "acked_at_deadline").is_some_and(|n| n >= 1),
        format!("rstream.slowaccept: exit line {l:?} (want outstanding=0, acked_at_deadline >= 1)"),
    );
}

/// Check mode's report lines of a run: (kind, text).
fn reports(b: Option<&Block>) -> Vec<(String, String)> {
    b.map(|b| {
        b.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("rdmasafe-check[")?;
                let (_, rest) = rest.split_once("]: ")?;
                let (kind, text) = rest.split_once(": ")?;
                Some((kind.to_string(), text.to_string()))
            })
            .collect()
    })
    .unwrap_or_default()
}

/// The word after `key` in the first line that has it.
fn word_after<'a>(b: &'a Block, key: &str) -> Option<&'a str> {
    b.lines().find_map(|l| {
        let at = l.find(key)? + key.len();
        l[at..].split_whitespace().next()
    })
}

fn check_cm_bugs(c: &mut Checks, runs: &BTreeMap<String, Block>, out: &str) -> usize {
    let empty = Block::default();
    let mut n = 0;
    for mode in ["ok", "held", "leak", "double", "destroy", "forkheld"] {
        let label = format!("check_cm_bugs.{mode}.run");
        let b = runs.get(&label).unwrap_or(&empty);
        let rep = reports(runs.get(&format!("{label}.report")));
        n += rep.len();
        // forkheld: the event held is the forked child's
        let got = if mode == "forkheld" { "child got" } else { "got" };
        let ev = word_after(b, &format!("{got} RDMA_CM_EVENT_ADDR_RESOLVED event ")).unwrap_or("?");
        let id = word_after(b, &format!("{got} RDMA_CM_EVENT_ADDR_RESOLVED event {ev} of id ")).unwrap_or("?");
        let what = format!("RDMA_CM_EVENT_ADDR_RESOLVED event {ev} of id {id} (status 0)");
        let kinds: BTreeSet<&str> = rep.iter().map(|(k, _)| k.as_str()).collect();
        let has = |kind: &str, prefix: &str| rep.iter().any(|(k, t)| k == kind && t.starts_with(prefix));
        if mode == "destroy" {
            // rdma_destroy_id waits forever: the harness kills it
            c.that(b.exit == Some(137), format!("{label}: exit {:?} (want 137: killed while waiting)", b.exit));
            c.that(
                out.contains(&format!("# {label}: reported destroy-id-waiting and still running: killing it")),
                format!("{label}: was not still waiting in rdma_destroy_id after the report"),
            );
            c.that(
                has("destroy-id-waiting", &format!("rdma_destroy_id({id}) has waited ")) && has("held", &what),
                format!("{label}: reports {rep:?} (want destroy-id-waiting for {what}, and held)"),
            );
            continue;
        }
        c.that(
            b.exit == Some(0) && b.last_line() == "check_cm_bugs: done",
            format!("{label}: exit {:?}, last line {:?}", b.exit, b.last_line()),
        );
        c.that(ev.starts_with("0x") && id.starts_with("0x"), format!("{label}: no event / id printed"));
        let ok = match mode {
            "ok" => rep.is_empty(),
            // a child forked after its parent's watcher started has one
            // of its own (it used to report nothing: the child waited for
            // its report until its watchdog)
            "held" | "forkheld" => {
                kinds == BTreeSet::from(["held", "late-ack"])
                    && has("held", &format!("{what} not acked for "))
                    && has("late-ack", &format!("{what} acked after "))
                    && rep.len() == 2
            }
            // a slow machine may also pass the hold threshold first
            "leak" => {
                has("unacked-at-exit", &format!("{what} never acked: got "))
                    && kinds.iter().all(|k| ["unacked-at-exit", "held"].contains(k))
            }
            "double" => {
                has("bad-ack", &format!("rdma_ack_cm_event({ev}): not an event rdma_get_cm_event handed out"))
                    && b.has("second rdma_ack_cm_event of the same event: -1 (Invalid argument)")
                    && kinds.iter().all(|k| ["bad-ack", "held", "late-ack"].contains(k))
            }
            _ => false,
        };
        c.that(ok, format!("{label}: reports {rep:?}"));
        let err = runs.get(&format!("{label}.err")).unwrap_or(&empty);
        let l = exit_lines(err);
        // one exit line per process: forkheld's parent and child
        let processes = if mode == "forkheld" { 2 } else { 1 };
        let counted: Option<u64> = l.iter().map(|line| field(line, "reports")).sum();
        c.that(
            l.len() == processes && counted == Some(rep.len() as u64),
            format!("{label}: exit lines {l:?} (want {processes}, reports={} in all)", rep.len()),
        );
    }
    n
}

fn check_cq_bugs(c: &mut Checks, runs: &BTreeMap<String, Block>, out: &str) -> usize {
    let empty = Block::default();
    let mut n = 0;
    for mode in ["ok", "unacked", "wrongcq", "overack"] {
        for how in ["check", "fix"] {
            let label = format!("check_cq_bugs.{mode}.{how}");
            let b = runs.get(&label).unwrap_or(&empty);
            let rep = reports(runs.get(&format!("{label}.report")));
            n += rep.len();
            let a = word_after(b, "CQ A ").unwrap_or("?");
            let bq = word_after(b, " and CQ B ").unwrap_or("?");
            c.that(
                a.starts_with("0x") && bq.starts_with("0x") && b.has("CQ event for A"),
                format!("{label}: setup: {:?}", b.out),
            );
            let fix = how == "fix";
            let fixed = |s: String, tail: &str| if fix { format!("{s}; RDMASAFE_CHECK=fix: {tail}") } else { s };
            let unacked_a = fixed(
                format!(
                    "ibv_destroy_cq({a}) with 1 unacked CQ event(s) (got 1, acked 0): it waits until they are acked, \
                     forever if nobody does"
                ),
                "acked 1 now, so it returns",
            );
            let want: Vec<(&str, String)> = match mode {
                "ok" => vec![],
                "unacked" => vec![("cq-destroy-unacked", unacked_a)],
                "wrongcq" => vec![
                    (
                        "cq-wrong-cq",
                        fixed(
                            format!(
                                "ibv_ack_cq_events({bq}, 1): this CQ has only 0 unacked event(s) (got 0, acked 0) \
                                 while on the same completion channel CQ {a} has 1 unacked: acked on the wrong CQ? \
                                 ibv_destroy_cq waits forever on both"
                            ),
                            "passed on 0, dropped the 1 excess",
                        ),
                    ),
                    ("cq-destroy-unacked", unacked_a),
                ],
                _ => {
                    let mut v = vec![(
                        "cq-overack",
                        fixed(
                            format!(
                                "ibv_ack_cq_events({a}, 2): more acks than events on this CQ (got 1, acked 0 before): \
                                 ibv_destroy_cq({a}) will wait forever"
                            ),
                            "passed on 1, dropped the 1 excess",
                        ),
                    )];
                    if !fix {
                        v.push((
                            "cq-destroy-overacked",
                            format!(
                                "ibv_destroy_cq({a}) after more acks than events (got 1, acked 2): it waits forever"
                            ),
                        ));
                    }
                    v
                }
            };
            let want: Vec<(String, String)> = want.into_iter().map(|(k, t)| (k.to_string(), t)).collect();
            c.that(rep == want, format!("{label}: reports\n      {rep:?}\n    want\n      {want:?}"));
            if mode == "ok" || fix {
                c.that(
                    b.exit == Some(0)
                        && b.has("ibv_destroy_cq(A) returned 0")
                        && b.has("ibv_destroy_cq(B) returned 0")
                        && b.last_line() == "check_cq_bugs: done",
                    format!("{label}: exit {:?}, last line {:?}", b.exit, b.last_line()),
                );
            } else {
                // ibv_destroy_cq(A) waits forever: killed after the report
                c.that(
                    b.exit == Some(137)
                        && b.last_line() == format!("ibv_destroy_cq(A {a})")
                        && out.contains(&format!("# {label}: reported cq-destroy-(un|over)acked and still running")),
                    format!(
                        "{label}: exit {:?} (want 137, killed in ibv_destroy_cq(A)), last {:?}",
                        b.exit,
                        b.last_line()
                    ),
                );
            }
        }
    }
    n
}

fn run_script(lib: &Path, bin: &Path) -> (bool, String) {
    if let Ok(file) = std::env::var("RDMASAFE_PRELOAD_REPLAY") {
        println!("[preload] replaying {file} (no guest run)");
        return (true, std::fs::read_to_string(&file).expect("read RDMASAFE_PRELOAD_REPLAY"));
    }
    let root = root();
    let script = root.join("tests/preload/run-in-guest.sh");
    let hw = match (std::env::var("RDMASAFE_DEVICE"), std::env::var("RDMASAFE_ADDR")) {
        (Ok(d), Ok(a)) if !d.is_empty() && !a.is_empty() => Some((d, a)),
        _ => None,
    };
    let mut cmd;
    if let Some((device, addr)) = &hw {
        println!("[preload] real hardware: {device} ({addr}), on the host");
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
    cmd.current_dir(&root)
        .env("RDMASAFE_PRELOAD_LIB", lib)
        .env("RDMASAFE_PRELOAD_BIN", bin)
        .env("RDMASAFE_PRELOAD_RPING_RUNS", RPING_RUNS.to_string())
        .env("RDMASAFE_PRELOAD_BARRIER_RUNS", BARRIER_RUNS.to_string());
    let t = Instant::now();
    let out = cmd.output().expect("run tests/preload/run-in-guest.sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    println!("[preload] guest run {:.1} s, {}", t.elapsed().as_secs_f64(), out.status);
    (out.status.success(), stdout)
}

#[test]
fn preload_on_rdma() {
    let profile = profile_dir();
    let (lib, bin) = build(&profile);
    let (ok, stdout) = run_script(&lib, &bin);
    let runs = blocks(&stdout);
    let mut c = Checks::default();
    c.that(ok, "run-in-guest.sh failed");
    c.that(stdout.contains("==== SUMMARY done"), "the script did not reach its end");

    let t = check_copy_mode(&mut c, &runs);
    check_barrier(&mut c, &runs);
    check_cancel(&mut c, &runs);
    check_copy_books(&mut c, &runs);
    check_slow_accept(&mut c, &runs);
    check_late_librdmacm(&mut c, &runs);
    let cm_reports = check_cm_bugs(&mut c, &runs, &stdout);
    let cq_reports = check_cq_bugs(&mut c, &runs, &stdout);
    // perftest's own connect race, run once more by the script (see
    // perftest_pair there): shown, never silent
    for line in stdout.lines().filter(|l| l.starts_with("# ib_send_lat.") && l.ends_with("once more")) {
        println!("[preload] {}", &line[2..]);
    }
    println!(
        "[preload] copy mode: {} preloaded sides of stock tools ({} of them the extra rping runs), {} events \
         copied; check mode: {cm_reports} CM and {cq_reports} CQ reports from the bug programs",
        t.preloaded_runs, t.rping_runs, t.copied
    );
    if t.unwritten > 0 {
        println!("[preload] {} sides under the preload wrote no exit line after a lost teardown race", t.unwritten);
    }
    println!("[preload] {} expectations met, {} failed", c.passed, c.failures.len());
    assert!(
        c.failures.is_empty(),
        "librdmasafe-preload.so on RDMA: {} failed expectations:\n  {}",
        c.failures.len(),
        c.failures.join("\n  ")
    );
}

#[test]
fn normalize_hides_numbers_and_keeps_words() {
    assert_eq!(normalize("RDMA addr 5651a9e47600 rkey 1a60 len 64"), "RDMA addr # rkey # len #");
    assert_eq!(
        normalize("cma_event type RDMA_CM_EVENT_ESTABLISHED cma_id 0x7fab44040cf0 (child)"),
        "cma_event type RDMA_CM_EVENT_ESTABLISHED cma_id # (child)"
    );
    assert_eq!(normalize(" 2       100          19.33\t  11758.00 "), "# # # #");
    assert_eq!(normalize("ping data: rdma-ping-0: ABCDEF"), "ping data: rdma-ping-#: ABCDEF");
    assert_eq!(normalize("a bad face added"), "a bad face added", "hex letters without a digit are words");
    assert_eq!(
        normalize("rdma write from lkey bedf laddr 563c152fa170 len 64"),
        "rdma write from lkey # laddr # len #"
    );
    assert_eq!(normalize("Received rkey cafe addr 55 len 64 from peer"), "Received rkey # addr # len # from peer");
    assert_eq!(
        normalize(" 2  100  inf inf -nan -3.5 "),
        "# # # # # #",
        "perftest's degenerate timings are figures too"
    );
    assert!(racy("rping", "client", "client DISCONNECT EVENT..."));
    assert!(!racy("rping", "server", "server DISCONNECT EVENT..."));
    assert!(!racy("ucmatose", "client", "client DISCONNECT EVENT..."));
}

/// The blocks of rping's stock pair and of run 6 with `preloaded` (server
/// or client) under the preload, as run-in-guest.sh labels them (pserver in
/// even runs, pclient in odd ones; 6 and 7 here). The preloaded side's
/// stdout (stock's if empty), its stderr after stock's and its exit status
/// are given. CI (2026-12-01) had the server lose rping's teardown race
/// with exit 0.
fn rping_pair(preloaded: &str, out: &str, err: &str, exit: i32) -> BTreeMap<String, Block> {
    let block = |out: &str, exit: i32| Block { out: out.to_string(), exit: Some(exit) };
    let server = "cma_event type RDMA_CM_EVENT_CONNECT_REQUEST cma_id 0x55c58b41fe60 (parent)\n\
                  cma_event type RDMA_CM_EVENT_ESTABLISHED cma_id 0x7fa018000ce0 (child)\n\
                  server ping data: rdma-ping-0: ABCDEF\n\
                  cma_event type RDMA_CM_EVENT_DISCONNECTED cma_id 0x7fa018000ce0 (child)\n\
                  destroy cm_id 0x55c58b41fe60\n";
    let client = "cma_event type RDMA_CM_EVENT_ADDR_RESOLVED cma_id 0x5600 (parent)\n\
                  cma_event type RDMA_CM_EVENT_ROUTE_RESOLVED cma_id 0x5600 (parent)\n\
                  cma_event type RDMA_CM_EVENT_ESTABLISHED cma_id 0x5600 (parent)\n\
                  ping data: rdma-ping-0: ABCDEF\n";
    let errs = [("server", "server DISCONNECT EVENT...\nwait for RDMA_READ_ADV state 10\n"), ("client", "")];
    let (cfg, run) = rping_run(preloaded);
    let mut runs = BTreeMap::new();
    for (side, stock_out) in [("server", server), ("client", client)] {
        let stock_err = errs.iter().find(|e| e.0 == side).map_or("", |e| e.1);
        runs.insert(format!("rping.stock.{side}"), block(stock_out, 0));
        runs.insert(format!("rping.stock.{side}.err"), block(stock_err, 0));
        let this = format!("rping.{cfg}.{run}.{side}");
        if side == preloaded {
            runs.insert(this.clone(), block(if out.is_empty() { stock_out } else { out }, exit));
            runs.insert(format!("{this}.err"), block(&format!("{stock_err}{err}"), exit));
        } else {
            runs.insert(this.clone(), block(stock_out, 0));
            runs.insert(format!("{this}.err"), block(stock_err, 0));
        }
    }
    runs
}

/// The run of rping_pair with `preloaded` under the preload: its config
/// and number.
fn rping_run(preloaded: &str) -> (&'static str, usize) {
    if preloaded == "server" {
        ("pserver", 6)
    } else {
        ("pclient", 7)
    }
}

/// The preloaded side's exit line: `events` copied, `get_errors` failed gets.
fn rping_exit_line(events: u64, get_errors: u64) -> String {
    format!(
        "rdmasafe[INFO]: preload exit [552 rping]: mode=copy gets={events} copied={events} freed={events} \
         outstanding=0 originals_acked={events} acked_at_free={events} acked_at_deadline=0 acks={events} \
         not_copies=0 get_errors={get_errors} ack_deadline_ms=1000\n"
    )
}

/// check_pair on rping_pair's blocks: the failures and the totals.
fn check_rping(runs: &BTreeMap<String, Block>, preloaded: &str) -> (Vec<String>, Totals) {
    let mut c = Checks::default();
    let mut t = Totals::default();
    let (cfg, run) = rping_run(preloaded);
    check_pair(&mut c, runs, "rping", cfg, Some(run), &mut t);
    (c.failures, t)
}

#[test]
fn a_lost_rping_teardown_race_is_compared_as_the_run_rping_meant_on_either_side() {
    for side in ["server", "client"] {
        let n = 3; // rping_pair's sides print 3 events each
        let race = format!("{RPING_RACE_LINE}\n{}", rping_exit_line(n, 1));
        // The thread printed the line (CI: the server, exit 0; main's exit won).
        for exit in [0, 255] {
            let (failures, t) = check_rping(&rping_pair(side, "", &race, exit), side);
            assert!(failures.is_empty(), "{side}, exit {exit}: {failures:?}");
            let want = if side == "server" { "rping.pserver.6.server" } else { "rping.pclient.7.client" };
            assert_eq!(t.races.into_iter().collect::<Vec<_>>(), [(want.to_string(), true)]);
            assert_eq!((t.preloaded_runs, t.copied), (1, n), "the raced side is still checked and counted");
        }
        // The two exits ended the process before the preload's destructor
        // ran (2026-12-05, exit 255): the race line and no exit line. The run
        // is compared and listed; it has nothing to count.
        for exit in [0, 255] {
            let (failures, t) = check_rping(&rping_pair(side, "", &format!("{RPING_RACE_LINE}\n"), exit), side);
            assert!(failures.is_empty(), "{side}, exit {exit}, no exit line: {failures:?}");
            assert_eq!(t.races.len(), 1, "{side}, exit {exit}: listed as a race");
            assert_eq!((t.preloaded_runs, t.copied, t.unwritten), (1, 0, 1), "{side}, exit {exit}");
        }
        // main's exit ended the process before the print: the exit line shows it.
        let (failures, t) = check_rping(&rping_pair(side, "", &rping_exit_line(n, 1), 0), side);
        assert!(failures.is_empty() && t.races.len() == 1, "{side}: {failures:?}");
        // No race: nothing to forgive.
        let (failures, t) = check_rping(&rping_pair(side, "", &rping_exit_line(n, 0), 0), side);
        assert!(failures.is_empty() && t.races.is_empty(), "{side}: {failures:?}");
    }
}

/// rping in check mode, the server's race line and no exit line at all
/// (its two exits raced): compared as meant, listed, nothing counted; the
/// client's check-mode exit line is still checked.
#[test]
fn a_check_mode_rping_side_that_lost_the_race_may_write_no_exit_line() {
    let check_line = "rdmasafe[INFO]: preload exit [9 rping]: mode=check cm_events=3 cm_acked=3 cm_unacked=0 \
                      held_by_librdmacm=0 bad_acks=0 cq_events=0 cq_acks=0 cq_problems=0 reports=0\n";
    let runs = |client_err: &str| {
        let mut runs: BTreeMap<String, Block> = rping_pair("server", "", &format!("{RPING_RACE_LINE}\n"), 255)
            .into_iter()
            .map(|(k, v)| (k.replace("rping.pserver.6.", "rping.check."), v))
            .collect();
        runs.get_mut("rping.check.client.err").unwrap().out.push_str(client_err);
        for side in SIDES {
            runs.insert(format!("rping.check.{side}.report"), Block { out: String::new(), exit: Some(0) });
        }
        runs
    };
    let mut c = Checks::default();
    let mut t = Totals::default();
    check_pair(&mut c, &runs(check_line), "rping", "check", None, &mut t);
    assert!(c.failures.is_empty(), "{:?}", c.failures);
    assert_eq!(t.races.into_iter().collect::<Vec<_>>(), [("rping.check.server".to_string(), false)]);
    assert_eq!((t.unwritten, t.preloaded_runs), (1, 0));
    // The side that did not race still needs its line.
    let mut c = Checks::default();
    check_pair(&mut c, &runs(""), "rping", "check", None, &mut Totals::default());
    assert!(c.failures.iter().any(|f| f.contains("rping.check.client: check mode's exit line []")), "{:?}", c.failures);
}

#[test]
fn a_stock_rping_that_lost_the_race_is_compared_as_meant_and_counted_once() {
    let mut runs = rping_pair("server", "", &rping_exit_line(3, 0), 0);
    for label in ["rping.stock.client", "rping.pserver.6.client"] {
        runs.get_mut(label).unwrap().exit = Some(255);
        runs.get_mut(&format!("{label}.err")).unwrap().out = format!("{RPING_RACE_LINE}\n");
    }
    let mut c = Checks::default();
    let mut t = Totals::default();
    for _ in 0..3 {
        check_pair(&mut c, &runs, "rping", "pserver", Some(6), &mut t);
    }
    assert!(c.failures.is_empty(), "{:?}", c.failures);
    let want = [("rping.pserver.6.client".to_string(), false), ("rping.stock.client".to_string(), false)];
    assert_eq!(t.races.into_iter().collect::<Vec<_>>(), want);
}

#[test]
fn a_lost_rping_race_forgives_that_line_and_nothing_else() {
    let race = format!("{RPING_RACE_LINE}\n{}", rping_exit_line(3, 1));
    let failed = |runs: BTreeMap<String, Block>| check_rping(&runs, "server").0;
    let has = |f: &[String], what: &str| f.iter().any(|f| f.contains(what));
    // The line with the failed get not counted yet when main's exit wrote
    // the exit line (CI 2026-12-03) is the race.
    let f = failed(rping_pair("server", "", &format!("{RPING_RACE_LINE}\n{}", rping_exit_line(3, 0)), 0));
    assert!(f.is_empty(), "{f:?}");
    // A second failed get is not the race.
    let f = failed(rping_pair("server", "", &format!("{RPING_RACE_LINE}\n{}", rping_exit_line(3, 2)), 0));
    assert!(has(&f, "failed gets (want 0..=1)"), "{f:?}");
    // Without the line, a failed get with exit 255 is no race either.
    let f = failed(rping_pair("server", "", &rping_exit_line(3, 1), 255));
    assert!(has(&f, "failed gets (want 0..=0)") && has(&f, "exit Some(255)"), "{f:?}");
    // No exit line without the race line is a failure, whatever the exit.
    for exit in [0, 255] {
        let f = failed(rping_pair("server", "", "", exit));
        assert!(has(&f, "0 preload exit lines (want 1)"), "exit {exit}: {f:?}");
    }
    // A run cut short: stdout is still compared, and the events counted.
    let short = "cma_event type RDMA_CM_EVENT_CONNECT_REQUEST cma_id 0x1 (parent)\n";
    let f = failed(rping_pair("server", short, &race, 255));
    assert!(has(&f, "stdout differs") && has(&f, "events copied"), "{f:?}");
    // Any other exit status is a failure.
    let f = failed(rping_pair("server", "", &race, 1));
    assert!(has(&f, "exit Some(1)"), "{f:?}");
    // The line twice is no single lost race.
    let f = failed(rping_pair("server", "", &format!("{RPING_RACE_LINE}\n{race}"), 0));
    assert!(has(&f, "stderr differs"), "{f:?}");
    // Another stderr line still differs.
    let f = failed(rping_pair("server", "", &format!("rdma_connect: Invalid argument\n{race}"), 0));
    assert!(has(&f, "stderr differs"), "{f:?}");
    // Only rping has this race.
    let err = Block { out: format!("{RPING_RACE_LINE}\n"), exit: Some(0) };
    assert!(!lost_teardown_race("ucmatose", &Block { out: String::new(), exit: Some(255) }, &err));
}

#[test]
fn more_than_a_few_lost_races_fail() {
    let races = |preloaded: usize, stock: usize| {
        let mut t = Totals::default();
        for i in 0..preloaded {
            t.races.insert(format!("rping.pclient.{i}.client"), true);
        }
        for i in 0..stock {
            t.races.insert(format!("rping.pclient.{i}.server"), false);
        }
        let mut c = Checks::default();
        check_race_counts(&mut c, &t);
        c.failures
    };
    assert!(races(4, 8).is_empty());
    assert_eq!(races(5, 0).len(), 1, "5 preloaded sides");
    assert_eq!(races(4, 9).len(), 1, "13 of 48 processes");
}

/// The blocks of cmtime's stock pair and of `cfg` (pclient, or check with
/// both sides in check mode), as run-in-guest.sh labels them: the server
/// stopped by SIGINT (exit 130), the client's stderr after stock's (empty)
/// and its exit status given. CI-shaped: a full run on 2 busy cores
/// (2026-12-03) had the client lose cmtime's teardown race in pclient and
/// in check.
fn cmtime_pair(cfg: &str, err: &str, exit: i32) -> BTreeMap<String, Block> {
    let block = |out: &str, exit: i32| Block { out: out.to_string(), exit: Some(exit) };
    let client = "creating id\nresolving address\nresolving route\ncreating qp\nconnecting\ndisconnecting\n\
                  destroying id\nstep              total ms     max ms     min us  us / conn\n\
                  create id    :        0.24       0.11       7.00      23.60\n";
    let mut runs = BTreeMap::new();
    for c in ["stock", cfg] {
        runs.insert(format!("cmtime.{c}.server"), block("", 130));
        runs.insert(format!("cmtime.{c}.server.err"), block("", 130));
        runs.insert(format!("cmtime.{c}.client"), block(client, if c == "stock" { 0 } else { exit }));
    }
    runs.insert("cmtime.stock.client.err".into(), block("", 0));
    runs.insert(format!("cmtime.{cfg}.client.err"), block(err, exit));
    if cfg == "check" {
        for side in SIDES {
            runs.insert(format!("cmtime.check.{side}.report"), block("", 0));
        }
    }
    runs
}

/// The client's exit line: copy mode's with `get_errors` failed gets, or
/// check mode's.
fn cmtime_exit_line(cfg: &str, get_errors: u64) -> String {
    match cfg {
        "check" => "rdmasafe[INFO]: preload exit [1041 cmtime]: mode=check cm_events=40 cm_acked=40 cm_unacked=0 \
                    held_by_librdmacm=0 bad_acks=0 cq_events=0 cq_acks=0 cq_problems=0 reports=0\n"
            .to_string(),
        _ => format!(
            "rdmasafe[INFO]: preload exit [393 cmtime]: mode=copy gets=40 copied=40 freed=40 outstanding=0 \
             originals_acked=40 acked_at_free=40 acked_at_deadline=0 acks=40 not_copies=0 \
             get_errors={get_errors} ack_deadline_ms=1000\n"
        ),
    }
}

fn check_cmtime(runs: &BTreeMap<String, Block>, cfg: &str) -> (Vec<String>, Totals) {
    let mut c = Checks::default();
    let mut t = Totals::default();
    check_pair(&mut c, runs, "cmtime", cfg, None, &mut t);
    (c.failures, t)
}

#[test]
fn a_lost_cmtime_teardown_race_is_compared_as_the_run_cmtime_meant() {
    for (cfg, preloaded) in [("pclient", true), ("check", false)] {
        let race = format!("{CMTIME_RACE_LINE}\n{}", cmtime_exit_line(cfg, 1));
        let (failures, t) = check_cmtime(&cmtime_pair(cfg, &race, 0), cfg);
        assert!(failures.is_empty(), "{cfg}: {failures:?}");
        assert_eq!(t.races.into_iter().collect::<Vec<_>>(), [(format!("cmtime.{cfg}.client"), preloaded)]);
        // No race: nothing to forgive, nothing listed.
        let (failures, t) = check_cmtime(&cmtime_pair(cfg, &cmtime_exit_line(cfg, 0), 0), cfg);
        assert!(failures.is_empty() && t.races.is_empty(), "{cfg}: {failures:?}");
    }
    // The preloaded client is still counted: its 40 events copied.
    let race = format!("{CMTIME_RACE_LINE}\n{}", cmtime_exit_line("pclient", 1));
    let (_, t) = check_cmtime(&cmtime_pair("pclient", &race, 0), "pclient");
    assert_eq!((t.preloaded_runs, t.copied), (1, 40));
}

#[test]
fn a_lost_cmtime_race_forgives_that_line_and_nothing_else() {
    let has = |f: &[String], what: &str| f.iter().any(|f| f.contains(what));
    let failed = |err: String, exit: i32| check_cmtime(&cmtime_pair("pclient", &err, exit), "pclient").0;
    // The line with the failed get counted or not yet (main's exit wrote
    // the exit line first) is the race; with two failed gets it is not.
    for n in [0, 1] {
        let f = failed(format!("{CMTIME_RACE_LINE}\n{}", cmtime_exit_line("pclient", n)), 0);
        assert!(f.is_empty(), "{n}: {f:?}");
    }
    let f = failed(format!("{CMTIME_RACE_LINE}\n{}", cmtime_exit_line("pclient", 2)), 0);
    assert!(has(&f, "failed gets (want 0..=1)"), "{f:?}");
    // cmtime's thread returns after the print: main exits 0, nothing else.
    let f = failed(format!("{CMTIME_RACE_LINE}\n{}", cmtime_exit_line("pclient", 1)), 255);
    assert!(has(&f, "exit Some(255)"), "{f:?}");
    // cmtime's thread does not exit: main's exit always writes the line,
    // in copy mode and in check mode.
    let f = failed(format!("{CMTIME_RACE_LINE}\n"), 0);
    assert!(has(&f, "0 preload exit lines (want 1)"), "{f:?}");
    let (f, t) = check_cmtime(&cmtime_pair("check", &format!("{CMTIME_RACE_LINE}\n"), 0), "check");
    assert!(has(&f, "check mode's exit line []") && t.unwritten == 0, "{f:?}");
    // rping's line is not cmtime's: it still differs.
    let f = failed(format!("{RPING_RACE_LINE}\n{}", cmtime_exit_line("pclient", 1)), 0);
    assert!(has(&f, "stderr differs"), "{f:?}");
    // Nor is cmtime's line another tool's.
    let err = Block { out: format!("{CMTIME_RACE_LINE}\n"), exit: Some(0) };
    assert!(!lost_teardown_race("ucmatose", &Block { out: String::new(), exit: Some(0) }, &err));
    assert!(!lost_teardown_race("rping", &Block { out: String::new(), exit: Some(0) }, &err));
}

#[test]
fn cmtime_races_do_not_count_against_rpings_caps() {
    let mut t = Totals::default();
    for cfg in ["stock", "pserver", "pclient", "check"] {
        t.races.insert(format!("cmtime.{cfg}.client"), cfg == "pclient");
    }
    for i in 0..4 {
        t.races.insert(format!("rping.pclient.{i}.client"), true);
    }
    let mut c = Checks::default();
    check_race_counts(&mut c, &t);
    assert!(c.failures.is_empty(), "{:?}", c.failures);
    t.races.insert("rping.pserver.9.server".into(), true);
    let mut c = Checks::default();
    check_race_counts(&mut c, &t);
    assert_eq!(c.failures.len(), 1, "5 preloaded rping sides: {:?}", c.failures);
}

/// A setting the preload cannot honour (an unknown RDMASAFE_CHECK or
/// RDMASAFE_LOG value, a RDMASAFE_CHECK_HOLD_MS or RDMASAFE_ACK_DEADLINE_MS
/// that is no number; the latter was taken silently as 1000) is said
/// on stderr even with logging off: it
/// changes what the preload does. On the host: the preload reads its
/// settings at a program's first CM call, before librdmacm is asked (which
/// fails here without an RDMA device; the call's result is not the point).
#[test]
fn an_unknown_rdmasafe_check_value_is_said_with_logging_off() {
    let (lib, _) = build(&profile_dir());
    let dir = std::env::temp_dir().join(format!("rdmasafe-preload-setting.{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // LD_PRELOAD splits at blanks and colons: a link in a folder without them.
    let link = dir.join("librdmasafe-preload.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).unwrap();
    let src = dir.join("first_get.c");
    std::fs::write(
        &src,
        "#include <rdma/rdma_cma.h>\n#include <stdio.h>\n#include <unistd.h>\n\
         int main(void) { int p[2]; struct rdma_cm_event *ev; if (pipe(p)) return 2;\n\
         struct rdma_event_channel ch = { .fd = p[0] };\n\
         printf(\"get: %d\\n\", rdma_get_cm_event(&ch, &ev)); return 0; }\n",
    )
    .unwrap();
    let exe = dir.join("first_get");
    run_logged("cc first_get.c", Command::new("cc").arg("-o").arg(&exe).arg(&src).args(["-lrdmacm", "-libverbs"]));
    let run = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(&exe);
        cmd.env("LD_PRELOAD", &link).env_remove("RDMASAFE_LOG").env_remove("RDMASAFE_CHECK");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{env:?}: {out:?}");
        // The preload's lines only (libibverbs may warn about the host).
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        err.lines().filter(|l| l.starts_with("rdmasafe")).collect::<Vec<_>>().join("\n")
    };
    let err = run(&[("RDMASAFE_CHECK", "chek")]);
    assert!(err.contains("RDMASAFE_CHECK=\"chek\"") && err.contains("copy mode"), "stderr: {err:?}");
    assert_eq!(run(&[("RDMASAFE_CHECK", "0")]), "", "a known value, logging off: nothing said");
    let err = run(&[("RDMASAFE_CHECK", "1"), ("RDMASAFE_CHECK_HOLD_MS", "10s")]);
    assert!(err.contains("RDMASAFE_CHECK_HOLD_MS=\"10s\""), "stderr: {err:?}");
    for bad in ["5s", "-5", "99999999999999999999"] {
        let err = run(&[("RDMASAFE_ACK_DEADLINE_MS", bad)]);
        assert!(err.contains(&format!("RDMASAFE_ACK_DEADLINE_MS={bad:?}")) && err.contains("1000"), "stderr: {err:?}");
    }
    assert_eq!(run(&[("RDMASAFE_ACK_DEADLINE_MS", " 250 ")]), "", "a number (blanks around it are fine): nothing said");
    // Said once, with the library's warnings on as well.
    let err = run(&[("RDMASAFE_ACK_DEADLINE_MS", "5s"), ("RDMASAFE_LOG", "warn")]);
    assert_eq!(err.matches("RDMASAFE_ACK_DEADLINE_MS").count(), 1, "stderr: {err:?}");
    let err = run(&[("RDMASAFE_LOG", "verbose")]);
    assert!(err.contains("RDMASAFE_LOG=\"verbose\""), "stderr: {err:?}");
    assert_eq!(run(&[("RDMASAFE_LOG", "off")]), "", "off is a level: nothing said");
    let _ = std::fs::remove_dir_all(&dir);
}
