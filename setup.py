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
    ],
    extras_require={'test': ['pytest', 'pytest-xdist', 'filelock']},
)
