#!/usr/bin/env bash
# Reduce (SUM) a float32 value with one component per device: [1,2,3] on
# CPU:0 plus [10,20,30] on CPU:1 gives [11,22,33] on both devices. Typed
# JSON values (float_values) in the request mean typed values in the reply.
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext -d @ "${target[@]}" xreduce.v1.CrossDeviceOps/Reduce <<'JSON'
{
  "reduce_op": "REDUCE_OP_SUM",
  "value": {"components": [
    {"device": "CPU:0", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [3], "float_values": [1, 2, 3]}},
    {"device": "CPU:1", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [3], "float_values": [10, 20, 30]}}
  ]}
}
JSON
