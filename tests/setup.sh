#!/usr/bin/env bash
# Installs everything rdmasafe's build, demo and tests need on a fresh
# Debian 12 machine, then prepares the Soft-RoCE test bed (kernel +
# initramfs, cached). Idempotent: a second run only checks.
#
# Needs: root (or sudo) for apt-get, and a Rust toolchain (cargo with
# rustfmt and clippy, as rustup installs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

pkgs=(
  # build: rdma-sys runs bindgen over the rdma-core headers
  gcc g++ make cmake pkg-config libclang-dev clang libibverbs-dev librdmacm-dev
  # run: libraries and the Soft-RoCE provider (librxe)
  rdma-core ibverbs-providers libibverbs1 librdmacm1 iproute2
  # stock peers for the bed check and interop tests
  ibverbs-utils rdmacm-utils perftest
  # examples-c/mpi_ring (mpicc, mpirun) in the C programs test
  openmpi-bin libopenmpi-dev
  # the test bed: QEMU guest with Debian's stock kernel
  qemu-system-x86 busybox-static kmod cpio xz-utils python3
  # the fault and leak suite (tests/faults/): memcheck in the guest
  valgrind
  # benchmarks (tests/bench/): callgrind (valgrind, above), syscall counts, the plot
  strace gnuplot-nox
  # man pages: groff lints them (tests/manpages), man reads the installed ones
  groff-base man-db
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing: ${missing[*]}" >&2
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null; then
  [[ -x $HOME/.cargo/bin/cargo ]] && export PATH=$HOME/.cargo/bin:$PATH
fi
command -v cargo >/dev/null || { echo "[setup] cargo not found: install Rust with rustup first" >&2; exit 1; }
cargo fmt --version >/dev/null 2>&1 || { echo "[setup] rustfmt missing: rustup component add rustfmt" >&2; exit 1; }
cargo clippy --version >/dev/null 2>&1 || { echo "[setup] clippy missing: rustup component add clippy" >&2; exit 1; }

echo "[setup] fetching Rust dependencies" >&2
cargo fetch --locked -q
tests/bed/prepare
echo "[setup] ready" >&2
