#!/usr/bin/env bash
# Runs every C program of the rdmasafe C API tests against one RDMA device,
# in one go (one guest boot): normally inside the Soft-RoCE guest
#   tests/bed/vm-run --timeout 900 -- bash tests/c/run-in-guest.sh
# or on the host with real hardware (RDMASAFE_TEST_ADDR set by the caller).
#
# Scenarios:
#   1. cm_capi_test
#   2. messenger_server -n 8 with 8 connections from 5 client processes
#      (one with -n 4, four single ones), all at once; the server adds and
#      removes a CQ per connection on its running CQ loop thread
#   3. messenger_server stopped by SIGTERM while 2 connections are held (-H)
#   4. examples-c rdmasafe_rdma_server with the stock rdma_client
#   5. the stock rdma_server with examples-c rdmasafe_rdma_client
#   6. cq_loop_test (CQ loop C API: handles, 3 modes, stop/run, drain)
#   7. examples-c mpi_ring: 4 MPI ranks (Open MPI's mpirun), token ring
#      over RDMA in event and adaptive mode
#   8. cm_ud_test (udaddy-style UD) and its raw librdmacm build
#   9. cm_mcast_test (mckey-style multicast) and its raw librdmacm build
#  10. cm_barrier_test (rping-shaped, ASan): RDMASAFE_C_BARRIER_RUNS runs
#      (default 30) of the rdmasafe build, RDMASAFE_C_BARRIER_RAW_RUNS
#      (default 10) of the raw librdmacm control, labels NAME.1 .. NAME.N
#  11. cm_barrier_test -H (a held DISCONNECTED copy, destroy time measured),
#      rdmasafe and raw
#  12. cm_cancel_test and its raw build: threads waiting in the get calls
#      (and ibv_get_cq_event) cancelled and joined
#
# Each program's output is printed as one block:
#   ==== BEGIN <label>
#   ...
#   ==== END <label> exit <status>
# then "==== SUMMARY <n> failed"; the exit status is 0 only if every
# program exited 0. Listeners are waited for by polling `rdma res show
# cm_id` for their LISTEN id, never by a fixed sleep. Every -t / timeout
# below is a watchdog that turns a hang into a failure, sized for a busy
# machine (a normal run needs a fraction of it).
#
# Env: RDMASAFE_TEST_ADDR (required), RDMASAFE_C_BIN (default
# <repo>/target/c), RDMASAFE_C_PORT_BASE (default 7471),
# RDMASAFE_C_BARRIER_RUNS, RDMASAFE_C_BARRIER_RAW_RUNS (see 10).
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${RDMASAFE_C_BIN:-$root/target/c}
addr=${RDMASAFE_TEST_ADDR:?RDMASAFE_TEST_ADDR must name the RDMA device address}
base=${RDMASAFE_C_PORT_BASE:-7471}
barrier_runs=${RDMASAFE_C_BARRIER_RUNS:-30}
barrier_raw_runs=${RDMASAFE_C_BARRIER_RAW_RUNS:-10}
logs=$(mktemp -d "${TMPDIR:-/tmp}/rdmasafe-c.XXXXXX") || exit 1
trap 'rm -rf "$logs"' EXIT
failed=0
declare -A pid_of

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
t_start=$(now_ms)

# start LABEL CMD ARGS...: runs CMD in the background, output to a log
start() {
	local label=$1
	shift
	"$@" >"$logs/$label.out" 2>&1 &
	pid_of[$label]=$!
}

# finish LABEL [WANT_STATUS]: waits for it and prints its block
finish() {
	local label=$1 want=${2:-0} rc=0
	wait "${pid_of[$label]}" || rc=$?
	echo "==== BEGIN $label"
	cat "$logs/$label.out"
	echo "==== END $label exit $rc"
	if [[ $rc -ne $want ]]; then
		failed=$((failed + 1))
	fi
}

# run LABEL CMD ARGS...: in the foreground
run() {
	start "$@"
	finish "$1"
}

