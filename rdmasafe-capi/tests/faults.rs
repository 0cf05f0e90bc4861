//! Fault and leak suite of the C API, end to end on Soft-RoCE: builds the
//! programs of tests/faults/ with plain make against librdmasafe, then runs
//! them in throw-away guests through tests/faults/guest.sh (one guest:
//! tests/bed/vm-run; two guests on one virtual link: tests/bed/vm-run2):
//!
//! 0. (host only) the rules of tests/faults/rdma-core.supp: rdma-core's
//!    globals only, possible leaks only, no frame of rdmasafe's;
//! 1. `storm`: a connection storm past the listen backlog while the server
//!    holds back its getter; the dropped requests end UNREACHABLE after
//!    ~100 s, the queued ones REJECTED (run once: it is the slow one);
//! 2. `leaks`: valgrind memcheck over 100 connect/disconnect cycles and
//!    10k completions: 0 bytes definitely or indirectly lost, 0 errors;
//!    rdma-core's globals suppressed (tests/faults/rdma-core.supp; every
//!    suppression used is one of its entries, told by name, or one of
//!    valgrind's defaults), the only possibly-lost blocks left are
//!    rdmasafe's process-wide registries; then a CONNECT_REQUEST copy held
//!    past the ack deadline after its new id was rejected and destroyed
//!    (the ack thread must not read the destroyed id);
//! 3. `hostkill` (two guests): the peer's host is killed mid-traffic:
//!    RETRY_EXC_ERR then flushes on the traffic connection; on an idle
//!    connection with retry_count 7 the keepalive declares the peer dead;
//! 4. `linkflap` (two guests): link down (until the error reached the
//!    program) and up: PORT_ERR, the send error (or, when rxe leaves the
//!    QP silent, the keepalive's flushes), then PORT_ACTIVE;
//! 5. one guest: `prockill` (peer process SIGKILLed mid-traffic),
//!    `overrun` (CQ overrun: CQ_ERR names the CQ), then `devremove`
//!    (`rdma link delete` under live connections: DEVICE_REMOVAL on every
//!    id; last, as it removes the device).
//!
//! Every program checks itself (every work request completed exactly
//! once, object teardown under a watchdog, loop unacked_now 0, cm counters
//! outstanding 0, no cm_id left) and prints "measure NAME=VALUE" lines;
//! this test asserts on exit statuses and on those figures, and prints
//! them. It asserts what holds whatever the timing (counts, order, which
//! status, causality): the machine running it is often busy, which
//! stretches every time and can swap which of two independent events comes
//! first. Times are reported; only lower bounds that load cannot break are
//! asserted, and generous limits (the programs' own, the guests') turn a
//! hang into a failure. The groups are separate #[test]s, so
//! libtest runs two at a time (one per core): names start with a number to
//! start the long ones first.
//!
//! This binary runs on the host (its name does not start with `rxe_`) and
//! boots its guests itself. The cases are destructive (they kill hosts,
//! take links down, delete the device), so they always run in guests, never
//! on real hardware.

mod common;

use common::{blocks, profile_dir, root, Block};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

