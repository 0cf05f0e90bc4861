#!/usr/bin/env bash
# The demo: sets everything up (tests/setup.sh), then runs the first proof
# in a Soft-RoCE guest and prints the CM events each side saw and the
# message that crossed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tests/setup.sh
[[ -x $HOME/.cargo/bin/cargo ]] && export PATH=$HOME/.cargo/bin:$PATH
# The cargo runner (.cargo/config.toml) boots the guest for rxe_* binaries.
exec cargo run --locked -q -p rdmasafe-core --example rxe_demo