# wait_listen PORT LABEL: until a LISTEN cm_id on PORT exists (or LABEL died)
wait_listen() {
	local port=$1 label=$2 i
	for ((i = 0; i < 1200; i++)); do
		if rdma res show cm_id 2>/dev/null | grep -Eq "state LISTEN .*src-addr [^ ]*:$port( |$)"; then
			echo "# $label listening on port $port (after $i polls)"
			return 0
		fi
		kill -0 "${pid_of[$label]}" 2>/dev/null || break
		sleep 0.05
	done
	echo "# $label: no LISTEN id on port $port"
	return 1
}

# wait_lines FILE PATTERN COUNT LABEL: until FILE has COUNT lines matching
wait_lines() {
	local file=$1 pattern=$2 count=$3 label=$4 i
	for ((i = 0; i < 1200; i++)); do
		if [[ $(grep -c -- "$pattern" "$file" 2>/dev/null) -ge $count ]]; then
			return 0
		fi
		kill -0 "${pid_of[$label]}" 2>/dev/null || break
		sleep 0.05
	done
	echo "# $label: wanted $count lines of '$pattern'"
	return 1
}

scenario() {
	echo "# ---- $* (t=$(($(now_ms) - t_start)) ms)"
}

echo "# rdmasafe C programs on $addr (bin $bin, device ${RDMASAFE_TEST_DEVICE:-?})"

# 1. -----------------------------------------------------------------------
scenario "cm_capi_test"
run cm_capi_test "$bin/cm_capi_test"

# 2. -----------------------------------------------------------------------
scenario "messenger: 8 connections from 5 client processes"
port=$((base + 10))
start messenger_server "$bin/messenger_server" -a "$addr" -p "$port" -n 8 -t 300
if wait_listen "$port" messenger_server; then
	start messenger_client_100 "$bin/messenger_client" -a "$addr" -p "$port" -i 100 -n 4 -t 240
	for id in 201 202 203 204; do
		start "messenger_client_$id" "$bin/messenger_client" -a "$addr" -p "$port" -i "$id" -t 240
	done
	for id in 100 201 202 203 204; do
		finish "messenger_client_$id"
	done
else
	kill -TERM "${pid_of[messenger_server]}" 2>/dev/null
fi
finish messenger_server

# 3. -----------------------------------------------------------------------
scenario "messenger: SIGTERM with 2 held connections"
port=$((base + 11))
start messenger_sigterm_server "$bin/messenger_server" -a "$addr" -p "$port" -n 1000 -t 300
if wait_listen "$port" messenger_sigterm_server; then
	start messenger_sigterm_client "$bin/messenger_client" -a "$addr" -p "$port" -i 300 -n 2 -H -t 240
	wait_lines "$logs/messenger_sigterm_client.out" "holding the connection" 2 messenger_sigterm_client
	echo "# sending SIGTERM to messenger_server"
	kill -TERM "${pid_of[messenger_sigterm_server]}"
	finish messenger_sigterm_client
else
	kill -TERM "${pid_of[messenger_sigterm_server]}" 2>/dev/null
fi
finish messenger_sigterm_server

# 4. -----------------------------------------------------------------------
scenario "rdmasafe_rdma_server with the stock rdma_client"
port=$base
start rdmasafe_rdma_server "$bin/rdmasafe_rdma_server" -s "$addr" -p "$port" -t 240
if wait_listen "$port" rdmasafe_rdma_server; then
	run rdma_client timeout -k 5 240 rdma_client -s "$addr" -p "$port"
else
	kill -TERM "${pid_of[rdmasafe_rdma_server]}" 2>/dev/null
fi
finish rdmasafe_rdma_server

# 5. -----------------------------------------------------------------------
scenario "the stock rdma_server with rdmasafe_rdma_client"
port=$((base + 1))
start rdma_server timeout -k 5 240 rdma_server -s "$addr" -p "$port"
if wait_listen "$port" rdma_server; then
	run rdmasafe_rdma_client "$bin/rdmasafe_rdma_client" -s "$addr" -p "$port" -t 240
