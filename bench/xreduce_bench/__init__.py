"""xreduce_bench: the tools that measure and stress xreduce, apart from the SDK.

``import xreduce`` never loads this package. Nothing is imported here: each
tool is its own module.

- ``command`` runs ``xreduce bench`` (the SDK's command hands its arguments
  over), with ``sweep``, ``oracle``, ``table``, ``workers`` and ``peers``,
  through the SDK's public API only; with ``--nodes``, ``multinode`` runs it
  across nodes and ``multinode_report`` prints it; with ``--big-tensors``,
  ``big`` runs it (``big_workers`` in the workers, ``footprint`` samples
  their memory, ``big_report`` prints it);
- ``netns`` makes several "nodes" on one machine (network namespaces on a
  bridge, shaped or cut links) for ``--nodes`` and the multi-node tests;
- ``daemon`` runs a real ``xreduced`` in a subprocess, for the scripts in
  ``bench/``, for the tests and for ``xreduce bench --embedded``;
- ``mp_worker`` is one scripted process of a multi-process job
  (``bench/multiprocess_faults.py`` and the multi-process tests);
- ``fuzzing`` generates malformed requests (``bench/fuzz.py`` and the fuzz tests);
- ``load`` runs concurrent clients whose every answer is checked
  (``bench/load.py`` and the load tests).

Example:
    >>> from xreduce_bench.sweep import human_size
    >>> human_size(64 << 20)
    '64 MiB'
"""
