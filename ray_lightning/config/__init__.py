"""What the user asked for, checked before anything is launched, and the settings every layer reads.

One module per concern:

* :mod:`.variables`: the ``RAY_LIGHTNING_*`` environment variables, and reading a setting from an
  argument, else its variable, else its default;
* :mod:`.timeouts`: :class:`~.timeouts.WorkerTimeouts`, the time bounds of a launch;
* :mod:`.restarts`: :class:`~.restarts.RecoverySettings`, how often a fit may restart its workers;
* :mod:`.storage`: :class:`~.storage.StorageSettings`, where a run's checkpoints and logs go;
* :mod:`.resources`: :class:`~.resources.WorkerResources`, what each worker reserves and how many
  there are (no Ray needed to check them), and their placement-group bundles;
* :mod:`.workers`: :class:`~.workers.WorkerSpec`, the one record of a strategy's workers made of the above;
* :mod:`.arguments`: checks of keyword arguments shared by the strategies;
* :mod:`.display`: amounts and resources written for people.

Whether the cluster can hold a request is checked at launch (:mod:`ray_lightning.launch.placement`).
"""
