#!/usr/bin/env bash
# Runs suanli locally with nothing to configure: `suanli dev`, one control-plane server on
# 127.0.0.1:7400 with its data in .suanli/dev (kept between runs), a `default` queue, and two
# agents with fake devices (dev-gpu: 8 GPUs in two NVLink islands; dev-npu: 4 NPUs).
# Extra arguments go to `suanli dev` (e.g. --listen, --data-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# --workspace: the same feature set as the tests, so RocksDB is compiled once for both; it
# also builds the device plugin libraries (cdylibs) the dev agents load.
cargo build --quiet --workspace
exec target/debug/suanli dev "$@"
