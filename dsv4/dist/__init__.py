"""dsv4.dist: tensor parallel attention and expert / tensor parallel MoE over torch.distributed.

* ``parallel``: :class:`ParallelConfig` (the user's choice), :class:`Parallel` (this process's
  rank and the collectives; ``SINGLE`` is the no-op single-process default), ``init_parallel``
  (torchrun environment, NCCL on CUDA, gloo on CPU);
* ``sharding``: which slice of each checkpoint tensor a rank loads (heads, output groups,
  experts or expert columns, Engram rows);
* ``worker``: the loop of ranks > 0, running the steps rank 0 broadcasts;
* ``random_weights``: a rank's shard with random weights in the checkpoint formats, made on its
  device (benchmarks of full-size models without the files: ``bench/tp_bench.py``).
"""
