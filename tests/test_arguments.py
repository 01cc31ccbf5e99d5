"""Bad arguments fail with a clear error before any worker is started."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from ray_lightning import ClusterResourceError, HorovodRayAccelerator, HorovodRayStrategy, RayAccelerator, RayStrategy
from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.launch.capacity import check_cluster_can_hold
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
        (
            {"device_ids": [0]},
            TypeError,
            r"RayStrategy sets device_ids itself \(each worker's device\); do not pass device_ids",
        ),
        ({"process_group": object()}, TypeError, "process groups exist only in the workers"),
        ({"device_mesh": "mesh"}, TypeError, "process groups exist only in the workers"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        RayStrategy(**kwargs)


_DDP = "takes its own arguments and those of Lightning's DDPStrategy and torch's DistributedDataParallel: "
NAN, INF = float("nan"), float("inf")
_FINITE = "must be a finite number of seconds"


@pytest.mark.parametrize(
    "make, error, message",
    [
        # Unknown keywords used to pass through **ddp_kwargs and fail in every worker.
        (
            lambda: RayStrategy(num_worker=2),
            TypeError,
            rf"'num_worker' \(did you mean 'num_workers'\?\)\. RayStrategy {_DDP}.*find_unused_parameters",
        ),
        (
            lambda: RayStrategy(placement_timeout=10),
            TypeError,
            r"'placement_timeout' \(did you mean 'placement_timeout_s'\?\)",
        ),
        (lambda: RayStrategy(find_unused_parameter=True), TypeError, r"did you mean 'find_unused_parameters'\?"),
        (
            lambda: RayAccelerator(num_workers=2, bogus_kwarg=1),
            TypeError,
            r"RayAccelerator got unknown keyword argument\(s\) 'bogus_kwarg'\. "
            r"RayAccelerator takes its own arguments and RayStrategy's: .*cpus_per_worker",
        ),
        (
            lambda: RayAccelerator(num_workers=2, num_cpus_per_worker=2),
            TypeError,
            "RayAccelerator calls num_cpus_per_worker cpus_per_worker: write cpus_per_worker=2",
        ),
        (
            lambda: HorovodRayAccelerator(bogus=1),
            TypeError,
            r"HorovodRayAccelerator got unknown keyword argument\(s\) 'bogus'\. HorovodRayAccelerator takes "
            r"its own arguments and HorovodRayStrategy's: batch_policy, cpus_per_worker, grow_check_interval_s, "
            r"init_hook, .*num_hosts",
        ),
        (lambda: HorovodRayAccelerator(num_worker=2), TypeError, r"'num_worker' \(did you mean 'num_workers'\?\)"),
        (
            lambda: RayStrategy(timeout=30),
            TypeError,
            r"timeout .*must be a datetime.timedelta, e.g. timeout=timedelta\(seconds=30\), got 30",
        ),
        (
            lambda: RayStrategy(process_group_backend="nccl"),
            ValueError,
            "process_group_backend='nccl' needs GPUs, but the workers reserve none .*"
            "Use process_group_backend='gloo'.*use_gpu=True",
        ),
        (
            lambda: RayAccelerator(num_workers=2, process_group_backend="nccl"),
            ValueError,
            "process_group_backend='nccl' needs GPUs",
        ),
        (
            lambda: RayStrategy(init_hook=lambda x: x),
            TypeError,
            r"init_hook is called with no arguments in every worker, but .* cannot be "
            r"\(missing a required argument: 'x'\)",
        ),
        (lambda: HorovodRayStrategy(init_hook=lambda x: x), TypeError, "init_hook is called with no arguments"),
        (lambda: RayStrategy(placement_timeout_s=NAN), ValueError, f"placement_timeout_s {_FINITE} .*got nan"),
        (lambda: RayStrategy(placement_timeout_s=INF), ValueError, f"placement_timeout_s {_FINITE} .*got inf"),
        (lambda: RayStrategy(worker_start_timeout_s=NAN), ValueError, f"worker_start_timeout_s {_FINITE}"),
        (lambda: RayStrategy(worker_start_timeout_s=INF), ValueError, f"worker_start_timeout_s {_FINITE}"),
        (lambda: RayStrategy(keep_workers_alive_s=NAN), ValueError, f"keep_workers_alive_s {_FINITE}"),
        # inf used to kill the thread that releases idle workers: they were never released.
        (lambda: RayStrategy(keep_workers_alive_s=INF), ValueError, f"keep_workers_alive_s {_FINITE} .*86400"),
        (
            lambda: HorovodRayStrategy(keep_workers_alive_s=1e300),
            ValueError,
            rf"keep_workers_alive_s {_FINITE} \(at most",
        ),
        (
            lambda: RayStrategy(worker_start_timeout_s="60"),
            TypeError,
            "worker_start_timeout_s must be a positive number of seconds, got '60'",
        ),
    ],
)
def test_bad_arguments_fail_before_anything_launches(ray_local, make, error, message):
    with pytest.raises(error, match=message):
        pl.Trainer(max_epochs=1, strategy=make(), logger=False).fit(BoringModel())
    assert not alive_worker_actors()


@pytest.mark.parametrize(
    "variable, value",
    [
        ("RAY_LIGHTNING_PLACEMENT_TIMEOUT_S", "abc"),
        ("RAY_LIGHTNING_PLACEMENT_TIMEOUT_S", "nan"),
        ("RAY_LIGHTNING_WORKER_START_TIMEOUT_S", "inf"),
        ("RAY_LIGHTNING_WORKER_START_TIMEOUT_S", "-1"),
        ("RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S", "1e400"),
        ("RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S", ""),
    ],
)
def test_unreadable_environment_variables_name_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable} \(environment variable\) must be a .*number of seconds"):
        RayStrategy(num_workers=2)
    monkeypatch.setenv(variable, "5")
    assert RayStrategy(num_workers=2).resources.num_workers == 2  # an explicit argument still wins over it
    assert RayStrategy(placement_timeout_s=7).placement_timeout_s == 7.0


def test_lightning_and_torch_arguments_still_pass():
    from datetime import timedelta

    strategy = RayStrategy(
        num_workers=2,
        find_unused_parameters=True,
        static_graph=False,
        bucket_cap_mb=10,
        process_group_backend="gloo",
        timeout=timedelta(seconds=60),
        init_hook=print,  # callable without arguments
    )
    assert strategy.ddp_timeout == timedelta(seconds=60)
    assert strategy.requested_process_group_backend == "gloo"
    assert RayStrategy(use_gpu=True, process_group_backend="nccl").requested_process_group_backend == "nccl"
    assert RayAccelerator(num_workers=2, cpus_per_worker=2, find_unused_parameters=True).make_strategy()


@pytest.mark.parametrize(
    "make",
    [
        lambda: RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}, process_group_backend="nccl"),
        lambda: RayAccelerator(num_workers=2, resources_per_worker={"GPU": 0.5}, process_group_backend="NCCL"),
        lambda: RayStrategy(
            num_workers=4, resources_per_worker={"GPU": 0.25}, process_group_backend="cpu:gloo,cuda:nccl"
        ),
    ],
)
def test_nccl_where_workers_share_a_gpu_is_refused_when_the_strategy_is_made(make):
    # No GPU or Ray needed: the refusal comes from the arguments alone, before anything launches.
    with pytest.raises(ValueError, match=r"each worker reserves 0\.\d+ of a GPU.*NCCL refuses two ranks on one device"):
        make()


def test_nccl_with_whole_gpus_or_one_worker_and_gloo_on_a_shared_gpu_are_accepted():
    assert RayStrategy(num_workers=2, use_gpu=True, process_group_backend="nccl").requested_process_group_backend
    alone = RayStrategy(num_workers=1, resources_per_worker={"GPU": 0.5}, process_group_backend="nccl")
    assert alone.requested_process_group_backend == "nccl"
    shared = RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}, process_group_backend="gloo")
    assert shared.requested_process_group_backend == "gloo"
    # Left out: chosen in the workers from where Ray put them (gloo where they share a GPU, test_environment.py).
    assert RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}).requested_process_group_backend is None


def test_a_checkpoint_path_that_exists_nowhere_fails_before_any_worker_starts(ray_local, tmp_path):
    trainer = pl.Trainer(max_epochs=1, strategy=RayStrategy(num_workers=2), logger=False)
    missing = str(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match=f"ckpt_path='{missing}' exists neither on this machine nor on any"):
        trainer.fit(BoringModel(), ckpt_path=missing)
    assert not alive_worker_actors()
    with pytest.raises(FileNotFoundError, match="ckpt_path='missing.ckpt'"):
        trainer.test(BoringModel(), ckpt_path="missing.ckpt")
    assert not alive_worker_actors()


@pytest.mark.parametrize(
    "ckpt_path", [None, "best", "last", "hpc", "registry", "registry:model:v1", "s3://bucket/x.ckpt"]
)
def test_lightnings_own_checkpoint_names_and_remote_urls_pass_through(ckpt_path):
    from ray_lightning.launch.payload import check_checkpoint_exists

    def fit(model, ckpt_path=None):
        pass

    check_checkpoint_exists(fit, (None,), {"ckpt_path": ckpt_path})  # left to Lightning in the workers
    check_checkpoint_exists(fit, (None, ckpt_path), {})


def test_devices_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match=r"devices=4 \(of the Trainer or Fabric\) is ignored: .* num_workers"):
        pl.Trainer(devices=4, strategy=RayStrategy(num_workers=2), logger=False)
    with pytest.warns(UserWarning, match=r"devices=\[0, 1\] \(of the Trainer or Fabric\) is ignored"):
        pl.Trainer(devices=[0, 1], accelerator=RayAccelerator(num_workers=2), logger=False)
    import warnings

    # The default ("auto") and 1 say nothing: Lightning turns "auto" into 1 before asking.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(strategy=RayStrategy(num_workers=2), logger=False)
        pl.Trainer(devices=1, strategy=RayStrategy(num_workers=2), logger=False)
        pl.Trainer(devices="auto", accelerator=RayAccelerator(num_workers=2), logger=False)
    assert not [w for w in caught if "devices" in str(w.message)]


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
        # Memory, in bytes for Ray, is shown in human units when the request asks for it.
        (
            (1, 1, False, {"memory": 2e9}),
            r"one worker \{CPU: 1, memory: 1.9 GiB\}; the nodes have: \{CPU: 4, memory: 953.7 MiB\}; \{CPU: 2, ",
        ),
        ((2, 1, False, {"memory": 1e9}), r"= 1.9 GiB memory in all, but the whole Ray cluster has 953.7 MiB memory"),
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
        (
            {"num_workers": 1, "resources_per_worker": {"CPU": 1, "memory": 1e15}},
            r"No single node can hold one worker \{CPU: 1, memory: 909.5 TiB\}; "
            r"the nodes have: \{CPU: 8, .*memory: [\d.]+ [GM]iB\}",
        ),
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


def test_arguments_ray_strategy_decides_may_be_given_as_none():
    # LightningCLI passes every DDP argument it finds with its default: process_group=None, device_mesh=None.
    strategy = RayStrategy(num_workers=2, process_group=None, device_mesh=None, static_graph=True)
    assert strategy._ddp_kwargs == {"static_graph": True}


def test_the_signature_lists_what_is_passed_on_and_passes_on_only_what_was_given():
    import inspect

    from ray_lightning import RayFSDP1Strategy

    parameters = inspect.signature(RayStrategy).parameters
    # What LightningCLI offers: DDPStrategy's and DistributedDataParallel's arguments, keyword-only...
    for name in ("find_unused_parameters", "static_graph", "ddp_comm_hook", "timeout"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert parameters["find_unused_parameters"].default is False
    # ...less those RayStrategy decides.
    assert not {"process_group", "module", "device_ids", "cluster_environment", "start_method"} & set(parameters)
    assert inspect.signature(RayFSDP1Strategy).parameters["state_dict_type"].default == "full"
    # Defaults of passed-on arguments stay Lightning's and torch's to apply: only the given ones travel.
    assert RayStrategy(num_workers=2, bucket_cap_mb=10)._ddp_kwargs == {"bucket_cap_mb": 10}
    with pytest.raises(TypeError, match=r"'find_unused_parameter' \(did you mean 'find_unused_parameters'\?\)"):
        RayStrategy(find_unused_parameter=True)


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


def test_progress_timeout_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv("RAY_LIGHTNING_PROGRESS_TIMEOUT_S", raising=False)
    assert RayStrategy().progress_timeout_s == 900.0
    assert RayStrategy(progress_timeout_s=None).progress_timeout_s is None  # None switches the watchdog off
    monkeypatch.setenv("RAY_LIGHTNING_PROGRESS_TIMEOUT_S", "120")
    assert RayStrategy().progress_timeout_s == 120.0
    # The default given explicitly (as LightningCLI passes every default) is the default: the variable applies.
    assert RayStrategy(progress_timeout_s=900.0).progress_timeout_s == 120.0
    assert RayStrategy(progress_timeout_s=300).progress_timeout_s == 300.0  # any other value wins
    monkeypatch.setenv("RAY_LIGHTNING_PROGRESS_TIMEOUT_S", "none")
    assert RayAccelerator(num_workers=2).make_strategy().progress_timeout_s is None
    monkeypatch.setenv("RAY_LIGHTNING_PROGRESS_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RAY_LIGHTNING_PROGRESS_TIMEOUT_S='soon'"):
        RayStrategy()
    with pytest.raises(ValueError, match="progress_timeout_s must be a positive number"):
        RayStrategy(progress_timeout_s=0)
