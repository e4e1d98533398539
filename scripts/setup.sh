#!/usr/bin/env bash
# Installs what a fresh machine lacks to build suanli: the Rust toolchain is assumed, plus
# libclang (RocksDB's bindings run bindgen) and librocksdb-dev. protoc comes from the
# protoc-bin-vendored crate.
set -euo pipefail
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust from https://rustup.rs" >&2
  exit 1
fi
have_libclang() {
  # libclang.so or libclang-14.so.1, not libclang-cpp.so (which bindgen cannot use).
  ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so' && return 0
  ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* >/dev/null 2>&1
}
if ! have_libclang; then
  echo "setup: installing libclang-dev (needed by RocksDB's bindgen)"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libclang-dev >/dev/null
fi
# RocksDB: the system's library (Debian's librocksdb-dev 7.8.3; .cargo/config.toml points the
# build at it). Without it the link fails with "cannot find -lrocksdb".
if [ ! -e /usr/include/rocksdb/c.h ] || ! ls /usr/lib/*-linux-gnu/librocksdb.so >/dev/null 2>&1; then
  echo "setup: installing librocksdb-dev (RocksDB, linked by suanli-raft)"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends librocksdb-dev >/dev/null
fi
# libfaketime: the chaos harness's clock faults (clock-skew, clock-rate) preload it into a
# server. Without it those scenarios fail (they never skip).
if [ ! -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] && [ ! -e /usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1 ]; then
  echo "setup: installing faketime (libfaketime, for the chaos harness's clock faults)"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends faketime >/dev/null
fi
# Debian's prometheus (prometheus, promtool: tests/tests/metrics.rs scrapes a running cluster
# and checks deploy/prometheus/ with promtool) and chromium-headless-shell (headless Chromium,
# from Debian's chromium source package: tests/tests/dashboard.rs loads the dashboard). Without
# them those tests fail (they never skip).
missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium-headless-shell >/dev/null 2>&1 || missing+=(chromium-headless-shell)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# protobuf-c (protoc-c and libprotobuf-c): the C example plugin and `suanli plugin new --lang c`
# encode their payloads with it; tests build them with make outside cargo.
command -v protoc-c >/dev/null 2>&1 || missing+=(protobuf-c-compiler)
[ -e /usr/include/protobuf-c/protobuf-c.h ] || missing+=(libprotobuf-c-dev)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} (Debian packages, for the metrics, dashboard and C plugin tests)"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for c in rustfmt clippy; do
  if ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
    rustup component add "$c" >/dev/null 2>&1 || true
  fi
done
