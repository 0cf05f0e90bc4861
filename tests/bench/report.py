#!/usr/bin/env python3
"""Turns the output of tests/bench/guest.sh into docs/BENCHMARKS.md and
docs/bench-latency.png (the plot with gnuplot).

    report.py RESULTS.txt OUT.md OUT.png [SCALE_RESULTS.txt]

The adaptive frontier plot goes next to OUT.png, as bench-adaptive.png.

With SCALE_RESULTS.txt (the output of a `run.sh --only scale` run), the CQ
loop scale section and its target row come from that run instead, and say
so (date, command, commit); everything else comes from RESULTS.txt.

RESULTS.txt holds "@@ {json}" lines (anything else is ignored). Only the
Python standard library is used. Times are reported as median [min-max]
over the repeats; ratios rdmasafe/raw are computed per repeat (the two ran
back to back) and reported the same way.
"""
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

# --------------------------------------------------------------------------
# loading


def load(path):
    recs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.startswith("@@ "):
                continue
            try:
                recs.append(json.loads(line[3:]))
            except json.JSONDecodeError:
                sys.stderr.write(f"report.py: bad line: {line[:120]}\n")
    return recs


# Cases whose system calls are counted on the thread marking the window
# (the event getter, the CQ loop's thread), when the guest output has the
# per-thread count ("thread"); the storms count the whole process.
THREAD_CASES = ("evcost_", "pp_", "stream_")


def other_threads(w, d, cases):
    """A line with the calls the programs' other threads made in the
    measured windows of `cases` ([(case, label)]), which the table above
    leaves out (THREAD_CASES); nothing when there were none."""
    parts = []
    for case, label in cases:
        o = d.syscalls_other.get(case)
        if o:
            parts.append(f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(o.items(), key=lambda kv: -kv[1])))
    if parts:
        w("Calls of the programs' other threads in the measured window (totals, not per event; "
          "left out of the table: rdmasafe's CM ack-deadline thread sleeps a quarter of the "
          "ack deadline at a time, 250 ms by default, whatever the event rate): "
          + "; ".join(parts) + ".")
        w("")


class Data:
    def __init__(self, recs):
        self.recs = recs
        self.machine = next((r for r in recs if r.get("kind") == "machine"), {})
        self.host = next((r for r in recs if r.get("kind") == "host"), {})
        self.summary = next((r for r in recs if r.get("kind") == "summary"), {})
        self.sections = {r["name"]: r["seconds"] for r in recs if r.get("kind") == "section"}
        self.errors = [r for r in recs if r.get("kind") == "error"]
        self.scale_data = self  # where the scale section's figures come from
        # (case, role) -> {rep: record}; kind-specific records separately
        self.by = defaultdict(dict)
        self.cpurun = defaultdict(dict)
        self.syscalls = {}
        # case -> calls of the program's other threads in the window (the
        # cases counted on the marking thread alone, see THREAD_CASES)
        self.syscalls_other = {}
        self.callgrind = {}
        self.callgrind_top = {}
        self.scale = defaultdict(list)  # case -> cq_scale window records
        self.dumps = defaultdict(dict)  # case -> {dump label: callgrind record}
        for r in recs:
            k = r.get("kind")
            case, rep = r.get("case"), r.get("rep")
            if case is None:
                continue
            if k == "cpurun":
                self.cpurun[(case, r.get("role"))][rep] = r
            elif k == "syscalls":
                self.syscalls[case] = r["counts"]
                own = r.get("thread")
                if own is not None and case.startswith(THREAD_CASES):
                    # per event / round trip: the calls of the thread that
                    # gets the events or runs the loop (the one marking the
                    # window); the others' (rdmasafe's CM ack-deadline
                    # thread, which sleeps in steps of a quarter of the
                    # deadline: per time, not per event) kept apart
                    self.syscalls[case] = own
                    other = {n: c - own.get(n, 0) for n, c in r["counts"].items() if c > own.get(n, 0)}
                    if other:
                        self.syscalls_other[case] = other
            elif k == "callgrind":
                self.callgrind[case] = r.get("ir")
                self.callgrind_top[case] = r.get("top", [])
            elif k == "scale":
                self.scale[case].append(r)
            elif k == "callgrind_dump":
                self.dumps[case][r.get("label")] = r
            elif k is None:
                self.by[(case, r.get("role", "client"))][rep] = r

    def reps(self, case, role="client"):
        return self.by.get((case, role), {})

    def vals(self, case, key, role="client", f=None):
        out = {}
        for rep, r in self.reps(case, role).items():
            if key in r or f:
                try:
                    out[rep] = f(r) if f else r[key]
                except (KeyError, ZeroDivisionError, TypeError):
                    pass
        return out

    def one(self, case, role="client"):
        """The record of a case run once (counts phase)."""
        d = self.reps(case, role)
        return next(iter(d.values())) if d else None


# --------------------------------------------------------------------------
# formatting


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fnum(x, digits=3):
    if x is None:
        return "n/a"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 100):
        return f"{int(x):,}"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.{digits}f}"


def mmm(vals, scale=1.0):
    """median [min-max] of a {rep: value} dict (or list)"""
    xs = list(vals.values()) if isinstance(vals, dict) else list(vals)
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return fnum(xs[0])
    return f"{fnum(statistics.median(xs))} [{fnum(min(xs))}-{fnum(max(xs))}]"


def paired(a, b):
    """per-repeat a/b for the repeats both have"""
    return {rep: a[rep] / b[rep] for rep in a if rep in b and b[rep]}


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------
# CQ loop scale (cq_scale): per N, the difference of two window lengths


def scale_figures(d, case):
    """{N: {"runs": [...]}} for a cq_scale case: per run, with windows of
    L1 < L2 round trips, instructions / completion = (I(L2) - I(L1)) /
    (completions(L2) - completions(L1)), the same per wakeup and per
    ibv_poll_cq call, and per function (own instructions)."""
    by = defaultdict(lambda: defaultdict(dict))  # N -> run -> {len: record}
    for r in d.scale.get(case, []):
        by[r["ncq"]][r["run"]][r["len"]] = r
    dumps = d.dumps.get(case, {})
    out = {}
    for n in sorted(by):
        runs = []
        for run in sorted(by[n]):
            lens = by[n][run]
            if len(lens) < 2:
                continue
            l1, l2 = sorted(lens)[0], sorted(lens)[-1]
            a, b = lens[l1], lens[l2]
            da, db = dumps.get(a.get("dump")), dumps.get(b.get("dump"))
            dc = b["completions"] - a["completions"]
            if not da or not db or dc <= 0:
                continue
            di = db["ir"] - da["ir"]
            dw = b["wakeups"] - a["wakeups"]
            dp = b["poll_calls"] - a["poll_calls"]
            fa = {name: ir for ir, name in da.get("top", [])}
            fb = {name: ir for ir, name in db.get("top", [])}
            funcs = {f: (fb.get(f, 0) - fa.get(f, 0)) / dc for f in set(fa) | set(fb)}
            # rdmasafe's loop only (cq_scale writes them for it): its
            # sleeps and its reads that found no event, per completion
            loop = {k + "_per_c": (b[k] - a[k]) / dc for k in ("sleeps", "channel_reads_empty")
                    if k in a and k in b}
            runs.append({**loop, "run": run, "l1": l1, "l2": l2, "dc": dc, "per_c": di / dc,
                         "per_wakeup": di / dw if dw > 0 else None, "wakeups_per_c": dw / dc,
                         "polls_per_c": dp / dc, "per_poll": di / dp if dp > 0 else None,
                         "funcs": funcs, "idle_hits": b.get("idle_hits", 0)})
        if runs:
            out[n] = {"runs": runs, "per_c": med([r["per_c"] for r in runs])}
    return out


def scale_funcs(fig, n):
    """per-completion own instructions per function at N, median over runs"""
    runs = fig.get(n, {}).get("runs", [])
    names = set().union(*(r["funcs"] for r in runs)) if runs else set()
    return {f: med([r["funcs"].get(f, 0.0) for r in runs]) for f in names}


