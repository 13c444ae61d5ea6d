"""Benchmarks of the kvstore connector inside vLLM: its GPU data path against raw copies
(``transfer``), its cost to a prefill step (``step``) and the TTFT it saves in a second vLLM
process (``ttft``); ``store_process`` starts the ``kvstore serve`` they talk to.
"""
