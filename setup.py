"""megatron-zeppelin: variable-length long-context data parallelism for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-zeppelin",
    version="0.1.0",
    description="Hierarchical sequence partitioning, attention engine, NIC routing and token "
                "remapping for Megatron-Core training on variable-length long-context data",
    packages=find_packages(include=["megatron_zeppelin", "megatron_zeppelin.*"]),
    python_requires=">=3.10",
    # Ranges, never pins: a user's CUDA build of torch must not be replaced.
    install_requires=[
        "numpy>=1.24",
        "pyyaml>=6.0",
        "highspy>=1.7",
        # The replay's event loop (sim/event_loop.py) is compiled with it.
        "numba>=0.60",
        "torch>=2.3",
        "megatron-core>=0.16.1,<0.20",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": [
        "zeppelin-sim=megatron_zeppelin.sim.__main__:main",
        "zeppelin-train=megatron_zeppelin.train.__main__:main",
    ]},
)
