#!/usr/bin/env bash
# Reduce (SUM) a sparse value, TF's IndexedSlices of a [4, 2] embedding's gradient: the
# replicas' rows and indices are concatenated in device order (never added), and both
# devices get rows [1,2] [3,4] [5,6] at indices 0, 3, 0 (dense: row 0 = [6,8], row 3 = [3,4]).
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext -d @ "${target[@]}" xreduce.v1.CrossDeviceOps/Reduce <<'JSON'
{
  "reduce_op": "REDUCE_OP_SUM",
  "value": {"components": [
    {"device": "CPU:0", "indexed_slices": {
      "values": {"dtype": "DATA_TYPE_FLOAT32", "shape": [1, 2], "float_values": [1, 2]},
      "indices": {"dtype": "DATA_TYPE_INT64", "shape": [1], "int_values": [0]},
      "dense_shape": [4, 2]}},
    {"device": "CPU:1", "indexed_slices": {
      "values": {"dtype": "DATA_TYPE_FLOAT32", "shape": [2, 2], "float_values": [3, 4, 5, 6]},
      "indices": {"dtype": "DATA_TYPE_INT64", "shape": [2], "int_values": [3, 0]},
      "dense_shape": [4, 2]}}
  ]}
}
JSON
