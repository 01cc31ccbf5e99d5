"""``HorovodRayStrategy``: what Lightning sees — Horovod (over Gloo, or NCCL on GPUs) between Ray actors.

Lightning 2.x has no Horovod strategy, so this is one, written against Lightning's
``ParallelStrategy`` interface. Workers start, get their ranks and return their results exactly as
with :class:`~ray_lightning.RayStrategy` (the shared :class:`~ray_lightning.launch.launcher.RayLauncher`);
only the rendezvous (horovod.ray's Gloo rendezvous, see :mod:`ray_lightning.horovod.rendezvous`)
and the collectives differ:

* gradients: ``hvd.DistributedOptimizer`` with ``backward_passes_per_step`` equal to
  ``accumulate_grad_batches``, synchronized once after the backward pass of each optimizer step;
* parameters (and any existing optimizer state) broadcast from rank 0 before training;
* ``self.log(..., sync_dist=True)``, ``all_gather`` and ``broadcast`` use Horovod's allreduce,
  allgather and broadcast_object; barriers use ``hvd.join``.

Decision: unlike Lightning 1.x's ``HorovodStrategy``, the learning rate is *not* multiplied by the
number of workers. Horovod averages gradients exactly as DDP does, so the same LightningModule
trains the same way under HorovodRayStrategy and RayStrategy; scale the rate yourself if you want
Horovod's linear-scaling rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning.config.workers import WorkerSpec
from ray_lightning.horovod.hvd import import_horovod_torch, init_horovod
from ray_lightning.horovod.optim import horovod_op, retarget_scheduler, writable
from ray_lightning.horovod.rendezvous import HorovodRendezvous
from ray_lightning.launch.rendezvous import Rendezvous
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.ddp import RayAccelerator
from ray_lightning.strategies.workers import RayWorkersMixin, float_for_mean

if TYPE_CHECKING:
    import pytorch_lightning as pl


class HorovodRayStrategy(RayWorkersMixin):
    """Horovod data-parallel training across Ray actors.

    Args:
        num_workers: number of training processes, packed onto as few nodes as the cluster allows.
        num_hosts: number of different nodes to train on (with ``num_slots``; instead of ``num_workers``).
        num_slots: workers on each of those nodes.
        num_cpus_per_worker: CPUs reserved for each worker.
        use_gpu: reserve one GPU per worker and train on CUDA (Horovod must be built with NCCL).
        resources_per_worker: Ray resources per worker, e.g. ``{"CPU": 2, "GPU": 1, "my_accel": 1}``;
            wins over ``num_cpus_per_worker`` and ``use_gpu``.
        init_hook: called without arguments in every worker before training.
        placement_timeout_s: how long to wait for the cluster to free the resources (default 60 s,
            or ``RAY_LIGHTNING_PLACEMENT_TIMEOUT_S``).
        worker_start_timeout_s: how long started workers may take to report in and meet (default
            300 s, or ``RAY_LIGHTNING_WORKER_START_TIMEOUT_S``); also Gloo's rendezvous timeout.
        keep_workers_alive_s: how long workers wait for the next call of this process (default
            60 s, ``RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S``; 0: stop after every call), as for ``RayStrategy``.
        progress_timeout_s: a rank without progress for this long stops the call with every rank's
            stack (default 900 s, ``RAY_LIGHTNING_PROGRESS_TIMEOUT_S``; None: off), as for ``RayStrategy``.
        scale_up_timeout_s, max_failures, recovery_checkpoint_every_n_steps: as for ``RayStrategy``
            (restarts start Horovod afresh on the new workers).

    Example::

        trainer = pl.Trainer(max_epochs=4, strategy=HorovodRayStrategy(num_hosts=2, num_slots=4, use_gpu=True))
        trainer.fit(model)  # weights, metrics and the best checkpoint are back here afterwards
    """

    registry_name = "horovod_ray"
    lightning_base = "strategies.ParallelStrategy"
    state_in_every_rank = True  # every rank holds the whole state (launch.memory)

    @worker_arguments(defaults={"num_workers": None})
    def __init__(self, num_hosts: int | None = None, num_slots: int | None = None) -> None:
        # Fail here, on the driver, rather than in every worker.
        import_horovod_torch()
        super().__init__(cluster_environment=None)
        self._failed = False

    @classmethod
    @override
    def worker_spec(cls, shared: dict[str, Any], own: dict[str, Any]) -> WorkerSpec:
        # num_workers, or num_hosts x num_slots: the workers per host go onto different nodes.
        workers, hosts = worker_layout(shared.pop("num_workers"), own["num_hosts"], own["num_slots"])
        return WorkerSpec.resolve(workers, **shared, num_hosts=hosts)

    @property
    @override
    def rendezvous(self) -> Rendezvous:
        """horovod.ray's Gloo rendezvous server, opened by rank 0."""
        return HorovodRendezvous()

    @property
    @override
    def collective_errors(self) -> tuple[type[BaseException], ...]:
        from horovod.common.exceptions import HorovodInternalError

        return (HorovodInternalError,)

    # Horovod's DistributedOptimizer takes accumulate_grad_batches when it wraps the optimizer (data.elastic keeps
    # it and moves only the per-worker batch).
    fixed_accumulation = True

    @property
    def num_hosts(self) -> int | None:
        return self.resources.num_hosts

    @property
    def num_slots(self) -> int | None:
        return self.resources.workers_per_host if self.resources.num_hosts else None

    @override
    def check_trainer(self, trainer: pl.Trainer) -> None:
        if any(isinstance(cb, namespaces.every("callbacks.GradientAccumulationScheduler")) for cb in trainer.callbacks):
            raise ValueError(
                "HorovodRayStrategy needs one accumulate_grad_batches for the whole run (Horovod fixes how many "
                "backward passes make a step when it wraps the optimizer); GradientAccumulationScheduler "
                "changes it between epochs. Use Trainer(accumulate_grad_batches=N)."
            )

    # -- inside a worker ----------------------------------------------------------------------------

    @property
    def _hvd(self) -> Any:
        return import_horovod_torch()

    @override
    def setup_environment(self) -> None:
        self._failed = False
        self.set_world_ranks()
        runtime.mark_progress("rendezvous", "hvd.init", startup=True)
        assert self._worker is not None
        hvd = init_horovod(ray.util.get_node_ip_address(), across_machines=self._worker.num_machines > 1)
        if (hvd.rank(), hvd.size()) != (self.global_rank, self.world_size):
            raise RuntimeError(
                f"Horovod started as rank {hvd.rank()} of {hvd.size()}, but ray_lightning placed this worker as "
                f"rank {self.global_rank} of {self.world_size}."
            )
        self.namespace.fabric("utilities.seed.reset_seed")()
        super().setup_environment()
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")

    @override
    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != namespaces.FITTING:
            return
        hvd = self._hvd
        module = self.lightning_module
        assert module is not None
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        wrapper = namespaces.every("core.optimizer.LightningOptimizer")
        optimizers = [o.optimizer if isinstance(o, wrapper) else o for o in self.optimizers]
        wrapped = [self._wrap(optimizer, hvd, trainer.accumulate_grad_batches) for optimizer in optimizers]
        for old, new in zip(optimizers, wrapped):
            state = old.state_dict()
            # Horovod initialises an empty state with a zero-gradient step, which moves weights
            # under weight decay; an empty state is the same everywhere, so only a real one is sent.
            if state.get("state"):
                if new is not old:  # Horovod's wrapper is a new optimizer over the same param_groups
                    new.load_state_dict(state)
                hvd.broadcast_optimizer_state(new, root_rank=0)
        for config in self.lr_scheduler_configs:
            for old, new in zip(optimizers, wrapped):
                if getattr(config.scheduler, "optimizer", None) is old:
                    retarget_scheduler(config.scheduler, new)
        self.optimizers = wrapped
        for lightning_optimizer in self.lightning_optimizers:
            # Lightning's wrapper class subclasses Horovod's optimizer class, whose methods call
            # super(self.__class__, self): through the wrapper that recurses forever
            # (`self.optimizers().zero_grad()` in manual optimization). Call the real ones.
            for name in ("zero_grad", "load_state_dict"):
                setattr(lightning_optimizer, name, getattr(lightning_optimizer.optimizer, name))

    def _wrap(self, optimizer: Optimizer, hvd: Any, accumulate_grad_batches: int) -> Optimizer:
        if hasattr(optimizer, "synchronize") or _lightning.is_mock_optimizer(optimizer):
            return optimizer  # already Horovod's, or Lightning's stand-in when there is no optimizer
        module = self.lightning_module
        assert module is not None
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=[(n, p) for n, p in module.named_parameters() if id(p) in in_optimizer],
            # Gradients of the micro-batches before the last one are accumulated locally.
            backward_passes_per_step=accumulate_grad_batches,
        )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        synchronize = getattr(optimizer, "synchronize", None)
        if synchronize is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize() -> Any:
            # The closure runs the last backward pass of this step; the averaged gradients must be
            # in place before the precision plugin unscales or clips them and the optimizer steps.
            result = closure()
            synchronize()
            return result

        # step() itself must not synchronize again (entered per step: Horovod's load_state_dict,
        # which Lightning calls when resuming, resets the flag).
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            raise ValueError("Horovod cannot reduce over a sub-group of workers; leave `group` unset.")
        if not self._in_horovod():
            return tensor
        hvd = self._hvd
        op = horovod_op(hvd, reduce_op)
        with torch.inference_mode(False):
            return hvd.allreduce(writable(float_for_mean(tensor, reduce_op)), op=op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is not None:
            raise ValueError("Horovod cannot gather over a sub-group of workers; leave `group` unset.")
        # Same shape as DDP's all_gather: (world_size, *tensor.shape).
        if not self._in_horovod():
            return tensor.unsqueeze(0)
        with torch.inference_mode(False), contextlib.nullcontext() if sync_grads else torch.no_grad():
            return self._hvd.allgather(writable(tensor).unsqueeze(0))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # A fixed name: Horovod names the collective after type(obj) otherwise, and ranks holding
        # different types (`x if rank == 0 else None`) would wait for each other forever.
        if not self._in_horovod():
            return obj
        return self._hvd.broadcast_object(obj, root_rank=src, name="ray_lightning.broadcast")

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._in_horovod():
            self._hvd.join(self.root_device.index if self.root_device.type == "cuda" else -1)

    def _in_horovod(self) -> bool:
        """In a worker with Horovod running; on the driver (``trainer.log_dir`` after fit...) collectives are no-ops."""
        return self._worker is not None and self._hvd.is_initialized()

    @override
    def detach_worker(self) -> None:
        # The next call's workers meet through a new rendezvous: start Horovod afresh then.
        hvd = self._hvd
        if hvd.is_initialized():
            hvd.shutdown()
        super().detach_worker()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True

    @override
    def teardown(self) -> None:
        # Every worker finishes its last collective before any leaves; but a failed worker must not
        # join, since hvd.join lets the others train on without it and would hide the failure.
        if not self._failed:
            self.barrier()
        super().teardown()
        if self._worker is not None and self.root_device.type == "cuda":
            torch.cuda.empty_cache()


class HorovodRayAccelerator(RayAccelerator):
    """Train on Ray actors with Horovod: the classic form of :class:`HorovodRayStrategy`.

    Args:
        num_workers: number of training processes, packed onto as few nodes as the cluster allows.
        num_hosts: number of different nodes to train on (instead of ``num_workers``).
        num_slots: workers on each of those nodes.
        cpus_per_worker: CPUs reserved for each worker.
        use_gpu: reserve one GPU per worker and train on CUDA.
        **strategy_kwargs: any other :class:`~ray_lightning.HorovodRayStrategy` argument.

    Example::

        trainer = pl.Trainer(max_epochs=2, accelerator=HorovodRayAccelerator(num_hosts=2, num_slots=4, use_gpu=True))
        trainer.fit(model)
    """

    strategy_class = HorovodRayStrategy

    def __init__(
        self,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_slots: int | None = None,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        **strategy_kwargs: Any,
    ) -> None:
        super().__init__(
            num_workers=num_workers,  # type: ignore[arg-type]
            cpus_per_worker=cpus_per_worker,
            use_gpu=use_gpu,
            num_hosts=num_hosts,
            num_slots=num_slots,
            **strategy_kwargs,
        )


def worker_layout(num_workers: Any, num_hosts: Any, num_slots: Any) -> tuple[Any, int | None]:
    """``(number of workers, number of hosts or None)`` from the three ways of saying how many.

    ``num_workers`` alone (an int, or ``(min, max)``: elastic, checked by the worker record) lets Ray pack the
    workers; ``num_hosts`` and/or ``num_slots`` put
    ``num_slots`` workers on each of ``num_hosts`` different nodes (a missing one counts as 1).
    """
    for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts), ("num_slots", num_slots)):
        if value is None or (name == "num_workers" and isinstance(value, (tuple, list))):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 1, got {value!r}.")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}.")
    if num_workers is not None and (num_hosts is not None or num_slots is not None):
        raise ValueError(
            "Give either num_workers (Ray packs the workers onto as few nodes as it can) or "
            "num_hosts/num_slots (num_slots workers on each of num_hosts nodes), not both."
        )
    if num_hosts is None and num_slots is None:
        return (num_workers or 1), None
    hosts, slots = num_hosts or 1, num_slots or 1
    return hosts * slots, hosts


accelerator.register(HorovodRayAccelerator, "Horovod on Ray actors")
