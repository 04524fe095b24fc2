#!/usr/bin/env bash
# ListDevices: the daemon's devices (names, memory, what backs them), the
# peer-access matrix (one row per device) and the backend in use.
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext "${target[@]}" xreduce.v1.CrossDeviceOps/ListDevices