fn run_checked(what: &str, cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Builds librdmasafe.so (always: `cargo test --test faults` builds only
/// the rlib) and the fault programs, once per test binary. Returns the
/// programs' directory.
fn build() -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = BUILT.get_or_init(|| {
        let t0 = Instant::now();
        let profile = profile_dir();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(root()).args(["build", "-p", "rdmasafe-capi"]);
        if profile.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        if let Some(target) = profile.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        run_checked("cargo build -p rdmasafe-capi", &mut cmd)?;
        let bin = profile.parent().expect("<target>").join("faults");
        run_checked(
            "make -C tests/faults",
            Command::new("make")
                .current_dir(root())
                .args(["-C", "tests/faults"])
                .arg(format!("LIBDIR={}", profile.display()))
                .arg(format!("OUT={}", bin.display())),
        )?;
        for p in ["fault_node", "fault_devremove", "fault_storm", "fault_overrun", "leak_cycles"] {
            if !bin.join(p).exists() {
                return Err(format!("make did not produce {p}"));
            }
        }
        println!("[faults] built the programs in {:.1} s", t0.elapsed().as_secs_f64());
        Ok(bin)
    });
    r.clone().unwrap_or_else(|e| panic!("{e}"))
}

/// A guest run: its output and how long it took.
struct Run {
    stdout: String,
    stderr: String,
    code: Option<i32>,
    secs: f64,
}

fn run_bed(label: &str, cmd: &mut Command) -> Run {
    let bin = build();
    cmd.current_dir(root()).env("RDMASAFE_FAULTS_BIN", &bin);
    let t0 = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| panic!("{label}: cannot run {cmd:?}: {e}"));
    let run = Run {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        code: out.status.code(),
        secs: t0.elapsed().as_secs_f64(),
    };
    println!("==== [faults] {label}: guest output\n{}", run.stdout);
    eprintln!("{}", run.stderr);
    println!("[faults] {label}: bed exit {:?} after {:.1} s", run.code, run.secs);
    run
}

/// One guest (tests/bed/vm-run) running `guest.sh one CASES...`.
fn one_guest(label: &str, timeout: u32, mem: u32, cases: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(root().join("tests/bed/vm-run"));
    cmd.args([
        "--timeout",
        &timeout.to_string(),
        "--mem",
        &mem.to_string(),
        "--",
        "bash",
        "tests/faults/guest.sh",
        "one",
    ]);
    cmd.args(cases);
    cmd.envs(env.iter().copied());
    run_bed(label, &mut cmd)
}

/// Two guests (tests/bed/vm-run2) running `guest.sh CASE a` and `... b`.
fn two_guests(label: &str, timeout: u32, case: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(root().join("tests/bed/vm-run2"));
    cmd.args(["--timeout", &timeout.to_string()])
        .args(["--a", &format!("bash tests/faults/guest.sh {case} a")])
        .args(["--b", &format!("bash tests/faults/guest.sh {case} b")]);
    cmd.envs(env.iter().copied());
    run_bed(label, &mut cmd)
}

/// The lines of one guest of a vm-run2 run ("[a] " / "[b] " removed).
fn guest_lines(stdout: &str, guest: char) -> String {
    let prefix = format!("[{guest}] ");
    stdout.lines().filter_map(|l| l.strip_prefix(&prefix)).flat_map(|l| [l, "\n"]).collect()
}

/// Failed expectations of one group, reported together.
struct Checks {
    group: &'static str,
    failures: Vec<String>,
    passed: usize,
    figures: Vec<String>,
}

