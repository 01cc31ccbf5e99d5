"""The Ray actor that runs one training process, and what it does once started.

A ``fit``/``validate``/``test``/``predict`` runs on ``num_workers`` :class:`RayWorker` actors
(see :mod:`ray_lightning.launcher`). An actor reports where it runs (:meth:`RayWorker.node_info`),
rank 0 opens the rendezvous store (:meth:`RayWorker.open_rendezvous`), then every actor receives its
rank and runs the Trainer function (:meth:`RayWorker.execute`). After a successful call the actor
leaves the process group and can run the next call of the same process
(:mod:`ray_lightning.idle_workers`), unless code it imported changed (:meth:`RayWorker.reusable`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray

from ray_lightning.environment import WorkerRank
from ray_lightning.output import ProgressLines


@dataclass(frozen=True)
class WorkerContext:
    """Everything a worker learns from the launcher before it trains."""

    rank: WorkerRank
    world_size: int
    num_nodes: int
    main_address: str
    main_port: int
    cuda_visible_devices: str
    device_index: int | None
    shares_gpu: bool
    # Rank 0 off the driver's machine writes its files under the staging directory of this name and
    # sends them back (ray_lightning.driver_files); None elsewhere.
    staging_name: str | None
    env_vars: dict[str, str]
    driver_sys_path: tuple[str, ...] = ()
    # (deterministic algorithms, warn only, cudnn.benchmark) as Trainer(...) set them on the driver.
    torch_flags: tuple[bool, bool, bool] = (False, False, False)
    # The queue of calls to run on the driver (ray_lightning.driver_channel), if the Trainer needs one.
    driver_queue: Any = None
    # The ckpt_path argument when it is a file on the driver's machine: (its absolute path, a
    # reference to its bytes for workers on other machines, None on the driver's machine).
    checkpoint_file: tuple[str, ray.ObjectRef | None] | None = None


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    node_ip: str
    pid: int
    gpu_ids: list[str]


class RayWorker:
    """One training process. Created through ``ray.remote(RayWorker).options(...)`` by the launcher."""

    def __init__(self, global_rank: int) -> None:
        self._store: Any = None
        self._global_rank = global_rank
        # Modification times of the code files imported by the last call (see `reusable`).
        self._code_files: dict[str, float] = {}
        self._unfinished: tuple[Any, dict[str, str]] | None = None  # see finish_call

    def __repr__(self) -> str:
        # Ray prefixes the lines an actor prints with its repr: "(rank 1 pid=...) Epoch 0: ...".
        return f"rank {self._global_rank}"

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
        return all(_mtime(path) == mtime for path, mtime in self._code_files.items())

    def open_rendezvous(self, kind: str, nodes_by_rank: list[str], timeout_s: float) -> tuple[int, list[dict]]:
        """Open the rendezvous the other workers connect to (rank 0 only); keep it open while training.

        Returns its port and, per global rank, extra environment variables for that worker.
        ``kind`` "torch": torch.distributed's TCPStore. "horovod": horovod.ray's Gloo rendezvous
        server (:mod:`ray_lightning.horovod_support`). Either binds a port the OS picks, here in
        the process that keeps it open, so no other process can take the port between choosing
        and using it, and concurrent fits on one node never collide.
        """
        if kind == "horovod":
            from ray_lightning.horovod_support import open_rendezvous

            self._store, port, rank_env = open_rendezvous(nodes_by_rank, timeout_s)
            return port, rank_env
        from torch.distributed import TCPStore

        self._store = TCPStore(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return self._store.port, [{} for _ in nodes_by_rank]

    def execute(self, payload: list[ray.ObjectRef], context: WorkerContext) -> Any:
        """Run the Trainer function (``trainer._fit_impl`` etc.) with this worker's rank.

        ``payload`` is ``[ref]`` rather than ``ref`` so that Ray does not unpickle it on arrival:
        the device environment must be set before anything could initialise CUDA, and the module
        may come from a directory only the driver had on ``sys.path``.
        """
        from pytorch_lightning.trainer.states import TrainerFn

        from ray_lightning import accelerator as accelerator_module
        from ray_lightning import driver_channel, driver_files
        from ray_lightning.results import PredictionRecorder, collect_worker_output

        self.finish_call()
        saved_environment = dict(os.environ)  # this call's variables, and those it sets itself, go afterwards
        _set_environment(context)
        for path in context.driver_sys_path:
            if path not in sys.path and os.path.isdir(path):
                sys.path.append(path)
        trainer, function, args, kwargs = ray.get(payload[0])
        with contextlib.ExitStack() as scratch:
            if context.checkpoint_file is not None:
                path, data = context.checkpoint_file
                if data is not None:
                    directory = scratch.enter_context(tempfile.TemporaryDirectory(prefix="ray_lightning-ckpt-"))
                    path = os.path.join(directory, os.path.basename(path))
                    with open(path, "wb") as f:
                        f.write(ray.get(data))
                args, kwargs = _with_checkpoint_path(function, args, kwargs, path)
            # Kept if the call fails: the launcher fetches what is in it (driver_files.fetch_after_failure).
            staging = driver_files.staging_dir(context.staging_name) if context.staging_name else None
            if staging is not None:
                driver_files.stage(trainer, staging)
            accelerator_module._IN_RAY_WORKER = True
            driver_channel._worker_queue = context.driver_queue

            strategy = trainer.strategy
            strategy._attach_worker(context, self._store)
            if strategy.init_hook is not None:
                strategy.init_hook()
            recorder = None
            if trainer.state.fn == TrainerFn.PREDICTING:
                recorder = PredictionRecorder()
                trainer.callbacks.append(recorder)
            with _readable_output(context.rank.global_rank == 0, progress_to_driver=context.driver_queue is not None):
                results = function(*args, **kwargs)
            output = collect_worker_output(trainer, results, recorder, staging)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        # The code as it is now ran this call: a later change on disk makes the process stale.
        self._code_files = _imported_code_files()
        # The clean-up for the next call waits until the results are on their way (finish_call).
        self._unfinished = (strategy, saved_environment)
        return output

    def finish_call(self) -> None:
        """After a call succeeded and returned: leave its process group and environment, for the next call.

        The launcher sends this right after the results arrived, so the driver does not wait for it;
        :meth:`execute` and :meth:`reusable` also run it if it is still due.
        """
        import torch

        from ray_lightning import driver_channel

        if self._unfinished is None:
            return
        strategy, saved_environment = self._unfinished
        self._unfinished = None
        strategy._detach_worker()
        self._store = None
        driver_channel._worker_queue = None
        os.environ.clear()
        os.environ.update(saved_environment)
        del strategy
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # a waiting worker should not hold cached GPU memory


def _with_checkpoint_path(function: Any, args: tuple, kwargs: dict, path: str) -> tuple[tuple, dict]:
    """``args``/``kwargs`` of ``function`` with its ``ckpt_path`` argument replaced by ``path``."""
    import inspect

    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs


@contextlib.contextmanager
def _readable_output(enabled: bool, progress_to_driver: bool) -> Iterator[None]:
    """On rank 0, turn the progress bar's in-place redraws into lines Ray can forward.

    With ``progress_to_driver`` the bar's states go to the driver, which draws the one bar.
    """
    if not enabled:
        yield
        return
    original = sys.stdout
    stream = ProgressLines(original, to_driver=progress_to_driver)
    sys.stdout = stream
    try:
        yield
    finally:
        stream.close_line()
        sys.stdout = original


def _set_environment(context: WorkerContext) -> None:
    import torch

    update = {
        **context.env_vars,
        "LOCAL_RANK": str(context.rank.local_rank),
        "RANK": str(context.rank.global_rank),
        "NODE_RANK": str(context.rank.node_rank),
        "WORLD_SIZE": str(context.world_size),
        "LOCAL_WORLD_SIZE": str(context.rank.local_world_size),
        "MASTER_ADDR": context.main_address,
        "MASTER_PORT": str(context.main_port),
        # The device follows the GPUs Ray reserved: none means none visible.
        "CUDA_VISIBLE_DEVICES": context.cuda_visible_devices,
    }
    os.environ.update(update)
    # Ray numbers GPUs in PCI bus order; make CUDA's ordinals agree.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    deterministic, warn_only, benchmark = context.torch_flags
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark


# Code that is part of Python or of installed packages does not change between calls.
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _imported_code_files() -> dict[str, float]:
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and not path.startswith(_INSTALLED):
            files[path] = _mtime(path)
    return files


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0
