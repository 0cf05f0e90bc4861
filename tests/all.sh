#!/usr/bin/env bash
# Runs every test: sets up (tests/setup.sh), checks formatting, lints,
# then `cargo test` for the whole workspace with every feature on (the
# `tokio` and `mio` features of rdmasafe-core, so their tests rxe_async and
# rxe_mio run too). Integration tests named rxe_*
# run inside a throw-away Soft-RoCE guest (one boot per test binary, see
# tests/bed/); a test that needs RDMA and finds none fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
# The space left where cargo writes, at every step: a disk that fills up
# shows itself as a failed copy or link, far from its cause.
free_space() {
	local dir=${CARGO_TARGET_DIR:-target}
	[[ -d $dir ]] || dir=.
	stat -f -c '%a %S' "$dir" | awk '{ printf "%.1f GiB free", $1 * $2 / 1073741824 }'
}
step() { echo "== [$((SECONDS - start)) s] $* ($(free_space))" >&2; }
trap 'rc=$?; echo "== [$((SECONDS - start)) s] failed: line $LINENO: $BASH_COMMAND (exit $rc; $(free_space))" >&2' ERR

step "setup"
tests/setup.sh
[[ -x $HOME/.cargo/bin/cargo ]] && export PATH=$HOME/.cargo/bin:$PATH

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --locked --workspace --all-targets --all-features -q -- -D warnings
step "cargo test (rxe_* in the Soft-RoCE guest)"
cargo test --locked --workspace --all-targets -- --skip preload_on_rdma
step "rdmasafe-core's features: tokio and mio (rxe_async, rxe_mio), sideway (rxe_interop)"
cargo test --locked -p rdmasafe-core --all-features --lib --test rxe_async --test rxe_mio --test rxe_interop
step "librdmasafe-preload.so: stock tools under the preload, check mode on the bug programs (one guest)"
cargo test --locked -p rdmasafe-capi --test preload
step "rustdoc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps -q --all-features -p rdmasafe-core -p rdmasafe-capi -p rdmasafe-preload
# and as the README's `cargo doc -p rdmasafe-core` builds it (default
# features: no link may lead into a module behind a feature)
RUSTDOCFLAGS="-D warnings" CARGO_TARGET_DIR=target/doc-default cargo doc --locked --no-deps -q -p rdmasafe-core
step "doc tests"
cargo test --locked --workspace --doc
cargo test --locked -p rdmasafe-core --doc --all-features
step "loom: every interleaving of the work queue's sleep/wake protocol and of a run against a close"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --locked --release -p rdmasafe-core --lib loom_tests
step "all tests passed"
