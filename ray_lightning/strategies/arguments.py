"""The arguments that describe a strategy's workers, written once (:data:`SHARED`), and :func:`worker_arguments`,
which adds them to every strategy's ``__init__`` so that each names only its own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ray_lightning import namespaces
from ray_lightning.config.elastic import num_workers_from_environment
from ray_lightning.config.resources import refuse_nccl_on_a_shared_gpu
from ray_lightning.config.timeouts import DEFAULT_PROGRESS_TIMEOUT_S
from ray_lightning.environment import RayEnvironment

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
    (:class:`~ray_lightning.config.workers.WorkerSpec`, made by the class's
    :meth:`~ray_lightning.strategies.workers.RayWorkersMixin.worker_spec`),
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
