#!/usr/bin/env bash
# Build the CPU worker and router images with podman on this machine, where no container registry is reachable:
# the base is a local Debian image (base-image.sh) and torch's CPU wheel comes from /opt/wheels when it is there.
# Tags localhost/pdserve-cpu:dev and localhost/pdserve-router:dev; prints each build's time and size. Root only.
#   bash deploy/containers/build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/containers/base-image.sh
args=(--network host --build-arg BASE_IMAGE=localhost/pdserve-base:bookworm)
if [ -d /opt/wheels ]; then
  args+=(-v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels --build-arg TORCH_INDEX_URL=)
fi
for target in router cpu; do
  started=$SECONDS
  podman build -q "${args[@]}" --target "$target" -t "localhost/pdserve-$target:dev" . >/dev/null
  size=$(podman image inspect --format '{{.Size}}' "localhost/pdserve-$target:dev")
  echo "built localhost/pdserve-$target:dev in $((SECONDS - started)) s, $((size / 1000000)) MB"
done
