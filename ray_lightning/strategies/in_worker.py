"""What a strategy does inside a worker: take the rank and device the launcher decided, fit the precision to the
device, and join (and leave) the call's process group.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import ray
import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning.home.background_io import BackgroundCheckpointIO
from ray_lightning.launch.network import interface_for, listener_environment
from ray_lightning.runtime import WorkerContext


def mixed_precision_is_stale(plugin: Any, device_type: str) -> bool:
    """Whether Lightning's ``MixedPrecision`` ``plugin``, built on the driver, is wrong for a worker on ``device_type``:
    made for another device, or (``16-mixed``) with the ``GradScaler`` a driver without CUDA disabled for good."""
    scaler = getattr(plugin, "scaler", None)
    return plugin.device != device_type or (device_type == "cuda" and scaler is not None and not scaler.is_enabled())


class InWorker:
    """The in-worker methods of :class:`~ray_lightning.strategies.workers.RayWorkersMixin` (a base of it)."""

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
