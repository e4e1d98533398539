#!/usr/bin/env bash
# Runs suanli locally with nothing to configure. Today: the scheduling engine replaying a
# workload it generates itself (a 200-node, 1,600-GPU synthetic cluster), every policy side
# by side. Extra arguments go to `suanli sim fill`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --quiet -p suanli
exec target/debug/suanli sim fill --synthetic 200 --policy all --seeds 42-44 "$@"