def build(d, png_name):
    m = d.machine
    quick = m.get("quick") == 1
    L = []
    w = L.append

    def per_rep_sum(case, key_fn):
        """per repeat: key_fn(client_rec, server_rec)"""
        cl, sv = d.reps(case, "client"), d.reps(case, "server")
        out = {}
        for rep in cl:
            if rep in sv:
                try:
                    out[rep] = key_fn(cl[rep], sv[rep])
                except (KeyError, ZeroDivisionError, TypeError):
                    pass
        return out

    # ---------------- header
    w("# rdmasafe benchmarks")
    w("")
    w("GENERATED by `tests/bench/run.sh` from one run"
      + ("; the CQ loop scale section from a second, `--only scale` run" if d.scale_data is not d else "")
      + " (do not edit by hand; rerun the command). " + ("**This is a --quick smoke run: sizes are tiny, numbers are meaningless.**" if quick else ""))
    w("")
    w("```sh\ntests/bench/run.sh            # this page, docs/bench-latency.png, docs/bench-adaptive.png\n"
      "tests/bench/run.sh --quick    # smoke run, tiny sizes\n```")
    w("")
    g = d.host.get("guest_wall_s")
    tot = d.host.get("command_s")
    w(f"This run ({d.host.get('date', '?')}): guest {g} s" + (f", whole command {tot} s (build + guest; the report takes a few seconds more)" if tot else "")
      + f"; phases: " + ", ".join(f"{k} {v} s" for k, v in d.sections.items())
      + f"; failures: {d.summary.get('failures', 'n/a')}; library profile: {d.host.get('profile', '?')}"
      + (f"; commit {d.host['commit']}" if d.host.get("commit") else "") + ".")
    w("")
    w("Machine: everything ran in ONE throw-away QEMU guest under TCG (software "
      f"CPU emulation, no KVM): {m.get('nproc')} vCPUs (`nproc`), CPU model \"{m.get('cpu')}\", "
      f"kernel {m.get('kernel')} (Debian's stock kernel), Soft-RoCE (`rdma_rxe`) device "
      f"{m.get('device')} on a dummy netdev, clocksource `{m.get('clocksource')}`, "
      f"{m.get('mem_mb')} MB. The host has 2 cores. Under TCG absolute times say nothing "
      "about real RDMA hardware; only ratios of runs made side by side in this guest mean "
      "something, and counts (system calls, instructions, allocations, wakeups, acks) "
      "matter more than times.")
    w("")
    if d.errors:
        w("**Failed runs:** " + "; ".join(f"{e['case']} rep {e['rep']}: {e['error']}" for e in d.errors))
        w("")

    # ================= derived figures
    rs, raw = "rdmasafe", "raw"

    # CM event micro: counts
    ev_st = {v: d.syscalls.get(f"evcost_{v}_strace") for v in (rs, raw)}
    ev_st_n = {v: (d.one(f"evcost_{v}_strace") or {}).get("events") for v in (rs, raw)}
    ev_ir = {v: d.callgrind.get(f"evcost_{v}_callgrind") for v in (rs, raw)}
    ev_ir_n = {v: (d.one(f"evcost_{v}_callgrind") or {}).get("events") for v in (rs, raw)}
    ev_al = {v: d.one(f"evcost_{v}_allocs") or {} for v in (rs, raw)}

    def per(counts, n):
        if not counts or not n:
            return None
        return sum(counts.values()) / n

    def per_name(counts, n):
        if not counts or not n:
            return "n/a"
        return ", ".join(f"{k} {fnum(v / n)}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))

    # CM per-event instructions against live ids on the channel (cm_evcost -l L)
    live_ir = {}  # variant -> {L: instructions per event}
    for v in (rs, raw):
        for c, ir in d.callgrind.items():
            pre = f"evcost_{v}_callgrind_l"
            r = d.one(c)
            if c.startswith(pre) and c[len(pre):].isdigit() and ir and r and r.get("events"):
                live_ir.setdefault(v, {})[int(c[len(pre):])] = ir / r["events"]
    live_ls = sorted(set(live_ir.get(rs, {})) | set(live_ir.get(raw, {})))

    def live_spread(v):
        """max / min of the per-event instructions over L = 10 .. 10,000"""
        xs = [x for l, x in live_ir.get(v, {}).items() if 10 <= l <= 10000]
        return max(xs) / min(xs) if len(xs) >= 2 and min(xs) > 0 else None

    sc_ev = {v: per(ev_st[v], ev_st_n[v]) for v in (rs, raw)}
    ir_ev = {v: (ev_ir[v] / ev_ir_n[v]) if ev_ir[v] and ev_ir_n[v] else None for v in (rs, raw)}
    al_ev = {v: ev_al[v].get("allocs_per_event") for v in (rs, raw)}
    own_slots = ev_al[rs].get("rs_slots_allocated_in_window")

    # CM storm counts
    st_cases = {v: next((c for c in d.syscalls if c.startswith(f"storm_{v}_") and c.endswith("_strace")), None)
                for v in (rs, raw)}
    st_n = {v: (d.one(st_cases[v]) if st_cases[v] else None) or {} for v in (rs, raw)}
    sc_conn = {v: per(d.syscalls.get(st_cases[v]) if st_cases[v] else None, st_n[v].get("conns")) for v in (rs, raw)}
    al_cases = {v: next((c for (c, role) in d.by if c.startswith(f"storm_{v}_") and c.endswith("_allocs")), None)
                for v in (rs, raw)}
    al_conn = {}
    for v in (rs, raw):
        r = d.one(al_cases[v]) if al_cases[v] else None
        al_conn[v] = r["allocs_window"] / r["conns"] if r else None

    # CQ counts (pp, client window)
    modes = [(rs, "event"), (rs, "busy"), (rs, "adaptive"), (raw, "event"), (raw, "busy")]
    pp_sc = {}
    for v, mo in modes:
        c = d.syscalls.get(f"pp_{v}_{mo}_strace")
        r = d.one(f"pp_{v}_{mo}_strace")
        pp_sc[(v, mo)] = (c, r["n"] if r else None, r)
    pp_ir = {}
    for v in (rs, raw):
        ir = d.callgrind.get(f"pp_{v}_event_callgrind")
        r = d.one(f"pp_{v}_event_callgrind")
        pp_ir[v] = ir / (2 * r["n"]) if ir and r else None
    # the rdmasafe program connected through raw librdmacm (`-C raw`): the
    # CQ loop alone, glibc on its single-thread paths as in the raw program
    ir = d.callgrind.get(f"pp_{rs}_event_Craw_callgrind")
    r = d.one(f"pp_{rs}_event_Craw_callgrind")
    pp_ir_loop = ir / (2 * r["n"]) if ir and r else None

    def no_clock(c):
        return {k: v for k, v in c.items() if k != "clock_gettime"} if c else None

    # ================= targets at a glance
    w("## Targets at a glance")
    w("")
    w("Measured against the targets of the benchmark issue. Nothing here is asserted "
      "by a test; a miss is reported with its reason further down.")
    w("")
    rows = []

    def verdict(ok):
        return "n/a" if ok is None else ("met" if ok else "**missed**")

    # 1 syscalls
    a, b = sc_ev[rs], sc_ev[raw]
    rows.append(["CM: system calls per event <= raw (get + release, strace)",
                 f"{fnum(a)} vs raw {fnum(b)}", verdict(None if a is None or b is None else a <= b + 1e-9)])
    c_rs, n_rs, _ = pp_sc.get((rs, "event"), (None, None, None))
    c_raw, n_raw, _ = pp_sc.get((raw, "event"), (None, None, None))
    a, b = per(c_rs, n_rs), per(c_raw, n_raw)
    rows.append(["CQ event mode: system calls per round trip <= raw (client, strace)",
                 f"{fnum(a)} vs raw {fnum(b)}", verdict(None if a is None or b is None else a <= b + 1e-9)])
    a2, b2 = per(no_clock(c_rs), n_rs), per(no_clock(c_raw), n_raw)
    rows.append(["... the same without clock_gettime (a system call only on this guest's hpet clocksource)",
                 f"{fnum(a2)} vs raw {fnum(b2)}", verdict(None if a2 is None or b2 is None else a2 <= b2 + 1e-9)])
    # 2 instructions
    a = (ir_ev[rs] - ir_ev[raw]) if ir_ev[rs] is not None and ir_ev[raw] is not None else None
    rows.append(["CM: at most a few hundred user-space instructions per event beyond raw (callgrind)",
                 f"{fnum(a)} (rdmasafe {fnum(ir_ev[rs])}, raw {fnum(ir_ev[raw])})",
                 verdict(None if a is None else a <= 500)])
    a = (pp_ir[rs] - pp_ir[raw]) if pp_ir[rs] is not None and pp_ir[raw] is not None else None
    rows.append(["CQ event mode: few hundred instructions per completion beyond raw (callgrind)",
                 f"{fnum(a)} (rdmasafe {fnum(pp_ir[rs])}, raw {fnum(pp_ir[raw])})",
                 verdict(None if a is None else a <= 500)])
    # 3 CM rate
    storm_ratio, storm_aa, storm_thread = {}, {}, {}
    for n in (200, 1000, 10, 20):
        t_rs = d.vals(f"storm_{rs}_{n}", "total_ms")
        t_raw = d.vals(f"storm_{raw}_{n}", "total_ms")
        t_aa = d.vals(f"storm_raw_{n}_aa", "total_ms")
        t_thr = d.vals(f"storm_raw_{n}_thread", "total_ms")
        if t_rs and t_raw:
            storm_ratio[n] = paired(t_raw, t_rs)  # rate ratio = raw time / rdmasafe time
        if t_raw and t_aa:
            storm_aa[n] = paired(t_aa, t_raw)  # raw / raw: the noise floor
        if t_rs and t_thr:
            storm_thread[n] = paired(t_thr, t_rs)  # rdmasafe / raw with one idle thread
    for n, pr in storm_ratio.items():
        mm = med(pr.values())
        aa = storm_aa.get(n)
        floor = f"; A/A control raw / raw {mmm(aa)}x" if aa else "; no A/A control in this run"
        thr = storm_thread.get(n)
        if thr:
            floor += f"; against raw with one idle thread per process (`-T`) {mmm(thr)}x"
        rows.append([f"CM storm N={n}: connection rate >= 0.98x raw",
                     f"{mmm(pr)}x (per-repeat pairs){floor}", verdict(None if mm is None else mm >= 0.98)])
    # 4 allocations
    own = None
    if al_ev[rs] is not None and al_ev[raw] is not None:
        own = al_ev[rs] - al_ev[raw]
    rows.append(["CM: 0 allocations of rdmasafe's own per event in steady state",
                 f"{fnum(own)} per event (total {fnum(al_ev[rs])} vs raw {fnum(al_ev[raw])}; "
                 f"slots allocated in window: {own_slots})",
                 verdict(None if own is None else (abs(own) < 1e-9 and not own_slots))])
    # 5 CQ event rate and CPU
    def pp_rate(case):
        return d.vals(case, "r", f=lambda r: 2 * r["n"] / r["window_s"])

    def pp_cpu(case):  # ms of CPU (both processes) per 1000 messages
        return per_rep_sum(case, lambda c, s: (c["cpu_user_s"] + c["cpu_sys_s"] + s["cpu_user_s"] + s["cpu_sys_s"])
                           / (2 * c["n"]) * 1000 * 1000)

    for suffix, label in (("", ""), ("_fastclock", " (user-space clock, diagnostic)")):
        r_rs, r_raw = pp_rate(f"pp_{rs}_event{suffix}"), pp_rate(f"pp_{raw}_event{suffix}")
        c_rs2, c_raw2 = pp_cpu(f"pp_{rs}_event{suffix}"), pp_cpu(f"pp_{raw}_event{suffix}")
        pr, pc = paired(r_rs, r_raw), paired(c_rs2, c_raw2)
        if pr:
            ok = None if med(pr.values()) is None else (med(pr.values()) >= 0.98 and med(pc.values()) <= 1.0)
            rows.append([f"CQ event mode{label}: rate >= 0.98x hand-written loop at <= its CPU per message",
                         f"rate {mmm(pr)}x, CPU/msg {mmm(pc)}x", verdict(ok)])
    # 6 adaptive idle
    def p50(case):
        return d.vals(case, "p50_ns")

    def srv_cpu_per_msg(case):  # server CPU us per message (idle)
        return d.vals(case, "c", role="server",
                      f=lambda r: (r["cpu_user_s"] + r["cpu_sys_s"]) / (2 * r["n"]) * 1e6)

    for case_a, label in ((f"idle_{rs}_adaptive", "default spin 50 us"), (f"idle_{rs}_adaptive_A2000", "spin 2000 us")):
        pl = paired(p50(case_a), p50(f"idle_{rs}_busy"))
        pcpu = paired(srv_cpu_per_msg(case_a), srv_cpu_per_msg(f"idle_{rs}_busy"))
        if pl:
            ok = med(pl.values()) <= 1.10 and med(pcpu.values()) <= 0.30
            rows.append([f"Mostly idle ({label}): adaptive p50 within 10% of busy-poll at <= 30% of its CPU",
                         f"p50 {mmm(pl)}x, server CPU/msg {mmm(pcpu)}x", verdict(ok)])
    # 7 acks under load
    for case in (f"stream_{rs}_event_big", f"stream_{rs}_event"):
        v = d.vals(case, "a", role="server", f=lambda r: r["ack_calls"] / r["cq_events"])
        # a loop acks every 16th event, plus one flush of the rest at stop
        ok = d.vals(case, "o", role="server", f=lambda r: r["ack_calls"] <= r["cq_events"] / 16 + 1)
        if v:
            n = d.one(case, "server")["n"]
            rows.append([f"Under load (stream of {n:,} sends, receiver): ack calls <= 1 per 16 CQ events",
                         f"1 per {fnum(1 / med(v.values()))} events (the last call flushes the remainder at stop)",
                         verdict(all(ok.values()))])
            break
    rows += adaptive_target_rows(d, verdict)
    scale_ev = scale_figures(d.scale_data, f"scale_{rs}_event")
    if scale_ev:
        xs = {n: f["per_c"] for n, f in scale_ev.items()}
        lo, hi = min(xs.values()), max(xs.values())
        rows.append([f"CQ loop event mode, {', '.join(f'{n:,}' for n in xs)} CQs on one channel, one active: "
                     "instructions per completion within 10% of each other (callgrind)",
                     "; ".join(f"N={n:,}: {fnum(x)}" for n, x in xs.items()) + f" (max / min {hi / lo:.3f})"
                     + (f"; separate run of {d.scale_data.host.get('date', '?')}, see the scale section"
                        if d.scale_data is not d else ""),
                     verdict(hi / lo <= 1.10)])
    # issue 14, targets 1-3 (counts; the before/after table in section 1).
    # Per wakeup: a wakeup re-arms its CQ once (the ioctl of
    # ibv_req_notify_cq on rxe), so wakeups = ioctl calls; the loop's own
    # calls are everything but the program's clock stamps and its
    # post_send write()s.
    def loop_calls_per_wakeup(c):
        if not c or not c.get("ioctl"):
            return None, None
        own = sum(v for k, v in c.items() if k not in ("clock_gettime", "write", "getrusage"))
        return own / c["ioctl"], c["ioctl"]

    for case, label in ((f"pp_{{}}_event_strace", "ping-pong client"),
                        (f"stream_{{}}_event_strace_server", "stream receiver (under load)")):
        a, wa = loop_calls_per_wakeup(d.syscalls.get(case.format(rs)))
        b, wb = loop_calls_per_wakeup(d.syscalls.get(case.format(raw)))
        if a is None or b is None:
            if d.syscalls.get(case.format(rs)) is not None or d.syscalls.get(case.format(raw)) is not None:
                # counted, but no wakeup that re-armed: nothing to divide by
                rows.append([f"Issue 14 #1: event mode, {label}: the loop's system calls per wakeup at most +1 "
                             "over the hand-written loop's",
                             "not measured in this run: no wakeup re-armed the CQ in the "
                             + " and ".join(v for v, x in ((rs, a), (raw, b)) if x is None)
                             + " program's window (everything was queued before its loop ran)", verdict(None)])
            continue
        c1 = d.syscalls.get(case.format(rs))
        sleeps = (c1.get("epoll_wait", 0) + c1.get("poll", 0)) / wa
        rows.append([f"Issue 14 #1: event mode, {label}: the loop's system calls per wakeup at most +1 over the "
                     "hand-written loop's (none extra when the event is already pending)",
                     f"{fnum(a)} vs raw {fnum(b)} per wakeup; epoll_wait in {fnum(100 * sleeps)}% of wakeups "
                     f"({wa} vs {wb} wakeups)", verdict(a - b <= 1 + 1e-9)])
    c_rs, n_rs, _ = pp_sc.get((rs, "event"), (None, None, None))
    c_raw, n_raw, _ = pp_sc.get((raw, "event"), (None, None, None))
    if c_rs and c_raw:
        ca, cb = c_rs.get("clock_gettime", 0) / n_rs, c_raw.get("clock_gettime", 0) / n_raw
        rows.append(["Issue 14 #1: timing statistics off (default): no clock read of the loop's own "
                     "(clock_gettime per round trip = the program's own stamps, as raw)",
                     f"{fnum(ca)} vs raw {fnum(cb)}", verdict(ca <= cb + 1e-9)])
    if pp_ir[rs] is not None and pp_ir[raw] is not None:
        x = pp_ir[rs] - pp_ir[raw]
        if pp_ir_loop is not None:
            y = pp_ir_loop - pp_ir[raw]
            rows.append(["Issue 14 #2: CQ event mode: instructions per completion within +150 of the hand-written "
                         "loop (the programs differing in the loop alone: rdmasafe's connects through raw "
                         "librdmacm, `-C raw`)",
                         f"+{fnum(y)} (rdmasafe {fnum(pp_ir_loop)}, raw {fnum(pp_ir[raw])}); with rdmasafe's CM "
                         f"too (its ack-deadline thread puts glibc on its multi-threaded paths): +{fnum(x)}",
                         verdict(y <= 150)])
        else:
            rows.append(["Issue 14 #2: CQ event mode: instructions per completion within +150 of the "
                         "hand-written loop",
                         f"+{fnum(x)} (rdmasafe {fnum(pp_ir[rs])}, raw {fnum(pp_ir[raw])})", verdict(x <= 150)])
    if ir_ev[rs] is not None and ir_ev[raw] is not None:
        x = ir_ev[rs] - ir_ev[raw]
        rows.append(["Issue 14 #3: CM: instructions per get + free within +200 of raw librdmacm",
                     f"+{fnum(x)} (rdmasafe {fnum(ir_ev[rs])}, raw {fnum(ir_ev[raw])})", verdict(x <= 200)])
    sp = live_spread(rs)
    if sp is not None:
        lo, hi = min(x for x in live_ls if x >= 10), max(x for x in live_ls if x <= 10000)
        full = lo == 10 and hi == 10000
        rows.append(["Issue 14 #5: CM per-event instructions flat within 10% from 10 to 10,000 live ids",
                     "; ".join(f"L={l:,}: {fnum(live_ir[rs][l])}" for l in live_ls if l in live_ir.get(rs, {}))
                     + f" (max / min {sp:.3f}; raw {fnum(live_spread(raw))})"
                     + ("" if full else f"; only L={lo:,}..{hi:,} measured"),
                     verdict(sp <= 1.10 if full else None)])
    w(table(["target", "measured", "verdict"], rows))
    w("")

    # ================= counts
    w("## 1. Counts (do not depend on timing)")
    w("")
    w("System calls: `strace -f`, counting only the calls between two `getppid()` markers "
      "the programs make around the measured loop (set-up and teardown excluded); for the CM "
      "events and the CQ loops, the calls of the thread that makes the markers (the one that "
      "gets the events or runs the loop), with the other threads' calls in the window listed "
      "apart below; for the storms, those of every thread. "
      "Instructions: `valgrind --tool=callgrind --collect-atstart=no`, collection toggled on "
      "for the same window (user space only). Allocations: `allocount.so` (LD_PRELOAD, "
      "counts malloc/calloc/realloc/memalign calls of the whole process in the window). "
      "strace slows the traced process, so event batching under strace can differ from the "
      "timed runs; the loop counters (wakeups, acks) below come from the untraced timed runs.")
    w("")
    w("### CM events (cm_evcost: K queued ADDR_RESOLVED events drained by get + release)")
    w("")
    rows = []
    for v, label in ((rs, "rdmasafe_get_event + rdmasafe_event_free"), (raw, "rdma_get_cm_event + rdma_ack_cm_event")):
        rows.append([label, fnum(sc_ev[v]), per_name(ev_st[v], ev_st_n[v]), fnum(ir_ev[v]), fnum(al_ev[v])])
    w(table(["variant", "syscalls / event", "by call", "instructions / event", "allocations / event (all)"], rows))
    w("")
    w(f"rdmasafe's own allocations per event: {fnum(own)} (its total minus raw's; the one "
      "remaining allocation per event is librdmacm's own `malloc` of the event inside "
      f"`rdma_get_cm_event`, present in both); copy slots newly allocated during the "
      f"measured window: {own_slots}.")
    w("")
    other_threads(w, d, [(f"evcost_{v}_strace", v) for v in (rs, raw)])
    if live_ls:
        w("### CM per-event cost vs live ids (cm_evcost -l L: L more ids bound on the measured channel)")
        w("")
        rows = []
        for l in live_ls:
            a, b = live_ir.get(rs, {}).get(l), live_ir.get(raw, {}).get(l)
            rows.append([f"{l:,}", fnum(a), fnum(b), fnum(a - b) if a is not None and b is not None else "n/a"])
        rows.append(["max / min (10..10,000)", fnum(live_spread(rs)), fnum(live_spread(raw)), ""])
        w(table(["live ids L", "rdmasafe instructions / event", "raw instructions / event", "rdmasafe - raw"], rows))
        w("")
        w("Each live id is created on the channel the events are drained from and bound to the guest's "
          "address with port 0 before the first round (it stays live and makes no event); the drained "
          "events are the K ADDR_RESOLVED events of the round's own ids, as above (callgrind, K = 300, "
          "2 measured rounds).")
        w("")
    d0 = d.callgrind.get(f"evcost_{rs}_callgrind_deadline0")
    r0 = d.one(f"evcost_{rs}_callgrind_deadline0")
    if d0 and r0 and r0.get("events"):
        w(f"Diagnostic, rdmasafe with the ack deadline off (`RDMASAFE_ACK_DEADLINE_MS=0`: each original "
          f"acked inside the get, no ack-deadline thread, so glibc keeps its single-thread paths): "
          f"{fnum(d0 / r0['events'])} instructions per get + free (with the default deadline: "
          f"{fnum(ir_ev[rs])}; raw {fnum(ir_ev[raw])}).")
        w("")
    d1 = d.callgrind.get(f"evcost_{raw}_callgrind_thread")
    r1 = d.one(f"evcost_{raw}_callgrind_thread")
    if d1 and r1 and r1.get("events") and ir_ev[rs] is not None:
        t1 = d1 / r1["events"]
        w(f"Diagnostic, raw librdmacm in a process with one more (idle) thread (`cm_evcost -T`: glibc on "
          f"its multi-threaded paths, as in rdmasafe's program, whose ack-deadline thread does the same, and "
          f"in every program that has threads anyway): {fnum(t1)} instructions per get + ack, so rdmasafe's "
          f"default ({fnum(ir_ev[rs])}) is +{fnum(ir_ev[rs] - t1)} over raw at the same threading state.")
        w("")
    w("### CM connection storm (cm_storm client, per connection: create, resolve addr + route, QP, connect, disconnect, destroy)")
    w("")
    rows = []
    for v in (rs, raw):
        c = d.syscalls.get(st_cases[v]) if st_cases[v] else None
        n = st_n[v].get("conns")
        rows.append([v, n, fnum(sc_conn[v]), per_name(c, n), fnum(al_conn[v])])
    w(table(["variant", "N", "syscalls / connection", "by call", "allocations / connection"], rows))
    w("")
    w("### CQ ping-pong (cq_pingpong client, per round trip = 1 send + 1 receive completion)")
    w("")
    rows = []
    for v, mo in modes:
        c, n, r = pp_sc[(v, mo)]
        if not c:
            continue
        ir = pp_ir.get(v) if mo == "event" else None
        rows.append([f"{v} {mo}", fnum(per(c, n)), fnum(per(no_clock(c), n)), per_name(c, n),
                     fnum(ir) if ir else ("time-dependent" if mo != "event" else "n/a")])
    w(table(["loop", "syscalls / round trip", "without clock_gettime", "by call",
             "instructions / completion"], rows))
    w("")
    other_threads(w, d, [(f"pp_{v}_{mo}_strace", f"{v} {mo}") for v, mo in modes]
                  + [(f"stream_{v}_event_strace_server", f"{v} event, stream receiver") for v in (rs, raw)])
    # before / after: the same programs against an earlier librdmasafe
    # (tests/bench/run.sh --before-lib), counted in the same guest run
    bf = "before"
    if d.syscalls.get(f"pp_{bf}_event_strace") or d.syscalls.get(f"stream_{bf}_event_strace_server"):
        w("### Before / after: the same programs against the earlier library, in this run")
        w("")
        w(f"`{bf}` is `cq_pingpong_rdmasafe` / `cm_evcost_rdmasafe` built from the same sources "
          "against the librdmasafe given to `run.sh --before-lib` (see the hand-written section for "
          "which commit), run in this guest next to the current library (`rdmasafe`) and the "
          "hand-written loop (`raw`). Counts first; the ratio columns are count / raw's count.")
        w("")
        rows = []
        for v in (bf, rs, raw):
            c = d.syscalls.get(f"pp_{v}_event_strace")
            r = d.one(f"pp_{v}_event_strace")
            n = r["n"] if r else None
            ir = d.callgrind.get(f"pp_{v}_event_callgrind")
            rc = d.one(f"pp_{v}_event_callgrind")
            irc = ir / (2 * rc["n"]) if ir and rc else None
            if not c:
                continue
            rows.append([v, fnum(per(c, n)), fnum(per(no_clock(c), n)),
                         fnum((c.get("clock_gettime", 0) / n) if n else None), per_name(c, n), fnum(irc)])
        w(table(["loop (event mode, ping-pong client)", "syscalls / round trip", "without clock_gettime",
                 "clock_gettime / round trip", "by call", "instructions / completion"], rows))
        w("")
        ratios = []
        for v in (bf, rs):
            c, cr = d.syscalls.get(f"pp_{v}_event_strace"), d.syscalls.get(f"pp_{raw}_event_strace")
            r, rr = d.one(f"pp_{v}_event_strace"), d.one(f"pp_{raw}_event_strace")
            ir, irr = d.callgrind.get(f"pp_{v}_event_callgrind"), d.callgrind.get(f"pp_{raw}_event_callgrind")
            rc, rrc = d.one(f"pp_{v}_event_callgrind"), d.one(f"pp_{raw}_event_callgrind")
            if not (c and cr and r and rr):
                continue
            a, b = per(c, r["n"]), per(cr, rr["n"])
            a2, b2 = per(no_clock(c), r["n"]), per(no_clock(cr), rr["n"])
            ia = ir / (2 * rc["n"]) if ir and rc else None
            ib = irr / (2 * rrc["n"]) if irr and rrc else None
            ratios.append([v, fnum(a / b) + "x", fnum(a2 / b2) + "x", fnum(a2 - b2),
                           fnum(ia / ib) + "x" if ia and ib else "n/a", fnum(ia - ib) if ia and ib else "n/a"])
        if ratios:
            w(table(["loop", "syscalls vs raw", "without clock vs raw", "extra syscalls / round trip (no clock)",
                     "instructions vs raw", "extra instructions / completion"], ratios))
            w("")
        pr = paired(pp_rate(f"pp_{rs}_event"), pp_rate(f"pp_{bf}_event"))
        pc = paired(pp_cpu(f"pp_{rs}_event"), pp_cpu(f"pp_{bf}_event"))
        if pr:
            w(f"Times, for completeness (noisy, see Noise): event-mode ping-pong, now / before, per repeat: "
              f"rate {mmm(pr)}x at CPU per message {mmm(pc)}x.")
            w("")
        rows = []
        for v in (bf, rs, raw):
            c = d.syscalls.get(f"stream_{v}_event_strace_server")
            r = d.one(f"stream_{v}_event_strace_server", "server")
            if not c or not r:
                continue
            n = r["n"]
            reads = c.get("read", 0)
            waits = c.get("epoll_wait", 0) + c.get("poll", 0)
            rows.append([v, n, fnum(per(c, n)), fnum(per(no_clock(c), n)), fnum(reads / n),
                         fnum(waits / n), fnum(waits / reads) if reads else "n/a", per_name(c, n)])
        if rows:
            w("Under load, the receiver of a stream (server under strace; its CQ event is often already "
              "pending when the loop would sleep):")
            w("")
            w(table(["loop (event mode, stream receiver)", "messages", "syscalls / message",
                     "without clock_gettime", "read / message", "epoll_wait + poll / message",
                     "epoll_wait + poll per read", "by call"], rows))
            w("")
        r = d.one(f"stream_{rs}_event_loopstats", "server")
        if r and r.get("wakeups"):
            wk = r["wakeups"]
            w(f"Untraced stream of {r['n']:,} sends, the receiver's own figures (`rdmasafe_cq_loop_stats`): "
              f"{wk} wakeups, {r.get('cq_events')} CQ events, {r.get('sleeps', 0)} `epoll_wait` "
              f"({fnum(r.get('sleeps', 0) / wk)} per wakeup), {r.get('channel_reads', 0)} channel reads "
              f"({fnum(r.get('channel_reads', 0) / wk)} per wakeup), of which {r.get('channel_reads_empty', 0)} "
              "found nothing (EAGAIN); the hand-written loop makes one blocking `read()` per wakeup and no "
              "`epoll_wait`.")
            w("")
        rows = []
        for v in (bf, rs, raw):
            c = d.syscalls.get(f"evcost_{v}_strace")
            n = (d.one(f"evcost_{v}_strace") or {}).get("events")
            ir = d.callgrind.get(f"evcost_{v}_callgrind")
            ni = (d.one(f"evcost_{v}_callgrind") or {}).get("events")
            if not c and not ir:
                continue
            rows.append([v, fnum(per(c, n)), fnum(ir / ni if ir and ni else None),
                         fnum(ir / ni - ir_ev[raw] if ir and ni and ir_ev[raw] else None)])
        if rows:
            w(table(["CM get + free (cm_evcost)", "syscalls / event", "instructions / event",
                     "instructions beyond raw"], rows))
            w("")
        tops = [(c, lab) for c, lab in ((f"evcost_{bf}_callgrind", "before: CM get + free (per event)"),
                                         (f"pp_{bf}_event_callgrind", "before: event loop (per completion)"))
                if d.callgrind_top.get(c)]
        for c, lab in tops:
            r = d.one(c)
            div = (r["events"] if "evcost" in c else 2 * r["n"]) if r else None
            if div:
                items = [f"`{name[:70]}` {fnum(ir / div)}" for ir, name in d.callgrind_top[c][:12] if ir / div >= 5]
                w(f"- {lab}: " + "; ".join(items))
        if tops:
            w("")
    w("Allocations in the measured window (separate runs with allocount.so preloaded on both sides):")
    w("")
    rows = []
    for v, mo in modes:
        r = d.one(f"pp_{v}_{mo}_allocs")
        s = d.one(f"pp_{v}_{mo}_allocs", "server")
        if r:
            rows.append([f"{v} {mo}", r["allocs_window"], r["n"], s["allocs_window"] if s else "n/a"])
    w(table(["loop", "client allocations in window", "round trips", "server allocations in window"], rows))
    w("")
    tops = [(c, lab) for c, lab in ((f"evcost_{rs}_callgrind", "CM get + free (per event)"),
                                     (f"evcost_{raw}_callgrind", "raw CM get + ack (per event)"),
                                     (f"pp_{rs}_event_callgrind", "rdmasafe event loop (per completion)"),
                                     (f"pp_{rs}_event_Craw_callgrind",
                                      "rdmasafe event loop, connected through raw librdmacm (per completion)"),
                                     (f"pp_{raw}_event_callgrind", "hand-written event loop (per completion)"))
            if d.callgrind_top.get(c)]
    if tops:
        w("Where the user-space instructions go (callgrind, instructions executed in each function itself, "
          "top functions of the measured window, divided by events or completions; hex names are functions "
          "of the stripped rdma-core libraries):")
        w("")
        for c, lab in tops:
            r = d.one(c)
            div = (r["events"] if "evcost" in c else 2 * r["n"]) if r else None
            if not div:
                continue
            items = [f"`{name[:70]}` {fnum(ir / div)}" for ir, name in d.callgrind_top[c][:12] if ir / div >= 5]
            w(f"- {lab}: " + "; ".join(items))
        w("")
    w("Loop counters of the timed ping-pong runs (client side, whole run incl. warm-up; median over repeats):")
    w("")
    rows = []
    for v, mo in modes:
        case = f"pp_{v}_{mo}"
        if not d.reps(case):
            continue
        rows.append([f"{v} {mo}",
                     mmm(d.vals(case, "x", f=lambda r: r["wakeups"] / (2 * (r["recvs"])))),
                     mmm(d.vals(case, "x", f=lambda r: r["completions"] / r["wakeups"])),
                     mmm(d.vals(case, "x", f=lambda r: r["cq_events"] / (2 * r["recvs"]))),
                     mmm(d.vals(case, "x", f=lambda r: r["ack_calls"] / r["cq_events"] if r["cq_events"] else 0)),
                     mmm(d.vals(case, "x", f=lambda r: r["arm_calls"] / (2 * r["recvs"]))),
                     mmm(d.vals(case, "empty_wakeups"))])
    w(table(["loop", "wakeups / message", "completions / wakeup", "CQ events / message",
             "ack calls / CQ event", "arm calls / message", "empty wakeups"], rows))
    w("")

    scale_section(d.scale_data, w, quick, separate=d.scale_data is not d)

    w("### Loop under load (stream of small sends, 64 bytes, at most 64 outstanding)")
    w("")
    rows = []
    for case in (f"stream_{rs}_event_big", f"stream_{raw}_event_big", f"stream_{rs}_event", f"stream_{raw}_event",
                 f"stream_{rs}_event_fastclock", f"stream_{raw}_event_fastclock"):
        for role in ("server", "client"):
            recs = d.reps(case, role)
            if not recs:
                continue
            n = next(iter(recs.values()))["n"]
            rows.append([case.replace("stream_", "").replace("_big", " (1M run)").replace("_fastclock", " + fastclock.so")
                         .replace("_", " "),
                         "receiver" if role == "server" else "sender",
                         f"{n:,} x {len(recs)}",
                         mmm(d.vals(case, "x", role, lambda r: r["completions"] / r["wakeups"])),
                         mmm(d.vals(case, "x", role, lambda r: r["wakeups"] / r["n"])),
                         mmm(d.vals(case, "x", role, lambda r: r["cq_events"] / r["n"])),
                         mmm(d.vals(case, "x", role, lambda r: r["ack_calls"] / r["cq_events"] if r["cq_events"] else 0)),
                         mmm(d.vals(case, "x", role, lambda r: r["empty_wakeups"])),
                         mmm(d.vals(case, "x", role, lambda r: r["empty_wakeups"] / r["wakeups"]))])
    w(table(["loop", "side", "messages x runs", "completions / wakeup", "wakeups / message", "CQ events / message",
             "ack calls / CQ event", "empty wakeups", "empty / wakeups"], rows))
    w("")
    hist = d.one(f"stream_{rs}_event_big", "server") or d.one(f"stream_{rs}_event", "server")
    if hist and "completions_per_wakeup_hist" in hist:
        h = hist["completions_per_wakeup_hist"]
        labels = ["0", "1"] + [f"{1 << (i - 1)}-{(1 << i) - 1}" for i in range(2, 15)] + [">=16384"]
        w("Completions per wakeup, rdmasafe event-mode receiver of the "
          f"{hist['n']:,}-send stream (histogram of `rdmasafe_cq_loop_stats`): "
          + ", ".join(f"{lab}: {c}" for lab, c in zip(labels, h) if c))
        w("")

    # ================= times
    w("## 2. Times (median [min-max] over the repeats, A/B alternated)")
    w("")
    w(f"{m.get('repeats')} repeats; in each repeat the variants of a workload ran back to back, "
      "in reverse order every other repeat. Ratios are computed per repeat (pairs that ran next "
      "to each other), then summarised.")
    w("")
    for n in (200, 1000, 10, 20):
        cases = [(f"storm_{rs}_{n}", "rdmasafe C calls"), (f"storm_{raw}_{n}", "same program, raw librdmacm")]
        if d.reps(f"storm_raw_{n}_thread"):
            cases.append((f"storm_raw_{n}_thread", "raw, one idle thread per process (`-T`)"))
        cases.append((f"storm_cmtime_{n}", "stock cmtime"))
        if not d.reps(cases[0][0]):
            continue
        w(f"### CM connection storm, N = {n} (client step times, ms)")
        w("")
        steps = ["create_id", "resolve_addr", "resolve_route", "create_qp", "connect", "disconnect", "destroy"]
        rows = []
        for s in steps + ["total"]:
            key = "total_ms" if s == "total" else f"ms_{s}"
            rows.append([s] + [mmm(d.vals(c, key)) for c, _ in cases])
        rows.append(["us per connection"] + [mmm(d.vals(c, "total_ms"), 1000.0 / n) for c, _ in cases])
        rows.append(["connections / s"] + [mmm(d.vals(c, "x", f=lambda r: n / r["total_ms"] * 1000)) for c, _ in cases])
        rows.append(["client CPU ms"] + [mmm(d.vals(c, "x", f=lambda r: (r["cpu_user_s"] + r["cpu_sys_s"]) * 1000))
                                         for c, _ in cases[:-1]] + ["n/a"])
        w(table(["step"] + [lab for _, lab in cases], rows))
        w("")
        pr = storm_ratio.get(n, {})
        if pr:
            w(f"Connection rate rdmasafe / raw, per repeat: {mmm(pr)}x "
              f"(per repeat: {', '.join(fnum(pr[k]) for k in sorted(pr))}).")
        aa = storm_aa.get(n, {})
        if aa:
            w("")
            w(f"A/A control: the raw program against itself (a second raw run in the same "
              f"repeat, `storm_raw_{n}_aa`), rate per repeat {mmm(aa)}x "
              f"(per repeat: {', '.join(fnum(aa[k]) for k in sorted(aa))}): a rdmasafe / raw "
              "ratio inside this spread is not a measured difference.")
            w("")
        thr = storm_thread.get(n, {})
        if thr:
            w(f"Threading control: rdmasafe against the raw program with one more, idle thread in "
              f"each process (`cm_storm -T`, `storm_raw_{n}_thread`: glibc's multi-threaded paths "
              "and the kernel's view of a process whose threads ran on several CPUs, as with "
              f"rdmasafe's ack-deadline thread), rate per repeat {mmm(thr)}x "
              f"(per repeat: {', '.join(fnum(thr[k]) for k in sorted(thr))}).")
            w("")
    w("### CM event cost (cm_evcost, per event, ns)")
    w("")
    t_rs, t_raw = d.vals(f"evcost_{rs}", "ns_per_event"), d.vals(f"evcost_{raw}", "ns_per_event")
    diff = {k: t_rs[k] - t_raw[k] for k in t_rs if k in t_raw}
    rows = [["wall time per get + release", mmm(t_rs), mmm(t_raw), mmm(diff)],
            ["user CPU per event", mmm(d.vals(f"evcost_{rs}", "cpu_user_ns_per_event")),
             mmm(d.vals(f"evcost_{raw}", "cpu_user_ns_per_event")), ""],
            ["system CPU per event", mmm(d.vals(f"evcost_{rs}", "cpu_sys_ns_per_event")),
             mmm(d.vals(f"evcost_{raw}", "cpu_sys_ns_per_event")), ""]]
    w(table(["", "rdmasafe", "raw", "rdmasafe - raw (per repeat)"], rows))
    w("")
    ev1 = d.one(f"evcost_{rs}")
    if ev1:
        w(f"{ev1['k']} events per round, {ev1['rounds']} rounds per run after one warm-up round; "
          "most of the time is the `write()` into the kernel both variants make. "
          f"Late rounds (an event not queued yet when the drain began): "
          f"{sum(r.get('late_rounds', 0) for c in (f'evcost_{rs}', f'evcost_{raw}') for r in d.reps(c).values())}.")
        w("")

    def pp_table(title, suffix, stock):
        w(f"### {title}")
        w("")
        rows = []
        for v, mo in modes:
            case = f"pp_{v}_{mo}{suffix}"
            if not d.reps(case):
                continue
            rows.append([f"{v} {mo}", mmm(d.vals(case, "p50_ns"), 1e-3), mmm(d.vals(case, "p99_ns"), 1e-3),
                         mmm(pp_rate(case)), mmm(pp_cpu(case))])
        if stock:
            rc = d.reps("pp_stock_rcpp_event")
            if rc:
                cpu = {}
                for rep, r in rc.items():
                    a = d.cpurun.get(("pp_stock_rcpp_event", "client"), {}).get(rep)
                    b = d.cpurun.get(("pp_stock_rcpp_event", "server"), {}).get(rep)
                    if a and b:
                        cpu[rep] = (a["cpu_user_s"] + a["cpu_sys_s"] + b["cpu_user_s"] + b["cpu_sys_s"]) / (2 * r["iters"]) * 1e6
                rows.append(["stock ibv_rc_pingpong -e (mean)", mmm(d.vals("pp_stock_rcpp_event", "usec_per_iter")), "n/a",
                             mmm(d.vals("pp_stock_rcpp_event", "x", f=lambda r: 2 * r["iters"] / r["seconds"])),
                             mmm(cpu) + " (whole process)"])
            sl = d.reps("pp_stock_sendlat_busy")
            if sl:
                rows.append(["stock ib_send_lat (2 x one-way)", mmm(d.vals("pp_stock_sendlat_busy", "t_typical_us"), 2),
                             mmm(d.vals("pp_stock_sendlat_busy", "p99_us"), 2),
                             mmm(d.vals("pp_stock_sendlat_busy", "x", f=lambda r: 1e6 / r["t_avg_us"])), "n/a"])
        w(table(["loop", "p50 round trip (us)", "p99 round trip (us)", "messages / s", "CPU ms / 1000 messages (both sides)"], rows))
        w("")
        pr = paired(pp_rate(f"pp_{rs}_event{suffix}"), pp_rate(f"pp_{raw}_event{suffix}"))
        pc = paired(pp_cpu(f"pp_{rs}_event{suffix}"), pp_cpu(f"pp_{raw}_event{suffix}"))
        pb = paired(pp_rate(f"pp_{rs}_busy{suffix}"), pp_rate(f"pp_{raw}_busy{suffix}"))
        pbc = paired(pp_cpu(f"pp_{rs}_busy{suffix}"), pp_cpu(f"pp_{raw}_busy{suffix}"))
        w(f"rdmasafe / hand-written, per repeat: event mode rate {mmm(pr)}x at CPU per message {mmm(pc)}x; "
          f"busy-poll rate {mmm(pb)}x at CPU per message {mmm(pbc)}x.")
        w("")
        w("p50 per repeat (us; on a loaded host these jump between two regimes, see Noise): " + "; ".join(
            f"{v} {mo}: " + ", ".join(fnum(x / 1000) for _, x in sorted(d.vals(f"pp_{v}_{mo}{suffix}", "p50_ns").items()))
            for v, mo in modes if d.reps(f"pp_{v}_{mo}{suffix}")) + ".")
        w("")
        fast = {k for k, x in d.vals(f"pp_{rs}_event{suffix}", "p50_ns").items() if x < 2e6} & \
               {k for k, x in d.vals(f"pp_{raw}_event{suffix}", "p50_ns").items() if x < 2e6}
        if fast and len(fast) < len(pr):
            w(f"Event-mode pairs in which both runs were in the fast regime (p50 < 2 ms; repeats "
              f"{', '.join(str(k) for k in sorted(fast))}): rate {mmm({k: pr[k] for k in fast if k in pr})}x, "
              f"CPU per message {mmm({k: pc[k] for k in fast if k in pc})}x.")
            w("")

    n_pp = (d.one(f"pp_{rs}_event") or {}).get("n")
    pp_table(f"CQ ping-pong, {n_pp} round trips of 64 bytes after {50 if not quick else 5} warm-up", "", True)
    if d.reps(f"pp_{rs}_event_fastclock"):
        pp_table("CQ ping-pong with a user-space clock (diagnostic, `fastclock.so` preloaded on both sides)",
                 "_fastclock", False)
        w("`fastclock.so` serves `clock_gettime(CLOCK_MONOTONIC)` from the TSC in user space, as the "
          "vDSO does on a machine whose clocksource is the TSC. In this guest the clocksource is "
          f"`{m.get('clocksource')}`, so every `clock_gettime` is a real system call plus an emulated "
          "HPET read. Both variants' clients read it twice per round trip (their own stamps); rdmasafe's "
          "event-mode loop reads it not at all with timing statistics off (the default, used here: issue 14 "
          "#1's row counts it), nor does the hand-written loop. This table shows the same programs with "
          "the clock's cost removed from both: a gap between its ratios and the table above's does not "
          "come from clock reads of the loop's.")
        w("")

    # idle
    idle_cases = [(f"idle_{rs}_busy", "rdmasafe busy-poll"), (f"idle_{rs}_adaptive", "rdmasafe adaptive (spin 50 us)"),
                  (f"idle_{rs}_adaptive_A2000", "rdmasafe adaptive (spin 2000 us)"), (f"idle_{rs}_event", "rdmasafe event"),
                  (f"idle_{raw}_busy", "hand-written busy-poll"), (f"idle_{raw}_event", "hand-written event")]
    r0 = d.one(idle_cases[0][0])
    if r0:
        w(f"### Mostly idle: one ping per 1 ms, {r0['n']} round trips")
        w("")
        rows = []
        for case, label in idle_cases:
            if not d.reps(case):
                continue
            rows.append([label, mmm(d.vals(case, "p50_ns"), 1e-3), mmm(d.vals(case, "p99_ns"), 1e-3),
                         mmm(srv_cpu_per_msg(case)),
                         mmm(d.vals(case, "x", f=lambda r: (r["cpu_user_s"] + r["cpu_sys_s"]) / (2 * r["n"]) * 1e6))])
        w(table(["loop (both sides)", "p50 round trip (us)", "p99 round trip (us)",
                 "server CPU us / message", "client CPU us / message"], rows))
        w("")
        w("p50 per repeat (us): " + "; ".join(
            f"{label}: " + ", ".join(fnum(x / 1000) for _, x in sorted(d.vals(case, "p50_ns").items()))
            for case, label in idle_cases if d.reps(case)) + ".")
        w("")

    # stream times
    n_st = (d.one(f"stream_{rs}_event", "server") or {}).get("n")
    if n_st:
        w(f"### Stream of {n_st:,} sends (64 bytes, window 64)")
        w("")
        rows = []
        for v, mo in [(rs, "event"), (raw, "event"), (rs, "event_fastclock"), (raw, "event_fastclock")]:
            case = f"stream_{v}_{mo}"
            if not d.reps(case, "server"):
                continue
            rows.append([f"{v} {mo.replace('_fastclock', ' + fastclock.so')}",
                         mmm(d.vals(case, "x", "server", lambda r: r["n"] / r["window_s"])),
                         mmm(per_rep_sum(case, lambda c, s: (c["cpu_user_s"] + c["cpu_sys_s"] + s["cpu_user_s"] + s["cpu_sys_s"])
                                         / c["n"] * 1e6)),
                         mmm(d.vals(case, "x", "server", lambda r: (r["cpu_user_s"] + r["cpu_sys_s"]) / r["n"] * 1e6))])
        w(table(["loop (both sides)", "messages / s (receiver)", "CPU us / message (both)", "receiver CPU us / message"], rows))
        w("")

    adaptive_section(d, w)

    # ================= method and noise
    w("## 3. Method")
    w("")
    w("- One command, `tests/bench/run.sh`: builds librdmasafe (`cargo build --release -p rdmasafe-capi`) "
      "and the programs (`tests/bench/Makefile`, into `target/bench/<profile>/`), boots one guest "
      "(`tests/bed/vm-run`) that runs `tests/bench/guest.sh`, keeps its output in "
      "`target/bench/results-full.txt`, and writes this page with `tests/bench/report.py`.")
    w("- Programs (each built twice from one source, `-DUSE_RDMASAFE` or not): `cm_storm.c` "
      "(cmtime-style storm, server and client processes), `cm_evcost.c` (drains K queued CM events), "
      "`cq_pingpong.c` (RC send/recv over one connection made with rdma_cm: `pp` ping-pong, `idle` one "
      "ping per 1 ms, `poisson` the same with exponential gaps (adaptive frontier), `stream` of sends with "
      "at most 64 outstanding, posted as chained lists). The "
      "completion handler is the same code for both loops; the hand-written event loop is the classic "
      "`ibv_get_cq_event` (blocking) -> `ibv_ack_cq_events(cq, 1)` -> `ibv_req_notify_cq` -> "
      "`ibv_poll_cq` until empty (16 per call), its busy-poll loop spins on `ibv_poll_cq`. rdmasafe's loop "
      "runs with default options (poll batch 16, ack batch 16, adaptive spin 50 us unless stated).")
    w("- Ping-pong round trip: client time from `ibv_post_send` of the ping to the handler seeing the "
      "pong's receive completion; every send is signalled, so a round trip is 2 messages and 4 "
      "completions (2 per side). CPU is `getrusage` user + system of both processes over the measured "
      "window (after the warm-up). Stock tools: `ibv_rc_pingpong -e` reports a mean per iteration "
      "(one round trip); `ib_send_lat` reports one-way times (half a round trip), doubled here; their "
      "CPU (from `wait4`) covers the whole process including device open and connection set-up.")
    w("- CQ loop scale: `cq_scale.c` (one RC ping-pong connection whose client loop holds N CQs on one "
      "completion channel, N - 1 of them idle; one client process grows its loop through every N and "
      "dumps callgrind's counts once per measured window, `CALLGRIND_DUMP_STATS_AT`; per-function counts "
      "are read from the dump files themselves, since `callgrind_annotate` 3.19 counts a call in progress "
      "across a dump as its caller's own cost). `ibv_poll_cq` calls are counted by a wrapper the program "
      "installs in the device context's `poll_cq`.")
    w("- Counts: see section 1. Instructions are user-space only (valgrind does not see the kernel); "
      "under busy polling they grow with waiting time, so only event mode is counted.")
    w("- CM storm columns: steps timed by the client for all N ids at once (create ids; resolve all "
      "addresses and wait for N ADDR_RESOLVED; same for routes; create QPs; connect all and wait for N "
      "ESTABLISHED; disconnect all and wait for N DISCONNECTED; destroy). Both our variants handle an "
      "event the same way: read the fields, release the event, then act. `cmtime` is rdma-core's own "
      "implementation of the same steps (it creates and destroys QPs and ids its own way, see its "
      "create_qp and destroy rows); it is an anchor, not a like-for-like column.")
    w("")
    w("## 4. Noise")
    w("")
    hl = d.host
    w("- TCG emulates both vCPUs in software on a 2-core host; the guest's clocksource is "
      f"`{m.get('clocksource')}` (no TSC), so `clock_gettime` is a system call with an emulated HPET "
      "read behind it; event-mode wakeups go through the emulated interrupt path and vary from "
      "~0.1 ms to several ms from run to run (stock `ibv_rc_pingpong -e` shows the same spread).")
    if hl.get("load_samples"):
        busy = hl.get("samples_with_other_qemu", 0)
        w(f"- The host is shared with other jobs' test beds: during this run {busy} of "
          f"{hl.get('load_samples')} five-second samples saw other QEMU guests running next to ours; "
          f"the highest 1-minute load average was {hl.get('max_loadavg')} on {hl.get('host_nproc')} cores. "
          + ("" if busy else "Earlier runs made while other guests were running showed round trips "
             "jumping between two regimes (~0.3 ms and ~8 ms in event mode, ~50 us and ~8 ms in "
             "busy-poll) from one run to the next, for both loops alike. ")
          + "A/B pairs ran back to back to share whatever load there was, which is why ratios are "
          "taken per repeat.")
    w("- Spread: every time is given as median [min-max]; a ratio whose range crosses 1.0 is not a "
      "measured difference. Counts are exact for the run they come from (strace and callgrind runs are "
      "separate runs, so batching there can differ a little).")
    w("")
    w(f"![latency distributions]({png_name})")
    w("")
    w(f"`{png_name}`: round-trip latency distributions (all repeats pooled) per loop and mode.")
    w("")
    return L


def scale_section(d, w, quick, separate=False):
    rs, raw = "rdmasafe", "raw"
    ev = {v: scale_figures(d, f"scale_{v}_event") for v in (rs, raw)}
    busy = {v: scale_figures(d, f"scale_{v}_busy") for v in (rs, raw)}
    if not ev[rs] and not ev[raw]:
        return
    w("### CQ loop scale (cq_scale: N CQs on one completion channel, one active)")
    w("")
    hl, m = d.host, d.machine
    only = set(d.sections) == {"scale"}
    cmd = "tests/bench/run.sh --only scale" if only else "tests/bench/run.sh --quick" if quick else "tests/bench/run.sh"
    busy_s = hl.get("samples_with_other_qemu")
    w(f"Run: {hl.get('date', '?')}, `{cmd}`"
      + (f", commit {hl['commit']}" if hl.get("commit") else "")
      + f"; guest: {m.get('nproc')} vCPUs under TCG, kernel {m.get('kernel')}, Soft-RoCE rxe0; "
      + f"this case {d.sections.get('scale', '?')} s of a {hl.get('guest_wall_s', '?')} s guest run"
      + (f"; other QEMU guests were running next to ours in {busy_s} of {hl.get('load_samples')} "
         f"five-second samples (highest 1-minute load average {hl.get('max_loadavg')} on "
         f"{hl.get('host_nproc')} host cores)" if hl.get("load_samples") else "")
      + (". This section comes from that separate run; the rest of the page from the run described "
         "at the top" if separate else "")
      + ". The instruction counts (callgrind, user space) do not depend on the machine's speed as "
      "such, so they hold on this shared machine, but rdmasafe's event mode's do depend on how often a "
      "wakeup finds its event already pending (see below the table), and the busy-poll instructions "
      "per completion and the run's duration depend on timing. Each loop's columns give the count "
      "first, then its ratio to N = 1.")
    w("")
    any_fig = ev[rs] or ev[raw]
    r0 = next(iter(next(iter(any_fig.values()))["runs"]))
    nruns = max(len(f["runs"]) for f in any_fig.values())
    w("The client's loop holds N CQs created on one completion channel; one carries an RC ping-pong "
      "(its QP's sends and receives), the N - 1 others are idle (armed, never fire). Sends are "
      "unsignaled but every 64th, so a round trip is one completion (plus one send completion every 64), "
      "and each completion about one wakeup (see the wakeups column). User-space instructions of the "
      "client (callgrind) are counted in windows of L1 and L2 round trips after a warm-up, and "
      f"instructions per completion are (I(L2) - I(L1)) / (completions(L2) - completions(L1)) "
      f"(L1 = {r0['l1']}, L2 = {r0['l2']}, {nruns} run(s) of each pair; median over runs), so creating, "
      "adding and arming the N CQs, and whatever a window costs once, are not counted. One process "
      "grows its loop through every N in turn.")
    w("")
    ns = sorted(set(ev[rs]) | set(ev[raw]))
    base = {v: ev[v].get(ns[0], {}).get("per_c") if ev[v] else None for v in (rs, raw)}
    rows = []
    for n in ns:
        row = [f"{n:,}"]
        for v in (rs, raw):
            f = ev[v].get(n)
            if not f:
                row += ["n/a", "n/a", "n/a"]
                continue
            row += [mmm([r["per_c"] for r in f["runs"]]),
                    f"{f['per_c'] / base[v]:.3f}" if base[v] else "n/a",
                    mmm([r["wakeups_per_c"] for r in f["runs"]])]
            if v == rs:
                row += [mmm([r[k] for r in f["runs"] if k in r]) if any(k in r for r in f["runs"]) else "n/a"
                        for k in ("sleeps_per_c", "channel_reads_empty_per_c")]
        rows.append(row)
    w(table(["N (CQs on the channel)", "rdmasafe event: instructions / completion", "ratio to N=1",
             "wakeups / completion", "sleeps (epoll_wait) / completion", "empty channel reads / completion",
             "hand-written event loop: instructions / completion", "ratio to N=1",
             "wakeups / completion"], rows))
    w("")
    w("Event mode's count per completion depends on timing as well as on N: a wakeup whose CQ event "
      "is already in the channel when the loop looks costs one read, as in the hand-written loop; one "
      "that finds none costs a sleep (`epoll_wait`) before that read, and an empty read before the "
      "sleep when the loop chose to read first. The hand-written loop blocks in its one read either way, so its count does not "
      "move. The sleeps and empty-read columns give how often that happened in each window pair; "
      "compare N with N at equal columns.")
    w("")
    fig = ev[rs]
    if fig and len(fig) >= 2:
        lo_n, hi_n = min(fig), max(fig)
        f_lo, f_hi = scale_funcs(fig, lo_n), scale_funcs(fig, hi_n)
        diff = sorted(((f_hi.get(f, 0) - f_lo.get(f, 0), f) for f in set(f_lo) | set(f_hi)),
                      key=lambda t: -abs(t[0]))
        items = [f"`{f[:70]}` {fnum(f_lo.get(f, 0))} -> {fnum(f_hi.get(f, 0))}" for dlt, f in diff[:8] if abs(dlt) >= 2]
        if items:
            w(f"rdmasafe event mode, the functions whose own instructions per completion differ most "
              f"between N = {lo_n:,} and N = {hi_n:,} (callgrind, same difference of window lengths; "
              "hex names are functions of the stripped rdma-core libraries): " + "; ".join(items) + ".")
            w("")
    if busy[rs] or busy[raw]:
        w("Busy-poll mode (documented as O(registered): every cycle polls every CQ). Instructions per "
          "completion here depend on how long the loop spins between completions (timing: under valgrind a "
          "sweep over many CQs is slower than a round trip), so the figures that do not depend on timing "
          "are the instructions per `ibv_poll_cq` call and per sweep over the N CQs:")
        w("")
        rows = []
        for v, label in ((rs, "rdmasafe busy-poll"), (raw, "hand-written busy-poll")):
            for n, f in busy[v].items():
                runs = f["runs"]
                per_poll = [r["per_poll"] for r in runs if r["per_poll"]]
                rows.append([label, f"{n:,}", mmm([r["per_c"] for r in runs]) + " (time-dependent)",
                             mmm([r["polls_per_c"] for r in runs]), mmm(per_poll),
                             mmm([x * n for x in per_poll])])
        w(table(["loop", "N", "instructions / completion", "ibv_poll_cq calls / completion",
                 "instructions / poll call", "instructions / sweep of N CQs"], rows))
        w("")
    hits = sum(r["idle_hits"] for v in (rs, raw) for f in list(ev[v].values()) + list(busy[v].values())
               for r in f["runs"])
    if hits:
        w(f"**Idle CQs delivered {hits} completions: the run is wrong.**")
        w("")


# --------------------------------------------------------------------------
# adaptive frontier (issue 14 target 4): cases adapt_<workload><arg>_<variant>_<mode>
# written by guest.sh's adaptive section

AD_WORKLOADS = [("idle1000", "Periodic: one ping per 1 ms"),
                ("poisson200", "Poisson arrivals, mean gap 200 us"),
                ("poisson2000", "Poisson arrivals, mean gap 2 ms")]
AD_STREAM = "stream64"


def learn_weight(mo):
    """the latency weight of a learning mode's name (learn: 1, learnK: K),
    None for other modes"""
    if mo == "learn":
        return 1
    if mo.startswith("learn") and mo[5:].isdigit():
        return int(mo[5:])
    return None


def learn_label(mo):
    """learning, learning (latency weight K), or None"""
    k = learn_weight(mo)
    return None if k is None else "learning" if mo == "learn" else f"learning (latency weight {k})"


def learn_modes(d):
    """the learning modes in the results (learn first, then by weight)"""
    found = {c.split("_", 3)[3] for (c, role) in d.by if c.startswith("adapt_") and c.count("_") >= 3
             and c.split("_")[2] == "rdmasafe"}
    return sorted((mo for mo in found if learn_weight(mo) is not None), key=learn_weight)


def ad_modes(d, wl):
    """[(variant, mode, label)] of the cases present for a workload, in plot order"""
    found = {(c.split("_")[2], c.split("_", 3)[3]) for (c, role) in d.by
             if c.startswith(f"adapt_{wl}_") and c.count("_") >= 3}

    def key(vm):
        v, mo = vm
        if mo.startswith("spin"):
            try:
                return (0 if v == "rdmasafe" else 1, 1, int(mo[4:]))
            except ValueError:
                return (0 if v == "rdmasafe" else 1, 1, 0)
        if learn_weight(mo) is not None:
            return (0 if v == "rdmasafe" else 1, 2, learn_weight(mo))
        return (0 if v == "rdmasafe" else 1, {"event": 0, "busy": 3}.get(mo, 4), 0)

    out = []
    for v, mo in sorted(found, key=key):
        who = "rdmasafe" if v == "rdmasafe" else "hand-written" if v == "raw" else v
        what = {"event": "event", "busy": "busy-poll"}.get(
            mo, f"adaptive spin={mo[4:]} us" if mo.startswith("spin") else learn_label(mo) or mo)
        out.append((v, mo, f"{who} {what}"))
    return out


def ad_cpu(d, case, side):
    """{rep: CPU us per message}: side client, server or both (sum of the two
    processes); a round trip is 2 messages (ping and pong), a stream message 1"""
    cl, sv = d.reps(case, "client"), d.reps(case, "server")
    out = {}
    for rep in cl:
        c, s = cl.get(rep), sv.get(rep)
        try:
            msgs = c["n"] * (1 if c.get("workload") == "stream" else 2)
            cc = c["cpu_user_s"] + c["cpu_sys_s"]
            if side == "client":
                out[rep] = cc / msgs * 1e6
            elif s is not None:
                sc = s["cpu_user_s"] + s["cpu_sys_s"]
                out[rep] = (sc if side == "server" else cc + sc) / msgs * 1e6
        except (KeyError, TypeError, ZeroDivisionError):
            pass
    return out


def ad_learned(d, case, label="learning"):
    """One paragraph: what the learning mode (`label`) had learned at the
    end of each repeat, per side (its plan and measured wake cost, from the
    loop's stats), or None for results without those figures."""
    parts = []
    for role in ("server", "client"):
        reps = d.reps(case, role)
        got = [(k, r) for k, r in sorted(reps.items()) if "learn_wake_cost_ns" in r]
        if not got:
            continue

        def plan(r):
            us = lambda k: fnum(r[k] / 1000)
            win = (f", window {us('learn_window_from_ns')}-{us('learn_window_to_ns')} us"
                   if r.get("learn_window_to_ns") else ", no window")
            msgs = max(1, r.get("recvs", 0) + r.get("sends", 0))
            batch = (f" x {fnum(r['learn_wake_batch_milli'] / 1000)} completions"
                     if r.get("learn_wake_batch_milli") else "")
            return (f"spin {us('learn_spin_ns')} us{win}, wake cost {us('learn_wake_cost_ns')} us{batch}, "
                    f"{fnum(r.get('learn_timer_wakes', 0) / msgs)} timer wakes and "
                    f"{fnum(r.get('learn_calibrations', 0) / msgs)} calibrations per completion")
        parts.append(f"{role}: " + "; ".join(f"repeat {k}: {plan(r)}" for k, r in got))
    if not parts:
        return None
    return (f"What the {label} mode had learned at the end of the window (its plan, from the loop's stats; "
            "times after the last completion): " + ". ".join(parts) + ".")


def ad_p50(d, case):
    return {k: v / 1000 for k, v in d.vals(case, "p50_ns").items()}


def line_at(pe, ce, pb, cb, p):
    """CPU of the straight line from the event point (pe, ce) to the
    busy-poll point (pb, cb) at p50 p. Outside the two points' p50 range the
    line is not extended (a steep segment extended far gives meaningless,
    even negative CPU): the CPU of the end point with the nearer p50 is
    used, so a point slower than both must be no dearer than the slower
    one, a point faster than both no dearer than the faster one."""
    lo, hi = ((pe, ce), (pb, cb)) if pe <= pb else ((pb, cb), (pe, ce))
    if p <= lo[0]:
        return lo[1]
    if p >= hi[0]:
        return hi[1]
    return lo[1] + (hi[1] - lo[1]) * (p - lo[0]) / (hi[0] - lo[0])


def ad_line(d, wl, lm="learn"):
    """per repeat: the line's CPU at learning's (mode `lm`) p50, whether
    that p50 is inside [busy, event] p50, and learning's CPU / the line's,
    for the repeats that have all three points"""
    ca = {mo: f"adapt_{wl}_rdmasafe_{m}" for mo, m in (("event", "event"), ("busy", "busy"), ("learn", lm))}
    p = {mo: ad_p50(d, c) for mo, c in ca.items()}
    c = {mo: ad_cpu(d, cs, "both") for mo, cs in ca.items()}
    out = {}
    for rep in p["learn"]:
        try:
            pe, pb, pl = p["event"][rep], p["busy"][rep], p["learn"][rep]
            ce, cb, cl = c["event"][rep], c["busy"][rep], c["learn"][rep]
        except KeyError:
            continue
        at = line_at(pe, ce, pb, cb, pl)
        out[rep] = {"line": at, "inside": min(pe, pb) <= pl <= max(pe, pb),
                    "ratio": cl / at if at > 0 else None}
    return out


def ad_stream_rate(d, mo):
    return d.vals(f"adapt_{AD_STREAM}_rdmasafe_{mo}", "x", "server", lambda r: r["n"] / r["window_s"])


def learn_target_rows(d, verdict, lm):
    """the issue 14 #4 rows of one learning mode (learn or learnK)"""
    rows = []
    wl = "idle1000"
    # the rows of the default mode keep their names; a weighted one says so
    name = "learning" if lm == "learn" else f"learning with latency weight {learn_weight(lm)}"
    pl = paired(ad_p50(d, f"adapt_{wl}_rdmasafe_{lm}"), ad_p50(d, f"adapt_{wl}_rdmasafe_busy"))
    pc = paired(ad_cpu(d, f"adapt_{wl}_rdmasafe_{lm}", "both"), ad_cpu(d, f"adapt_{wl}_rdmasafe_busy", "both"))
    if pl and pc:
        ml, mc = med(pl.values()), med(pc.values())
        why = [] if ml <= 1.10 else [f"p50 {fnum(ml)}x > 1.10x"]
        why += [] if mc <= 0.30 else [f"CPU {fnum(mc)}x > 0.30x"]
        # The floor: event mode never spins, so no way of waiting uses less
        # CPU than it; where event mode's own CPU is above 30% of
        # busy-poll's (the RDMA work itself, e.g. rxe's packet processing
        # in system time), the CPU half of the target cannot be met by any
        # waiting strategy. The share of the waiting CPU (above event mode's)
        # that learning spends is shown beside it.
        pe = paired(ad_cpu(d, f"adapt_{wl}_rdmasafe_event", "both"), ad_cpu(d, f"adapt_{wl}_rdmasafe_busy", "both"))
        cl, ce, cb = (ad_cpu(d, f"adapt_{wl}_rdmasafe_{mo}", "both") for mo in (lm, "event", "busy"))
        share = {r: (cl[r] - ce[r]) / (cb[r] - ce[r]) for r in cl if r in ce and r in cb and cb[r] > ce[r]}
        floor = ""
        if pe:
            floor = (f"; the floor, event mode's CPU / busy-poll's: {mmm(pe)}x"
                     + (f"; {name}'s CPU above event mode's / busy-poll's above event mode's: {mmm(share)}"
                        if share else ""))
        rows.append([f"Issue 14 #4: periodic 1 ms: {name} p50 within 10% of busy-poll at <= 30% of its CPU",
                     f"p50 {mmm(pl)}x, CPU/msg (both sides) {mmm(pc)}x of busy-poll (per-repeat pairs)"
                     + floor + (f"; missed on: {', '.join(why)}" if why else ""), verdict(not why)])
    pr = paired(ad_stream_rate(d, lm), ad_stream_rate(d, "busy"))
    if pr:
        mr = med(pr.values())
        rows.append([f"Issue 14 #4: 64-deep stream: {name} rate >= 0.98x busy-poll",
                     f"rate {mmm(pr)}x of busy-poll (receiver, per-repeat pairs)", verdict(mr >= 0.98)])
    for wl, label in (("poisson200", "200 us"), ("poisson2000", "2 ms")):
        ln = ad_line(d, wl, lm)
        if not ln:
            continue
        rt = {k: v["ratio"] for k, v in ln.items() if v["ratio"] is not None}
        if not rt:
            continue
        inside = sum(1 for v in ln.values() if v["inside"])
        mx = med(rt.values())
        rows.append([f"Issue 14 #4: Poisson mean {label}: {name} on or below the event-busy line in (p50, CPU)",
                     f"{name}'s CPU/msg (both sides) / the line's at {name}'s p50: {mmm(rt)}x per repeat "
                     f"(<= 1: on or below); {name}'s p50 between busy-poll's and event's in {inside} of {len(ln)} "
                     "repeats (outside that range: compared with the CPU of the end point with the nearer p50)",
                     verdict(mx <= 1.0)])
    return rows


def adaptive_target_rows(d, verdict):
    """the issue 14 #4 rows of the targets table (none without the data)"""
    rows = []
    for lm in learn_modes(d) or ["learn"]:
        rows += learn_target_rows(d, verdict, lm)
    return rows


def adaptive_section(d, w):
    """the page's "Adaptive frontier" section"""
    if not any(c.startswith("adapt_") for (c, role) in d.by):
        w("### Adaptive frontier (issue 14 target 4)")
        w("")
        w("No adaptive-frontier data in this results file (it comes from an older run, or from a run "
          "without guest.sh's adaptive section): `tests/bench/run.sh` or `tests/bench/run.sh --only adaptive` "
          "measures it.")
        w("")
        return
    hl, m = d.host, d.machine
    only = m.get("only") == "adaptive"
    quick = m.get("quick") == 1
    cmd = ("tests/bench/run.sh --only adaptive" if only else "tests/bench/run.sh --quick" if quick
           else "tests/bench/run.sh")
    w("### Adaptive frontier (issue 14 target 4)")
    w("")
    busy_s = hl.get("samples_with_other_qemu")
    w(f"Run: {hl.get('date', '?')}, `{cmd}`" + (f", commit {hl['commit']}" if hl.get("commit") else "")
      + f"; this section {d.sections.get('adaptive', '?')} s of a {hl.get('guest_wall_s', '?')} s guest run, "
      f"{m.get('repeats')} alternated repeats"
      + (f"; other QEMU guests ran next to ours in {busy_s} of {hl.get('load_samples')} five-second samples "
         f"(highest 1-minute load average {hl.get('max_loadavg')} on {hl.get('host_nproc')} host cores)"
         if hl.get("load_samples") else "") + ".")
    w("")
    w("`cq_pingpong` with both sides in the same mode: rdmasafe's loop in event, busy-poll, learning "
      "(`RDMASAFE_MODE_LEARNING`" + ("; with `-L K` its `learn_latency_weight` K, a microsecond of added latency "
      "priced as K of CPU, default 1" if any(mo != "learn" for mo in learn_modes(d)) else "") + ") and fixed-spin adaptive mode (`RDMASAFE_MODE_ADAPTIVE`, spin N us, "
      "`-A N`), and the hand-written event and busy-poll loops as reference. Workloads: `idle -i 1000` "
      "(the client sends one ping, waits for the pong, and sends the next 1 ms after the previous send) "
      "and `poisson -i MEAN` (the same, but the gaps between send times are exponential with mean MEAN, "
      "from a seeded xorshift64* generator; seed = repeat number, so every mode of a repeat sees the "
      "same gaps; a pong later than the next send time makes the client send at once). p50 and p99 are "
      "the client's round trips (post_send of the ping to the pong's receive completion). CPU is "
      "`getrusage` user + system over the measured window (after the warm-up) of each process, per "
      "message (a round trip is 2 messages); **the verdicts use the sum of both sides per message** "
      "(the client waits in the same loop mode as the server). Every figure is median [min-max] over "
      "the repeats; ratios are per repeat (all modes of a workload ran back to back, in reverse order "
      "every other repeat). Times under TCG are emulated: compare the rows with each other, not with "
      "real hardware.")
    w("")
    for wl, title in AD_WORKLOADS:
        modes = ad_modes(d, wl)
        if not modes:
            continue
        r0 = d.one(f"adapt_{wl}_{modes[0][0]}_{modes[0][1]}") or {}
        w(f"#### {title} ({r0.get('n', '?')} round trips after {r0.get('recvs', 0) - r0.get('n', 0)} warm-up)")
        w("")
        rows = []
        for v, mo, label in modes:
            case = f"adapt_{wl}_{v}_{mo}"
            sleeps = d.vals(case, "x", "server", lambda r: r["sleeps"] / (2 * r["n"])) if v == "rdmasafe" else {}
            rows.append([label, mmm(ad_p50(d, case)), mmm(d.vals(case, "p99_ns"), 1e-3),
                         mmm(ad_cpu(d, case, "client")), mmm(ad_cpu(d, case, "server")),
                         mmm(ad_cpu(d, case, "both")), mmm(sleeps) if sleeps else "n/a"])
        w(table(["mode (both sides)", "p50 round trip (us)", "p99 round trip (us)", "client CPU us / message",
                 "server CPU us / message", "CPU us / message, both sides (verdict)",
                 "server sleeps (epoll_wait) / message"], rows))
        w("")
        gm = d.vals(f"adapt_{wl}_rdmasafe_event", "gap_mean_us")
        if gm:
            w(f"Mean gap drawn (client, warm-up included), per repeat: {mmm(gm)} us.")
            w("")
        pe, pb = ad_p50(d, f"adapt_{wl}_rdmasafe_event"), ad_p50(d, f"adapt_{wl}_rdmasafe_busy")
        both = [k for k in pe if k in pb]
        if both:
            slower = sum(1 for k in both if pb[k] > pe[k])
            w(f"rdmasafe busy-poll's p50 above event mode's in {slower} of {len(both)} repeats"
              + (" (where it is, the line rises with p50 and is no trade-off between latency and CPU: a point on "
                 "or below it can still be worse than event mode on both axes)" if slower else "")
              + ".")
            w("")
        ln = ad_line(d, wl)
        if ln and wl.startswith("poisson"):
            w("Learning against the straight line from the rdmasafe event point to the rdmasafe busy-poll point "
              "(per repeat, CPU both sides per message, at learning's p50; when learning's p50 is outside "
              "the two points' p50 range, the line's value is the CPU of the end point with the nearer p50; "
              "met when learning's CPU is at most the line's, median over the repeats): " + "; ".join(
                  f"repeat {k}: learning {fnum(ad_cpu(d, f'adapt_{wl}_rdmasafe_learn', 'both')[k])} vs line "
                  f"{fnum(v['line'])} us ({'inside' if v['inside'] else 'outside'} the p50 range)"
                  for k, v in sorted(ln.items())) + ".")
            w("")
        for lm in learn_modes(d):
            learned = ad_learned(d, f"adapt_{wl}_rdmasafe_{lm}", learn_label(lm))
            if learned:
                w(learned)
                w("")
        pl = paired(ad_p50(d, f"adapt_{wl}_rdmasafe_learn"), ad_p50(d, f"adapt_{wl}_rdmasafe_spin50"))
        pc = paired(ad_cpu(d, f"adapt_{wl}_rdmasafe_learn", "both"), ad_cpu(d, f"adapt_{wl}_rdmasafe_spin50", "both"))
        if pl:
            w(f"Learning / fixed spin 50 us, per repeat: p50 {mmm(pl)}x, CPU per message {mmm(pc)}x.")
            w("")
        w("p50 per repeat (us): " + "; ".join(
            f"{label}: " + ", ".join(fnum(x) for _, x in sorted(ad_p50(d, f'adapt_{wl}_{v}_{mo}').items()))
            for v, mo, label in modes) + ".")
        w("")
    smodes = ad_modes(d, AD_STREAM)
    if smodes:
        r0 = d.one(f"adapt_{AD_STREAM}_{smodes[0][0]}_{smodes[0][1]}", "server") or {}
        w(f"#### Stream of {r0.get('n', 0):,} sends, at most 64 outstanding")
        w("")
        rows = []
        base = ad_stream_rate(d, "busy")
        for v, mo, label in smodes:
            case = f"adapt_{AD_STREAM}_{v}_{mo}"
            rate = d.vals(case, "x", "server", lambda r: r["n"] / r["window_s"])
            rows.append([label, mmm(rate), mmm(paired(rate, base)) + "x" if base and mo != "busy" else "1",
                         mmm(ad_cpu(d, case, "server")), mmm(ad_cpu(d, case, "client")), mmm(ad_cpu(d, case, "both")),
                         mmm(d.vals(case, "x", "server", lambda r: r["wakeups"] / r["n"]))])
        w(table(["mode (both sides)", "messages / s (receiver)", "rate / busy-poll (per repeat)",
                 "receiver CPU us / message", "sender CPU us / message", "both sides", "receiver wakeups / message"],
                rows))
        w("")
    w("![adaptive frontier](bench-adaptive.png)")
    w("")
    w("`bench-adaptive.png`: per workload, p50 round trip against CPU per message (both sides; medians over "
      "the repeats, each axis on its own) of each mode, named in the key and next to its point (hand-written "
      "loops in open symbols); the dashed line joins rdmasafe's event and busy-poll points. On or below "
      "the line is at least as good as time-sharing the two modes, where busy-poll is the faster of the two.")
    w("")


def plot_adaptive(d, png):
    """the frontier panels with gnuplot; returns True if written"""
    panels = []
    for wl, title in AD_WORKLOADS:
        pts = []
        for v, mo, label in ad_modes(d, wl):
            case = f"adapt_{wl}_{v}_{mo}"
            p, c = med(ad_p50(d, case).values()), med(ad_cpu(d, case, "both").values())
            if p is not None and c is not None:
                short = ((f"learning k={learn_weight(mo)}" if mo.startswith("learn") and mo != "learn"
                          else mo.replace("spin", "spin=").replace("learn", "learning")) if v == "rdmasafe"
                         else f"hand-written {mo}")
                pts.append((v, mo, p, c, short))
        if pts:
            panels.append((title, pts))
    if not panels:
        return False
    tmp = tempfile.mkdtemp(prefix="rdmasafe-plot.")
    script = [f"set terminal pngcairo size 1100,{380 * len(panels) + 60} font 'DejaVu Sans,10'", f"set output '{png}'",
              f"set multiplot layout {len(panels)},1 title 'rdmasafe adaptive frontier on Soft-RoCE under TCG: "
              "p50 round trip vs CPU per message (both sides, medians over repeats)'",
              "set grid", "set key outside right top font ',9'", "set xrange [0:*]", "set yrange [0:*]",
              "set xlabel 'p50 round trip (us)'", "set ylabel 'CPU us / message (both sides)'",
              "set offsets 0, graph 0.15, graph 0.1, 0"]
    # one colour and point type per mode (the key names them); hand-written
    # loops in open symbols
    colors = {"event": "#1f77b4", "busy": "#d62728", "learn": "#2ca02c", "spin20": "#9467bd",
              "spin50": "#8c564b", "spin200": "#e377c2", "spin1000": "#bcbd22", "learn4": "#17becf",
              "learn8": "#98df8a", "learn16": "#2f6f2f"}
    ptype = {"event": 7, "busy": 5, "learn": 9, "spin20": 11, "spin50": 13, "spin200": 15, "spin1000": 3,
             "learn4": 8, "learn8": 8, "learn16": 8}
    for i, (title, pts) in enumerate(panels):
        fn = os.path.join(tmp, f"p{i}.dat")
        with open(fn, "w") as f:
            for v, mo, p, c, short in pts:
                f.write(f"{p:.3f} {c:.3f} \"{short}\"\n")
        plots = []
        for j, (v, mo, p, c, short) in enumerate(pts):
            col = colors.get(mo, "#7f7f7f") if v == "rdmasafe" else "#7f7f7f"
            pt = ptype.get(mo, 1) if v == "rdmasafe" else {"event": 6, "busy": 4}.get(mo, 1)
            plots.append(f"'{fn}' every ::{j}::{j} using 1:2 with points pt {pt} ps 1.6 lc rgb '{col}' title '{short}'")
        plots.append(f"'{fn}' using 1:2:3 with labels offset 1.2,0 left font ',8' notitle")
        pe = next(((p, c) for v, mo, p, c, _ in pts if v == "rdmasafe" and mo == "event"), None)
        pb = next(((p, c) for v, mo, p, c, _ in pts if v == "rdmasafe" and mo == "busy"), None)
        if pe and pb:
            ln = os.path.join(tmp, f"l{i}.dat")
            with open(ln, "w") as f:
                f.write(f"{pe[0]:.3f} {pe[1]:.3f}\n{pb[0]:.3f} {pb[1]:.3f}\n")
            plots.insert(0, f"'{ln}' using 1:2 with lines dt 2 lw 1.5 lc rgb '#444444' title 'event-busy line'")
        script.append(f"set title '{title}'")
        script.append("plot " + ", ".join(plots))
    script.append("unset multiplot")
    try:
        subprocess.run(["gnuplot"], input="\n".join(script), text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.stderr.write(f"report.py: gnuplot failed (adaptive plot): {e}\n")
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def plot(d, png):
    """CDF panels with gnuplot; returns True if written."""
    rs, raw = "rdmasafe", "raw"
    panels = [
        ("Ping-pong, back to back", [(f"pp_{rs}_event", "rdmasafe event"), (f"pp_{rs}_adaptive", "rdmasafe adaptive"),
                                     (f"pp_{rs}_busy", "rdmasafe busy-poll"), (f"pp_{raw}_event", "hand-written event"),
                                     (f"pp_{raw}_busy", "hand-written busy-poll")]),
        ("Ping-pong, user-space clock (fastclock.so, diagnostic)",
         [(f"pp_{rs}_event_fastclock", "rdmasafe event"), (f"pp_{rs}_adaptive_fastclock", "rdmasafe adaptive"),
          (f"pp_{rs}_busy_fastclock", "rdmasafe busy-poll"), (f"pp_{raw}_event_fastclock", "hand-written event"),
          (f"pp_{raw}_busy_fastclock", "hand-written busy-poll")]),
        ("Mostly idle: one ping per 1 ms", [(f"idle_{rs}_event", "rdmasafe event"), (f"idle_{rs}_adaptive", "rdmasafe adaptive 50 us"),
                                            (f"idle_{rs}_adaptive_A2000", "rdmasafe adaptive 2000 us"),
                                            (f"idle_{rs}_busy", "rdmasafe busy-poll"), (f"idle_{raw}_event", "hand-written event"),
                                            (f"idle_{raw}_busy", "hand-written busy-poll")]),
    ]
    tmp = tempfile.mkdtemp(prefix="rdmasafe-plot.")
    script = ["set terminal pngcairo size 1100,1350 font 'DejaVu Sans,10'", f"set output '{png}'",
              "set multiplot layout 3,1 title 'rdmasafe CQ loops on Soft-RoCE under TCG: round-trip latency (CDF, all repeats pooled)'",
              "set logscale x", "set format x '%.0f'", "set grid", "set key right bottom", "set xlabel 'round trip (us, log scale)'",
              "set ylabel 'fraction of round trips'", "set yrange [0:1]"]
    # one colour per loop and mode in every panel; hand-written loops dashed
    colors = {"rdmasafe event": "#1f77b4", "rdmasafe adaptive": "#2ca02c", "rdmasafe adaptive 50 us": "#2ca02c",
              "rdmasafe adaptive 2000 us": "#8c564b", "rdmasafe busy-poll": "#d62728",
              "hand-written event": "#9467bd", "hand-written busy-poll": "#ff7f0e"}
    drew = False
    for title, series in panels:
        plots = []
        for i, (case, label) in enumerate(series):
            qs = []
            for r in d.reps(case).values():
                qs.extend(r.get("quantiles_ns", []))
            if not qs:
                continue
            qs.sort()
            fn = os.path.join(tmp, f"{case}.dat")
            with open(fn, "w") as f:
                for j, q in enumerate(qs):
                    f.write(f"{max(q, 1) / 1000:.3f} {(j + 0.5) / len(qs):.5f}\n")
            dash = "dt 2" if "hand-written" in label else ("dt 4" if "2000" in label else "dt 1")
            plots.append(f"'{fn}' using 1:2 with lines lw 2 {dash} lc rgb '{colors.get(label, '#000000')}' title '{label}'")
        if plots:
            drew = True
            script.append(f"set title '{title}'")
            script.append("plot " + ", ".join(plots))
    script.append("unset multiplot")
    try:
        if not drew:
            return False
        subprocess.run(["gnuplot"], input="\n".join(script), text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.stderr.write(f"report.py: gnuplot failed: {e}\n")
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def main():
    if len(sys.argv) not in (4, 5):
        sys.stderr.write(__doc__)
        return 2
    results, md, png = sys.argv[1:4]
    d = Data(load(results))
    if len(sys.argv) == 5:
        d.scale_data = Data(load(sys.argv[4]))
    if not d.machine:
        sys.stderr.write("report.py: no machine record: not a guest.sh output?\n")
        return 1
    lines = build(d, os.path.basename(png))
    extra = os.path.join(os.path.dirname(os.path.abspath(__file__)), "analysis.md")
    body = "\n".join(lines)
    # the hand-written analysis reads the full run: not on a quick or an
    # adaptive-only page
    if os.path.exists(extra) and d.machine.get("quick") != 1 and d.machine.get("only") != "adaptive":
        with open(extra, encoding="utf-8") as f:
            body += "\n" + f.read()
    with open(md, "w", encoding="utf-8") as f:
        f.write(body.rstrip() + "\n")
    if not plot(d, png):
        sys.stderr.write("report.py: no plot written\n")
    ad_png = os.path.join(os.path.dirname(os.path.abspath(png)), "bench-adaptive.png")
    if any(c.startswith("adapt_") for (c, role) in d.by) and not plot_adaptive(d, ad_png):
        sys.stderr.write("report.py: no adaptive plot written\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
