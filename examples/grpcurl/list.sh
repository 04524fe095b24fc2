#!/usr/bin/env bash
# Discover the daemon through server reflection: list its services, then
# describe the CrossDeviceOps service and the ReduceRequest message.
set -euo pipefail

source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS

grpcurl -plaintext "${target[@]}" list
grpcurl -plaintext "${target[@]}" describe xreduce.v1.CrossDeviceOps
grpcurl -plaintext "${target[@]}" describe xreduce.v1.ReduceRequest
