#!/usr/bin/env bash
# Only the CQ event-mode callgrind case of tests/bench/run.sh, fast (one
# guest, ~2-4 min): the ping-pong client (`cq_pingpong -m event -w pp`,
# 200 round trips) under callgrind, rdmasafe, rdmasafe connected through
# raw librdmacm (`-C raw`: no CM ack-deadline thread, so the programs differ
# in the CQ loop alone), then the hand-written loop, with the same window
# as run.sh's counts phase. Prints, per variant, the
# user-space instructions per completion (Ir / (2 * round trips)) and the
# functions with the most instructions of their own, per completion.
#
#   tests/bench/cq-callgrind.sh            # build (release) + guest
#   tests/bench/cq-callgrind.sh --no-build # programs already built
#   tests/bench/cq-callgrind.sh --times    # instead: untimed A/B event-mode
#                                          # ping-pong (CQ_TIMES_N round trips,
#                                          # default 500, CQ_TIMES_REPEATS 5):
#                                          # rate and CPU per message ratios;
#                                          # CQ_TIMES_BEFORE_BIN=DIR adds the
#                                          # rdmasafe program of DIR as "before"
#                                          # (to the callgrind case too; DIR and
#                                          # its library's folder must be in
#                                          # RDMASAFE_BED_SHARE if under /tmp)
#
# Nothing is written to docs/; the summary is also kept in
# target/bench/cq-callgrind.txt, the callgrind files in
# target/bench/cq-callgrind/<variant>.cg. CQ_CALLGRIND_N (round trips, default 200)
# and CQ_CALLGRIND_WARM (warm-up round trips, default 50, as run.sh);
# CQ_CALLGRIND_OPTS: more valgrind options (e.g. --dump-instr=yes).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# repo, target, bin and the callgrind_* functions
# shellcheck source=tests/bench/callgrind-lib.sh
. "$here/callgrind-lib.sh"

if [[ ${1:-} == --times-in-guest ]]; then
	# event-mode ping-pong, untraced, rdmasafe and raw back to back (order
	# swapped every other repeat): rate and CPU per message of both sides
	addr=${RDMASAFE_TEST_ADDR:?}
	n=${CQ_TIMES_N:-500}
	reps=${CQ_TIMES_REPEATS:-5}
	out=$(mktemp -d)
	trap 'rm -rf "$out"' EXIT
	port=7950
	rc=0
	for ((rep = 1; rep <= reps; rep++)); do
		order=(rdmasafe raw)
		((rep % 2 == 0)) && order=(raw rdmasafe)
		[[ -n ${CQ_TIMES_BEFORE_BIN:-} ]] && order+=(before)
		for v in "${order[@]}"; do
			port=$((port + 1))
			p=$bin/cq_pingpong_$v
			[[ $v == before ]] && p=$CQ_TIMES_BEFORE_BIN/cq_pingpong_rdmasafe
			"$p" -S -a "$addr" -p "$port" -w pp -m event -n "$n" -W 50 -t 300 >"$out/s.out" 2>"$out/s.err" &
			sp=$!
			for ((i = 0; i < 600; i++)); do
				grep -q '^READY' "$out/s.out" 2>/dev/null && break
				sleep 0.02
			done
			timeout -k 5 300 "$p" -a "$addr" -p "$port" -w pp -m event -n "$n" -W 50 -t 300 \
				>"$out/c.out" 2>"$out/c.err" || rc=1
			wait "$sp" || rc=1
			python3 - "$v" "$rep" "$out/c.out" "$out/s.out" <<'PY'
import json, sys
v, rep, c, s = sys.argv[1:]
rec = lambda f: json.loads(next(l for l in open(f) if l.startswith("RESULT "))[7:])
c, s = rec(c), rec(s)
msgs = 2 * c["n"]
cpu = c["cpu_user_s"] + c["cpu_sys_s"] + s["cpu_user_s"] + s["cpu_sys_s"]
print(f"@@times {v} {rep} rate {msgs / c['window_s']:.1f} cpu_us_per_msg {cpu / msgs * 1e6:.1f} p50_us {c.get('p50_ns', 0) / 1e3:.0f}")
PY
		done
	done
	exit $rc
