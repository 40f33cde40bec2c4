"""Data tools: Megatron indexed datasets of whole documents, synthetic tokens, length reports.

Kept import-light: ``megatron.core`` is imported only by the functions that read or
write indexed datasets.
"""

from megatron_zeppelin.data.indexed import IndexedDocuments, check_prefix, document_lengths, is_indexed_prefix
from megatron_zeppelin.data.tokens import synthetic_tokens

__all__ = ["IndexedDocuments", "check_prefix", "document_lengths", "is_indexed_prefix", "synthetic_tokens"]
