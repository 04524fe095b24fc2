"""Workloads of ``xreduce bench --workload``: a training step's gradients, as a list of shapes.

A trainer does not all-reduce one large tensor: each step it reduces every
gradient of its model, of mixed sizes. A workload is that list of shapes;
``--workload NAME`` names a built-in one, ``--workload-file FILE.json`` reads
any (a JSON list of shapes, each a list of dimensions).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

RESNET50_SHAPES: tuple[tuple[int, ...], ...] = (
    (64, 3, 7, 7), (64,), (64,), (64, 64, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1),
    (256,), (256,), (256, 64, 1, 1), (256,), (256,), (64, 256, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,),
    (256, 64, 1, 1), (256,), (256,), (64, 256, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1),
    (256,), (256,), (128, 256, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1), (512,),
    (512,), (512, 256, 1, 1), (512,), (512,), (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,),
    (512, 128, 1, 1), (512,), (512,), (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,),
    (512, 128, 1, 1), (512,), (512,), (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,),
    (512, 128, 1, 1), (512,), (512,), (256, 512, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,),
    (1024, 256, 1, 1), (1024,), (1024,), (1024, 512, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (512, 1024, 1, 1), (512,), (512,),
    (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1), (2048,), (2048,), (2048, 1024, 1, 1), (2048,), (2048,),
    (512, 2048, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1), (2048,), (2048,),
    (512, 2048, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1), (2048,), (2048,),
    (1000, 2048), (1000,),
)
"""The 161 parameters of ResNet-50 (torchvision's ``resnet50()``, v1.5) in registration order, as
``model.parameters()`` yields them, transcribed from torchvision's ``models/resnet.py`` (``Bottleneck`` blocks
``[3, 4, 6, 3]``; torchvision itself is not a dependency): the stem's convolution and batch norm, then each of
the 16 bottleneck blocks' three convolutions and batch norms (weight, bias), the first block of each stage
followed by its downsampling convolution and batch norm, then the classifier. 25,557,032 parameters (102 MB
in float32)."""

BUILT_IN = {"resnet50": RESNET50_SHAPES}
"""The workloads ``--workload`` names."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named list of tensor shapes, one per gradient.

    Example:
        >>> w = Workload("tiny", ((2, 3), (4,)))
        >>> w.elements, w.sizes(4), w.nbytes(4)
        (10, (24, 16), 40)
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def elements(self) -> int:
        """Elements of all the tensors together."""
        return sum(self.sizes(1))

    def sizes(self, itemsize: int) -> tuple[int, ...]:
        """Each tensor's elements times ``itemsize`` (1: element counts)."""
        return tuple(math.prod(s) * itemsize for s in self.shapes)

    def nbytes(self, itemsize: int) -> int:
        """Bytes of all the tensors together."""
        return self.elements * itemsize


def built_in(name: str) -> Workload:
    """The built-in workload ``name``.

    Raises:
        ValueError: an unknown name, naming the known ones.

    Example:
        >>> w = built_in("resnet50")
        >>> len(w.shapes), w.elements
        (161, 25557032)
    """
    if name not in BUILT_IN:
        raise ValueError(f"--workload: unknown workload {name!r}; known: {', '.join(BUILT_IN)}")
    return Workload(name, BUILT_IN[name])


def parse_shapes(data: Any, where: str) -> tuple[tuple[int, ...], ...]:
    """Checks a JSON list of shapes and returns it as tuples.

    Raises:
        ValueError: naming ``where``, the index and the value that is not a shape.

    Example:
        >>> parse_shapes([[2, 3], [4], []], "w.json")
        ((2, 3), (4,), ())
        >>> parse_shapes([[2, -1]], "w.json")
        Traceback (most recent call last):
        ...
        ValueError: w.json[0]: a shape is a list of whole numbers >= 0; got [2, -1]
    """
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: must be a non-empty JSON list of shapes (lists of dimensions); got {data!r:.80}")
    shapes = []
    for i, shape in enumerate(data):
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{where}[{i}]: a shape is a list of whole numbers >= 0; got {shape!r:.80}")
        shapes.append(tuple(shape))
    if not any(math.prod(s) for s in shapes):
        raise ValueError(f"{where}: every shape holds 0 elements; a workload needs at least one element")
    return tuple(shapes)


def from_file(path: str) -> Workload:
    """The workload in the JSON file ``path`` (a list of shapes), named after the file.

    Raises:
        ValueError: the file is not JSON, or not a list of shapes (naming the file and the entry).
        OSError: the file cannot be read.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--workload-file {path}: not JSON: {e}") from None
    name = path.rsplit("/", 1)[-1].removesuffix(".json")
    return Workload(name, parse_shapes(data, f"--workload-file {path}"))


def ddp_buckets(sizes: tuple[int, ...], first_cap: int = 1 << 20, cap: int = 25 << 20) -> list[list[int]]:
    """The buckets PyTorch's DistributedDataParallel puts gradients of ``sizes`` bytes in: tensors in reverse
    registration order (the order backward produces them), each bucket closed once it holds ``cap`` bytes or
    more (``first_cap`` for the first, DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``; ``bucket_cap_mb=25``).

    Returns:
        Each bucket's tensor indices, in the order the buckets are all-reduced.

    Example:
        >>> ddp_buckets((4, 4, 4, 4), first_cap=4, cap=8)
        [[3], [2, 1], [0]]
    """
    buckets: list[list[int]] = [[]]
    filled, limit = 0, first_cap
    for t in reversed(range(len(sizes))):
        buckets[-1].append(t)
        filled += sizes[t]
        if filled >= limit and t:
            buckets.append([])
            filled, limit = 0, cap
    return buckets
