#!/usr/bin/env bash
# Runs the fault cases inside the Soft-RoCE guests (tests/bed/vm-run for one
# guest, tests/bed/vm-run2 for two). Every program's output is printed as
#   ==== BEGIN <label>
#   ...
#   ==== END <label> exit <status>
# and, per case, "==== CASE <case> <n> failed" (n = programs whose exit
# status was not the expected one). Exit status 0 only if n is 0 for every
# case run. rdmasafe-capi/tests/faults.rs parses this.
#
#   guest.sh one CASE...         one guest; CASE: prockill overrun devremove
#                                storm leaks (devremove deletes rxe0: last)
#   guest.sh hostkill a|b        two guests: a survives, b's host is killed
#   guest.sh linkflap a|b        two guests: a's link goes down and up
#
# Env: RDMASAFE_TEST_ADDR (own address), RDMASAFE_PEER_ADDR and
# RDMASAFE_SHARED (two guests), RDMASAFE_FAULTS_BIN (default
# <repo>/target/faults), RDMASAFE_FAULTS_LEAK_CYCLES (default 100),
# RDMASAFE_FAULTS_LEAK_MESSAGES (round trips per cycle, default 25),
# RDMASAFE_FAULTS_VALGRIND_OPTS (extra valgrind options),
# RDMASAFE_FAULTS_TRAFFIC_S (hostkill, prockill, linkflap: seconds of
# traffic between "traffic flowing" and the fault, default 0; more makes
# the programs account for hundreds of completions before the first
# error, as a slow, loaded machine does),
# RDMASAFE_FAULTS_LINK_DOWN_S (link flap: seconds down at least, default
# 5; the link stays down until the survivor has seen the error, at most
# RDMASAFE_FAULTS_LINK_DOWN_MAX_S, default 60),
# RDMASAFE_FAULTS_LINKFLAP_SECS (link flap survivor's limit, default 150).
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${RDMASAFE_FAULTS_BIN:-$root/target/faults}
addr=${RDMASAFE_TEST_ADDR:?RDMASAFE_TEST_ADDR must name the RDMA device address}
netdev=${RDMASAFE_TEST_NETDEV:-dummy0}
traffic_s=${RDMASAFE_FAULTS_TRAFFIC_S:-0}
logs=$(mktemp -d "${TMPDIR:-/tmp}/rdmasafe-faults.XXXXXX") || exit 1
trap 'rm -rf "$logs"' EXIT
declare -A pid_of
failed_total=0
failed=0

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
t_start=$(now_ms)
say() { echo "# [$(($(now_ms) - t_start)) ms] $*"; }
# /proc/uptime: the clock (CLOCK_BOOTTIME) the programs compare stamps with
stamp() { read -r up _ </proc/uptime; echo "$up" >"$1"; }

start() {   # start LABEL CMD ARGS...: in the background, output to a log
	local label=$1
	shift
	"$@" >"$logs/$label.out" 2>&1 &
	pid_of[$label]=$!
}

start_killable() {   # like start, for a program the case will SIGKILL
	local label=$1
	shift
	# its pid in a file; the subshell, not this script, reaps it (bash
	# would print a "Killed" notice)
	( "$@" >"$logs/$label.out" 2>&1 &
	  echo $! >"$logs/$label.pid"
	  wait $! ) 2>/dev/null &
	pid_of[$label]=$!
	while [[ ! -s $logs/$label.pid ]]; do sleep 0.01; done
}

kill_program() {   # kill_program LABEL: SIGKILL a program started by start_killable
	kill -KILL "$(<"$logs/$1.pid")"
}

finish() {   # finish LABEL [WANT_STATUS]: wait for it, print its block
	local label=$1 want=${2:-0} rc=0
	wait "${pid_of[$label]}" || rc=$?
	echo "==== BEGIN $label"
	cat "$logs/$label.out"
	echo "==== END $label exit $rc"
	[[ $rc -eq $want ]] || failed=$((failed + 1))
}

run() {   # run LABEL CMD ARGS...: in the foreground
	start "$@"
	finish "$1"
}

wait_line() {   # wait_line LABEL PATTERN SECS: until LABEL's log has it
	local label=$1 pattern=$2 secs=$3 i
	for ((i = 0; i < secs * 20; i++)); do
		grep -q -- "$pattern" "$logs/$label.out" 2>/dev/null && return 0
		kill -0 "${pid_of[$label]}" 2>/dev/null || break
		sleep 0.05
	done
	grep -q -- "$pattern" "$logs/$label.out" 2>/dev/null && return 0
	say "$label: no line '$pattern' within $secs s"
	return 1
}

