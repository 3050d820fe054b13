from setuptools import find_packages, setup

setup(
    name='loopmoe_jax',
    version='0.1.0',
    description='Looped Mixture-of-Experts language models in JAX/Flax',
    packages=find_packages(include=['loopmoe_jax', 'loopmoe_jax.*', 'pallas_kernels',
                                    'pallas_kernels.*']) + ['loopmoe_jax.configs'],
    # the configs the package loads itself (the main job's, the replications'), shipped inside
    # it so an installed package finds them (loopmoe_jax.config_file)
    package_dir={'loopmoe_jax.configs': 'configs'},
    python_requires='>=3.10',
    install_requires=[
        'jax>=0.10', 'flax>=0.12', 'optax', 'orbax-checkpoint', 'grain', 'tensorstore',
        'ml-collections', 'absl-py', 'numpy', 'tokenizers', 'tensorboardX', 'scipy',
        'matplotlib', 'threadpoolctl',
        # scripts/prepare_data.py: parquet and Hugging Face arrow inputs, .zst inputs
        'pyarrow>=14', 'zstandard>=0.22',
    ],
    # the offline LM-harness task pack (analysis/lm_harness.py) ships its rows inside the package
    package_data={'loopmoe_jax.lm_tasks': ['*.yaml', '*.jsonl', 'build.json']},
    # lm_eval: the LM Evaluation Harness adapter (scripts/lm_eval.py), optional; accelerate for
    # the harness's own `hf` backend on an hf-looped export (export/hf_looped.py)
    # tpu / cuda: the accelerators' own compilers for compiling on a CPU-only machine
    # (scripts/dry_run.py --target, scripts/fit.py; loopmoe_jax/targets.py). jax's extras pin
    # libtpu and the CUDA plugin to the installed jax; 'cuda12-local' is the plugin without the
    # NVIDIA runtime wheels (several GB), of which compiling needs ptxas / nvJitLink only.
    # gcs: gs:// paths (loopmoe_jax/storage.py: gcsfs, the library Orbax's paths use;
    # google-cloud-storage for TensorBoard's gs:// writer). The tests run gs:// against a local
    # GCS-protocol server (gcp-storage-emulator).
    # wandb: train.wandb's Weights & Biases logger (tested offline).
    extras_require={'test': ['pytest', 'pytest-xdist', 'pytest-timeout', 'filelock', 'gcsfs', 'google-cloud-storage',
                             'gcp-storage-emulator', 'wandb'],
                    'gcs': ['gcsfs', 'google-cloud-storage'],
                    'wandb': ['wandb'],
                    'lm_eval': ['lm-eval==0.4.13', 'accelerate==1.16.0'],
                    'tpu': ['jax[tpu]'],
                    'cuda': ['jax[cuda12-local]', 'nvidia-cuda-nvcc-cu12', 'nvidia-nvjitlink-cu12']},
)
