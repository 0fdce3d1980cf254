"""Training data: tokenizers, the preprocessing tool, synthetic and indexed samples, and the micro-batch stream.

The runtime calls :func:`build_micro_batches`; ``python -m cfp_megatron.data.preprocess`` turns a corpus into the
``.bin``/``.idx`` files that ``data.kind=indexed`` reads.
"""

from cfp_megatron.data.batches import build_micro_batches, build_samples, micro_batch_sample_ids, num_microbatches
from cfp_megatron.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "build_micro_batches",
    "build_samples",
    "build_tokenizer",
    "micro_batch_sample_ids",
    "num_microbatches",
]
