"""How workers start and run: one Ray actor per worker, placed, ranked and met, for each Trainer call.

Where things are:

* :mod:`.launcher`: ``RayLauncher``, what Lightning calls instead of re-running ``sys.argv``: the
  steps of a launch, and ``kill``; :mod:`.call_record`: what a call keeps across its attempts;
  :mod:`.bring_home`: its results, files and weights onto the driver; :mod:`.runs`: a run in storage.
* :mod:`.placement`: the placement group (own or a Tune trial's); :mod:`.capacity`: can the cluster ever
  hold the request; :mod:`.placement_wait`: the wait for it, while the autoscaler adds nodes;
  :mod:`.probes`: an elastic fit's size, probed with placement groups of a few sizes.
* :mod:`.autoscaler`: what the cluster's autoscaler can add, and what it reports while a request waits for it.
* :mod:`.recovery`: restarts inside a call (``max_failures``): the driver's newest recovery
  checkpoint, which failures a restart follows; :mod:`.preemption`: a worker about to go away
  gets rank 0 to checkpoint first.
* :mod:`.worker_group`: starts the actors in the placement, runs a call on them, shuts them down
  (one clean-up path, also for a half-started group).
* :mod:`.actor`: the actor itself (``RayWorker``); :mod:`.call`: what one call does inside it.
* :mod:`.contexts`: each worker's rank, device and environment, from where the actors landed
  (ranks themselves: :mod:`ray_lightning.environment`).
* :mod:`.rendezvous`: how the workers meet (torch's TCPStore; Horovod's is in ``ray_lightning.horovod``).
* :mod:`.network`: the address and interface every listener of a fit binds (the node IP, never all).
* :mod:`.poll`: waiting for the workers without polling; a failure is raised with its rank.
* :mod:`.payload`: the Trainer, module and arguments sent once; the ``ckpt_path`` file.
  :mod:`.weights_out`: the module's big tensors, beside the payload in chunks.
* :mod:`.idle_pool`: workers kept alive for the next call of the process.
* :mod:`.session`: the Ray this process talks to.
* :mod:`.protocol`: what the launcher needs from a strategy.
"""
