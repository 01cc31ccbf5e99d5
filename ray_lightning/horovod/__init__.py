"""Horovod between Ray actors; the only place ray_lightning imports Horovod.

* :mod:`.strategy`: ``HorovodRayStrategy``, what Lightning sees.
* :mod:`.rendezvous`: horovod.ray's Gloo rendezvous, run by rank 0's actor.
* :mod:`.hvd`: finding Horovod (with install instructions when it is missing), ``hvd.init`` in a worker.
* :mod:`.optim`: Horovod's ``DistributedOptimizer`` inside Lightning's optimizer loop; collectives' helpers.
"""
