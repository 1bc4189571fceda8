#!/usr/bin/env bash
# A base image for docker/Dockerfile.cpu made from Debian's packages alone, for a box that
# reaches no image registry: Debian 12 "bookworm" (its Python 3.11 is what the torch wheel
# needs) with python3, its venv module and CA certificates, made with debootstrap and
# `docker import`. The host's CA bundle goes in too, and pip is pointed at it, for a network
# whose outgoing HTTPS is re-signed by a proxy. About 2 minutes (132 s on a busy 2-core box); run as root:
#
#   docker/base-image.sh [TAG]        (default nanoflex-base:bookworm)
#
# Settings: DEBIAN_MIRROR (default http://deb.debian.org/debian), HOST_CA_BUNDLE (default
# /etc/ssl/certs/ca-certificates.crt; none: trust Debian's certificates only).
set -euo pipefail
tag=${1:-nanoflex-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
bundle=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

if [ "$(id -u)" != 0 ]; then
  echo "base-image.sh: debootstrap needs root" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

root=$(mktemp -d /var/tmp/nanoflex-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"

if [ -f "$bundle" ]; then
  # a file of its own: Debian's update-ca-certificates rewrites its bundle, not this one
  cp "$bundle" "$root/etc/ssl/certs/host-ca-bundle.pem"
  printf '[global]\ncert = /etc/ssl/certs/host-ca-bundle.pem\n' >"$root/etc/pip.conf"
fi
# what a registry's base image leaves out: no package lists, no caches
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb

tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  - "$tag" >/dev/null
echo "$tag"