impl Checks {
    fn new(group: &'static str) -> Checks {
        Checks { group, failures: Vec::new(), passed: 0, figures: Vec::new() }
    }
    fn that(&mut self, ok: bool, what: impl Into<String>) -> bool {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(what.into());
        }
        ok
    }
    /// A program ran, exited `want`, printed no FAIL line and its summary.
    fn program(&mut self, runs: &BTreeMap<String, Block>, label: &str, prog: &str, want: i32) -> bool {
        let Some(b) = runs.get(label) else {
            return self.that(false, format!("{label}: did not run (no output block)"));
        };
        let fails = b.fails();
        let ok = self.that(b.exit == Some(want), format!("{label}: exit {:?}, want {want}", b.exit))
            & self.that(fails.is_empty(), format!("{label}: FAIL lines: {fails:#?}"));
        if want == 0 {
            self.that(
                b.has(&format!("{prog}: ")) && b.has(" passed, 0 failed"),
                format!("{label}: no clean summary line"),
            ) && ok
        } else {
            ok
        }
    }
    /// Records a figure for the report (and checks it is there).
    fn figure(&mut self, b: Option<&Block>, label: &str, name: &str) -> Option<f64> {
        let v = b.and_then(|b| b.num(name));
        if let Some(v) = v {
            self.figures.push(format!("{label}.{name}={v}"));
        } else {
            self.that(false, format!("{label}: no figure {name}"));
        }
        v
    }
    fn text(&mut self, b: Option<&Block>, label: &str, name: &str) -> String {
        let v = b.and_then(|b| b.measure(name)).unwrap_or("").trim().to_string();
        self.figures.push(format!("{label}.{name}={v}"));
        v
    }
    /// A lower bound that load cannot break (causality, a protocol's
    /// minimum); upper bounds on times are left to the watchdogs.
    fn at_least(&mut self, b: Option<&Block>, label: &str, name: &str, lo: f64) {
        if let Some(v) = self.figure(b, label, name) {
            self.that(v >= lo, format!("{label}: {name} = {v}, want at least {lo}"));
        }
    }
    fn equals(&mut self, b: Option<&Block>, label: &str, name: &str, want: f64) {
        if let Some(v) = self.figure(b, label, name) {
            self.that(v == want, format!("{label}: {name} = {v}, want {want}"));
        }
    }
    /// The common end-of-program guarantees.
    fn clean_end(&mut self, b: Option<&Block>, label: &str, loop_prefix: Option<&str>) {
        self.equals(b, label, "cm_outstanding", 0.0);
        self.equals(b, label, "cm_ids_left", 0.0);
        if let Some(p) = loop_prefix {
            self.equals(b, label, &format!("{p}_unacked_now"), 0.0);
        }
    }
    fn finish(self, run: &Run) {
        println!("[faults] {}: figures: {}", self.group, self.figures.join(" "));
        println!(
            "[faults] {}: {} expectations met, {} failed, guest run {:.1} s",
            self.group,
            self.passed,
            self.failures.len(),
            run.secs
        );
        assert!(
            self.failures.is_empty(),
            "{}: {} failed expectations:\n  {}",
            self.group,
            self.failures.len(),
            self.failures.join("\n  ")
        );
    }
}

/// Seconds of traffic between "traffic flowing" and a peer fault: the
/// programs then account for hundreds of completions before the first
/// error, as on a slow, loaded machine (where a log of the first 256
/// completions once held no error at all).
const TRAFFIC_S: &str = "2";

/// The error sequence of a fault_node survivor's traffic connection: how
/// many errors depends on what was in flight at the fault (timing); at
/// least one, then only flushes, no success after the first error.
fn error_sequence(c: &mut Checks, b: Option<&Block>, l: &str) {
    let errs = c.figure(b, l, "error_completions").unwrap_or(0.0);
    let flush = c.figure(b, l, "flush_after_first").unwrap_or(-1.0);
    c.equals(b, l, "other_after_first", 0.0);
    c.equals(b, l, "ok_after_first", 0.0);
    c.that(errs >= 1.0 && flush == errs - 1.0, format!("{l}: {errs} errors, {flush} flushes after the first"));
}

fn case_line(c: &mut Checks, text: &str, case: &str) {
    let want = format!("==== CASE {case} 0 failed");
    c.that(text.lines().any(|l| l.starts_with(&want)), format!("no line {want:?}"));
}

// --------------------------------------------------------------- the cases

/// Case 5: storm past the backlog; UNREACHABLE after ~100 s (run once).
#[test]
fn faults_1_storm_past_the_backlog() {
    let run = one_guest("storm", 900, 512, &["storm"], &[]);
    let mut c = Checks::new("storm");
    let runs = blocks(&run.stdout);
    c.that(run.code == Some(0), format!("vm-run exit {:?}", run.code));
    case_line(&mut c, &run.stdout, "storm");
    c.program(&runs, "storm_server", "fault_storm", 0);
    c.program(&runs, "storm_client", "fault_storm", 0);
    let (cl, sv) = (runs.get("storm_client"), runs.get("storm_server"));
    let n = c.figure(cl, "client", "clients").unwrap_or(0.0);
    c.equals(cl, "client", "unreachable", n - 4.0);
    c.equals(cl, "client", "rejected", 4.0);
    c.equals(cl, "client", "established", 0.0);
    // ib_cm gives up after its REQ retries (~102 s on this kernel and
    // rxe): never sooner than a minute; how much later is the machine's
    // load (the client's own limit bounds it)
    c.at_least(cl, "client", "unreachable_min_ms", 60_000.0);
    c.at_least(cl, "client", "unreachable_max_ms", 60_000.0);
    c.figure(cl, "client", "rejected_max_ms");
    c.equals(sv, "server", "server_requests", 4.0);
    c.figure(sv, "server", "server_late_requests");
    c.figure(sv, "server", "server_held_ms");
    c.clean_end(cl, "client", None);
    c.clean_end(sv, "server", None);
    c.finish(&run);
}

