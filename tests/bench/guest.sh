#!/usr/bin/env bash
# Guest side of tests/bench/run.sh: runs every benchmark inside ONE
# Soft-RoCE guest (tests/bed/vm-run) and prints machine-readable results,
# one per line:
#   @@ {"case":"...","rep":N,...}
# (the programs' own RESULT lines, tagged; parsed stock-tool output;
# syscall counts from strace; instruction counts from callgrind).
# Progress and diagnostics go to stderr.
#
# Phases:
#   counts   once per variant: strace (system calls inside the measured
#            window, between two getppid() markers), callgrind (user-space
#            instructions inside the window), allocount.so (allocations);
#   times    RDMASAFE_BENCH_REPEATS repeats (default 5); in each repeat the
#            variants of a workload run back to back (rdmasafe, raw, stock;
#            order reversed in every other repeat);
#   load     one long stream (1M sends) per event loop, counts per wakeup;
#   scale    cq_scale under callgrind: instructions per completion with N
#            CQs on one channel, one active (event mode, N up to 4096;
#            busy-poll at two N), one dump per measured window;
#   adaptive the adaptive frontier (issue 14 target 4): p50 and CPU per
#            message of rdmasafe's event, busy-poll, learning and fixed-spin
#            adaptive modes (and the hand-written event and busy loops) on
#            periodic 1 ms pings and Poisson arrivals (mean 200 us, 2 ms),
#            and the receiver's rate of a 64-deep stream (busy-poll,
#            learning, adaptive 50 us); RDMASAFE_BENCH_REPEATS alternated
#            repeats. Runs after times in the full run.
# With RDMASAFE_BENCH_QUICK=1 (smoke run) only one short pass over our
# programs and modes runs instead (no stock tools, strace or callgrind).
#
# Env: RDMASAFE_TEST_ADDR (set by vm-run), RDMASAFE_BENCH_BIN (the programs,
# default <repo>/target/bench), RDMASAFE_BENCH_QUICK=1 (tiny sizes, one
# repeat, no callgrind but for the scale case, no 1M stream),
# RDMASAFE_BENCH_REPEATS, RDMASAFE_BENCH_BEFORE_BIN (optional: the same
# programs built against an earlier librdmasafe; they run as variant
# "before" next to "rdmasafe" and "raw" in the CQ event-mode and CM event
# counts, and in the event-mode ping-pong times), RDMASAFE_BENCH_ONLY=scale
# (only the scale case), =adaptive (only the adaptive frontier), =counts
# (the counts phase only), =cm (only the CM callgrind cases of the counts
# phase: cm_evcost plain and with CM_LIVE live ids on the channel) or
# =storm (only the CM storms of the times phase, with their controls),
# RDMASAFE_BENCH_AD_WEIGHTS (the learning mode's latency weights the
# adaptive section runs beside weight 1, space-separated; unset or empty:
# 16; "none": no weighted mode).
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${RDMASAFE_BENCH_BIN:-$root/target/bench}
ADDR=${RDMASAFE_TEST_ADDR:?RDMASAFE_TEST_ADDR must name the RDMA device address}
DEV=${RDMASAFE_TEST_DEVICE:-rxe0}
GID=${RDMASAFE_TEST_GID_INDEX:-1}
QUICK=${RDMASAFE_BENCH_QUICK:-0}
REPEATS=${RDMASAFE_BENCH_REPEATS:-5}
W=$(mktemp -d "${TMPDIR:-/tmp}/bench.XXXXXX") || exit 1
# LD_PRELOAD splits its list at spaces and colons, with no way to quote:
# the preload libraries are named through links in a folder of /tmp (the
# checkout's path, and so $BIN, may contain spaces)
P=$(mktemp -d /tmp/rdmasafe-preload.XXXXXX) || exit 1
trap 'rm -rf "$W" "$P"' EXIT
ln -s "$BIN/allocount.so" "$P/allocount.so"
ln -s "$BIN/fastclock.so" "$P/fastclock.so"
failures=0
port=7700
BEFORE=${RDMASAFE_BENCH_BEFORE_BIN:-}
ONLY=${RDMASAFE_BENCH_ONLY:-}

# prog NAME VARIANT: the program of a variant (rdmasafe, raw, or before:
# the rdmasafe program built against the earlier library)
prog() {
	if [[ $2 == before ]]; then
		echo "$BEFORE/$1_rdmasafe"
	else
		echo "$BIN/$1_$2"
	fi
}

if [[ $QUICK == 1 ]]; then
	REPEATS=1
	STORM_NS=(10)
	EV_K=50 EV_R=1
	PP_N=20 PP_WARM=5
	RCPP_N=10 SENDLAT_N=20
	IDLE_N=10
	STREAM_N=500
	BIG_N=0
	CALLGRIND=0
	ST_EV_K=50 ST_STORM_N=10 ST_PP_N=50 ST_STREAM_N=1000
	# the CQ loop scale case runs under callgrind in quick mode too (its
	# figures are counts): two CQ counts, short windows
	SCALE_NS=1,64 SCALE_M=32 SCALE_R=1 SCALE_W=4 SCALE_BUSY_NS= SCALE_BUSY_M=
	AD_IDLE_N=10 AD_P200_N=20 AD_P2000_N=10 AD_STREAM_N=500
