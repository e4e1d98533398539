#!/usr/bin/env bash
# The nvidia plugin and a one-node cluster on a machine with real NVIDIA GPUs and a driver:
# `suanli plugin check` of the nvidia plugin, then a server, an agent with the nvidia and cpu
# plugins, a one-GPU job and a job of two half-GPU replicas, whose tasks print
# CUDA_VISIBLE_DEVICES and run nvidia-smi. Everything is logged to $OUT/gpu-check.log.
#   BIN_DIR=<dir with suanli, libsuanli_plugin_nvidia.so, libsuanli_plugin_cpu.so> OUT=<dir> scripts/gpu-check.sh
# Last run 2026-12-04 at f630e21 on one NVIDIA H200 (driver 580.159.04, MIG disabled): the kit's
# 13 checks passed, both jobs succeeded with CUDA_VISIBLE_DEVICES set to the GPU's UUID, and
# the node showed utilisation, memory and temperature from NVML. Without a driver the plugin
# reports 0 devices and the jobs stay pending with "no gpu".
set -x
OUT="${OUT:-/tmp/gpu-check}"; mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
BIN_DIR="${BIN_DIR:-target/debug}"
B=$(cd "$BIN_DIR" && pwd)/suanli
W=/tmp/sl; rm -rf $W; mkdir -p $W/plugins; cp "$BIN_DIR"/libsuanli_plugin_{nvidia,cpu}.so $W/plugins/
nvidia-smi -L; nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv
uname -a; ldd --version | head -1
time $B plugin check $W/plugins/libsuanli_plugin_nvidia.so
$B server --id 1 --listen 127.0.0.1:7400 --data-dir $W/server --bootstrap > $W/server.log 2>&1 &
for i in $(seq 50); do $B cluster members >/dev/null 2>&1 && break; sleep 0.2; done
cat > $W/q.toml <<Q
id = "default"
team = "ops"
[nominal]
cpu_milli = 1024000
memory_mib = 8388608
gpu_milli = 64000
Q
$B queue apply $W/q.toml
cat > $W/agent.toml <<A
servers = ["127.0.0.1:7400"]
node_id = "h200-node"
pool = "gpu"
data_dir = "$W/agent"
plugin_dir = "$W/plugins"
plugins = ["nvidia", "cpu"]
A
$B agent --config $W/agent.toml > $W/agent.log 2>&1 &
for i in $(seq 100); do $B node list 2>/dev/null | grep -q ready && break; sleep 0.2; done
$B node list; $B node get h200-node
cat > $W/whole.toml <<J
name = "whole-gpu"
queue = "default"
[[groups]]
name = "main"
[groups.resources]
cpu_milli = 1000
memory_mib = 1024
[groups.resources.devices]
kind = "gpu"
count = 1
[groups.task]
command = "/bin/sh"
args = ["-c", "echo CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES; nvidia-smi -L; nvidia-smi --query-gpu=uuid,memory.used --format=csv"]
J
sed -e 's/whole-gpu/frac-gpu/' -e 's/^count = 1/count = 1\nmilli = 500\nmemory_mib = 20480/' $W/whole.toml > $W/frac.toml
sed -i 's/^name = "main"/name = "main"\nreplicas = 2/' $W/frac.toml
$B job submit $W/whole.toml; $B job submit $W/frac.toml
for i in $(seq 100); do n=$($B job list 2>/dev/null | grep -c -E 'succeeded|failed'); [ "$n" -ge 2 ] && break; sleep 0.3; done
$B job list; $B job status 1; $B job status 2
$B job logs 1; $B job logs 2 --task main-0 2>&1; $B job logs 2 --task main-1 2>&1
$B node get h200-node
cp $W/server.log $W/agent.log $OUT/ 2>/dev/null
pkill -f "$W/" || true
