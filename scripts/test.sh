#!/usr/bin/env bash
# The one gate: formatting, clippy with warnings denied, every test of the workspace, and the
# chaos harness's short suite (chaos/README.md) against real clusters.
# Tests that replay the public Alibaba trace read it from $SUANLI_TRACES (default: the copy
# beside this checkout, ../shared/traces/alibaba-gpu-v2023, when present).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -z "${SUANLI_TRACES:-}" ] && [ -d ../shared/traces/alibaba-gpu-v2023 ]; then
  SUANLI_TRACES="$(cd ../shared/traces/alibaba-gpu-v2023 && pwd)"
fi
export SUANLI_TRACES="${SUANLI_TRACES:-}"
# A gate run builds once: incremental caches would only add ~half again to the target dir
# (disk, not time, is what a CI machine ran out of). Set CARGO_INCREMENTAL=1 to keep them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
target_dir="${CARGO_TARGET_DIR:-target}"
disk() { echo "   disk: $(df -h --output=avail "$target_dir" 2>/dev/null | tail -1 | tr -d ' ') free; target dir $(du -sh "$target_dir" 2>/dev/null | cut -f1)"; }
mkdir -p "$target_dir"
# Each stage prints how long the one before it took, and the total so far.
stage_start=$SECONDS
stage() {
  echo "   took $((SECONDS - stage_start)) s (total $((SECONDS / 60))m$((SECONDS % 60))s)"
  stage_start=$SECONDS
  echo "== $1"
}
disk
echo "== cargo fmt --check"
cargo fmt --all -- --check
stage "cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
stage "cargo build (the device plugin .so files and the binary the end-to-end tests load)"
# `cargo test` builds only the rlib side of other packages' libraries; the plugin tests and
# the agent tests dlopen the cdylibs from target/debug. Same profile, so nothing is rebuilt.
cargo build --workspace --quiet
stage "cargo test"
cargo test --workspace --quiet
disk
stage "suanli-chaos suite --short (every short scenario once; seed base ${SUANLI_CHAOS_SEED:-1})"
"$target_dir/debug/suanli-chaos" suite --short --seed "${SUANLI_CHAOS_SEED:-1}" --duration-s 15
