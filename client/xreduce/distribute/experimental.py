"""``xreduce.distribute.experimental``: the ``tf.distribute.experimental`` names.

Example:
    >>> from xreduce.distribute import experimental
    >>> options = experimental.CommunicationOptions(
    ...     bytes_per_pack=50 * 1024 * 1024, timeout_seconds=120.0,
    ...     implementation=experimental.CommunicationImplementation.NCCL)
    >>> options.implementation.name, [i.name for i in experimental.CommunicationImplementation]
    ('NCCL', ['AUTO', 'RING', 'NCCL'])
"""

from xreduce._ops import CommunicationImplementation, CommunicationOptions

__all__ = ["CommunicationImplementation", "CommunicationOptions"]