/// Leaks: valgrind memcheck over the connect/disconnect and completion cycles.
#[test]
fn faults_2_valgrind_leaks() {
    let run = one_guest("leaks", 1800, 1024, &["leaks"], &[]);
    let mut c = Checks::new("leaks");
    let runs = blocks(&run.stdout);
    c.that(run.code == Some(0), format!("vm-run exit {:?}", run.code));
    case_line(&mut c, &run.stdout, "leaks");
    c.program(&runs, "leaks", "leak_cycles", 0);
    let b = runs.get("leaks");
    let cycles = c.figure(b, "leaks", "cycles").unwrap_or(0.0);
    let completions = c.figure(b, "leaks", "completions").unwrap_or(0.0);
    c.that(cycles >= 100.0, format!("only {cycles} connect/disconnect cycles"));
    c.that(completions >= 10_000.0, format!("only {completions} completions"));
    c.figure(b, "leaks", "cycles_ms");
    c.equals(b, "leaks", "rejected_request_acked_at_deadline", 1.0);
    c.clean_end(b, "leaks", None);
    // valgrind's own summary (lines "==PID== ...")
    let out = b.map(|b| b.out.as_str()).unwrap_or("");
    let vg = |key: &str| -> Option<String> {
        out.lines().find_map(|l| l.split_once(key).map(|(_, r)| r.trim().to_string()))
    };
    let report = |c: &mut Checks, key: &str| {
        let v = vg(key).unwrap_or_default();
        c.figures.push(format!("valgrind.{}={v:?}", key.trim_end_matches(": ").trim().replace(' ', "_")));
        v
    };
    for key in ["definitely lost: ", "indirectly lost: "] {
        let v = report(&mut c, key);
        c.that(v == "0 bytes in 0 blocks", format!("valgrind {key}{v:?}, want 0 bytes in 0 blocks"));
    }
    report(&mut c, "possibly lost: ");
    report(&mut c, "still reachable: ");
    let suppressed = report(&mut c, "suppressed: ");
    let errors = report(&mut c, "ERROR SUMMARY: ");
    c.that(
        errors.starts_with("0 errors"),
        format!("valgrind ERROR SUMMARY {errors:?} (invalid accesses, uninitialised values)"),
    );
    c.that(
        !suppressed.starts_with("0 bytes"),
        format!("no rdma-core global was suppressed ({suppressed:?}): is the suppression file read?"),
    );
    // What stays "possibly lost" must be rdmasafe's process-wide registries
    // (hashbrown tables in statics keep pointers into their blocks), never
    // per-connection or per-cycle memory: it is reported, not suppressed.
    let mut records = Vec::new();
    let mut cur: Option<String> = None;
    for l in out.lines() {
        let body = l.split_once("== ").map(|(_, r)| r).unwrap_or("");
        if body.contains("are possibly lost in loss record") {
            cur = Some(format!("{body}\n"));
        } else if let Some(r) = cur.as_mut() {
            if body.trim().is_empty() {
                records.push(cur.take().unwrap());
            } else {
                r.push_str(body);
                r.push('\n');
            }
        }
    }
    // (frame that allocated it, what the block is): state that lives as
    // long as the process, allocated once: the loop / CQ registries and the
    // C handle table (in statics), and the CM ack-deadline thread (its TLS
    // block, from pthread_create).
    let process_wide = [
        ("rdmasafe::cq::rdmasafe_cq_loop_create", "hashbrown"),
        ("CqLoop::from_raw", "hashbrown"),
        ("CqLoop::add_entry", "hashbrown"),
        ("rdmasafe_core::cq::registry", "hashbrown"),
        ("rdmasafe::handles::Table", "rdmasafe::handles"),
        // Whichever Reaper method starts it (`kick` today).
        ("rdmasafe_core::cm::pool::Reaper::", "pthread_create"),
    ];
    for r in &records {
        let head = r.lines().next().unwrap_or("");
        let known = process_wide.iter().any(|(frame, what)| r.contains(frame) && r.contains(what));
        println!("[faults] leaks: {head}{}", if known { " (process-wide rdmasafe state)" } else { "" });
        c.that(known, format!("possibly lost block outside rdmasafe's process-wide state:\n{r}"));
    }
    // Nothing of rdmasafe may be suppressed: every suppression used is one
    // of rdma-core.supp's (which name rdma-core's globals only, see
    // faults_0_suppressions_cover_only_rdma_core_globals) or one of
    // valgrind's own defaults. Told by the suppression's name, never by
    // the file's path (a checkout is usually in a folder named rdmasafe).
    let ours = suppression_names(&read_supp(&root().join(SUPP)));
    let defaults = suppression_names(&read_supp(std::path::Path::new(VALGRIND_DEFAULT_SUPP)));
    let used: Vec<&str> = out.lines().filter(|l| l.contains("used_suppression:")).collect();
    let mut used_ours = 0;
    for u in &used {
        let which = match used_suppression(u, &ours) {
            Some(name) => {
                used_ours += 1;
                format!("ours: {name}")
            }
            None => match used_suppression(u, &defaults) {
                Some(name) => format!("valgrind's default: {name}"),
                None => {
                    c.that(false, format!("a suppression from neither {SUPP} nor valgrind's defaults was used: {u}"));
                    "UNKNOWN".into()
                }
            },
        };
        println!("[faults] leaks: {} ({which})", u.trim());
    }
    c.that(used_ours > 0, format!("valgrind -s listed no used suppression of {SUPP}"));
    c.finish(&run);
}

