#!/usr/bin/env bash
# Runs suanli locally with nothing to configure: `suanli dev`, one control-plane server on
# 127.0.0.1:7400 with its data in .suanli/dev (kept between runs) and a `default` queue.
# Extra arguments go to `suanli dev` (e.g. --listen, --data-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# --workspace: the same feature set as the tests, so RocksDB is compiled once for both.
cargo build --quiet --workspace --bins
exec target/debug/suanli dev "$@"
