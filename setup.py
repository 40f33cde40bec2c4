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
        # psutil: Megatron-Core's torch_dist checkpoint writer (--ckpt-format torch_dist, the default)
        # imports it when it saves; tests/megatron saves through it.
        "test": ["pytest>=8", "hypothesis>=6.100", "psutil>=5.9"],
        "plot": ["matplotlib>=3.7"],
        # What Megatron-LM's pretrain_gpt.py (core_v0.16.1 / core_v0.19.0) imports at run time
        # beyond torch and megatron-core, none pinned: six, regex, pydantic and pyyaml by its
        # training and tokenizer code, psutil by the torch_dist writer, pybind11 to build the
        # dataset helpers it compiles at start-up, triton (a CUDA torch already brings it) by
        # its fused kernels' imports.  docs/megatron-lm.md, step 1.
        "megatron": ["six", "regex", "pydantic>=2", "pyyaml>=6.0", "psutil>=5.9", "pybind11>=2.10",
                     "triton; platform_system == 'Linux'"],
    },
    entry_points={"console_scripts": [
        "zeppelin-sim=megatron_zeppelin.sim.__main__:main",
        "zeppelin-train=megatron_zeppelin.train.__main__:main",
    ]},
)
