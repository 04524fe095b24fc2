#!/usr/bin/env bash
# BatchReduce (MEAN) two values that both live on CPU:0 and CPU:1; they are
# all-reduced together, split into 2 packs. Each result is the element-wise
# mean, on both devices: [[3,4],[5,6]] and [20,30].
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext -d @ "${target[@]}" xreduce.v1.CrossDeviceOps/BatchReduce <<'JSON'
{
  "reduce_op": "REDUCE_OP_MEAN",
  "num_packs": 2,
  "pairs": [
    {"value": {"components": [
      {"device": "CPU:0", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2, 2], "float_values": [1, 2, 3, 4]}},
      {"device": "CPU:1", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2, 2], "float_values": [5, 6, 7, 8]}}
    ]}},
    {"value": {"components": [
      {"device": "CPU:0", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2], "float_values": [10, 20]}},
      {"device": "CPU:1", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2], "float_values": [30, 40]}}
    ]}}
  ]
}
JSON
