"""What every ray_lightning strategy shares, whatever moves the gradients (DDP, sharding or Horovod).

:class:`RayWorkersMixin` goes first in a strategy's bases (``class RayStrategy(RayWorkersMixin)``,
whose ``lightning_base = "strategies.DDPStrategy"``: :class:`ray_lightning.namespaces.PerNamespace`).
It owns the record of the workers (:class:`~ray_lightning.config.workers.WorkerSpec`), hands Lightning a
:class:`~ray_lightning.launch.launcher.RayLauncher` instead of a process launcher, keeps Lightning
from choosing devices by the driver's hardware, and, inside a worker, answers rank and device
questions from what the launcher decided (:meth:`RayWorkersMixin.attach_worker`).
Lightning's private hooks it needs are overridden in :class:`~ray_lightning._lightning.LightningStrategyHooks`.

Every strategy's constructor is decorated with :func:`worker_arguments`: the arguments that describe
the workers (how many, what each reserves, the time bounds, the restarts, ``init_hook``) are written
once, here (:data:`SHARED`), and each strategy's ``__init__`` names only its own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning._lightning import LightningStrategyHooks
from ray_lightning.config.elastic import num_workers_from_environment
from ray_lightning.config.resources import WorkerResources, refuse_nccl_on_a_shared_gpu
from ray_lightning.config.storage import name_now
from ray_lightning.config.timeouts import DEFAULT_PROGRESS_TIMEOUT_S
from ray_lightning.config.workers import WorkerSpec
from ray_lightning.data.elastic import find as find_elastic
from ray_lightning.environment import RayEnvironment
from ray_lightning.home.background_io import BackgroundCheckpointIO
from ray_lightning.home.files import path_forms
from ray_lightning.launch.launcher import RayLauncher
from ray_lightning.launch.network import interface_for, listener_environment
from ray_lightning.launch.rendezvous import Rendezvous, TorchStoreRendezvous
from ray_lightning.runtime import WorkerContext
from ray_lightning.strategies.accelerator import WorkerAccelerator

if TYPE_CHECKING:
    import pytorch_lightning as pl

_P = inspect.Parameter
# The arguments that describe a strategy's workers, as every strategy's signature shows them (LightningCLI
# reads the annotations). ``num_workers`` comes first, then the
# strategy's own positional arguments, the next four, its own keyword-only ones and the time bounds.
_LEADING = (_P("num_workers", _P.POSITIONAL_OR_KEYWORD, default=1, annotation=int | tuple[int, int]),)
_RESOURCES = (
    _P("num_cpus_per_worker", _P.POSITIONAL_OR_KEYWORD, default=1, annotation=float),
    _P("use_gpu", _P.POSITIONAL_OR_KEYWORD, default=False, annotation=bool),
    _P("resources_per_worker", _P.POSITIONAL_OR_KEYWORD, default=None, annotation=Mapping[str, float] | None),
    _P("init_hook", _P.POSITIONAL_OR_KEYWORD, default=None, annotation=Callable[[], Any] | None),
)
_BOUNDS = (
    *(
        _P(name, _P.KEYWORD_ONLY, default=None, annotation=float | None)
        for name in ("placement_timeout_s", "worker_start_timeout_s", "keep_workers_alive_s")
    ),
    _P("progress_timeout_s", _P.KEYWORD_ONLY, default=DEFAULT_PROGRESS_TIMEOUT_S, annotation=float | None),
    _P("scale_up_timeout_s", _P.KEYWORD_ONLY, default=None, annotation=float | None),
    _P("max_failures", _P.KEYWORD_ONLY, default=None, annotation=int | None),
    _P("recovery_checkpoint_every_n_steps", _P.KEYWORD_ONLY, default=None, annotation=int | None),
    _P("storage_path", _P.KEYWORD_ONLY, default=None, annotation=str | None),
    _P("run_name", _P.KEYWORD_ONLY, default=None, annotation=str | None),
    _P("batch_policy", _P.KEYWORD_ONLY, default=None, annotation=str | None),
    _P("grow_check_interval_s", _P.KEYWORD_ONLY, default=None, annotation=float | None),
)
SHARED = (*_LEADING, *_RESOURCES, *_BOUNDS)


def worker_arguments(
    defaults: Mapping[str, Any] | None = None,
    fixed: Mapping[str, Any] | None = None,
    passes_on: tuple[str, ...] = (),
    decided: Iterable[str] = (),
) -> Callable[[Callable], Callable]:
    """Decorate a strategy's ``__init__(self, <its own arguments>)``: its public signature gets :data:`SHARED` too.

    Before the decorated body runs, the shared arguments are checked and kept as ``self.workers``
    (:class:`~ray_lightning.config.workers.WorkerSpec`, made by the class's :meth:`RayWorkersMixin.worker_spec`),
    and every argument as ``self.init_arguments`` (a Trainer of the other Lightning package rebuilds the
    strategy from them). After it, a ``process_group_backend`` asking NCCL where the workers may share a GPU
    is refused (:func:`~ray_lightning.config.resources.refuse_nccl_on_a_shared_gpu`).
    ``defaults``: shared arguments whose default differs for this strategy;
    ``fixed``: shared arguments the strategy decides (left out of its signature), with their values.
    ``passes_on``: what the strategy's ``**kwargs`` go to, as Lightning names (``"strategies.DDPStrategy"``)
    or torch classes (``"torch.nn.parallel.DistributedDataParallel"``); their arguments, less ``decided``,
    join the signature as keyword-only ones, passed on only when given.

    Example::

        @worker_arguments(fixed={"keep_workers_alive_s": 0.0}, passes_on=("strategies.DeepSpeedStrategy",))
        def __init__(self, *, stage: int = 2, **deepspeed_kwargs: Any) -> None: ...
    """
    defaults, fixed = dict(defaults or {}), dict(fixed or {})

    def decorate(init: Callable) -> Callable:
        signature, passed = _public_signature(init, defaults, fixed, passes_on, set(decided))
        shared = [p.name for p in SHARED if p.name not in fixed]
        var_keyword = next((p.name for p in signature.parameters.values() if p.kind == _P.VAR_KEYWORD), None)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            given = set(bound.arguments)
            bound.apply_defaults()
            if "num_workers" not in given and "num_workers" in bound.arguments:
                bound.arguments["num_workers"] = num_workers_from_environment(bound.arguments["num_workers"])
            own = {
                name: value
                for name, value in bound.arguments.items()
                if name != "self" and (name not in passed or name in given)
            }
            extra = own.pop(var_keyword, {}) if var_keyword else {}
            self.init_arguments = {**own, **extra}
            self.use_workers(type(self).worker_spec({n: own.pop(n) for n in shared} | fixed, own))
            init(self, **own, **extra)
            # Known only now: the backend is an argument of Lightning's strategy, stored by its __init__.
            refuse_nccl_on_a_shared_gpu(type(self).__name__, self.requested_process_group_backend, self.resources)
            # Whatever Lightning's __init__ set: the ranks come from where Ray placed the workers.
            self.cluster_environment = namespaces.member(RayEnvironment, self.namespace)(self.num_workers)

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return __init__

    return decorate


def _public_signature(
    init: Callable, defaults: dict[str, Any], fixed: dict[str, Any], passes_on: tuple[str, ...], decided: set[str]
) -> tuple[inspect.Signature, set[str]]:
    """The signature users see, and the names in it that are passed on only when given."""
    self_parameter, *own = inspect.signature(init).parameters.values()

    def shared(group: tuple[inspect.Parameter, ...]) -> list[inspect.Parameter]:
        return [_with_default(p, defaults[p.name]) if p.name in defaults else p for p in group if p.name not in fixed]

    kinds = {kind: [p for p in own if p.kind == kind] for kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    named = [
        self_parameter,
        *shared(_LEADING),
        *kinds[_P.POSITIONAL_OR_KEYWORD],
        *shared(_RESOURCES),
        *kinds[_P.KEYWORD_ONLY],
        *shared(_BOUNDS),
    ]
    passed = _passed_on(passes_on, {p.name for p in named} | decided)
    signature = inspect.Signature([*named, *passed, *(p for p in own if p.kind == _P.VAR_KEYWORD)])
    return signature, {p.name for p in passed}


def _passed_on(targets: tuple[str, ...], taken: set[str]) -> list[inspect.Parameter]:
    # Written out rather than left to **kwargs: LightningCLI (jsonargparse) follows **kwargs through the
    # class's bases, and the public class has no Lightning base (namespaces.PerNamespace); the primary
    # namespace's signatures serve both, as the two packages ship the same release.
    found: dict[str, inspect.Parameter] = {}
    for target in targets:
        if target.startswith("torch."):
            module, _, name = target.rpartition(".")
            function = getattr(importlib.import_module(module), name).__init__
        else:
            function = namespaces.primary().pl(target).__init__
        for p in _evaluated_signature(function).parameters.values():
            if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY) and p.name not in taken and p.name != "self":
                found.setdefault(p.name, p.replace(kind=_P.KEYWORD_ONLY))
    return list(found.values())


def _evaluated_signature(function: Callable) -> inspect.Signature:
    # Lightning writes its annotations as strings (PEP 563); evaluated where they were written, or left out.
    try:
        return inspect.signature(function, eval_str=True)
    except Exception:  # noqa: BLE001 - a name only imported for type checking: no annotations
        plain = inspect.signature(function)
        return plain.replace(parameters=[p.replace(annotation=_P.empty) for p in plain.parameters.values()])


def _with_default(parameter: inspect.Parameter, default: Any) -> inspect.Parameter:
    annotation = parameter.annotation
    if default is None and isinstance(annotation, type):
        annotation = annotation | None
    return parameter.replace(default=default, annotation=annotation)


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


def mixed_precision_is_stale(plugin: Any, device_type: str) -> bool:
    """Whether Lightning's ``MixedPrecision`` ``plugin``, built on the driver, is wrong for a worker on ``device_type``:
    made for another device, or (``16-mixed``) with the ``GradScaler`` a driver without CUDA disabled for good."""
    scaler = getattr(plugin, "scaler", None)
    return plugin.device != device_type or (device_type == "cuda" and scaler is not None and not scaler.is_enabled())


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


class RayWorkersMixin(LightningStrategyHooks, namespaces.PerNamespace):
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

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._worker is not None:
            try:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            finally:
                clock = runtime.step_clock()
                if clock is not None:
                    clock.checkpoint_done()  # the time it blocked the training thread (channel.timings)
            return
        # On the driver, after a fit: its workers, while they still hold it, write what a one-process fit would.
        full = "optimizer_states" in checkpoint
        weights_stayed = getattr(self, "_send_full_weights", True) is False
        last_fit = getattr(getattr(self, "_launcher", None), "last_fit", None)
        if (full or weights_stayed) and last_fit is not None and last_fit.save(filepath, weights_only=not full):
            return
        if full:
            raise RuntimeError(
                f"trainer.save_checkpoint({os.fspath(filepath)!r}) on the driver would write a checkpoint without the "
                "optimizers' and schedulers' states: they lived in the Ray workers of the fit, which are gone "
                "(they stay keep_workers_alive_s seconds after a fit, 60 by default, and until the next call; "
                "within that time they write it). Write the weights alone with "
                "trainer.save_checkpoint(path, weights_only=True), or resume from a checkpoint the workers wrote: "
                "ModelCheckpoint(save_last=True) and "
                "trainer.checkpoint_callback.last_model_path."
            )
        self._refuse_if_weights_stayed(f"trainer.save_checkpoint({os.fspath(filepath)!r})")
        # The driver's module, whole: one file (a sharded strategy's own saving is collective, for its workers).
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)

    def _refuse_if_weights_stayed(self, what: str) -> None:
        if getattr(self, "_send_full_weights", True) is False:
            raise RuntimeError(
                f"{what} on the driver: the trained weights stayed in the workers' checkpoints (full_weights_home), "
                "so this process holds the untrained ones. Use the checkpoints ModelCheckpoint wrote, or pass "
                "full_weights_home=True."
            )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._worker is None:
            # The driver's optimizers are settings after a fit (home.optimizers); the state stayed in the workers.
            return optimizer.state_dict()
        return super().optimizer_state(optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._worker is None:
            # The driver's module holds plain tensors (a sharded strategy's reading would need the workers'
            # process group); trainer.save_checkpoint after a fit has the workers write theirs (save_checkpoint).
            return self.lightning_module.state_dict()
        return super().lightning_module_state_dict()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # Nothing removes the checkpoint the fit resumed from (ModelCheckpoint's rotation would: Lightning#21813).
        kept = {*(self._worker.keep_checkpoints if self._worker is not None else ()), *self._resumed_from()}
        path = os.fspath(filepath)
        if kept.intersection(path_forms(path)):
            self.namespace.pl("utilities.rank_zero.rank_zero_info")(
                f"ray_lightning: kept {path}: the fit resumed from it, so no checkpoint rotation removes it."
            )
            return
        super().remove_checkpoint(filepath)

    def _resumed_from(self) -> tuple[str, ...]:
        try:
            return path_forms(self.lightning_module.trainer.ckpt_path)
        except (AttributeError, RuntimeError):  # no module, or not attached to a Trainer
            return ()

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

    # -- inside a worker ----------------------------------------------------------------------------

    def attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        """Called by the worker before the call with its rank, device and rendezvous handle."""
        self._worker = context
        self._rendezvous_store = rendezvous_store
        assert self._cluster_environment is not None
        self._cluster_environment.configure(context.rank, context.world_size, context.main_address, context.main_port)
        self.parallel_devices = [self.root_device] * context.rank.local_world_size
        self.adapt_precision_to_device()
        background = self.workers.storage.enabled and self.writes_in_background
        if background and not isinstance(self.checkpoint_io, BackgroundCheckpointIO):
            # Rank 0's checkpoint files go to storage while training goes on (home.background_io).
            self.checkpoint_io = BackgroundCheckpointIO(self.checkpoint_io)

    def adapt_precision_to_device(self) -> None:
        """In a worker: mixed precision for the device this worker trains on, not the driver's.

        Lightning built it for the driver's device; a GradScaler made where CUDA is absent is disabled
        for good, so it is built anew.
        """
        plugin = self.precision_plugin
        mixed_precision = self.namespace.pl("plugins.precision.MixedPrecision")
        if type(plugin) is mixed_precision and mixed_precision_is_stale(plugin, self.root_device.type):
            self.precision_plugin = mixed_precision(plugin.precision, self.root_device.type)

    def detach_worker(self) -> None:
        """Called by the worker after a call succeeded: leave the process group, so that the
        process can join the next call's."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._worker = None
        self._rendezvous_store = None

    @override
    def worker_process_group_backend(self) -> str:
        requested = self.requested_process_group_backend
        if requested:
            return requested
        if self.root_device.type == "cuda" and self._worker is not None and self._worker.shares_gpu:
            # NCCL refuses two ranks on one GPU (fractional GPUs); gloo handles CUDA tensors too.
            return "gloo"
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def join_process_group(self) -> None:
        """In a worker: join the call's torch.distributed process group at rank 0's rendezvous (TCPStore)."""
        runtime.mark_progress("rendezvous", "joining the process group", startup=True)
        self.namespace.fabric("utilities.seed.reset_seed")()
        self.set_world_ranks()
        backend = self.worker_process_group_backend()
        self.use_process_group_backend(backend)
        # gloo's (and NCCL's bootstrap) listeners bind this node's IP; the call's environment is
        # restored when it ends.
        interface = interface_for(ray.util.get_node_ip_address())
        os.environ.update(listener_environment(backend, interface, os.environ))
        store = self._rendezvous_store
        if store is None:
            from torch.distributed import TCPStore

            store = TCPStore(
                self.cluster_environment.main_address,
                self.cluster_environment.main_port,
                is_master=False,
                timeout=self.ddp_timeout or timedelta(minutes=30),
            )
        kwargs: dict[str, Any] = {"timeout": self.ddp_timeout, "store": store}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _lightning.init_dist_connection(self.namespace, self.cluster_environment, backend, **kwargs)

    @override
    def set_world_ranks(self) -> None:
        for fabric in (False, True):
            namespaces.set_everywhere("utilities.rank_zero.rank_zero_only", "rank", self.global_rank, fabric=fabric)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rendezvous_store"] = None  # a TCPStore cannot be pickled; workers get theirs on attach
        return state
