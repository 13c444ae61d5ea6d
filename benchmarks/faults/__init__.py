"""The soak under faults: a daemon and an engine under multi-turn load while a seeded schedule
stops, kills and restarts them, every answer checked against a reference engine.

``soak`` runs it (``python -m benchmarks.faults.soak``); ``schedule`` says which fault strikes
when, ``injector`` applies them to the ``stack`` (the processes) while ``chat_load`` sends the
requests; ``answer_scoring`` tells numerics from wrong KV and ``verdict`` judges the run.
"""
