#!/usr/bin/env bash
# Runs the built docs/migration programs one after the other against one
# RDMA device, in one go (one guest boot): normally inside the Soft-RoCE
# guest
#   tests/bed/vm-run --timeout 300 -- bash tests/consumer/run-in-guest.sh LABEL=BINARY...
# or on the host with real hardware (RDMASAFE_TEST_ADDR set by the caller).
# rdmasafe-capi/tests/install_consumers.rs builds the binaries and calls it.
#
# Each program (cm_server_*, cq_rank_*: each runs alone, with its own client
# or both ranks) gets -a $RDMASAFE_TEST_ADDR and a port of its own, and a
# timeout. Its output is printed as one block:
#   ==== BEGIN <label>
#   ...
#   ==== END <label> exit <status>
# then "==== SUMMARY <n> failed"; the exit status is 0 only if every
# program exited 0.
#
# A label ending in ".preload" runs its program with
# LD_PRELOAD=$RDMASAFE_CONSUMER_PRELOAD (the installed librdmasafe-preload.so)
# and RDMASAFE_LOG=info: an unmodified "before" program in copy mode.
#
# Env: RDMASAFE_TEST_ADDR (required), RDMASAFE_CONSUMER_PORT_BASE (default 7600),
# RDMASAFE_CONSUMER_PRELOAD (for ".preload" labels).
set -u

addr=${RDMASAFE_TEST_ADDR:?RDMASAFE_TEST_ADDR must name the RDMA device address}
port=${RDMASAFE_CONSUMER_PORT_BASE:-7600}
failed=0

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
t_start=$(now_ms)
echo "# rdmasafe consumer programs on $addr (device ${RDMASAFE_TEST_DEVICE:-?})"

for arg in "$@"; do
	label=${arg%%=*}
	bin=${arg#*=}
	t0=$(now_ms)
	echo "==== BEGIN $label"
	rc=0
	pre=()
	if [[ $label == *.preload ]]; then
		# LD_PRELOAD cannot quote a path with spaces: a link without any
		links=$(mktemp -d /tmp/rdmasafe-consumer-preload.XXXXXX)
		ln -s "${RDMASAFE_CONSUMER_PRELOAD:?for $label}" "$links/librdmasafe-preload.so"
		pre=(env "LD_PRELOAD=$links/librdmasafe-preload.so" RDMASAFE_LOG=info)
	fi
	timeout -k 5 90 "${pre[@]}" "$bin" -a "$addr" -p "$port" 2>&1 || rc=$?
	if [[ ${#pre[@]} -gt 0 ]]; then rm -rf "$links"; fi
	echo "==== END $label exit $rc ($(($(now_ms) - t0)) ms)"
	[[ $rc -eq 0 ]] || failed=$((failed + 1))
	port=$((port + 1))
done

echo "==== SUMMARY $failed failed ($(($(now_ms) - t_start)) ms)"
[[ $failed -eq 0 ]]