wait_file() {   # wait_file FILE SECS
	local i
	for ((i = 0; i < $2 * 20; i++)); do
		[[ -e $1 ]] && return 0
		sleep 0.05
	done
	say "no $1 within $2 s"
	return 1
}

wait_listen() {   # wait_listen PORT LABEL: a LISTEN cm_id on PORT (one guest)
	local port=$1 label=$2 i
	for ((i = 0; i < 1200; i++)); do
		if rdma res show cm_id 2>/dev/null | grep -Eq "state LISTEN .*src-addr [^ ]*:$port( |$)"; then
			return 0
		fi
		kill -0 "${pid_of[$label]}" 2>/dev/null || break
		sleep 0.05
	done
	say "$label: no LISTEN id on port $port"
	return 1
}

stop() {   # stop LABEL: kill a helper that is still running
	kill -KILL "${pid_of[$1]}" 2>/dev/null || true
}

case_begin() { failed=0; say "---- case $1"; }
case_end() {
	echo "==== CASE $1 $failed failed ($(($(now_ms) - t_start)) ms)"
	failed_total=$((failed_total + failed))
}

# ---------------------------------------------------------------- one guest

# 3) the peer process is SIGKILLed mid-traffic
case_prockill() {
	case_begin prockill
	local port=7610
	start_killable prockill_peer "$bin/fault_node" peer -p "$port" -t 120
	if wait_listen "$port" prockill_peer; then
		start prockill_survivor "$bin/fault_node" survivor -x prockill -a "$addr" -p "$port" \
			-F "$logs/prockill.stamp" -t 90
		if wait_line prockill_survivor "fault_node: traffic flowing" 60; then
			sleep "$traffic_s"
			stamp "$logs/prockill.stamp"
			kill_program prockill_peer
			say "peer process SIGKILLed"
		fi
		finish prockill_survivor
	fi
	kill_program prockill_peer 2>/dev/null
	finish prockill_peer 137
	case_end prockill
}

# 6) CQ overrun: CQ_ERR via rdmasafe_async_get names the CQ
case_overrun() {
	case_begin overrun
	run overrun "$bin/fault_overrun" -a "$addr" -t 120
	case_end overrun
}

# 5) connection storm past the listen backlog while the server holds back
# its getter: 12 of 16 requests dropped (UNREACHABLE after ~102 s), 4 queued
# and rejected once the client releases the server
case_storm() {
	case_begin storm
	local port=7620
	start storm_server "$bin/fault_storm" server -a "$addr" -p "$port" -b 4 -H "$logs/storm.release" -t 200
	if wait_listen "$port" storm_server; then
		run storm_client "$bin/fault_storm" client -a "$addr" -p "$port" -n 16 -b 4 \
			-R "$logs/storm.release" -t 180
	fi
	touch "$logs/storm.release"
	finish storm_server
	case_end storm
}

# 1) rdma link delete rxe0 under live connections and a running CQ loop
case_devremove() {
	case_begin devremove
	local rc=0 t0 t_exit
	start devremove "$bin/fault_devremove" -a "$addr" -F "$logs/devremove.stamp" -t 90
	if wait_line devremove "fault_devremove: traffic flowing" 60; then
		stamp "$logs/devremove.stamp"
		t0=$(now_ms)
		rdma link delete rxe0 >"$logs/link-delete.out" 2>&1 &
		pid_of[link_delete]=$!
		say "rdma link delete rxe0 started in the background"
		wait "${pid_of[devremove]}" || rc=$?
		t_exit=$(now_ms)
		# the delete finishes once no process has the device open
		local i
		for ((i = 0; i < 600; i++)); do
			kill -0 "${pid_of[link_delete]}" 2>/dev/null || break
			sleep 0.05
		done
		if kill -0 "${pid_of[link_delete]}" 2>/dev/null; then
			say "rdma link delete still blocked 30 s after the program exited"
			echo "measure link_delete_after_exit_ms=-1"
			stop link_delete
			failed=$((failed + 1))
		else
			local drc=0
			wait "${pid_of[link_delete]}" || drc=$?
			echo "measure link_delete_total_ms=$(($(now_ms) - t0))"
			echo "measure link_delete_after_exit_ms=$(($(now_ms) - t_exit))"
			echo "measure link_delete_exit=$drc"
			[[ $drc -eq 0 ]] || failed=$((failed + 1))
		fi
		if rdma link show 2>/dev/null | grep -q 'rxe0/'; then
			echo "measure rxe0_left=1"
			failed=$((failed + 1))
		else
			echo "measure rxe0_left=0"
		fi
		echo "==== BEGIN devremove"
		cat "$logs/devremove.out"
		echo "==== END devremove exit $rc"
		[[ $rc -eq 0 ]] || failed=$((failed + 1))
	else
		stop devremove
		finish devremove
	fi
	case_end devremove
}

