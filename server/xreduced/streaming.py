"""ReduceStream: BatchReduce in chunks (being written)."""

import grpc


def reduce_stream(service, request_iterator, context):
    """Serves one ReduceStream call."""
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "ReduceStream is not written yet")
    yield