const SUPP: &str = "tests/faults/rdma-core.supp";
const VALGRIND_DEFAULT_SUPP: &str = "/usr/libexec/valgrind/default.supp";

fn read_supp(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The entries of a valgrind suppression file: (name, the lines after it).
fn suppression_entries(text: &str) -> Vec<(String, Vec<String>)> {
    let mut entries = Vec::new();
    let mut cur: Option<(Option<String>, Vec<String>)> = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match (&mut cur, line) {
            (None, "{") => cur = Some((None, Vec::new())),
            (Some(_), "}") => {
                if let Some((Some(name), body)) = cur.take() {
                    entries.push((name, body));
                }
            }
            (Some((name @ None, _)), l) => *name = Some(l.to_string()),
            (Some((Some(_), body)), l) => body.push(l.to_string()),
            (None, _) => {}
        }
    }
    entries
}

fn suppression_names(text: &str) -> Vec<String> {
    suppression_entries(text).into_iter().map(|(n, _)| n).collect()
}

/// Which of `names` a valgrind "used_suppression:  COUNT NAME FILE:LINE
/// [suppressed: ...]" line names (the longest that fits), if any.
fn used_suppression<'a>(line: &str, names: &'a [String]) -> Option<&'a str> {
    let rest = line.split_once("used_suppression:")?.1.trim_start();
    let rest = rest.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start();
    names
        .iter()
        .filter(|n| rest.strip_prefix(n.as_str()).is_some_and(|r| r.starts_with(' ')))
        .max_by_key(|n| n.len())
        .map(String::as_str)
}

