"""A real model under Fabric on Ray: LitGPT's GPT (pythia-14m, random init, nothing downloaded) trained a few steps
with ``Fabric(strategy=RayFSDPStrategy(...))`` on 2 CPU workers, sharded with FSDP2 by its transformer blocks.

LitGPT's pins would downgrade the test extra's packages, so ``dev.py test`` installs it without its dependencies
(``ensure_litgpt``); where it is missing this module is skipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from ray_lightning import RayFSDPStrategy
from ray_lightning.namespaces import GLOO_SHARDING_TORCH, version_tuple

pytest.importorskip("litgpt")

import lightning as L
from litgpt.config import Config
from litgpt.model import GPT, Block

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.skipif(
        version_tuple(torch.__version__) < GLOO_SHARDING_TORCH,
        reason=f"FSDP2 on CPUs (gloo) needs torch 2.9, this is {torch.__version__}",
    ),
]

BLOCK_SIZE = 32
BATCH = 2


def config() -> Config:
    return Config.from_name("pythia-14m", block_size=BLOCK_SIZE)


def train_gpt(fabric: L.Fabric, steps: int) -> dict:
    """Runs on each Ray worker: a few optimizer steps on random tokens (one fixed batch per rank)."""
    from torch.distributed.tensor import DTensor

    fabric.seed_everything(0)  # the same initial weights on every rank, which FSDP2 then shards
    model = GPT(config())
    qkv_before = model.transformer.h[0].attn.qkv.weight.detach().clone()
    model = fabric.setup_module(model)
    # FSDP2: the optimizer is made from the sharded parameters, after setup_module.
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    qkv = model.module.transformer.h[0].attn.qkv.weight
    generator = torch.Generator().manual_seed(fabric.global_rank)
    tokens = torch.randint(0, config().vocab_size, (BATCH, BLOCK_SIZE + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(fabric.device), tokens[:, 1:].to(fabric.device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())

    return {
        "world_size": fabric.world_size,
        "losses": losses,
        "qkv_type": type(qkv).__name__,
        "qkv_is_dtensor": isinstance(qkv, DTensor),
        "qkv_local_shape": tuple(qkv.to_local().shape) if isinstance(qkv, DTensor) else None,
        "qkv_full_shape": tuple(qkv.shape),
        "qkv_changed": not torch.equal(qkv.full_tensor().cpu(), qkv_before),  # a collective: every rank calls it
    }


def test_litgpt_trains_sharded_by_block_on_ray_workers():
    fabric = L.Fabric(strategy=RayFSDPStrategy(num_workers=2, auto_wrap_policy={Block}))
    result = fabric.launch(train_gpt, 3)

    assert result["world_size"] == 2
    losses = result["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the loss did not go down on a fixed batch: {losses}"
    assert result["qkv_changed"], "the optimizer steps left the weights as they were"
    # Sharded: each rank holds half of the block's weight (FSDP2 splits dim 0), the full shape is the model's.
    assert result["qkv_is_dtensor"], f"a {result['qkv_type']}, not a DTensor: the model was not sharded"
    full = result["qkv_full_shape"]
    assert full == (3 * config().n_embd, config().n_embd)
    assert result["qkv_local_shape"] == (full[0] // 2, full[1])
