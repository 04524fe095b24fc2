"""The wire contract's Python side, shared by the daemon (``xreduced``) and the SDK (``xreduce``).

The messages are the generated stubs in :mod:`xreduce.v1`; what both sides must
also agree on lives here, once, and both import it:

* :mod:`~xreduce.wire.codec`: numpy arrays <-> ``Tensor`` messages, the dtypes the wire carries;
* :mod:`~xreduce.wire.devices`: device names in TensorFlow's DeviceSpec forms;
* :mod:`~xreduce.wire.framing`: ReduceStream's chunk messages and their sizes;
* :mod:`~xreduce.wire.layout`: where results go in an output region;
* :mod:`~xreduce.wire.contract`: service and method names, the session metadata key,
  the default address, the MEAN promotion rule;
* :mod:`~xreduce.wire.cuda_ipc`: CUDA IPC handles for CuPy arrays (CuPy imported on use);
* :mod:`~xreduce.wire.addresses`: the daemon's address forms and their checks.

The daemon imports nothing else of the SDK but this package and the stubs.

Example:
    >>> from xreduce import wire
    >>> wire.method_path("BatchReduce"), wire.DeviceName.parse("gpu:1").short
    ('/xreduce.v1.CrossDeviceOps/BatchReduce', 'GPU:1')
"""

from xreduce.wire import codec, contract, cuda_ipc, devices, framing, layout
from xreduce.wire.codec import SUPPORTED_DTYPES, CodecError
from xreduce.wire.contract import (
    DEFAULT_ADDRESS,
    METHOD_PREFIX,
    METHODS,
    SERVICE_NAME,
    SESSION_METADATA,
    mean_dtype,
    method_path,
)
from xreduce.wire.devices import DeviceName, canonical
from xreduce.wire.framing import (
    CHUNK_OVERHEAD_BYTES,
    DEFAULT_CHUNK_BYTES,
    REPLY_CHUNK_BYTES,
    chunk_message,
    chunk_message_size,
    streamed_tensor,
)
from xreduce.wire.layout import OUTPUT_ALIGNMENT, OutputLayout, output_layout

__all__ = [
    "CHUNK_OVERHEAD_BYTES",
    "DEFAULT_ADDRESS",
    "DEFAULT_CHUNK_BYTES",
    "METHODS",
    "METHOD_PREFIX",
    "OUTPUT_ALIGNMENT",
    "REPLY_CHUNK_BYTES",
    "SERVICE_NAME",
    "SESSION_METADATA",
    "SUPPORTED_DTYPES",
    "CodecError",
    "DeviceName",
    "OutputLayout",
    "canonical",
    "chunk_message",
    "chunk_message_size",
    "codec",
    "contract",
    "cuda_ipc",
    "devices",
    "framing",
    "layout",
    "mean_dtype",
    "method_path",
    "output_layout",
    "streamed_tensor",
]
