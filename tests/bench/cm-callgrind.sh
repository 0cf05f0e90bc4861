#!/usr/bin/env bash
# Only the CM callgrind cases of tests/bench/run.sh's counts phase, fast
# (one guest, ~2-3 min): `cm_evcost -k 300 -r 2` under callgrind for
# rdmasafe (rdmasafe_get_event + rdmasafe_event_free), rdmasafe with the
# ack deadline off (RDMASAFE_ACK_DEADLINE_MS=0: no original held, no
# ack-deadline thread), raw librdmacm (rdma_get_cm_event +
# rdma_ack_cm_event) and raw with one idle thread (-T: glibc on its
# multi-threaded paths, as in rdmasafe's program). Prints, per variant, the
# user-space instructions per get + free (Ir / events) and the functions
# with the most instructions of their own, per event (issue 14 target 3).
#
#   tests/bench/cm-callgrind.sh            # build (release) + guest
#   tests/bench/cm-callgrind.sh --no-build # programs already built
#
# Nothing is written to docs/; the summary is kept in
# target/bench/cm-callgrind.txt, the callgrind files in
# target/bench/cm-callgrind/<variant>.cg. CM_CALLGRIND_K (ids per round,
# default 300), CM_CALLGRIND_ROUNDS (default 2); CM_CALLGRIND_OPTS: more
# valgrind options (e.g. --dump-instr=yes).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# repo, target, bin and the callgrind_* functions
# shellcheck source=tests/bench/callgrind-lib.sh
. "$here/callgrind-lib.sh"

if [[ ${1:-} == --in-guest ]]; then
	addr=${RDMASAFE_TEST_ADDR:?}
	k=${CM_CALLGRIND_K:-300}
	r=${CM_CALLGRIND_ROUNDS:-2}
	out=$(mktemp -d)
	trap 'rm -rf "$out"' EXIT
	rc=0
	for v in rdmasafe rdmasafe_deadline0 raw raw_thread; do
		p=$bin/cm_evcost_${v%%_*}
		env=()
		opt=()
		[[ $v == *_deadline0 ]] && env=(RDMASAFE_ACK_DEADLINE_MS=0)
		[[ $v == *_thread ]] && opt=(-T)
		# shellcheck disable=SC2086 # CM_CALLGRIND_OPTS: extra valgrind options, split
		timeout -k 5 600 env "${env[@]}" valgrind --tool=callgrind --collect-atstart=no ${CM_CALLGRIND_OPTS:-} \
			--callgrind-out-file="$out/$v.cg" "$p" -a "$addr" -k "$k" -r "$r" -w 1 "${opt[@]}" \
			>"$out/$v.out" 2>"$out/$v.err" || { rc=1; tail -n 5 "$out/$v.err" >&2; continue; }
		callgrind_summary "$v" "$out/$v.cg" "$(sed -n 's/.*"events":\([0-9]*\).*/\1/p' "$out/$v.out" | head -n1)" "get + free" 2
		callgrind_send "$v" "$out/$v.cg"
	done
	exit $rc
fi

if [[ ${1:-} != --no-build ]]; then
	cargo build -q --release -p rdmasafe-capi
	make -s -C "$here" LIBDIR="$target/release" OUT="$bin" >&2
fi
callgrind_guest_run cm-callgrind "$here/cm-callgrind.sh" CM_CALLGRIND_OPTS="${CM_CALLGRIND_OPTS:-}" \
	CM_CALLGRIND_K="${CM_CALLGRIND_K:-300}" CM_CALLGRIND_ROUNDS="${CM_CALLGRIND_ROUNDS:-2}"
