"""What the user asked for, checked before anything is launched, and the settings every layer reads.

* :class:`WorkerResources` / :func:`resolve_worker_resources`: what each worker reserves and how
  many workers there are (no Ray needed to check them);
* :func:`worker_layout`: Horovod's ``num_workers`` or ``num_hosts`` x ``num_slots``;
* :class:`WorkerTimeouts`: the time bounds, from arguments or ``RAY_LIGHTNING_*`` variables;
* :class:`RecoverySettings`: how often a fit may restart its workers, and how often it checkpoints for that;
* the names of those variables and the package's other fixed settings.

Whether the cluster can hold a request is checked at launch (:mod:`ray_lightning.launch.placement`).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Environment variables that set a strategy argument the user left out.
PLACEMENT_TIMEOUT_ENV = "RAY_LIGHTNING_PLACEMENT_TIMEOUT_S"
WORKER_START_TIMEOUT_ENV = "RAY_LIGHTNING_WORKER_START_TIMEOUT_S"
KEEP_WORKERS_ALIVE_ENV = "RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S"
PROGRESS_TIMEOUT_ENV = "RAY_LIGHTNING_PROGRESS_TIMEOUT_S"
SCALE_UP_TIMEOUT_ENV = "RAY_LIGHTNING_SCALE_UP_TIMEOUT_S"
MAX_FAILURES_ENV = "RAY_LIGHTNING_MAX_FAILURES"
RECOVERY_EVERY_N_STEPS_ENV = "RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS"
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
# 15 minutes: a cloud node (a spot GPU instance) takes minutes to boot, pull its image and join;
# the autoscaler retries a launch that failed within that time.
DEFAULT_SCALE_UP_TIMEOUT_S = 900.0
DEFAULT_WORKER_START_TIMEOUT_S = 300.0
DEFAULT_KEEP_WORKERS_ALIVE_S = 60.0


# 15 minutes: longer than any one batch or evaluation step of a real workload, shorter than the
# 30 minutes after which torch.distributed's own timeout fails with an error that blames rank 0.
# Long prepare_data() downloads or setup() need more; None switches the watchdog off. This very
# object is the argument's default: only when the argument *is* it (not merely equal) does
# RAY_LIGHTNING_PROGRESS_TIMEOUT_S apply, since None already means "off". A plain float, so
# LightningCLI's --print_config can write it.
DEFAULT_PROGRESS_TIMEOUT_S: float = float("900")
_OFF = ("none", "off", "")

# Environment variables of the driver that Lightning reads in the workers (seed, deterministic flags),
# and those of the loggers rank 0 runs (WANDB_MODE, WANDB_API_KEY, MLFLOW_ALLOW_FILE_STORE, COMET_...),
# as Lightning's DDP processes inherit them.
FORWARDED_ENV_PREFIXES = ("PL_", "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "WANDB_", "MLFLOW_", "COMET_")
# ... except those that belong to the driver's process: the socket of its W&B service.
NOT_FORWARDED_ENV = ("WANDB_SERVICE",)
# The rendezvous (TCPStore, Horovod's Gloo) waits this many times worker_start_timeout_s for every
# rank to arrive: longer than the watchdog's startup bound, so a rank stuck before it (in init_hook)
# is named by the watchdog instead of surfacing as its peers' rendezvous timeout.
RENDEZVOUS_TIMEOUT_FACTOR = 2.0
# How long to look for a dead worker behind another worker's exception (its peers fail at once too).
DEATH_GRACE_S = 2.0
# After a worker died, how long a restart waits for the others to come out of the broken call (and
# answer that they can run the next one) before it replaces them too.
SALVAGE_WAIT_S = 5.0
# How long a kept worker may take to say whether it can run another call before a fresh one replaces it.
REUSE_CHECK_TIMEOUT_S = 30.0


# The longest wait Python's threads (and so every bound here) accept: about 292 years.
MAX_SECONDS = threading.TIMEOUT_MAX


def _seconds(name: str, value: Any, env: str, default: float, zero_ok: bool = False) -> float:
    """A time bound from the argument ``name``, else the variable ``env``, else ``default``."""
    source = name
    if value is None and env in os.environ:
        source, raw = f"{env} (environment variable)", os.environ[env]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds, got {raw!r}.") from None
    elif value is None:
        value = default
    kind = "non-negative" if zero_ok else "positive"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source} must be a {kind} number of seconds, got {value!r}.")
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise ValueError(
            f"{source} must be a finite number of seconds (at most {MAX_SECONDS:.0f}), got {value!r}; "
            "for a very long bound give a large number such as 86400 (a day)."
        )
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{source} must be a {kind} number of seconds, got {value!r}.")
    return float(value)


def _progress_seconds(value: float | None) -> float | None:
    if value is DEFAULT_PROGRESS_TIMEOUT_S:
        text = os.environ.get(PROGRESS_TIMEOUT_ENV)
        if text is None:
            return float(value)
        try:
            value = None if text.strip().lower() in _OFF else float(text)
        except ValueError:
            raise ValueError(
                f"{PROGRESS_TIMEOUT_ENV}={text!r}: give a positive number of seconds, or 'none' to switch "
                "the progress watchdog off."
            ) from None
    return None if value is None else _seconds("progress_timeout_s", value, PROGRESS_TIMEOUT_ENV, 0.0)


@dataclass(frozen=True)
class WorkerTimeouts:
    """The time bounds of a launch, in seconds.

    ``placement_s``: waiting for the cluster to free the resources; ``start_s``: started workers
    reporting in and meeting, ``init_hook`` included; ``keep_alive_s``: workers waiting for the
    next call (0: never); ``progress_s``: a rank without progress in setup or any loop (None: no bound).
    """

    placement_s: float
    start_s: float
    keep_alive_s: float
    progress_s: float | None = None
    # Waiting for the autoscaler to start nodes that a request needs (only when it can).
    scale_up_s: float = DEFAULT_SCALE_UP_TIMEOUT_S

    @classmethod
    def resolve(
        cls,
        placement_timeout_s: float | None,
        worker_start_timeout_s: float | None,
        keep_workers_alive_s: float | None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        scale_up_timeout_s: float | None = None,
    ) -> WorkerTimeouts:
        """Arguments left as None (``progress_timeout_s``: left out) come from the ``RAY_LIGHTNING_*``
        variables, else the defaults; ``progress_timeout_s=None`` switches that bound off."""
        return cls(
            _seconds("placement_timeout_s", placement_timeout_s, PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S),
            _seconds(
                "worker_start_timeout_s",
                worker_start_timeout_s,
                WORKER_START_TIMEOUT_ENV,
                DEFAULT_WORKER_START_TIMEOUT_S,
            ),
            _seconds(
                "keep_workers_alive_s",
                keep_workers_alive_s,
                KEEP_WORKERS_ALIVE_ENV,
                DEFAULT_KEEP_WORKERS_ALIVE_S,
                zero_ok=True,
            ),
            _progress_seconds(progress_timeout_s),
            _seconds("scale_up_timeout_s", scale_up_timeout_s, SCALE_UP_TIMEOUT_ENV, DEFAULT_SCALE_UP_TIMEOUT_S),
        )


def _count(name: str, value: Any, env: str, default: int | None, minimum: int) -> int | None:
    """A whole number from the argument ``name``, else the variable ``env``, else ``default``."""
    source = name
    if value is None and env in os.environ:
        source, raw = f"{env} (environment variable)", os.environ[env]
        if raw.strip().lower() in _OFF and default is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{source} must be a whole number, got {raw!r}.") from None
    elif value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{source} must be a whole number >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{source} must be >= {minimum}, got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class RecoverySettings:
    """How a fit survives lost workers.

    ``max_failures``: how many times the worker group may be restarted from the latest recovery
    checkpoint within one call (0: a failure ends the call, as before). ``every_n_steps``: rank 0
    also takes a recovery checkpoint every this many optimizer steps, besides every epoch end
    (None: epoch ends only). Recovery checkpoints are taken only when ``max_failures > 0``.
    """

    max_failures: int = 0
    every_n_steps: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    @classmethod
    def resolve(cls, max_failures: Any = None, every_n_steps: Any = None) -> RecoverySettings:
        """Arguments left as None come from ``RAY_LIGHTNING_MAX_FAILURES`` and
        ``RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS``, else 0 and None."""
        return cls(
            _count("max_failures", max_failures, MAX_FAILURES_ENV, 0, 0) or 0,
            _count("recovery_checkpoint_every_n_steps", every_n_steps, RECOVERY_EVERY_N_STEPS_ENV, None, 1),
        )


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str], takes: str) -> None:
    """Refuse keyword arguments ``owner`` does not take, with the closest accepted name.

    ``takes`` says in words what ``owner`` accepts, for the error message.
    """
    accepted = sorted(set(accepted))
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        lines.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{owner} got unknown keyword argument(s) {', '.join(lines)}. {owner} takes {takes}: {', '.join(accepted)}."
    )


def refuse_decided(owner: str, kwargs: dict[str, Any], decided: dict[str, str]) -> dict[str, Any]:
    """The keyword arguments to pass on to Lightning, without those ``owner`` decides itself (name -> why).

    Those given as None are dropped (LightningCLI/jsonargparse passes every argument of Lightning's
    strategy with its default); any other value of them is refused, saying why.
    """
    kwargs = {k: v for k, v in kwargs.items() if not (k in decided and v is None)}
    given = sorted(set(decided) & set(kwargs))
    if given:
        reasons = "; ".join(f"{name} itself ({decided[name]})" for name in given)
        raise TypeError(f"{owner} sets {reasons}; do not pass {', '.join(given)}.")
    return kwargs


def check_init_hook(init_hook: Any) -> None:
    """``init_hook`` is called in every worker with no arguments: refuse what cannot be."""
    if init_hook is None:
        return
    if not callable(init_hook):
        raise TypeError(f"init_hook must be a function taking no arguments, got {init_hook!r}.")
    try:
        signature = inspect.signature(init_hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it will tell for itself
    try:
        signature.bind()
    except TypeError as error:
        raise TypeError(
            f"init_hook is called with no arguments in every worker, but {init_hook!r} cannot be ({error}). "
            "Give it defaults, or wrap it: init_hook=lambda: setup(value)."
        ) from None


def worker_layout(num_workers: Any, num_hosts: Any, num_slots: Any) -> tuple[int, int | None]:
    """``(number of workers, number of hosts or None)`` from the three ways of saying how many.

    ``num_workers`` alone lets Ray pack the workers; ``num_hosts`` and/or ``num_slots`` put
    ``num_slots`` workers on each of ``num_hosts`` different nodes (a missing one counts as 1).
    """
    for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts), ("num_slots", num_slots)):
        if value is None:
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


# Names users write for Ray's built-in resources; Ray only understands the canonical spelling.
_CANONICAL = {
    "cpu": "CPU",
    "cpus": "CPU",
    "num_cpus": "CPU",
    "gpu": "GPU",
    "gpus": "GPU",
    "num_gpus": "GPU",
}
_BUILTIN = ("CPU", "GPU", "memory")


@dataclass(frozen=True)
class WorkerResources:
    """The resources one worker actor reserves, and how many workers there are.

    ``gpus`` follows what is actually reserved: a worker trains on CUDA exactly when ``gpus > 0``.
    With ``num_hosts`` set, the workers are ``num_hosts`` groups of ``num_workers // num_hosts``,
    each group on its own node; otherwise Ray packs them onto as few nodes as it can.
    """

    num_workers: int
    cpus: float
    gpus: float
    custom: Mapping[str, float] = field(default_factory=dict)
    num_hosts: int | None = None

    @property
    def use_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def workers_per_host(self) -> int:
        return self.num_workers // self.num_hosts if self.num_hosts else 1

    def placement(self) -> tuple[list[dict[str, float]], str]:
        """The placement group's bundles and strategy.

        Without hosts: one bundle per worker, packed. With hosts: one bundle per host holding all
        of that host's workers, each on a different node (``STRICT_SPREAD``).
        """
        if not self.num_hosts:
            return [self.bundle() for _ in range(self.num_workers)], "PACK"
        per_host = {k: v * self.workers_per_host for k, v in self.bundle().items()}
        return [dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD"

    def bundle_index(self, worker: int) -> int:
        """The bundle worker number ``worker`` draws its resources from."""
        return worker // self.workers_per_host if self.num_hosts else worker

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle: exactly what one worker actor asks for."""
        bundle: dict[str, float] = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        bundle.update(self.custom)
        return {k: v for k, v in bundle.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options`` that ask for the same as :meth:`bundle`."""
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        custom = {k: v for k, v in self.custom.items() if k != "memory"}
        if custom:
            options["resources"] = custom
        if self.custom.get("memory"):
            options["memory"] = self.custom["memory"]
        return options

    def describe(self) -> str:
        parts = [f"{fmt_resource(k, v)} {k}" for k, v in self.bundle().items()]
        each = f"{{{', '.join(parts) or 'nothing'}}}"
        if self.num_hosts:
            return f"{self.num_hosts} host(s) x {self.workers_per_host} worker(s) x {each}"
        return f"{self.num_workers} worker(s) x {each}"


def fmt_amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# Ray's resources counted in bytes.
_BYTES = ("memory", "object_store_memory")


def fmt_resource(name: str, value: float) -> str:
    """``value`` of resource ``name`` for people: bytes in KiB/MiB/GiB/..., other amounts as numbers."""
    if name not in _BYTES:
        return fmt_amount(value)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    index = 0
    while abs(value) >= 1024 and index < len(units) - 1:
        value, index = value / 1024, index + 1
    return f"{value:.1f}".removesuffix(".0") + f" {units[index]}"


def _check_amount(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a non-negative number, got {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}.")
    return float(value)


def resolve_worker_resources(
    num_workers: Any,
    num_cpus_per_worker: Any = 1,
    use_gpu: Any = False,
    resources_per_worker: Mapping[str, Any] | None = None,
    num_hosts: int | None = None,
) -> WorkerResources:
    """Validate the user's arguments and merge them into one :class:`WorkerResources`.

    ``resources_per_worker`` wins over the plain arguments: its ``CPU`` replaces
    ``num_cpus_per_worker`` and its ``GPU`` replaces ``use_gpu`` (``GPU: 0`` means CPU training even
    with ``use_gpu=True``; ``GPU: 0.5`` means CUDA training even with ``use_gpu=False``).
    ``num_hosts`` (validated by the caller) must divide ``num_workers``.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral):
        raise TypeError(f"num_workers must be an int >= 1, got {num_workers!r}.")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}.")
    if num_hosts is not None and num_workers % num_hosts:
        raise ValueError(f"num_workers={num_workers} cannot be split evenly over num_hosts={num_hosts}.")
    cpus = _check_amount("num_cpus_per_worker", num_cpus_per_worker)
    if not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True or False, got {use_gpu!r}.")
    gpus = 1.0 if use_gpu else 0.0

    custom: dict[str, float] = {}
    if resources_per_worker is not None:
        if not isinstance(resources_per_worker, Mapping):
            raise TypeError(
                "resources_per_worker must be a dict such as {'CPU': 2, 'GPU': 1, 'my_resource': 1}, "
                f"got {resources_per_worker!r}."
            )
        for name, amount in resources_per_worker.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"resources_per_worker keys must be resource names, got {name!r}.")
            canonical = _CANONICAL.get(name.lower())
            if canonical is not None and name != canonical:
                raise ValueError(
                    f"resources_per_worker has {name!r}; Ray calls this resource {canonical!r}. "
                    f"Write resources_per_worker={{{canonical!r}: {amount!r}}}."
                )
            value = _check_amount(f"resources_per_worker[{name!r}]", amount)
            if name == "CPU":
                cpus = value
            elif name == "GPU":
                gpus = value
            else:
                custom[name] = value
    if cpus == 0 and gpus == 0 and not any(custom.values()):
        raise ValueError(
            "Each worker must reserve some resource: num_cpus_per_worker=0 with no GPU or custom resource "
            "would let Ray start any number of workers on one CPU. Ask for a CPU, a GPU or a custom resource."
        )
    if gpus > 1 and not gpus.is_integer():
        raise ValueError(f"A worker can reserve a fraction of one GPU or whole GPUs, not {gpus:g}.")
    return WorkerResources(int(num_workers), cpus, gpus, custom, num_hosts)


def describe_totals(resources: Mapping[str, float], memory: bool = False) -> str:
    """``{CPU: 4, GPU: 1, my_resource: 2}``: what a node, cluster or request holds.

    Node markers and placement-group resources are left out, and so is memory unless ``memory``
    (it is in bytes, and only worth showing when it is what a request lacks).
    """
    shown = {
        k: v
        for k, v in resources.items()
        if not k.startswith("node:") and "_group_" not in k and k != "object_store_memory" and (memory or k != "memory")
    }
    return "{" + ", ".join(f"{k}: {fmt_resource(k, v)}" for k, v in sorted(shown.items())) + "}"
