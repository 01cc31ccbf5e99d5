"""Every private Ray name ray_lightning uses, and nothing else.

Ray's public API has no way to do some of what the launcher and the driver need; where none
exists, the private name is touched here and only here, so that a Ray release that moves one
breaks one folder, and ``tests/test_ray_internals.py`` names what moved:

* :mod:`.logs`: the dispatcher that prints the output workers forward to the driver
  (``ray._private.ray_logging.global_worker_stdstream_dispatcher``, its ``_lock`` and
  ``handlers``) and the de-duplicators that hold repeated lines back (``ray._private.worker``):
  the end-of-call output markers (:mod:`ray_lightning.channel.worker_output`).
* :mod:`.kv`: the internal key-value store (``ray.experimental.internal_kv._internal_kv_get``/
  ``_put``/``_del``): the notices of workers that received SIGTERM
  (:mod:`ray_lightning.launch.preemption`), and what the autoscaler publishes there, its version
  and v1's status (:mod:`ray_lightning.launch.autoscaler`).
* :mod:`.state`: what the GCS knows for Ray's own tools (``ray._private.state.state``, the GCS
  client of ``ray._private.worker.global_worker``, ``ray.core.generated.autoscaler_pb2``): the
  draining nodes (preemption), autoscaler v2's node groups and status, with named node statuses
  instead of the enum's numbers, and where the autoscaler's monitor scripts are in Ray's package
  (:mod:`ray_lightning.launch.autoscaler`).
* :mod:`.data`: a Ray Data dataset's row count from its metadata (``Dataset._meta_count``): the
  length of ``RayDataModule``'s loaders (:mod:`ray_lightning.data`); and, not private but fragile, a pass's
  block references (``Dataset.iter_internal_ref_bundles``, a DeveloperAPI) and the deprecated
  ``ExecutionOptions.exclude_resources`` that keeps Ray Data off the training workers' CPUs.
* :mod:`.tune`: a Tune trial's storage (``ray.train._internal.session.get_session().storage``, a
  DeveloperAPI ``StorageContext``, and its ``_make_checkpoint_dir_name``): the folder the ranks write a
  trial's checkpoint into themselves (:class:`ray_lightning.tune.TuneReportCheckpointCallback`). Where it is
  missing, the checkpoint goes through the trial's process as bytes.

Where a private name is missing, each caller degrades as it always did: no output markers, no
preemption notice, an autoscaler that is unknown. :data:`PRIVATE_NAMES` lists all of them (with
``ray.experimental`` and ``ray.core.generated`` counted as private: Ray makes no promise about
either); a test checks each still exists.
"""

from ray_lightning._ray import data, kv, logs, state, tune
from ray_lightning._ray.names import PRIVATE_NAMES

__all__ = ["PRIVATE_NAMES", "data", "kv", "logs", "state", "tune"]
