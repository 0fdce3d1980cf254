"""Model capture with no memory: Megatron-Core (or plain PyTorch) layers built on the meta device, one of each
distinct kind, recorded into operator graphs (:mod:`cfp_megatron.graph.opgraph`) and composed into the whole model.

Entry points: :func:`~cfp_megatron.model.capture.capture_job`, :func:`~cfp_megatron.model.capture.capture_model`,
:func:`~cfp_megatron.model.capture.capture_transformer_config`, :func:`~cfp_megatron.model.cache.capture_summary`
(cached), the hooks in :mod:`cfp_megatron.model.hooks` and :mod:`cfp_megatron.backends.deepspeed.hook`.
"""
