"""Bad arguments fail with a clear error before any worker is started."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from ray_lightning import ClusterResourceError, RayAccelerator, RayStrategy
from ray_lightning.config import resolve_worker_resources
from ray_lightning.launch.placement import check_cluster_can_hold
from tests.conftest import alive_worker_actors
from tests.models import BoringModel


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_workers": 0}, ValueError, "num_workers must be >= 1"),
        ({"num_workers": -2}, ValueError, "num_workers must be >= 1"),
        ({"num_workers": "2"}, TypeError, "num_workers must be an int"),
        ({"num_workers": 1.5}, TypeError, "num_workers must be an int"),
        ({"num_workers": True}, TypeError, "num_workers must be an int"),
        ({"num_cpus_per_worker": -1}, ValueError, "num_cpus_per_worker must be >= 0"),
        ({"num_cpus_per_worker": 0}, ValueError, "must reserve some resource"),
        ({"num_cpus_per_worker": "one"}, TypeError, "num_cpus_per_worker must be a non-negative number"),
        ({"use_gpu": "yes"}, TypeError, "use_gpu must be True or False"),
        ({"resources_per_worker": {"gpu": 1}}, ValueError, "Ray calls this resource 'GPU'"),
        ({"resources_per_worker": {"num_cpus": 2}}, ValueError, "Ray calls this resource 'CPU'"),
        ({"resources_per_worker": {"Gpus": 1}}, ValueError, "Ray calls this resource 'GPU'"),
        ({"resources_per_worker": {"CPU": -1}}, ValueError, r"resources_per_worker\['CPU'\] must be >= 0"),
        ({"resources_per_worker": {"GPU": 1.5}}, ValueError, "fraction of one GPU or whole GPUs"),
        ({"resources_per_worker": [("CPU", 1)]}, TypeError, "resources_per_worker must be a dict"),
        ({"init_hook": "not callable"}, TypeError, "init_hook must be a function"),
        ({"placement_timeout_s": 0}, ValueError, "placement_timeout_s must be a positive number"),
        ({"cluster_environment": object()}, TypeError, "RayStrategy sets cluster_environment itself"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        RayStrategy(**kwargs)


def test_bad_accelerator_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        RayAccelerator(num_workers=0)
    with pytest.raises(ValueError, match="num_cpus_per_worker must be >= 0"):
        RayAccelerator(num_workers=2, cpus_per_worker=-1)


def test_resources_per_worker_wins_over_plain_arguments():
    res = resolve_worker_resources(2, 1, False, {"CPU": 3, "GPU": 0.5, "custom": 2})
    assert (res.cpus, res.gpus, dict(res.custom), res.use_gpu) == (3.0, 0.5, {"custom": 2.0}, True)
    assert res.bundle() == {"CPU": 3.0, "GPU": 0.5, "custom": 2.0}
    assert res.actor_options() == {"num_cpus": 3.0, "num_gpus": 0.5, "resources": {"custom": 2.0}}
    no_gpu = resolve_worker_resources(2, 1, True, {"GPU": 0})
    assert not no_gpu.use_gpu and "GPU" not in no_gpu.bundle()
    assert resolve_worker_resources(2, 1, True).bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert resolve_worker_resources(1, 1, False, {"GPU": 2}).gpus == 2.0


_NODES = [{"CPU": 4.0, "memory": 1e9, "node:10.0.0.1": 1.0}, {"CPU": 2.0, "custom_accel": 2.0}]


@pytest.mark.parametrize(
    "request_args, message",
    [
        ((2, 1, True, None), "the Ray cluster has no GPUs"),
        ((2, 1, False, {"custom_acel": 1}), "Did you mean 'custom_accel'"),
        ((2, 1, False, {"tpu_v9": 1}), "which no node in the Ray cluster has"),
        ((1, 5, False, None), "No single node can hold one worker"),
        ((4, 2, False, None), "8 CPU in all, but the whole Ray cluster has 6 CPU"),
    ],
)
def test_cluster_check_names_request_and_cluster(request_args, message):
    with pytest.raises(ClusterResourceError, match=message):
        check_cluster_can_hold(resolve_worker_resources(*request_args), _NODES)


def test_cluster_check_accepts_what_fits():
    check_cluster_can_hold(resolve_worker_resources(3, 2, False, None), _NODES)
    check_cluster_can_hold(resolve_worker_resources(2, 1, False, {"custom_accel": 1}), _NODES)


@pytest.mark.parametrize(
    "strategy_kwargs, message",
    [
        ({"num_workers": 2, "use_gpu": True}, "the Ray cluster has no GPUs"),
        ({"num_workers": 2, "resources_per_worker": {"custom_acel": 1}}, "Did you mean 'custom_accel'"),
        ({"num_workers": 20}, "the whole Ray cluster has 8 CPU"),
    ],
)
def test_impossible_requests_fail_before_any_actor_starts(ray_local, strategy_kwargs, message):
    trainer = pl.Trainer(max_epochs=1, strategy=RayStrategy(**strategy_kwargs), logger=False)
    with pytest.raises(ClusterResourceError, match=message):
        trainer.fit(BoringModel())
    assert not alive_worker_actors()


def test_busy_cluster_fails_within_the_placement_timeout(ray_local):
    # Another job holds most CPUs: the request fits the cluster but not what is free now.
    blocker = placement_group([{"CPU": ray.cluster_resources()["CPU"] - 1}])
    ray.get(blocker.ready(), timeout=60)
    try:
        strategy = RayStrategy(num_workers=2, placement_timeout_s=2)
        trainer = pl.Trainer(max_epochs=1, strategy=strategy, logger=False)
        with pytest.raises(
            ClusterResourceError, match=r"Could not reserve 2 worker\(s\) x \{1 CPU\} within 2 s"
        ) as info:
            trainer.fit(BoringModel())
        assert "free now" in str(info.value) and "placement_timeout_s" in str(info.value)
        assert not alive_worker_actors()
    finally:
        remove_placement_group(blocker)


def test_worker_error_survives_pickling_and_copying():
    import copy
    import pickle

    from ray_lightning import RayWorkerError

    error = RayWorkerError("ray_lightning worker rank 3 raised", rank=3)
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert isinstance(clone, RayWorkerError)
        assert (str(clone), clone.rank) == (str(error), 3)


def test_per_worker_resources_read_back_as_in_ray_lightning_0_3():
    from ray_lightning import HorovodRayStrategy

    strategy = RayStrategy(num_workers=2, num_cpus_per_worker=2, resources_per_worker={"GPU": 0.5})
    assert (strategy.num_cpus_per_worker, strategy.num_gpus_per_worker) == (2.0, 0.5)
    assert RayStrategy(num_workers=1, use_gpu=True).num_gpus_per_worker == 1.0
    assert RayAccelerator(num_workers=2, cpus_per_worker=3).make_strategy().num_cpus_per_worker == 3.0
    horovod = HorovodRayStrategy(num_workers=2, resources_per_worker={"CPU": 4})
    assert (horovod.num_cpus_per_worker, horovod.num_gpus_per_worker) == (4.0, 0.0)
    with pytest.raises(AttributeError):
        strategy.num_cpus_per_worker = 8  # read-only: the resources are fixed at construction
