"""What every ray_lightning strategy shares, whatever moves the gradients (DDP, sharding or Horovod).

:class:`RayWorkersMixin` goes first in a strategy's bases (``class RayStrategy(RayWorkersMixin)``,
whose ``lightning_base = "strategies.DDPStrategy"``: :class:`ray_lightning.namespaces.PerNamespace`).
It owns the record of the workers (:class:`~ray_lightning.config.workers.WorkerSpec`), hands Lightning a
:class:`~ray_lightning.launch.launcher.RayLauncher` instead of a process launcher, keeps Lightning
from choosing devices by the driver's hardware, and, inside a worker, answers rank and device
questions from what the launcher decided (:class:`~ray_lightning.strategies.in_worker.InWorker`, a base).
Its checkpoint calls are :class:`~ray_lightning.strategies.checkpoints.WorkerCheckpoints`' (a base too).
Lightning's private hooks it needs are overridden in :class:`~ray_lightning._lightning.LightningStrategyHooks`.

Every strategy's constructor is decorated with :func:`~ray_lightning.strategies.arguments.worker_arguments`:
the arguments that describe the workers (how many, what each reserves, the time bounds, the restarts,
``init_hook``) are written once, in :mod:`ray_lightning.strategies.arguments`, and each strategy's ``__init__``
names only its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ray_lightning import namespaces
from ray_lightning._lightning import LightningStrategyHooks
from ray_lightning.config.resources import WorkerResources
from ray_lightning.config.storage import name_now
from ray_lightning.config.workers import WorkerSpec
from ray_lightning.data.elastic import find as find_elastic
from ray_lightning.environment import RayEnvironment
from ray_lightning.launch.launcher import RayLauncher
from ray_lightning.launch.rendezvous import Rendezvous, TorchStoreRendezvous
from ray_lightning.runtime import WorkerContext
from ray_lightning.strategies.accelerator import WorkerAccelerator
from ray_lightning.strategies.checkpoints import WorkerCheckpoints
from ray_lightning.strategies.in_worker import InWorker

if TYPE_CHECKING:
    import pytorch_lightning as pl


def _tune_trial_id() -> str | None:
    """The Tune trial this process runs, if any."""
    import warnings

    try:
        from ray import tune

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # outside a trial Tune warns and answers None
            return tune.get_context().get_trial_id()
    except Exception:  # noqa: BLE001 - no Tune, or no session: not a trial
        return None


def float_for_mean(tensor: Any, reduce_op: Any) -> Any:
    """``tensor`` as float64 where it is an integer tensor to average, else itself.

    Lightning averages an integer tensor across ranks into an integer (truncated): the row count behind a
    logged epoch mean is one, so a mean logged by ranks that saw different numbers of rows (a RayDataModule's
    validation, whose last batch is short) came out wrong (465 over 31 rows as 15.5). As a float it is exact.
    """
    import torch

    averaging = str(getattr(reduce_op, "name", reduce_op)).lower() in ("mean", "avg", "average")
    if isinstance(tensor, torch.Tensor) and averaging and not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor.double()
    return tensor


class RayWorkersMixin(WorkerCheckpoints, InWorker, LightningStrategyHooks, namespaces.PerNamespace):
    """Workers on Ray actors for a Lightning ``ParallelStrategy`` subclass; see the module docstring."""

    # The name of the strategy (and of its accelerator form) in Lightning's registries: Trainer(strategy="ray").
    registry_name: str
    # A Trainer of the other Lightning namespace uses a rebuild of this strategy: the caller's object
    # shows its restarts too (namespaces.rebuild_for).
    shared_with_rebuild = ("restarts", "timings", "startup")
    # Whether its checkpoints can go to an fsspec URL (storage_path="s3://..."); else only to a mounted directory.
    writes_to_urls = True
    # With storage_path: rank 0's checkpoint files are uploaded while training goes on (home.background_io).
    writes_in_background = True
    _cluster_environment: RayEnvironment | None
    namespace: namespaces.Namespace
    init_arguments: dict[str, Any]
    workers: WorkerSpec

    @classmethod
    def worker_spec(cls, shared: dict[str, Any], own: dict[str, Any]) -> WorkerSpec:
        """The workers' record from the shared arguments (and, where a strategy counts its workers its own way,
        from its own arguments ``own``: Horovod's hosts and slots)."""
        return WorkerSpec.resolve(**shared)

    def use_workers(self, workers: WorkerSpec) -> None:
        """Keep ``workers``: called by the constructor (:func:`worker_arguments`) before the strategy's own code."""
        if workers.storage.is_remote and not self.writes_to_urls:
            raise ValueError(
                f"{type(self).__name__} writes its checkpoints with local file I/O and cannot write to "
                f"storage_path={workers.storage.path!r}: give a directory every node mounts, or leave storage_path "
                "out (checkpoints then come home to this machine)."
            )
        self.workers = workers
        # Every restart of this strategy's workers inside its calls (ray_lightning.launch.recovery.Restart).
        self.restarts: list[Any] = []
        # The last call's step times per rank (ray_lightning.channel.timings.RankTimes) and where the time from
        # fit to its first step went ((mark, seconds since fit, seconds since the mark before)).
        self.timings: dict[int, Any] = {}
        self.startup: list[tuple[str, float, float]] = []
        self._worker: WorkerContext | None = None
        self._rendezvous_store: Any = None

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(float_for_mean(tensor, reduce_op), group, reduce_op)  # type: ignore[misc]

    def warn(self, message: str) -> None:
        """Warn once, from rank 0, as Lightning does."""
        self.namespace.pl("utilities.rank_zero.rank_zero_warn")(message)

    @classmethod
    def accepted_keywords(cls) -> set[str]:
        """The keyword arguments this strategy's constructor takes (``RayAccelerator`` checks its own against them)."""
        parameters = inspect.signature(cls.__init__).parameters.items()
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {name for name, p in parameters if p.kind in named and name != "self"}

    # -- what the workers are, as users read it ----------------------------------------------------

    @property
    def storage_path(self) -> str | None:
        """Where the run's files go (``storage_path``), None: they come home to the driver."""
        return self.workers.storage.path

    def run_name_now(self) -> str:
        """The run's name: ``run_name``, else one made from the script and the time at the first call (then kept)."""
        if self.workers.storage.run_name is not None:
            return self.workers.storage.run_name
        if getattr(self, "_made_run_name", None) is None:
            # Trials of a Tune search start together, from the same script: each gets a folder of its own.
            self._made_run_name = name_now(tag=_tune_trial_id())
        return self._made_run_name

    @property
    def resources(self) -> WorkerResources:
        return self.workers.resources

    @property
    def init_hook(self) -> Callable[[], Any] | None:
        return self.workers.init_hook

    @property
    def recovery(self) -> Any:
        return self.workers.recovery

    @property
    def max_failures(self) -> int:
        """How many times one call may restart its workers (``max_failures``)."""
        return self.workers.recovery.max_failures

    @property
    def placement_timeout_s(self) -> float:
        return self.workers.timeouts.placement_s

    @property
    def worker_start_timeout_s(self) -> float:
        return self.workers.timeouts.start_s

    @property
    def keep_workers_alive_s(self) -> float:
        return self.workers.timeouts.keep_alive_s

    @property
    def progress_timeout_s(self) -> float | None:
        return self.workers.timeouts.progress_s

    @property
    def scale_up_timeout_s(self) -> float:
        return self.workers.timeouts.scale_up_s

    # -- configuration seen on the driver --------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.resources.num_workers

    @property
    def use_gpu(self) -> bool:
        return self.resources.use_gpu

    @property
    def num_cpus_per_worker(self) -> float:
        """CPUs each worker reserves (``resources_per_worker['CPU']`` when given), as in ray_lightning 0.3."""
        return self.resources.cpus

    @property
    def num_gpus_per_worker(self) -> float:
        """GPUs each worker reserves (0, a fraction, or whole GPUs), as in ray_lightning 0.3."""
        return self.resources.gpus

    @property
    def rendezvous(self) -> Rendezvous:
        """How this strategy's workers meet: torch.distributed's TCPStore, opened by rank 0."""
        return TorchStoreRendezvous()

    @property
    def collective_errors(self) -> tuple[type[BaseException], ...]:
        """What its collectives raise, besides torch's ``DistError``, when a peer went away (launch.failures)."""
        return ()

    # Every rank holds the whole state (DDP, Horovod): a restart after a worker died goes on from the survivors'
    # state (launch.memory). A sharded strategy's lost rank held a part that exists nowhere else.
    state_in_every_rank = False

    @override
    def make_launcher(self) -> RayLauncher:
        return RayLauncher(self)

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse, on the driver and before any worker starts, a Trainer this strategy cannot run."""

    @override
    def choose_accelerator(self, accelerator: Any) -> WorkerAccelerator:
        # Lightning assigns the accelerator it chose from the driver's hardware; the workers'
        # reserved GPUs decide instead.
        return self._accelerator_for_trainer(accelerator)

    def prepare_for_trainer(self, requested: Any) -> WorkerAccelerator:
        """Called as a Trainer is built with this strategy: returns the accelerator it should use."""
        accelerator = self._accelerator_for_trainer(requested)
        # A strategy reused for another Trainer still holds what Lightning gave it last time, which
        # Lightning would take as conflicting flags.
        self.forget_accelerator()
        self.parallel_devices = None
        return accelerator

    def _accelerator_for_trainer(self, requested: Any) -> WorkerAccelerator:
        """What the Trainer should use when this strategy is given with ``accelerator=requested``."""
        if isinstance(requested, WorkerAccelerator):
            if not requested.belongs_to(self):
                raise ValueError(
                    f"Pass either accelerator={type(requested).__name__}(...) or strategy="
                    f"{type(self).__name__}(...), not both: each describes the workers to start."
                )
            return requested
        name = requested if isinstance(requested, str) else type(requested).__name__
        wants_gpu = name.lower() in ("gpu", "cuda", "cudaaccelerator")
        wants_cpu = name.lower() in ("cpu", "cpuaccelerator")
        if (wants_gpu and not self.use_gpu) or (wants_cpu and self.use_gpu):
            self.warn(
                f"Trainer(accelerator={requested!r}) is ignored: {type(self).__name__} trains on "
                f"{'CUDA' if self.use_gpu else 'CPU'} because the workers reserve "
                f"{self.resources.gpus:g} GPU each (use_gpu / resources_per_worker decide)."
            )
        # This strategy's accelerator form: registered under the same name (strategies.register).
        form = self.namespace.pl("accelerators.AcceleratorRegistry")[self.registry_name]["accelerator"]
        return form.for_strategy(self)

    @property
    def cluster_environment(self) -> RayEnvironment | None:
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env: Any) -> None:
        if env is not None and not isinstance(env, RayEnvironment):
            raise ValueError(
                f"{type(self).__name__} computes ranks from where Ray placed its workers; "
                f"it cannot use {type(env).__name__}."
            )
        self._cluster_environment = env

    @property
    @override
    def root_device(self) -> torch.device:
        if self._worker is not None and self._worker.device_index is not None:
            return torch.device("cuda", self._worker.device_index)
        return torch.device("cpu")

    @property
    @override
    def num_processes(self) -> int:
        if self._worker is not None and self._cluster_environment is not None:
            return self._cluster_environment.local_world_size
        return self.num_workers

    @property
    @override
    def num_nodes(self) -> int:
        return self._worker.num_nodes if self._worker is not None else 1

    @num_nodes.setter
    @override
    def num_nodes(self, num_nodes: int) -> None:
        # Ray decides how many nodes the workers span.
        if num_nodes != 1:
            self.warn(
                f"Trainer(num_nodes={num_nodes}) is ignored: {type(self).__name__} places "
                f"{self.resources.describe()} wherever the Ray cluster has room."
            )

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """In a worker: the training loader at this world size and position (``data.elastic``, restartable fits)."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = getattr(self, "lightning_module", None)  # Fabric's strategies have none
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # a module attached to no Trainer
            trainer = None
        elastic = find_elastic(trainer) if trainer is not None and trainer.training else None
        return elastic.process_loader(trainer, dataloader) if elastic is not None else dataloader

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rendezvous_store"] = None  # a TCPStore cannot be pickled; workers get theirs on attach
        return state