else
	kill -TERM "${pid_of[rdma_server]}" 2>/dev/null
fi
finish rdma_server

# 6. -----------------------------------------------------------------------
scenario "cq_loop_test"
run cq_loop_test "$bin/cq_loop_test" -n 2000

# 7. -----------------------------------------------------------------------
# MPI only bootstraps (ports via MPI_Allgather) and keeps phases in step;
# its own traffic stays in shared memory (btl self,vader: no tcp btl on
# dummy0, nothing of MPI's on rxe0) and its runtime's out-of-band channel
# on lo. Open MPI 4.1 refuses a node name outside [A-Za-z0-9.-]; the
# guest's kernel has none set ("(none)"), so mpirun then gets one in a UTS
# namespace of its own.
scenario "mpi_ring: 4 ranks, event and adaptive mode"
mpi=(mpirun --allow-run-as-root --oversubscribe -np 4
	--mca pml ob1 --mca btl self,vader --mca oob_tcp_if_include lo
	"$bin/mpi_ring" -a "$addr" -n 100 -m both -t 240)
if ! command -v mpirun >/dev/null || [[ ! -x $bin/mpi_ring ]]; then
	echo "==== BEGIN mpi_ring"
	echo "mpirun or $bin/mpi_ring missing (apt-get install openmpi-bin libopenmpi-dev)"
	echo "==== END mpi_ring exit 127"
	failed=$((failed + 1))
elif [[ $(hostname) =~ ^[A-Za-z0-9.-]+$ ]]; then
	run mpi_ring timeout -k 5 300 "${mpi[@]}"
else
	echo "# node name '$(hostname)' is not one Open MPI accepts: mpirun in its own UTS namespace"
	run mpi_ring unshare --uts sh -c 'hostname rdmasafe-guest && exec "$@"' sh timeout -k 5 300 "${mpi[@]}"
fi

# 8. -----------------------------------------------------------------------
# The UD, multicast and barrier programs use only the two renamed calls;
# each *_raw twin is the same source on librdmacm alone, the control.
scenario "cm_ud_test: UD with param.ud, AH from the event, both ways"
run cm_ud_test "$bin/cm_ud_test"
run cm_ud_test_raw "$bin/cm_ud_test_raw"

# 9. -----------------------------------------------------------------------
scenario "cm_mcast_test: multicast join with context pointers, send to the group"
run cm_mcast_test "$bin/cm_mcast_test"
run cm_mcast_test_raw "$bin/cm_mcast_test_raw"

# 10. ----------------------------------------------------------------------
# Each run forks its own server and client (port passed through a pipe).
# rdmasafe's barrier holds until the ack deadline: one no stall of a busy
# machine between a get and its free reaches (the -H runs below use the
# default, which they are about)
scenario "cm_barrier_test (ASan): $barrier_runs runs"
for ((i = 1; i <= barrier_runs; i++)); do
	run "cm_barrier_test.$i" env RDMASAFE_ACK_DEADLINE_MS=60000 "$bin/cm_barrier_test"
done
scenario "cm_barrier_test_raw (ASan, librdmacm only): $barrier_raw_runs runs"
for ((i = 1; i <= barrier_raw_runs; i++)); do
	run "cm_barrier_test_raw.$i" "$bin/cm_barrier_test_raw"
done

# 11. ----------------------------------------------------------------------
scenario "cm_barrier_test -H: the client holds its DISCONNECTED for 5 s"
run cm_barrier_test_hold "$bin/cm_barrier_test" -H
run cm_barrier_test_raw_hold "$bin/cm_barrier_test_raw" -H

# 12. ----------------------------------------------------------------------
scenario "cm_cancel_test: threads waiting for an event cancelled and joined"
run cm_cancel_test timeout -k 5 300 "$bin/cm_cancel_test" "$addr"
run cm_cancel_test_raw timeout -k 5 300 "$bin/cm_cancel_test_raw" "$addr"

scenario "end"
echo "==== SUMMARY $failed failed ($(($(now_ms) - t_start)) ms)"
[[ $failed -eq 0 ]]
