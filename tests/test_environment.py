"""Rank and GPU assignment (pure logic), and how the strategy uses them inside a worker.

The GPU cases run everywhere: they check the numbers a GPU worker would use
(CUDA_VISIBLE_DEVICES, device index, backend) without needing a GPU.
"""

from __future__ import annotations

import torch

from ray_lightning import RayStrategy
from ray_lightning.environment import WorkerRank, assign_cuda_devices, assign_ranks, shares_a_gpu
from ray_lightning.runtime import WorkerContext


def test_ranks_group_workers_by_node_and_actor_zero_is_rank_zero():
    ranks = assign_ranks(["b", "a", "b", "a", "c"])
    assert ranks[0] == WorkerRank(global_rank=0, local_rank=0, node_rank=0, local_world_size=2)
    assert [(r.global_rank, r.local_rank, r.node_rank) for r in ranks] == [
        (0, 0, 0),
        (2, 0, 1),
        (1, 1, 0),
        (3, 1, 1),
        (4, 0, 2),
    ]
    assert [r.local_world_size for r in ranks] == [2, 2, 2, 2, 1]


def test_ranks_on_one_node():
    assert [r.global_rank for r in assign_ranks(["n"] * 3)] == [0, 1, 2]
    assert [r.local_rank for r in assign_ranks(["n"] * 3)] == [0, 1, 2]


def test_each_worker_sees_its_nodes_gpus_and_uses_its_own():
    nodes = ["a", "a", "b", "b"]
    gpus = [["3"], ["1"], ["0"], ["1"]]
    assert assign_cuda_devices(nodes, gpus) == [("1,3", 1), ("1,3", 0), ("0,1", 0), ("0,1", 1)]
    assert not shares_a_gpu(nodes, gpus)


def test_multi_gpu_and_fractional_workers():
    # A worker with two GPUs trains on its first; two half-GPU workers share device 0.
    assert assign_cuda_devices(["a", "a"], [["2", "0"], ["1"]]) == [("0,1,2", 2), ("0,1,2", 1)]
    assert assign_cuda_devices(["a", "a"], [["0"], ["0"]]) == [("0", 0), ("0", 0)]
    assert shares_a_gpu(["a", "a"], [["0"], ["0"]])
    assert not shares_a_gpu(["a", "b"], [["0"], ["0"]])
    assert assign_cuda_devices(["a"], [[]]) == [("", None)]


def _context(device_index, shares_gpu=False):
    return WorkerContext(
        rank=WorkerRank(1, 1, 0, 2),
        world_size=2,
        num_nodes=1,
        main_address="10.0.0.1",
        main_port=1234,
        cuda_visible_devices="0,1" if device_index is not None else "",
        device_index=device_index,
        shares_gpu=shares_gpu,
        staging_name=None,
        env_vars={},
    )


def test_strategy_in_a_gpu_worker_uses_its_device_and_nccl():
    strategy = RayStrategy(num_workers=2, use_gpu=True)
    strategy.attach_worker(_context(device_index=1), rendezvous_store=None)
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.determine_ddp_device_ids() == [1]
    assert strategy.worker_process_group_backend() == "nccl"
    assert (strategy.global_rank, strategy.local_rank, strategy.world_size) == (1, 1, 2)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert strategy.cluster_environment.main_address == "10.0.0.1"


def test_fractional_gpus_on_one_device_fall_back_to_gloo():
    strategy = RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5})
    strategy.attach_worker(_context(device_index=0, shares_gpu=True), rendezvous_store=None)
    assert strategy.root_device == torch.device("cuda", 0)
    assert strategy.worker_process_group_backend() == "gloo"


def test_explicit_backend_wins():
    strategy = RayStrategy(num_workers=2, use_gpu=True, process_group_backend="gloo")
    strategy.attach_worker(_context(device_index=0), rendezvous_store=None)
    assert strategy.worker_process_group_backend() == "gloo"


def test_cpu_worker():
    strategy = RayStrategy(num_workers=2)
    assert strategy.root_device == torch.device("cpu")  # on the driver
    strategy.attach_worker(_context(device_index=None), rendezvous_store=None)
    assert strategy.root_device == torch.device("cpu")
    assert strategy.determine_ddp_device_ids() is None
    assert strategy.worker_process_group_backend() == "gloo"


def test_mixed_precision_built_on_a_driver_without_cuda_is_rebuilt_for_a_cuda_worker():
    # A driver without CUDA builds "16-mixed" for CUDA workers with a GradScaler that disabled itself; a worker
    # on CUDA must not train fp16 without loss scaling (the Trainer's and Fabric's plugins alike).
    import warnings

    from lightning.fabric.plugins.precision import MixedPrecision

    from ray_lightning.strategies.in_worker import mixed_precision_is_stale

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that CUDA is not available
        fp16 = MixedPrecision("16-mixed", "cuda")
    assert not fp16.scaler.is_enabled()
    assert mixed_precision_is_stale(fp16, "cuda"), "a disabled scaler on a CUDA worker"
    assert mixed_precision_is_stale(fp16, "cpu"), "built for another device"
    assert not mixed_precision_is_stale(MixedPrecision("bf16-mixed", "cuda"), "cuda"), "bf16 has no scaler"
    assert not mixed_precision_is_stale(MixedPrecision("bf16-mixed", "cpu"), "cpu")