/// The rules of rdma-core.supp (its header): only rdma-core's own globals,
/// only "possible" leaks, no frame of rdmasafe's. Host only, no guest.
#[test]
fn faults_0_suppressions_cover_only_rdma_core_globals() {
    let text = read_supp(&root().join(SUPP));
    let entries = suppression_entries(&text);
    assert!(!entries.is_empty(), "{SUPP} has entries");
    for (name, body) in &entries {
        assert!(name.starts_with("rdma-core/"), "{SUPP}: entry {name:?} is not named after an rdma-core global");
        assert_eq!(body.first().map(String::as_str), Some("Memcheck:Leak"), "{name}: a leak suppression");
        assert!(
            body.iter().any(|l| l == "match-leak-kinds: possible"),
            "{name}: suppresses only possible leaks: {body:?}"
        );
        let frames: Vec<&String> = body.iter().filter(|l| l.starts_with("fun:") || l.starts_with("obj:")).collect();
        assert!(
            frames.iter().any(|l| l.contains("librdmacm") || l.contains("libibverbs") || l.starts_with("fun:rdma_")),
            "{name}: anchored in rdma-core: {frames:?}"
        );
        for f in frames {
            assert!(!f.to_lowercase().contains("rdmasafe"), "{name}: a frame of rdmasafe's: {f}");
        }
    }
    // The check of the leaks case tells a used suppression by its name,
    // whatever the path of the file (valgrind prints it after the name).
    let names = suppression_names(&text);
    let line = |name: &str, file: &str| {
        format!("--170-- used_suppression:      2 {name} {file}:32 suppressed: 1,288 bytes in 2 blocks")
    };
    for file in ["/tmp/x y/rdmasafe/tests/faults/rdma-core.supp", "/home/me/src/rdmasafe/tests/faults/rdma-core.supp"] {
        for n in &names {
            assert_eq!(used_suppression(&line(n, file), &names), Some(n.as_str()), "{n} in {file}");
        }
        assert_eq!(used_suppression(&line("rdmasafe/hides-a-leak", file), &names), None, "an unknown suppression");
    }
}

/// Case 2 and dead-peer detection: the peer host is killed (two guests).
#[test]
fn faults_3_two_hosts_peer_host_killed() {
    let run = two_guests("hostkill", 600, "hostkill", &[("RDMASAFE_FAULTS_TRAFFIC_S", TRAFFIC_S)]);
    let mut c = Checks::new("hostkill");
    c.that(run.code == Some(0), format!("vm-run2 exit {:?}", run.code));
    c.that(run.stderr.contains("[bed2] status a=0 b=killed"), "vm-run2 did not report a=0 b=killed");
    let a = guest_lines(&run.stdout, 'a');
    let runs = blocks(&a);
    case_line(&mut c, &a, "hostkill-a");
    c.program(&runs, "hostkill_survivor", "fault_node", 0);
    let b = runs.get("hostkill_survivor");
    let l = "survivor";
    let first = c.text(b, l, "first_error");
    c.that(first == "IBV_WC_RETRY_EXC_ERR", format!("first error {first}, want IBV_WC_RETRY_EXC_ERR"));
    // retry_cnt 6, ack timeout 2.1 s: ~15 s, never less than 8 (later
    // under load; the program's limit bounds it)
    c.at_least(b, l, "first_error_after_fault_ms", 8_000.0);
    c.figure(b, l, "first_error_after_last_ok_ms");
    c.figure(b, l, "killed_seen_after_fault_ms");
    error_sequence(&mut c, b, l);
    // keepalive on the idle connection, retry_count 7 (period 200, bound
    // 10000: above rxe's retransmission of a healthy peer's lost packet,
    // about 2.1 s on these guests): it declared the peer dead (the program checks it did, once,
    // with that QP) after the fault, not before; how long after, and
    // whether before the traffic connection's RETRY_EXC_ERR, is timing
    c.figure(b, l, "keepalive_period_ms");
    c.figure(b, l, "keepalive_bound_ms");
    c.at_least(b, l, "dead_after_fault_ms", 0.0);
    c.figure(b, l, "dead_after_killed_seen_ms");
    c.figure(b, l, "dead_before_retry_exc_ms");
    c.figure(b, l, "keepalive_probes");
    c.equals(b, l, "cm_events_during_fault", 0.0);
    c.equals(b, l, "async_events", 0.0);
    c.figure(b, l, "teardown_ms");
    c.clean_end(b, l, Some("survivor"));
    c.finish(&run);
}

