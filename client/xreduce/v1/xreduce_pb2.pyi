import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT64: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_INT16: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_UINT16: _ClassVar[DataType]
    DATA_TYPE_UINT32: _ClassVar[DataType]
    DATA_TYPE_UINT64: _ClassVar[DataType]
    DATA_TYPE_COMPLEX64: _ClassVar[DataType]
    DATA_TYPE_COMPLEX128: _ClassVar[DataType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    REDUCE_OP_SUM: _ClassVar[ReduceOp]
    REDUCE_OP_MEAN: _ClassVar[ReduceOp]

class Algorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALGORITHM_UNSPECIFIED: _ClassVar[Algorithm]
    ALGORITHM_HIERARCHICAL_COPY: _ClassVar[Algorithm]
    ALGORITHM_REDUCTION_TO_ONE_DEVICE: _ClassVar[Algorithm]
    ALGORITHM_NCCL: _ClassVar[Algorithm]

class Route(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_UNSPECIFIED: _ClassVar[Route]
    ROUTE_IDENTITY: _ClassVar[Route]
    ROUTE_HIERARCHICAL_COPY: _ClassVar[Route]
    ROUTE_REDUCTION_TO_ONE_DEVICE: _ClassVar[Route]
    ROUTE_NCCL: _ClassVar[Route]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT64: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_INT16: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_UINT16: DataType
DATA_TYPE_UINT32: DataType
DATA_TYPE_UINT64: DataType
DATA_TYPE_COMPLEX64: DataType
DATA_TYPE_COMPLEX128: DataType
REDUCE_OP_UNSPECIFIED: ReduceOp
REDUCE_OP_SUM: ReduceOp
REDUCE_OP_MEAN: ReduceOp
ALGORITHM_UNSPECIFIED: Algorithm
ALGORITHM_HIERARCHICAL_COPY: Algorithm
ALGORITHM_REDUCTION_TO_ONE_DEVICE: Algorithm
ALGORITHM_NCCL: Algorithm
ROUTE_UNSPECIFIED: Route
ROUTE_IDENTITY: Route
ROUTE_HIERARCHICAL_COPY: Route
ROUTE_REDUCTION_TO_ONE_DEVICE: Route
ROUTE_NCCL: Route

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "raw_data", "float_values", "int_values", "uint_values", "region", "streamed")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_DATA_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUES_FIELD_NUMBER: _ClassVar[int]
    INT_VALUES_FIELD_NUMBER: _ClassVar[int]
    UINT_VALUES_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw_data: bytes
    float_values: _containers.RepeatedScalarFieldContainer[float]
    int_values: _containers.RepeatedScalarFieldContainer[int]
    uint_values: _containers.RepeatedScalarFieldContainer[int]
    region: RegionSlice
    streamed: bool
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., raw_data: _Optional[bytes] = ..., float_values: _Optional[_Iterable[float]] = ..., int_values: _Optional[_Iterable[int]] = ..., uint_values: _Optional[_Iterable[int]] = ..., region: _Optional[_Union[RegionSlice, _Mapping]] = ..., streamed: _Optional[bool] = ...) -> None: ...

class RegionSlice(_message.Message):
    __slots__ = ("name", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class Component(_message.Message):
    __slots__ = ("device", "tensor", "copy_of", "indexed_slices")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    COPY_OF_FIELD_NUMBER: _ClassVar[int]
    INDEXED_SLICES_FIELD_NUMBER: _ClassVar[int]
    device: str
    tensor: Tensor
    copy_of: int
    indexed_slices: IndexedSlices
    def __init__(self, device: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., copy_of: _Optional[int] = ..., indexed_slices: _Optional[_Union[IndexedSlices, _Mapping]] = ...) -> None: ...

class IndexedSlices(_message.Message):
    __slots__ = ("values", "indices", "dense_shape")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    DENSE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    values: Tensor
    indices: Tensor
    dense_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Union[Tensor, _Mapping]] = ..., indices: _Optional[_Union[Tensor, _Mapping]] = ..., dense_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DistributedValue(_message.Message):
    __slots__ = ("components", "fused_parts")
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FUSED_PARTS_FIELD_NUMBER: _ClassVar[int]
    components: _containers.RepeatedCompositeFieldContainer[Component]
    fused_parts: _containers.RepeatedCompositeFieldContainer[FusedPart]
    def __init__(self, components: _Optional[_Iterable[_Union[Component, _Mapping]]] = ..., fused_parts: _Optional[_Iterable[_Union[FusedPart, _Mapping]]] = ...) -> None: ...