else
	STORM_NS=(200 1000)
	EV_K=1000 EV_R=3
	PP_N=500 PP_WARM=50
	RCPP_N=300 SENDLAT_N=1000
	IDLE_N=200
	STREAM_N=20000
	BIG_N=1000000
	CALLGRIND=1
	# strace costs milliseconds per call under TCG: small sizes (the
	# counts are per event and do not depend on the size)
	ST_EV_K=100 ST_STORM_N=30 ST_PP_N=100 ST_STREAM_N=1000
	# CQ loop scale (cq_scale, callgrind): windows of M and 2M round trips
	# (M a multiple of cq_scale's send-signal interval, 64), R runs each
	SCALE_NS=1,64,1024,4096 SCALE_M=256 SCALE_R=2 SCALE_W=20
	SCALE_BUSY_NS=1,1024 SCALE_BUSY_M=64
	# adaptive frontier: round trips (messages for the stream) per case.
	# 30 runs per repeat; each spends ~2-3 s in process start, connect and
	# teardown, more than in its measured window (~1-4 s: on a loaded host
	# round trips are ~4 ms once a side sleeps, so Poisson 200 us is then
	# mostly back to back). With 5 repeats the section took 509 s of guest
	# time on the shared 2-core host (2026-12-01, other guests running in
	# 41 of 104 samples), and more than 1,180 s with 3 other guests.
	AD_IDLE_N=200 AD_P200_N=500 AD_P2000_N=150 AD_STREAM_N=10000
	# CM per-event cost against live ids on the channel (callgrind)
	CM_LIVE=(10 100 1000 10000)
fi

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
t_start=$(now_ms)
say() { echo "[bench $(($(now_ms) - t_start)) ms] $*" >&2; }
next_port() { port=$((port + 1)); }

