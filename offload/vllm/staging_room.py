"""How many staging slots a vLLM worker gets, and how many of them its saves may hold.

Loads and saves go through slots of one staging buffer: the CPU path's shared memory, and on a
GPU, by default, whole-block slots of vLLM's own device memory, so the daemon moves whole blocks
instead of vLLM's 32 KiB pieces. The room follows the instance's ``kv_role`` (a consumer only
loads, a producer only saves): ``load_blocks`` slots for loads (the scheduler never has more
blocks loading) and ``save_blocks`` for saves. ``device_staging_blocks`` unset: that room in
device memory where CuPy can launch the packing and it comes to at most
``DEFAULT_MAX_DEVICE_BYTES``, else none (noted in the log, with why); 0: none (the daemon reads
and writes vLLM's pieces in place); N: N slots, ``load_blocks`` of them for loads and the rest
for saves. A save that finds the saves' room full waits for it (``offload.core.saver``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from offload.external.block_mover import BlockMover
from offload.external.device_staging import PACK_CTAS
from offload.external.kv_tensors import make_mover
from offload.vllm.settings import KEY, ConnectorSettings, SettingsError

# Device staging by default takes at most this much of vLLM's GPU: 128 Qwen3-4B blocks are 302 MB.
DEFAULT_MAX_DEVICE_BYTES = 1 << 30


@dataclass(frozen=True)
class StagingRoom:
    """``num_slots``: the CPU staging buffer's; ``device_slots``: device staging's (0: none);
    ``save_slots``: of the buffer in use, the slots saves may hold at once; ``note``: why
    device staging is off by default here, for the log (None: it is not, or was asked off)."""

    num_slots: int
    device_slots: int
    save_slots: int
    note: str | None = None

    @classmethod
    def of(cls, settings: ConnectorSettings, loads: bool, saves: bool, on_cuda: bool,
           block_bytes: int, packing_unavailable: Callable[[], str | None]) -> StagingRoom:
        """The room for an instance that ``loads`` and/or ``saves`` blocks of ``block_bytes``,
        its KV on a GPU or not; ``packing_unavailable`` says why CuPy cannot launch the
        packing (None: it can). SettingsError for a device staging too small for ``load_blocks``."""
        load_room = settings.load_blocks * loads
        save_room = settings.save_blocks * saves
        num_slots = load_room + save_room
        asked = settings.device_staging_blocks
        if not on_cuda or asked == 0:
            return cls(num_slots, 0, save_room)
        if asked is not None:
            if asked < load_room + saves:
                raise SettingsError(
                    f"{KEY}.device_staging_blocks {asked} leaves "
                    f"{'no slot for saves' if asked >= load_room else 'too few for loads'}: "
                    f"loads take load_blocks ({load_room}) of them, saves the rest; give at "
                    f"least {load_room + saves}, or 0 for none")
            return cls(num_slots, asked, asked - load_room)
        reason = packing_unavailable()
        if reason is not None:
            reason = (f"the packing's modules do not import ({reason}); the cuda13 or cuda12 "
                      f"extra brings them")
        elif num_slots * block_bytes > DEFAULT_MAX_DEVICE_BYTES:
            reason = (f"load_blocks + save_blocks = {num_slots} blocks of {block_bytes} bytes "
                      f"would take more than {DEFAULT_MAX_DEVICE_BYTES >> 20} MiB of the GPU; "
                      f"set device_staging_blocks to have them anyway")
        if reason is not None:
            return cls(num_slots, 0, save_room,
                       f"kvstore connector: no device staging: {reason}. The daemon moves "
                       f"vLLM's pieces in place, a fraction of the bus for small pieces")
        return cls(num_slots, num_slots, save_room)

    def mover(self, names: Sequence[str], tensors: Sequence[Any], num_blocks: int, meta: dict,
              pack_ctas: int = PACK_CTAS) -> BlockMover:
        """The block mover of these KV tensors with this room (``make_mover``)."""
        return make_mover(names, tensors, num_blocks, self.num_slots, meta,
                          device_staging_slots=self.device_slots, pack_ctas=pack_ctas,
                          save_slots=self.save_slots)
