#!/usr/bin/env bash
# The per-event cost of librdmasafe-preload.so next to the renamed build:
# tests/bench's cm_evcost (K ADDR_RESOLVED events drained in a tight loop,
# only the drain measured) under valgrind --tool=callgrind, user-space
# instructions of the measured window (CALLGRIND_TOGGLE_COLLECT in
# bench_common.h), in three variants:
#   raw       cm_evcost_raw, librdmacm's get + ack (the baseline);
#   preload   the same unmodified binary with LD_PRELOAD=librdmasafe-preload.so
#             (copy mode: its get / ack are rdmasafe's copy and free);
#   rdmasafe  cm_evcost_rdmasafe, the renamed build (rdmasafe_get_event /
#             rdmasafe_event_free from librdmasafe.so).
# Instruction counts do not depend on the guest's (TCG) timing.
#
#   tests/bed/vm-run --timeout 900 -- bash tests/preload/overhead.sh
#
# Prints `measure ir_<variant>_<rep>=N` and `measure events=N` (events in
# the window per run). Env: RDMASAFE_TEST_ADDR (required),
# RDMASAFE_PRELOAD_LIB (default <repo>/target/release/librdmasafe_preload.so),
# RDMASAFE_BENCH_BIN (default <repo>/target/bench: `make -C tests/bench`),
# OVERHEAD_K (300), OVERHEAD_ROUNDS (2), OVERHEAD_REPS (2).
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
addr=${RDMASAFE_TEST_ADDR:?RDMASAFE_TEST_ADDR must name the RDMA device address}
lib=${RDMASAFE_PRELOAD_LIB:-$root/target/release/librdmasafe_preload.so}
bin=${RDMASAFE_BENCH_BIN:-$root/target/bench}
k=${OVERHEAD_K:-300}
rounds=${OVERHEAD_ROUNDS:-2}
reps=${OVERHEAD_REPS:-2}
w=$(mktemp -d /tmp/rdmasafe-overhead.XXXXXX) || exit 1
trap 'rm -rf "$w"' EXIT
# LD_PRELOAD cannot quote a path with spaces: a link without any
ln -s "$lib" "$w/librdmasafe-preload.so"
echo "measure events=$((k * rounds))"
fail=0
for ((rep = 1; rep <= reps; rep++)); do
	for v in raw preload rdmasafe; do
		exe=$bin/cm_evcost_raw pre=()
		[[ $v == rdmasafe ]] && exe=$bin/cm_evcost_rdmasafe
		[[ $v == preload ]] && pre=(env "LD_PRELOAD=$w/librdmasafe-preload.so" RDMASAFE_LOG=info)
		rm -f "$w/cg.out"
		"${pre[@]}" timeout -k 5 600 valgrind --tool=callgrind --collect-atstart=no \
			--callgrind-out-file="$w/cg.out" "$exe" -a "$addr" -k "$k" -r "$rounds" -w 1 \
			>"$w/out" 2>"$w/err"
		rc=$?
		ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$w/cg.out" 2>/dev/null)
		echo "# $v rep $rep: exit $rc; $(grep -h '^RESULT' "$w/out")"
		grep -h 'preload exit' "$w/err" | sed 's/^/# /'
		if [[ $rc -ne 0 || -z $ir ]]; then
			echo "# $v rep $rep failed:"
			sed 's/^/#   /' "$w/err" | tail -20
			fail=1
		else
			echo "measure ir_${v}_${rep}=$ir"
		fi
	done
done
exit $fail