/// Case 4: link down then up on guest a's eth0 (two guests).
#[test]
fn faults_4_two_hosts_link_flap() {
    let run = two_guests(
        "linkflap",
        600,
        "linkflap",
        &[("RDMASAFE_FAULTS_LINK_DOWN_S", "5"), ("RDMASAFE_FAULTS_TRAFFIC_S", TRAFFIC_S)],
    );
    let mut c = Checks::new("linkflap");
    c.that(run.code == Some(0), format!("vm-run2 exit {:?}", run.code));
    c.that(run.stderr.contains("[bed2] status a=0 b=0"), "vm-run2 did not report a=0 b=0");
    let (a, bg) = (guest_lines(&run.stdout, 'a'), guest_lines(&run.stdout, 'b'));
    let (runs_a, runs_b) = (blocks(&a), blocks(&bg));
    case_line(&mut c, &a, "linkflap-a");
    case_line(&mut c, &bg, "linkflap-b");
    c.program(&runs_a, "linkflap_survivor", "fault_node", 0);
    c.program(&runs_b, "linkflap_peer", "fault_node", 0);
    let (b, l) = (runs_a.get("linkflap_survivor"), "survivor");
    // rxe reports the dead port through the QP when a send is posted
    // (LOC_QP_OP_ERR at once) or retransmitted (~2.1 s) while it is down,
    // and sometimes never (the QP stalls): then the traffic connection's
    // keepalive moves the QP to error (flushes). Which comes first is
    // timing; the guest keeps the link down until the error has reached
    // the program. Guaranteed either way: an error, then only flushes,
    // every request completed once (the program checks that too), a flush
    // first only if the keepalive fired, and the keepalive at most once.
    // After a send's own error (LOC_QP_OP_ERR) the keepalive need not
    // fire: that completion reports the broken QP, and a probe that only
    // flushes is no dead peer (it fires if its bound passed first).
    let first = c.text(b, l, "first_error");
    c.text(b, l, "error_path");
    let fired = c.figure(b, l, "traffic_keepalive_fired").unwrap_or(-1.0);
    c.that(first.starts_with("IBV_WC_") && first != "IBV_WC_SUCCESS", format!("first error {first:?}"));
    c.that(fired == 0.0 || fired == 1.0, format!("keepalive fired {fired} times"));
    c.that(
        first != "IBV_WC_WR_FLUSH_ERR" || fired == 1.0,
        format!("first error {first} without the keepalive moving the QP to error (fired {fired})"),
    );
    if fired == 1.0 {
        c.figure(b, l, "traffic_dead_after_fault_ms");
    }
    // causality (the program checks these against the stamps too): the
    // port went down after the link, the error came before PORT_ACTIVE,
    // PORT_ACTIVE after the link was set up again
    c.at_least(b, l, "port_err_after_fault_ms", 0.0);
    let first_ms = c.figure(b, l, "first_error_after_port_err_ms").unwrap_or(f64::MAX);
    let active = c.figure(b, l, "port_active_after_port_err_ms").unwrap_or(0.0);
    c.that(first_ms < active, format!("the send error ({first_ms} ms) came before PORT_ACTIVE ({active} ms)"));
    c.at_least(b, l, "port_active_after_link_up_ms", 0.0);
    error_sequence(&mut c, b, l);
    c.equals(b, l, "async_events", 2.0);
    c.clean_end(b, l, Some("survivor"));
    c.clean_end(runs_b.get("linkflap_peer"), "peer", Some("peer"));
    c.finish(&run);
}

