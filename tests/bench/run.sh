#!/usr/bin/env bash
# THE benchmark command of rdmasafe:
#
#   tests/bench/run.sh            # full run (its time is on the page it writes:
#                                 # 30-50 min on the 2-core test host, longer with
#                                 # other guests on it); writes docs/BENCHMARKS.md,
#                                 # docs/bench-latency.png and docs/bench-adaptive.png
#   tests/bench/run.sh --quick    # tiny sizes, one repeat (smoke run, 1-5 min)
#   tests/bench/run.sh --only scale   # only the CQ loop scale case (~5 min)
#   tests/bench/run.sh --only adaptive  # only the adaptive frontier (~9-20 min)
#
# It builds librdmasafe (cargo, release) and the benchmark programs
# (tests/bench/Makefile -> target/bench/<profile>/), boots ONE Soft-RoCE
# guest (tests/bed/vm-run) that runs tests/bench/guest.sh (all benchmarks,
# A/B alternated repeats, machine-readable "@@ {json}" lines on stdout),
# keeps that output in target/bench/results-<full|quick>.txt, and then, on
# the host, turns it into docs/BENCHMARKS.md, docs/bench-latency.png and docs/bench-adaptive.png
# (tests/bench/report.py; the plot needs gnuplot, installed with apt-get
# if missing).
#
# Options:
#   --quick            tiny sizes, one repeat, our programs only; its page goes
#                      to target/bench/quick-docs/, never to docs/
#   --no-docs          do not write docs/ (results file only)
#   --profile P        release (default) or debug build of librdmasafe
#   --results FILE     where to keep the guest's output
#   --from FILE        skip build and guest: regenerate the docs from FILE
#   --docdir DIR       write the page and plots to DIR instead of docs/ (or of
#                      the --quick / --only folder), e.g. with --from
#   --repeats N        repeats of the timed part (default 5)
#   --only scale       only the CQ loop scale case (cq_scale under callgrind);
#                      its page goes to target/bench/scale-docs/, never to docs/
#   --only adaptive    only the adaptive frontier (event, busy-poll, learning
#                      and fixed-spin modes on periodic and Poisson pings, and
#                      a 64-deep stream); its page and plots go to
#                      target/bench/adaptive-docs/, never to docs/
#   --only cm          only the CM callgrind cases (cm_evcost, plain and with
#                      10..10,000 live ids on its channel; ~5 min); implies
#                      --no-docs (report.py FILE can still read it)
#   --only storm       only the CM connection storms of the times phase (N=200
#                      and 1000, rdmasafe, raw, cmtime, the A/A control and raw
#                      with one idle thread per process; ~2 min); implies
#                      --no-docs (report.py FILE can still read it)
#   --scale-from FILE  the page's CQ loop scale section (and target row) from
#                      FILE, the results of an --only scale run, e.g.
#                      --from results-full.txt --scale-from results-scale.txt
#   --before-lib DIR   also run the programs built against the librdmasafe.so
#                      in DIR (an earlier build, e.g. of the commit before a
#                      change) as variant "before", side by side with the
#                      current library in the same guest
#   --counts-only      the counts phase only (strace, callgrind, allocations);
#                      implies --no-docs
# Env: RDMASAFE_BENCH_AD_WEIGHTS="4 16" the learning mode's latency weights
#      the adaptive section runs beside weight 1 (default 16; none: only 1)
# Exit status: 0 only if every benchmark ran (guest.sh reports failures).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"

quick=0 docs=1 profile=release results= from= repeats=5 before_lib= only= scale_from= docdir_opt=
while [[ $# -gt 0 ]]; do
	case $1 in
	--quick) quick=1 ;;
	--no-docs) docs=0 ;;
	--profile) profile=$2; shift ;;
	--results) results=$2; shift ;;
	--from) from=$2; shift ;;
	--docdir) docdir_opt=$2; shift ;;
	--repeats) repeats=$2; shift ;;
	--only) only=$2; shift ;;
	--scale-from) scale_from=$2; shift ;;
	--before-lib) before_lib=$(cd "$2" && pwd); shift ;;
	--counts-only) only=counts docs=0 ;;
	-h | --help) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 0 ;;
	*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
	shift
done
[[ $profile == release || $profile == debug ]] || { echo "--profile release|debug" >&2; exit 2; }
[[ -z $only || $only == scale || $only == adaptive || $only == counts || $only == cm || $only == storm ]] || { echo "--only scale|adaptive|cm|storm (the cases that run alone; --counts-only for the counts phase)" >&2; exit 2; }
[[ $only != cm && $only != storm ]] || docs=0
[[ -z $only || $quick == 0 ]] || { echo "--only and --quick do not mix" >&2; exit 2; }

msg() { echo "[bench] $*" >&2; }
now_s() { local t=${EPOCHREALTIME/./}; echo $((t / 1000000)); }
t0=$(now_s)
target=${CARGO_TARGET_DIR:-$repo/target}
rc=0

