#!/usr/bin/env bash
# Installs the Debian packages idem needs to build, test and benchmark, skipping those present.
# Product: liburing, xxHash, lz4. Tests and benchmarks: criterion, hiredis, redis, python3-redis,
# LMDB, SQLite, PostgreSQL client tools come from the same list; btrfs-progs for the disk-full
# test on a copy-on-write file system.
set -euo pipefail
pkgs=(build-essential cmake pkg-config liburing-dev libxxhash-dev liblz4-dev
      libcriterion-dev libhiredis-dev liblmdb-dev libsqlite3-dev
      redis-server redis-tools python3-redis clang btrfs-progs)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