fi

if [[ ${1:-} == --in-guest ]]; then
	addr=${RDMASAFE_TEST_ADDR:?}
	n=${CQ_CALLGRIND_N:-200}
	warm=${CQ_CALLGRIND_WARM:-50}
	out=$(mktemp -d)
	trap 'rm -rf "$out"' EXIT
	port=7900
	rc=0
	variants=(rdmasafe rdmasafe_rawcm raw)
	[[ -n ${CQ_TIMES_BEFORE_BIN:-} ]] && variants+=(before before_rawcm)
	for v in "${variants[@]}"; do
		port=$((port + 1))
		p=$bin/cq_pingpong_${v%_rawcm}
		[[ $v == before* ]] && p=$CQ_TIMES_BEFORE_BIN/cq_pingpong_rdmasafe
		cm=()
		[[ $v == *_rawcm ]] && cm=(-C raw)
		"$p" -S -a "$addr" -p "$port" -w pp -m event -n "$n" -W "$warm" -t 300 "${cm[@]}" >"$out/$v.s.out" 2>"$out/$v.s.err" &
		sp=$!
		for ((i = 0; i < 600; i++)); do
			grep -q '^READY' "$out/$v.s.out" 2>/dev/null && break
			sleep 0.02
		done
		# shellcheck disable=SC2086 # CQ_CALLGRIND_OPTS: extra valgrind options, split
		timeout -k 5 600 valgrind --tool=callgrind --collect-atstart=no ${CQ_CALLGRIND_OPTS:-} --callgrind-out-file="$out/$v.cg" \
			"$p" -a "$addr" -p "$port" -w pp -m event -n "$n" -W "$warm" -t 300 "${cm[@]}" \
			>"$out/$v.c.out" 2>"$out/$v.c.err" || { rc=1; tail -n 5 "$out/$v.c.err" >&2; }
		wait "$sp" || { rc=1; tail -n 5 "$out/$v.s.err" >&2; }
		rt=$(sed -n 's/.*"n":\([0-9]*\).*/\1/p' "$out/$v.c.out" | head -n1)
		callgrind_summary "$v" "$out/$v.cg" "$((2 * rt))" completion 3
		callgrind_send "$v" "$out/$v.cg"
	done
	exit $rc
fi

if [[ ${1:-} == --times ]]; then
	# rate and CPU per message, rdmasafe / raw per repeat (times under TCG
	# are noisy: a ratio whose range crosses 1.0 is no measured difference)
	"$repo/tests/bed/vm-run" --timeout 1200 -- env CARGO_TARGET_DIR="$target" bash "$here/cq-callgrind.sh" --times-in-guest |
		tee "$target/bench/cq-times.txt" | python3 -c '
import sys, statistics as st
r = {}
for l in sys.stdin:
    if l.startswith("@@times "):
        _, v, rep, _, rate, _, cpu, _, p50 = l.split()
        r.setdefault(int(rep), {})[v] = (float(rate), float(cpu), float(p50))
        print(l.strip())
for v in ("rdmasafe", "before"):
    rr = [x[v][0] / x["raw"][0] for x in r.values() if v in x and "raw" in x]
    cc = [x[v][1] / x["raw"][1] for x in r.values() if v in x and "raw" in x]
    if rr:
        print(f"{v} / raw per repeat: rate {st.median(rr):.3f} [{min(rr):.3f}-{max(rr):.3f}]x, "
              f"CPU per message {st.median(cc):.3f} [{min(cc):.3f}-{max(cc):.3f}]x")
'
	exit "${PIPESTATUS[0]}"
fi

if [[ ${1:-} != --no-build ]]; then
	cargo build -q --release -p rdmasafe-capi
	make -s -C "$here" LIBDIR="$target/release" OUT="$bin" >&2
fi
callgrind_guest_run cq-callgrind "$here/cq-callgrind.sh" CQ_CALLGRIND_OPTS="${CQ_CALLGRIND_OPTS:-}" \
	CQ_CALLGRIND_N="${CQ_CALLGRIND_N:-200}" CQ_CALLGRIND_WARM="${CQ_CALLGRIND_WARM:-50}"