class FusedPart(_message.Message):
    __slots__ = ("shape", "index")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    index: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("name", "short_name", "device_type", "index", "memory_bytes", "physical_device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHORT_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    short_name: str
    device_type: str
    index: int
    memory_bytes: int
    physical_device: str
    def __init__(self, name: _Optional[str] = ..., short_name: _Optional[str] = ..., device_type: _Optional[str] = ..., index: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., physical_device: _Optional[str] = ...) -> None: ...

class PeerRow(_message.Message):
    __slots__ = ("can_access",)
    CAN_ACCESS_FIELD_NUMBER: _ClassVar[int]
    can_access: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, can_access: _Optional[_Iterable[bool]] = ...) -> None: ...

class CollectiveSpec(_message.Message):
    __slots__ = ("group", "num_processes", "process_id", "sequence", "name", "epoch", "abort")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    group: str
    num_processes: int
    process_id: int
    sequence: int
    name: str
    epoch: int
    abort: str
    def __init__(self, group: _Optional[str] = ..., num_processes: _Optional[int] = ..., process_id: _Optional[int] = ..., sequence: _Optional[int] = ..., name: _Optional[str] = ..., epoch: _Optional[int] = ..., abort: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "peer_access", "backend")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PEER_ACCESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    peer_access: _containers.RepeatedCompositeFieldContainer[PeerRow]
    backend: str
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., peer_access: _Optional[_Iterable[_Union[PeerRow, _Mapping]]] = ..., backend: _Optional[str] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("reduce_op", "value", "destinations", "num_packs", "algorithm", "reduce_to_device", "timeout", "collective", "output", "output_one_copy")
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PACKS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    REDUCE_TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ONE_COPY_FIELD_NUMBER: _ClassVar[int]
    reduce_op: ReduceOp
    value: DistributedValue
    destinations: _containers.RepeatedScalarFieldContainer[str]
    num_packs: int
    algorithm: Algorithm
    reduce_to_device: str
    timeout: _duration_pb2.Duration
    collective: CollectiveSpec
    output: RegionSlice
    output_one_copy: bool
    def __init__(self, reduce_op: _Optional[_Union[ReduceOp, str]] = ..., value: _Optional[_Union[DistributedValue, _Mapping]] = ..., destinations: _Optional[_Iterable[str]] = ..., num_packs: _Optional[int] = ..., algorithm: _Optional[_Union[Algorithm, str]] = ..., reduce_to_device: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., collective: _Optional[_Union[CollectiveSpec, _Mapping]] = ..., output: _Optional[_Union[RegionSlice, _Mapping]] = ..., output_one_copy: _Optional[bool] = ...) -> None: ...

class ReduceResponse(_message.Message):
    __slots__ = ("result", "route")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    result: DistributedValue
    route: Route
    def __init__(self, result: _Optional[_Union[DistributedValue, _Mapping]] = ..., route: _Optional[_Union[Route, str]] = ...) -> None: ...

class ReducePair(_message.Message):
    __slots__ = ("value", "destinations")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    value: DistributedValue
    destinations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, value: _Optional[_Union[DistributedValue, _Mapping]] = ..., destinations: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchReduceRequest(_message.Message):
    __slots__ = ("reduce_op", "pairs", "num_packs", "algorithm", "reduce_to_device", "timeout", "collective", "output", "output_one_copy")
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    NUM_PACKS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    REDUCE_TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ONE_COPY_FIELD_NUMBER: _ClassVar[int]
    reduce_op: ReduceOp
    pairs: _containers.RepeatedCompositeFieldContainer[ReducePair]
    num_packs: int
    algorithm: Algorithm
    reduce_to_device: str
    timeout: _duration_pb2.Duration
    collective: CollectiveSpec
    output: RegionSlice
    output_one_copy: bool
    def __init__(self, reduce_op: _Optional[_Union[ReduceOp, str]] = ..., pairs: _Optional[_Iterable[_Union[ReducePair, _Mapping]]] = ..., num_packs: _Optional[int] = ..., algorithm: _Optional[_Union[Algorithm, str]] = ..., reduce_to_device: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., collective: _Optional[_Union[CollectiveSpec, _Mapping]] = ..., output: _Optional[_Union[RegionSlice, _Mapping]] = ..., output_one_copy: _Optional[bool] = ...) -> None: ...

class ReduceResult(_message.Message):
    __slots__ = ("result", "route")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    result: DistributedValue
    route: Route
    def __init__(self, result: _Optional[_Union[DistributedValue, _Mapping]] = ..., route: _Optional[_Union[Route, str]] = ...) -> None: ...

class BatchReduceResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReduceResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReduceResult, _Mapping]]] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("tensor", "source_device", "destinations", "timeout", "collective", "source_process", "output")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PROCESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    source_device: str
    destinations: _containers.RepeatedScalarFieldContainer[str]
    timeout: _duration_pb2.Duration
    collective: CollectiveSpec
    source_process: int
    output: RegionSlice
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., source_device: _Optional[str] = ..., destinations: _Optional[_Iterable[str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., collective: _Optional[_Union[CollectiveSpec, _Mapping]] = ..., source_process: _Optional[int] = ..., output: _Optional[_Union[RegionSlice, _Mapping]] = ...) -> None: ...

class BroadcastResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: DistributedValue
    def __init__(self, result: _Optional[_Union[DistributedValue, _Mapping]] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("group", "num_processes", "process_id", "devices", "timeout", "coordinator")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    group: str
    num_processes: int
    process_id: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    timeout: _duration_pb2.Duration
    coordinator: str
    def __init__(self, group: _Optional[str] = ..., num_processes: _Optional[int] = ..., process_id: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., coordinator: _Optional[str] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("group", "epoch", "process_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    process_id: int
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., process_id: _Optional[int] = ...) -> None: ...

class LeaveGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProcessDevices(_message.Message):
    __slots__ = ("process_id", "devices")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, process_id: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinGroupResponse(_message.Message):
    __slots__ = ("local_devices", "global_devices", "processes", "epoch", "group", "nodes", "node_index", "engine")
    LOCAL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    local_devices: _containers.RepeatedScalarFieldContainer[str]
    global_devices: _containers.RepeatedScalarFieldContainer[str]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessDevices]
    epoch: int
    group: str
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNode]
    node_index: int
    engine: str
    def __init__(self, local_devices: _Optional[_Iterable[str]] = ..., global_devices: _Optional[_Iterable[str]] = ..., processes: _Optional[_Iterable[_Union[ProcessDevices, _Mapping]]] = ..., epoch: _Optional[int] = ..., group: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[ClusterNode, _Mapping]]] = ..., node_index: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class ClusterNode(_message.Message):
    __slots__ = ("index", "node_id", "address", "processes", "backend")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    index: int
    node_id: str
    address: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessDevices]
    backend: str
    def __init__(self, index: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessDevices, _Mapping]]] = ..., backend: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "max_request_bytes", "max_inflight_bytes", "max_collectives", "collective_timeout_seconds", "workers", "max_mapped_bytes")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_request_bytes: int
    max_inflight_bytes: int
    max_collectives: int
    collective_timeout_seconds: float
    workers: int
    max_mapped_bytes: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., max_collectives: _Optional[int] = ..., collective_timeout_seconds: _Optional[float] = ..., workers: _Optional[int] = ..., max_mapped_bytes: _Optional[int] = ...) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("method", "calls_by_code", "bytes_in", "bytes_out")
    class CallsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    method: str
    calls_by_code: _containers.ScalarMap[str, int]
    bytes_in: int
    bytes_out: int
    def __init__(self, method: _Optional[str] = ..., calls_by_code: _Optional[_Mapping[str, int]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "backend", "devices", "uptime_seconds", "limits", "methods", "inflight_bytes", "collectives_waiting", "tls", "mutual_tls", "token_auth", "groups", "local_lane", "local_lane_connections", "local_lane_calls", "mapped_bytes", "oom_score_adj", "node_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_WAITING_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MUTUAL_TLS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AUTH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LANE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LANE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LANE_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OOM_SCORE_ADJ_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    uptime_seconds: float
    limits: Limits
    methods: _containers.RepeatedCompositeFieldContainer[MethodStats]
    inflight_bytes: int
    collectives_waiting: int
    tls: bool
    mutual_tls: bool
    token_auth: bool
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    local_lane: str
    local_lane_connections: int
    local_lane_calls: int
    mapped_bytes: int
    oom_score_adj: int
    node_id: str
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., methods: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ..., inflight_bytes: _Optional[int] = ..., collectives_waiting: _Optional[int] = ..., tls: _Optional[bool] = ..., mutual_tls: _Optional[bool] = ..., token_auth: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., local_lane: _Optional[str] = ..., local_lane_connections: _Optional[int] = ..., local_lane_calls: _Optional[int] = ..., mapped_bytes: _Optional[int] = ..., oom_score_adj: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class LostPeer(_message.Message):
    __slots__ = ("node_index", "address", "process_ids", "reason")
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_index: int
    address: str
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, node_index: _Optional[int] = ..., address: _Optional[str] = ..., process_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group", "epoch", "state", "num_processes", "node_index", "nodes", "engine", "coordinator", "cross_node_collectives", "cross_node_bytes", "cross_node_seconds", "lost", "reason")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    CROSS_NODE_COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    CROSS_NODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CROSS_NODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    state: str
    num_processes: int
    node_index: int
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNode]
    engine: str
    coordinator: bool
    cross_node_collectives: int
    cross_node_bytes: int
    cross_node_seconds: float
    lost: _containers.RepeatedCompositeFieldContainer[LostPeer]
    reason: str
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., num_processes: _Optional[int] = ..., node_index: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[ClusterNode, _Mapping]]] = ..., engine: _Optional[str] = ..., coordinator: _Optional[bool] = ..., cross_node_collectives: _Optional[int] = ..., cross_node_bytes: _Optional[int] = ..., cross_node_seconds: _Optional[float] = ..., lost: _Optional[_Iterable[_Union[LostPeer, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("probe_shm_key", "probe_nonce")
    PROBE_SHM_KEY_FIELD_NUMBER: _ClassVar[int]
    PROBE_NONCE_FIELD_NUMBER: _ClassVar[int]
    probe_shm_key: str
    probe_nonce: bytes
    def __init__(self, probe_shm_key: _Optional[str] = ..., probe_nonce: _Optional[bytes] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "shared_memory", "shared_memory_error", "cuda_ipc", "local_lane")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_ERROR_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LANE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shared_memory: bool
    shared_memory_error: str
    cuda_ipc: bool
    local_lane: str
    def __init__(self, session_id: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., shared_memory_error: _Optional[str] = ..., cuda_ipc: _Optional[bool] = ..., local_lane: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "device_id", "event_handle")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    device_id: int
    event_handle: bytes
    def __init__(self, mem_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., event_handle: _Optional[bytes] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "shm_key", "cuda_ipc", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_KEY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shm_key: str
    cuda_ipc: CudaIpcHandle
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., shm_key: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Region(_message.Message):
    __slots__ = ("name", "kind", "shm_key", "offset", "byte_size", "in_use")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    shm_key: str
    offset: int
    byte_size: int
    in_use: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., shm_key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., in_use: _Optional[int] = ...) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("pair", "component", "offset", "data")
    PAIR_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    pair: int
    component: int
    offset: int
    data: bytes
    def __init__(self, pair: _Optional[int] = ..., component: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReduceStreamRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BatchReduceRequest
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[BatchReduceRequest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ReduceStreamResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BatchReduceResponse
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[BatchReduceResponse, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class NodeIdentity(_message.Message):
    __slots__ = ("node_id", "address", "devices", "backend", "engines")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("group", "num_processes", "process_id", "node", "devices", "timeout", "last_epoch")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    group: str
    num_processes: int
    process_id: int
    node: NodeIdentity
    devices: _containers.RepeatedScalarFieldContainer[str]
    timeout: _duration_pb2.Duration
    last_epoch: int
    def __init__(self, group: _Optional[str] = ..., num_processes: _Optional[int] = ..., process_id: _Optional[int] = ..., node: _Optional[_Union[NodeIdentity, _Mapping]] = ..., devices: _Optional[_Iterable[str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., last_epoch: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("epoch", "group", "nodes", "engine", "peer_timeout_seconds", "heartbeat_interval_seconds")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PEER_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    group: str
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNode]
    engine: str
    peer_timeout_seconds: float
    heartbeat_interval_seconds: float
    def __init__(self, epoch: _Optional[int] = ..., group: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[ClusterNode, _Mapping]]] = ..., engine: _Optional[str] = ..., peer_timeout_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("group", "epoch", "node_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    node_id: str
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: EpochState
    def __init__(self, state: _Optional[_Union[EpochState, _Mapping]] = ...) -> None: ...

class EpochState(_message.Message):
    __slots__ = ("ok", "epoch", "lost", "reason", "left")
    OK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    epoch: int
    lost: _containers.RepeatedCompositeFieldContainer[LostPeer]
    reason: str
    left: bool
    def __init__(self, ok: _Optional[bool] = ..., epoch: _Optional[int] = ..., lost: _Optional[_Iterable[_Union[LostPeer, _Mapping]]] = ..., reason: _Optional[str] = ..., left: _Optional[bool] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("group", "epoch", "node_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    node_id: str
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: EpochState
    def __init__(self, state: _Optional[_Union[EpochState, _Mapping]] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("group", "epoch", "node_id", "reason", "process_ids", "left")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    node_id: str
    reason: str
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    left: bool
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., process_ids: _Optional[_Iterable[int]] = ..., left: _Optional[bool] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: EpochState
    def __init__(self, state: _Optional[_Union[EpochState, _Mapping]] = ...) -> None: ...

class StoreSetRequest(_message.Message):
    __slots__ = ("group", "epoch", "key", "value")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    key: str
    value: bytes
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class StoreSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreGetRequest(_message.Message):
    __slots__ = ("group", "epoch", "key", "timeout")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    key: str
    timeout: _duration_pb2.Duration
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., key: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StoreGetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class StoreAddRequest(_message.Message):
    __slots__ = ("group", "epoch", "key", "amount")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    key: str
    amount: int
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class StoreAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...
