"""What Lightning sees: the strategies and accelerators a Trainer is given.

* :mod:`.ddp`: ``RayStrategy``, Lightning's DDP between Ray actors, and ``RayAccelerator``, its classic
  ``accelerator=`` form. Every strategy module defines its strategy and its form, side by side.
* :mod:`.fsdp` (FSDP2), :mod:`.fsdp1`, :mod:`.model_parallel`, :mod:`.deepspeed`: the sharded strategies;
  :mod:`.sharded`: what they share (checkpoints and weights that are collective).
* :mod:`.workers`: ``RayWorkersMixin``, what every ray_lightning strategy shares (the workers' record,
  devices, the launcher), and ``worker_arguments``, the constructor arguments written once.
* :mod:`.accelerator`: ``WorkerAccelerator``, the accelerator inside the workers and the base of every form.

Horovod's strategy is in :mod:`ray_lightning.horovod`, the only place Horovod is imported.
"""
