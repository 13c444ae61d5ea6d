"""Multi-turn chat and agent benchmarks: conversations (``benchmarks.workload``) over a shared
system prompt whose later turns find their earlier ones in the cache.

``load`` sends them to an OpenAI-compatible endpoint and times each request (``request_record``,
``summary``); ``sweep`` runs offload on against off over loads and HBM regimes
(``sweep_report``), ``presets`` the long-context and agent presets.
"""