# valgrind memcheck over connect/disconnect cycles and completions
case_leaks() {
	case_begin leaks
	local cycles=${RDMASAFE_FAULTS_LEAK_CYCLES:-100} msgs=${RDMASAFE_FAULTS_LEAK_MESSAGES:-25} extra
	read -ra extra <<<"${RDMASAFE_FAULTS_VALGRIND_OPTS:-}"
	run leaks valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect,possible \
		--errors-for-leak-kinds=definite,indirect --error-exitcode=99 \
		--suppressions="$root/tests/faults/rdma-core.supp" --num-callers=40 -s "${extra[@]}" \
		"$bin/leak_cycles" -a "$addr" -c "$cycles" -m "$msgs" -t 900
	case_end leaks
}

# ---------------------------------------------------------------- two guests

shared=${RDMASAFE_SHARED:-}

# 2) the peer host is killed mid-traffic; idle connection with keepalive
case_hostkill() {
	case_begin "hostkill-$1"
	local port=7630
	if [[ $1 == b ]]; then
		# the peer: killed by the host once a has traffic flowing
		start hostkill_peer "$bin/fault_node" peer -p "$port" -n 2 -L "$shared/listening" -t 150
		finish hostkill_peer
	else
		if wait_file "$shared/listening" 120; then
			start hostkill_survivor "$bin/fault_node" survivor -x hostkill -p "$port" -k -r 6 \
				-P 200 -B 10000 -F "$logs/hostkill.stamp" -W "$shared/killed-b" -t 90
			if wait_line hostkill_survivor "fault_node: traffic flowing" 60; then
				sleep "$traffic_s"
				stamp "$logs/hostkill.stamp"
				touch "$shared/kill-b"
				say "asked the host to kill guest b"
			fi
			finish hostkill_survivor
		else
			failed=$((failed + 1))
		fi
	fi
	case_end "hostkill-$1"
}

# 4) link down then up on a's eth0; b is the far side
case_linkflap() {
	case_begin "linkflap-$1"
	local port=7640 link_down_s=${RDMASAFE_FAULTS_LINK_DOWN_S:-5}
	local link_down_max_s=${RDMASAFE_FAULTS_LINK_DOWN_MAX_S:-60}
	if [[ $1 == b ]]; then
		run linkflap_peer "$bin/fault_node" peer -p "$port" -L "$shared/listening" -t 300
	else
		if wait_file "$shared/listening" 120; then
			start linkflap_survivor "$bin/fault_node" survivor -x linkflap -p "$port" -r 6 -K \
				-F "$logs/linkflap.stamp" -U "$logs/linkflap.upstamp" \
				-t "${RDMASAFE_FAULTS_LINKFLAP_SECS:-150}"
			if wait_line linkflap_survivor "fault_node: traffic flowing" 60; then
				sleep "$traffic_s"
				stamp "$logs/linkflap.stamp"
				ip link set dev "$netdev" down
				say "link $netdev down"
				sleep "$link_down_s"
				# down until the error reached the app (how long that takes
				# is rxe's and the keepalive's timing, stretched by load)
				wait_line linkflap_survivor "fault_node: traffic error" "$link_down_max_s" ||
					say "no error completion within $link_down_max_s s of link down"
				stamp "$logs/linkflap.upstamp"
				ip link set dev "$netdev" up
				say "link $netdev up"
			fi
			finish linkflap_survivor
		else
			failed=$((failed + 1))
		fi
	fi
	case_end "linkflap-$1"
}

say "rdmasafe fault cases: $* (addr $addr, bin $bin)"
mode=${1:-}
shift || true
case $mode in
one)
	for c in "$@"; do
		case $c in
		prockill | overrun | storm | devremove | leaks) "case_$c" ;;
		*) echo "unknown case $c" >&2; exit 2 ;;
		esac
	done
	;;
hostkill | linkflap)
	[[ -n $shared && ${1:-} =~ ^[ab]$ ]] || { echo "usage: $0 $mode a|b (two guests)" >&2; exit 2; }
	"case_$mode" "$1"
	;;
*)
	echo "usage: $0 one CASE... | hostkill a|b | linkflap a|b" >&2
	exit 2
	;;
esac
echo "==== SUMMARY $failed_total failed ($(($(now_ms) - t_start)) ms)"
[[ $failed_total -eq 0 ]]
