"""What Lightning sees: the strategies and accelerators a Trainer is given.

* :mod:`.ddp`: ``RayStrategy``, Lightning's DDP between Ray actors.
* :mod:`.accelerator`: ``RayAccelerator``/``HorovodRayAccelerator``, the classic ``accelerator=`` form.
* :mod:`.workers`: ``RayWorkersMixin``, what every ray_lightning strategy shares (workers, devices, the launcher).

Horovod's strategy is in :mod:`ray_lightning.horovod`, the only place Horovod is imported.
"""