/// Cases 3, 6 and 1 in one guest: peer process killed, CQ overrun, then
/// `rdma link delete` (last: it removes the device).
#[test]
fn faults_5_one_host_process_kill_overrun_device_removal() {
    let run = one_guest(
        "one-host",
        900,
        1024,
        &["prockill", "overrun", "devremove"],
        &[("RDMASAFE_FAULTS_TRAFFIC_S", TRAFFIC_S)],
    );
    let mut c = Checks::new("one-host");
    let runs = blocks(&run.stdout);
    c.that(run.code == Some(0), format!("vm-run exit {:?}", run.code));

    // 3) peer process SIGKILLed mid-traffic
    case_line(&mut c, &run.stdout, "prockill");
    c.program(&runs, "prockill_survivor", "fault_node", 0);
    c.program(&runs, "prockill_peer", "fault_node", 137);
    let (b, l) = (runs.get("prockill_survivor"), "prockill");
    c.at_least(b, l, "disconnected_after_fault_ms", 0.0);
    c.at_least(b, l, "first_error_after_fault_ms", 0.0);
    let first = c.text(b, l, "first_error");
    c.that(first.starts_with("IBV_WC_") && first != "IBV_WC_SUCCESS", format!("prockill first error {first}"));
    error_sequence(&mut c, b, l);
    c.clean_end(b, l, Some("survivor"));

    // 6) CQ overrun
    case_line(&mut c, &run.stdout, "overrun");
    c.program(&runs, "overrun", "fault_overrun", 0);
    let (b, l) = (runs.get("overrun"), "overrun");
    let got = c.figure(b, l, "cq_got").unwrap_or(0.0);
    c.that((4.0..64.0).contains(&got), format!("CQ asked for 4 got {got}"));
    let lost = c.figure(b, l, "completions_lost").unwrap_or(0.0);
    c.that(lost >= 1.0, "no completion was lost: no overrun");
    c.equals(b, l, "cq_err_events", lost);
    let first = c.text(b, l, "client_first_error");
    c.that(
        first == "IBV_WC_RETRY_EXC_ERR",
        format!("overrun: the sender's first error {first}, want IBV_WC_RETRY_EXC_ERR"),
    );
    c.figure(b, l, "client_first_error_ms");
    c.figure(b, l, "first_cq_err_ms");
    let held = c.figure(b, l, "server_delivered_ok").unwrap_or(0.0);
    c.that(held >= 1.0 && held <= got + 1.0, format!("delivered {held} of a {got}-entry CQ"));
    c.clean_end(b, l, Some("client"));
    c.equals(b, l, "server_unacked_now", 0.0);

    // 1) rdma link delete under live connections
    case_line(&mut c, &run.stdout, "devremove");
    c.program(&runs, "devremove", "fault_devremove", 0);
    let (b, l) = (runs.get("devremove"), "devremove");
    let ids = c.figure(b, l, "ids").unwrap_or(0.0);
    c.that(ids == 5.0, format!("{ids} ids, want 5 (listener, 2 client, 2 accepted)"));
    c.equals(b, l, "removal_events", ids);
    // after the delete began; how soon is timing (the program's limit and
    // its teardown watchdog bound it)
    c.at_least(b, l, "first_removal_after_delete_ms", 0.0);
    c.at_least(b, l, "last_removal_after_delete_ms", 0.0);
    c.figure(b, l, "teardown_ms");
    c.figure(b, l, "other_cm_events");
    c.figure(b, l, "async_events");
    c.clean_end(b, l, Some("devremove"));
    // the script's own figures (outside the program's block)
    let script = Block { out: run.stdout.clone(), exit: None };
    c.equals(Some(&script), "devremove", "link_delete_exit", 0.0);
    c.equals(Some(&script), "devremove", "rxe0_left", 0.0);
    // (-1 if it still blocked 30 s after the program exited)
    c.at_least(Some(&script), "devremove", "link_delete_after_exit_ms", 0.0);
    c.figure(Some(&script), "devremove", "link_delete_total_ms");
    c.finish(&run);
}