# json_str STRING: a JSON string literal (enough for our plain values)
json_str() {
	local s=${1//\\/\\\\}
	s=${s//\"/\\\"}
	printf '"%s"' "$s"
}

# emit CASE REP FILE...: the RESULT lines of FILEs, tagged
emit() {
	local case=$1 rep=$2
	shift 2
	sed -n "s/^RESULT {/@@ {\"case\":\"$case\",\"rep\":$rep,/p" "$@"
	sed -n "s/^CPURUN \\([a-z_]*\\) {/@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"cpurun\",\"role\":\"\\1\",/p" "$@"
}

fail() {
	local case=$1 rep=$2 what=$3
	failures=$((failures + 1))
	echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"error\",\"error\":$(json_str "$what")}"
	say "FAILED $case rep $rep: $what"
	for f in "$W"/*.err; do
		[[ -s $f ]] && { echo "--- $f" >&2; tail -n 5 "$f" >&2; }
	done
}

# wait_ready FILE PID: until FILE has a READY line (our servers)
wait_ready() {
	local i
	for ((i = 0; i < 600; i++)); do
		grep -q '^READY' "$1" 2>/dev/null && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.02
	done
	return 1
}

# wait_cm_listen PORT PID: until a LISTEN cm_id on PORT exists (cmtime)
wait_cm_listen() {
	local i
	for ((i = 0; i < 300; i++)); do
		rdma res show cm_id 2>/dev/null | grep -Eq "state LISTEN .*src-addr [^ ]*:$1( |$)" && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

# wait_tcp_listen PORT PID: until a TCP listener on PORT exists (perftest, ibv_*)
wait_tcp_listen() {
	local i
	for ((i = 0; i < 300; i++)); do
		ss -ltnH "sport = :$1" 2>/dev/null | grep -q . && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

# kill_tree PID: the process PID and its direct children (ours only)
kill_tree() {
	local pid=$1 kids
	kids=$(cat "/proc/$pid/task/$pid/children" 2>/dev/null)
	# shellcheck disable=SC2086
	kill $kids "$pid" 2>/dev/null
}

# syscalls FILE: {"name":count,...} of the calls inside getppid() windows
syscall_counts() {
	# prints {all threads},"thread":{the marker thread's own}: the JSON of
	# the "counts" key and a "thread" key after it
	awk '
		/ getppid\(\)/ { inwin = !inwin; split($0, f, / +/); marker = f[1]; next }
		inwin && !/resumed>/ && !/^[0-9]+ +(\+\+\+|---)/ {
			line = $0
			pid = line; sub(/ .*/, "", pid)
			sub(/^[0-9]+ +/, "", line)
			if (match(line, /^[a-z_0-9]+\(/)) {
				n = substr(line, 1, RLENGTH - 1); cnt[n]++
				if (pid == marker) own[n]++
			}
		}
		END {
			printf "{"; sep = ""; for (k in cnt) { printf "%s\"%s\":%d", sep, k, cnt[k]; sep = "," }
			printf "},\"thread\":{"; sep = ""; for (k in own) { printf "%s\"%s\":%d", sep, k, own[k]; sep = "," }
			printf "}"
		}
	' "$1"
}

# callgrind_fn_sums, callgrind_ir
# shellcheck source=tests/bench/callgrind-lib.sh
. "$root/tests/bench/callgrind-lib.sh"

# callgrind_top FILE: the 20 functions with the most instructions of their
# own (exclusive Ir), as a JSON list of [Ir, "function"]
callgrind_top() {
	callgrind_fn_sums "$1" | sort -t "$(printf '\t')" -k1,1nr | head -n 20 |
		awk -F '\t' '{ gsub(/\\/, "\\\\", $2); gsub(/"/, "\\\"", $2); printf "%s[%s,\"%s\"]", (NR > 1 ? "," : ""), $1, $2 }'
}

# callgrind_excl FILE K: the K functions with the most instructions of
# their own in one callgrind output file, as callgrind_top prints them,
# read from the file itself: callgrind_annotate (3.19) counts the cost of
# a call that was in progress across a dump (a "calls=0" line) as the
# caller's own, which makes every dump after the first useless to it.
# Names of functions without symbols get their object's name
# ("librxe-rdmav34.so:0x...3cc0").
callgrind_excl() {
	awk -v k="$2" '
		function nm(kind, s,   id, rest) {
			# "(id) name" defines, "(id)" refers, "name" is plain
			if (s ~ /^\([0-9]+\)/) {
				id = s; sub(/\).*/, "", id); sub(/^\(/, "", id)
				rest = s; sub(/^\([0-9]+\) ?/, "", rest)
				if (rest != "") names[kind, id] = rest
				return names[kind, id]
			}
			return s
		}
		/^(ob|cob)=/ { v = substr($0, index($0, "=") + 1); o = nm("ob", v); if ($0 ~ /^ob=/) ob = o; next }
		/^(fl|fi|fe|cfi|cfl)=/ { nm("fl", substr($0, index($0, "=") + 1)); next }
		/^(fn|cfn)=/ {
			v = nm("fn", substr($0, index($0, "=") + 1))
			if ($0 ~ /^fn=/) { fn = v; if (fn ~ /^0x/) { b = ob; sub(/.*\//, "", b); fn = b ":" fn } }
			next
		}
		/^calls=/ { skip = 1; next }
		/^[0-9+*-]/ { if (skip) { skip = 0; next } if (NF >= 2) cost[fn] += $2; next }
		END { for (f in cost) if (cost[f] > 0) printf "%d\t%s\n", cost[f], f }' "$1" |
		sort -t "$(printf '\t')" -k1,1nr | head -n "$2" |
		awk -F '\t' '{ gsub(/\\/, "\\\\", $2); gsub(/"/, "\\\"", $2); printf "%s[%s,\"%s\"]", (NR > 1 ? "," : ""), $1, $2 }'
}

# callgrind_dumps CASE REP: one record per dump file of a run whose
# program dumped once per window (CALLGRIND_DUMP_STATS_AT(label))
callgrind_dumps() {
	local case=$1 rep=$2 f label
	for f in "$W"/cg.log.*; do
		[[ -s $f ]] || continue
		label=$(sed -n 's/^desc: Trigger: Client Request: //p' "$f")
		echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"callgrind_dump\",\"role\":\"client\",\"label\":$(json_str "$label"),\"ir\":$(callgrind_ir "$f"),\"top\":[$(callgrind_excl "$f" 60)]}"
	done
}

# ---- our client/server pairs --------------------------------------------
# S=(server command) C=(client command) run_pair CASE REP [KIND]
# KIND: "" (plain), strace (client under strace), strace_server (server under
# strace), callgrind (client under callgrind), callgrind_dumps (the same, one
# record per window the program dumped), allocs (both with allocount.so)
run_pair() {
	local case=$1 rep=$2 kind=${3:-} sp crc src pre=() t0
	t0=$(now_ms)
	rm -f "$W"/*.out "$W"/*.err "$W"/st.log "$W"/cg.log*
	[[ $kind == allocs ]] && pre=(env "LD_PRELOAD=$P/allocount.so")
	[[ $kind == fastclock ]] && pre=(env "LD_PRELOAD=$P/fastclock.so")
	if [[ $kind == strace_server ]]; then
		strace -f -o "$W/st.log" "${S[@]}" >"$W/s.out" 2>"$W/s.err" &
	else
		"${pre[@]}" "${S[@]}" >"$W/s.out" 2>"$W/s.err" &
	fi
	sp=$!
	if ! wait_ready "$W/s.out" "$sp"; then
		kill "$sp" 2>/dev/null
		wait "$sp" 2>/dev/null
		fail "$case" "$rep" "server did not get ready"
		return 1
	fi
	case $kind in
	strace) timeout -k 5 600 strace -f -o "$W/st.log" "${C[@]}" >"$W/c.out" 2>"$W/c.err" ;;
	callgrind | callgrind_dumps)
		timeout -k 5 600 valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file="$W/cg.log" \
			"${C[@]}" >"$W/c.out" 2>"$W/c.err"
		;;
	*) timeout -k 5 600 "${pre[@]}" "${C[@]}" >"$W/c.out" 2>"$W/c.err" ;;
	esac
	crc=$?
	if [[ $crc -ne 0 ]]; then
		# the server may wait for a peer that is gone: its alarm ends it,
		# but do not wait that long
		sleep 1
		kill "$sp" 2>/dev/null
	fi
	wait "$sp"
	src=$?
	emit "$case" "$rep" "$W/s.out" "$W/c.out"
	if [[ ($kind == strace || $kind == strace_server) && -s $W/st.log ]]; then
		local role=client
		[[ $kind == strace_server ]] && role=server
		echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"syscalls\",\"role\":\"$role\",\"counts\":$(syscall_counts "$W/st.log")}"
	fi
	if [[ $kind == callgrind && -s $W/cg.log ]]; then
		echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"callgrind\",\"role\":\"client\",\"ir\":$(callgrind_ir "$W/cg.log"),\"top\":[$(callgrind_top "$W/cg.log")]}"
	fi
	[[ $kind == callgrind_dumps ]] && callgrind_dumps "$case" "$rep"
	say "$case rep $rep: $(($(now_ms) - t0)) ms"
	if [[ $crc -ne 0 || $src -ne 0 ]]; then
		fail "$case" "$rep" "exit status client $crc, server $src"
		return 1
	fi
	return 0
}

# single CASE REP [KIND] with C=(command): one process (cm_evcost)
run_single() {
	local case=$1 rep=$2 kind=${3:-} rc t0
	t0=$(now_ms)
	rm -f "$W"/*.out "$W"/*.err "$W"/st.log "$W"/cg.log
	case $kind in
	strace) timeout -k 5 600 strace -f -o "$W/st.log" "${C[@]}" >"$W/c.out" 2>"$W/c.err" ;;
	callgrind)
		timeout -k 5 600 valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file="$W/cg.log" \
			"${C[@]}" >"$W/c.out" 2>"$W/c.err"
		;;
	allocs) timeout -k 5 600 env "LD_PRELOAD=$P/allocount.so" "${C[@]}" >"$W/c.out" 2>"$W/c.err" ;;
	*) timeout -k 5 600 "${C[@]}" >"$W/c.out" 2>"$W/c.err" ;;
	esac
	rc=$?
	say "$case rep $rep: $(($(now_ms) - t0)) ms"
	emit "$case" "$rep" "$W/c.out"
	[[ $kind == strace && -s $W/st.log ]] &&
		echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"syscalls\",\"role\":\"client\",\"counts\":$(syscall_counts "$W/st.log")}"
	[[ $kind == callgrind && -s $W/cg.log ]] &&
		echo "@@ {\"case\":\"$case\",\"rep\":$rep,\"kind\":\"callgrind\",\"role\":\"client\",\"ir\":$(callgrind_ir "$W/cg.log"),\"top\":[$(callgrind_top "$W/cg.log")]}"
	[[ $rc -eq 0 ]] || { fail "$case" "$rep" "exit status $rc"; return 1; }
}

# ---- the workloads -------------------------------------------------------
storm() { # VARIANT N REP [KIND] (KIND thread: -T, one more idle thread per process)
	local v=$1 n=$2 rep=$3 kind=${4:-} t=()
	next_port
	[[ $kind == thread ]] && t=(-T)
	S=("$(prog cm_storm "$v")" -S -a "$ADDR" -p "$port" -c "$n" -t 300 "${t[@]}")
	C=("$(prog cm_storm "$v")" -a "$ADDR" -p "$port" -c "$n" -t 300 "${t[@]}")
	run_pair "storm_${v}_$n${kind:+_$kind}" "$rep" "$kind"
}

storm_cmtime() { # N REP
	local n=$1 rep=$2 case="storm_cmtime_$1" sp crc
	next_port
	rm -f "$W"/*.out "$W"/*.err
	"$BIN/cpurun" server cmtime -b "$ADDR" -c "$n" -p "$port" >"$W/s.out" 2>"$W/s.err" &
	sp=$!
	if ! wait_cm_listen "$port" "$sp"; then
		kill_tree "$sp"
		wait "$sp" 2>/dev/null
		fail "$case" "$rep" "cmtime server did not listen"
		return 1
	fi
	timeout -k 5 300 "$BIN/cpurun" client cmtime -s "$ADDR" -c "$n" -p "$port" >"$W/c.out" 2>"$W/c.err"
	crc=$?
	kill_tree "$sp"
	wait "$sp" 2>/dev/null
	emit "$case" "$rep" "$W/s.err" "$W/c.err"
	awk -v c="$case" -v r="$rep" -v n="$n" -F: '
		NF >= 2 && $1 ~ /^(create id|resolve addr|resolve route|create qp|connect|disconnect|destroy)/ {
			name = $1; gsub(/ +$/, "", name); gsub(/ /, "_", name); if (name == "destroy_id") name = "destroy"
			split($2, f, " "); ms[name] = f[1]; total += f[1]; order[++k] = name
		}
		END {
			printf "@@ {\"case\":\"%s\",\"rep\":%s,\"variant\":\"cmtime\",\"role\":\"client\",\"conns\":%s,\"total_ms\":%s", c, r, n, total
			for (i = 1; i <= k; i++) printf ",\"ms_%s\":%s", order[i], ms[order[i]]
			printf "}\n"
		}' "$W/c.out"
	[[ $crc -eq 0 ]] || { fail "$case" "$rep" "cmtime client exit $crc"; return 1; }
}

evcost() { # VARIANT REP [KIND] [K] [ROUNDS] [LIVE_IDS]
	local v=$1 rep=$2 kind=${3:-} k=${4:-$EV_K} r=${5:-$EV_R} l=${6:-}
	C=("$(prog cm_evcost "$v")" -a "$ADDR" -k "$k" -r "$r" -w 1 ${l:+-l "$l"} ${EV_THREAD:+-T})
	run_single "evcost_$v${kind:+_$kind}${l:+_l$l}${EV_TAG:-}" "$rep" "$kind"
}

# CM per-event instructions (callgrind) with L more live ids on the
# measured channel (issue 14 target 5, CM half); and the plain case
cm_callgrind() {
	local v l
	for v in rdmasafe raw; do
		evcost "$v" 0 callgrind 300 2
		for l in "${CM_LIVE[@]}"; do
			evcost "$v" 0 callgrind 300 2 "$l"
		done
	done
	# diagnostic: the ack deadline off (every original acked at the get; no
	# ack-deadline thread, so glibc stays on its single-thread paths)
	EV_TAG=_deadline0 RDMASAFE_ACK_DEADLINE_MS=0 evcost rdmasafe 0 callgrind 300 2
	# diagnostic: raw in a process with one more (idle) thread, glibc on its
	# multi-threaded paths as in rdmasafe's program (its ack-deadline thread)
	# and in every program that has threads anyway
	EV_TAG=_thread EV_THREAD=1 evcost raw 0 callgrind 300 2
}

pp() { # VARIANT MODE WORKLOAD N REP [KIND] [EXTRA...]
	local v=$1 m=$2 w=$3 n=$4 rep=$5 kind=${6:-}
	shift 6 2>/dev/null || shift $#
	local extra=("$@") tag=""
	[[ $kind == _ ]] && kind=
	[[ ${#extra[@]} -gt 0 ]] && tag=_$(printf '%s' "${extra[*]}" | tr -d ' -')
	next_port
	S=("$(prog cq_pingpong "$v")" -S -a "$ADDR" -p "$port" -w "$w" -m "$m" -n "$n" -W "$PP_WARM" -t 300 "${extra[@]}")
	C=("$(prog cq_pingpong "$v")" -a "$ADDR" -p "$port" -w "$w" -m "$m" -n "$n" -W "$PP_WARM" -t 300 "${extra[@]}")
	run_pair "${w}_${v}_$m$tag${kind:+_$kind}" "$rep" "$kind"
}

# adapt VARIANT MODE WORKLOAD ARG N REP: one case of the adaptive frontier.
# MODE: event, busy, learn, learnK (learning with latency weight K) or
# spinUS (adaptive, fixed spin of US microseconds); ARG: -i (idle, poisson: the interval or mean gap, us) or
# -q (stream: the window). Poisson gaps are seeded with the repeat number:
# every mode of a repeat sees the same arrival times.
adapt() {
	local v=$1 m=$2 w=$3 arg=$4 n=$5 rep=$6 opt=()
	next_port
	if [[ $w == stream ]]; then opt=(-q "$arg"); else opt=(-i "$arg" -r "$rep"); fi
	if [[ $m == spin* ]]; then
		opt+=(-m adaptive -A "${m#spin}")
	elif [[ $m == learn?* ]]; then
		opt+=(-m learn -L "${m#learn}")
	else
		opt+=(-m "$m")
	fi
	S=("$(prog cq_pingpong "$v")" -S -a "$ADDR" -p "$port" -w "$w" -n "$n" -W "$PP_WARM" -t 300 "${opt[@]}")
	C=("$(prog cq_pingpong "$v")" -a "$ADDR" -p "$port" -w "$w" -n "$n" -W "$PP_WARM" -t 300 "${opt[@]}")
	run_pair "adapt_${w}${arg}_${v}_$m" "$rep"
}

scale() { # VARIANT MODE NS M RUNS WARM  (cq_scale under callgrind, one dump per window)
	local v=$1 m=$2 ns=$3 len=$4 runs=$5 warm=$6
	next_port
	S=("$BIN/cq_scale_$v" -S -a "$ADDR" -p "$port" -t 900)
	C=("$BIN/cq_scale_$v" -a "$ADDR" -p "$port" -m "$m" -N "$ns" -M "$len" -R "$runs" -W "$warm" -t 900)
	run_pair "scale_${v}_$m" 0 callgrind_dumps
}

rc_pingpong() { # N REP  (stock ibv_rc_pingpong -e, event mode)
	local n=$1 rep=$2 case=pp_stock_rcpp_event sp crc
	next_port
	rm -f "$W"/*.out "$W"/*.err
	"$BIN/cpurun" server timeout -k 5 300 ibv_rc_pingpong -d "$DEV" -g "$GID" -e -n "$n" -s 64 -p "$port" >"$W/s.out" 2>"$W/s.err" &
	sp=$!
	if ! wait_tcp_listen "$port" "$sp"; then
		kill_tree "$sp"
		wait "$sp" 2>/dev/null
		fail "$case" "$rep" "ibv_rc_pingpong server did not listen"
		return 1
	fi
	"$BIN/cpurun" client timeout -k 5 300 ibv_rc_pingpong -d "$DEV" -g "$GID" -e -n "$n" -s 64 -p "$port" "$ADDR" >"$W/c.out" 2>"$W/c.err"
	crc=$?
	wait "$sp"
	emit "$case" "$rep" "$W/s.err" "$W/c.err"
	awk -v c="$case" -v r="$rep" '/iters in/ {
		printf "@@ {\"case\":\"%s\",\"rep\":%s,\"variant\":\"stock\",\"role\":\"client\",\"iters\":%s,\"seconds\":%s,\"usec_per_iter\":%s}\n", c, r, $1, $4, $7 }' "$W/c.out"
	[[ $crc -eq 0 ]] || { fail "$case" "$rep" "ibv_rc_pingpong client exit $crc"; return 1; }
}

send_lat() { # N REP  (stock ib_send_lat, busy polling)
	local n=$1 rep=$2 case=pp_stock_sendlat_busy sp crc
	next_port
	rm -f "$W"/*.out "$W"/*.err
	"$BIN/cpurun" server timeout -k 5 300 ib_send_lat -d "$DEV" -x "$GID" -n "$n" -s 64 -F -p "$port" >"$W/s.out" 2>"$W/s.err" &
	sp=$!
	if ! wait_tcp_listen "$port" "$sp"; then
		kill_tree "$sp"
		wait "$sp" 2>/dev/null
		fail "$case" "$rep" "ib_send_lat server did not listen"
		return 1
	fi
	"$BIN/cpurun" client timeout -k 5 300 ib_send_lat -d "$DEV" -x "$GID" -n "$n" -s 64 -F -p "$port" "$ADDR" >"$W/c.out" 2>"$W/c.err"
	crc=$?
	wait "$sp"
	emit "$case" "$rep" "$W/s.err" "$W/c.err"
	awk -v c="$case" -v r="$rep" 'hdr && NF >= 9 {
		printf "@@ {\"case\":\"%s\",\"rep\":%s,\"variant\":\"stock\",\"role\":\"client\",\"iters\":%s,\"t_min_us\":%s,\"t_typical_us\":%s,\"t_avg_us\":%s,\"p99_us\":%s}\n", c, r, $2, $3, $5, $6, $8
		exit }
		/#bytes/ { hdr = 1 }' "$W/c.out"
	[[ $crc -eq 0 ]] || { fail "$case" "$rep" "ib_send_lat client exit $crc"; return 1; }
}

# runs the commands given as arguments in order, or reversed for even reps
alternate() { # REP CMD1 CMD2 ...  (each CMD one string, word-split)
	local rep=$1 i
	shift
	local cmds=("$@")
	if ((rep % 2 == 0)); then
		for ((i = ${#cmds[@]} - 1; i >= 0; i--)); do ${cmds[i]}; done
	else
		for ((i = 0; i < ${#cmds[@]}; i++)); do ${cmds[i]}; done
	fi
}

section() {
	local now
	now=$(now_ms)
	if [[ -n ${sec_name:-} ]]; then
		echo "@@ {\"kind\":\"section\",\"name\":\"$sec_name\",\"seconds\":$(((now - sec_t0) / 1000)).$((((now - sec_t0) % 1000) / 100))}"
	fi
	sec_name=${1:-}
	sec_t0=$now
	[[ -n $sec_name ]] && say "---- $sec_name"
}

# ---- machine ---------------------------------------------------------------
if [[ -z ${RDMASAFE_BENCH_QUICK_PART:-} ]]; then
	cpu_model=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
	echo "@@ {\"kind\":\"machine\",\"nproc\":$(nproc),\"cpu\":$(json_str "$cpu_model"),\"kernel\":$(json_str "$(uname -r)"),\"clocksource\":$(json_str "$(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"),\"mem_mb\":$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024)),\"quick\":$QUICK,\"only\":$(json_str "${RDMASAFE_BENCH_ONLY:-}"),\"repeats\":$REPEATS,\"device\":$(json_str "$DEV")}"
	say "machine: $(nproc) vCPU, $cpu_model, $(uname -r), quick=$QUICK repeats=$REPEATS"
fi

# ---- quick (smoke) run: every program and mode once, tiny sizes ----------
# Two halves run at the same time (timing does not matter here), each in
# its own guest.sh with its own ports and files; this shell merges them.
if [[ $QUICK == 1 ]]; then
	case ${RDMASAFE_BENCH_QUICK_PART:-} in
	a)
		port=7800
		storm rdmasafe "${STORM_NS[0]}" 1
		evcost rdmasafe 1 "" "$EV_K" "$EV_R"
		pp rdmasafe event pp "$PP_N" 1
		pp rdmasafe busy pp "$PP_N" 1
		pp rdmasafe adaptive pp "$PP_N" 1
		pp rdmasafe event stream "$STREAM_N" 1
		;;
	b)
		port=7900
		storm raw "${STORM_NS[0]}" 1
		evcost raw 1 "" "$EV_K" "$EV_R"
		pp raw event pp "$PP_N" 1
		pp raw busy pp "$PP_N" 1
		pp raw event stream "$STREAM_N" 1
		pp rdmasafe adaptive idle "$IDLE_N" 1
		adapt rdmasafe learn idle 1000 "$AD_IDLE_N" 1
		adapt rdmasafe learn16 idle 1000 "$AD_IDLE_N" 1
		adapt rdmasafe spin200 poisson 200 "$AD_P200_N" 1
		adapt raw event poisson 2000 "$AD_P2000_N" 1
		adapt rdmasafe learn stream 64 "$AD_STREAM_N" 1
		evcost rdmasafe 0 allocs "$ST_EV_K" 1
		scale rdmasafe event "$SCALE_NS" "$SCALE_M" "$SCALE_R" "$SCALE_W"
		;;
	*)
		section quick
		RDMASAFE_BENCH_QUICK_PART=a bash "${BASH_SOURCE[0]}" >"$W/part-a" &
		pa=$!
		RDMASAFE_BENCH_QUICK_PART=b bash "${BASH_SOURCE[0]}" >"$W/part-b" &
		pb=$!
		wait "$pa" || true
		wait "$pb" || true
		grep -hv '"kind":"\(summary\|machine\)"' "$W/part-a" "$W/part-b"
		failures=$(cat "$W/part-a" "$W/part-b" | sed -n 's/.*"kind":"summary","failures":\([0-9]*\).*/\1/p' |
			awk '{ s += $1 } END { print s + 0 }')
		section
		;;
	esac
	say "done: $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

# ---- scale (CQ loop with N CQs on one channel, callgrind) ----------------
scale_section() {
	section scale
	for v in rdmasafe raw; do
		scale "$v" event "$SCALE_NS" "$SCALE_M" "$SCALE_R" "$SCALE_W"
	done
	for v in rdmasafe raw; do
		scale "$v" busy "$SCALE_BUSY_NS" "$SCALE_BUSY_M" 1 "$SCALE_W"
	done
}
# ---- adaptive frontier (issue 14 target 4) -------------------------------
AD_SPINS=(20 50 200 1000)
# learning mode's latency weights beside the default 1 (run.sh passes
# RDMASAFE_BENCH_AD_WEIGHTS through; word-split on purpose)
# shellcheck disable=SC2206
AD_WEIGHTS=(${RDMASAFE_BENCH_AD_WEIGHTS:-16})
[[ ${RDMASAFE_BENCH_AD_WEIGHTS:-} != none ]] || AD_WEIGHTS=()
adaptive_section() {
	local rep w arg n m cmds
	section adaptive
	for ((rep = 1; rep <= REPEATS; rep++)); do
		say "adaptive: repeat $rep of $REPEATS"
		for w in idle:1000:$AD_IDLE_N poisson:200:$AD_P200_N poisson:2000:$AD_P2000_N; do
			IFS=: read -r w arg n <<<"$w"
			cmds=()
			for m in event busy learn "${AD_WEIGHTS[@]/#/learn}" "${AD_SPINS[@]/#/spin}"; do
				cmds+=("adapt rdmasafe $m $w $arg $n $rep")
			done
			cmds+=("adapt raw event $w $arg $n $rep" "adapt raw busy $w $arg $n $rep")
			alternate "$rep" "${cmds[@]}"
		done
		cmds=()
		for m in busy learn "${AD_WEIGHTS[@]/#/learn}" spin50; do
			cmds+=("adapt rdmasafe $m stream 64 $AD_STREAM_N $rep")
		done
		alternate "$rep" "${cmds[@]}"
	done
}
if [[ ${RDMASAFE_BENCH_ONLY:-} == adaptive ]]; then
	adaptive_section
	section
	say "done: $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

if [[ ${RDMASAFE_BENCH_ONLY:-} == scale ]]; then
	scale_section
	section
	say "done: $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

# ---- cm only (RDMASAFE_BENCH_ONLY=cm): the CM callgrind cases ------------
if [[ ${RDMASAFE_BENCH_ONLY:-} == cm ]]; then
	section counts
	cm_callgrind
	section
	say "done (cm only): $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

# storm_repeat REP: the CM storms of one repeat, every N
storm_repeat() {
	local n
	for n in "${STORM_NS[@]}"; do
		# "storm raw ... aa": raw against raw, the A/A control that shows
		# the noise floor of the rdmasafe / raw ratio; "... thread": raw
		# with one more idle thread per process (-T), rdmasafe's threading
		# state (its ack-deadline thread)
		alternate "$1" "storm rdmasafe $n $1" "storm raw $n $1" "storm_cmtime $n $1" "storm raw $n $1 aa" \
			"storm raw $n $1 thread"
	done
}

# ---- storm only (RDMASAFE_BENCH_ONLY=storm): the CM storms' repeats -------
if [[ ${RDMASAFE_BENCH_ONLY:-} == storm ]]; then
	section times
	for ((rep = 1; rep <= REPEATS; rep++)); do
		say "repeat $rep of $REPEATS"
		storm_repeat "$rep"
	done
	section
	say "done (storm only): $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

# ---- counts ----------------------------------------------------------------
section counts
for v in rdmasafe raw; do
	evcost "$v" 0 strace "$ST_EV_K" 1
	evcost "$v" 0 allocs "$EV_K" 2
	storm "$v" "$ST_STORM_N" 0 strace
	storm "$v" "$ST_STORM_N" 0 allocs
done
for vm in rdmasafe:event rdmasafe:busy rdmasafe:adaptive rdmasafe:learn raw:event raw:busy; do
	pp "${vm%%:*}" "${vm##*:}" pp "$ST_PP_N" 0 strace
	pp "${vm%%:*}" "${vm##*:}" pp "$ST_PP_N" 0 allocs
done
for v in rdmasafe raw; do
	pp "$v" event stream "$ST_STREAM_N" 0 strace
	# the receiver: wakeups under load, whose CQ event is often pending
	pp "$v" event stream "$ST_STREAM_N" 0 strace_server
done
if [[ $CALLGRIND == 1 ]]; then
	cm_callgrind
	for v in rdmasafe raw; do
		pp "$v" event pp 200 0 callgrind
	done
	# the rdmasafe program connected through raw librdmacm: no CM
	# ack-deadline thread, so glibc stays on its single-thread paths as in
	# the raw program, and the two differ in the CQ loop alone
	pp rdmasafe event pp 200 0 callgrind -C raw
fi
if [[ -n $BEFORE ]]; then
	# the earlier library, same programs: before/after side by side
	evcost before 0 strace "$ST_EV_K" 1
	pp before event pp "$ST_PP_N" 0 strace
	pp before event stream "$ST_STREAM_N" 0 strace_server
fi
# untraced stream: the receiver's own figures of how it waited (sleeps,
# channel reads, EAGAIN reads per wakeup)
for v in rdmasafe raw; do
	pp "$v" event stream "$STREAM_N" 0 loopstats
done
if [[ -n $BEFORE ]]; then
	if [[ $CALLGRIND == 1 ]]; then
		evcost before 0 callgrind 300 2
		pp before event pp 200 0 callgrind
	fi
fi
if [[ $ONLY == counts ]]; then
	section
	say "done (counts only): $failures failed"
	echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
	[[ $failures -eq 0 ]]
	exit
fi

# ---- times (alternated repeats) --------------------------------------------
section times
for ((rep = 1; rep <= REPEATS; rep++)); do
	say "repeat $rep of $REPEATS"
	storm_repeat "$rep"
	alternate "$rep" "evcost rdmasafe $rep" "evcost raw $rep"
	before_pp=()
	[[ -n $BEFORE ]] && before_pp=("pp before event pp $PP_N $rep")
	alternate "$rep" \
		"pp rdmasafe event pp $PP_N $rep" "pp raw event pp $PP_N $rep" "${before_pp[@]}" \
		"pp rdmasafe busy pp $PP_N $rep" "pp raw busy pp $PP_N $rep" \
		"pp rdmasafe adaptive pp $PP_N $rep" \
		"rc_pingpong $RCPP_N $rep" "send_lat $SENDLAT_N $rep"
	alternate "$rep" \
		"pp rdmasafe event pp $PP_N $rep fastclock" "pp raw event pp $PP_N $rep fastclock" \
		"pp rdmasafe busy pp $PP_N $rep fastclock" "pp raw busy pp $PP_N $rep fastclock"
	alternate "$rep" \
		"pp rdmasafe busy idle $IDLE_N $rep" "pp rdmasafe adaptive idle $IDLE_N $rep" \
		"pp raw busy idle $IDLE_N $rep" "pp raw event idle $IDLE_N $rep" \
		"pp rdmasafe event idle $IDLE_N $rep" \
		"pp rdmasafe adaptive idle $IDLE_N $rep _ -A 2000"
	alternate "$rep" \
		"pp rdmasafe event stream $STREAM_N $rep" "pp raw event stream $STREAM_N $rep" \
		"pp rdmasafe event stream $STREAM_N $rep fastclock" "pp raw event stream $STREAM_N $rep fastclock"
done
adaptive_section

# ---- load ------------------------------------------------------------------
if ((BIG_N > 0)); then
	section load
	pp rdmasafe event stream "$BIG_N" 0 big
	pp raw event stream "$BIG_N" 0 big
fi
scale_section
section

say "done: $failures failed"
echo "@@ {\"kind\":\"summary\",\"failures\":$failures,\"seconds\":$((($(now_ms) - t_start) / 1000))}"
[[ $failures -eq 0 ]]
