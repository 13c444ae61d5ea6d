"""Whether a hit is worth loading: the restore policy, plugged into the ``Restorer``.

kvengine weighs the load against recomputing (``offload.restore_policy``, fed with the load
times this reports); vLLM's scheduler has already decided when it planned the load, so its
worker restores ``Always``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from offload.core.restore_job import RestoreJob


class RestoreDecider(ABC):
    """Contract: ``worth_loading`` is asked once per hit, when it is leased (False: the lease is
    released and the restore ends DECLINED). ``load_started`` and ``load_ended`` bracket every
    load sent, exactly once each, whatever its end (``num_landed`` 0 for a load given up)."""

    @abstractmethod
    def worth_loading(self, job: RestoreJob) -> bool: ...

    @abstractmethod
    def load_started(self, job: RestoreJob) -> None: ...

    @abstractmethod
    def load_ended(self, job: RestoreJob, started_at: float, ended_at: float,
                   num_landed: int) -> None: ...


class Always(RestoreDecider):
    """Every hit is loaded (the caller decided before asking)."""

    def worth_loading(self, job: RestoreJob) -> bool:
        return True

    def load_started(self, job: RestoreJob) -> None:
        pass  # nothing is learnt from the loads

    def load_ended(self, job: RestoreJob, started_at: float, ended_at: float,
                   num_landed: int) -> None:
        pass
