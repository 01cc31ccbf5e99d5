"""Small LightningModules and data used across the tests (generated; the digits task is examples/train_digits.py)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class IndexedDataset(Dataset):
    """Random regression data whose items carry their own index, so tests can see what each rank got."""

    def __init__(self, size: int = 64, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class BoringModel(pl.LightningModule):
    """A linear regressor on :class:`IndexedDataset`."""

    def __init__(self, dim: int = 8, lr: float = 0.05, batch_size: int = 8, size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(dim, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _, i = batch
        return {"index": i, "pred": self(x)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def _loader(self, seed: int, shuffle: bool = False, num_workers: int = 0):
        return DataLoader(
            IndexedDataset(self.hparams.size, self.hparams.dim, seed),
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
        )

    def train_dataloader(self):
        return self._loader(0, shuffle=True)

    def val_dataloader(self):
        return self._loader(1)

    def test_dataloader(self):
        return self._loader(2)

    def predict_dataloader(self):
        return self._loader(3)


class Recorder(pl.Callback):
    """Runs in the workers; writes what each rank saw to ``<directory>/<name>-rank<r>-<n>.json``.

    The tests run on one machine, so the driver reads the files the workers wrote.
    """

    def __init__(self, directory, name: str = "fit") -> None:
        self.directory = str(directory)
        self.name = name
        self.seen_indices: list[list[int]] = []

    def _write(self, trainer, key: str, payload: dict) -> None:
        import json
        import os

        path = os.path.join(self.directory, f"{self.name}-{key}-rank{trainer.global_rank}.json")
        with open(path, "w") as f:
            json.dump(payload, f)

    def on_fit_start(self, trainer, pl_module):
        import os

        import ray

        self._write(
            trainer,
            "start",
            {
                "global_rank": trainer.global_rank,
                "local_rank": trainer.local_rank,
                "node_rank": trainer.node_rank,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "node_id": ray.get_runtime_context().get_node_id(),
                "resources": ray.get_runtime_context().get_assigned_resources(),
                "pid": os.getpid(),
                "env_hook": os.environ.get("RAY_LIGHTNING_TEST_HOOK"),
                "progress_bar_enabled": bool(
                    trainer.progress_bar_callback and trainer.progress_bar_callback.is_enabled
                ),
                "device": str(pl_module.device),
                "backend": _backend(),
                "precision_device": getattr(trainer.precision_plugin, "device", None),
                "precision": type(trainer.precision_plugin).__name__,
                "deterministic": __import__("torch").are_deterministic_algorithms_enabled(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                # The GPUs Ray reserved for this actor (its own ids), and the devices torch sees through the above.
                "gpu_ids": [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
                "cuda_device_count": __import__("torch").cuda.device_count(),
                "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            },
        )

    def on_train_epoch_start(self, trainer, pl_module):
        self.seen_indices.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if isinstance(batch, (list, tuple)) and len(batch) == 3:
            self.seen_indices[-1].extend(int(i) for i in batch[2])

    def on_train_end(self, trainer, pl_module):
        sampler = trainer.train_dataloader.sampler
        self._write(
            trainer,
            "end",
            {
                "indices": self.seen_indices,
                "sampler": type(sampler).__name__,
                "num_replicas": getattr(sampler, "num_replicas", None),
                "rank": getattr(sampler, "rank", None),
            },
        )


class EpochsTrained(pl.Callback):
    """Rank 0 appends a line to ``path`` for each epoch it trains: the epoch and, with ``lr``, the learning rate of
    its first param group (a restored Tune trial's tests: which epochs ran again, with which rate)."""

    def __init__(self, path, lr: bool = False) -> None:
        self.path, self.lr = str(path), lr

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            rate = f" {trainer.optimizers[0].param_groups[0]['lr']}" if self.lr else ""
            with open(self.path, "a") as f:
                f.write(f"{trainer.current_epoch}{rate}\n")


def read_records(directory, name: str, key: str) -> list[dict]:
    """The records of all ranks, ordered by global rank."""
    import json
    from pathlib import Path

    files = sorted(Path(directory).glob(f"{name}-{key}-rank*.json"))
    records = [json.loads(f.read_text()) for f in files]
    return sorted(records, key=lambda r: r.get("global_rank", 0))


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else None


class HorovodRanks(Recorder):
    """Writes what Horovod itself reports in each worker (``<name>-horovod-rank<r>.json``), and the
    samplers and indices each rank trained on as :class:`Recorder` does (``<name>-end-...``)."""

    def on_fit_start(self, trainer, pl_module):
        import os

        import horovod.torch as hvd
        import ray

        self._write(
            trainer,
            "horovod",
            {
                "global_rank": trainer.global_rank,
                "hvd_rank": hvd.rank(),
                "hvd_size": hvd.size(),
                "hvd_local_rank": hvd.local_rank(),
                "hvd_local_size": hvd.local_size(),
                "hvd_cross_rank": hvd.cross_rank(),
                "hvd_cross_size": hvd.cross_size(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gloo_iface": os.environ.get("HOROVOD_GLOO_IFACE"),
                "optimizer": type(trainer.optimizers[0]).__module__,
            },
        )


class Listeners(pl.Callback):
    """Records, in each worker during training, the TCP sockets its process listens on.

    Writes ``<directory>/<name>-listeners-rank<r>.json`` at the first training batch of each fit
    (``fit`` counts the fits of this callback object, so reused workers write a new file).
    """

    def __init__(self, directory, name: str = "fit") -> None:
        self.directory = str(directory)
        self.name = name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import json
        import os

        import psutil
        import ray

        if batch_idx != 0 or trainer.current_epoch != 0:
            return
        listening = [
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        record = {
            "global_rank": trainer.global_rank,
            "pid": os.getpid(),
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "listening": sorted(listening),
            "master_port": int(os.environ.get("MASTER_PORT", "-1")),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "horovod_rendezvous": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
            "horovod_rendezvous_port": int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "-1")),
        }
        with open(os.path.join(self.directory, f"{self.name}-listeners-rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


class StagingMode(pl.Callback):
    """On a staged rank 0 (off the driver's machine), writes its staging directory's permission bits to
    ``<directory>/staging-mode.json``."""

    def __init__(self, directory) -> None:
        self.directory = str(directory)

    def on_train_start(self, trainer, pl_module):
        import json
        import os
        import stat

        from ray_lightning import runtime
        from ray_lightning.home.files import staging_dir

        context = runtime.current_context()
        if context is not None and context.staging_name:
            mode = stat.S_IMODE(os.stat(staging_dir(context.staging_name)).st_mode)
            with open(os.path.join(self.directory, "staging-mode.json"), "w") as f:
                json.dump({"rank": trainer.global_rank, "mode": mode}, f)
