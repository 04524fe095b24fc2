#!/usr/bin/env bash
# Broadcast one float32 tensor from CPU:0 to CPU:1 and CPU:2: the reply holds
# one copy per destination.
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext -d @ "${target[@]}" xreduce.v1.CrossDeviceOps/Broadcast <<'JSON'
{
  "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2, 2], "float_values": [1.5, -2, 0.25, 4]},
  "source_device": "CPU:0",
  "destinations": ["CPU:1", "CPU:2"]
}
JSON
