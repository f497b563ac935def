#!/bin/bash
# Serving with the embedded store's memory full over a slow disk tier, against the same engine
# without the tier: benches/vllm_connectors.py's kvstride-embedded and kvstride-disk, in one run,
# with the disk tier's folder on an ext4 file system on a loop device whose reads and writes the
# kernel throttles to RATE bytes a second (cgroup v1 blkio; the tier writes with O_DIRECT, which
# the throttle sees). Needs root and cgroup v1's blkio controller; everything it makes (the
# image, the loop device, the mount, the cgroup) is removed at the end.
#
#     sudo RATE=2MiB PYTHON=.venv-vllm/bin/python bash benches/slow_disk.sh [vllm_connectors.py arguments]
#     sudo RATE=2MiB PYTHON=.venv-vllm/bin/python bash benches/slow_disk.sh --serve [serve_gains.py arguments]
#
# Defaults: --models gemma3,qwen3_next --prompts 48 --reps 5 --trials 3 and a 16 MiB arena
# (store_bytes), so that the memory is full after the first rep; the goal is kvstride-disk's
# "generate s vs kvstride-embedded" <= 1.1x.
#
# --serve: benches/serve_gains.py under vllm serve instead, its kvstride-slow-disk cell on the
# throttled device and its kvstride-disk cell on a second loop device, unthrottled: the slow
# disk's hits, TTFT and throughput against the same run's on a fast disk (defaults: --models
# llama --cells none,kvstride-disk --workloads multi-turn,rag --reps 2).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv-vllm/bin/python}
rate_text=${RATE:-2MiB}
blkio=/sys/fs/cgroup/blkio
[ "$(id -u)" = 0 ] || { echo "slow_disk.sh: run as root (losetup, mount, cgroup)" >&2; exit 2; }
[ -d "$blkio" ] || { echo "slow_disk.sh: no cgroup v1 blkio controller at $blkio" >&2; exit 2; }
serve=0
if [ "${1:-}" = --serve ]; then serve=1; shift; fi
rate=$(PYTHONPATH=python "$python" -c "import sys; from kvstride.sizes import parse_size; print(parse_size(sys.argv[1]))" "$rate_text")

work=$(mktemp -d /var/tmp/kvstride-slow-disk.XXXXXX)
group="$blkio/kvstride-slow-disk-$$"
loop=""
fast_loop=""
cleanup() {
    set +e
    if [ -d "$group" ]; then  # one process a write: this shell among them
        for pid in $(cat "$group/cgroup.procs"); do echo "$pid" > "$blkio/cgroup.procs" 2>/dev/null; done
        rmdir "$group"
    fi
    mountpoint -q "$work/mnt" && umount "$work/mnt"
    mountpoint -q "$work/fast" && umount "$work/fast"
    [ -n "$loop" ] && losetup -d "$loop"
    [ -n "$fast_loop" ] && losetup -d "$fast_loop"
    rm -rf "$work"
}
trap cleanup EXIT

truncate -s 4G "$work/disk.img"
loop=$(losetup -f --show "$work/disk.img")
mkfs.ext4 -q "$loop"
mkdir -m 700 "$work/mnt"
mount "$loop" "$work/mnt"
chmod 700 "$work/mnt"
device=$(lsblk -ndo MAJ:MIN "$loop" | tr -d ' ')
mkdir "$group"
echo "$device $rate" > "$group/blkio.throttle.write_bps_device"
echo "$device $rate" > "$group/blkio.throttle.read_bps_device"
echo $$ > "$group/cgroup.procs"  # this shell and everything it starts from here on
echo "# slow disk: ext4 on $loop ($device), reads and writes throttled to $rate_text/s (cgroup v1 blkio)"

if [ "$serve" = 1 ]; then
    truncate -s 4G "$work/fast.img"
    fast_loop=$(losetup -f --show "$work/fast.img")
    mkfs.ext4 -q "$fast_loop"
    mkdir -m 700 "$work/fast"
    mount "$fast_loop" "$work/fast"
    chmod 700 "$work/fast"
    echo "# fast disk: ext4 on $fast_loop, unthrottled"
    # The defaults first: an option given on the command line overrides its default.
    "$python" benches/serve_gains.py --disk-path "$work/fast" --slow-disk-path "$work/mnt" \
        --models llama --cells none,kvstride-disk --workloads multi-turn,rag --reps 2 "$@"
    exit
fi
"$python" benches/vllm_connectors.py --configs kvstride-embedded,kvstride-disk \
    --kvstride-extra '{"store_bytes": "16MiB"}' --disk-path "$work/mnt" --disk-bytes 512MiB \
    --models gemma3,qwen3_next --prompts 48 --reps 5 --trials 3 "$@"