if [[ -z $from ]]; then
	[[ -n $results ]] || results=$target/bench/results-$([[ $quick == 1 ]] && echo quick || echo "${only:-full}").txt
	mkdir -p "$(dirname "$results")"
	msg "building librdmasafe ($profile) and the benchmark programs"
	cargo_args=(build -q -p rdmasafe-capi)
	[[ $profile == release ]] && cargo_args+=(--release)
	cargo "${cargo_args[@]}"
	bin=$target/bench/$profile
	make -s -C "$here" LIBDIR="$target/$profile" OUT="$bin" >&2
	before_bin=
	if [[ -n $before_lib ]]; then
		before_bin=$target/bench/before-$profile
		msg "building the programs against the earlier library in $before_lib"
		make -s -C "$here" LIBDIR="$before_lib" OUT="$before_bin" >&2
	fi

	# the full run's phases took ~2,800 s of guest time on the shared host
	# before the adaptive section (8.5 to 20 min more, with the host's load)
	timeout=5400
	# --quick: 258 s of guest time were seen with the host's 1-minute load
	# at 6.5 (this is a watchdog, not a budget)
	[[ $quick == 1 ]] && timeout=900
	[[ -n $only ]] && timeout=1200
	[[ $only == adaptive ]] && timeout=2400
	msg "running the benchmarks in one guest (timeout ${timeout} s); output -> $results"
	t_guest=$(now_s)
	# Host load while the guest runs (other QEMU guests share the 2 cores):
	# one sample every 5 s, summarised into the results.
	load_log=$(mktemp)
	(
		while :; do
			echo "$(cut -d' ' -f1 /proc/loadavg) $(pgrep -c -f '^qemu-system' || true)"
			sleep 5
		done
	) >"$load_log" 2>/dev/null &
	sampler=$!
	tests/bed/vm-run --timeout "$timeout" -- env RDMASAFE_BENCH_BIN="$bin" RDMASAFE_BENCH_QUICK="$quick" \
		RDMASAFE_BENCH_REPEATS="$repeats" RDMASAFE_BENCH_BEFORE_BIN="$before_bin" RDMASAFE_BENCH_ONLY="$only" \
		RDMASAFE_BENCH_AD_WEIGHTS="${RDMASAFE_BENCH_AD_WEIGHTS:-}" bash tests/bench/guest.sh >"$results" || rc=$?
	guest_s=$(($(now_s) - t_guest))
	kill "$sampler" 2>/dev/null || true
	wait "$sampler" 2>/dev/null || true
	# samples with more than our own QEMU running, highest 1-min load average
	others=$(awk '$2 > 1 { n++ } END { print n + 0 }' "$load_log")
	samples=$(awk 'END { print NR }' "$load_log")
	maxload=$(awk '$1 > m { m = $1 } END { print m + 0 }' "$load_log")
	rm -f "$load_log"
	# the commit measured (+dirty: tracked files outside docs/ changed)
	commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
	[[ -z $(git -C "$repo" status --porcelain --untracked-files=no -- . ':!docs' 2>/dev/null) ]] || commit+=+dirty
	echo "@@ {\"kind\":\"host\",\"commit\":\"$commit\",\"guest_wall_s\":$guest_s,\"profile\":\"$profile\",\"exit\":$rc,\"host_nproc\":$(nproc),\"load_samples\":$samples,\"samples_with_other_qemu\":$others,\"max_loadavg\":$maxload,\"command_s\":$(($(now_s) - t0)),\"date\":\"$(date -u +%Y-%m-%d)\"}" >>"$results"
	msg "guest finished in ${guest_s} s (exit $rc)"
else
	results=$from
fi

if [[ $docs == 1 ]]; then
	if ! command -v gnuplot >/dev/null; then
		msg "installing gnuplot-nox (for docs/bench-latency.png)"
		sudo=()
		[[ $(id -u) -eq 0 ]] || sudo=(sudo)
		"${sudo[@]}" apt-get update -q >&2
		DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends gnuplot-nox >&2
	fi
	# a --quick run never overwrites the real page
	docdir=docs
	[[ $quick == 1 ]] && docdir=$target/bench/quick-docs
	[[ -n $only ]] && docdir=$target/bench/$only-docs
	[[ -n $docdir_opt ]] && docdir=$docdir_opt
	mkdir -p "$docdir"
	python3 "$here/report.py" "$results" "$docdir/BENCHMARKS.md" "$docdir/bench-latency.png" ${scale_from:+"$scale_from"}
	msg "wrote $docdir/BENCHMARKS.md and $docdir/bench-latency.png (and bench-adaptive.png if the results have the adaptive frontier)"
fi
msg "total $(($(now_s) - t0)) s"
exit "$rc"
