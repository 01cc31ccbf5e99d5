"""The Ray actor that runs one training process.

The launcher starts one :class:`RayWorker` per worker (:mod:`.worker_group`). The actor reports
where it runs (:meth:`RayWorker.node_info`), rank 0 opens the rendezvous
(:meth:`RayWorker.open_rendezvous`), then every actor receives its rank and runs the Trainer
function (:meth:`RayWorker.execute`, i.e. :class:`~ray_lightning.launch.call.WorkerCall`), and hands the
driver the trained weights it holds, a chunk at a time (:meth:`RayWorker.weights_chunk`). After a
successful call the actor cleans up (:meth:`RayWorker.finish_call`) and can run the next call of
the same process (:mod:`.idle_pool`), unless code it imported changed (:meth:`RayWorker.reusable`).
"""

from __future__ import annotations

import gc
import os
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from ray_lightning import namespaces
from ray_lightning._ray import logs
from ray_lightning.home import files, snapshot
from ray_lightning.home.results import WorkerOutput
from ray_lightning.home.snapshot import SnapshotHeader
from ray_lightning.launch import priority
from ray_lightning.launch.call import WorkerCall, imported_code_files, mtime
from ray_lightning.launch.rendezvous import Rendezvous, RendezvousPoint
from ray_lightning.launch.stacks import enable_signal_dump
from ray_lightning.runtime import WorkerContext


@dataclass(frozen=True)
class NodeInfo:
    """Where an actor landed."""

    node_id: str
    node_ip: str
    pid: int
    gpu_ids: list[str]


