//! Smoke test of the benchmark suite (tests/bench/), so it cannot rot:
//! builds the benchmark programs against the debug librdmasafe and runs
//! `tests/bench/run.sh --quick --no-docs` (one Soft-RoCE guest, tiny
//! sizes, one repeat), then checks that every program ran and produced
//! sane numbers: all connections established, every event and completion
//! accounted for, latencies positive, no allocation of rdmasafe's own per
//! CM event, counters consistent, the CQ loop scale case's callgrind
//! counts present and sane. It asserts nothing about speed.
//!
//! Runs on the host (its name does not start with `rxe_`); run.sh boots
//! the guest itself. The full benchmark is `tests/bench/run.sh`.

mod common;

use common::{profile_dir, root};

use std::collections::BTreeMap;

use std::process::Command;
use std::time::Instant;

/// A flat JSON object of numbers, strings and arrays of numbers, as
/// tests/bench/guest.sh prints them (no nesting except `counts`, skipped).
#[derive(Debug, Default, Clone)]
struct Rec(BTreeMap<String, String>);

impl Rec {
    fn parse(s: &str) -> Option<Rec> {
        let s = s.trim();
        let body = s.strip_prefix('{')?.strip_suffix('}')?;
        let mut map = BTreeMap::new();
        let mut rest = body;
        while !rest.is_empty() {
            let r = rest.trim_start_matches([',', ' ']);
            let r = r.strip_prefix('"')?;
            let (key, r) = r.split_once('"')?;
            let r = r.strip_prefix(':')?;
            let (val, r) = if let Some(v) = r.strip_prefix('"') {
                let (v, r) = v.split_once('"')?;
                (v.to_string(), r)
            } else if r.starts_with('[') || r.starts_with('{') {
                let end = Self::close(r)?;
                (r[..=end].to_string(), &r[end + 1..])
            } else {
                let end = r.find(',').unwrap_or(r.len());
                (r[..end].to_string(), &r[end..])
            };
            map.insert(key.to_string(), val);
            rest = r;
        }
        Some(Rec(map))
    }
    /// The index of the bracket that closes the one `r` starts with
    /// (nested arrays, such as callgrind's `top` lists, and strings).
    fn close(r: &str) -> Option<usize> {
        let (mut depth, mut in_str, mut esc) = (0usize, false, false);
        for (i, ch) in r.char_indices() {
            if in_str {
                match ch {
                    _ if esc => esc = false,
                    '\\' => esc = true,
                    '"' => in_str = false,
                    _ => {}
                }
                continue;
            }
            match ch {
                '"' => in_str = true,
                '[' | '{' => depth += 1,
                ']' | '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(i);
                    }
                }
                _ => {}
            }
        }
        None
    }
    fn s(&self, k: &str) -> &str {
        self.0.get(k).map(String::as_str).unwrap_or("")
    }
    fn n(&self, k: &str) -> f64 {
        self.0.get(k).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
    }
}

/// Collects failed expectations, so one run reports all of them.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    fn that(&mut self, ok: bool, what: impl Into<String>) {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(what.into());
        }
    }
}

