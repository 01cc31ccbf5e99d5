"""Modules for the sharded strategies' tests: an MLP to shard with FSDP2, a transformer block for tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.models import BoringModel


class MLP(BoringModel):
    """BoringModel's regression with a hidden layer; no configure_model (RayFSDPStrategy, RayStrategy shard or not)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layer = nn.Sequential(nn.Linear(self.hparams.dim, 16), nn.ReLU(), nn.Linear(16, 1))


class ShardedMLP(MLP):
    """The same MLP, sharded by its own configure_model on the data-parallel mesh (RayModelParallelStrategy)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in self.layer:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self.layer, mesh=mesh)


class Sequences(Dataset):
    def __init__(self, size: int = 32, length: int = 6, dim: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, length, dim, generator=g)
        self.y = self.x.flip(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Block(nn.Module):
    """A transformer block: self-attention (q, k, v, o) and an MLP (w1, w2), each with a LayerNorm."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.norm1(x)
        batch, length, _ = h.shape
        # Under tensor parallelism q, k, v hold this rank's heads only: count them from the width.
        q, k, v = (p(h).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, -1)
        x = x + self.o(attended)
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class BlockModel(BoringModel):
    """A transformer block learning to reverse sequences; ``configure_model`` applies tensor parallelism."""

    def __init__(self, dim: int = 16, lr: float = 0.05, batch_size: int = 8, size: int = 32) -> None:
        super().__init__(dim=dim, lr=lr, batch_size=batch_size, size=size)
        self.block = Block(dim)
        del self.layer

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {name: ColwiseParallel() for name in ("q", "k", "v", "w1")}
        plan.update(o=RowwiseParallel(), w2=RowwiseParallel())
        parallelize_module(self.block, self.device_mesh["tensor_parallel"], plan)

    def forward(self, x):
        return self.block(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def _loader(self, seed: int, shuffle: bool = False, num_workers: int = 0):
        data = Sequences(self.hparams.size, dim=self.hparams.dim, seed=seed)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle)


class DenseBlockModel(BlockModel):
    """The same block unsharded (the reference)."""

    def configure_model(self) -> None:
        pass
