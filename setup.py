from setuptools import find_packages, setup

setup(
    name='loopmoe_jax',
    version='0.1.0',
    description='Looped Mixture-of-Experts language models in JAX/Flax',
    packages=find_packages(include=['loopmoe_jax', 'loopmoe_jax.*', 'pallas_kernels',
                                    'pallas_kernels.*']),
    python_requires='>=3.10',
    install_requires=[
        'jax>=0.10', 'flax>=0.12', 'optax', 'orbax-checkpoint', 'grain', 'tensorstore',
        'ml-collections', 'absl-py', 'numpy', 'tokenizers', 'tensorboardX', 'scipy',
        'matplotlib', 'threadpoolctl',
    ],
    extras_require={'test': ['pytest', 'pytest-xdist', 'filelock']},
)
