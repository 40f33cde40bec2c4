"""megatron-zeppelin: variable-length long-context data parallelism for Megatron-Core."""

__version__ = "0.1.0"
