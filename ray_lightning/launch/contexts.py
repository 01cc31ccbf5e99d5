"""Each worker's :class:`~ray_lightning.runtime.WorkerContext`, from where its actor landed.

Ranks and devices come from :mod:`ray_lightning.environment` (pure functions of the node ids and
GPU ids the actors reported); the rendezvous point from rank 0; the staging directory and the
``ckpt_path`` file from where the driver is. Also the log line that says where the workers run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ray_lightning.config.variables import NOT_FORWARDED_ENV
from ray_lightning.environment import WorkerRank, assign_cuda_devices, shares_a_gpu
from ray_lightning.home.files import StagingArea
from ray_lightning.home.weights import module_bytes
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.rendezvous import RendezvousPoint
from ray_lightning.launch.session import driver_niceness, driver_sys_path
from ray_lightning.runtime import CheckpointFile, RecoveryPlan, TorchFlags, WorkerContext

# Environment variables of the driver that Lightning reads in the workers (seed, deterministic flags),
# and those of the loggers rank 0 runs (WANDB_MODE, WANDB_API_KEY, MLFLOW_ALLOW_FILE_STORE, COMET_...),
# as Lightning's DDP processes inherit them.
FORWARDED_ENV_PREFIXES = ("PL_", "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "WANDB_", "MLFLOW_", "COMET_")
# With storage_path, also the cloud SDKs' and fsspec's, which its filesystems read in every rank (credentials,
# endpoints, regions: AWS_ENDPOINT_URL, GOOGLE_CLOUD_PROJECT...); without it the workers keep their own.
STORAGE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCSFS_", "AZURE_", "FSSPEC_")


@dataclass(frozen=True)
class CallSettings:
    """What the driver decided for this call, the same for every worker."""

    driver_queue: Any = None  # the driver channel's queue
    progress_interval_s: float | None = None  # how often ranks report progress; None: they do not
    output_marker: str | None = None  # rank N writes f"{output_marker}-{N}" when its call ends
    # A sharded strategy's ranks each write part of a checkpoint: those off the driver's machine stage
    # theirs under f"{shard_staging}-rank{N}" (None: only rank 0 writes files).
    shard_staging: str | None = None
    # The ckpt_path the call was given, which no checkpoint rotation may remove (Lightning#21813).
    keep_checkpoints: tuple[str, ...] = ()
    # The run keeps its files in storage: the storage variables are forwarded too.
    storage: bool = False
    # Every rank off the driver's machine, rank 0 too, stages under ``node_staging_name(shard_staging, node)``: one
    # directory per node, which that node's ranks share as a local disk (a function Fabric launched reads what
    # another rank of its node saved, and a sharded checkpoint's parts on a node are one directory).
    node_staging: bool = False
    # Where ranks that stage copy their large files for the driver (home.driver_disk); None: no rank stages.
    files_home: str | None = None

    def marker_of(self, rank: int) -> str | None:
        return f"{self.output_marker}-{rank}" if self.output_marker is not None else None


def progress_interval(start_timeout_s: float, progress_timeout_s: float | None) -> float:
    """How often a rank reports progress: often enough that a stall is seen soon after its bound passes."""
    shortest = min(b for b in (start_timeout_s, progress_timeout_s) if b is not None)
    return min(max(shortest / 10, 0.2), 5.0)


def nodes_by_rank(ranks: Sequence[WorkerRank], infos: Sequence[NodeInfo]) -> list[str]:
    """The node id of each global rank, in rank order."""
    return [info.node_id for _, info in sorted(zip((r.global_rank for r in ranks), infos))]


def build_contexts(
    ranks: Sequence[WorkerRank],
    infos: Sequence[NodeInfo],
    point: RendezvousPoint,
    driver_node: str | None,
    staging: StagingArea | None,
    checkpoint: tuple[CheckpointFile | None, CheckpointFile | None] = (None, None),
    call: CallSettings = CallSettings(),
    recovery: RecoveryPlan | None = None,
) -> list[WorkerContext]:
    """One context per actor (actor order). ``checkpoint``: the ``ckpt_path`` file for workers on the
    driver's machine and for the others (:func:`ray_lightning.launch.payload.checkpoint_files`).
    ``recovery``: what the workers do for restarts (its ``seed`` goes to rank 0 alone)."""
    node_ids = [i.node_id for i in infos]
    gpu_ids = [i.gpu_ids for i in infos]
    devices = assign_cuda_devices(node_ids, gpu_ids)
    shared = shares_a_gpu(node_ids, gpu_ids)
    rank_zero = next(info for rank, info in zip(ranks, infos) if rank.global_rank == 0)
    prefixes = FORWARDED_ENV_PREFIXES + (STORAGE_ENV_PREFIXES if call.storage else ())
    env = {k: v for k, v in os.environ.items() if k.startswith(prefixes) and k not in NOT_FORWARDED_ENV}
    sys_path = driver_sys_path()
    niceness = driver_niceness()
    # Trainer(deterministic=..., benchmark=...) set these in this process only.
    torch_flags = TorchFlags.capture()
    local_checkpoint, remote_checkpoint = checkpoint
    return [
        WorkerContext(
            rank=rank,
            world_size=len(infos),
            num_nodes=len(set(node_ids)),
            main_address=rank_zero.node_ip,
            main_port=point.port,
            cuda_visible_devices=visible,
            device_index=index,
            shares_gpu=shared,
            staging_name=_staging_name(rank.global_rank, info.node_id, info.node_id != driver_node, staging, call),
            rank_zero_staging=staging.name if staging is not None and call.shard_staging else None,
            env_vars={**env, **(point.rank_env[rank.global_rank] if point.rank_env else {})},
            driver_sys_path=sys_path if info.node_id == driver_node else (),
            torch_flags=torch_flags,
            driver_queue=call.driver_queue,
            checkpoint_file=local_checkpoint if info.node_id == driver_node else remote_checkpoint,
            progress_interval_s=call.progress_interval_s,
            output_marker=call.marker_of(rank.global_rank),
            num_machines=len({i.node_ip for i in infos}),
            recovery=recovery if recovery is None or rank.global_rank == 0 else replace(recovery, seed=None),
            niceness=niceness,
            keep_checkpoints=call.keep_checkpoints,
            files_home=call.files_home,
        )
        for rank, info, (visible, index) in zip(ranks, infos, devices)
    ]


def node_staging_name(base: str, node_id: str) -> str:
    """The staging directory the ranks on node ``node_id`` share (``CallSettings.node_staging``); nodes that share a
    disk (a test's cluster on one machine) keep theirs apart."""
    return f"{base}-{node_id[:12]}"


def _staging_name(
    rank: int, node_id: str, off_driver: bool, staging: StagingArea | None, call: CallSettings
) -> str | None:
    """Where this rank writes its files instead of the driver's paths (None: at the driver's paths)."""
    if call.node_staging and call.shard_staging is not None:
        return node_staging_name(call.shard_staging, node_id) if off_driver else None
    if rank == 0:
        return staging.name if staging is not None else None
    return f"{call.shard_staging}-rank{rank}" if call.shard_staging is not None and off_driver else None


def describe_placement(workers: str, ranks: Sequence[WorkerRank], infos: Sequence[NodeInfo], reused: bool) -> str:
    """The log line saying where the workers run.

    ``ray_lightning: 2 worker(s) x {1 CPU} on 2 node(s): rank 0 on 10.0.0.5 (node 3f2a9c1e, pid 4711, GPUs none), ...``
    """
    placed = ", ".join(
        f"rank {r.global_rank} on {i.node_ip} (node {i.node_id[:8]}, pid {i.pid}, GPUs {','.join(i.gpu_ids) or 'none'})"
        for r, i in sorted(zip(ranks, infos), key=lambda p: p[0].global_rank)
    )
    again = " (reusing the workers of the last call)" if reused else ""
    return f"ray_lightning: {workers} on {len({i.node_id for i in infos})} node(s){again}: {placed}"


def checkpoints_come_home_warning(
    trainer: Any, restarts: bool, infos: Sequence[NodeInfo], driver_node: str
) -> str | None:
    """The warning for a call on several machines without ``storage_path`` whose checkpoints come to the driver's
    disk (recovery checkpoints, a checkpoint callback's files), with what each costs; None when nothing comes.

    Said once per strategy at the first such call: the bytes per checkpoint grow with the model, and every one of
    them crosses the network to this machine, which ``storage_path`` (a bucket, a shared directory) avoids.
    """
    sources = [
        *(["recovery checkpoints (max_failures)"] if restarts else []),
        *(["ModelCheckpoint files"] if getattr(trainer, "checkpoint_callback", None) is not None else []),
    ]
    if trainer is None or not sources or all(info.node_id == driver_node for info in infos):
        return None
    size = module_bytes(trainer.lightning_module)
    what = (
        f"~{size / 2**20:.0f} MiB of weights per checkpoint plus the optimizer's state (Adam: twice that)"
        if size
        else "the model's weights and optimizer state per checkpoint (its layers are made in configure_model)"
    )
    return (
        f"ray_lightning: the workers run on other machines and no storage_path is set, so the {', '.join(sources)} "
        f"come to this machine's disk over the network: {what}. Pass storage_path='s3://bucket/runs' (or a directory "
        "every node "
        "mounts) to the strategy: every rank then writes its own part there and nothing comes through this process."
    )
