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
    install_requires=[
        "torch>=2.1",
        "pytorch-lightning>=2.6,<2.7",
        "ray[default,tune]>=2.60,<2.61",
    ],
    extras_require={
        # Horovod 0.28.1 must be built with C++17 to compile against torch >= 2.1 (README:
        # "Installing Horovod"); where it is already installed this extra only checks the version.
        "horovod": ["horovod>=0.28.1"],
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "scikit-learn",
            "tensorboard",
            "ipykernel",
            "nbclient",
            "nbformat",
            "ruff",
            # The Hydra app example (examples/hydra_app.py).
            "hydra-core>=1.3",
            # LightningCLI (examples/cli_digits.py): pytorch_lightning.cli needs jsonargparse[signatures]>=4.27.7;
            # Lightning's own "extra" pins >=4.39, the range it is tested with.
            "jsonargparse[signatures]>=4.39",
            # The loggers of tests/test_loggers.py: W&B offline, MLflow with a file store, Comet offline.
            "wandb>=0.31",
            "mlflow-skinny>=3.17",
            "comet_ml>=3.58",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
