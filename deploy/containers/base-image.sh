#!/usr/bin/env bash
# A local Debian bookworm image with Python 3.11, venv and pip, for building pdserve's images on a machine that
# reaches Debian's archive and PyPI but no container registry (CI, the development VM). Tagged
# localhost/pdserve-base:bookworm; built once per machine (about a minute), then reused.
# Also installs podman (with runc and the cgroupfs manager, which work on these kernels) when it is missing. Root only.
set -euo pipefail
IMAGE=localhost/pdserve-base:bookworm
export DEBIAN_FRONTEND=noninteractive
missing=()
for tool in podman debootstrap runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  apt-get update -qq && apt-get install -y -qq podman debootstrap runc >/dev/null
fi
if [ ! -f /etc/containers/containers.conf ] || ! grep -q cgroup_manager /etc/containers/containers.conf; then
  mkdir -p /etc/containers
  # crun and the systemd cgroup manager fail on hybrid-cgroup kernels; podman's default ulimits exceed the hard ones.
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' \
    >> /etc/containers/containers.conf
fi
podman image exists "$IMAGE" && exit 0
archive=$(awk '$1 == "URIs:" && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
archive=${archive:-http://deb.debian.org/debian}
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,libgomp1 \
  bookworm "$rootfs" "${archive%/}" >/dev/null
# The host's CA bundle: package downloads here may pass through a proxy whose CA only the host trusts.
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "built $IMAGE"
