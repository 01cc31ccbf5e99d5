"""The one record of a strategy's workers: how many and what each reserves, the time bounds, the restarts, the hook,
where the run's files go."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray_lightning.config.arguments import check_init_hook
from ray_lightning.config.elastic import ElasticSettings
from ray_lightning.config.resources import WorkerResources, resolve_worker_resources
from ray_lightning.config.restarts import RecoverySettings
from ray_lightning.config.storage import StorageSettings
from ray_lightning.config.timeouts import DEFAULT_PROGRESS_TIMEOUT_S, WorkerTimeouts


@dataclass(frozen=True)
class WorkerSpec:
    """What a strategy's workers are: how many and what each reserves, the time bounds, the restarts, the hook.

    Made once per strategy, from its constructor's arguments (:meth:`resolve`); the launcher reads nothing else.
    """

    resources: WorkerResources
    timeouts: WorkerTimeouts
    recovery: RecoverySettings
    init_hook: Callable[[], Any] | None = None
    storage: StorageSettings = StorageSettings()
    elastic: ElasticSettings | None = None  # num_workers=(min, max); None for a fixed size

    @classmethod
    def resolve(
        cls,
        num_workers: Any = 1,
        num_cpus_per_worker: Any = 1,
        use_gpu: Any = False,
        resources_per_worker: Mapping[str, Any] | None = None,
        init_hook: Callable[[], Any] | None = None,
        *,
        num_hosts: int | None = None,
        placement_timeout_s: float | None = None,
        worker_start_timeout_s: float | None = None,
        keep_workers_alive_s: float | None = None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        scale_up_timeout_s: float | None = None,
        max_failures: int | None = None,
        recovery_checkpoint_every_n_steps: int | None = None,
        storage_path: str | None = None,
        run_name: str | None = None,
        batch_policy: str | None = None,
        grow_check_interval_s: float | None = None,
    ) -> WorkerSpec:
        """Check every argument (a bad one raises naming it) and fill in those left out from the environment."""
        elastic = ElasticSettings.resolve(num_workers, batch_policy, grow_check_interval_s)
        if elastic.enabled and num_hosts is not None:
            raise ValueError(
                f"num_workers={num_workers!r} (elastic) cannot be combined with num_hosts/num_slots: give a fixed "
                "number of hosts, or num_workers=(min, max) alone."
            )
        resources = resolve_worker_resources(
            elastic.max_workers, num_cpus_per_worker, use_gpu, resources_per_worker, num_hosts
        )
        timeouts = WorkerTimeouts.resolve(
            placement_timeout_s, worker_start_timeout_s, keep_workers_alive_s, progress_timeout_s, scale_up_timeout_s
        )
        recovery = RecoverySettings.resolve(max_failures, recovery_checkpoint_every_n_steps)
        check_init_hook(init_hook)
        storage = StorageSettings.resolve(storage_path, run_name)
        return cls(resources, timeouts, recovery, init_hook, storage, elastic if elastic.enabled else None)
