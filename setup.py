from setuptools import find_packages, setup

setup(
    name="ray_lightning",
    version="0.6.0",
    description="Distributed PyTorch Lightning training on Ray: DDP between Ray actors, from a laptop to a cluster.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ray_lightning", "ray_lightning.*"]),
    python_requires=">=3.10",
    # torch is not pinned to a build here: install the CPU or CUDA build you need first (dev.py does).
    # Lightning comes as two packages, `lightning` (lightning.pytorch) and `pytorch-lightning`
    # (pytorch_lightning); ray_lightning works with either or both, so it requires neither and never
    # replaces the one a user has: the extras below install one. Lower bounds only: the tested window
    # is Lightning 2.4-2.6, Ray 2.50-2.60, torch 2.4-2.15 (docs/versions.md; RayFSDPStrategy and
    # RayModelParallelStrategy need torch 2.6), and a newer release is not downgraded by installing this package.
    install_requires=[
        "torch>=2.4",
        "ray[default,tune]>=2.50",
    ],
    extras_require={
        "lightning": ["lightning>=2.4"],
        "pytorch-lightning": ["pytorch-lightning>=2.4"],
        # Horovod 0.28.1 must be built with C++17 to compile against torch >= 2.1 (docs/horovod.md:
        # "Installing Horovod"); where it is already installed this extra only checks the version.
        "horovod": ["horovod>=0.28.1"],
        # RayDeepSpeedStrategy (Lightning needs DeepSpeed >= 0.16 with torch >= 2.6). Where torch must not be
        # replaced (a CPU build), install it with DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed.
        "deepspeed": ["deepspeed>=0.16"],
        # storage_path="s3://..." (fsspec's S3 filesystem; gcsfs and adlfs serve gs:// and az:// the same way).
        "s3": ["s3fs"],
        # The documentation site (`python3 dev.py docs`; mkdocs.yml says why MkDocs).
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        "test": [
            # Both Lightning packages: the suite runs with both installed, the normal case.
            "lightning>=2.4",
            "pytorch-lightning>=2.4",
            "pytest>=8",
            "pytest-timeout",
            # The whole suite runs on two pytest processes, one test file each at a time (dev.py).
            "pytest-xdist>=3.6",
            "scikit-learn",
            # The benchmark reports' figures (benchmarks/plots.py).
            "matplotlib",
            "tensorboard",
            "ipykernel",
            "nbclient",
            "nbformat",
            # Pinned to one minor release: a new one can add lint findings, and tests/test_lint.py would fail on them.
            "ruff~=0.17.6",
            # The Hydra app example (examples/hydra_app.py).
            "hydra-core>=1.3",
            # LightningCLI (examples/cli_digits.py): pytorch_lightning.cli needs jsonargparse[signatures]>=4.27.7;
            # Lightning's own "extra" pins >=4.39, the range it is tested with.
            "jsonargparse[signatures]>=4.39",
            # The loggers of tests/test_loggers.py: W&B offline, MLflow with a file store, Comet offline.
            "wandb>=0.31",
            "mlflow-skinny>=3.17",
            "comet_ml>=3.58",
            # storage_path's tests: a real S3-compatible server (moto's server mode) and fsspec's S3 filesystem.
            "moto[server]>=5.1",
            "s3fs>=2024.6",
            # tests/test_docs.py builds the site (the docs extra).
            "mkdocs>=1.6,<2",
            "mkdocs-material>=9.5",
            "mkdocstrings[python]>=0.26",
            # Not here: LitGPT (tests/test_fabric_litgpt.py), whose pins would downgrade jsonargparse; dev.py's
            # ensure_litgpt installs it with --no-deps.
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