#[test]
fn bench_programs_run_and_report_sane_numbers() {
    let t0 = Instant::now();
    let root = root();
    let profile = profile_dir();
    let target = profile.parent().expect("<target>").to_path_buf();
    let results = target.join("bench").join("results-smoke.txt");
    let _ = std::fs::remove_file(&results);

    let out = Command::new(root.join("tests/bench/run.sh"))
        .current_dir(&root)
        .args(["--quick", "--no-docs", "--profile", "debug", "--results"])
        .arg(&results)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .expect("run tests/bench/run.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    let text = std::fs::read_to_string(&results).unwrap_or_default();
    println!("[bench_smoke] run.sh {} in {:.1} s", out.status, t0.elapsed().as_secs_f64());

    let recs: Vec<Rec> = text.lines().filter_map(|l| l.strip_prefix("@@ ")).filter_map(Rec::parse).collect();
    let find = |case: &str, role: &str| -> Option<Rec> {
        recs.iter()
            .find(|r| r.s("case") == case && r.s("kind").is_empty() && (role.is_empty() || r.s("role") == role))
            .cloned()
    };
    let mut c = Checks::default();
    c.that(out.status.success(), format!("run.sh exit status {}", out.status));
    let summary = recs.iter().find(|r| r.s("kind") == "summary");
    c.that(summary.is_some_and(|s| s.n("failures") == 0.0), format!("guest summary: {summary:?}"));
    for e in recs.iter().filter(|r| r.s("kind") == "error") {
        c.that(false, format!("failed run: {} {}", e.s("case"), e.s("error")));
    }
    let machine = recs.iter().find(|r| r.s("kind") == "machine");
    c.that(machine.is_some_and(|m| m.n("nproc") >= 1.0), "machine record");

    // CM storm: every connection made and torn down, every event seen
    for v in ["rdmasafe", "raw"] {
        let case = format!("storm_{v}_10");
        match (find(&case, "client"), find(&case, "server")) {
            (Some(cl), Some(sv)) => {
                let n = cl.n("conns");
                c.that(n == 10.0, format!("{case}: conns {n}"));
                c.that(cl.n("unexpected_events") == 0.0, format!("{case}: unexpected events"));
                c.that(cl.n("events") == 4.0 * n, format!("{case}: client events {} != 4 x {n}", cl.n("events")));
                for step in ["resolve_addr", "resolve_route", "connect", "disconnect"] {
                    c.that(cl.n(&format!("ev_{step}")) == n, format!("{case}: {step} events"));
                }
                c.that(cl.n("total_ms") > 0.0, format!("{case}: total_ms"));
                c.that(sv.n("requests") == n && sv.n("established") == n, format!("{case}: server accepted all"));
                c.that(sv.n("other_events") == 0.0, format!("{case}: server unexpected events"));
                if v == "rdmasafe" {
                    c.that(cl.n("rs_outstanding") == 0.0 && sv.n("rs_outstanding") == 0.0, "storm: copies outstanding");
                    c.that(cl.n("rs_copied") == cl.n("events"), "storm: client copies == events");
                }
            }
            other => c.that(false, format!("{case}: missing records {other:?}")),
        }
    }

    // CM event cost micro-benchmark
    for v in ["rdmasafe", "raw"] {
        let case = format!("evcost_{v}");
        match find(&case, "") {
            Some(r) => {
                c.that(r.n("events") == r.n("k") * r.n("rounds") && r.n("events") > 0.0, format!("{case}: events"));
                c.that(r.n("wrong_type") == 0.0, format!("{case}: wrong event types"));
                c.that(r.n("ns_per_event") > 0.0, format!("{case}: ns_per_event"));
            }
            None => c.that(false, format!("{case}: missing")),
        }
    }
    match find("evcost_rdmasafe_allocs", "") {
        Some(r) => {
            // librdmacm mallocs each event; rdmasafe adds nothing in steady state
            c.that(r.n("allocs_per_event") >= 1.0, format!("allocount.so not counting: {}", r.n("allocs_per_event")));
            c.that(r.n("rs_slots_allocated_in_window") == 0.0, "rdmasafe allocated copy slots in steady state");
        }
        None => c.that(false, "evcost_rdmasafe_allocs: missing"),
    }

    // CQ ping-pong in every mode
    for (v, m) in
        [("rdmasafe", "event"), ("rdmasafe", "busy"), ("rdmasafe", "adaptive"), ("raw", "event"), ("raw", "busy")]
    {
        let case = format!("pp_{v}_{m}");
        match (find(&case, "client"), find(&case, "server")) {
            (Some(cl), Some(sv)) => {
                let n = cl.n("n");
                let total = cl.n("recvs");
                c.that(cl.n("failed") == 0.0 && sv.n("failed") == 0.0, format!("{case}: failed"));
                c.that(cl.n("samples") == n, format!("{case}: samples {} != {n}", cl.n("samples")));
                c.that(sv.n("recvs") == total && total > n, format!("{case}: server recvs"));
                c.that(cl.n("completions") >= 2.0 * total, format!("{case}: completions {}", cl.n("completions")));
                let (p50, p99) = (cl.n("p50_ns"), cl.n("p99_ns"));
                c.that(p50 > 0.0 && p99 >= p50, format!("{case}: p50 {p50} p99 {p99}"));
                c.that(cl.n("window_s") > 0.0 && cl.n("wakeups") > 0.0, format!("{case}: window / wakeups"));
                c.that(cl.s("quantiles_ns").starts_with('['), format!("{case}: quantiles"));
                if m == "event" {
                    c.that(cl.n("cq_events") > 0.0, format!("{case}: no CQ events in event mode"));
                    c.that(cl.n("acked_events") == cl.n("cq_events"), format!("{case}: not every CQ event acked"));
                    c.that(cl.n("ack_calls") <= cl.n("cq_events"), format!("{case}: ack calls"));
                }
                if m == "busy" {
                    c.that(cl.n("cq_events") == 0.0, format!("{case}: CQ events in busy-poll mode"));
                }
            }
            other => c.that(false, format!("{case}: missing records {other:?}")),
        }
    }
    match find("idle_rdmasafe_adaptive", "client") {
        Some(r) => c.that(r.n("samples") == r.n("n") && r.n("p50_ns") > 0.0, "idle: samples / p50"),
        None => c.that(false, "idle_rdmasafe_adaptive: missing"),
    }
    // the learning mode, plain and with a latency weight (-L 16): both ran
    // the periodic pings to the end and measured a wake cost
    for m in ["learn", "learn16"] {
        let case = format!("adapt_idle1000_rdmasafe_{m}");
        match (find(&case, "client"), find(&case, "server")) {
            (Some(cl), Some(sv)) => {
                c.that(cl.n("samples") == cl.n("n") && cl.n("p50_ns") > 0.0, format!("{case}: samples / p50"));
                let k = if m == "learn" { 0.0 } else { 16.0 };
                c.that(cl.n("latency_weight") == k, format!("{case}: latency_weight {}", cl.n("latency_weight")));
                c.that(sv.n("learn_wake_cost_ns") > 0.0, format!("{case}: the server measured no wake cost"));
            }
            other => c.that(false, format!("{case}: missing records {other:?}")),
        }
    }
    for v in ["rdmasafe", "raw"] {
        let case = format!("stream_{v}_event");
        match (find(&case, "client"), find(&case, "server")) {
            (Some(cl), Some(sv)) => {
                let n = sv.n("n");
                c.that(sv.n("recvs") == n && cl.n("sends") == n, format!("{case}: messages"));
                // The receiver's completions: the n receives and its one
                // "go" send (the stream starts when that arrives).
                c.that(sv.n("sends") == 1.0, format!("{case}: the receiver's go message"));
                c.that(sv.n("wakeups") > 0.0 && sv.n("completions") == n + 1.0, format!("{case}: receiver counters"));
                c.that(sv.n("acked_events") == sv.n("cq_events"), format!("{case}: acks"));
            }
            other => c.that(false, format!("{case}: missing records {other:?}")),
        }
    }

    // CQ loop scale (cq_scale under callgrind): N = 1 and 64 CQs on one
    // channel, one active; windows of M and 2M round trips, one callgrind
    // dump each. Counts only: instructions per completion, taken as the
    // difference of the two windows, positive and about the same at both N.
    let case = "scale_rdmasafe_event";
    let windows: Vec<&Rec> = recs.iter().filter(|r| r.s("case") == case && r.s("kind") == "scale").collect();
    let dump = |label: &str| {
        recs.iter().find(|r| r.s("case") == case && r.s("kind") == "callgrind_dump" && r.s("label") == label)
    };
    let mut per_completion = BTreeMap::new();
    for n in [1.0, 64.0] {
        let mut at_n: Vec<&Rec> = windows.iter().copied().filter(|r| r.n("ncq") == n).collect();
        at_n.sort_by(|a, b| a.n("len").total_cmp(&b.n("len")));
        c.that(at_n.len() == 2, format!("{case}: N={n}: {} windows, want 2", at_n.len()));
        if at_n.len() != 2 {
            continue;
        }
        for w in &at_n {
            let len = w.n("len");
            c.that(w.n("recvs") == len && w.n("completions") >= len, format!("{case}: N={n} L={len}: completions"));
            c.that(w.n("loop_completions") == w.n("completions"), format!("{case}: N={n} L={len}: loop completions"));
            c.that(w.n("wakeups") > 0.0 && w.n("cq_events") > 0.0, format!("{case}: N={n} L={len}: no wakeups"));
            c.that(w.n("idle_hits") == 0.0, format!("{case}: N={n}: an idle CQ delivered completions"));
        }
        let (a, b) = (at_n[0], at_n[1]);
        c.that(b.n("len") == 2.0 * a.n("len"), format!("{case}: N={n}: window lengths {} {}", a.n("len"), b.n("len")));
        match (dump(a.s("dump")), dump(b.s("dump"))) {
            (Some(da), Some(db)) => {
                c.that(
                    da.n("ir") > 0.0 && db.n("ir") > da.n("ir"),
                    format!("{case}: N={n}: dumps ir {} {}", da.n("ir"), db.n("ir")),
                );
                c.that(db.s("top").starts_with("[["), format!("{case}: N={n}: no per-function counts"));
                let per = (db.n("ir") - da.n("ir")) / (b.n("completions") - a.n("completions"));
                c.that(per > 0.0 && per.is_finite(), format!("{case}: N={n}: instructions per completion {per}"));
                per_completion.insert(n as u64, per);
            }
            other => c.that(false, format!("{case}: N={n}: missing callgrind dumps {other:?}")),
        }
    }
    if let (Some(one), Some(many)) = (per_completion.get(&1), per_completion.get(&64)) {
        // generous: the benchmark's target is 10%, a smoke run checks sanity
        c.that(
            *many < 2.0 * one && *many > 0.5 * one,
            format!("{case}: instructions per completion N=64 {many:.0} vs N=1 {one:.0}"),
        );
        println!("[bench_smoke] CQ loop scale: instructions per completion N=1 {one:.0}, N=64 {many:.0}");
    }

    println!("[bench_smoke] {} expectations met, {} failed", c.passed, c.failures.len());
    assert!(
        c.failures.is_empty(),
        "benchmark smoke run: {} failed expectations:\n  {}\n--- results\n{}",
        c.failures.len(),
        c.failures.join("\n  "),
        text
    );
}
