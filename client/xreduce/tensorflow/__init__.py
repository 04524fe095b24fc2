"""``xreduce.tensorflow``: real ``tf.distribute`` classes whose reductions run in the xreduce daemon.

Needs TensorFlow (``pip install 'xreduce[tensorflow]'``); ``import xreduce`` never imports it.

    >>> import tensorflow as tf
    >>> import xreduce.tensorflow
    >>> strategy = tf.distribute.MirroredStrategy(
    ...     ["/cpu:0"], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce())
    >>> strategy.num_replicas_in_sync
    1
"""

from xreduce.tensorflow._ops import HierarchicalCopyAllReduce, ReductionToOneDevice
from xreduce.tensorflow._strategy import MirroredStrategy

__all__ = ["HierarchicalCopyAllReduce", "MirroredStrategy", "ReductionToOneDevice"]
