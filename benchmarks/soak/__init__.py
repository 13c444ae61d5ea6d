"""The daemon's soak: churn against one ``kvstore serve`` for minutes while its memory and pool
use are sampled (``python -m benchmarks.soak.daemon``); ``verdict`` judges whether they drifted.
"""
