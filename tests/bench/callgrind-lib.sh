# Shell functions shared by the callgrind scripts of tests/bench/ (sourced
# by guest.sh, cq-callgrind.sh and cm-callgrind.sh). Sets, from the folder
# of this file: repo (the checkout), target (the cargo target directory)
# and bin (where tests/bench/Makefile puts the release programs).

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
bin=$target/bench/release

# callgrind_fn_sums FILE: one "Ir<TAB>function" line per function of a
# callgrind output file, its instructions of its own (exclusive Ir) summed
# over the source files callgrind_annotate splits it into; unsorted.
callgrind_fn_sums() {
	callgrind_annotate --threshold=100 --auto=no "$1" 2>/dev/null | awk '
		/^-+$/ { dashes++; next }
		dashes == 6 && NF == 0 { exit }
		dashes == 6 && $1 ~ /^[0-9,]+$/ {
			ir = $1; gsub(/,/, "", ir)
			line = $0; sub(/^ *[0-9,]+ +(\([ 0-9.]+%\) +)?/, "", line)
			sub(/ \[[^]]*\]$/, "", line); sub(/^[^:]*:/, "", line)
			sum[line] += ir
		}
		END { for (f in sum) printf "%d\t%s\n", sum[f], f }'
}

# callgrind_per FILE D MIN: the functions with at least MIN instructions of
# their own per unit (Ir / D), most first, as "   per-unit  function" lines
callgrind_per() {
	callgrind_fn_sums "$1" | awk -F '\t' -v d="$2" -v m="$3" '
		$1 / d >= m { printf "%8.1f  %s\n", $1 / d, substr($2, 1, 110) }' | sort -k1,1nr
}

# callgrind_ir FILE: the Ir total of a callgrind output file
callgrind_ir() {
	awk '/^(summary|totals):/ { print $2; exit }' "$1"
}

# callgrind_summary VARIANT FILE UNITS WHAT MIN: "== VARIANT: Ir, per WHAT",
# then the functions with at least MIN instructions of their own per unit
callgrind_summary() {
	local ir
	ir=$(callgrind_ir "$2")
	echo "== $1: $ir Ir over $3 x $4: $(awk -v a="$ir" -v b="$3" 'BEGIN { printf "%.1f", a / b }') instructions per $4"
	callgrind_per "$2" "$3" "$5"
}

# callgrind_guest_run NAME SCRIPT ENV...: on the host, runs `bash SCRIPT
# --in-guest` in one Soft-RoCE guest with the environment ENV
# (NAME=VALUE...), keeps its summary in target/bench/NAME.txt (also
# printed) and the callgrind files it sent as "@@cg VARIANT" + base64 lines
# in target/bench/NAME/VARIANT.cg. Returns the guest job's status.
callgrind_guest_run() {
	local name=$1 script=$2 raw rc=0 f
	shift 2
	mkdir -p "$target/bench/$name"
	raw=$target/bench/$name.raw
	"$repo/tests/bed/vm-run" --timeout 900 -- env CARGO_TARGET_DIR="$target" "$@" bash "$script" --in-guest >"$raw" || rc=$?
	awk '/^@@cg / { v = $2; getline; print > (dir "/" v ".cg.gz.b64"); next } { print }' dir="$target/bench/$name" "$raw" |
		tee "$target/bench/$name.txt"
	for f in "$target/bench/$name"/*.cg.gz.b64; do
		[[ -s $f ]] && base64 -d "$f" | gunzip >"${f%.gz.b64}" && rm -f "$f"
	done
	echo "(callgrind files: $target/bench/$name/; callgrind_annotate --auto=yes them for lines)"
	return $rc
}

# callgrind_send VARIANT FILE: in the guest, the callgrind file for the host
# (read back by callgrind_guest_run)
callgrind_send() {
	echo "@@cg $1"
	gzip -c "$2" | base64 -w 0
	echo
}