class RayWorker:
    """One training process. Created through ``ray.remote(RayWorker).options(...)`` by the worker group."""

    def __init__(self, global_rank: int) -> None:
        # A stuck worker's stack can then be taken even where py-spy may not attach (launch.stacks).
        enable_signal_dump()
        self._global_rank = global_rank
        self._store: Any = None  # the rendezvous rank 0 keeps open during a call
        # Modification times of the code files imported by the last call (see `reusable`).
        self._code_files: dict[str, float] = {}
        self._unfinished: WorkerCall | None = None  # see finish_call
        self._niceness: int | None = None  # the last call's (the driver's), for let_go
        self._weights: list[Any] = []  # chunks of the last call's trained weights, until the driver takes them
        self._completed: tuple[WorkerOutput | None] | None = None  # the last call's output, if it returned (completed)
        # torch's generator as a new process has it (a fixed default seed), for every later call (finish_call).
        self._fresh_torch_random = torch.get_rng_state()
        # Start-up marks of this process (channel.timings): when it started, when Ray had it load this class (its
        # imports began), and when they were done.
        self.started = {
            "worker process started": _process_start(),
            "worker imports began": namespaces.IMPORT_STARTED,
            "worker imports done": time.time(),
        }

    def __repr__(self) -> str:
        # Ray prefixes the lines an actor prints with its repr: "(rank 1 pid=...) Epoch 0: ..." (see execute).
        return "spare" if self._global_rank < 0 else f"rank {self._global_rank}"

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpu_ids=[str(g) for g in ray.get_gpu_ids()],
        )

    def reusable(self) -> bool:
        """Whether this process may run another call: no code file it imported has changed since.

        A reused process keeps the modules it imported; a module edited on disk in between (a
        notebook user changing their code) would otherwise run stale.
        """
        self.finish_call()
        return all(mtime(path) == modified for path, modified in self._code_files.items())

    def open_rendezvous(self, rendezvous: Rendezvous, nodes_by_rank: list[str], timeout_s: float) -> RendezvousPoint:
        """Open the rendezvous the other workers connect to (rank 0 only); keep it open while training."""
        self._store, point = rendezvous.open(nodes_by_rank, timeout_s)
        return point

    def execute(self, payload: list[ray.ObjectRef], context: WorkerContext) -> WorkerOutput | None:
        """Run the Trainer function (``trainer._fit_impl`` etc.) with this worker's rank.

        ``payload`` is ``[ref]`` rather than ``ref`` so that Ray does not unpickle it on arrival
        (see :mod:`.call`).
        """
        self.finish_call()
        self._weights, self._completed = [], None
        if context.rank.global_rank != self._global_rank:
            # A spare taking a dead worker's place, or a group re-formed after a lost node: the driver prints this
            # process's lines as "(rank N pid=...)" again, N its rank now (Ray read the name once, at the start).
            if self._global_rank < 0:  # a spare (launch.worker_group): says which rank it takes
                print(f"ray_lightning: this spare process (pid {os.getpid()}) is rank {context.rank.global_rank} now")
            self._global_rank = context.rank.global_rank
            logs.name_this_actors_output(repr(self))
        self._niceness = context.niceness
        snapshot.forget()  # a failed fit's state, shared (or not needed) before this call was sent
        call = WorkerCall(context, self._store, self.started)
        try:
            output = call.run(payload[0])
        except BaseException as error:
            # Clean up now, not when a restart asks (reusable): gloo's transport thread spins on a connection
            # whose peer is gone, a core per survivor, starving what the driver runs on this node meanwhile (the
            # fetch of rank 0's files, a new worker's imports). The traceback's frames let go of the failed fit
            # (its process group) first; the text of the traceback stays. What a restart goes on from is kept
            # apart (home.snapshot).
            self._unfinished = call
            traceback.clear_frames(error.__traceback__)
            self.finish_call()
            raise
        if output is not None and isinstance(output.weights, list):
            # The weights stay here until the driver asks for them, a chunk at a time (weights_chunk).
            self._weights, output.weights = output.weights, len(output.weights)
        self._completed = (output,)
        # The code as it is now ran this call: a later change on disk makes the process stale.
        self._code_files = imported_code_files()
        # The clean-up for the next call waits until the results are on their way (finish_call).
        self._unfinished = call
        return output

    def completed(self) -> tuple[WorkerOutput | None] | None:
        """``(output,)`` as the last :meth:`execute` returned it, None if it raised: what a call the driver cancelled
        as it ended returned (Ray then reports the call cancelled, :meth:`~.worker_group.WorkerGroup.interrupt`)."""
        return self._completed

    def let_go(self) -> None:
        """After a failed call, once :meth:`execute` has returned: free what the failed fit still held.

        Its process group's connections stay open while anything references the group, and the fit's objects
        (Trainer, DDP's reducer) are cycles that only a collection frees: one run inside ``execute`` finds the
        failure's frames still alive. A peer still waiting in a collective on this rank (it had not failed with
        it) then fails at once, instead of at the process group's timeout (30 minutes). At the call's niceness:
        at Ray's, on a busy node, the collection takes seconds.
        """
        priority.hold(self._niceness)
        try:
            gc.collect()
        finally:
            priority.release()

    def snapshot_header(self) -> SnapshotHeader | None:
        """After a fit failed here: the step this process reached, and the state it holds (``home.snapshot``)."""
        return snapshot.header()

    def share_snapshot(self) -> list[ray.ObjectRef]:
        """The held state, serialized into this node's object store, for the restarted ranks: ``[reference]``."""
        return snapshot.share()

    def collect_staged(self, name: str, home: str | None) -> dict[str, Any]:
        """After a failed call on rank 0: the files it staged under ``name`` (:func:`~ray_lightning.home.files.
        collect_and_remove`), taken by this process, which has everything imported, instead of a new one."""
        return files.collect_and_remove(name, home)

    def weights_chunk(self, index: int) -> list[Any]:
        """Chunk ``index`` of the trained weights this worker holds for the driver (:mod:`ray_lightning.home.weights`).

        The driver asks for each chunk once; the worker lets it go as it returns it.
        """
        chunk, self._weights[index] = self._weights[index], []
        return chunk

    def save_after_fit(self, filepath: str, weights_only: bool) -> None:
        """``trainer.save_checkpoint(filepath)`` in the fit this worker ran last, which it still holds (every rank
        takes part, as in the fit); raises when it holds none (its clean-up ran)."""
        call = self._unfinished
        if call is None or call.fitted is None:
            raise RuntimeError("ray_lightning: this worker no longer holds the fit's Trainer.")
        call.save_after_fit(filepath, weights_only)

    def wait_idle(self) -> None:
        """After a fit whose state this worker keeps (:meth:`save_after_fit`): it waits at Ray's niceness."""
        priority.release()

    def finish_call(self) -> None:
        """After a call returned or failed: clean up for the next call.

        The launcher sends this right after the results arrived, so the driver does not wait for it;
        :meth:`execute` and :meth:`reusable` also run it if it is still due.
        """
        call, self._unfinished = self._unfinished, None
        if call is not None:
            self._store = None
            call.finish()
            # The next call (a notebook's next fit, Tune's next trial) draws what a new process would: nothing
            # of this call's random state carries over to a call that sets no seed.
            random.seed()
            np.random.seed()
            torch.set_rng_state(self._fresh_torch_random)


def _process_start() -> float:
    """When this process started (``time.time()``'s clock)."""
    import psutil

    return psutil.Process().create_time()
